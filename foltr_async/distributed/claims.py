"""Which clients a worker hosts: the ``--agents`` spec (``client-0..client-99,client-120``).

The launcher writes it, ``join`` reads it and the server names missing clients with it.
"""

from __future__ import annotations

import itertools
import re

from foltr_async.errors import FoltrError

__all__ = ["agent_ids", "client_number", "parse_agents"]

_RANGE = re.compile(r"^client-(\d+)(?:\.\.client-(\d+))?$")


def parse_agents(spec: str) -> set[int]:
    """``client-0..client-99,client-120`` -> the client numbers it names."""
    out: set[int] = set()
    for part in spec.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise FoltrError(
                f"--agents: {part.strip()!r}: expected client-N or "
                "client-A..client-B (e.g. client-0..client-99)"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise FoltrError(f"--agents: {part.strip()!r}: empty range")
        out.update(range(lo, hi + 1))
    return out


def agent_ids(numbers: set[int] | list[int]) -> str:
    """The shortest ``--agents`` spec for these client numbers."""
    nums = sorted(numbers)
    parts = []
    for _, run in itertools.groupby(enumerate(nums), lambda t: t[1] - t[0]):
        block = [n for _, n in run]
        parts.append(
            f"client-{block[0]}" if len(block) == 1 else f"client-{block[0]}..client-{block[-1]}"
        )
    return ",".join(parts)


def client_number(agent_id: str) -> int:
    return int(agent_id.rsplit("-", 1)[1])
