"""Checkpoints: the state of objects as bytes, and atomic checkpoint files.

Agents, strategies and buses are ordinary Python objects whose state (weights, random
generators, stored unlearning updates, counters) lives in their attributes, tangled with the
run's machinery (the bus, the run context, the shared read-only dataset, asyncio primitives).
``capture`` pickles an object's attributes while replacing every piece of machinery by a
*name*; ``restore`` loads them into a freshly built object of the same run, resolving each name
to the fresh run's own machinery. So a protocol needs no ``state()/restore()`` methods: building
the run again from the same scenario and seed gives the skeleton, the checkpoint its state.
Which attributes are state is the class's own declaration (``Checkpointed``): the run saves
each of its objects without knowing their fields.

Rules the pickler follows:

- objects listed in ``shared`` (name -> object) travel as their name; on restore the name must
  be in the fresh ``shared`` map (a missing name is an error, not a silent copy);
- asyncio primitives travel as "make a fresh one" (an ``Event`` or ``Queue`` restores empty;
  tasks, futures, handles and loops restore as None): a checkpoint is taken between rounds, when
  no handler is running;
- a numpy view whose base array is pickled too stays a view of it (e.g. an MLP's layer views
  into its flat parameter vector); a view of anything else is copied;
- everything else is pickled by value, identity preserved within one ``capture``.

Loading never runs code a pickle names: agent state travels between processes (a worker's
snapshot to the server, a checkpoint back to a worker on ``--resume``), so ``loads`` and
``read_checkpoint`` accept only the project's own classes (rebuilt without calling their
constructors) and a short list of library callables whose arguments are checked (numpy arrays,
dtypes and random generators, ``collections`` containers, the registered reducers). Anything
else (``os.system``, ``builtins.exec``, a project function, a constructor call) is refused
with a ``CheckpointError`` naming it. ``write_atomic`` writes via a temporary file, fsync and
rename, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import io
import os
import pickle
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FunctionType, NoneType
from typing import Any, ClassVar

import numpy as np

from foltr_async.errors import FoltrError

__all__ = [
    "CheckpointError",
    "Checkpointed",
    "capture",
    "dumps",
    "loads",
    "read_checkpoint",
    "register_reducer",
    "restore",
    "write_atomic",
]

_FRESH = {
    asyncio.Event: asyncio.Event,
    asyncio.Queue: asyncio.Queue,
    asyncio.Lock: asyncio.Lock,
    asyncio.Condition: asyncio.Condition,
    asyncio.Semaphore: asyncio.Semaphore,
}
_NONE = (asyncio.AbstractEventLoop, asyncio.Future, asyncio.Handle)


class CheckpointError(FoltrError):
    """A checkpoint cannot be taken, read, or does not fit the run it is loaded into."""


#: type -> reducer for objects pickle cannot handle by itself (``register_reducer``).
_REDUCERS: dict[type, Any] = {}
#: callable -> check of its arguments: what a loaded checkpoint may call (``_SafeUnpickler``).
_CALLS: dict[Any, Callable[[tuple], bool]] = {}


def register_reducer(
    kind: type, reduce: Any, rebuild: Any = None, check: Callable[[tuple], bool] | None = None
) -> None:
    """Teach checkpoints an extra type: ``reduce(obj) -> (rebuild, args)`` as in ``copyreg``;
    loading calls ``rebuild`` only with arguments ``check(args)`` accepts."""
    _REDUCERS[kind] = reduce
    if rebuild is not None:
        _CALLS[rebuild] = check or (lambda args: False)


def _x25519_keys() -> None:
    """Secure aggregation keeps X25519 keys between rounds; they restore from their raw bytes."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import x25519
    except ImportError:  # pragma: no cover - cryptography is optional for the runtime
        return
    raw = serialization.Encoding.Raw
    one_key = _types(bytes)
    private, public = x25519.X25519PrivateKey, x25519.X25519PublicKey
    register_reducer(
        private,
        lambda k: (
            private.from_private_bytes,
            (k.private_bytes(raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()),),
        ),
        private.from_private_bytes,
        one_key,
    )
    register_reducer(
        public,
        lambda k: (
            public.from_public_bytes,
            (k.public_bytes(raw, serialization.PublicFormat.Raw),),
        ),
        public.from_public_bytes,
        one_key,
    )
    # a classmethod pickles as getattr(class, name): allowed for these two only
    _GETATTR.update({(private, "from_private_bytes"), (public, "from_public_bytes")})


