"""Which code made a results file: a stamp every run writes into results.json (``code``).

Results are a function of the scenario, the seed, the data and the code, so runs that share
repeats (``--reuse``, ``merge``) must come from the same code. The stamp's ``source`` is a hash
of every Python file the simulator runs that can change a result (this package and its
protocols, less the ``PRESENTATION`` files): equal hashes, equal code, whatever the version
number or the commit say (a change to a docstring changes it too; the check errs on the side of
running again). ``commit`` is there for the reader when the code
is a git checkout (``modified``: its simulator or protocol files differ from that commit);
``python`` and ``numpy`` because another numpy may round differently.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import platform
import subprocess
from pathlib import Path

import numpy as np

import foltr_async
from foltr_async.errors import FoltrError

#: files that only present results (commands, console, figures, tracking, the claims report):
#: a change to them cannot change a number a run computes, so they are left out of the hash
PRESENTATION = (
    "foltr_async/cli.py",
    "foltr_async/__main__.py",
    "foltr_async/observe/console.py",
    "foltr_async/observe/plots.py",
    "foltr_async/observe/tracking.py",
    "foltr_async/reproduction/",
)


@functools.cache
def source_hashes() -> dict[str, str]:
    """``label/path -> sha256[:16]`` of every simulator and protocol file that can change a
    result (``foltr_async/...``, ``protocols/...``), in a fixed order."""
    protocols = importlib.util.find_spec("foltr_async.protocols")  # found, not imported
    roots = {
        "foltr_async": foltr_async.__path__[0],
        "protocols": protocols.submodule_search_locations[0],
    }
    out = {}
    for label, root in roots.items():
        for path in sorted(Path(root).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if label == "foltr_async" and rel.startswith(("protocols/", "benchmarks/")):
                continue  # an installed wheel holds them inside the package: hashed once
            key = f"{label}/{rel}"
            if not key.startswith(PRESENTATION):
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


@functools.cache
def code_stamp() -> dict:
    """This process's code: ``version``, ``source`` (hash), ``commit`` and ``modified`` (if a
    git checkout), ``python``, ``numpy``. Computed once per process (the code does not change
    under it)."""
    digest = hashlib.sha256()
    for key, file_hash in source_hashes().items():
        digest.update(f"{key}\0{file_hash}\0".encode())
    stamp = {
        "version": foltr_async.__version__,
        "source": digest.hexdigest()[:16],
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    root = Path(foltr_async.__path__[0]).parent
    commit = git(root, "rev-parse", "HEAD")
    if commit:
        changed = git(root, "status", "--porcelain", "--", "foltr_async", "protocols")
        stamp.update(commit=commit, modified=bool(changed))
    return stamp


def git(root: Path, *args: str) -> str | None:
    """A git command's output in the checkout at ``root``, or None (not a checkout, no git)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip("\n")  # not the leading space of a status line


def check_same_code(results: dict, label: str, what: str) -> None:
    """Raise a one-line error when ``results`` (a results.json object) was made by other code
    than this process's; results older than the stamp carry none and are taken on trust."""
    theirs = (results.get("code") or {}).get("source")
    mine = code_stamp()["source"]
    if theirs is not None and theirs != mine:
        raise FoltrError(
            f"{what} {label}: made by other code (source {theirs}, this code {mine}), so its "
            "repeats may differ from what this code computes; run them again"
        )
