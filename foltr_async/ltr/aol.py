"""AOL4FOLTR: the AOL query log as a federation of real users, one client per user.

The release (built by its authors from the 2006 AOL query log and the AOL-IA documents;
repository mg98/aol4foltr, data on Zenodo) is a folder with two files linked by ``qid``:

- ``metadata.csv``: one row per logged query, at least the columns ``qid``, ``user_id`` and
  ``timestamp`` (``YYYY-MM-DD HH:MM:SS``); the release also has ``query``, ``target_doc_id``
  and ``candidate_doc_ids``, which are not read.
- ``letor.txt``: LETOR lines ``label qid:Q 1:v ... 103:v`` for the top-20 result list of every
  qid, raw (unnormalised) features, label 1 on the document the user clicked in the log and 0
  on the others (``write_letor.py`` / ``ltr/data.py`` there).

:func:`load_aol` picks users (a seeded sample, or the most active as the authors'
``experiment.py`` does), splits their queries in time as ``experiment.py`` does (the first
``1 - test_fraction`` of the picked users' queries in logged order train, the rest are the
held-out test set), reads their documents from ``letor.txt``'s memory-mapped store
(:mod:`ltr.column_store`: the first load converts the ~55 GB text in one streaming pass, later
loads map it and read only the picked users' rows), and normalises features as the authors'
``AOL4FOLTRDataset`` does (:func:`picked_rows`). ``metadata.csv``'s three columns are cached
too. Each user's training queries come with their logged times, so a run can replay them when
they were issued.

Grades: the logged click (label 1) is stored as grade 2, the top of the 3-grade scale the
cascade click models know, so a ``perfect`` user clicks exactly the logged document and the
others click it with their top-grade probability; nDCG is unchanged (one relevant grade).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from foltr_async.errors import DatasetError
from foltr_async.ltr.cache import cache_dir, read_npz, write_npz
from foltr_async.ltr.column_store import ColumnStore, Progress, file_key, read_store
from foltr_async.ltr.queryset import QuerySet

__all__ = [
    "CLICKED_GRADE",
    "GLOBAL_FEATURES",
    "N_FEATURES",
    "AolData",
    "QueryLog",
    "UserLog",
    "load_aol",
    "read_metadata",
    "select_users",
]

N_FEATURES = 103
#: 0-based columns the authors min-max over the whole loaded set instead of per query
#: (``aol4foltr/data/letor.py``): IDF min..variance (ids 19-33), variance of stream-length
#: normalised TF (76-78), total query terms (94-96): per query they are constant or nearly so.
GLOBAL_FEATURES = np.r_[18:33, 75:78, 93:96]
CLICKED_GRADE = 2
METADATA, LETOR = "metadata.csv", "letor.txt"
COLUMNS = ("qid", "user_id", "timestamp")
SELECT = ("sample", "most_active")
METADATA_VERSION = 1  # of the cached columns of metadata.csv
_METADATA_FIELDS = ("qids", "users", "times", "lines")


@dataclass(frozen=True, eq=False)
class QueryLog:
    """The read columns of ``metadata.csv``, one entry per row in file order."""

    path: Path
    qids: np.ndarray  # int64
    users: np.ndarray  # int64
    times: np.ndarray  # int64 logged seconds (UTC for zoned timestamps)
    lines: np.ndarray  # int64 line of the row in the file (for errors)


@dataclass(frozen=True, eq=False)
class UserLog:
    """One picked user's training queries in logged order: ``queries`` index the training
    QuerySet, ``offsets`` are logged seconds since the first training query of any picked
    user (ascending)."""

    user: int
    queries: np.ndarray
    offsets: np.ndarray


@dataclass(frozen=True, eq=False)
class AolData:
    train: QuerySet
    test: QuerySet
    users: tuple[UserLog, ...]


def read_metadata(path: str | os.PathLike[str]) -> QueryLog:
    """``qid``, ``user_id`` and ``timestamp`` of every row (other columns are skipped)."""
    path = Path(path)
    qids: list[int] = []
    users: list[int] = []
    times: list[int] = []
    lines: list[int] = []
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise DatasetError(f"{path}: empty file; expected a header naming {_cols()}")
            names = [h.strip() for h in header]
            missing = [c for c in COLUMNS if c not in names]
            if missing:
                raise DatasetError(
                    f"{path}:1: expected column(s) {', '.join(map(repr, missing))} in the header,"
                    f" got {', '.join(map(repr, names))}"
                )
            iq, iu, it = (names.index(c) for c in COLUMNS)
            need = max(iq, iu, it) + 1
            parse_time = _time_parser()
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                if len(row) < need:
                    raise DatasetError(
                        f"{path}:{line}: expected at least {need} fields, got {len(row)}"
                    )
                qids.append(_int(row[iq], "qid", path, line))
                users.append(_int(row[iu], "user_id", path, line))
                times.append(parse_time(row[it], path, line))
                lines.append(line)
    except FileNotFoundError:
        raise DatasetError(
            f"{path}: does not exist (an AOL4FOLTR folder holds {METADATA})"
        ) from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except csv.Error as exc:
        raise DatasetError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
    if not qids:
        raise DatasetError(f"{path}: no rows after the header")
    log = QueryLog(
        path,
        np.array(qids, dtype=np.int64),
        np.array(users, dtype=np.int64),
        np.array(times, dtype=np.int64),
        np.array(lines, dtype=np.int64),
    )
    order = np.argsort(log.qids, kind="stable")
    dup = np.flatnonzero(np.diff(log.qids[order]) == 0)
    if len(dup):
        i = int(order[dup[0] + 1])
        raise DatasetError(
            f"{path}:{log.lines[i]}: qid {log.qids[i]} appears twice "
            f"(first at line {log.lines[order[dup[0]]]})"
        )
    return log


def _cols() -> str:
    return ", ".join(COLUMNS)


def _int(text: str, column: str, path: Path, line: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise DatasetError(
            f"{path}:{line}: {column}: expected an integer, got {text[:40]!r}"
        ) from None


def _time_parser():
    """``timestamp`` text -> whole seconds. The release's ``YYYY-MM-DD HH:MM:SS`` is split by
    hand with each date's epoch second memoised (a log of millions of rows spans ~90 days);
    any other ISO 8601 form goes through ``fromisoformat``."""
    days: dict[str, int] = {}

    def parse(text: str, path: Path, line: int) -> int:
        t = text.strip()
        # fast path: 'YYYY-MM-DD HH:MM:SS' as pandas writes it
        if len(t) == 19 and t[10] in " T" and t[13] == ":" and t[16] == ":":
            day = days.get(t[:10])
            if day is None:
                try:
                    day = days[t[:10]] = int(
                        datetime.fromisoformat(t[:10]).replace(tzinfo=UTC).timestamp()
                    )
                except ValueError:
                    day = None
            hh, mm, ss = t[11:13], t[14:16], t[17:19]
            if day is not None and (hh + mm + ss).isdigit():
                h, m, s = int(hh), int(mm), int(ss)
                if h < 24 and m < 60 and s < 60:
                    return day + 3600 * h + 60 * m + s
        try:
            dt = datetime.fromisoformat(t)
        except ValueError:
            raise DatasetError(
                f"{path}:{line}: timestamp: expected 'YYYY-MM-DD HH:MM:SS', got {text[:40]!r}"
            ) from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return int(dt.timestamp())

    return parse


def select_users(
    log: QueryLog, n: int, min_queries: int, how: str, rng: np.random.Generator
) -> np.ndarray:
    """``n`` user ids (ascending) among those with at least ``min_queries`` logged queries:
    a uniform draw from ``rng`` (``"sample"``), or the ``n`` with the most queries, ties to the
    lower id (``"most_active"``: the authors' ``experiment.py`` takes the top 100)."""
    ids, counts = np.unique(log.users, return_counts=True)
    ok = counts >= min_queries
    ids, counts = ids[ok], counts[ok]
    if len(ids) < n:
        raise DatasetError(
            f"{log.path}: {len(ids)} users have at least {min_queries} queries "
            f"(dataset.min_queries); the run needs {n}, one per client"
        )
    if how == "most_active":
        picked = ids[np.lexsort((ids, -counts))[:n]]
    elif how == "sample":
        picked = ids[rng.choice(len(ids), size=n, replace=False)]
    else:
        raise ValueError(f"unknown user selection {how!r}")
    return np.sort(picked)


def cached_metadata(path: Path, *, cache: bool = True) -> QueryLog:
    """:func:`read_metadata`, kept in the cache folder between runs (keyed as stores are)."""
    if not cache:
        return read_metadata(path)
    try:
        key = file_key(path, f"aol metadata v{METADATA_VERSION}")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    entry = cache_dir() / f"aolmeta-{key[:40]}.npz"
    got = read_npz(entry, _METADATA_FIELDS)
    if got is not None and all(
        a.dtype == np.int64 and a.shape == got["qids"].shape for a in got.values()
    ):
        return QueryLog(path, *(got[k] for k in _METADATA_FIELDS))
    log = read_metadata(path)
    write_npz(entry, {k: getattr(log, k) for k in _METADATA_FIELDS})
    return log


def letor_store(path: Path, *, cache: bool = True, progress: Progress | None = None) -> ColumnStore:
    """``letor.txt``'s store (103 features, ``nan`` read as 0, as the authors' reader does),
    its labels checked (:func:`column_store.read_store`)."""
    store = read_store(
        path, cache=cache, n_features=N_FEATURES, nan_as_zero=True, progress=progress
    )
    bad = np.flatnonzero(store.labels > 1)
    if len(bad):
        q = int(np.searchsorted(store.qptr, bad[0], side="right")) - 1
        k = int(bad[0] - store.qptr[q])
        raise DatasetError(
            f"{path}:{store.lines[q] + k}: expected label 0 or 1 (1: the document the user "
            f"clicked), got {store.labels[bad[0]]}"
            + (f" (document {k + 1} of qid {store.qids[q].decode()})" if k else "")
        )
    return store


def store_qids(store: ColumnStore, path: Path) -> np.ndarray:
    """The store's qids as integers (AOL4FOLTR's are); one line naming the first that is not."""
    try:
        return store.qids.astype(np.int64)
    except ValueError:
        bad = next(i for i, x in enumerate(store.qids.tolist()) if not x.strip().isdigit())
        raise DatasetError(
            f"{path}:{store.lines[bad]}: expected an integer qid (AOL4FOLTR's), "
            f"got {store.qids[bad].decode('utf-8', 'replace')[:40]!r}"
        ) from None


def picked_rows(
    store: ColumnStore, store_ids: np.ndarray, qids: np.ndarray, *, normalise: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents of ``qids`` from the store, grouped in the order of ``qids``: ``(features,
    labels, counts)``, ``counts`` the documents per qid (0: not in the file). ``normalise``: the
    authors' normalisation (``AOL4FOLTRDataset``): min-max per query for every feature but
    :data:`GLOBAL_FEATURES`, which are min-maxed over all the picked rows instead (a constant one
    keeps its raw value, as there)."""
    by_id = np.argsort(store_ids, kind="stable")
    at = np.searchsorted(store_ids[by_id], qids)
    found = at < len(by_id)
    found[found] = store_ids[by_id[at[found]]] == qids[found]
    q = by_id[np.where(found, at, 0)]
    counts = np.where(found, store.qptr[q + 1] - store.qptr[q], 0)
    if not normalise:
        features, labels = store.read(q[found], [store.features, store.labels])
        return features, labels, counts
    features, labels = store.read(q[found], [store.scaled(keep=GLOBAL_FEATURES), store.labels])
    raw = features[:, GLOBAL_FEATURES]  # kept raw in the store's scaled copy
    if len(raw):
        lo = raw.min(axis=0)
        span = raw.max(axis=0) - lo
        scaled = (raw - lo) / np.where(span > 0, span, 1)
        features[:, GLOBAL_FEATURES] = np.where(span > 0, scaled, raw)
    return features, labels, counts


def aol_files(folder: str | Path) -> tuple[Path, Path]:
    """An AOL4FOLTR folder's metadata and LETOR files; one line if either is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise DatasetError(
            f"{folder}: AOL4FOLTR folder {what} (expected {METADATA}, {LETOR}; a synthetic "
            "sample in that layout: python tools/make_aol_sample.py FOLDER)"
        )
    meta, letor = folder / METADATA, folder / LETOR
    for f in (meta, letor):
        if not f.is_file():
            raise DatasetError(
                f"{f}: does not exist (an AOL4FOLTR folder holds {METADATA}, {LETOR})"
            )
    return meta, letor


def load_aol(
    folder: str | os.PathLike[str],
    n_users: int,
    *,
    min_queries: int = 1,
    select: str = "sample",
    seed: int = 0,
    test_fraction: float = 0.2,
    normalise: bool = True,
    cache: bool = True,
    progress: Progress | None = None,
) -> AolData:
    """Pick ``n_users`` users of an AOL4FOLTR folder, split their queries in time, read their
    LETOR lines; see the module docstring. ``progress(file, bytes_done, size)`` follows a
    conversion of ``letor.txt``."""
    folder = Path(folder)
    meta, letor = aol_files(folder)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    log = cached_metadata(meta, cache=cache)
    users = select_users(log, n_users, min_queries, select, np.random.default_rng(seed))
    rows = np.flatnonzero(np.isin(log.users, users))
    rows = rows[np.lexsort((log.qids[rows], log.times[rows]))]  # logged order, ties by qid
    n_train = int(len(rows) * (1.0 - test_fraction))
    if n_train == 0 or n_train == len(rows):
        raise DatasetError(
            f"{meta}: the picked users' {len(rows)} queries leave an empty "
            f"{'training' if n_train == 0 else 'test'} split at dataset.test_fraction = "
            f"{test_fraction}"
        )
    qids = log.qids[rows]
    store = letor_store(letor, cache=cache, progress=progress)
    features, labels, counts = picked_rows(
        store, store_qids(store, letor), qids, normalise=normalise
    )
    if (counts == 0).any():
        i = int(np.argmax(counts == 0))
        raise DatasetError(
            f"{letor}: no lines for qid {qids[i]} ({meta}:{log.lines[rows[i]]}, "
            f"user {log.users[rows[i]]})"
        )
    qptr = np.zeros(len(qids) + 1, dtype=np.int64)
    np.cumsum(counts, out=qptr[1:])
    labels = np.where(labels > 0, CLICKED_GRADE, 0).astype(np.int8)
    whole = QuerySet(features, labels, qptr, qids.astype(str), name=folder.name)
    train, test = _split(whole, n_train)
    t = log.times[rows]
    user, offset = log.users[rows[:n_train]], (t[:n_train] - t[0]).astype(np.float64)
    logs = []
    for u in users.tolist():
        mine = np.flatnonzero(user == u)  # ascending: logged order
        logs.append(UserLog(int(u), mine, offset[mine]))
    return AolData(train, test, tuple(logs))


def _split(qs: QuerySet, n: int) -> tuple[QuerySet, QuerySet]:
    """The first ``n`` queries and the rest, as views (``subset`` would copy the features)."""
    cut = int(qs.qptr[n])
    head = QuerySet(qs.features[:cut], qs.labels[:cut], qs.qptr[: n + 1], qs.qids[:n], "train")
    tail = QuerySet(qs.features[cut:], qs.labels[cut:], qs.qptr[n:] - cut, qs.qids[n:], "test")
    return head, tail