def _types(*kinds: Any) -> Callable[[tuple], bool]:
    """An argument check: exactly these positional types."""
    return lambda args: (
        len(args) == len(kinds) and all(isinstance(a, k) for a, k in zip(args, kinds, strict=True))
    )


_GETATTR: set[tuple[type, str]] = set()


_x25519_keys()


def _reduce_registered(obj: Any) -> Any:
    for kind, reduce in _REDUCERS.items():
        if isinstance(obj, kind):
            return reduce(obj)
    return NotImplemented


def _view_of(base: np.ndarray, offset: int, shape: tuple, strides: tuple, dtype: np.dtype):
    return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)


def _library_calls() -> None:
    """The library callables checkpoints of this project's runs contain, with their checks."""
    from numpy._core.multiarray import scalar
    from numpy._core.numeric import _frombuffer
    from numpy.random import BitGenerator, SeedSequence
    from numpy.random import _pickle as rp
    from numpy.random.bit_generator import __pyx_unpickle_SeedSequence as unpickle_seeds

    def bit_generator(args: tuple) -> bool:
        return len(args) == 1 and (
            args[0] in rp.BitGenerators
            or (isinstance(args[0], type) and issubclass(args[0], BitGenerator))
        )

    def generator(args: tuple) -> bool:
        return len(args) == 1 and (isinstance(args[0], BitGenerator) or bit_generator(args))

    def frombuffer(args: tuple) -> bool:
        return (
            len(args) == 4
            and isinstance(args[0], bytes | bytearray | pickle.PickleBuffer)
            and isinstance(args[1], np.dtype)
            and isinstance(args[2], tuple)
            and args[3] in ("C", "F")
        )

    _CALLS.update(
        {
            np.dtype: lambda args: all(isinstance(a, str | bool | int) for a in args),
            _frombuffer: frombuffer,
            scalar: lambda args: (
                len(args) == 2
                and isinstance(args[0], np.dtype)
                and args[0].kind in "biufc"
                and isinstance(args[1], bytes)
            ),
            rp.__bit_generator_ctor: bit_generator,
            rp.__generator_ctor: generator,
            unpickle_seeds: lambda args: len(args) == 3 and args[0] is SeedSequence,
            collections.Counter: lambda args: (
                args == () or (len(args) == 1 and type(args[0]) is dict)
            ),
            collections.OrderedDict: lambda args: args == (),
            collections.deque: lambda args: (
                len(args) <= 2 and all(isinstance(a, list | int | type(None)) for a in args)
            ),
            _view_of: _types(np.ndarray, int, tuple, tuple, np.dtype),
            slice: lambda args: len(args) == 3 and all(type(a) in (int, NoneType) for a in args),
            range: lambda args: len(args) == 3 and all(type(a) is int for a in args),
            complex: lambda args: len(args) == 2 and all(type(a) is float for a in args),
        }
    )


_library_calls()
#: (module, name) of every allowed callable that is not a project class
_GLOBALS = {(f.__module__, f.__qualname__): f for f in _CALLS if hasattr(f, "__qualname__")}
#: modules whose classes a checkpoint may rebuild (with ``cls.__new__``, no constructor)
_PROJECT = ("foltr_async.", "protocols.")
#: numpy classes a checkpoint may name as an argument (a bit generator's), never build itself:
#: some take a file name in ``__new__`` (``numpy.memmap``)
_NUMPY = "numpy."
_GETATTR_CLASSES = {(c.__module__, c.__qualname__): c for c, _ in _GETATTR}


