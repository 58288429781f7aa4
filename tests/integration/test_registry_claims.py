"""One pairing rule and one set of claims: the registry stores the rule's baseline on every run,
and `GET /sweeps/{ref}/claims` on the committed study data says what docs/RESULTS-d64.md says."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from crucible import stats, study
from crucible.grid.cells import expand_cells
from tests.integration.test_registry_api import _config

pytestmark = pytest.mark.integration

V1 = "/api/v1"
ROOT = Path(__file__).resolve().parents[2]


def _create(registry, sweep_id, config):
    response = registry.post(f"{V1}/runs", json={"sweep_id": sweep_id, "config": config})
    assert response.status_code == 201, response.text
    return response.json()


def _finish(registry, run_id, status, loss=None):
    response = registry.patch(f"{V1}/runs/{run_id}",
                              json={"status": status, "final_val_loss": loss})
    assert response.status_code == 200, response.text


def _baseline_of(registry, run_id):
    return registry.get(f"{V1}/runs/{run_id}").json()["baseline_run_id"]


def test_the_stored_baseline_follows_the_one_rule(registry):
    sweep = registry.post(f"{V1}/sweeps", json={"name": "pairing"}).json()
    faulty = _create(registry, sweep["id"], _config(p=0.2, seed=1))
    first = _create(registry, sweep["id"], _config(p=0.0, seed=1))
    second = _create(registry, sweep["id"], _config(p=0.0, seed=1))
    other_seed = _create(registry, sweep["id"], _config(p=0.0, seed=2))
    # none usable yet: the first unfinished one, so the run page says where it will come from
    assert _baseline_of(registry, faulty["id"]) == first["id"]
    _finish(registry, faulty["id"], "completed", 2.2)
    _finish(registry, second["id"], "completed", 2.0)     # the first usable one now
    assert _baseline_of(registry, faulty["id"]) == second["id"]
    _finish(registry, first["id"], "completed", 1.0)      # earlier in creation order: it wins
    assert _baseline_of(registry, faulty["id"]) == first["id"]
    _finish(registry, first["id"], "failed")              # no longer usable: back to the second
    assert _baseline_of(registry, faulty["id"]) == second["id"]
    _finish(registry, other_seed["id"], "completed", 9.0)  # another seed's group: no effect
    assert _baseline_of(registry, faulty["id"]) == second["id"]
    # the robustness numbers use the same baseline the run carries
    [item] = [i for i in registry.get(f"{V1}/sweeps/{sweep['id']}/robustness").json()["items"]
              if i["p"] == 0.2]
    assert item["mean_pct"] == pytest.approx(100 * (2.2 - 2.0) / 2.0)
    [base_item] = [i for i in registry.get(f"{V1}/sweeps/{sweep['id']}/robustness")
                   .json()["items"] if i["p"] == 0.0]
    assert dict(zip(base_item["seeds"], base_item["run_ids"], strict=True)) == {
        1: second["id"], 2: other_seed["id"]}


def test_claims_need_one_duration(registry):
    sweep = registry.post(f"{V1}/sweeps", json={"name": "durations"}).json()
    for duration in (2, 6):
        for p in (0.0, 0.1):
            run = _create(registry, sweep["id"], _config(p=p, seed=0, duration=duration))
            _finish(registry, run["id"], "completed", 2.0 + p)
    response = registry.get(f"{V1}/sweeps/{sweep['id']}/claims")
    assert response.status_code == 422
    assert "duration" in response.text and "2, 6" in response.text
    chosen = registry.get(f"{V1}/sweeps/{sweep['id']}/claims", params={"duration": 6})
    assert chosen.status_code == 200 and chosen.json()["duration"] == 6
    assert registry.get(f"{V1}/sweeps/{sweep['id']}/claims",
                        params={"duration": 3}).status_code == 422


def test_claims_read_the_specs_references_and_claims(registry):
    """A sweep's spec may hold the claims against its own references and decide only some."""
    references = [{"arm": "mapl", "strategy": "skip", "p": 0.1, "pct": 1.5},
                  {"arm": "mapl", "strategy": "drop", "p": 0.1, "pct": 3.0},
                  {"arm": "none", "strategy": "skip", "p": 0.1, "pct": 1.0}]
    sweep = registry.post(f"{V1}/sweeps", json={"name": "refs", "spec": {
        "references": references, "claims": ["a", "d"]}}).json()
    for seed in (0, 1, 2):
        for arm in ("mapl", "none"):
            for p, strategy, loss in ((0.0, "skip", 2.0), (0.1, "skip", 2.02 + 0.001 * seed),
                                      (0.1, "drop", 2.06 - 0.002 * seed)):
                run = _create(registry, sweep["id"], _config(p=p, seed=seed, compression=arm,
                                                             strategy=strategy))
                _finish(registry, run["id"], "completed", loss)
    body = registry.get(f"{V1}/sweeps/{sweep['id']}/claims").json()
    assert body["references"] == "spec"
    assert [c["tag"] for c in body["claims"]] == ["a", "d"]
    a, d = body["claims"]
    assert {c["label"]: c["reference"] for c in a["comparisons"]} == {
        "uncompressed, p = 0.1": None, "MAPL, p = 0.1": -1.5}     # skip - drop, references'
    assert [c["reference"] for c in d["comparisons"]] == [0.5]  # MAPL - uncompressed
    assert "the spec's references" in d["blog"] and "+1.5%" in d["blog"]
    # the blog's by default: Table 1's skip values
    plain = registry.post(f"{V1}/sweeps", json={"name": "blog"}).json()
    for arm in ("mapl", "none"):
        for p in (0.0, 0.1):
            run = _create(registry, plain["id"], _config(p=p, seed=0, compression=arm))
            _finish(registry, run["id"], "completed", 2.0 + p)
    body = registry.get(f"{V1}/sweeps/{plain['id']}/claims").json()
    assert body["references"] == "blog" and len(body["claims"]) == 5
    [d] = [c for c in body["claims"] if c["tag"] == "d"]
    assert d["comparisons"][0]["reference"] == pytest.approx(
        stats.BLOG_SKIP[("mapl", 0.1)] - stats.BLOG_SKIP[("none", 0.1)])


