"""A LETOR file as a memory-mapped columnar cache (a *store*): one streaming pass converts it,
later runs map it in milliseconds and read only the queries they use.

A store is a folder under ``data.cache_dir()``:

- ``features.f32``: the documents' features as parsed (float32, documents x width, row-major),
  documents grouped by query (first-appearance order of the qids, file order within a qid, as
  :func:`data.load_letor` groups them);
- ``labels.i8``: the documents' grades;
- ``qptr.npy`` (int64, queries + 1), ``qids.npy`` (bytes), ``lines.npy`` (int64: the file line
  of each query's first document, for errors);
- ``store.json``, written last: the version, the shape and a CRC-32 of every file. A folder
  without it is an interrupted conversion and is built again;
- ``scaled.f32`` and ``scaled.json``, made on first use: the features min-maxed per query
  (:func:`scaling.normalise_per_query`), so a normalised load maps them too (``scaled-*``: some
  columns left raw, as AOL4FOLTR's normalisation needs).

Converting holds a few parsed blocks at a time (``CONVERT_BLOCK`` bytes of text each), never the
file or its matrix, so memory does not grow with the file. A file whose queries are not
contiguous is grouped by a second pass over the store on disk, in bounded chunks.

The store's name is keyed by the file's resolved path, size, modification time, its first and
last MiB and the options, not by a hash of every byte (which would cost minutes per run on the
55 GB AOL4FOLTR release): an edit that keeps size and modification time and touches only the
middle of a file larger than 2 MiB goes unnoticed. Opening checks the shapes and offsets and the
CRC of every file but the features, whose CRC is checked up to ``VERIFY_BYTES``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from foltr_async.errors import DatasetError
from foltr_async.ltr.cache import cache_dir
from foltr_async.ltr.letor_parse import PARSER_VERSION, LetorBlock, _gib, scan_letor
from foltr_async.ltr.queryset import ranges
from foltr_async.ltr.scaling import normalise_per_query

__all__ = [
    "CONVERT_BLOCK",
    "STORE_VERSION",
    "VERIFY_BYTES",
    "CacheUnwritable",
    "ColumnStore",
    "file_key",
    "open_store",
    "read_store",
    "store_for",
    "uncached_store",
]

STORE_VERSION = 1
#: text bytes per parsed block while converting: ~15x that in temporaries, three in flight
CONVERT_BLOCK = 1 << 23
#: the largest feature file whose CRC is checked each time it is opened (~0.5 s)
VERIFY_BYTES = 1 << 30
_FINGERPRINT = 1 << 20  # bytes read from each end of the file for the store's key
PROGRESS_LOG_BYTES = 256 << 20  # a conversion of a file this large logs its progress
_CHUNK_ROWS = 1 << 16  # rows per copy when a store is widened or grouped on disk
FEATURES, LABELS, META = "features.f32", "labels.i8", "store.json"
_ARRAYS = ("qptr", "qids", "lines")

log = structlog.get_logger()

Progress = Callable[[Path, int, int], None]


class CacheUnwritable(OSError):
    """The cache folder cannot be made or written to (a read-only home, say)."""


@dataclass(frozen=True, eq=False)
class ColumnStore:
    """A converted file: memory-mapped documents, queries in memory."""

    folder: Path
    features: np.ndarray  # (docs, width) float32, read-only, memory-mapped
    labels: np.ndarray  # (docs,) int8, read-only, memory-mapped
    qptr: np.ndarray  # (queries + 1,) int64 document offsets
    qids: np.ndarray  # (queries,) bytes
    lines: np.ndarray  # (queries,) int64 file line of each query's first document

    @property
    def n_queries(self) -> int:
        return len(self.qids)

    def read(self, queries: np.ndarray, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The rows of the documents of ``queries`` (indices into the store), in that order, of
        each of ``arrays`` (the store's per-document arrays), copied into memory: one slice per
        run of adjacent queries (a fancy-indexed gather through the map is ~30x slower on
        millions of rows)."""
        queries = np.asarray(queries, dtype=np.int64)
        starts, ends = self.qptr[queries], self.qptr[queries + 1]
        n = int((ends - starts).sum())
        out = [np.empty((n, *a.shape[1:]), dtype=a.dtype) for a in arrays]
        if not n:
            return out
        first = np.flatnonzero(np.r_[True, starts[1:] != ends[:-1]])  # runs of adjacent queries
        run_start, run_end = starts[first], ends[np.r_[first[1:], len(queries)] - 1]
        at = 0
        for lo, hi in zip(run_start.tolist(), run_end.tolist(), strict=True):
            for dst, src in zip(out, arrays, strict=True):
                dst[at : at + hi - lo] = src[lo:hi]
            at += hi - lo
        return out

    def scaled(self, keep: np.ndarray | None = None) -> np.ndarray:
        """The features min-maxed per query, but for the columns ``keep``, left raw: mapped
        from ``scaled*.f32`` (written on first use, query-aligned chunk by chunk); computed into
        memory where the folder cannot be written (an uncached store)."""
        name = "scaled"
        if keep is not None:
            name += "-" + hashlib.sha256(np.asarray(keep, np.int64).tobytes()).hexdigest()[:16]
        path, meta = self.folder / f"{name}.f32", self.folder / f"{name}.json"
        shape = self.features.shape
        try:
            crc = json.loads(meta.read_text())["crc"]
            found = _mapped(path, np.float32, shape, crc, verify=_nbytes(shape) <= VERIFY_BYTES)
        except (OSError, ValueError, KeyError, TypeError):
            found = None
        if found is not None:
            return found
        try:
            crc = self._write_scaled(path, keep)
            meta.write_text(json.dumps({"crc": crc}))
        except OSError:
            return self._scaled_rows(0, self.n_queries, keep)
        return _raw(path, np.float32, shape)

    def _scaled_rows(self, qa: int, qb: int, keep: np.ndarray | None) -> np.ndarray:
        """Queries ``qa..qb-1`` scaled (:meth:`scaled`)."""
        r0, r1 = int(self.qptr[qa]), int(self.qptr[qb])
        out = normalise_per_query(self.features[r0:r1], self.qptr[qa : qb + 1] - r0)
        if keep is not None:
            out[:, keep] = self.features[r0:r1, keep]
        return out

    def _write_scaled(self, path: Path, keep: np.ndarray | None) -> int:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        cuts = np.unique(np.searchsorted(self.qptr, np.arange(0, len(self.labels), _CHUNK_ROWS)))
        bounds = [*cuts.tolist(), self.n_queries]
        crc = 0
        try:
            with open(tmp, "wb") as fh:
                for qa, qb in zip(bounds[:-1], bounds[1:], strict=True):
                    if qa == qb:
                        continue
                    data = memoryview(self._scaled_rows(qa, qb, keep).reshape(-1)).cast("B")
                    fh.write(data)
                    crc = zlib.crc32(data, crc)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return crc


