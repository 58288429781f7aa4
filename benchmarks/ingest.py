"""Ingestion throughput of the registry: `POST /runs/{id}/metrics:batch` (10,000 points a
request, the real app under uvicorn, Postgres) against a raw `COPY` of the same rows into the same
table, measured in the same run. Prints one JSON object.

    python benchmarks/ingest.py [--database-url postgresql://postgres@127.0.0.1:5432/postgres]
                                [--batches 10] [--batch-size 10000]

A fresh database is created on the server (and dropped afterwards), migrated to head; every batch
carries new keys, so each request really inserts (plus one resend, which inserts nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

import httpx
import psycopg
from sqlalchemy.engine import make_url

from db.migrate import upgrade

TOKEN = "crc_benchmark-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _create_database(admin_url: str) -> str:
    name = f"crucible_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(_libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def _drop_database(admin_url: str, url: str) -> None:
    with psycopg.connect(_libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


def _serve(url: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CRUCIBLE_DATABASE_URL": url, "CRUCIBLE_API_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "api.app:create_app", "--factory",
                             "--port", str(port), "--log-level", "warning"], env=env)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("uvicorn did not become ready")


def _items(batch: int, size: int) -> list[dict[str, object]]:
    # distinct (name, step, replica) keys per batch: 8 replicas of train_loss per step
    first = batch * size
    return [{"name": "train_loss", "global_step": (first + i) // 8, "replica": (first + i) % 8,
             "tokens": first + i, "value": 1.0 / (1 + i)} for i in range(size)]


def _bench_api(base: str, run_id: str, batches: int, size: int) -> dict[str, float]:
    timings, resend_s = [], 0.0
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        for batch in range(batches + 1):   # batch 0 warms up connections and caches
            body = json.dumps({"items": _items(batch, size)})
            start = time.perf_counter()
            response = http.post(f"/api/v1/runs/{run_id}/metrics:batch", content=body)
            elapsed = time.perf_counter() - start
            assert response.json()["inserted"] == size, response.text
            if batch:
                timings.append(elapsed)
        start = time.perf_counter()
        response = http.post(f"/api/v1/runs/{run_id}/metrics:batch", content=body)
        resend_s = time.perf_counter() - start
        assert response.json()["inserted"] == 0
    return {"median_s": statistics.median(timings), "points_per_s": size / statistics.median(timings),
            "resend_points_per_s": size / resend_s}


def _bench_copy(url: str, run_id: str, batches: int, size: int) -> dict[str, float]:
    timings = []
    columns = "(run_id, name, global_step, replica, tokens, value)"
    with psycopg.connect(_libpq(url)) as conn:
        for batch in range(batches + 1):
            rows = [(run_id, i["name"], i["global_step"], i["replica"], i["tokens"], i["value"])
                    for i in _items(batch, size)]
            start = time.perf_counter()
            with conn.cursor() as cur, cur.copy(f"COPY metrics {columns} FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            conn.commit()
            if batch:
                timings.append(time.perf_counter() - start)
    return {"median_s": statistics.median(timings), "points_per_s": size / statistics.median(timings)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="a Postgres server where a scratch database may be created")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10_000)
    args = parser.parse_args()
    url = _create_database(args.database_url)
    proc = None
    try:
        upgrade(url)
        port = _free_port()
        proc = _serve(url, port)
        base = f"http://127.0.0.1:{port}"
        runs = [httpx.post(f"{base}/api/v1/runs", json={"config": {"seed": s}},
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()["id"]
                for s in range(2)]
        api = _bench_api(base, runs[0], args.batches, args.batch_size)
        copy = _bench_copy(url, runs[1], args.batches, args.batch_size)
        print(json.dumps({"batch_size": args.batch_size, "batches": args.batches,
                          "api_metrics_batch": api, "raw_copy": copy,
                          "api_over_copy": api["points_per_s"] / copy["points_per_s"],
                          "cpu_count": os.cpu_count(),
                          "load_avg_1m": os.getloadavg()[0]}, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        _drop_database(args.database_url, url)


if __name__ == "__main__":
    main()
