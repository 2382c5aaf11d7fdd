"""LETOR / SVMlight reader and writer with a content-keyed binary cache.

Lines look like ``label qid:Q 1:v1 2:v2 ... # comment``. The reader parses whole 32 MiB blocks
with numpy byte operations (comment blanking, token boundaries, colon positions) and converts all
numbers of a block in one ``np.fromstring`` call, because a per-token Python loop would need
minutes for an MSLR-WEB10K fold. Only when a block fails validation does a careful line-by-line
parser run over it, to name the first bad line in a one-line :class:`DatasetError`.

Parsed files are cached as uncompressed ``.npz`` under ``$FOLTR_ASYNC_CACHE`` (else
``~/.cache/foltr_async``), keyed by a SHA-256 of the file bytes, the parser version and the
options, so an edited file can never be served stale; a cache entry that fails its checks (zip
CRC, shapes, offsets) is ignored and rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import tempfile
import threading
import warnings
import zipfile
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

from foltr_async.errors import DatasetError
from foltr_async.ltr.queryset import QuerySet

__all__ = [
    "PARSER_VERSION",
    "LetorBlock",
    "cache_dir",
    "check_line",
    "load_fold",
    "load_letor",
    "normalise_per_query",
    "scan_letor",
    "write_letor",
]

PARSER_VERSION = 2  # 2: feature ids up to MAX_FEATURE_ID (10,000)
#: features are dense matrices: the largest public collection has 700 ids (Yahoo! LTR), and a
#: larger id than this is a corrupt file, not a real feature
MAX_FEATURE_ID = 10_000
#: the largest dense feature matrix a file may make (documents x largest id x 4 bytes): a
#: short line with a large id must be refused, not allocated
MAX_DENSE_BYTES = 8 * 2**30
MAX_GRADE = 127  # labels are stored as int8
MAX_QID_LEN = 256

_BLOCK = 1 << 25  # bytes parsed per vectorised step (bounded temporary memory)
_HASH_BLOCK = 1 << 24  # bytes per hashed piece (pieces are hashed on two threads)

# Separators are space, \t, \v, \f, \r and \n; other control bytes are never valid in a line.
_SPACE, _NL, _HASH, _COLON = 32, 10, 35, 58

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_WS = re.compile(r"[ \t\v\f\r]+")
_CTRL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where parsed files are cached: ``$FOLTR_ASYNC_CACHE`` or ``~/.cache/foltr_async``."""
    env = os.environ.get("FOLTR_ASYNC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "foltr_async"


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
    query-level min-max scaling (see :func:`normalise_per_query`).
    """
    path = Path(path)
    if n_features is not None and not 1 <= n_features <= MAX_FEATURE_ID:
        raise DatasetError(f"{path}: n_features must be in 1..{MAX_FEATURE_ID}, got {n_features}")
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DatasetError(f"{path}: dataset file {what}")
    entry = None
    if cache:
        try:
            key = _cache_key(path, n_features, normalise)
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
        entry = cache_dir() / f"letor-{key[:40]}.npz"
        cached = _read_cache(entry)
        if cached is not None:
            return _assemble(*cached, name=path.stem)
    arrays = _parse_file(path, n_features)
    if normalise:
        arrays = (normalise_per_query(arrays[0], arrays[2]), *arrays[1:])
    if entry is not None:
        _write_cache(entry, arrays)
    return _assemble(*arrays, name=path.stem)


def normalise_per_query(features: np.ndarray, qptr: np.ndarray) -> np.ndarray:
    """Min-max scale every feature within every query to [0, 1]; constant features become 0.

    This is the query-level normalisation the PDGD/FPDGD authors apply to MSLR-WEB10K (and
    LETOR 4.0 ships as ``QueryLevelNorm``); it removes per-query scale effects a linear ranker
    cannot undo. Returns a new float32 array.
    """
    out = np.array(features, dtype=np.float32, copy=True, order="C")
    sizes = np.diff(qptr)
    nonempty = sizes > 0
    if out.size == 0 or not nonempty.any():
        return out
    starts = qptr[:-1][nonempty]
    lo = np.minimum.reduceat(out, starts, axis=0)
    span = np.maximum.reduceat(out, starts, axis=0) - lo
    doc_q = np.repeat(np.arange(len(starts)), sizes[nonempty])
    for r0 in range(0, len(out), 1 << 16):  # bounded temporaries on MSLR-size data
        rows = doc_q[r0 : r0 + (1 << 16)]
        block = out[r0 : r0 + len(rows)]
        s = span[rows]
        np.divide(block - lo[rows], s, out=block, where=s > 0)
        block[s <= 0] = 0.0
    return out


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


# --------------------------------------------------------------------------------------------
# Writing helpers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


@dataclass
class LetorBlock:
    """The documents of one parsed block of a LETOR file, in file order."""

    labels: np.ndarray  # (docs,) int8
    qids: np.ndarray  # (docs,) bytes (S) without the 'qid:' prefix
    dense: np.ndarray  # (docs, width) float32, width = max_id
    doc_line: np.ndarray  # (docs,) 1-based line number of each document
    max_id: int  # largest feature id in the block
    bytes_done: int = 0  # bytes of the file read up to the end of this block


def _iter_blocks(fh, size: int = _BLOCK) -> Iterator[bytes]:
    """Blocks of whole lines (each ends with a newline), about ``size`` bytes each."""
    carry = b""
    while True:
        chunk = fh.read(size)
        if not chunk:
            break
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            carry = data
            continue
        yield data[:cut]
        carry = data[cut:]
    if carry:
        yield carry + b"\n"


def scan_letor(
    path: str | os.PathLike[str], *, n_features: int | None = None, block: int = _BLOCK
) -> Iterator[LetorBlock]:
    """Parse ``path`` block by block (about ``block`` bytes of text each), in file order.

    Memory stays bounded by a few blocks whatever the file size (the vectorised parse needs
    about 15x a block's bytes in temporaries, three blocks in flight), so a whole collection can
    be validated without holding it; every line is checked as :func:`load_letor` checks it (the
    first bad one raises a one-line :class:`DatasetError` naming file and line). Feature ids
    above ``n_features`` are errors.
    """
    path = Path(path)
    line0 = 0
    pending: deque[tuple[Future, int]] = deque()
    # Two blocks in flight: numpy releases the GIL in most of the block parser.
    try:
        with open(path, "rb") as fh, ThreadPoolExecutor(max_workers=2) as pool:
            done = 0
            for raw in _iter_blocks(fh, block):
                done += len(raw)
                pending.append((pool.submit(_parse_block, raw, line0, path, n_features), done))
                line0 += raw.count(b"\n")
                while len(pending) > 2:
                    yield from _collect(pending)
            while pending:
                yield from _collect(pending)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _parse_file(
    path: Path, n_features: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parse ``path`` into (features, labels, qptr, qids) with queries grouped."""
    blocks = list(scan_letor(path, n_features=n_features))
    if not blocks:
        raise DatasetError(f"{path}: no data lines (expected 'label qid:<id> 1:<value> ...')")

    if n_features is None:
        n_features = max(b.max_id for b in blocks)
    docs = sum(len(b.labels) for b in blocks)
    if docs * n_features * 4 > MAX_DENSE_BYTES:
        raise DatasetError(
            f"{path}: {docs:,} documents x {n_features} features make a "
            f"{_gib(docs * n_features * 4)} feature matrix; expected at most "
            f"{_gib(MAX_DENSE_BYTES)} for the file (fewer features or a smaller file)"
        )
    all_qids = np.concatenate([b.qids for b in blocks])
    labels = np.concatenate([b.labels for b in blocks])
    uniq, first, inverse = np.unique(all_qids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[order] = np.arange(len(uniq))
    group = rank[inverse.reshape(-1)]
    grouped = bool(np.all(group[1:] >= group[:-1]))
    qptr = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(np.bincount(group, minlength=len(uniq)), out=qptr[1:])

    features = np.zeros((len(labels), n_features), dtype=np.float32)
    if grouped:
        dest = None
    else:
        perm = np.argsort(group, kind="stable")
        dest = np.empty_like(perm)
        dest[perm] = np.arange(len(perm))
        labels = labels[perm]
    r0 = 0
    for b in blocks:
        r1 = r0 + len(b.labels)
        w = b.dense.shape[1]
        if dest is None:
            features[r0:r1, :w] = b.dense
        else:
            features[dest[r0:r1], :w] = b.dense
        r0 = r1
    qids = _decode_qids(uniq[order], all_qids, first[order], blocks, path)
    return features, labels, qptr, qids


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _collect(pending: deque[tuple[Future, int]]) -> Iterator[LetorBlock]:
    """The oldest block, if it held data lines; on its error cancel the rest so the first
    error wins."""
    fut, done = pending.popleft()
    try:
        blk = fut.result()
    except BaseException:
        for other, _ in pending:
            other.cancel()
        raise
    if blk is not None:
        blk.bytes_done = done
        yield blk


def _decode_qids(
    qids: np.ndarray, all_qids: np.ndarray, first: np.ndarray, blocks: list[LetorBlock], path: Path
) -> np.ndarray:
    try:
        return qids.astype(str)
    except UnicodeDecodeError:
        pass
    doc_line = np.concatenate([b.doc_line for b in blocks])
    out = []
    for q, i in zip(qids.tolist(), first.tolist(), strict=True):
        try:
            out.append(q.decode("utf-8"))
        except UnicodeDecodeError:
            raise DatasetError(
                f"{path}:{doc_line[i]}: expected a UTF-8 query id, got {q!r}"
            ) from None
    return np.array(out, dtype=str)


def _parse_block(raw: bytes, line0: int, path: Path, n_features: int | None) -> LetorBlock | None:
    """Vectorised parse of whole lines; on any doubt defer to :func:`_explain` for the error.

    Work is per byte only for cheap comparisons; the rest is per token or per line.
    """
    n = len(raw)
    padded = np.full(n + 8, _NL, dtype=np.uint8)
    padded[:n] = np.frombuffer(raw, dtype=np.uint8)
    b = padded[:n]
    nl = np.flatnonzero(b == _NL)
    n_lines = len(nl)

    def fail() -> NoReturn:
        _explain(raw, line0, path, n_features)

    # Blank comments: toggle on at the first '#' of a line, off at its newline.
    hashes = np.flatnonzero(b == _HASH)
    if len(hashes):
        hl = np.searchsorted(nl, hashes)
        firsts = np.ones(len(hashes), dtype=bool)
        firsts[1:] = hl[1:] != hl[:-1]
        _blank(b, hashes[firsts], nl[hl[firsts]])
    # Control bytes other than whitespace are never valid; 127 neither.
    n_ws_ctrl = np.count_nonzero((b - np.uint8(9)) <= 4)
    if np.count_nonzero(b < 32) != n_ws_ctrl or np.count_nonzero(b == 127):
        fail()

    # Token boundaries: separator (any byte <= 32 here) <-> non-separator flips alternate.
    sep = np.empty(n + 1, dtype=np.int8)
    sep[0] = 1
    np.less_equal(b, _SPACE, out=sep[1:].view(bool))
    flips = np.flatnonzero(np.diff(sep))
    t_start, t_end = flips[0::2], flips[1::2]
    if len(t_start) == 0:
        return None
    per_line = np.diff(np.searchsorted(t_start, nl), prepend=0)
    data_lines = np.flatnonzero(per_line)
    if (per_line[data_lines] < 2).any():
        fail()
    t_line = np.repeat(np.arange(n_lines), per_line)
    lab_tok = np.concatenate([[0], np.cumsum(per_line[data_lines])[:-1]])
    qid_tok = lab_tok + 1
    is_feat = np.ones(len(t_start), dtype=bool)
    is_feat[lab_tok] = False
    is_feat[qid_tok] = False
    feat_tok = np.flatnonzero(is_feat)

    # Colons: exactly one per qid and feature token (none in labels), in token order.
    colons = np.flatnonzero(b == _COLON)
    holders = np.flatnonzero(np.diff(t_line, prepend=-1) == 0)  # every token but the labels
    if len(colons) != len(holders) or not (
        (t_start[holders] < colons).all() and (colons < t_end[holders]).all()
    ):
        fail()
    # qid tokens: 'qid:' then 1 to MAX_QID_LEN bytes.
    qs, qe = t_start[qid_tok], t_end[qid_tok]
    if (
        (qe - qs < 5).any()
        or (qe - qs > 4 + MAX_QID_LEN).any()
        or any((b[qs + k] != c).any() for k, c in enumerate(b"qid:"))
    ):
        fail()
    # Feature tokens: 1-6 digits, ':', a non-empty value.
    fs, fe = t_start[feat_tok], t_end[feat_tok]
    fc = colons[is_feat[holders]]
    key_len = fc - fs
    if len(fs) and ((key_len < 1).any() or (key_len > 6).any() or (fe - fc < 2).any()):
        fail()
    width_k = int(key_len.max()) if len(fs) else 0
    # The first 8 bytes of every token in one gather (b is padded past its end).
    heads = np.ndarray((n,), dtype="<u8", buffer=padded, strides=(1,))[fs]
    key_bytes = heads.view(np.uint8).reshape(-1, 8)[:, :width_k] - np.uint8(48)
    in_key = np.arange(width_k) < key_len[:, None]
    if (in_key & (key_bytes > 9)).any():
        fail()
    ids = np.zeros(len(fs), dtype=np.int32)
    for j in range(width_k):
        ids = np.where(in_key[:, j], ids * 10 + key_bytes[:, j], ids)
    if len(ids) and ((ids < 1).any() or (ids > MAX_FEATURE_ID).any()):
        fail()

    q_len = qe - qs - 4
    qw = int(q_len.max())
    # clip the gather: a short qid near the end of the file must not read past the buffer
    at = np.minimum(qs[:, None] + 4 + np.arange(qw), len(padded) - 1)
    qbytes = np.where(np.arange(qw) < q_len[:, None], padded[at], 0)
    qids = np.ascontiguousarray(qbytes, dtype=np.uint8).view(f"S{qw}").reshape(-1)

    # Blank keys (with their colon) and qid tokens, then convert labels and values at once.
    for j in range(width_k + 1):
        padded[np.where(j <= key_len, fs + j, n)] = _SPACE  # index n: harmless padding byte
    for j in range(qw + 4):
        padded[np.where(qs + j < qe, qs + j, n)] = _SPACE
    try:
        with warnings.catch_warnings():  # numpy < 2 warns (not raises) on unparsable text
            warnings.simplefilter("ignore", DeprecationWarning)
            nums = np.fromstring(b.tobytes(), dtype=np.float64, sep=" ")
    except ValueError:
        fail()
    if len(nums) != len(feat_tok) + len(lab_tok):
        fail()
    # Numbers come in token order with the qid tokens skipped.
    is_feat[lab_tok] = True  # now: tokens that hold a number
    num_of_tok = np.cumsum(is_feat) - 1
    lab = nums[num_of_tok[lab_tok]]
    if ((lab != np.floor(lab)) | (lab < 0) | (lab > MAX_GRADE)).any():
        fail()
    with np.errstate(over="ignore"):
        vals = nums[num_of_tok[feat_tok]].astype(np.float32)
    if not np.isfinite(vals).all():
        fail()

    doc_of_line = np.full(n_lines, -1, dtype=np.int64)
    doc_of_line[data_lines] = np.arange(len(data_lines))
    f_doc = doc_of_line[t_line[feat_tok]]
    # Duplicate ids: ascending ids per line are the norm; only otherwise sort to check.
    key = f_doc * (MAX_FEATURE_ID + 1) + ids
    if len(key) > 1 and not (np.diff(key) > 0).all() and len(np.unique(key)) != len(key):
        fail()
    width = int(ids.max()) if len(ids) else 0
    if n_features is not None and width > n_features:
        bad = int(np.argmax(ids > n_features))
        line = line0 + int(t_line[feat_tok[bad]]) + 1
        raise DatasetError(f"{path}:{line}: feature id {ids[bad]} exceeds n_features={n_features}")
    if len(data_lines) * width * 4 > MAX_DENSE_BYTES:
        bad = int(np.argmax(ids == width))
        line = line0 + int(t_line[feat_tok[bad]]) + 1
        raise DatasetError(
            f"{path}:{line}: feature id {width} makes these {len(data_lines):,} documents a "
            f"{_gib(len(data_lines) * width * 4)} feature matrix; expected at most "
            f"{_gib(MAX_DENSE_BYTES)} for the file (fewer features or a smaller file)"
        )
    dense = np.zeros((len(data_lines), width), dtype=np.float32)
    dense.reshape(-1)[f_doc * width + ids - 1] = vals
    blk = LetorBlock(
        labels=lab.astype(np.int8),
        qids=qids,
        dense=dense,
        doc_line=line0 + data_lines + 1,
        max_id=width,
    )
    return blk


def _blank(b: np.ndarray, begin: np.ndarray, end: np.ndarray) -> None:
    """Overwrite ``b[begin[i]:end[i]]`` with spaces (disjoint ranges, distinct endpoints)."""
    toggle = np.zeros(len(b) + 1, dtype=np.uint8)
    toggle[begin] = 1
    toggle[end] = 1
    np.copyto(b, _SPACE, where=np.bitwise_xor.accumulate(toggle[:-1]).view(bool))


def _explain(raw: bytes, line0: int, path: Path, n_features: int | None) -> NoReturn:
    """Find the first bad line of a block the fast path rejected; always raises."""
    lines = raw.split(b"\n")
    for i, line_b in enumerate(lines[:-1] if lines[-1] == b"" else lines):
        msg = check_line(line_b.decode("utf-8", errors="surrogateescape"), n_features)
        if msg is not None:
            raise DatasetError(f"{path}:{line0 + i + 1}: {msg}")
    last = line0 + len(lines) - 1
    raise DatasetError(f"{path}:{line0 + 1}-{last}: could not parse these lines as LETOR")


def _short(tok: str) -> str:
    """A token for an error message: printable (bad UTF-8 shown as U+FFFD), at most 40 chars."""
    tok = tok.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
    return repr(tok if len(tok) <= 40 else tok[:37] + "...")


def check_line(line: str, n_features: int | None) -> str | None:
    """The careful per-line parser: the reason ``line`` is not valid LETOR, or None."""
    line = line.split("#", 1)[0]
    ctrl = _CTRL_CHARS.search(line)
    if ctrl:
        return f"unexpected control character {ctrl.group()!r}"
    toks = _WS.split(line.strip(" \t\v\f\r"))
    if toks == [""]:
        return None
    lab = toks[0]
    if (
        not _NUMBER.fullmatch(lab)
        or float(lab) != math.floor(float(lab))
        or not 0 <= float(lab) <= MAX_GRADE
    ):
        grade = f"a relevance grade (integer 0-{MAX_GRADE})"
        return f"expected {grade} as the first field, got {_short(lab)}"
    if len(toks) < 2:
        return "expected 'qid:<id>' after the label, got end of line"
    q = toks[1]
    if not q.startswith("qid:") or len(q) < 5 or ":" in q[4:]:
        return f"expected 'qid:<id>' after the label, got {_short(q)}"
    if len(q.encode("utf-8", errors="surrogateescape")) > 4 + MAX_QID_LEN:
        return f"expected a query id of at most {MAX_QID_LEN} bytes, got {_short(q)}"
    seen: set[int] = set()
    for tok in toks[2:]:
        key, colon, val = tok.partition(":")
        if not colon or ":" in val:
            return f"expected '<feature id>:<value>', got {_short(tok)}"
        if not (key.isascii() and key.isdigit()) or len(key) > 6:
            return (
                f"expected a feature id (integer 1-{MAX_FEATURE_ID}) before ':', got {_short(tok)}"
            )
        fid = int(key)
        if not 1 <= fid <= MAX_FEATURE_ID:
            return (
                f"expected a feature id (integer 1-{MAX_FEATURE_ID}) before ':', got {_short(tok)}"
            )
        if not _NUMBER.fullmatch(val) or not _finite32(float(val)):
            return f"expected a finite number after '{key}:', got {_short(val)}"
        if fid in seen:
            return f"feature id {fid} appears twice"
        seen.add(fid)
        if n_features is not None and fid > n_features:
            return f"feature id {fid} exceeds n_features={n_features}"
    return None


def _finite32(x: float) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(x)))


def _assemble(
    features: np.ndarray, labels: np.ndarray, qptr: np.ndarray, qids: np.ndarray, *, name: str
) -> QuerySet:
    return QuerySet(
        features=np.ascontiguousarray(features, dtype=np.float32),
        labels=np.asarray(labels, dtype=np.int8),
        qptr=np.asarray(qptr, dtype=np.int64),
        qids=np.asarray(qids, dtype=str),
        name=name,
    )


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def _cache_key(path: Path, n_features: int | None, normalise: bool) -> str:
    """SHA-256 over the file's bytes, parser version and options.

    The file is hashed in 16 MiB pieces on two threads (hashlib and pread release the GIL), each
    thread reusing one buffer, then the piece digests are hashed in order: about 0.4 s per GB.
    """
    size = path.stat().st_size
    local = threading.local()
    fd = os.open(path, os.O_RDONLY)
    try:

        def piece(off: int) -> bytes:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(_HASH_BLOCK)
            got = os.preadv(fd, [buf], off)
            return hashlib.sha256(memoryview(buf)[:got]).digest()

        offsets = range(0, size, _HASH_BLOCK)
        if len(offsets) <= 1:
            digests = [piece(0)]
        else:
            with ThreadPoolExecutor(max_workers=2) as pool:
                digests = list(pool.map(piece, offsets))
    finally:
        os.close(fd)
    h = hashlib.sha256(f"letor v{PARSER_VERSION} n={n_features} norm={normalise} {size}".encode())
    for dg in digests:
        h.update(dg)
    return h.hexdigest()


_CACHE_FIELDS = ("features", "labels", "qptr", "qids")


def _write_cache(entry: Path, arrays: tuple[np.ndarray, ...]) -> None:
    write_npz(entry, dict(zip(_CACHE_FIELDS, arrays, strict=True)))


def write_npz(entry: Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomic write of an uncompressed ``.npz`` (temporary file + rename); an unwritable cache
    is silently skipped."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def _read_cache(entry: Path) -> tuple[np.ndarray, ...] | None:
    """Arrays of a cache entry, or None when it is missing or fails any check."""
    out = read_npz(entry, _CACHE_FIELDS)
    if out is None:
        return None
    f, lab, qptr, qids = (out[k] for k in _CACHE_FIELDS)
    ok = (
        f.ndim == 2
        and f.dtype == np.float32
        and lab.shape == (len(f),)
        and qptr.ndim == 1
        and len(qptr) >= 2
        and qptr[0] == 0
        and qptr[-1] == len(f)
        and bool((np.diff(qptr) > 0).all())
        and qids.shape == (len(qptr) - 1,)
        and qids.dtype.kind == "U"
    )
    return (f, lab, qptr, qids) if ok else None


def read_npz(entry: Path, fields: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays of an uncompressed ``.npz`` holding exactly ``fields``, or None when it is
    missing or fails any check.

    Members are read straight into their arrays (``readinto``) with the zip CRC verified by
    ``zlib.crc32``; ``np.load`` would copy through ``zipfile`` at half the speed.
    """
    try:
        out = {}
        with open(entry, "rb") as fh, zipfile.ZipFile(fh) as zf:
            for info in zf.infolist():
                name = info.filename.removesuffix(".npy")
                if name not in fields or info.compress_type != zipfile.ZIP_STORED:
                    return None
                fh.seek(info.header_offset)
                local = fh.read(30)
                if local[:4] != b"PK\x03\x04":
                    return None
                skip = int.from_bytes(local[26:28], "little") + int.from_bytes(
                    local[28:30], "little"
                )
                start = info.header_offset + 30 + skip
                fh.seek(start)
                version = np.lib.format.read_magic(fh)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
                if fortran or dtype.hasobject:
                    return None
                head_len = fh.tell() - start
                fh.seek(start)
                crc = zlib.crc32(fh.read(head_len))
                arr = np.empty(shape, dtype=dtype)
                if arr.nbytes + head_len != info.file_size:
                    return None
                if arr.nbytes and fh.readinto(memoryview(arr.reshape(-1)).cast("B")) != arr.nbytes:
                    return None
                if zlib.crc32(memoryview(arr.reshape(-1)).cast("B"), crc) != info.CRC:
                    return None
                out[name] = arr
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, TypeError):
        return None
    return out if set(out) == set(fields) else None
