"""The registry client: what a run reports to the REST registry and how nothing is lost on the way.

`reporting` (the reporter a run's events feed), `spool` and `spool_files` (the on-disk queue of
records a run still owes), `replay` (sending them later, exactly once), `finish_file` (the run's
final state, written before the registry hears of it), `client` (the HTTP client), `settings`
(the client settings that the flows, `crucible run --api` and the API's CLI share), `connect`
(a client, a run's callback and its dashboard URLs from those settings), `identity` (a run's
config fingerprint and code version: what makes two runs the same run) and `standalone` (a run
outside any flow, reported: `crucible run --api`). The simulator never imports this package;
the flows and the command line wire a run to it. Importing it loads no torch
(tests/unit/test_imports.py).
"""