class _Pickler(pickle.Pickler):
    """Machinery by name, asyncio primitives fresh; records arrays and views as it goes.

    With ``keep_views`` (the ids of arrays the value contains), a view of one of them is
    pickled as a view; otherwise as a copy, and ``views_of_own`` tells whether a second pass
    with ``keep_views`` is needed (a view whose base was pickled too).
    """

    def __init__(self, fh, names: dict[int, str], keep_views: set[int] | None) -> None:
        super().__init__(fh, protocol=pickle.HIGHEST_PROTOCOL)
        self._names = names
        self._keep = keep_views
        self.arrays: set[int] = set()
        self.bases: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        name = self._names.get(id(obj))
        if name is not None:
            return ("shared", name)
        make = _FRESH_BY_TYPE.get(type(obj))
        if make is not None:
            return ("fresh", make)
        if isinstance(obj, _NONE):
            return ("none", "")
        return None

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray:
            self.arrays.add(id(obj))
            base = obj.base
            if type(base) is np.ndarray:
                keep = self._keep
                if keep is None:
                    self.bases.add(id(base))
                elif id(base) in keep and base.flags.c_contiguous:
                    start = base.__array_interface__["data"][0]
                    offset = obj.__array_interface__["data"][0] - start
                    return _view_of, (base, offset, obj.shape, obj.strides, obj.dtype)
            return NotImplemented
        return _reduce_registered(obj)

    @property
    def views_of_own(self) -> bool:
        return not self.bases.isdisjoint(self.arrays)


_FRESH_BY_TYPE = {kind: make.__name__ for kind, make in _FRESH.items()}


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint data names {what}, which a checkpoint may not load")


