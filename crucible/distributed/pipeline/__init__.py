"""The pipeline mode: every stage-replica its own process, a ZeroMQ link at every boundary.

`launch.launch_pipeline` starts and supervises the R x S processes (`stage`), whose boundary
messages travel over `links`; the outer round is the replica mode's (`crucible.distributed.sync`)
holding one stage. A stage process's parts: `schedule` (an inner step's micro-batches),
`verdicts` (its first stage's clip-or-retry verdict), `deaths` (the unplanned deaths it has heard
of and the step plan they make), `stage_model` (its model, the run's checks, its folder).
"""