def store_for(
    path: Path,
    *,
    n_features: int | None = None,
    nan_as_zero: bool = False,
    progress: Progress | None = None,
) -> ColumnStore:
    """The store of ``path`` (a LETOR file) in the cache folder, converted first when there is
    none yet.

    ``n_features`` fixes the width (a larger id is an error), else it is the largest id;
    ``nan_as_zero`` reads a ``nan`` value as 0. Raises :class:`CacheUnwritable` when the cache
    folder cannot be written, :class:`DatasetError` on a bad line.
    """
    try:
        key = file_key(path, f"store v{STORE_VERSION} n={n_features} nan0={nan_as_zero}")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    folder = cache_dir() / f"store-{key[:40]}"
    found = open_store(folder)
    if found is not None:
        return found
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder.parent):
            pass
    except OSError as exc:
        raise CacheUnwritable(exc.errno, exc.strerror, str(folder.parent)) from None
    return _convert(path, folder, n_features, nan_as_zero, progress)


def read_store(
    path: Path,
    *,
    cache: bool = True,
    n_features: int | None = None,
    nan_as_zero: bool = False,
    progress: Progress | None = None,
) -> ColumnStore:
    """:func:`store_for`, or with ``cache=False`` :func:`uncached_store`; an unwritable cache
    folder takes the uncached path and says so (a warning)."""
    if cache:
        try:
            return store_for(
                path, n_features=n_features, nan_as_zero=nan_as_zero, progress=progress
            )
        except CacheUnwritable as exc:
            warnings.warn(
                f"{path}: converted into a temporary folder, not cached: cannot write the cache "
                f"folder {exc.filename} ({exc.strerror})",
                RuntimeWarning,
                stacklevel=2,
            )
    return uncached_store(path, n_features=n_features, nan_as_zero=nan_as_zero)


