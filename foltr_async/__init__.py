"""foltr_async: an event-driven asyncio simulator for federated online learning to rank."""

from pathlib import Path

__version__ = "0.1.0"

# ``foltr_async.protocols`` and ``foltr_async.benchmarks`` live in the checkout's top-level
# protocols/ and benchmarks/ folders (pyproject.toml's package-dir); an installed wheel has them
# inside this package. From a checkout, search its root for them too, so the code that runs is
# this checkout's whichever copy of the project is installed (and `python -m foltr_async` needs
# no install at all).
_checkout = Path(__file__).resolve().parent.parent
if not Path(__file__).with_name("protocols").is_dir() and (_checkout / "pyproject.toml").is_file():
    __path__.append(str(_checkout))


#: what ``foltr_async.NAME`` resolves to on first use (PEP 562), by module
_API = {
    "run": "foltr_async.api",
    "Results": "foltr_async.api",
    "VariantResult": "foltr_async.api",
    "load_scenario": "foltr_async.scenario.load",
}


def __getattr__(name: str):
    """``foltr_async.run`` / ``Results`` / ``load_scenario``: the Python API, imported on first
    use so that importing the package (and so every command) stays light. By name, not an
    import statement: the package is initialised by then, so this is no dependency of it (the
    API depends on the package, tests/test_imports.py's direction)."""
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'foltr_async' has no attribute {name!r}")
