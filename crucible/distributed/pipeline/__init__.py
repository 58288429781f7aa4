"""The pipeline mode: every stage-replica its own process, a ZeroMQ link at every boundary.

`launch.launch_pipeline` starts and supervises the R x S processes (`stage`), whose boundary
messages travel over `links`; the outer round is the replica mode's (`crucible.distributed.sync`)
holding one stage.
"""
