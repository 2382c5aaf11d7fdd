"""Variant grids: a few lists of values in the TOML expand into named variants.

A sweep over four DP settings, three client counts or five aggregators times four attacker
fractions would otherwise be one ``[variants.NAME]`` table per combination. A ``[[grid]]`` entry
says it once::

    [[grid]]
    name = "dp-eps{epsilon}-delta{sensitivity}-C{clients}"
    set = { federation.params.dp = true }
    product = { federation.clients = [10, 100, 1000] }
    [grid.zip]
    federation.params.epsilon = [1.2, 2.3, 4.5, 10]
    federation.params.sensitivity = [3, 3, 5, 5]

``zip`` keys are paired (equal-length lists, read together: one axis); ``product`` keys each
form an axis; the variants are every combination of the axes. ``set`` holds overrides shared by
all of them. Keys are paths into the scenario (dotted keys or nested tables); a path component
that is a number indexes a list the grid's ``set`` holds (``agents.0.count``: the count of the
first agent group in ``set``). ``{key}`` in ``name`` is the value of the axis whose path ends in
``key`` (or the whole dotted path); every variant name must come out different. Each expanded
variant is an ordinary variant table: it is deep-merged over the base and validated like any
other, so an error names the expanded variant.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
from typing import Any

from foltr_async.errors import ScenarioError
from foltr_async.names import suggest
from foltr_async.params import Field, check_table, fail

GRID_FIELDS = {
    "name": Field(str, help="variant name template, e.g. 'dp-eps{epsilon}-delta{sensitivity}'"),
    "set": Field(dict, {}, "overrides shared by every variant of the grid"),
    "product": Field(dict, {}, "key paths -> lists of values; every combination"),
    "zip": Field(dict, {}, "key paths -> equal-length lists read together (paired keys)"),
}

_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")

#: the most variants the grids of one file expand to; ``FOLTR_ASYNC_MAX_VARIANTS`` raises it
#: (every variant is validated and built at load: a few ms and some kB each)
MAX_VARIANTS = 10_000
MAX_VARIANTS_ENV = "FOLTR_ASYNC_MAX_VARIANTS"


def max_variants() -> int:
    """The cap on grid variants: ``FOLTR_ASYNC_MAX_VARIANTS`` (a positive integer) or 10,000."""
    text = os.environ.get(MAX_VARIANTS_ENV)
    if text is None:
        return MAX_VARIANTS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ScenarioError(f"{MAX_VARIANTS_ENV}: expected an integer >= 1, got {text!r}")
    return value


def expand_grids(grids: Any, where: str) -> dict[str, dict[str, Any]]:
    """``[[grid]]`` entries -> ``{variant name: override table}`` in file order."""
    if not isinstance(grids, list):
        raise fail(where, "grid", "an array of tables ([[grid]])", grids)
    out: dict[str, dict[str, Any]] = {}
    cap, total = max_variants(), 0
    for i, entry in enumerate(grids):
        total += _size(entry)
        if total > cap:
            raise ScenarioError(
                f"{where}: grid: expands to more than {cap:,} variants ({total:,} by grid[{i}]); "
                f"split the study, or raise the cap with {MAX_VARIANTS_ENV}=N"
            )
        for name, table in _expand(entry, where, f"grid[{i}]").items():
            if name in out:
                raise fail(where, f"grid[{i}].name", f"distinct variant names, {name!r} repeats")
            out[name] = table
    return out


def _size(entry: Any) -> int:
    """How many variants a grid entry names, counted before any is built (0 when its shape is
    wrong: ``_expand`` says what)."""
    if not isinstance(entry, dict):
        return 0
    zipped, product = entry.get("zip") or {}, entry.get("product") or {}
    if not isinstance(zipped, dict) or not isinstance(product, dict):
        return 0
    sizes = [len(v) for v in _lists(product)]
    paired = _lists(zipped)
    if paired:
        sizes.append(min(len(v) for v in paired))
    return math.prod(sizes) if sizes else 0


def _lists(table: dict) -> list[list]:
    """The lists at the leaves of a (dotted or nested) key table."""
    out = []
    for value in table.values():
        if isinstance(value, dict):
            out += _lists(value)
        elif isinstance(value, list):
            out.append(value)
    return out


def _expand(entry: Any, where: str, path: str) -> dict[str, dict[str, Any]]:
    spec = check_table(entry, GRID_FIELDS, where, path)
    axes: list[list[list[tuple[list[str], Any]]]] = []  # axis -> choices -> (key path, value)
    paired = _leaves(spec["zip"], where, f"{path}.zip")
    if paired:
        lengths = {len(v) for _, v in paired}
        if len(lengths) > 1:
            raise fail(
                where,
                f"{path}.zip",
                "lists of one length (their values are read together)",
                {".".join(k): len(v) for k, v in paired},
            )
        axes.append([[(k, v[j]) for k, v in paired] for j in range(lengths.pop())])
    for keys, values in _leaves(spec["product"], where, f"{path}.product"):
        axes.append([[(keys, v)] for v in values])
    if not axes:
        raise fail(where, path, "at least one list of values in 'product' or 'zip'")
    all_keys = [keys for axis in axes for keys, _ in axis[0]]
    _check_placeholders(spec["name"], all_keys, where, f"{path}.name")
    out: dict[str, dict[str, Any]] = {}
    for combo in itertools.product(*axes):
        chosen = [kv for choice in combo for kv in choice]
        name = _render(spec["name"], chosen)
        if name in out:
            raise fail(where, f"{path}.name", f"a placeholder for every axis ({name!r} repeats)")
        table = copy.deepcopy(spec["set"])
        for keys, value in chosen:
            _put(table, keys, copy.deepcopy(value), where, f"{path}: {'.'.join(keys)}")
        out[name] = table
    return out


def _leaves(table: dict, where: str, path: str) -> list[tuple[list[str], list]]:
    """Flatten nested tables to (key path, list of values); every leaf must be a non-empty list."""
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += [([key, *k], v) for k, v in _leaves(value, where, f"{path}.{key}")]
        elif isinstance(value, list) and value:
            out.append(([key], value))
        else:
            raise fail(where, f"{path}.{key}", "a non-empty list of values", value)
    return out


def _check_placeholders(template: str, keys: list[list[str]], where: str, path: str) -> None:
    known = {".".join(k) for k in keys} | {k[-1] for k in keys}
    for ph in _PLACEHOLDER.findall(template):
        if ph not in known:
            raise ScenarioError(
                f"{where}: {path}: unknown placeholder {{{ph}}}{suggest(ph, sorted(known))}; "
                f"known: {', '.join(sorted(known))}"
            )


def _render(template: str, chosen: list[tuple[list[str], Any]]) -> str:
    labels = {}
    for keys, value in chosen:
        labels.setdefault(keys[-1], _label(value))
        labels[".".join(keys)] = _label(value)
    return _PLACEHOLDER.sub(lambda m: labels[m.group(1)], template)


def _label(value: Any) -> str:
    """A value as it reads in a variant name: 10.0 -> '10', [64, 64] -> '64x64'."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return "x".join(_label(v) for v in value)
    return str(value)


def _put(table: dict, keys: list[str], value: Any, where: str, path: str) -> None:
    """``table[k0][k1]... = value``, creating tables; a numeric key indexes an existing list."""
    node: Any = table
    for i, key in enumerate(keys):
        if isinstance(node, list) != key.isdigit():
            raise fail(where, path, f"{'a list index' if isinstance(node, list) else 'a key'}", key)
        if key.isdigit():
            key = _index(node, key, where, path)
        if i == len(keys) - 1:
            node[key] = value
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            node = node[key]


def _index(node: list, key: str, where: str, path: str) -> int:
    if int(key) >= len(node):
        raise fail(where, path, f"a list index below {len(node)}", key)
    return int(key)
