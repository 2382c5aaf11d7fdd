"""Checkpoints: the state of objects as plain data, and atomic, checksummed checkpoint files.

Agents, strategies and buses are ordinary Python objects whose state (weights, random
generators, stored unlearning updates, counters) lives in their attributes, tangled with the
run's machinery (the bus, the run context, the shared read-only dataset, asyncio primitives).
``capture`` encodes an object's attributes while replacing every piece of machinery by a
*name*; ``restore`` loads them into a freshly built object of the same run, resolving each name
to the fresh run's own machinery. So a protocol needs no ``state()/restore()`` methods: building
the run again from the same scenario and seed gives the skeleton, the checkpoint its state.
Which attributes are state is the class's own declaration (``Checkpointed``): the run saves
each of its objects without knowing their fields.

The format is data only (msgpack), no pickle: agent state travels between processes (a worker's
snapshot to the server, a checkpoint back to a worker on ``--resume``), so reading must not be
able to run code or crash the process whatever the bytes. A value is a tree of numbers, strings,
bytes and tagged lists; reading builds only

- Python scalars, containers (``list``, ``tuple``, ``dict``, ``set``, ``frozenset``,
  ``Counter``) and ``slice``s of integers;
- numpy arrays from (dtype, shape, bytes), numeric or fixed-width text dtypes only, the byte
  count matching the shape (never an object or structured dtype), and numpy scalars likewise;
- a view of such an array as a contiguous slice of it (e.g. an MLP's layer views into its flat
  parameter vector; a view of an array that is not saved too is saved as a copy);
- numpy ``Generator``s from their bit generator's name (one of numpy's) and ``state`` dict;
- instances of the project's own classes (``foltr_async.*``, protocols included, already
  imported, allocated without running a constructor, attributes set directly);
- methods of the project's classes bound to such an object or to the run's machinery
  (callbacks);
- the run's machinery by name (a name the fresh run lacks is an error, not a silent copy) and
  asyncio primitives fresh (an ``Event`` or ``Queue`` restores empty; tasks, futures, handles
  and loops as None): a checkpoint is taken between rounds, when no handler is running.

Identity is kept within one value (two attributes holding one generator still do). ``restore``
then checks every field against what the class declares state and against the freshly built
object: same types, array dtypes and shapes, recursively; a mismatch is one ``CheckpointError``
line naming the field and what was expected.

A checkpoint file (``write_atomic``) is a header (format name, SHA-256 of the payload) and the
payload, written via a temporary file, fsync and rename, so a crash mid-write leaves the
previous checkpoint intact. ``read_checkpoint`` refuses a file whose checksum does not match
(a flipped bit, a truncated or hand-edited file) and old pickle checkpoints. The checksum is not
keyed: it detects accidental damage and naive edits, not a forger who recomputes it (whose file
can still hold only the data above, checked against the run).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FunctionType, MemberDescriptorType, MethodType
from typing import Any, ClassVar

import msgpack
import numpy as np

from foltr_async.errors import FoltrError

__all__ = [
    "MAGIC",
    "CheckpointError",
    "Checkpointed",
    "capture",
    "conform",
    "dumps",
    "loads",
    "read_checkpoint",
    "restore",
    "write_atomic",
]

_FRESH: dict[str, type] = {
    k.__name__: k
    for k in (asyncio.Event, asyncio.Queue, asyncio.Lock, asyncio.Condition, asyncio.Semaphore)
}
_FRESH_NAME = {kind: name for name, kind in _FRESH.items()}
_NONE = (asyncio.AbstractEventLoop, asyncio.Future, asyncio.Handle)
#: modules whose classes a checkpoint may hold (rebuilt with ``cls.__new__``, no constructor)
_PROJECT = ("foltr_async.",)
#: array and scalar dtypes a checkpoint may hold: numbers, booleans, fixed-width text
_DTYPE = re.compile(r"[<>|](b1|[iu][1248]|f[248]|c(8|16)|[US][0-9]{1,6})")
_BIT_GENERATORS = {
    k.__name__: k
    for k in (
        np.random.PCG64,
        np.random.PCG64DXSM,
        np.random.Philox,
        np.random.SFC64,
        np.random.MT19937,
    )
}
#: the header of a checkpoint file: format name, then the payload's SHA-256, then the payload
#: (4: protocol classes are named ``foltr_async.protocols.*``, no longer ``protocols.*``)
MAGIC = b"foltr-async checkpoint 4\n"
_DIGEST = 32

# node tags: a node is a msgpack list [tag, ...]; scalars, strings and bytes stand for themselves
_TUPLE, _LIST, _DICT, _SET, _COUNTER = 1, 2, 3, 4, 5
_BIGINT, _ARRAY, _VIEW, _SCALAR, _GENERATOR = 6, 7, 8, 9, 10
_OBJECT, _REF, _SHARED, _FRESH_TAG, _SLICE, _METHOD, _FROZENSET = 11, 12, 13, 14, 15, 16, 17
_PLAIN = (type(None), bool, float, str, bytes)


class CheckpointError(FoltrError):
    """A checkpoint cannot be taken, read, or does not fit the run it is loaded into."""


def _project_class(cls: type) -> bool:
    """A class of this project whose instances are their attributes: defined at the top level
    of a project module, built on ``object`` only (no builtin container's hidden contents),
    ``__new__`` only allocating."""
    return (
        cls.__module__.startswith(_PROJECT)
        and "." not in cls.__qualname__
        and all(
            k is object or k.__module__.startswith(_PROJECT) or k.__module__ in ("abc", "typing")
            for k in cls.__mro__
        )
        and all("__new__" not in vars(k) or k is object for k in cls.__mro__)
    )


def _slots(cls: type) -> dict[str, MemberDescriptorType]:
    """The slot descriptors of ``cls`` and its bases, by name."""
    out = {}
    for k in cls.__mro__:
        for name in vars(k).get("__slots__", ()):
            desc = inspect.getattr_static(cls, name, None)
            if type(desc) is MemberDescriptorType:
                out[name] = desc
    return out


def _attributes(obj: Any) -> dict[str, Any]:
    """An object's attributes: its ``__dict__`` and the slots that are set."""
    attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for name, desc in _slots(type(obj)).items():
        with contextlib.suppress(AttributeError):  # a slot never set
            attrs[name] = desc.__get__(obj)
    return attrs


def _dtype_name(dt: np.dtype) -> str:
    name = dt.str
    if not _DTYPE.fullmatch(name):
        raise CheckpointError(f"cannot checkpoint data of dtype {dt}")
    return name


class _Writer:
    """Encodes a value as a tree of msgpack-ready nodes.

    With ``keep`` (the ids of the arrays the value contains), a view of one of them is written
    as a view; otherwise as a copy, and ``views_of_own`` tells whether a second pass with
    ``keep`` is needed (a view whose base is written too).
    """

    def __init__(self, names: dict[int, str], keep: set[int] | None) -> None:
        self.names = names
        self.keep = keep
        self.memo: dict[int, int] = {}
        self.alive: list[Any] = []  # what the memo's ids refer to, kept alive while writing
        self.open: set[int] = set()  # tuples, frozensets being written (holding itself: refused)
        self.arrays: set[int] = set()
        self.bases: set[int] = set()

    @property
    def views_of_own(self) -> bool:
        return not self.bases.isdisjoint(self.arrays)

    def _remember(self, obj: Any) -> None:
        self.memo[id(obj)] = len(self.alive)
        self.alive.append(obj)

    def node(self, v: Any) -> Any:
        t = type(v)
        if t in _PLAIN:
            return v
        if t is int:
            if -(2**63) <= v < 2**64:
                return v
            return [_BIGINT, v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)]
        name = self.names.get(id(v))
        if name is not None:
            return [_SHARED, name]
        index = self.memo.get(id(v))
        if index is not None:
            return [_REF, index]
        if t is tuple or t is frozenset:
            if id(v) in self.open:
                raise CheckpointError(f"cannot checkpoint a {t.__name__} that contains itself")
            self.open.add(id(v))
            try:
                return [_TUPLE if t is tuple else _FROZENSET, *map(self.node, v)]
            finally:
                self.open.discard(id(v))
        if t in _FRESH_NAME:
            return [_FRESH_TAG, _FRESH_NAME[t]]
        if isinstance(v, _NONE):
            return None
        if t is MethodType and _method(type(v.__self__), v.__func__.__name__) is v.__func__:
            return [_METHOD, self.node(v.__self__), v.__func__.__name__]
        if t is slice:
            return [_SLICE, *map(self.node, (v.start, v.stop, v.step))]
        if isinstance(v, np.generic) and not isinstance(v, np.object_):
            return [_SCALAR, _dtype_name(v.dtype), v.tobytes()]
        self._remember(v)
        if t is list:
            return [_LIST, *map(self.node, v)]
        if t is dict or t is collections.Counter:
            out = [_DICT if t is dict else _COUNTER]
            for k, x in v.items():
                out += (self.node(k), self.node(x))
            return out
        if t is set:
            return [_SET, *map(self.node, v)]
        if t is np.ndarray:
            return self._array(v)
        if t is np.random.Generator:
            return self._generator(v)
        if _project_class(t):
            out = [_OBJECT, t.__module__, t.__qualname__]
            for k, x in _attributes(v).items():
                out += (k, self.node(x))
            return out
        raise CheckpointError(f"cannot checkpoint a {t.__module__}.{t.__qualname__}")

    def _array(self, a: np.ndarray) -> list:
        self.arrays.add(id(a))
        base = a.base
        if type(base) is np.ndarray:
            if self.keep is None:
                self.bases.add(id(base))
            elif id(base) in self.keep:
                start = _slice_start(base, a)
                if start is not None:
                    return [_VIEW, self.node(base), start, list(a.shape)]
        return [_ARRAY, _dtype_name(a.dtype), list(a.shape), np.ascontiguousarray(a).tobytes()]

    def _generator(self, g: np.random.Generator) -> list:
        bits = g.bit_generator
        if _BIT_GENERATORS.get(type(bits).__name__) is not type(bits):
            raise CheckpointError(f"cannot checkpoint a generator on {type(bits).__name__}")
        seq = bits.seed_seq
        seeds = None
        if isinstance(seq, np.random.SeedSequence):
            entropy = seq.entropy
            if isinstance(entropy, np.ndarray | list | tuple):
                entropy = [int(x) for x in entropy]
            spawn_key = [int(x) for x in seq.spawn_key]
            seeds = [entropy, spawn_key, seq.pool_size, seq.n_children_spawned]
        return [_GENERATOR, type(bits).__name__, self.node(bits.state), self.node(seeds)]


