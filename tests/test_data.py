"""LETOR reader/writer/store: unit tests, a reference-parser differential test, round trips."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foltr_async.errors import DatasetError
from foltr_async.ltr import column_store, letor_parse
from foltr_async.ltr.cache import cache_dir
from foltr_async.ltr.data import load_fold, load_letor, write_letor
from foltr_async.ltr.letor_parse import MAX_FEATURE_ID
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.scaling import normalise_per_query


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Never touch the user's cache; every test gets its own."""
    monkeypatch.setenv("FOLTR_ASYNC_CACHE", str(tmp_path_factory.mktemp("cache")))


def _write(tmp_path: Path, text: str, name: str = "train.txt") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode())
    return p


def _same(a: QuerySet, b: QuerySet) -> bool:
    return (
        np.array_equal(a.features, b.features)
        and a.features.dtype == b.features.dtype
        and np.array_equal(a.labels, b.labels)
        and np.array_equal(a.qptr, b.qptr)
        and np.array_equal(a.qids, b.qids)
    )


# ---------------------------------------------------------------------------------------------
# Reader basics
# ---------------------------------------------------------------------------------------------


def test_comments_blank_lines_missing_features_and_unordered_qids(tmp_path):
    text = (
        "# a header comment\n"
        "2 qid:B 1:0.5 3:-1.5e2 # docid = x:y 9:9\n"
        "\n"
        "0 qid:A 2:7\n"
        "  \t \n"
        "1 qid:B 2:1 #\n"
        "0\tqid:C\t1:3\r\n"
        "1 qid:A 1:1 2:2 3:3"  # no final newline
    )
    qs = load_letor(_write(tmp_path, text), cache=False)
    assert list(qs.qids) == ["B", "A", "C"]  # first-appearance order
    assert qs.qptr.tolist() == [0, 2, 4, 5]
    assert qs.labels.tolist() == [2, 1, 0, 1, 0]  # file order within a query
    assert qs.n_features == 3
    expected = [[0.5, 0, -150], [0, 1, 0], [0, 7, 0], [1, 2, 3], [3, 0, 0]]
    np.testing.assert_array_equal(qs.features, np.array(expected, dtype=np.float32))
    assert qs.features.dtype == np.float32 and qs.features.flags.c_contiguous
    assert qs.labels.dtype == np.int8 and qs.qptr.dtype == np.int64
    assert qs.name == "train"


def test_n_features_pads_and_rejects_larger_ids(tmp_path):
    p = _write(tmp_path, "1 qid:1 2:5\n0 qid:1 1:1\n")
    assert load_letor(p, n_features=6, cache=False).features.shape == (2, 6)
    with pytest.raises(DatasetError, match=r"train\.txt:1: feature id 2 exceeds n_features=1"):
        load_letor(p, n_features=1, cache=False)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("1 foo 1:2", r"train\.txt:3: expected 'qid:<id>' after the label, got 'foo'"),
        ("1", r"train\.txt:3: expected 'qid:<id>' after the label, got end of line"),
        ("x qid:1 1:2", r"train\.txt:3: expected a relevance grade .* got 'x'"),
        ("1.5 qid:1 1:2", r"train\.txt:3: expected a relevance grade"),
        ("-1 qid:1 1:2", r"train\.txt:3: expected a relevance grade"),
        ("1 qid:1 1:abc", r"train\.txt:3: expected a finite number after '1:', got 'abc'"),
        ("1 qid:1 1:nan", r"train\.txt:3: expected a finite number after '1:'"),
        ("1 qid:1 1:1e39", r"train\.txt:3: expected a finite number after '1:'"),
        ("1 qid:1 1:", r"train\.txt:3: expected '<feature id>:<value>'|expected a finite number"),
        ("1 qid:1 0:5", r"train\.txt:3: expected a feature id \(integer 1-10000\)"),
        ("1 qid:1 a:5", r"train\.txt:3: expected a feature id"),
        ("1 qid:1 12", r"train\.txt:3: expected '<feature id>:<value>', got '12'"),
        ("1 qid:1 1:2:3", r"train\.txt:3: expected '<feature id>:<value>', got '1:2:3'"),
        ("1 qid:1 2:1 2:3", r"train\.txt:3: feature id 2 appears twice"),
        ("1 qid:1 1:2\x00", r"train\.txt:3: unexpected control character"),
        ("1 qid: 1:2", r"train\.txt:3: expected 'qid:<id>' after the label, got 'qid:'"),
        ("1 qid:" + "q" * 257, r"train\.txt:3: expected a query id of at most 256 bytes"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, expected):
    p = _write(tmp_path, f"0 qid:1 1:1\n\n{line}\n0 qid:1 1:1\n")
    with pytest.raises(DatasetError, match=expected) as info:
        load_letor(p, cache=False)
    assert "\n" not in str(info.value)


