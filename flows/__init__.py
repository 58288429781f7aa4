"""Prefect flows and deployments: thin recipes over `crucible` and the registry client.

- `flows.run_flow.train_run` - the `train-run` flow: one run, registered, reported, resumable.
- `flows.sweep_flow.failure_sweep` - the `failure-sweep` flow over a `crucible.grid.spec.SweepSpec`.
- `flows.gpu` - per-host GPU slots (Prefect global concurrency limit `gpu:<hostname>`).
- `flows.deploy` - both deployments, served (`crucible deploy`) or on a work pool.
- `flows.embedded` - the no-server stack behind `crucible sweep`.

Nothing is imported here, so `import flows.cli` (done by every `crucible` command) stays cheap.
"""
