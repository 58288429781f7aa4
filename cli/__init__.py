"""The `crucible` command line, outside the library: `cli.main` (the root app: presets, run,
evaluate, bypass-damage, launch, and the registry's, flows' and dashboards' own commands),
`cli.study` (`crucible study ...`), `cli.launch` (`crucible launch`, a distributed run),
`cli.flows` (`crucible sweep`, `deploy`, `reconcile`) and `cli.embedded` (the no-server stack
behind `crucible sweep`: the flows, the registry service and the offline report together).

The library (`crucible/`) never imports this package, `flows`, `api` or `dashboards`
(tests/unit/test_imports.py checks it); this is where they meet.
"""