def test_an_absurd_feature_id_is_refused_before_any_matrix_is_made(tmp_path, mq2008_dir):
    """One ``100000:0.5`` token in MQ2008 made a 6 GB matrix (7.68 GB peak): it is now a
    file:line error, and so is an id within range whose dense matrix would be too large."""
    lines = (mq2008_dir / "train.txt").read_text().splitlines()
    lines[4] = lines[4].replace(" 1:", " 100000:0.5 1:", 1)
    p = _write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(
        DatasetError, match=r"train\.txt:5: expected a feature id \(integer 1-10000\)"
    ):
        load_letor(p, cache=False)


def test_a_feature_matrix_beyond_the_cap_names_the_line_of_its_largest_id(tmp_path, monkeypatch):
    monkeypatch.setattr(letor_parse, "MAX_DENSE_BYTES", 4 * 1000 * 100)  # 1,000 docs x 100 features
    p = _write(tmp_path, "0 qid:1 1:1\n" * 999 + f"0 qid:2 {MAX_FEATURE_ID}:1\n")
    with pytest.raises(
        DatasetError,
        match=r"train\.txt:1000: feature id 10000 makes these 1,000 "
        r"documents a 0\.0373 GiB feature matrix; expected at most",
    ):
        load_letor(p, cache=False)
    ok = _write(tmp_path, "0 qid:1 1:1\n" * 999 + "0 qid:2 100:1\n")
    assert load_letor(ok, cache=False).n_features == 100


def test_missing_file_empty_file_and_directory(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.txt: dataset file does not exist"):
        load_letor(tmp_path / "nope.txt")
    with pytest.raises(DatasetError, match="is a directory"):
        load_letor(tmp_path)
    with pytest.raises(DatasetError, match="no data lines"):
        load_letor(_write(tmp_path, "# only a comment\n\n"))


def test_errors_across_blocks_report_global_line_and_first_error(tmp_path, monkeypatch):
    monkeypatch.setattr(column_store, "CONVERT_BLOCK", 64)  # many tiny blocks, two threads
    good = [f"{i % 3} qid:{i // 4} 1:{i}.25 3:{-i}" for i in range(200)]
    p = _write(tmp_path, "\n".join(good) + "\n")
    qs = load_letor(p, cache=False)
    assert qs.n_queries == 50 and qs.n_docs == 200
    np.testing.assert_array_equal(qs.features[:, 0], np.arange(200) + 0.25)
    bad = list(good)
    bad[120] = "1 qid:1 1:oops"
    bad[170] = "1 qid:1 1:worse"
    with pytest.raises(DatasetError, match=r"train\.txt:121: .*'oops'"):
        load_letor(_write(tmp_path, "\n".join(bad) + "\n"), cache=False)


def test_mq2008_sample(mq2008_dir):
    folds = load_fold(mq2008_dir, cache=False)
    assert set(folds) == {"train", "test"}
    train, test = folds["train"], folds["test"]
    assert (train.n_queries, test.n_queries) == (69, 36)
    assert train.n_features == test.n_features == 46
    n_lines = sum(1 for s in (mq2008_dir / "train.txt").read_text().splitlines() if s.strip())
    assert train.n_docs == n_lines
    assert set(np.unique(train.labels)) == {0, 1, 2}
    assert train.qids[0] == "15928" and train.name == "train"
    first = (mq2008_dir / "train.txt").read_text().splitlines()[0].split("#")[0].split()
    row = np.array([float(t.split(":")[1]) for t in first[2:]], dtype=np.float32)
    np.testing.assert_array_equal(train.features[0], row)


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------


def test_query_level_min_max_normalisation(tmp_path):
    text = "0 qid:1 1:2 2:5 3:-4\n1 qid:1 1:4 2:5 3:0\n2 qid:1 1:3 2:5 3:4\n0 qid:2 1:10 2:1 3:0\n"
    qs = load_letor(_write(tmp_path, text), normalise=True, cache=False)
    expected = [[0, 0, 0], [1, 0, 0.5], [0.5, 0, 1], [0, 0, 0]]  # constant -> 0
    np.testing.assert_allclose(qs.features, np.array(expected, dtype=np.float32))
    raw = load_letor(_write(tmp_path, text), cache=False)
    np.testing.assert_array_equal(normalise_per_query(raw.features, raw.qptr), qs.features)


def test_normalisation_matches_a_per_query_reference():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 9, size=40)
    qptr = np.concatenate([[0], np.cumsum(sizes)])
    x = (rng.standard_normal((qptr[-1], 5)) * rng.lognormal(size=5)).astype(np.float32)
    x[:, 4] = 3.0
    got = normalise_per_query(x, qptr)
    for q in range(len(sizes)):
        blk = x[qptr[q] : qptr[q + 1]]
        span = blk.max(0) - blk.min(0)
        ref = np.where(span > 0, (blk - blk.min(0)) / np.where(span > 0, span, 1), 0)
        np.testing.assert_allclose(got[qptr[q] : qptr[q + 1]], ref, rtol=1e-6, atol=1e-7)
    assert got.min() >= 0 and got.max() <= 1


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def _stores() -> list[Path]:
    return sorted(cache_dir().glob("store-*"))