def uncached_store(
    path: Path, *, n_features: int | None = None, nan_as_zero: bool = False
) -> ColumnStore:
    """``path`` converted into a temporary folder that is removed at once: its arrays stay
    mapped (and on the temporary disk) until they are dropped."""
    with tempfile.TemporaryDirectory(prefix="foltr-store-") as tmp:
        return _convert(path, Path(tmp) / "store", n_features, nan_as_zero, None)


def open_store(folder: Path) -> ColumnStore | None:
    """The store in ``folder``, or None when it is missing, interrupted or fails a check."""
    try:
        meta = json.loads((folder / META).read_text())
        if meta.get("version") != STORE_VERSION:
            return None
        docs, width = int(meta["docs"]), int(meta["width"])
        crc = meta["crc"]
        small = {name: np.load(folder / f"{name}.npy", allow_pickle=False) for name in _ARRAYS}
        for name, arr in small.items():
            if zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) != crc[name]:
                return None
        labels = _mapped(folder / LABELS, np.int8, (docs,), crc[LABELS], verify=True)
        features = _mapped(
            folder / FEATURES,
            np.float32,
            (docs, width),
            crc[FEATURES],
            verify=_nbytes((docs, width)) <= VERIFY_BYTES,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if features is None or labels is None:
        return None
    qptr, qids, lines = small["qptr"], small["qids"], small["lines"]
    ok = (
        qptr.dtype == np.int64
        and qptr.ndim == 1
        and len(qptr) >= 2
        and qptr[0] == 0
        and qptr[-1] == docs
        and bool((np.diff(qptr) > 0).all())
        and qids.dtype.kind == "S"
        and qids.shape == (len(qptr) - 1,)
        and lines.shape == qids.shape
    )
    if not ok:
        return None
    return ColumnStore(folder, features, labels, qptr, qids, lines)


def _mapped(
    path: Path, dtype: type, shape: tuple[int, ...], crc: int, *, verify: bool
) -> np.ndarray | None:
    """A read-only map of a raw file of ``shape`` (None when its size or checked CRC differ)."""
    nbytes = _nbytes(shape, dtype)
    if path.stat().st_size != nbytes:
        return None
    arr = _raw(path, dtype, shape)
    if verify and _crc_of(arr) != crc:
        return None
    arr.setflags(write=False)
    return arr


def _nbytes(shape: tuple[int, ...], dtype: type = np.float32) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def _raw(path: Path, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only map of a raw array file (an empty array needs no file: mmap refuses it)."""
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", shape=shape))


def _crc_of(arr: np.ndarray) -> int:
    flat = memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")
    crc = 0
    for i in range(0, len(flat), 1 << 26):
        crc = zlib.crc32(flat[i : i + (1 << 26)], crc)
    return crc


def file_key(path: Path, what: str) -> str:
    """A SHA-256 naming what is cached of ``path``: ``what`` (the format and options), the
    parser version, the file's resolved path, size and modification time and its first and
    last MiB."""
    st = path.stat()
    h = hashlib.sha256(
        f"{what} parser v{PARSER_VERSION} {path.resolve()} {st.st_size} {st.st_mtime_ns}".encode()
    )
    with open(path, "rb") as fh:
        h.update(fh.read(_FINGERPRINT))
        if st.st_size > _FINGERPRINT:
            fh.seek(max(_FINGERPRINT, st.st_size - _FINGERPRINT))
            h.update(fh.read(_FINGERPRINT))
    return h.hexdigest()


def _convert(
    path: Path,
    folder: Path,
    n_features: int | None,
    nan_as_zero: bool,
    progress: Progress | None,
) -> ColumnStore:
    """One streaming pass from ``path`` into a temporary folder, renamed to ``folder`` when
    complete (a store is never seen half-written)."""
    size = path.stat().st_size
    t0 = time.perf_counter()
    log.info("dataset_converting", file=str(path), mb=round(size / 2**20, 1), store=str(folder))
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = _Writer(tmp, n_features)
        blocks = scan_letor(
            path, n_features=n_features, block=CONVERT_BLOCK, nan_as_zero=nan_as_zero
        )
        progress = progress or _logged_tenths()
        for blk in blocks:
            writer.add(blk, path)
            progress(path, blk.bytes_done, size)
        writer.finish(path)
        _publish(tmp, folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(
            f"{path}: cannot write its store in {folder.parent} ({exc.strerror or exc})"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    store = open_store(folder)
    if store is None:  # just written and checked: only a failing disk gets here
        raise OSError(f"{folder}: the store just written does not read back")
    seconds = time.perf_counter() - t0
    log.info(
        "dataset_converted",
        file=str(path),
        docs=len(store.labels),
        queries=store.n_queries,
        seconds=round(seconds, 1),
        docs_per_s=round(len(store.labels) / max(seconds, 1e-9)),
    )
    return store


def _logged_tenths() -> Progress:
    """A conversion's progress when nobody asked for it (a run's): a log event at every tenth
    of a file of at least ``PROGRESS_LOG_BYTES``."""
    shown = [0]

    def progress(path: Path, done: int, size: int) -> None:
        tenth = done * 10 // max(size, 1)
        if size >= PROGRESS_LOG_BYTES and tenth > shown[0]:
            shown[0] = tenth
            log.info(
                "dataset_conversion_progress",
                file=str(path),
                percent=10 * tenth,
                mb=round(done / 2**20),
            )

    return progress


def _publish(tmp: Path, folder: Path) -> None:
    """Rename the finished ``tmp`` to ``folder``, replacing a stale or corrupt store there; when
    another process has just published a good one, keep that (runs mapping it are unaffected)."""
    if open_store(folder) is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:
        if open_store(folder) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)


class _Writer:
    """Appends parsed blocks to the store's raw files, noting where each run of one qid
    starts; ``finish`` groups the runs of a qid that recur and writes the queries."""

    def __init__(self, folder: Path, n_features: int | None) -> None:
        self.folder = folder
        self.width = n_features or 0
        self.rows = 0
        self.crc = {FEATURES: 0, LABELS: 0}
        self.files = {name: open(folder / name, "wb") for name in (FEATURES, LABELS)}  # noqa: SIM115
        self.starts: list[np.ndarray] = []
        self.qids: list[np.ndarray] = []
        self.lines: list[np.ndarray] = []
        self.last: bytes | None = None  # the qid of the last document written

    @property
    def written(self) -> int:
        return self.rows * self.width * 4

    def _write(self, name: str, arr: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")
        try:
            self.files[name].write(data)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DatasetError(
                    f"{self.folder.parent}: the disk filled while writing a store "
                    f"({_gib(self.written)} of features so far)"
                ) from None
            raise
        self.crc[name] = zlib.crc32(data, self.crc[name])

    def add(self, blk: LetorBlock, path: Path) -> None:
        width = max(self.width, blk.max_id)
        need = (self.rows + len(blk.labels)) * width * 4
        if need > self.written + _free_bytes(self.folder):
            raise DatasetError(
                f"{path}:{blk.doc_line[0]}: these documents make the store's feature matrix "
                f"{_gib(need)} ({self.rows + len(blk.labels):,} documents x {width} features); "
                f"the disk of {self.folder.parent} has {_gib(_free_bytes(self.folder))} free"
            )
        if blk.max_id > self.width:
            self._widen(blk.max_id)
        dense = blk.dense
        if dense.shape[1] < self.width:
            dense = np.pad(dense, ((0, 0), (0, self.width - dense.shape[1])))
        self._write(FEATURES, dense)
        self._write(LABELS, blk.labels)
        q = blk.qids
        new = np.empty(len(q), dtype=bool)
        new[0] = q[0] != self.last
        np.not_equal(q[1:], q[:-1], out=new[1:])
        at = np.flatnonzero(new)
        self.starts.append(at + self.rows)
        self.qids.append(q[at])
        self.lines.append(blk.doc_line[at])
        self.last = bytes(q[-1])
        self.rows += len(q)

    def _widen(self, width: int) -> None:
        """Rewrite the rows so far at ``width`` columns (a later line has a larger id)."""
        old = self.width
        self.width = width
        if self.rows == 0:
            return
        self.files[FEATURES].close()
        src = self.folder / FEATURES
        was = _raw(src, np.float32, (self.rows, old))
        part = self.folder / f"{FEATURES}.wide"
        self.crc[FEATURES] = 0
        self.files[FEATURES] = open(part, "wb")  # noqa: SIM115
        for r0 in range(0, self.rows, _CHUNK_ROWS):
            n = min(_CHUNK_ROWS, self.rows - r0)
            rows = np.zeros((n, width), dtype=np.float32)
            rows[:, :old] = was[r0 : r0 + n]
            self._write(FEATURES, rows)
        del was
        os.replace(part, src)

    def finish(self, path: Path) -> None:
        for fh in self.files.values():
            fh.close()
        if self.rows == 0:
            raise DatasetError(f"{path}: no data lines (expected 'label qid:<id> 1:<value> ...')")
        starts = np.concatenate(self.starts)
        qids = np.concatenate(self.qids)
        lines = np.concatenate(self.lines)
        uniq, first, inverse = np.unique(qids, return_index=True, return_inverse=True)
        if len(uniq) < len(qids):  # some qid's documents are not contiguous in the file
            starts, qids, lines = self._group(starts, uniq, first, inverse.reshape(-1), lines)
        try:
            qids.astype(str)
        except UnicodeDecodeError:
            bad = next(i for i, q in enumerate(qids.tolist()) if not _utf8(q))
            raise DatasetError(
                f"{path}:{lines[bad]}: expected a UTF-8 query id, got {bytes(qids[bad])!r}"
            ) from None
        arrays = {"qptr": np.append(starts, self.rows).astype(np.int64), "qids": qids}
        arrays["lines"] = lines.astype(np.int64)
        crc = dict(self.crc)
        for name, arr in arrays.items():
            np.save(self.folder / f"{name}.npy", arr, allow_pickle=False)
            crc[name] = zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"))
        meta = {"version": STORE_VERSION, "docs": self.rows, "width": self.width, "crc": crc}
        (self.folder / META).write_text(json.dumps(meta))

    def _group(
        self,
        starts: np.ndarray,
        uniq: np.ndarray,
        first: np.ndarray,
        inverse: np.ndarray,
        lines: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rewrite the documents query after query (a qid's runs in file order, qids in order
        of first appearance), chunk by chunk; returns the queries' starts, qids and lines."""
        order = np.argsort(first, kind="stable")
        rank = np.empty(len(uniq), dtype=np.int64)
        rank[order] = np.arange(len(uniq))
        group = rank[inverse]
        runs = np.argsort(group, kind="stable")
        sizes = np.diff(np.append(starts, self.rows))
        per_query = np.bincount(group, weights=sizes, minlength=len(uniq)).astype(np.int64)
        new_starts = np.zeros(len(uniq), dtype=np.int64)
        np.cumsum(per_query[:-1], out=new_starts[1:])
        was = {
            FEATURES: _raw(self.folder / FEATURES, np.float32, (self.rows, self.width)),
            LABELS: _raw(self.folder / LABELS, np.int8, (self.rows,)),
        }
        for name in was:
            self.crc[name] = 0
            self.files[name] = open(self.folder / f"{name}.grouped", "wb")  # noqa: SIM115
        cuts = np.searchsorted(np.cumsum(sizes[runs]), np.arange(0, self.rows, _CHUNK_ROWS))
        for lo, hi in zip(cuts, [*cuts[1:], len(runs)], strict=True):
            part = runs[lo:hi]
            if not len(part):
                continue
            rows = ranges(starts[part], sizes[part])
            for name, arr in was.items():
                self._write(name, arr[rows])
        for name, fh in self.files.items():
            fh.close()
            os.replace(self.folder / f"{name}.grouped", self.folder / name)
        first_run = runs[np.append(0, np.cumsum(np.bincount(group))[:-1])]
        return new_starts, uniq[order], lines[first_run]


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _utf8(q: bytes) -> bool:
    try:
        q.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
