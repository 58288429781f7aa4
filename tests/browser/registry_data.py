"""Putting `dashboards.sample` sweeps into a running registry through its HTTP API (for the
compare and report browser tests): every run completed with its results, val_loss and
per-replica train_loss metrics, and for failure runs the sample fault events."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from dashboards import sample
from tests.fixtures.browser import serve_in_thread

__all__ = ["seed_sample_sweep", "served_sample_sweep"]


def seed_sample_sweep(client: httpx.Client, *, name: str, arms: tuple[str, ...] = ("ssn",),
                      seeds: int = 1) -> dict[str, Any]:
    """Register a completed sample sweep; returns {"sweep": id, "runs": [REST run dicts]}
    (baselines first, in creation order)."""
    sweep_id = client.post("/api/v1/sweeps", json={"name": name}).raise_for_status().json()["id"]
    runs = []
    for run in sorted(sample.runs(arms=arms, seeds=seeds), key=lambda r: r["p"] > 0):
        config = {"preset": "smoke", "seed": run["seed"], "replicas": 4,
                  "train": {"global_steps": 20},
                  "faults": {"p": run["p"], "strategy": run["strategy"], "duration": 6},
                  "pipeline": {"compression": run["compression"]}}
        run_id = client.post("/api/v1/runs", json={"sweep_id": sweep_id, "config": config}
                             ).raise_for_status().json()["id"]
        results = {k: run[k] for k in ("initial_val_loss", "final_val_loss", "tokens_budget",
                                       "tokens_processed", "summary")}
        client.patch(f"/api/v1/runs/{run_id}", json={"status": "completed", **results}
                     ).raise_for_status()
        metrics = sample.val_loss_metrics(run["summary"]) + sample.train_loss_metrics()
        client.post(f"/api/v1/runs/{run_id}/metrics:batch", json={"items": metrics}
                    ).raise_for_status()
        if run["p"] > 0:
            client.post(f"/api/v1/runs/{run_id}/events:batch",
                        json={"items": sample.events(strategy=run["strategy"])}
                        ).raise_for_status()
        runs.append(client.get(f"/api/v1/runs/{run_id}").raise_for_status().json())
    client.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": "completed"}).raise_for_status()
    return {"sweep": sweep_id, "runs": runs}


@contextmanager
def served_sample_sweep(pg_url: str, *, name: str, token: str, arms: tuple[str, ...] = ("ssn",)
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
    """The registry app under uvicorn over `pg_url` with `seed_sample_sweep` registered; yields
    (its URL, the seeded data) and stops the server on exit."""
    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=pg_url, api_token=token))
    with serve_in_thread(app, name=f"{name}-uvicorn") as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                          timeout=30) as client:
            data = seed_sample_sweep(client, name=name, arms=arms)
        yield url, data