def test_store_hit_changed_file_and_options(tmp_path, conversions):
    p = _write(tmp_path, "1 qid:1 1:0.5 2:1\n0 qid:2 1:2\n")
    calls = conversions
    first = load_letor(p)
    assert len(_stores()) == 1 and len(calls) == 1
    again = load_letor(p)
    assert _same(first, again) and len(calls) == 1  # mapped from the store
    assert isinstance(again.features.base, np.memmap)

    p.write_text("1 qid:1 1:0.5 2:1\n0 qid:2 1:3\n")  # same size, new content
    changed = load_letor(p)
    assert changed.features[1, 0] == 3 and len(calls) == 2

    wide = load_letor(p, n_features=5)  # options are part of the key
    assert wide.n_features == 5 and len(calls) == 3
    normed = load_letor(p, normalise=True)  # normalised from the same store, in memory
    assert len(calls) == 3 and normed.features.max() <= 1


@pytest.mark.parametrize(
    "damage",
    ["truncate features", "flip a feature byte", "drop store.json", "flip a qptr byte"],
)
def test_a_damaged_store_is_built_again(tmp_path, request, damage):
    p = _write(tmp_path, "".join(f"{i % 2} qid:{i // 3} 1:{i} 2:{i * 0.5}\n" for i in range(30)))
    ref = load_letor(p)
    ref = dataclasses.replace(ref, features=np.array(ref.features))  # the damage edits in place
    (store,) = _stores()
    features = store / column_store.FEATURES
    if damage == "truncate features":
        features.write_bytes(features.read_bytes()[:-4])
    elif damage == "flip a feature byte":
        raw = bytearray(features.read_bytes())
        raw[raw.find(np.float32(29).tobytes()) + 2] ^= 0x40
        features.write_bytes(bytes(raw))
    elif damage == "drop store.json":  # what an interrupted conversion leaves
        (store / column_store.META).unlink()
    else:
        raw = bytearray((store / "qptr.npy").read_bytes())
        raw[-3] ^= 0x01
        (store / "qptr.npy").write_bytes(bytes(raw))
    assert column_store.open_store(store) is None
    calls = request.getfixturevalue("conversions")  # counting from here, after the damage
    assert _same(load_letor(p), ref) and len(calls) == 1
    assert _same(load_letor(p), ref) and len(calls) == 1  # the rebuilt store is used again


@pytest.mark.parametrize("block", [16, 1 << 20])
def test_a_store_groups_recurring_qids_and_widens_on_disk(tmp_path, monkeypatch, block):
    monkeypatch.setattr(column_store, "CONVERT_BLOCK", block)  # 16: a line or two per block
    p = _write(tmp_path, "0 qid:a 1:1\n1 qid:b 1:2 3:5\n2 qid:a 2:7\n0 qid:c 5:1\n1 qid:b 1:9\n")
    qs = load_letor(p)
    assert qs.qids.tolist() == ["a", "b", "c"] and qs.qptr.tolist() == [0, 2, 4, 5]
    assert qs.labels.tolist() == [0, 2, 1, 1, 0]
    expect = np.zeros((5, 5), dtype=np.float32)
    expect[0, 0], expect[1, 1], expect[2, [0, 2]], expect[3, 0], expect[4, 4] = 1, 7, (2, 5), 9, 1
    np.testing.assert_array_equal(qs.features, expect)
    (store,) = _stores()
    assert column_store.open_store(store).lines.tolist() == [1, 2, 4]


