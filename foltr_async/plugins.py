"""The one place the registries are filled: the built-in protocol modules and the
``FOLTR_ASYNC_PLUGINS`` modules, each declaring what it provides in its ``PROVIDES``.

Importing a module changes no registry; ``load_plugins`` imports the modules named below (then
the plugins) and installs every entry of their ``PROVIDES`` where it belongs (``install``).
Apart from the registry on purpose: the registry is what protocols import, and this is what
imports them, so nothing a protocol imports ever imports a protocol back. Entry points call it
before names are looked up: ``load_scenario`` (so every command and ZeroMQ worker reading a
scenario), ``list``, a ``--jobs`` child, the bench suites.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from foltr_async.errors import FoltrError
from foltr_async.registry import PLUGINS_ENV, REGISTRY, Registry

#: The built-in modules, in the order they are installed (each has a ``PROVIDES``).
BUILTIN = (
    "foltr_async.protocols.aggregation",
    "foltr_async.protocols.fpdgd",
    "foltr_async.protocols.fpdgd_async",
    "foltr_async.protocols.foltr_es",
    "foltr_async.protocols.pdgd_central",
    "foltr_async.protocols.fedips",
    "foltr_async.protocols.noniid",
    "foltr_async.protocols.attacks",
    "foltr_async.protocols.eavesdrop",
    "foltr_async.protocols.audit",
    "foltr_async.protocols.secagg",
    "foltr_async.protocols.csfltr",
)


def install(entry: Any, source: str) -> None:
    """Put one provided entry into its section of the registry: each entry type knows its own
    (``entry.install(REGISTRY)``; again the same entry: nothing changes)."""
    put = getattr(entry, "install", None)
    if not callable(put):
        raise FoltrError(
            f"{source}: PROVIDES: {entry!r} is none of Kind, ProtocolEntry, BehaviourEntry, "
            "AggregatorEntry, PartitionEntry, Scheme or a TapEavesdropper class"
        )
    put(REGISTRY)


def load_module(module: ModuleType, source: str) -> None:
    """Install everything ``module`` declares in its ``PROVIDES``."""
    provides = vars(module).get("PROVIDES")
    if not isinstance(provides, tuple | list):
        raise FoltrError(
            f"{source}: module {module.__name__!r} declares nothing: expected a module-level "
            "PROVIDES tuple of what it adds (docs/EXTENDING.md)"
        )
    for entry in provides:
        try:
            install(entry, source)
        except ValueError as e:  # a name or kind that another module already took
            raise FoltrError(f"{source}: {module.__name__}: {e}") from None


def load_plugins(named: Sequence[str] = (), source: str = "") -> Registry:
    """Import the built-in modules, the ``FOLTR_ASYNC_PLUGINS`` ones and ``named`` (a scenario
    file's ``[plugins] modules``; ``source`` is that file) and install what they provide;
    return the filled registry. A ``named`` module joins ``FOLTR_ASYNC_PLUGINS`` in this
    process's environment, so the processes it starts (``--jobs``, local ZeroMQ workers) load
    it too."""
    for name in BUILTIN:
        load_module(importlib.import_module(name), name)
    env = [n for n in (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",")) if n]
    for name in env:
        load_module(_import(name, f"{PLUGINS_ENV}: cannot import"), PLUGINS_ENV)
    where = f"{source}: plugins.modules"
    for name in named:
        load_module(_import(name, f"{where}: cannot import"), where)
        if name not in env:
            env.append(name)
            os.environ[PLUGINS_ENV] = ",".join(env)
    return REGISTRY


def _import(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise FoltrError(
            f"{what} {name!r}: {e} (a module importable from the current folder or installed)"
        ) from None
