"""The schema language of message bodies: field types (``Spec``), a message kind's schema
(``Kind``) and the table of kinds (``SchemaRegistry``; the process-wide one is ``MESSAGE_KINDS``).

``wire.decode`` checks every body against its kind's schema; a value that does not match raises
``Invalid``, which the decoder turns into ``DropMessage("bad_schema")``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "MAX_ID_LEN",
    "MESSAGE_KINDS",
    "WIRE_DTYPES",
    "Array",
    "BodySchema",
    "Bool",
    "Bytes",
    "Float",
    "Int",
    "Invalid",
    "Kind",
    "ListOf",
    "Map",
    "Opt",
    "SchemaRegistry",
    "Spec",
    "Str",
    "Struct",
    "check_body",
    "register_kind",
]

#: the longest kind, source or destination id a message may name
MAX_ID_LEN = 256


# Little-endian typestr -> dtype; the only dtypes that may cross the wire.
WIRE_DTYPES: dict[bytes, np.dtype] = {
    np.dtype(name).newbyteorder("<").str.encode(): np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "float32", "float64",
    )
}  # fmt: skip


class Invalid(Exception):
    """A body value does not match its spec (the decoder makes it DropMessage('bad_schema'))."""


def _name(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array {value.dtype}{list(value.shape)}"
    return type(value).__name__


class Spec:
    """A body field's type. ``check`` returns the (possibly normalised) value or raises."""

    __slots__ = ()

    def check(self, value: Any) -> Any:
        """The (possibly normalised) value, or raise Invalid naming what was expected."""
        raise Invalid(f"{type(self).__name__} does not check values")


@dataclass(frozen=True, slots=True)
class Int(Spec):
    """A Python int (never a bool) within optional bounds."""

    min: int | None = None
    max: int | None = None

    def check(self, value: Any) -> Any:
        if type(value) is not int:
            raise Invalid(f"expected an integer, got {_name(value)}")
        if self.min is not None and value < self.min:
            raise Invalid(f"expected an integer >= {self.min}, got {value}")
        if self.max is not None and value > self.max:
            raise Invalid(f"expected an integer <= {self.max}, got {value}")
        return value


@dataclass(frozen=True, slots=True)
class Float(Spec):
    """A float; an int is accepted and converted so handlers always see a float."""

    finite: bool = True

    def check(self, value: Any) -> Any:
        if type(value) is not float:
            if type(value) is not int:
                raise Invalid(f"expected a number, got {_name(value)}")
            try:
                value = float(value)
            except OverflowError:
                raise Invalid("expected a number, got an integer too large for a float") from None
        if self.finite and not math.isfinite(value):
            raise Invalid(f"expected a finite number, got {value}")
        return value


@dataclass(frozen=True, slots=True)
class Str(Spec):
    max_len: int = 256

    def check(self, value: Any) -> Any:
        if type(value) is not str:
            raise Invalid(f"expected a string, got {_name(value)}")
        if len(value) > self.max_len:
            raise Invalid(f"expected a string of at most {self.max_len} characters")
        return value


@dataclass(frozen=True, slots=True)
class Bool(Spec):
    def check(self, value: Any) -> Any:
        if type(value) is not bool:
            raise Invalid(f"expected true/false, got {_name(value)}")
        return value


