import os
import sys

from foltr_async.ltr.threads import BLAS_ENV

# The simulator is single-threaded by design (one event loop); multi-threaded BLAS only adds
# contention on the many small per-query products. Set before numpy is first imported.
for _var in BLAS_ENV:
    os.environ.setdefault(_var, "1")

from foltr_async.cli import main  # noqa: E402

sys.exit(main())
