"""What runs cost: a deployment as data (`deployment`: infra/deployments/*.toml, checked field
by field), the cost of one run on it (`cost`: each round replayed from the run's fault plan,
its wall-clock, accelerator-hours and money) and decisions by cost over a sweep (`cost_sweep`:
to the baseline's loss, on a budget, the cheapest strategy per p).

No torch: the API, the dashboards and `crucible cost` import it (a test checks).
"""