def test_a_stored_spec_with_malformed_references_gets_a_422_naming_them(registry):
    sweep = registry.post(f"{V1}/sweeps", json={"name": "bad-refs", "spec": {
        "references": [{"arm": "mapl", "p": 2.0, "pct": 1.0}]}}).json()
    response = registry.get(f"{V1}/sweeps/{sweep['id']}/claims")
    assert response.status_code == 422
    assert "spec.references[0].p" in response.text
    for claims, needle in ((["f"], "spec.claims[0]"), ([], "decides no claim"),
                           (["a", "a"], "twice")):
        sweep = registry.post(f"{V1}/sweeps", json={"name": "bad-claims", "spec": {
            "claims": claims}}).json()
        response = registry.get(f"{V1}/sweeps/{sweep['id']}/claims")
        assert response.status_code == 422 and needle in response.text, (claims, response.text)
    twice = [{"arm": "ssn", "p": 0.1, "pct": 1.0}, {"arm": "ssn", "p": 0.1, "pct": 2.0}]
    for refs, needle in ((twice, "two references for ssn/skip"), ([], "no reference value")):
        sweep = registry.post(f"{V1}/sweeps", json={"name": "bad-refs", "spec": {
            "references": refs}}).json()
        response = registry.get(f"{V1}/sweeps/{sweep['id']}/claims")
        assert response.status_code == 422 and needle in response.text, (refs, response.text)


def test_a_sweeps_annotations_are_updated_in_its_stored_spec(registry):
    """A re-run of a sweep with other references (or margins, or claims) continues it, and
    what the claims read is the re-run's: the flow sends its annotations, the registry merges
    them into the stored spec; a key that would change what runs is refused."""
    sweep = registry.post(f"{V1}/sweeps", json={"name": "notes", "spec": {
        "seeds": [0], "claims": ["a"]}}).json()
    for arm in ("mapl", "none"):
        for p in (0.0, 0.1):
            run = _create(registry, sweep["id"], _config(p=p, seed=0, compression=arm))
            _finish(registry, run["id"], "completed", 2.0 + p)
    refs = [{"arm": "mapl", "p": 0.1, "pct": 2.0}, {"arm": "none", "p": 0.1, "pct": 1.5}]
    response = registry.patch(f"{V1}/sweeps/{sweep['id']}", json={"spec_annotations": {
        "references": refs, "claims": ["d"], "close_margin": 1.0}})
    assert response.status_code == 200, response.text
    assert response.json()["spec"] == {"seeds": [0], "claims": ["d"], "references": refs,
                                       "close_margin": 1.0}
    body = registry.get(f"{V1}/sweeps/{sweep['id']}/claims").json()
    assert [c["tag"] for c in body["claims"]] == ["d"] and body["close_margin"] == 1.0
    assert body["claims"][0]["comparisons"][0]["reference"] == 0.5
    response = registry.patch(f"{V1}/sweeps/{sweep['id']}", json={"spec_annotations": {
        "seeds": [0, 1]}})
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "body.spec_annotations.seeds"
    assert registry.get(f"{V1}/sweeps/{sweep['id']}").json()["spec"]["seeds"] == [0]


def _committed_study():
    spec = study.load_spec(ROOT / "studies" / "table1.toml")
    return spec, study.load_results(spec)


