"""Distributed mode: each replica is its own OS process (torch.distributed.elastic), and the
replicas exchange SparseLoCo contributions only through the object store.

`launch.launch(config, out_dir=...)` starts one elastic agent per replica and merges their
outputs; `worker` is the per-process entry; `sync.ReplicaSync` is the simulator's outer round
with a deadline (`sparseloco.round_timeout_s`); `journal` the process records of real faults and
lives (`process.jsonl`); `liveness` the heartbeat leases; `injection` the test fault injection
(armed only by an environment variable); `cli.launch_main(argv)` is the command line. The simulator
(`crucible.train`) is the reference it is tested against: same config and seed, same global
weights. Nothing is imported here, so that `python -m crucible.distributed.worker` loads once.
"""