def test_an_interrupted_conversion_leaves_no_store(tmp_path, monkeypatch):
    monkeypatch.setattr(column_store, "CONVERT_BLOCK", 64)
    p = _write(tmp_path, "".join(f"0 qid:{i} 1:{i}\n" for i in range(100)))

    def interrupt(path, done, size):
        if done > size // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        column_store.store_for(p, progress=interrupt)
    assert list(cache_dir().iterdir()) == []  # no half-written store, no temporary folder
    assert load_letor(p).n_queries == 100


def test_a_store_beyond_the_free_disk_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(column_store, "CONVERT_BLOCK", 12)  # a line per block
    monkeypatch.setattr(column_store, "_free_bytes", lambda folder: 4 * 10 * 50)
    p = _write(tmp_path, "0 qid:1 1:1\n" * 30 + "0 qid:2 50:1\n")
    with pytest.raises(
        DatasetError, match=r"train\.txt:31: these documents make the store's feature matrix"
    ) as info:
        load_letor(p)
    assert "31 documents x 50 features" in str(info.value) and "\n" not in str(info.value)
    assert _stores() == []


def test_unwritable_cache_still_loads_and_says_so(tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("FOLTR_ASYNC_CACHE", str(blocker / "sub"))
    with pytest.warns(RuntimeWarning, match="not cached: cannot write the cache folder"):
        qs = load_letor(_write(tmp_path, "1 qid:1 1:1\n"))
    assert qs.n_docs == 1


# ---------------------------------------------------------------------------------------------
# Folds and writing
# ---------------------------------------------------------------------------------------------


def test_load_fold_layouts(tmp_path):
    fold = tmp_path / "MSLR" / "Fold1"
    fold.mkdir(parents=True)
    (tmp_path / "MSLR" / "Fold2").mkdir()
    _write(fold, "1 qid:1 1:1 2:2 5:3\n0 qid:1 1:0\n", "train.txt")
    _write(fold, "1 qid:7 1:1\n", "vali.txt")
    _write(fold, "0 qid:9 2:1\n", "test.txt")
    sets = load_fold(fold)
    assert list(sets) == ["train", "vali", "test"]
    assert {qs.n_features for qs in sets.values()} == {5}  # padded to the widest split
    assert sets["vali"].name == "vali" and sets["test"].features[0].tolist() == [0, 1, 0, 0, 0]
    with pytest.raises(DatasetError, match="Fold1, Fold2: pass one of them"):
        load_fold(tmp_path / "MSLR")

    yahoo = tmp_path / "yahoo"
    yahoo.mkdir()
    for split in ("train", "valid", "test"):
        _write(yahoo, "2 qid:3 1:0.5\n", f"set1.{split}.txt")
    assert set(load_fold(yahoo)) == {"train", "vali", "test"}
    with pytest.raises(DatasetError, match="does not exist"):
        load_fold(tmp_path / "missing")
    with pytest.raises(DatasetError, match="is a file, not a fold directory"):
        load_fold(fold / "train.txt")


def test_write_letor_formats_and_rejects_unwritable_qids(tmp_path):
    qs = QuerySet(
        features=np.array([[0.1, 0.0, 2.0], [0.0, 0.0, 0.0]], dtype=np.float32),
        labels=np.array([2, 0], dtype=np.int8),
        qptr=np.array([0, 2], dtype=np.int64),
        qids=np.array(["q1"]),
    )
    dense = write_letor(qs, tmp_path / "d.txt").read_text().splitlines()
    assert dense == ["2 qid:q1 1:0.1 2:0.0 3:2.0", "0 qid:q1 1:0.0 2:0.0 3:0.0"]
    sparse = write_letor(qs, tmp_path / "s.txt", sparse=True).read_text().splitlines()
    assert sparse == ["2 qid:q1 1:0.1 3:2.0", "0 qid:q1 3:0.0"]
    bad = QuerySet(qs.features, qs.labels, qs.qptr, np.array(["a b"]))
    with pytest.raises(DatasetError, match="cannot be written"):
        write_letor(bad, tmp_path / "bad.txt")


def test_six_decimal_values_use_fixed_point_text_and_round_trip(tmp_path):
    vals = np.array(
        [[0.478196, -12.5, 0.0, 1.0], [123456.000001, -0.000001, 3.25, 100.0]], dtype=np.float32
    )
    qs = QuerySet(vals, np.array([1, 0], np.int8), np.array([0, 2]), np.array(["7"]))
    p = write_letor(qs, tmp_path / "f.txt")
    assert p.read_text().splitlines()[0] == "1 qid:7 1:0.478196 2:-12.5 3:0.0 4:1.0"
    back = load_letor(p, cache=False)
    assert _same(back, qs)


_QID = st.text(alphabet="abcXYZ0123456789_-.", min_size=1, max_size=6)
_VALUE = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def _query_sets(draw):
    n_q = draw(st.integers(1, 5))
    n_f = draw(st.integers(1, 7))
    qids = draw(st.lists(_QID, min_size=n_q, max_size=n_q, unique=True))
    sizes = draw(st.lists(st.integers(1, 5), min_size=n_q, max_size=n_q))
    n = sum(sizes)
    vals = draw(st.lists(st.one_of(st.just(0.0), _VALUE), min_size=n * n_f, max_size=n * n_f))
    labels = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    return QuerySet(
        features=np.array(vals, dtype=np.float32).reshape(n, n_f),
        labels=np.array(labels, dtype=np.int8),
        qptr=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        qids=np.array(qids),
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(qs=_query_sets(), sparse=st.booleans())
def test_write_then_read_round_trips(tmp_path, qs, sparse):
    p = write_letor(qs, tmp_path / "rt.txt", sparse=sparse)
    back = load_letor(p, cache=False)
    assert _same(back, qs)


# ---------------------------------------------------------------------------------------------
# Differential test against a tiny reference parser
# ---------------------------------------------------------------------------------------------

_NUM = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _reference(lines: list[str]) -> tuple[dict, int | None]:
    """Straightforward per-line parser: (parsed docs by qid, first bad 1-based line or None)."""
    docs: dict[str, list] = {}
    for no, line in enumerate(lines, 1):
        body = line.split("#", 1)[0]
        if re.search(r"[\x00-\x08\x0e-\x1f\x7f]", body):
            return docs, no
        toks = [t for t in re.split(r"[ \t\r\v\f]+", body) if t]
        if not toks:
            continue
        try:
            lab = toks[0]
            assert _NUM.fullmatch(lab) and float(lab).is_integer() and 0 <= float(lab) <= 127
            assert len(toks) >= 2 and toks[1].startswith("qid:")
            qid = toks[1][4:]
            assert qid and ":" not in qid and len(qid.encode()) <= 256
            feats = {}
            for tok in toks[2:]:
                key, val = tok.split(":")  # ValueError unless exactly one colon
                assert re.fullmatch(r"[0-9]{1,6}", key) and 1 <= int(key) <= MAX_FEATURE_ID
                assert _NUM.fullmatch(val)
                with np.errstate(over="ignore"):
                    assert math.isfinite(np.float32(float(val)))
                assert int(key) not in feats
                feats[int(key)] = np.float32(float(val))
        except (AssertionError, ValueError):
            return docs, no
        docs.setdefault(qid, []).append((int(float(lab)), feats))
    return docs, None


_PIECES = [
    "0",
    "1",
    "2",
    "127",
    "128",
    "-1",
    "1.0",
    "2.5",
    "+1",
    "x",
    "1e0",
    "nan",
    "inf",
    "qid:1",
    "qid:2",
    "qid:ab",
    "qid:",
    "qid:1:2",
    "qid",
    "QID:1",
    "qid:" + "x" * 256,
    "qid:" + "x" * 257,
    "qid:\xe9" + "x" * 254,
    "qid:\xe9" + "x" * 255,
    "1:0.5",
    "2:-3",
    "3:1e3",
    "1:.5",
    "2:5.",
    "4:1e-5",
    "1:",
    ":1",
    "0:1",
    "01:2",
    "1:1:1",
    "1234567:1",
    "100001:1",
    "99999:1",
    "1:1e39",
    "1:nan",
    "1:inf",
    "1:0x10",
    "1:1_0",
    "1:1-2",
    "1:--1",
    "1:1e",
    "1:e1",
    "2:1.5.5",
    "a:1",
    "1:é",
    "#",
    "#c 1:x",
    "\x00",
    "\x7f",
    "\x01",
]


@st.composite
def _garbage_lines(draw):
    lines = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            toks = [str(draw(st.integers(0, 2))), f"qid:{draw(st.integers(1, 3))}"]
            toks += [
                f"{i}:{draw(st.integers(-5, 5)) / 4}" for i in range(1, draw(st.integers(0, 4)))
            ]
            if draw(st.integers(0, 3)) == 0:
                toks.insert(draw(st.integers(0, len(toks))), draw(st.sampled_from(_PIECES)))
        else:
            toks = draw(st.lists(st.sampled_from(_PIECES), max_size=5))
        seps = draw(st.lists(st.sampled_from([" ", "  ", "\t", " \r"]), min_size=len(toks)))
        lines.append("".join(s + t for s, t in zip(seps, toks, strict=False)).lstrip(" "))
    return lines


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=_garbage_lines(), block=st.sampled_from([16, 64, column_store.CONVERT_BLOCK]))
def test_garbage_gives_dataset_error_at_the_reference_line(tmp_path, lines, block):
    """Tiny blocks make a store widen (a later line has a larger id) and group (a qid recurs
    in a later block) on disk."""
    p = tmp_path / "g.txt"
    p.write_bytes("\n".join(lines).encode())
    docs, bad = _reference(lines)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(column_store, "CONVERT_BLOCK", block)
        _check_against_reference(p, docs, bad)


def _check_against_reference(p: Path, docs: dict, bad: int | None) -> None:
    if bad is not None:
        with pytest.raises(DatasetError, match=rf"g\.txt:{bad}: "):
            load_letor(p, cache=False)
        return
    if not docs:
        with pytest.raises(DatasetError, match="no data lines"):
            load_letor(p, cache=False)
        return
    qs = load_letor(p, cache=False)
    assert list(qs.qids) == list(docs)
    rows = [d for q in docs for d in docs[q]]
    assert qs.labels.tolist() == [lab for lab, _ in rows]
    width = max((max(f) for _, f in rows if f), default=0)
    assert qs.n_features == width
    for i, (_, feats) in enumerate(rows):
        expect = np.zeros(width, dtype=np.float32)
        for k, v in feats.items():
            expect[k - 1] = v
        np.testing.assert_array_equal(qs.features[i], expect)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(blob=st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_dataset_error(tmp_path, blob):
    p = tmp_path / "b.txt"
    p.write_bytes(blob)
    try:
        load_letor(p, cache=False)
    except DatasetError as exc:
        assert "\n" not in str(exc)


def test_a_normalised_load_maps_the_stores_scaled_copy_after_the_first(tmp_path, monkeypatch):
    from foltr_async.ltr import scaling

    p = _write(tmp_path, "".join(f"{i % 3} qid:{i // 4} 1:{i} 2:{i % 5} 3:7\n" for i in range(40)))
    first = np.array(load_letor(p, normalise=True).features)
    calls = []
    real = scaling.normalise_per_query
    monkeypatch.setattr(column_store, "normalise_per_query", lambda *a: calls.append(1) or real(*a))
    again = load_letor(p, normalise=True)
    assert calls == [] and isinstance(again.features.base, np.memmap)
    np.testing.assert_array_equal(again.features, first)
    (store,) = _stores()
    scaled = store / "scaled.f32"
    raw = bytearray(scaled.read_bytes())
    raw[5] ^= 0x10  # a damaged copy is made again
    scaled.write_bytes(bytes(raw))
    np.testing.assert_array_equal(load_letor(p, normalise=True).features, first)
    assert calls  # scaled again, chunk by chunk
    calls.clear()
    load_letor(p, normalise=True)
    assert calls == []


def test_a_store_another_process_published_first_is_kept(tmp_path):
    p = _write(tmp_path, "1 qid:1 1:1\n0 qid:2 1:2\n")
    load_letor(p)
    (store,) = _stores()
    twin = store.with_name(store.name + ".tmp-other")
    column_store._convert(p, twin, None, False, None)  # a second conversion, finished later
    column_store._publish(twin, store)
    assert not twin.exists() and column_store.open_store(store) is not None


def test_a_large_conversion_nobody_follows_logs_its_tenths(tmp_path, monkeypatch):
    import structlog
    from structlog.testing import capture_logs

    monkeypatch.setattr(column_store, "CONVERT_BLOCK", 64)
    monkeypatch.setattr(column_store, "PROGRESS_LOG_BYTES", 0)  # a run's view of a large file
    p = _write(tmp_path, "".join(f"0 qid:{i} 1:{i}\n" for i in range(400)))
    was = structlog.get_config()  # a CLI test may have left an info-filtering logger behind
    structlog.reset_defaults()
    try:
        with capture_logs() as events:
            load_letor(p)
    finally:
        structlog.configure(**was)
    shown = [e["percent"] for e in events if e["event"] == "dataset_conversion_progress"]
    assert shown == list(range(10, 101, 10))
    assert [e["event"] for e in events][-1] == "dataset_converted"
