"""Reading the files a user names (a scenario, a trace): regular files of bounded size only.

``/dev/zero`` never ends (a whole read runs out of memory) and a named pipe blocks its reader
until someone writes: both are refused before anything is read, and a file larger than its
kind's limit is refused after reading at most one byte more than the limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MB = 2**20


def read_capped(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` if it holds at most ``limit`` bytes (``what``:
    the kind of file, as the message names it).

    Raises ValueError saying what is wrong (not a regular file, larger than the limit) and
    OSError as opening the file does (missing, no permission).
    """
    # O_NONBLOCK: opening a named pipe for reading would otherwise wait for a writer
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than the {limit / MB:g} MB limit of a {what}")
    return data


def nesting_depth(obj: object, limit: int) -> int:
    """How deep ``obj``'s lists and dicts nest, counted without recursion up to ``limit + 1``
    (parsers take nesting that would overflow the stack of the code reading it later)."""
    deepest, todo = 0, [(obj, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            todo += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            todo += [(v, depth + 1) for v in node]
    return deepest


def relative_note(path: str | Path) -> str:
    """What a relative path that does not exist was looked up from, for its one-line error
    (a scenario file's ``dataset.path`` is read from the current folder, not the file's)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return ""
    return f" (a relative path: looked up from the current folder {Path.cwd()})"
