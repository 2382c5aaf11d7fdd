"""Reading LETOR / SVMlight files into QuerySets, and writing them.

A file is parsed once (:mod:`ltr.letor_parse`) into a memory-mapped columnar store
(:mod:`ltr.column_store`) under the cache folder; later loads map the store instead of reading
the text. With ``cache=False``, or when the cache folder cannot be written (the run says so), a
file is converted into a temporary store removed at once, with the same result.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from foltr_async.errors import DatasetError
from foltr_async.ltr.column_store import read_store
from foltr_async.ltr.letor_parse import _CTRL_CHARS, _NL, MAX_FEATURE_ID, check_line
from foltr_async.ltr.queryset import QuerySet

__all__ = [
    "load_fold",
    "load_letor",
    "write_letor",
]


def load_letor(
    path: str | os.PathLike[str],
    *,
    n_features: int | None = None,
    normalise: bool = False,
    cache: bool = True,
) -> QuerySet:
    """Read a LETOR/SVMlight file into a :class:`QuerySet`.

    Documents of one qid are grouped even when not adjacent in the file (queries keep their
    first-appearance order, documents their file order). Missing feature ids are 0; feature ids
    are 1-based and ``n_features`` defaults to the largest id seen. ``normalise`` applies
    query-level min-max scaling (see :func:`scaling.normalise_per_query`), from the store's
    kept copy (:meth:`ColumnStore.scaled`).
    """
    path = Path(path)
    if n_features is not None and not 1 <= n_features <= MAX_FEATURE_ID:
        raise DatasetError(f"{path}: n_features must be in 1..{MAX_FEATURE_ID}, got {n_features}")
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DatasetError(f"{path}: dataset file {what}")
    store = read_store(path, cache=cache, n_features=n_features)
    features = store.scaled() if normalise else store.features
    return QuerySet(features, store.labels, store.qptr, store.qids.astype(str), name=path.stem)


def load_fold(
    directory: str | os.PathLike[str],
    *,
    normalise: bool = False,
    n_features: int | None = None,
    cache: bool = True,
) -> dict[str, QuerySet]:
    """Load ``train``, optional ``vali`` and ``test`` from one fold directory.

    Accepts ``FoldN`` directories of MQ2007/MQ2008/MSLR (``train.txt``, ``vali.txt``,
    ``test.txt``), Istella-S (same names, no folds) and Yahoo (``set1.train.txt``,
    ``set1.valid.txt``, ``set1.test.txt``). All splits get the same feature count (the largest
    inferred one), since one ranker must score them all.
    """
    files = fold_files(directory)
    sets = {
        split: load_letor(p, n_features=n_features, normalise=normalise, cache=cache)
        for split, p in files.items()
        if p is not None
    }
    width = max(qs.n_features for qs in sets.values())
    out = {}
    for split, qs in sets.items():
        if qs.n_features < width:
            padded = np.zeros((qs.n_docs, width), dtype=np.float32)
            padded[:, : qs.n_features] = qs.features
            qs = dataclasses.replace(qs, features=padded)
        out[split] = dataclasses.replace(qs, name=split)
    return out


def fold_files(directory: str | os.PathLike[str]) -> dict[str, Path | None]:
    """A fold directory's split files (``vali`` may be None); a missing train or test file is
    a one-line error, without reading anything."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not a fold directory" if directory.exists() else "does not exist"
        raise DatasetError(f"{directory}: dataset directory {what}")
    files = {split: _find_split(directory, split) for split in ("train", "vali", "test")}
    missing = [s for s in ("train", "test") if files[s] is None]
    if missing:
        folds = sorted(p.name for p in directory.glob("Fold*") if p.is_dir())
        hint = f"; it holds {', '.join(folds)}: pass one of them" if folds else ""
        raise DatasetError(
            f"{directory}: expected {' and '.join(m + '.txt' for m in missing)} in the directory"
            f"{hint}"
        )
    return files


