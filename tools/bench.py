"""``python tools/bench.py [...]``: the same benchmark as ``python -m foltr_async bench``.

Works from a source checkout without installing: the repository root goes on ``sys.path``.
"""

import os
import sys
from pathlib import Path

# As the CLI does: one event loop, small per-query products; threaded BLAS only adds contention.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from foltr_async.benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