@dataclass(frozen=True, slots=True)
class Bytes(Spec):
    max_len: int | None = None

    def check(self, value: Any) -> Any:
        if type(value) is not bytes:
            raise Invalid(f"expected bytes, got {_name(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise Invalid(f"expected at most {self.max_len} bytes, got {len(value)}")
        return value


@dataclass(frozen=True, slots=True)
class Array(Spec):
    """A numpy array. ``dtype=None``: any wire dtype; ``ndim=None``: any rank; ``max_len`` bounds
    the element count; ``finite`` (addition) rejects NaN/inf in float arrays."""

    dtype: str | None = "float64"
    ndim: int | None = 1
    max_len: int | None = None
    finite: bool = False
    _dt: np.dtype | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.dtype is not None:
            dt = np.dtype(self.dtype).newbyteorder("<")
            if dt.str.encode() not in WIRE_DTYPES:
                raise ValueError(f"Array: dtype {self.dtype!r} cannot cross the wire")
            object.__setattr__(self, "_dt", dt)

    def check(self, value: Any) -> Any:
        if type(value) is not np.ndarray:
            raise Invalid(f"expected an array, got {_name(value)}")
        if self._dt is not None and value.dtype != self._dt:
            raise Invalid(f"expected a {self.dtype} array, got {value.dtype}")
        if self.ndim is not None and value.ndim != self.ndim:
            raise Invalid(f"expected a {self.ndim}-d array, got shape {list(value.shape)}")
        if self.max_len is not None and value.size > self.max_len:
            raise Invalid(f"expected at most {self.max_len} elements, got {value.size}")
        if self.finite and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise Invalid("expected finite values, got NaN or inf")
        return value


@dataclass(frozen=True, slots=True)
class ListOf(Spec):
    spec: Spec
    max_len: int | None = None

    def check(self, value: Any) -> Any:
        if type(value) is not list:
            raise Invalid(f"expected a list, got {_name(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise Invalid(f"expected at most {self.max_len} items, got {len(value)}")
        check = self.spec.check
        for i, item in enumerate(value):
            try:
                new = check(item)
            except Invalid as e:
                raise Invalid(f"[{i}]: {e}") from None
            if new is not item:
                value[i] = new
        return value


@dataclass(frozen=True, slots=True)
class Opt(Spec):
    """The field may be None or absent (absent fields decode as None)."""

    spec: Spec

    def check(self, value: Any) -> Any:
        return None if value is None else self.spec.check(value)


@dataclass(frozen=True)
class Struct(Spec):
    """A nested dict with its own fixed fields (addition), same rules as a body."""

    fields: Mapping[str, Spec]

    def __post_init__(self) -> None:
        _check_fields(self.fields, "Struct")

    def check(self, value: Any) -> Any:
        if type(value) is not dict:
            raise Invalid(f"expected a table, got {_name(value)}")
        check_body(value, self.fields)
        return value


@dataclass(frozen=True, slots=True)
class Map(Spec):
    """A dict with string keys and values of one spec (addition), e.g. term -> count."""

    value: Spec
    max_len: int | None = None
    key_max_len: int = 256

    def check(self, value: Any) -> Any:
        if type(value) is not dict:
            raise Invalid(f"expected a table, got {_name(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise Invalid(f"expected at most {self.max_len} entries, got {len(value)}")
        check = self.value.check
        for key, item in value.items():
            if type(key) is not str or len(key) > self.key_max_len:
                raise Invalid(f"expected string keys of at most {self.key_max_len} characters")
            try:
                new = check(item)
            except Invalid as e:
                raise Invalid(f"{key}: {e}") from None
            if new is not item:
                value[key] = new
        return value


def _check_fields(fields: Mapping[str, Spec], where: str) -> None:
    for name, spec in fields.items():
        if not isinstance(name, str) or not isinstance(spec, Spec):
            raise TypeError(f"{where}: field {name!r} needs a Spec (Int(), Array(), ...)")
        for inner in (getattr(spec, "spec", None), getattr(spec, "value", None)):
            if inner is not None and not isinstance(inner, Spec):
                raise TypeError(f"{where}: field {name!r} wraps {inner!r}, not a Spec")


def check_body(body: dict, fields: Mapping[str, Spec]) -> None:
    """Validate a body-like dict in place: no unknown keys, required keys present."""
    for key in body:
        if key not in fields:
            raise Invalid(f"unknown field {key!r}")
    for name, spec in fields.items():
        if name in body:
            old = body[name]
            try:
                new = spec.check(old)
            except Invalid as e:
                raise Invalid(f"{name}: {e}") from None
            if new is not old:
                body[name] = new
        elif type(spec) is Opt:
            body[name] = None
        else:
            raise Invalid(f"missing field {name!r}")


@dataclass(frozen=True)
class BodySchema:
    fields: Mapping[str, Spec]
    max_bytes: int | None


@dataclass(frozen=True)
class Kind:
    """A message kind and its body schema, as a protocol module declares it (in its
    ``PROVIDES``); ``foltr_async.plugins.load_plugins`` installs it in ``MESSAGE_KINDS``."""

    name: str
    fields: Mapping[str, Spec]
    max_bytes: int | None = None

    def install(self, registry: Any) -> None:
        """Put this kind in ``registry.message_kinds`` (the plugin registry's section)."""
        registry.message_kinds.add(self)


class SchemaRegistry:
    """Message kinds and their body schemas (``load_plugins`` installs the protocols' kinds)."""

    def __init__(self) -> None:
        self._schemas: dict[str, BodySchema] = {}

    def register(
        self, kind: str, fields: Mapping[str, Spec], *, max_bytes: int | None = None
    ) -> None:
        """Declare a kind. Re-registering the same schema is a no-op (module reloads)."""
        if not isinstance(kind, str) or not kind or len(kind) > MAX_ID_LEN:
            raise ValueError(f"message kind must be a non-empty string, got {kind!r}")
        _check_fields(fields, f"kind {kind!r}")
        schema = BodySchema(dict(fields), max_bytes)
        old = self._schemas.get(kind)
        if old is not None and old != schema:
            raise ValueError(f"message kind {kind!r} is already registered with another schema")
        self._schemas[kind] = schema

    def add(self, kind: Kind) -> None:
        self.register(kind.name, kind.fields, max_bytes=kind.max_bytes)

    def get(self, kind: str) -> BodySchema | None:
        return self._schemas.get(kind)

    def __contains__(self, kind: object) -> bool:
        return kind in self._schemas

    def kinds(self) -> list[str]:
        return sorted(self._schemas)


MESSAGE_KINDS = SchemaRegistry()


def register_kind(kind: str, fields: Mapping[str, Spec], *, max_bytes: int | None = None) -> None:
    """Register a message kind in the process-wide ``MESSAGE_KINDS``."""
    MESSAGE_KINDS.register(kind, fields, max_bytes=max_bytes)