def _slice_start(base: np.ndarray, view: np.ndarray) -> int | None:
    """Where ``view`` starts in ``base`` (in elements) when it is a contiguous run of it."""
    if not (base.flags.c_contiguous and view.flags.c_contiguous and view.dtype == base.dtype):
        return None
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    start, rest = divmod(offset, base.itemsize)
    return start if rest == 0 and start >= 0 and start + view.size <= base.size else None


def _bad(what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint data holds {what}, which a checkpoint may not hold")


class _Reader:
    """Builds the value a ``_Writer`` tree describes; anything else is a CheckpointError."""

    def __init__(self, shared: Mapping[str, Any]) -> None:
        self.shared = shared
        self.memo: list[Any] = []

    def value(self, node: Any) -> Any:
        if type(node) in _PLAIN or type(node) is int:
            return node
        if type(node) is not list or not node or type(node[0]) is not int:
            raise _bad(f"a {type(node).__name__} node")
        tag = node[0]
        if tag == _TUPLE:
            return tuple(map(self.value, node[1:]))
        if tag == _FROZENSET:
            return frozenset(map(self.value, node[1:]))
        if tag == _REF:
            index = node[1] if len(node) == 2 else None
            if type(index) is not int or not 0 <= index < len(self.memo):
                raise _bad("a reference to nothing")
            return self.memo[index]
        if tag == _SHARED:
            name = node[1] if len(node) == 2 else None
            if type(name) is not str or name not in self.shared:
                raise CheckpointError(f"checkpoint refers to {name!r}, which this run lacks")
            return self.shared[name]
        if tag == _BIGINT and len(node) == 2 and type(node[1]) is bytes:
            return int.from_bytes(node[1], "little", signed=True)
        if tag == _FRESH_TAG and len(node) == 2 and node[1] in _FRESH:
            return _FRESH[node[1]]()
        if tag == _SLICE and len(node) == 4 and all(type(x) in (int, type(None)) for x in node[1:]):
            return slice(*node[1:])
        if tag == _METHOD and len(node) == 3:
            owner = self.value(node[1])
            func = _method(type(owner), node[2])
            if func is None:
                raise _bad(f"a method {str(node[2])[:40]!r} of a {type(owner).__name__}")
            return MethodType(func, owner)
        if tag == _SCALAR and len(node) == 3:
            return _numbers(node[1], [], node[2])[()]
        build = self._containers.get(tag)
        if build is None:
            raise _bad(f"the tag {tag}")
        return build(self, node)

    def _remember(self, obj: Any) -> Any:
        self.memo.append(obj)
        return obj

    def _list(self, node: list) -> list:
        out = self._remember([])
        out.extend(map(self.value, node[1:]))
        return out

    def _dict(self, node: list) -> dict:
        out = self._remember(dict() if node[0] == _DICT else collections.Counter())
        if len(node) % 2 != 1:
            raise _bad("a table with a key and no value")
        for i in range(1, len(node), 2):
            key = self.value(node[i])
            out[key] = self.value(node[i + 1])
        return out

    def _set(self, node: list) -> set:
        out = self._remember(set())
        out.update(map(self.value, node[1:]))
        return out

    def _array(self, node: list) -> np.ndarray:
        if len(node) != 4:
            raise _bad("a malformed array")
        return self._remember(_numbers(node[1], node[2], node[3]))

    def _view(self, node: list) -> np.ndarray:
        if len(node) != 4 or type(node[2]) is not int:
            raise _bad("a malformed view")
        index = len(self.memo)
        self.memo.append(None)  # the view's place, taken before its base's
        base, start, shape = self.value(node[1]), node[2], _shape(node[3])
        size = int(np.prod(shape, dtype=object))
        if type(base) is not np.ndarray or not 0 <= start <= base.size - size:
            raise _bad("a view outside its array")
        self.memo[index] = view = base.reshape(-1)[start : start + size].reshape(shape)
        return view

    def _generator(self, node: list) -> np.random.Generator:
        if len(node) != 4 or node[1] not in _BIT_GENERATORS:
            raise _bad("a generator of an unknown kind")
        index = len(self.memo)
        self.memo.append(None)
        state, seeds = self.value(node[2]), self.value(node[3])
        bits = _BIT_GENERATORS[node[1]](_seed_sequence(seeds))
        if type(state) is not dict:
            raise _bad("a generator without a state table")
        bits.state = state  # numpy checks the kind, the keys and the ranges
        self.memo[index] = gen = np.random.Generator(bits)
        return gen

    def _object(self, node: list) -> Any:
        if len(node) < 3 or len(node) % 2 != 1:
            raise _bad("a malformed object")
        cls = _class(node[1], node[2])
        obj = self._remember(cls.__new__(cls))
        slots = _slots(cls)
        for i in range(3, len(node), 2):
            name, value = node[i], self.value(node[i + 1])
            if type(name) is not str or (name.startswith("__") and name.endswith("__")):
                raise _bad(f"an attribute named {str(name)[:40]!r}")
            if name in slots:
                slots[name].__set__(obj, value)
            elif hasattr(obj, "__dict__"):
                vars(obj)[name] = value
            else:
                raise _bad(f"an attribute {name!r} a {cls.__name__} cannot have")
        return obj

    _containers = {
        _LIST: _list,
        _DICT: _dict,
        _COUNTER: _dict,
        _SET: _set,
        _ARRAY: _array,
        _VIEW: _view,
        _GENERATOR: _generator,
        _OBJECT: _object,
    }


def _shape(shape: Any) -> tuple[int, ...]:
    if (
        type(shape) is not list
        or len(shape) > 32
        or any(type(n) is not int or n < 0 for n in shape)
    ):
        raise _bad(f"the array shape {str(shape)[:40]}")
    return tuple(shape)


def _numbers(dtype: Any, shape: Any, raw: Any) -> np.ndarray:
    """A fresh writable array of a numeric or text dtype from its bytes, sizes checked."""
    if type(dtype) is not str or not _DTYPE.fullmatch(dtype) or type(raw) is not bytes:
        raise _bad(f"an array of dtype {str(dtype)[:20]!r}")
    dt, shape = np.dtype(dtype), _shape(shape)
    if len(raw) != int(np.prod(shape, dtype=object)) * dt.itemsize:
        raise _bad(f"{len(raw)} bytes for a {dtype} array of shape {list(shape)}")
    return np.frombuffer(bytearray(raw), dtype=dt).reshape(shape)


def _seed_sequence(seeds: Any) -> np.random.SeedSequence | None:
    if seeds is None:
        return None
    ok = type(seeds) is list and len(seeds) == 4
    if ok:
        entropy, key, pool, children = seeds
        ok = (
            (entropy is None or _naturals([entropy]) or _naturals(entropy))
            and _naturals(key)
            and type(pool) is int
            and 4 <= pool <= 64
            and type(children) is int
            and children >= 0
        )
    if not ok:
        raise _bad("a malformed seed sequence")
    return np.random.SeedSequence(
        entropy, spawn_key=tuple(key), pool_size=pool, n_children_spawned=children
    )


def _naturals(xs: Any) -> bool:
    return type(xs) is list and len(xs) <= 64 and all(type(x) is int and x >= 0 for x in xs)


def _method(cls: type, name: Any) -> FunctionType | None:
    """A plain function a project class defines (looked up without running code: a property's
    getter would), which a checkpoint may hold bound to an object (a callback)."""
    func = inspect.getattr_static(cls, name, None) if type(name) is str else None
    ok = type(func) is FunctionType and func.__module__.startswith(_PROJECT)
    return func if ok else None


def _class(module: Any, name: Any) -> type:
    """A project class named by the data, from an already imported module (importing one
    would run it); nothing else."""
    cls = None
    if type(module) is str and type(name) is str and "." not in name:
        cls = getattr(sys.modules.get(module), name, None)
    if not (isinstance(cls, type) and cls.__module__ == module and _project_class(cls)):
        raise _bad(f"an object of {str(module)[:60]}.{str(name)[:60]}")
    return cls


class Checkpointed:
    """A run object whose state a checkpoint saves between rounds and loads into the rebuilt run.

    The class declares which of its attributes are state, so the run needs no list of other
    classes' fields: ``checkpoint_fields`` names them (every other attribute is machinery the
    rebuilt run makes afresh), or, left None, every attribute but ``checkpoint_skip`` is state.
    The freshly built object's values give each field's type, dtype and shape (``restore``).
    A class whose state is more than its attributes as they are overrides the two methods.
    """

    checkpoint_fields: ClassVar[tuple[str, ...] | None] = None
    checkpoint_skip: ClassVar[tuple[str, ...]] = ()

    def checkpoint_state(self, shared: Mapping[str, Any]) -> Any:
        """This object's state, the run's machinery in ``shared`` by name."""
        return capture(self, shared)

    def restore_state(self, state: Any, shared: Mapping[str, Any]) -> None:
        """Load ``checkpoint_state`` output into this freshly built object."""
        restore(self, state, shared)


def _is_state(cls: type, name: str) -> bool:
    fields = getattr(cls, "checkpoint_fields", None)
    return name in fields if fields is not None else name not in getattr(cls, "checkpoint_skip", ())


def capture(obj: Any, shared: Mapping[str, Any]) -> bytes:
    """Encode ``obj``'s state attributes (as its class declares them, see ``Checkpointed``;
    every attribute when it declares nothing), machinery in ``shared`` by name."""
    cls = type(obj)
    return dumps({k: v for k, v in vars(obj).items() if _is_state(cls, k)}, shared)


def dumps(value: Any, shared: Mapping[str, Any]) -> bytes:
    """Encode any value with the same rules as ``capture`` (msgpack bytes)."""
    names = {id(v): k for k, v in shared.items() if type(v) not in _PLAIN and type(v) is not int}
    keep: set[int] | None = None
    while True:
        writer = _Writer(names, keep)
        try:
            tree = writer.node(value)
        except RecursionError:
            raise CheckpointError(
                f"cannot checkpoint {type(value).__name__}: nested too deep"
            ) from None
        if keep is not None or not writer.views_of_own:
            return msgpack.packb(tree, use_bin_type=True)
        keep = writer.arrays  # again, keeping views of arrays written alongside


def loads(data: bytes, shared: Mapping[str, Any]) -> Any:
    """Inverse of ``dumps`` against a fresh run's ``shared`` map; any other bytes raise
    CheckpointError (nothing runs)."""
    try:
        tree = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
        return _Reader(shared).value(tree)
    except CheckpointError:
        raise
    except Exception as e:  # RecursionError too: nested too deep
        text = " ".join(str(e).split())[:160]
        raise CheckpointError(f"unreadable checkpoint data ({type(e).__name__}: {text})") from None


def restore(obj: Any, data: bytes, shared: Mapping[str, Any]) -> None:
    """Load attributes captured by ``capture`` into ``obj`` (a fresh object of the same kind),
    after checking each against the class's state fields and the fresh object's value."""
    state = loads(data, shared)
    cls = type(obj)
    if type(state) is not dict:
        raise CheckpointError(f"{cls.__name__}: expected a table of fields, got {_kind(state)}")
    fresh = vars(obj)
    for name, value in state.items():
        if type(name) is not str or not _is_state(cls, name):
            raise CheckpointError(f"{cls.__name__}.{name}: not a state field of {cls.__name__}")
        if name in fresh:
            conform(value, fresh[name], f"{cls.__name__}.{name}")
    fresh.update(state)


def _kind(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"a {v.dtype} array of shape {v.shape}"
    return f"a {type(v).__name__}"


def _number(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


def conform(value: Any, fresh: Any, where: str) -> None:
    """Check a loaded value against the freshly built one it replaces: the same type (any
    number for a number; None on either side is an unset field), arrays of the same dtype and
    shape, and so on into dict entries, list items and project objects' attributes both have."""
    seen: set[int] = set()

    def check(v: Any, f: Any, path: str) -> None:
        if v is None or f is None or v is f or (_number(v) and _number(f)) or id(v) in seen:
            return
        seen.add(id(v))
        if type(v) is not type(f) or (
            type(f) is np.ndarray and (v.dtype != f.dtype or v.shape != f.shape)
        ):
            raise CheckpointError(f"{path}: expected {_kind(f)}, got {_kind(v)}")
        if type(f) in (dict, collections.Counter):
            for k in f:
                if k in v:
                    check(v[k], f[k], f"{path}[{k!r}]")
        elif type(f) in (list, tuple):
            for i, (a, b) in enumerate(zip(v, f, strict=False)):
                check(a, b, f"{path}[{i}]")
        elif _project_class(type(f)):
            mine = _attributes(v)
            for k, b in _attributes(f).items():
                if k in mine:
                    check(mine[k], b, f"{path}.{k}")

    check(value, fresh, where)


def write_atomic(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` as a checkpoint file: temporary file, fsync, rename (never
    half a checkpoint)."""
    payload = dumps(value, {})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(MAGIC + hashlib.sha256(payload).digest())
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        try:  # the rename itself survives a power cut only once the directory is synced
            fd = os.open(path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        tmp.unlink(missing_ok=True)


def read_checkpoint(path: Path) -> Any:
    """The value ``write_atomic`` stored, once its checksum matches (a CheckpointError names
    the file otherwise)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint here") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    if data[:1] == b"\x80":
        raise CheckpointError(
            f"{path}: a checkpoint in the old pickle format, which this version does not read "
            "(the format changed to plain data): run the scenario again from the start"
        )
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a checkpoint file (expected {MAGIC[:-1].decode()})")
    digest, payload = data[len(MAGIC) : len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST :]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(
            f"{path}: checksum mismatch: the file changed after it was written (damaged, "
            "truncated or edited)"
        )
    try:
        return loads(payload, {})
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
