import os
import socket
from pathlib import Path

import pytest

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # as the CLI does: small per-query products, one loop

# the commands the tests start import this checkout's code, whichever checkout the package was
# installed from (a subprocess started in a temporary folder would import the installed one)
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])


def pytest_configure(config):
    """The protocols register their names before any test reads a scenario (as the command
    line does before it validates one)."""
    from foltr_async.plugins import load_plugins

    load_plugins()


@pytest.fixture(scope="session", autouse=True)
def _private_dataset_cache(tmp_path_factory):
    """Parsed-LETOR cache in a temporary folder, not the user's ~/.cache (also for subprocesses)."""
    old = os.environ.get("FOLTR_ASYNC_CACHE")
    os.environ["FOLTR_ASYNC_CACHE"] = str(tmp_path_factory.mktemp("letor-cache"))
    yield
    if old is None:
        os.environ.pop("FOLTR_ASYNC_CACHE", None)
    else:
        os.environ["FOLTR_ASYNC_CACHE"] = old


SHARED = Path(__file__).resolve().parents[2] / "shared"
MQ2008 = SHARED / "data" / "mq2008-sample"


def shared_data(path: Path) -> Path:
    """``path`` if the shared real data is there, else skip: a fresh clone has no ``../shared``
    (CI has it), and its other tests must still run."""
    if not (path / "train.txt").exists():
        pytest.skip(f"real data not found at {path} (the shared data folder beside the project)")
    return path


@pytest.fixture(scope="session")
def mq2008_dir() -> Path:
    """The real MQ2008 sample that lives beside the project (never copied into it)."""
    return shared_data(MQ2008)


def pytest_report_header(config):
    """Say what the run computed on: results are bit-identical only for one platform."""
    import platform

    import numba
    import numpy
    import scipy

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    blas = os.environ.get("OPENBLAS_CORETYPE")
    return (
        f"platform: {platform.platform()}, CPU {cpu} ({os.cpu_count()} cores)"
        + (f", OPENBLAS_CORETYPE={blas}" if blas else "")
        + f"\nnumpy {numpy.__version__}, numba {numba.__version__}, scipy {scipy.__version__}"
    )


def free_port() -> int:
    """A loopback TCP port nobody holds now (the zmq tests bind their hub to it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def conversions(monkeypatch) -> list:
    """The LETOR-to-store conversions a test makes (their arguments), counted as they run."""
    from foltr_async.ltr import column_store

    calls: list = []
    real = column_store._convert
    monkeypatch.setattr(column_store, "_convert", lambda *a: calls.append(a) or real(*a))
    return calls
