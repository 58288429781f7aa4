"""Screenshots of the served dashboards for `docs/img/`: the index, a sweep, a run and a compare
view, taken in headless Chromium from a real registry database.

    crucible sweep --demo --work-dir runs/shots          # a real sweep (about 3 minutes)
    python -m benchmarks.screenshots --database-url sqlite:///runs/shots/registry.db \
        --out docs/img

The registry app is served over that database on a loopback port for the time it takes; the
newest sweep is shown (or `--sweep NAME|UUID`), its run with the most fault events is the run
page, and that run, its baseline and one run of another arm are compared. Each image is written
atomically (temporary file, then rename). Nothing here runs in tests: it is a documentation tool.
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crucible.runfiles import write_bytes_atomic

__all__ = ["take", "main"]

CHROMIUM = Path("/usr/bin/chromium")
_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]


@contextmanager
def _serve(database_url: str) -> Iterator[str]:
    import uvicorn

    from api.app import create_app
    from api.settings import Settings

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    app = create_app(Settings(database_url=database_url, api_token="screenshots-only"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, name="screenshots-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the registry API did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _pick(database_url: str, sweep_ref: str | None) -> tuple[str, str, list[str]]:
    """(sweep id, run id for the run page, run ids to compare)."""
    from sqlalchemy import func, select

    from api import crud
    from db.models import Event, Run
    from db.session import make_engine, make_session_factory

    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as session:
            if sweep_ref:
                sweep = crud.resolve_sweep(session, sweep_ref)
            else:
                sweeps = crud.recent_sweeps(session, name=None, status=None, arm={})
                if not sweeps:
                    raise SystemExit("no sweep in this registry: run `crucible sweep --demo` first")
                sweep = sweeps[0]
            runs = session.scalars(select(Run).where(Run.sweep_id == sweep.id)).all()
            counts = dict(session.execute(
                select(Event.run_id, func.count()).where(Event.run_id.in_([r.id for r in runs]))
                .group_by(Event.run_id)).all())
            faulty = max(runs, key=lambda r: (counts.get(r.id, 0), r.p))
            compare = [faulty.id]
            if faulty.baseline_run_id and faulty.baseline_run_id != faulty.id:
                compare.append(faulty.baseline_run_id)
            other = [r for r in runs if r.compression != faulty.compression and r.p == faulty.p]
            if other:
                compare.append(other[0].id)
            return str(sweep.id), str(faulty.id), [str(i) for i in compare]
    finally:
        engine.dispose()


def _shoot(page: Any, url: str, path: Path) -> None:
    page.goto(url, wait_until="load")
    page.wait_for_timeout(1500)   # let Plotly finish its layout
    write_bytes_atomic(path, page.screenshot(full_page=True, type="png"))
    print(f"wrote {path}")


def take(database_url: str, out_dir: Path, *, sweep_ref: str | None = None,
         width: int = 1280) -> list[Path]:
    """Screenshot the index, sweep, run and compare pages into `out_dir`; returns the paths."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} is missing: `make system-deps`")
    sweep_id, run_id, compare = _pick(database_url, sweep_ref)
    out_dir.mkdir(parents=True, exist_ok=True)
    shots = {"dashboard-index.png": "/",
             "dashboard-sweep.png": f"/dashboards/sweeps/{sweep_id}",
             "dashboard-run.png": f"/dashboards/runs/{run_id}",
             "dashboard-compare.png": f"/dashboards/compare?runs={','.join(compare)}"}
    written = []
    with _serve(database_url) as base, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.set_default_timeout(120_000)
            for name, path in shots.items():
                _shoot(page, base + path, out_dir / name)
                written.append(out_dir / name)
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.screenshots",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True,
                        help="the registry database, e.g. sqlite:///runs/shots/registry.db")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--sweep", default=None, help="sweep name or UUID (default: newest)")
    args = parser.parse_args(argv)
    take(args.database_url, args.out, sweep_ref=args.sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
