"""Prefect flows and deployments: thin recipes over `crucible` and the registry client.

- `flows.run_flow.train_run` - the `train-run` flow: one run, registered, reported, resumable.
- `flows.sweep_flow.failure_sweep` - the `failure-sweep` flow over a `crucible.grid.spec.SweepSpec`.
- `flows.gpu` - per-host GPU slots (Prefect global concurrency limit `gpu:<hostname>`).
- `flows.deploy` - both deployments, served (`crucible deploy`) or on a work pool.

The flows import the library (`crucible`, the registry client `crucible.registry` included),
never the registry service (`api`, `db`), the dashboards or the command line: the embedded
stack behind `crucible sweep` (`cli.embedded`) and the flows' commands (`cli.flows`) live in
`cli/`, which composes them (tests/unit/test_imports.py checks it). Nothing is imported here,
so importing a flow module loads only what it needs.
"""
