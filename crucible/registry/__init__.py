"""The registry client: what a run reports to the REST registry and how nothing is lost on the way.

`reporting` (the reporter a run's events feed), `spool` and `spool_files` (the on-disk queue of
records a run still owes), `replay` (sending them later, exactly once), `finish_file` (the run's
final state, written before the registry hears of it), `client` (the HTTP client) and
`settings` (the client settings that the flows and the API's CLI share). The simulator never
imports this package; the flows and the command line wire a run to it.
"""
