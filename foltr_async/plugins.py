"""Loading the protocols and the ``FOLTR_ASYNC_PLUGINS`` modules, so their names register.

Apart from the registry on purpose: the registry is what protocols import, and this is what
imports them, so nothing a protocol imports ever imports a protocol back. Entry points call
it before names are looked up: ``load_scenario`` (so every command and ZeroMQ worker reading a
scenario), ``list``, a ``--jobs`` child, the bench suites.
"""

from __future__ import annotations

import importlib
import os

from foltr_async.errors import FoltrError
from foltr_async.registry import PLUGINS_ENV, REGISTRY, Registry


def load_plugins() -> Registry:
    """Import the protocol package and the ``FOLTR_ASYNC_PLUGINS`` modules so they register
    themselves; return the filled registry."""
    import foltr_async.protocols  # noqa: F401  (registration happens on import)

    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise FoltrError(f"{PLUGINS_ENV}: cannot import {name!r}: {e}") from None
    return REGISTRY
