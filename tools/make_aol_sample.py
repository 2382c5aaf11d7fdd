"""``python tools/make_aol_sample.py FOLDER [--users N] [--queries M] [--days D] [--seed S]``

Writes a synthetic folder in the AOL4FOLTR release's layout (``metadata.csv`` + ``letor.txt``,
see ``foltr_async/ltr/aol.py``) so the replay scenario and its tests run without the real
~56 GB release. It is not AOL data: users, times and features are drawn from a seeded
generator shaped like the log.

- Users: N of them, each with about M queries (geometric around M, at least 3), issued in
  sessions (session starts spread over D days, seconds to minutes apart within a session), so
  users are active at different times and some go quiet for days, as in the log.
- Result lists: 20 documents per query, exactly one labelled 1 (the "clicked" one). Every
  document has six latent factors; the click goes to the document whose factors best match
  the user's own taste vector (plus Gumbel noise), so users differ (non-IID) and a linear
  ranker can learn part of it. The 103 features are noisy, raw-scale transforms of the
  factors (scores, counts and lengths from 0.01 to thousands, integers where the release has
  integers); the columns the authors normalise globally are per-query constants here, as
  they (nearly) are in the release.
- ``metadata.csv`` has the release's columns (qid, user_id, timestamp, query, target_doc_id,
  candidate_doc_ids); qids number the rows in time order, as the release's do.

With ``--users 1000 --queries 50`` it writes ~1M LETOR lines (the reader's benchmark); memory
stays bounded at any size (``--users 10000 --queries 250``: ~50 M lines, ~60 GB, the release's
shape).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from foltr_async.ltr.aol import GLOBAL_FEATURES, N_FEATURES  # noqa: E402
from foltr_async.ltr.data import write_letor  # noqa: E402
from foltr_async.ltr.queryset import QuerySet  # noqa: E402

DOCS = 20
FACTORS = 6
START = datetime(2006, 3, 1, tzinfo=UTC)
#: 0-based columns holding counts / lengths (integers in the release) and exact-match flags
INTEGER = np.r_[27:30, 81:84, 87:93, 102]
BINARY = np.r_[96:99]
PART = 1 << 16  # queries generated and written at a time (~1.3 M lines)


def make_sample(
    folder: str | Path, users: int = 40, queries: int = 60, days: float = 30.0, seed: int = 0
) -> Path:
    """Write ``metadata.csv`` and ``letor.txt`` into ``folder``; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    user_ids = np.sort(rng.choice(np.arange(1, 25_000_000), size=users, replace=False))
    counts = np.maximum(3, rng.geometric(1.0 / queries, size=users))
    owner = np.repeat(user_ids, counts)
    times = np.concatenate([_times(rng, int(n), days) for n in counts])
    order = np.lexsort((owner, times))
    owner, times = owner[order], times[order]
    taste = np.array([1.0, 0.8, 0.6, 0.4, 0.2, 0.0]) + 0.6 * rng.standard_normal((users, FACTORS))
    taste_of = taste[np.searchsorted(user_ids, owner)]
    n_q = len(owner)

    loading = rng.standard_normal((FACTORS, N_FEATURES)) / np.sqrt(FACTORS)
    scale = 10.0 ** rng.uniform(-2, 3, size=N_FEATURES)
    clicked = np.empty(n_q, dtype=np.int64)
    letor = folder / "letor.txt"
    part = folder / ".letor.part"
    with open(letor, "wb") as out:
        # written PART queries at a time (bounded memory at the release's 50 M lines); PART
        # is a multiple of the 4096-query step, so the draws are those of one pass
        for p0 in range(0, n_q, PART):
            p1 = min(n_q, p0 + PART)
            feats = np.empty(((p1 - p0) * DOCS, N_FEATURES), dtype=np.float32)
            for q0 in range(p0, p1, 4096):  # bounded float64 temporaries
                q1 = min(p1, q0 + 4096)
                z = rng.standard_normal((q1 - q0, DOCS, FACTORS))
                utility = np.einsum("qdf,qf->qd", z, taste_of[q0:q1])
                utility += rng.gumbel(size=(q1 - q0, DOCS))
                clicked[q0:q1] = utility.argmax(axis=1)
                signal = z @ loading + 1.5 * rng.standard_normal((q1 - q0, DOCS, N_FEATURES))
                # constant within a query, as the globally normalised columns nearly are
                signal[:, :, GLOBAL_FEATURES] = rng.standard_normal(
                    (q1 - q0, 1, len(GLOBAL_FEATURES))
                )
                f = scale * np.logaddexp(0.0, signal)  # softplus: non-negative, raw scales
                f[:, :, INTEGER] = np.round(f[:, :, INTEGER])
                f[:, :, BINARY] = signal[:, :, BINARY] > 0.5
                rows = slice((q0 - p0) * DOCS, (q1 - p0) * DOCS)
                feats[rows] = np.round(f, 6).reshape(-1, N_FEATURES)
            labels = np.zeros((p1 - p0, DOCS), dtype=np.int8)
            labels[np.arange(p1 - p0), clicked[p0:p1]] = 1
            qs = QuerySet(
                feats,
                labels.reshape(-1),
                np.arange(0, (p1 - p0) * DOCS + 1, DOCS, dtype=np.int64),
                np.arange(p0, p1).astype(str),
            )
            write_letor(qs, part)
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 24)
            part.unlink()
    with open(folder / "metadata.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["qid", "user_id", "timestamp", "query", "target_doc_id", "candidate_doc_ids"])
        for q in range(n_q):
            docs = [f"d{q}x{d}" for d in range(DOCS)]
            stamp = (START + timedelta(seconds=int(times[q]))).strftime("%Y-%m-%d %H:%M:%S")
            cand = "{" + ", ".join(repr(d) for d in docs) + "}"
            w.writerow([q, int(owner[q]), stamp, f"query {q % 997}", docs[clicked[q]], cand])
    return folder


def _times(rng: np.random.Generator, n: int, days: float) -> np.ndarray:
    """n query times (seconds from the start) of one user, in sessions of ~3 queries."""
    sessions = max(1, n // 3)
    span = days * 86400.0
    first = rng.uniform(0.0, 0.3 * span)
    starts = np.sort(rng.uniform(first, span, size=sessions))
    which = np.sort(rng.integers(sessions, size=n))
    gaps = rng.exponential(60.0, size=n)
    t = starts[which] + np.cumsum(gaps) - np.cumsum(gaps)[np.searchsorted(which, which)]
    return np.floor(np.minimum(t, span - 1.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--users", type=int, default=40)
    ap.add_argument("--queries", type=int, default=60, help="mean queries per user")
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.users < 1 or a.queries < 1 or a.days <= 0:
        ap.error("--users, --queries and --days must be positive")
    out = make_sample(a.folder, a.users, a.queries, a.days, a.seed)
    print(f"wrote {out / 'metadata.csv'} and {out / 'letor.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
