"""The grid of a sweep, in words every layer shares: the names defined once (`names`: arms,
strategies, decodes, statuses, the arms' labels and palette), the one key of a cell
(`key.CellKey`: strategy None is the p = 0 baseline), the one spec of a failure sweep or a study
(`spec.SweepSpec`: blocks, seeds, annotations, identity), its cells (`cells`: ids, labels, run
order, the shared p = 0 baselines) and the rule for tags and notes (`tags`).

No torch: the API, the dashboards, the flows and the command line import it (a test checks).
"""