@pytest.mark.slow
def test_rest_claims_agree_with_the_committed_study_document(registry):
    """The 270 committed runs of the first study, posted to the registry as one sweep (its
    labelled decode variants left out: a sweep has no labels, and no claim reads them): REST's
    claims equal the study's, and every comparison's line in docs/RESULTS-d64.md shows REST's
    interval, seeds and status."""
    spec, results = _committed_study()
    cells = {c.id: c for c in expand_cells(spec)}
    sweep = registry.post(f"{V1}/sweeps", json={
        "name": "table1-in-registry", "spec": {"close_margin": spec.close_margin,
                                               "equivalence_margin": spec.equivalence_margin,
                                               "target_half_width": spec.target_half_width}}
                          ).json()
    posted = 0
    for cell_id, summary in sorted(results.items()):
        if cells[cell_id].key.label:
            continue
        run = _create(registry, sweep["id"], summary["config"])
        _finish(registry, run["id"], "completed", summary["final_val_loss"])
        posted += 1
    assert posted >= 200
    rest = registry.get(f"{V1}/sweeps/{sweep['id']}/claims")
    assert rest.status_code == 200, rest.text
    body = rest.json()
    mine = study.StudyData(spec, results).claims()
    assert [c["tag"] for c in body["claims"]] == [c.tag for c in mine]
    document = (ROOT / "docs" / "RESULTS-d64.md").read_text(encoding="utf-8")
    for served, local in zip(body["claims"], mine, strict=True):
        assert served["verdict"] == local.verdict, served["tag"]
        assert [c["label"] for c in served["comparisons"]] == [c.label for c in local.comparisons]
        for c, ref in zip(served["comparisons"], local.comparisons, strict=True):
            assert c["status"] == ref.status and c["n_seeds"] == ref.stat.n
            for name, value in (("mean", ref.stat.mean), ("ci_low", ref.stat.lo),
                                ("ci_high", ref.stat.hi)):
                assert math.isclose(c[name], value, rel_tol=0, abs_tol=1e-9), (c["label"], name)
            line = (f"| {c['label']} | {c['n_seeds']} | {c['mean']:+.2f} "
                    f"[{c['ci_low']:+.2f}, {c['ci_high']:+.2f}] | {c['status']} |")
            assert line in document, line
    # the Prefect artifact's rows are these numbers, flattened
    rows = stats.claim_rows(body)
    assert len(rows) == sum(max(1, len(c["comparisons"])) for c in body["claims"])
    assert json.dumps(rows)        # plain JSON, as an artifact table needs


def _check_0005_relinks(url: str) -> None:
    import uuid as uuid_module

    import sqlalchemy as sa

    from db.migrate import downgrade, upgrade

    upgrade(url, "0004")
    engine = sa.create_engine(url)
    ids = {name: uuid_module.uuid4() for name in ("sweep", "failed", "good", "faulty")}
    try:
        with engine.begin() as conn:
            sqlite = conn.dialect.name == "sqlite"

            def key(name: str) -> str:
                return ids[name].hex if sqlite else str(ids[name])

            conn.execute(sa.text(
                "INSERT INTO sweeps (id, name, status, created_at, updated_at) VALUES (:id, "
                "'old', 'completed', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"id": key("sweep")})
            for n, (name, p, status, loss, base) in enumerate([
                    ("failed", 0.0, "failed", None, None), ("good", 0.0, "completed", 2.0, None),
                    ("faulty", 0.2, "completed", 2.2, "failed")]):
                conn.execute(sa.text(
                    "INSERT INTO runs (id, sweep_id, config, compression, strategy, p, duration, "
                    "seed, preset, status, final_val_loss, baseline_run_id, created_at, "
                    "updated_at) VALUES (:id, :sweep, '{}', 'ssn', :strategy, :p, 6, 0, 'smoke', "
                    ":status, :loss, :base, :at, :at)"),
                    {"id": key(name), "sweep": key("sweep"), "strategy": None if p == 0 else "skip",
                     "p": p, "status": status, "loss": loss,
                     "base": None if base is None else key(base),
                     "at": f"2026-01-01 00:00:0{n}"})
        upgrade(url, "0005")
        with engine.connect() as conn:
            linked = conn.execute(sa.text("SELECT baseline_run_id FROM runs WHERE id = :id"),
                                  {"id": key("faulty")}).scalar()
        assert uuid_module.UUID(str(linked)) == ids["good"]     # the old rule's failed one, no more
        downgrade(url, "0004")
    finally:
        engine.dispose()
    downgrade(url)


def test_migration_0005_relinks_by_the_one_rule_postgres(fresh_pg_url):
    _check_0005_relinks(fresh_pg_url)


def test_migration_0005_relinks_by_the_one_rule_sqlite(tmp_path):
    _check_0005_relinks(f"sqlite:///{tmp_path / 'crucible.db'}")
