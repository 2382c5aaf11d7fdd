"""The LETOR / SVMlight line parser: whole blocks of text at a time, every line checked.

Lines look like ``label qid:Q 1:v1 2:v2 ... # comment``. The parser works on whole 32 MiB blocks
with numpy byte operations (comment blanking, token boundaries, colon positions) and converts all
numbers of a block in one ``np.fromstring`` call, because a per-token Python loop would need
minutes for an MSLR-WEB10K fold. Only when a block fails validation does a careful line-by-line
parser (:func:`check_line`) run over it, to name the first bad line in a one-line
:class:`DatasetError`.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

from foltr_async.errors import DatasetError

__all__ = [
    "MAX_DENSE_BYTES",
    "MAX_FEATURE_ID",
    "PARSER_VERSION",
    "LetorBlock",
    "check_line",
    "scan_letor",
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

# Separators are space, \t, \v, \f, \r and \n; other control bytes are never valid in a line.
_SPACE, _NL, _HASH, _COLON = 32, 10, 35, 58

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_WS = re.compile(r"[ \t\v\f\r]+")
_CTRL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
_NAN = re.compile(rb":nan(?=\s)")


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
    path: str | os.PathLike[str],
    *,
    n_features: int | None = None,
    block: int = _BLOCK,
    nan_as_zero: bool = False,
) -> Iterator[LetorBlock]:
    """Parse ``path`` block by block (about ``block`` bytes of text each), in file order.

    Memory stays bounded by a few blocks whatever the file size (the vectorised parse needs
    about 15x a block's bytes in temporaries, three blocks in flight), so a whole collection can
    be validated without holding it; every line is checked as :func:`load_letor` checks it (the
    first bad one raises a one-line :class:`DatasetError` naming file and line). Feature ids
    above ``n_features`` are errors; ``nan_as_zero`` reads a ``nan`` value as 0 (AOL4FOLTR's
    writer leaves some).
    """
    path = Path(path)
    parse = _parse_zeroing_nan if nan_as_zero else _parse_block
    line0 = 0
    pending: deque[tuple[Future, int]] = deque()
    # Two blocks in flight: numpy releases the GIL in most of the block parser.
    try:
        with open(path, "rb") as fh, ThreadPoolExecutor(max_workers=2) as pool:
            done = 0
            for raw in _iter_blocks(fh, block):
                done += len(raw)
                pending.append((pool.submit(parse, raw, line0, path, n_features), done))
                line0 += raw.count(b"\n")
                while len(pending) > 2:
                    yield from _collect(pending)
            while pending:
                yield from _collect(pending)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None


def zero_nans(raw: bytes) -> bytes:
    """``raw`` with every ``:nan`` value written as ``:0``."""
    return _NAN.sub(b":0", raw) if b"nan" in raw else raw


def _parse_zeroing_nan(
    raw: bytes, line0: int, path: Path, n_features: int | None
) -> LetorBlock | None:
    return _parse_block(zero_nans(raw), line0, path, n_features)


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
