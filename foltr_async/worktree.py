"""Whether a file would be picked up by git: secret keys must not land where ``git add .``
takes them. A careful default: ``keys`` refuses to write a secret into a git work tree that
does not ignore it, unless told to (``--in-work-tree``)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def unignored_in(path: Path) -> Path | None:
    """The root of the git work tree that holds ``path`` (existing or not) and would not
    ignore it; None outside a work tree, when git ignores it, or without git."""
    path = Path(path).absolute()
    probe = path.parent
    while not probe.is_dir():
        probe = probe.parent
    top = _git(probe, "rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0:
        return None
    root = Path(top.stdout.strip())
    ignored = _git(root, "check-ignore", "-q", "--no-index", str(path))
    return None if ignored is not None and ignored.returncode == 0 else root


def _git(where: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
