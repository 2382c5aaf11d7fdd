"""Names a user gives (variants) and did-you-mean hints for unknown ones, with no project
imports: the runtime, the scenario reader, ``merge`` and the registry all use it without
depending on each other."""

from __future__ import annotations

import difflib

#: the longest folder name most file systems take (bytes): a variant name becomes one
NAME_MAX = 255
#: what a variant name must not hold: path separators (it names folders under the output
#: folder) and the Markdown table's cell separator and code mark (it is a row of summary.md)
FORBIDDEN = "/\\|`"
#: what a variant name may hold, said in one line
VARIANT_RULE = (
    f"a variant name: printable characters other than {' '.join(FORBIDDEN)}, not '.' or '..', "
    f"no space at either end, 1 to {NAME_MAX} bytes"
)


def suggest(name: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def bad_variant_name(name: object) -> bool:
    """Whether ``name`` cannot be a variant's: every writer puts it in a path (tracking
    folders, per-variant files) or a line of text (summary.md, logs) as it is, so a name that
    would leave the output folder (``../x``, ``/abs``) or break a line or table row (a
    newline, control characters, ``|``) is refused where the scenario is read."""
    return (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or not name.isprintable()
        or name.strip() != name
        or any(c in name for c in FORBIDDEN)
        or len(name.encode("utf-8", "surrogatepass")) > NAME_MAX
    )
