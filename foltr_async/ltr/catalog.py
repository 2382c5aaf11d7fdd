"""The published learning-to-rank collections as users download them: recognise a folder's
layout, and check every line of it against what the collection defines.

Layouts (checked against the distributors' pages; docs/DATASETS.md names them):

- LETOR 4.0 MQ2007 / MQ2008: ``Fold1`` .. ``Fold5``, each ``train.txt vali.txt test.txt``;
  46 features, grades 0-2, features already query-level normalised (QueryLevelNorm).
- MSLR-WEB10K / 30K: the same fold layout; 136 features, grades 0-4, raw feature values.
- Yahoo! LTR set 1: ``set1.train.txt set1.valid.txt set1.test.txt`` (set 2 may sit beside);
  700 feature ids of which set 1 uses 519, grades 0-4, fixed splits.
- Istella-S: ``sample/train.txt vali.txt test.txt`` (a 60/20/20 split); 220 features,
  grades 0-4, raw feature values.

:func:`recognise` reads the folder names and one line, so a run can take its folds from the
layout at once; :func:`check` streams every file (bounded memory) and reports what a run would
see. Everything off is a one-line :class:`DatasetError` naming file and line.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from foltr_async.errors import DatasetError
from foltr_async.ltr.clicks import grade_scale
from foltr_async.ltr.letor_parse import check_line, scan_letor

SPLITS = ("train", "vali", "test")
#: text per parsed block: 4 MiB peaks at ~210 MB resident on an MSLR-like file where the
#: loader's 32 MiB blocks peak at 1.4 GB, at the same CPU time (measured on 300,000 lines)
CHECK_BLOCK = 4 << 20
_FOLD = re.compile(r"Fold(\d+)")
_LETOR_FILES = {"train": "train.txt", "vali": "vali.txt", "test": "test.txt"}


@dataclass(frozen=True)
class Collection:
    """What a published collection defines, and how runs read it."""

    name: str
    n_features: int  # the highest feature id it defines
    grades: tuple[int, ...]
    folds: int  # FoldN folders it ships (0: fixed splits)
    files: dict[str, str]  # split -> file name
    #: runs apply query-level min-max scaling (dataset.normalise); False where the collection
    #: ships normalised features
    normalise: bool

    def grade_text(self) -> str:
        return f"{self.grades[0]}-{self.grades[-1]}"


LETOR4 = Collection("LETOR 4.0 (MQ2007/MQ2008)", 46, (0, 1, 2), 5, _LETOR_FILES, False)
MSLR = Collection("MSLR-WEB10K/30K", 136, (0, 1, 2, 3, 4), 5, _LETOR_FILES, True)
YAHOO = Collection(
    "Yahoo! LTR set 1",
    700,
    (0, 1, 2, 3, 4),
    0,
    {"train": "set1.train.txt", "vali": "set1.valid.txt", "test": "set1.test.txt"},
    True,
)
ISTELLA = Collection("Istella-S", 220, (0, 1, 2, 3, 4), 0, _LETOR_FILES, True)
#: dense collections told apart by the feature count of a line
BY_WIDTH = {c.n_features: c for c in (LETOR4, MSLR, ISTELLA)}


class NotPublished(DatasetError):
    """A LETOR folder laid out like a collection but with a feature count none of them has (a
    written synthetic profile, one's own data): runs read it as plain files, ``check`` refuses
    it. ``folds`` are its FoldN numbers (empty without folds)."""

    def __init__(self, message: str, folds: tuple[int, ...]) -> None:
        super().__init__(message)
        self.folds = folds


@dataclass(frozen=True)
class Layout:
    """A recognised folder: the collection, what ``dataset.path`` names, its folds and files."""

    collection: Collection
    root: Path  # the folder runs read (FoldN parent, or the split files' folder)
    folds: tuple[int, ...]  # () for fixed splits or one fold's folder
    files: dict[str, dict[str, Path]]  # part ("Fold1", or "" unfolded) -> split -> file

    def describe(self) -> str:
        if self.root.is_file():
            return "a training file and the test.txt beside it"
        if self.folds:
            return f"{len(self.folds)} folds (Fold{self.folds[0]}..Fold{self.folds[-1]})"
        if self.collection.folds:
            return "one fold's folder"
        return "fixed splits, one fold"


def recognise(path: str | Path) -> Layout:
    """The collection and layout of ``path`` from folder names and the first line of one file
    (cheap on any size); a missing split or an unknown layout is a one-line error."""
    root = Path(path)
    if not root.is_dir():
        what = "is a file" if root.exists() else "does not exist"
        raise DatasetError(
            f"{root}: {what}; expected a collection folder (Fold1..Fold5, set1.*.txt, or "
            "train.txt vali.txt test.txt)"
        )
    folds = sorted(
        int(m[1]) for p in root.iterdir() if (m := _FOLD.fullmatch(p.name)) and p.is_dir()
    )
    if folds:
        if folds != [1, 2, 3, 4, 5]:
            found = ", ".join(f"Fold{f}" for f in folds)
            raise DatasetError(
                f"{root}: expected Fold1..Fold5 as the collection ships, found {found}"
            )
        first = _need(root / "Fold1", _LETOR_FILES, "train")
        coll = _by_width(first, (LETOR4, MSLR), tuple(folds))
        files = {f"Fold{f}": _splits(root / f"Fold{f}", coll) for f in folds}
        return Layout(coll, root, tuple(folds), files)
    if any((root / n).exists() for n in YAHOO.files.values()):
        return Layout(YAHOO, root, (), {"": _splits(root, YAHOO)})
    if any((root / n).exists() for n in _LETOR_FILES.values()):
        coll = _by_width(_need(root, _LETOR_FILES, "train"), (ISTELLA, LETOR4, MSLR), ())
        return Layout(coll, root, (), {"": _splits(root, coll, optional=("vali",))})
    if (root / "sample").is_dir():  # Istella-S as unpacked: istella-s-letor/sample/
        return recognise(root / "sample")
    raise DatasetError(
        f"{root}: no collection layout here; expected Fold1..Fold5 (LETOR 4.0, MSLR-WEB), "
        "set1.train.txt set1.valid.txt set1.test.txt (Yahoo!), or train.txt vali.txt test.txt "
        "(Istella-S's sample folder)"
    )


def _need(folder: Path, names: dict[str, str], split: str) -> Path:
    p = folder / names[split]
    if not p.is_file():
        raise DatasetError(f"{p}: missing (expected {', '.join(names.values())} in {folder})")
    return p


def _splits(folder: Path, coll: Collection, optional: tuple[str, ...] = ()) -> dict[str, Path]:
    """The split files; an ``optional`` one is left out when absent (a run of one folder
    needs train and test only)."""
    return {
        s: _need(folder, coll.files, s)
        for s in SPLITS
        if s not in optional or (folder / coll.files[s]).is_file()
    }


def _single_file(path: Path) -> Layout:
    """A training file as a run reads it: ``dataset.path = FILE`` takes the test.txt beside."""
    test = path.with_name("test.txt")
    if not test.is_file():
        raise DatasetError(
            f"{test}: missing (a run given the file {path.name} reads test.txt beside it)"
        )
    coll = _by_width(path, (ISTELLA, LETOR4, MSLR), ())
    return Layout(coll, path, (), {"": {"train": path, "test": test}})


def _by_width(path: Path, candidates: tuple[Collection, ...], folds: tuple[int, ...]) -> Collection:
    """The dense collection whose feature count the first data line of ``path`` has."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.rstrip(b"\n").decode("utf-8", errors="surrogateescape")
            msg = check_line(line, None)
            if msg is not None:
                raise DatasetError(f"{path}:{n}: {msg}")
            ids = [int(t.partition(":")[0]) for t in line.split("#", 1)[0].split()[2:]]
            if not ids:
                continue
            coll = BY_WIDTH.get(max(ids))
            if coll in candidates:
                return coll
            known = " or ".join(f"{c.n_features} ({c.name})" for c in candidates)
            raise NotPublished(f"{path}:{n}: feature ids up to {max(ids)}; expected {known}", folds)
    raise DatasetError(f"{path}: no data lines (expected 'label qid:<id> 1:<value> ...')")


@dataclass
class SplitStats:
    """What one split file holds."""

    path: Path
    docs: int = 0
    max_id: int = 0
    grade_counts: np.ndarray = field(default_factory=lambda: np.zeros(128, dtype=np.int64))
    used: np.ndarray | None = None  # feature ids (0-based) with a non-zero value somewhere
    lo: float = np.inf
    hi: float = -np.inf
    best: dict[bytes, int] = field(default_factory=dict)  # qid -> its highest grade

    @property
    def queries(self) -> int:
        return len(self.best)

    @property
    def no_relevant(self) -> int:
        return sum(1 for g in self.best.values() if g == 0)


@dataclass
class Report:
    layout: Layout
    parts: dict[str, dict[str, SplitStats]]
    bytes: int  # in every file
    parsed: int  # of them parsed (the rest repeats parsed files byte for byte)

    @property
    def name(self) -> str:
        """The collection's name, told apart by size where two share a layout (LETOR 4.0:
        about 1,700 vs 800 queries; MSLR-WEB: 10,000 vs 30,000, per their pages)."""
        coll = self.layout.collection
        if coll not in (LETOR4, MSLR):
            return coll.name
        per_fold = sum(s.queries for s in next(iter(self.parts.values())).values())
        if coll is LETOR4:
            return "LETOR 4.0 MQ2008" if per_fold < 1200 else "LETOR 4.0 MQ2007"
        return "MSLR-WEB10K" if per_fold < 20000 else "MSLR-WEB30K"

    def _all(self) -> list[SplitStats]:
        return [s for part in self.parts.values() for s in part.values()]

    @property
    def max_grade(self) -> int:
        counts = sum(s.grade_counts for s in self._all())
        return int(np.flatnonzero(counts).max())

    def lines(self) -> list[str]:
        lay, coll = self.layout, self.layout.collection
        stats = self._all()
        counts = sum(s.grade_counts for s in stats)
        grades = [int(g) for g in np.flatnonzero(counts)]
        used = np.any([s.used for s in stats if s.used is not None], axis=0)
        max_id = max(s.max_id for s in stats)
        n = grade_scale(self.max_grade)
        reads = f"folds {', '.join(map(str, lay.folds))}" if lay.folds else "its one split"
        out = [
            f"{lay.root}: {self.name}, {lay.describe()}",
            f"  {'':6} {'split':5} {'queries':>9} {'documents':>11} {'no relevant doc':>16}",
        ]
        for part, splits in self.parts.items():
            for i, (split, s) in enumerate(splits.items()):
                out.append(
                    f"  {'' if i else part:6} {split:5} {s.queries:>9,} {s.docs:>11,} "
                    f"{s.no_relevant:>16,}"
                )
        no_rel = sum(s.no_relevant for s in stats)
        out += [
            f"  features: max id {max_id} of the collection's {coll.n_features}; "
            f"{int(used.sum())} ids carry a non-zero value; values "
            f"{min(s.lo for s in stats):.6g} .. {max(s.hi for s in stats):.6g}",
            "  grades (documents, every file): "
            + " | ".join(f"{g}: {int(counts[g]):,}" for g in grades)
            + f" (the collection's {coll.grade_text()})",
            f"  queries without a relevant document: {no_rel:,} of "
            f"{sum(s.queries for s in stats):,} (offline nDCG skips them by default: "
            "evaluation.no_relevant)",
            f"  click models: the {n}-grade cascade tables (thesis Table 2.{1 if n == 3 else 2})",
            f"  runs: --set dataset.path={lay.root} takes {reads}, "
            f"dataset.normalise = {str(coll.normalise).lower()}",
        ]
        return out


def check(path: str | Path, progress: Callable[[Path, int, int], None] | None = None) -> Report:
    """Recognise ``path`` (a collection folder, or a training file with test.txt beside it,
    as runs take them) and validate every line of every file (streamed: memory stays at a
    few blocks); ``progress(file, bytes_done, size)`` is called per block.

    The fold collections ship five parts rotated over the folds: each vali/test file is one
    part (and appears twice), each train.txt is three of them end to end. Files (or runs of
    bytes) equal to a part parsed before are matched by SHA-256 and take its counts instead of
    being parsed again, so LETOR 4.0 and MSLR-WEB are parsed once, not five times; a file that
    does not match is parsed in full.
    """
    layout = _single_file(Path(path)) if Path(path).is_file() else recognise(path)
    coll = layout.collection
    known: dict[bytes, _Part] = {}
    stats: dict[tuple[str, str], SplitStats] = {}
    total = parsed = 0
    # vali and test first: they are the parts train files are made of
    todo = [(part, split, f) for part, files in layout.files.items() for split, f in files.items()]
    todo.sort(key=lambda t: t[1] == "train")
    for part, split, f in todo:
        size = f.stat().st_size
        total += size
        seq = _as_known(f, known, progress) if known else None
        if seq is not None:
            stats[part, split] = _merged(f, seq, coll.n_features)
            continue
        stats[part, split] = st = _scan(f, coll, progress)
        parsed += size
        if len(layout.files) > 1 and split != "train":
            digest, head, last = _fingerprint(f, progress)
            if last == b"\n":  # a part ending mid-line could not be joined to the next one
                known[digest] = _Part(st, size, digest, head)
    parts = {
        part: {split: stats[part, split] for split in files} for part, files in layout.files.items()
    }
    for splits in parts.values():
        _disjoint(splits)
    return Report(layout, parts, total, parsed)


@dataclass(frozen=True)
class _Part:
    """A parsed file other files may repeat byte for byte."""

    stats: SplitStats
    size: int
    digest: bytes
    head: bytes  # its first _HEAD bytes: which part a run of bytes may be


_HEAD = 4096
_PIECE = 1 << 24


def _fingerprint(path: Path, progress) -> tuple[bytes, bytes, bytes]:
    """SHA-256, first bytes and last byte of ``path``."""
    with open(path, "rb") as fh:
        head = fh.read(_HEAD)
        fh.seek(0)
        digest, last = _digest(fh, path.stat().st_size, path, progress)
    return digest, head, last


def _digest(fh, n: int, path: Path, progress) -> tuple[bytes, bytes]:
    """SHA-256 of the next ``n`` bytes of ``fh`` and the last of them."""
    h, left, last, start, size = hashlib.sha256(), n, b"", fh.tell(), path.stat().st_size
    while left:
        piece = fh.read(min(_PIECE, left))
        if not piece:
            break
        h.update(piece)
        left -= len(piece)
        last = piece[-1:]
        if progress is not None:
            progress(path, start + n - left, size)
    return h.digest(), last


def _as_known(path: Path, known: dict[bytes, _Part], progress) -> list[_Part] | None:
    """``path`` as parsed parts end to end (each run of bytes matched by its SHA-256), or None
    when it is not (then it is parsed)."""
    size = path.stat().st_size
    seq: list[_Part] = []
    with open(path, "rb") as fh:
        off = 0
        while off < size:
            head = fh.read(_HEAD)
            fh.seek(off)
            fits = [
                p for p in known.values() if p.size <= size - off and head[: len(p.head)] == p.head
            ]
            if len(fits) != 1:
                return None
            part = fits[0]
            if _digest(fh, part.size, path, progress)[0] != part.digest:
                return None
            seq.append(part)
            off += part.size
    return seq or None


def _merged(path: Path, seq: list[_Part], n_features: int) -> SplitStats:
    """The counts of a file made of already parsed parts."""
    st = SplitStats(path, used=np.zeros(n_features, dtype=bool))
    for part in seq:
        p = part.stats
        st.docs += p.docs
        st.max_id = max(st.max_id, p.max_id)
        st.grade_counts = st.grade_counts + p.grade_counts
        st.used |= p.used
        st.lo, st.hi = min(st.lo, p.lo), max(st.hi, p.hi)
        for q, g in p.best.items():
            st.best[q] = max(g, st.best.get(q, 0))
    return st


def _scan(path: Path, coll: Collection, progress) -> SplitStats:
    st = SplitStats(path, used=np.zeros(coll.n_features, dtype=bool))
    size = path.stat().st_size
    allowed = np.zeros(128, dtype=bool)
    allowed[list(coll.grades)] = True
    for blk in scan_letor(path, n_features=coll.n_features, block=CHECK_BLOCK):
        bad = ~allowed[blk.labels]
        if bad.any():
            i = int(np.argmax(bad))
            raise DatasetError(
                f"{path}:{blk.doc_line[i]}: grade {blk.labels[i]}; {coll.name} grades are "
                f"{coll.grade_text()}"
            )
        st.docs += len(blk.labels)
        st.max_id = max(st.max_id, blk.max_id)
        st.grade_counts += np.bincount(blk.labels.astype(np.int64), minlength=128)
        w = blk.dense.shape[1]
        if w:
            st.used[:w] |= (blk.dense != 0).any(axis=0)
            st.lo = min(st.lo, float(blk.dense.min()))
            st.hi = max(st.hi, float(blk.dense.max()))
        uniq, inv = np.unique(blk.qids, return_inverse=True)
        top = np.zeros(len(uniq), dtype=np.int8)
        np.maximum.at(top, inv.reshape(-1), blk.labels)
        for q, g in zip(uniq.tolist(), top.tolist(), strict=True):
            st.best[q] = max(g, st.best.get(q, 0))
        if progress is not None:
            progress(path, blk.bytes_done, size)
    if not st.docs:
        raise DatasetError(f"{path}: no data lines (expected 'label qid:<id> 1:<value> ...')")
    return st


def _disjoint(splits: dict[str, SplitStats]) -> None:
    """A query in two splits of one fold would be trained and tested on."""
    names = list(splits)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            shared = splits[a].best.keys() & splits[b].best.keys()
            if shared:
                q = min(shared).decode("utf-8", errors="replace")
                raise DatasetError(
                    f"{splits[b].path}: {len(shared)} queries also in {splits[a].path.name} "
                    f"(e.g. qid:{q}); a fold's splits hold distinct queries"
                )
