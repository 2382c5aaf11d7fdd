"""Suite ``parse``: a LETOR file's first load (one streaming conversion into its memory-mapped
store) and a later one (the store mapped), on ``--data`` or on a written MSLR-like file,
extrapolated to the MSLR-WEB10K Fold1 training file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from foltr_async.benchmarks.measure import N_FEATURES, Sizes, cpu_share, now, progress, set_env

MSLR_TRAIN_LINES = 723_412  # documents in MSLR-WEB10K Fold1/train.txt
MIN_EXTRAPOLATE_LINES = 10_000  # below this, fixed costs make a linear extrapolation meaningless


def letor_like(
    n_queries: int,
    rng: np.random.Generator,
    *,
    docs_per_query: int = 120,
    n_features: int = N_FEATURES,
    n_grades: int = 5,
):
    """A random QuerySet whose LETOR text looks like MSLR-WEB10K's, to time the parser.

    A third of the features are small integer counts and the rest have four decimals, so a
    written line is ~1.3 kB, close to MSLR's (full-precision random floats would double the
    text and make the parser look slower than on real data). Grades are skewed to 0.
    """
    from foltr_async.ltr.queryset import QuerySet

    sizes = rng.integers(docs_per_query // 2, docs_per_query * 3 // 2 + 1, n_queries)
    n = int(sizes.sum())
    latent = rng.standard_normal(n)
    x = rng.standard_normal((n, n_features), dtype=np.float32)
    x += (latent[:, None] * rng.uniform(0.0, 0.5, n_features)).astype(np.float32)
    ints = n_features // 3
    x[:, :ints] = np.floor(np.abs(x[:, :ints]) * 5.0)
    x[:, ints:] = np.round(x[:, ints:], 4)
    noisy = latent + rng.standard_normal(n)
    cuts = np.quantile(noisy, [0.55, 0.8, 0.93, 0.98][: n_grades - 1])
    labels = np.digitize(noisy, cuts).astype(np.int8)
    qptr = np.zeros(n_queries + 1, dtype=np.int64)
    np.cumsum(sizes, out=qptr[1:])
    qids = np.arange(1, n_queries + 1).astype(str)
    return QuerySet(x, labels, qptr, qids, name="letor-like")


def bench_parse(sz: Sizes, seed: int, workdir: Path, data_file: Path | None) -> dict[str, dict]:
    """First load (conversion into the store) and later load (the store mapped) of one LETOR
    file."""
    from foltr_async.ltr.data import load_letor, write_letor

    if data_file is None:
        n_queries = max(1, round(sz.parse_lines / 120))
        qs = letor_like(n_queries, np.random.default_rng(seed))
        path = workdir / "parse" / "train.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        progress(f"parse: writing {qs.n_docs} MSLR-like LETOR lines")
        t0 = time.perf_counter()
        write_letor(qs, path)
        write_s = time.perf_counter() - t0
        what = "written with write_letor (MSLR-like widths)"
    else:
        path, write_s, what = data_file, None, "--data"
    size = path.stat().st_size
    with set_env(FOLTR_ASYNC_CACHE=str(workdir / "parse-cache")):
        progress(f"parse: {path.name} ({size / 1e6:.0f} MB), cold then cached")
        t0 = now()
        qs = load_letor(path)
        t1 = now()
        cold = t1[0] - t0[0]
        c0 = time.perf_counter()
        again = load_letor(path)
        cached = time.perf_counter() - c0
    if again.n_docs != qs.n_docs or not np.array_equal(again.features, qs.features):
        raise RuntimeError("parse: the cached load differs from the parsed one")
    lines = qs.n_docs
    out: dict[str, Any] = {
        "lines_per_s": lines / cold,
        "cold_s": cold,
        "cached_s": cached,
        "mb_per_s": size / 1e6 / cold,
        "cpu_share": cpu_share(t0, t1),  # up to 2: the parser runs two blocks at once
        "on": {"lines": lines, "features": qs.n_features, "megabytes": size / 1e6, "file": what},
    }
    if lines >= MIN_EXTRAPOLATE_LINES:
        # Both times are linear in the cells parsed / loaded once fixed costs are small.
        scale = MSLR_TRAIN_LINES / lines * N_FEATURES / max(1, qs.n_features)
        out["mslr_parse_s"] = cold * scale
        out["mslr_cached_s"] = cached * scale
        out["note"] = (
            f"mslr_* extrapolate linearly to {MSLR_TRAIN_LINES} lines x {N_FEATURES} features "
            "(MSLR-WEB10K Fold1 train)"
        )
    else:
        out["note"] = (
            f"fewer than {MIN_EXTRAPOLATE_LINES} lines: fixed costs dominate, no MSLR-size "
            "extrapolation"
        )
    if write_s is not None:
        out["write_lines_per_s"] = lines / write_s
    return {"parse": out}
