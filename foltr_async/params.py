"""Typed, defaulted fields for scenario tables; every failure is one line naming the key path.

Protocols and agent roles declare their own parameters with these fields, so a misspelt
``[federation.params]`` key gets the same clear error as a misspelt top-level key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from foltr_async.errors import ScenarioError

_REQUIRED = object()


def fail(where: str, path: str, expected: str, got: Any = _REQUIRED) -> ScenarioError:
    tail = "" if got is _REQUIRED else f", got {got!r}"
    return ScenarioError(f"{where}: {path}: expected {expected}{tail}")


@dataclass(frozen=True)
class Field:
    """One scenario value: its type, default, bounds or choices, and a short help text."""

    kind: type | tuple[type, ...]
    default: Any = _REQUIRED
    help: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[Any, ...] | None = None
    nullable: bool = False
    #: accept ``inf`` (e.g. "no noise"); NaN is never a value
    infinite: bool = False
    #: a list's elements, each checked as ``path[i]``
    items: Field | None = None

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def describe(self) -> str:
        if self.items is not None:
            return f"a list, each {self.items.describe()}"
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        names = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        text = " or ".join(
            {
                int: "an integer",
                float: "a number (inf allowed)" if self.infinite else "a finite number",
                str: "a string",
                bool: "true/false",
                list: "a list",
                dict: "a table",
            }[k]
            for k in names
        )
        if self.min is not None and self.max is not None:
            text += f" in [{self.min}, {self.max}]"
        elif self.min is not None:
            text += f" >= {self.min}"
        elif self.max is not None:
            text += f" <= {self.max}"
        return text

    def check(self, value: Any, where: str, path: str) -> Any:
        if value is None and self.nullable:
            return None
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if isinstance(value, float) and not (
            math.isfinite(value) or (self.infinite and value == math.inf)
        ):
            ok = False  # NaN passes every < and > below, and inf loops or overflows a run
        if not ok:
            raise fail(where, path, self.describe(), value)
        if self.items is not None:
            return [self.items.check(v, where, f"{path}[{i}]") for i, v in enumerate(value)]
        if self.choices is not None and value not in self.choices:
            names = [str(c) for c in self.choices]
            hint = [c for c in names if c.lower() == str(value).lower()]  # "sln" -> "SLN"
            hint = hint or difflib.get_close_matches(str(value), names, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ScenarioError(
                f"{where}: {path}: expected {self.describe()}, got {value!r}{extra}"
            )
        if (self.min is not None and value < self.min) or (
            self.max is not None and value > self.max
        ):
            raise fail(where, path, self.describe(), value)
        return value


def check_table(table: Any, fields: dict[str, Field], where: str, prefix: str) -> dict[str, Any]:
    """Check ``table`` against ``fields``: fill defaults, reject unknown keys with a suggestion."""
    if not isinstance(table, dict):
        raise fail(where, prefix or "<top>", "a table", table)
    for key in table:
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            known = ", ".join(sorted(fields)) or "none"
            raise ScenarioError(
                f"{where}: {_join(prefix, key)}: unknown key{extra}; known keys: {known}"
            )
    out: dict[str, Any] = {}
    for key, spec in fields.items():
        if key in table:
            out[key] = spec.check(table[key], where, _join(prefix, key))
        elif spec.required:
            raise fail(where, _join(prefix, key), f"{spec.describe()} (required)")
        else:
            out[key] = spec.default
    return out


def _join(prefix: str, key: str) -> str:
    key = key_text(key)
    return f"{prefix}.{key}" if prefix else key


def key_text(key: str) -> str:
    """A key as an error shows it: quoted when TOML's quoted keys hold what would break the
    one-line message (a newline, control characters, spaces at the ends, nothing)."""
    return key if key and key.isprintable() and key.strip() == key else repr(key)


def param(default: Any = _REQUIRED, help: str = "", **checks: Any) -> Any:
    """One field of a ``@parameters`` class: its default, help text and checks (``min``,
    ``max``, ``choices``, ``infinite``, ``items``); the type comes from the annotation."""
    kw: dict[str, Any] = {"metadata": {"param": (default, help, checks)}}
    if isinstance(default, list | dict):
        kw["default_factory"] = lambda: type(default)(default)  # a fresh copy per instance
    elif default is not _REQUIRED:
        kw["default"] = default
    return dataclasses.field(**kw)


_KINDS = {float: float, int: int, bool: bool, str: str, list: list, dict: dict}


def _field_of(annotation: Any, spec: tuple[Any, str, dict[str, Any]]) -> Field:
    default, help, checks = spec
    options = annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = tuple(_KINDS[typing.get_origin(a) or a] for a in options if a is not type(None))
    nullable = len(kinds) < len(options)
    return Field(kinds[0] if len(kinds) == 1 else kinds, default, help, nullable=nullable, **checks)


def parameters(cls: type) -> type:
    """Make ``cls`` a frozen dataclass of scenario parameters whose ``FIELDS`` (name ->
    ``Field``, in declaration order) validate ``[federation.params]`` (or an agent group).

    The checks and one-line errors are ``Field``'s; code reads typed attributes (``p.lr``).
    ``cls.of(table)`` picks its fields out of a checked table.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    hints = typing.get_type_hints(cls)
    cls.FIELDS = {
        f.name: _field_of(hints[f.name], f.metadata["param"]) for f in dataclasses.fields(cls)
    }
    cls.of = classmethod(_of)
    return cls


def _of(cls: type, table: dict[str, Any]) -> Any:
    """``cls`` from a checked table that may hold other keys (an agent group's count, role)."""
    return cls(**{name: table[name] for name in cls.FIELDS})