class _SafeUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every way a pickle can call something checked.

    ``find_class`` gives out a project class (defined in an already imported ``foltr_async``
    or ``protocols`` module, since importing would run the module, and allocated by a builtin
    ``__new__``), a numpy class (as an argument only), or a callable of ``_CALLS``. REDUCE
    calls only ``_CALLS`` entries whose check accepts the arguments (and ``getattr`` only for
    a listed classmethod or a plain method of a shared object); NEWOBJ builds only project
    classes given out (``cls.__new__``: no constructor runs); INST, OBJ (protocol 0/1
    constructor calls) and NEWOBJ_EX (keyword arguments to ``__new__``; never written here)
    are refused.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, fh, shared: Mapping[str, Any]) -> None:
        super().__init__(fh)
        self._shared = shared
        self._classes: set[type] = set()

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name == "getattr":
            return getattr  # REDUCE allows it for the ``_GETATTR`` pairs only
        known = _GLOBALS.get((module, name)) or _GETATTR_CLASSES.get((module, name))
        if known is not None:
            return known
        obj = getattr(sys.modules.get(module), name, None) if "." not in name else None
        if isinstance(obj, type) and obj.__module__ == module:
            if module.startswith(_PROJECT) and _builtin_new(obj):
                self._classes.add(obj)
                return obj
            if module.startswith(_NUMPY):
                return obj
        raise _refuse(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        kind, name = pid if isinstance(pid, tuple) and len(pid) == 2 else (None, None)
        if kind == "shared":
            if name not in self._shared:
                raise CheckpointError(f"checkpoint refers to {name!r}, which this run lacks")
            return self._shared[name]
        if kind == "fresh":
            fresh = {make.__name__: make for make in _FRESH.values()}
            if name not in fresh:
                raise _refuse(f"a fresh {name!r}")
            return fresh[name]()
        if kind == "none":
            return None
        raise _refuse(f"the reference {pid!r}")

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if func is getattr:
            ok = len(args) == 2 and (
                (args[0], args[1]) in _GETATTR or self._method_of_shared(*args)
            )
        else:
            check = _CALLS.get(func) if _hashable(func) else None
            ok = check is not None and isinstance(args, tuple) and check(args)
        if not ok:
            if func is getattr and len(args) == 2:
                raise _refuse(f"getattr({type(args[0]).__name__}, {str(args[1])[:40]!r})")
            name = getattr(func, "__qualname__", type(func).__name__)
            raise _refuse(f"a call of {name} with {len(args)} arguments")
        self.stack[-1] = func(*args)

    def _method_of_shared(self, obj: Any, name: Any) -> bool:
        """A bound method of the run's machinery (e.g. a callback an agent keeps), looked up
        without running code (a property's getter would)."""
        return (
            any(obj is v for v in self._shared.values())
            and type(name) is str
            and isinstance(inspect.getattr_static(type(obj), name, None), FunctionType)
        )

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack[-1]
        if cls not in self._classes or not isinstance(args, tuple):
            raise _refuse(f"an object of {cls!r}")
        self.stack[-1] = cls.__new__(cls, *args)

    def _refused_opcode(self) -> None:
        raise _refuse("a constructor call (INST, OBJ or NEWOBJ_EX)")

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _refused_opcode
    dispatch[pickle.INST[0]] = _refused_opcode
    dispatch[pickle.OBJ[0]] = _refused_opcode


def _builtin_new(cls: type) -> bool:
    """Whether ``cls.__new__`` only allocates (no class on the way defines its own)."""
    return all("__new__" not in vars(k) or k.__module__ == "builtins" for k in cls.__mro__)


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


class Checkpointed:
    """A run object whose state a checkpoint saves between rounds and loads into the rebuilt run.

    The class declares which of its attributes are state, so the run needs no list of other
    classes' fields: ``checkpoint_fields`` names them (every other attribute is machinery the
    rebuilt run makes afresh), or, left None, every attribute but ``checkpoint_skip`` is state.
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


def capture(obj: Any, shared: Mapping[str, Any]) -> bytes:
    """Pickle ``obj``'s state attributes (as its class declares them, see ``Checkpointed``;
    every attribute when it declares nothing), machinery in ``shared`` by name."""
    fields = getattr(type(obj), "checkpoint_fields", None)
    skip = set(getattr(type(obj), "checkpoint_skip", ()))
    state = {
        k: v for k, v in vars(obj).items() if (k in fields if fields is not None else k not in skip)
    }
    return dumps(state, shared)


def dumps(value: Any, shared: Mapping[str, Any]) -> bytes:
    """Pickle any value with the same rules as ``capture``."""
    names = {id(v): k for k, v in shared.items()}
    keep: set[int] | None = None
    while True:
        fh = io.BytesIO()
        pickler = _Pickler(fh, names, keep)
        try:
            pickler.dump(value)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise CheckpointError(f"cannot checkpoint {type(value).__name__}: {e}") from None
        if keep is not None or not pickler.views_of_own:
            return fh.getvalue()
        keep = pickler.arrays  # again, keeping views of arrays pickled alongside


def loads(data: bytes, shared: Mapping[str, Any]) -> Any:
    """Inverse of ``dumps`` against a fresh run's ``shared`` map; data that names anything a
    checkpoint may not load, or is no pickle, raises CheckpointError (nothing runs)."""
    try:
        return _SafeUnpickler(io.BytesIO(data), shared).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"unreadable checkpoint data ({type(e).__name__}: {e})") from None


def restore(obj: Any, data: bytes, shared: Mapping[str, Any]) -> None:
    """Load attributes captured by ``capture`` into ``obj`` (a fresh object of the same kind)."""
    vars(obj).update(loads(data, shared))


def write_atomic(path: Path, value: Any) -> None:
    """Pickle ``value`` to ``path``: temporary file, fsync, rename (never half a checkpoint)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            pickle.dump(value, fh, protocol=pickle.HIGHEST_PROTOCOL)
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
    """The value ``write_atomic`` stored (a CheckpointError names the file when unreadable)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint here") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    try:
        return loads(data, {})
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