def check_first_line(path: Path, limit: int = 1 << 20) -> None:
    """The first data line of a LETOR file (within ``limit`` bytes), checked as the loader
    checks every line: a file of another format fails in one line without being read."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DatasetError(f"{path}: dataset file {what}")
    try:
        with open(path, "rb") as fh:
            head = fh.read(limit)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    lines = head.split(b"\n")
    if len(head) == limit:
        lines = lines[:-1]  # the last one may be cut
    for n, raw in enumerate(lines, 1):
        line = raw.decode("utf-8", errors="surrogateescape")
        if line.split("#", 1)[0].strip():
            msg = check_line(line, None)
            if msg is not None:
                raise DatasetError(f"{path}:{n}: {msg}")
            return
    raise DatasetError(f"{path}: no data lines (expected 'label qid:<id> 1:<value> ...')")


def write_letor(query_set: QuerySet, path: str | os.PathLike[str], *, sparse: bool = False) -> Path:
    """Write ``query_set`` in LETOR format: ``label qid:Q 1:v ... n:v`` per document.

    ``load_letor(write_letor(qs, p))`` reproduces the arrays exactly: values on a 6-decimal
    grid (LETOR files, the synthetic profiles) are written as such by fast integer formatting,
    any other value as the shortest text that reads back to the same float32. ``sparse`` omits
    zero features (Yahoo style) except the last one, which keeps ``n_features`` inferable. Only
    the main ``labels`` are written (LETOR has no slot for ``intent_labels``). Formatting is
    vectorised over blocks of documents; the file is replaced atomically.
    """
    path = Path(path)
    qs = query_set
    labels = np.asarray(qs.labels)
    if labels.size and (labels.min() < 0):
        raise DatasetError(f"{path}: cannot write negative relevance grades")
    if not np.isfinite(qs.features).all():
        raise DatasetError(f"{path}: cannot write non-finite feature values")
    qid_bytes = [str(q).encode() for q in qs.qids]
    for q in qid_bytes:
        if not q or any(c in q for c in b" \t\n\r\v\f:#") or _CTRL_CHARS.search(q.decode()):
            raise DatasetError(f"{path}: qid {q!r} cannot be written (empty, space, ':' or '#')")
    qtok = np.array([b" qid:" + q for q in qid_bytes], dtype=bytes)
    doc_q = np.repeat(np.arange(qs.n_queries), np.diff(qs.qptr))
    d = qs.n_features
    prefix = _byte_grid(np.array([f" {j}:".encode() for j in range(1, d + 1)], dtype=bytes))
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            rows = max(1, (1 << 21) // max(1, d))
            for r0 in range(0, qs.n_docs, rows):
                r1 = min(qs.n_docs, r0 + rows)
                n = r1 - r0
                feats = np.asarray(qs.features[r0:r1], dtype=np.float32)
                values = _format_values(feats)
                toks = np.concatenate([np.broadcast_to(prefix, (n, *prefix.shape)), values], axis=2)
                if sparse and d:
                    drop = feats == 0
                    drop[:, -1] = False
                    toks[drop] = 0
                line = np.concatenate(
                    [
                        _byte_grid(labels[r0:r1].astype("S3")),
                        _byte_grid(qtok[doc_q[r0:r1]]),
                        toks.reshape(n, -1),
                        np.full((n, 1), _NL, dtype=np.uint8),
                    ],
                    axis=1,
                ).ravel()
                fh.write(line[line != 0].tobytes())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise DatasetError(f"{path}: cannot write ({exc.strerror or exc})") from None
    return path


def _byte_grid(strings: np.ndarray) -> np.ndarray:
    """A bytes (``S``) array as a uint8 array with one more axis (NUL padded)."""
    strings = np.ascontiguousarray(strings)
    return strings.view(np.uint8).reshape(*strings.shape, strings.dtype.itemsize)


_DECIMALS = 6


def _format_values(x: np.ndarray) -> np.ndarray:
    """Text of float32 values as a NUL-padded uint8 grid ``x.shape + (width,)``.

    Values with at most 6 decimals print as ``-12.3405`` from integer digit arithmetic
    (vectorised, ~50x faster than float repr); others fall back to numpy's shortest repr.
    Either way the text parses back to the same float32.
    """
    scale = 10.0**_DECIMALS
    k = np.rint(x.astype(np.float64) * scale)
    if not (np.abs(x) < 1e9).all() or not np.array_equal((k / scale).astype(np.float32), x):
        return _byte_grid(x.astype(bytes))
    whole_frac = np.abs(k).astype(np.int64)
    whole = (whole_frac // 10**_DECIMALS).astype(np.int32)
    frac = (whole_frac % 10**_DECIMALS).astype(np.int32)
    n_int = len(str(int(whole.max()))) if whole.size else 1
    grid = np.zeros((*x.shape, n_int + _DECIMALS + 2), dtype=np.uint8)
    grid[..., 0] = np.where(k < 0, ord("-"), 0)
    for j in range(n_int):
        place = 10 ** (n_int - 1 - j)
        digit = (48 + (whole // place) % 10).astype(np.uint8)
        grid[..., 1 + j] = digit if j == n_int - 1 else np.where(whole >= place, digit, 0)
    grid[..., 1 + n_int] = ord(".")
    for j in range(_DECIMALS):
        digit = (48 + (frac // 10 ** (_DECIMALS - 1 - j)) % 10).astype(np.uint8)
        rest = frac % 10 ** (_DECIMALS - j)  # this digit and all after it
        grid[..., 2 + n_int + j] = digit if j == 0 else np.where(rest != 0, digit, 0)
    return grid


def _find_split(directory: Path, split: str) -> Path | None:
    # Yahoo!'s folder holds set 1 and set 2 side by side; set 1 is the studies' collection.
    names = {
        "train": ["train.txt", "set1.train.txt"],
        "vali": ["vali.txt", "valid.txt", "validation.txt", "set1.valid.txt"],
        "test": ["test.txt", "set1.test.txt"],
    }[split]
    for name in names:
        if (directory / name).is_file():
            return directory / name
    globbed = sorted(p for name in names for p in directory.glob(f"*.{name}") if p.is_file())
    if len(globbed) > 1:
        raise DatasetError(
            f"{directory}: several {split} files ({', '.join(p.name for p in globbed)}); "
            "expected one"
        )
    return globbed[0] if globbed else None
