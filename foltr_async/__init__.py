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
