"""Did-you-mean hints for unknown names, with no project imports: the runtime, the scenario
reader and the registry all use it without depending on each other."""

from __future__ import annotations

import difflib


def suggest(name: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""
