"""``dataset check PATH`` on small copies of each published layout, its one-line errors, and
``--set dataset.path=DIR`` moving a reproduce file onto a collection (folds from the layout,
click tables from the grades)."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED, shared_data

from foltr_async.cli import main
from foltr_async.errors import DatasetError
from foltr_async.ltr.catalog import recognise
from foltr_async.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parents[1]
REPRODUCE = ROOT / "reproduce"
LETOR = {"train": "train.txt", "vali": "vali.txt", "test": "test.txt"}
YAHOO = {"train": "set1.train.txt", "vali": "set1.valid.txt", "test": "set1.test.txt"}
QUERIES = {"train": 12, "vali": 4, "test": 4}
DOCS = 6  # per query


def write_split(
    path: Path,
    n_features: int,
    top: int,
    first_qid: int,
    n_queries: int,
    rng,
    sparse: bool = False,
    no_relevant: int = 0,
) -> None:
    """``n_queries`` queries of DOCS documents, grades 0..top (each grade present), the first
    ``no_relevant`` queries with grade 0 only; dense lines, or Yahoo-like sparse ones."""
    lines = []
    for q in range(n_queries):
        grades = rng.integers(0, top + 1, DOCS)
        grades[: min(DOCS, top + 1)] = np.arange(min(DOCS, top + 1))
        if q < no_relevant:
            grades[:] = 0
        for g in grades:
            ids = np.arange(1, n_features + 1)
            if sparse:  # about a third of the ids, always the largest one the file should show
                ids = np.union1d(ids[rng.random(n_features) < 0.3], [n_features])
            feats = " ".join(f"{i}:{v:.4f}" for i, v in zip(ids, rng.random(len(ids)), strict=True))
            lines.append(f"{g} qid:{first_qid + q} {feats}")
    path.write_text("\n".join(lines) + "\n")


def make_fold_collection(root: Path, n_features: int, top: int, seed: int = 0) -> Path:
    """Fold1..Fold5 with train/vali/test (LETOR 4.0 with 46 features, MSLR with 136)."""
    rng = np.random.default_rng(seed)
    for f in range(1, 6):
        qid = 100 * f
        for split, n in QUERIES.items():
            (root / f"Fold{f}").mkdir(parents=True, exist_ok=True)
            write_split(
                root / f"Fold{f}" / LETOR[split],
                n_features,
                top,
                qid,
                n,
                rng,
                no_relevant=1 if split == "test" else 0,
            )
            qid += n
    return root


def make_rotated(root: Path, n_features: int = 136, top: int = 4) -> Path:
    """As MSLR-WEB and LETOR 4.0 ship: five parts S1..S5, Fold k training on S_k, S_k+1,
    S_k+2 (end to end), validating on S_k+3 and testing on S_k+4."""
    rng = np.random.default_rng(3)
    parts = []
    for i in range(5):
        p = root / f"S{i + 1}.txt"
        root.mkdir(parents=True, exist_ok=True)
        write_split(p, n_features, top, 100 * i, 4, rng)
        parts.append(p.read_bytes())
        p.unlink()
    for k in range(5):
        fold = root / f"Fold{k + 1}"
        fold.mkdir()
        (fold / "train.txt").write_bytes(b"".join(parts[(k + j) % 5] for j in range(3)))
        (fold / "vali.txt").write_bytes(parts[(k + 3) % 5])
        (fold / "test.txt").write_bytes(parts[(k + 4) % 5])
    return root


def make_yahoo(root: Path) -> Path:
    """set1.* (sparse, ids up to 699) with set 2 beside it, as ltrc_yahoo unpacks."""
    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    qid = 1
    for split, n in QUERIES.items():
        write_split(root / YAHOO[split], 699, 4, qid, n, rng, sparse=True)
        write_split(root / YAHOO[split].replace("set1", "set2"), 700, 4, qid, 2, rng, sparse=True)
        qid += n
    return root


def make_istella(root: Path) -> Path:
    """istella-s-letor/sample/{train,vali,test}.txt, 220 dense features."""
    rng = np.random.default_rng(2)
    sample = root / "sample"
    sample.mkdir(parents=True)
    qid = 1
    for split, n in QUERIES.items():
        write_split(sample / LETOR[split], 220, 4, qid, n, rng)
        qid += n
    return root


@pytest.fixture(scope="module")
def collections(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("collections")
    return {
        "letor4": make_fold_collection(base / "MQ2007", 46, 2),
        "mslr": make_fold_collection(base / "MSLR-WEB10K", 136, 4),
        "yahoo": make_yahoo(base / "ltrc_yahoo"),
        "istella": make_istella(base / "istella-s-letor"),
    }


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def check(path: Path, capsys) -> tuple[int, str, str]:
    code = main(["dataset", "check", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "kind, name, layout, features, grades, table",
    [
        ("letor4", "LETOR 4.0 MQ2008", "5 folds (Fold1..Fold5)", 46, "0: ", "3-grade"),
        ("mslr", "MSLR-WEB10K", "5 folds (Fold1..Fold5)", 136, "4: ", "5-grade"),
        ("yahoo", "Yahoo! LTR set 1", "fixed splits, one fold", 699, "4: ", "5-grade"),
        ("istella", "Istella-S", "fixed splits, one fold", 220, "4: ", "5-grade"),
    ],
)
def test_each_layout_is_recognised_and_reported(
    collections, capsys, kind, name, layout, features, grades, table
):
    code, out, err = check(collections[kind], capsys)
    assert code == 0, err
    head, *rows = out.splitlines()
    assert head.endswith(f"{name}, {layout}")
    n_docs = {s: n * DOCS for s, n in QUERIES.items()}
    for split in ("train", "vali", "test"):  # queries, documents, queries without a relevant doc
        row = next(r for r in rows if r.split()[:1] in (["Fold1"], [split]) and split in r)
        cells = row.split()[-3:]
        no_rel = 1 if kind in ("letor4", "mslr") and split == "test" else 0
        assert cells == [str(QUERIES[split]), str(n_docs[split]), str(no_rel)], row
    assert f"max id {features} of the collection's" in out
    assert grades in out and f"the {table} cascade tables" in out
    if kind == "yahoo":  # set 2 beside set 1 is left alone
        assert "set2" not in out
    if kind == "istella":  # the unpacked archive's folder leads to its sample folder
        assert f"--set dataset.path={collections[kind] / 'sample'} " in out


def test_the_report_counts_queries_without_a_relevant_document(collections, capsys):
    code, out, _ = check(collections["mslr"], capsys)
    assert code == 0
    # one such query in each fold's test split: 5 of 5 x 20 queries
    assert "queries without a relevant document: 5 of 100" in out
    assert "folds 1, 2, 3, 4, 5, dataset.normalise = true" in out


def _one_line_error(path: Path, capsys) -> str:
    code, out, err = check(path, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_missing_split_or_fold_is_one_line_naming_it(collections, tmp_path, capsys):
    mslr = copy_of(collections["mslr"], tmp_path / "mslr")
    (mslr / "Fold3" / "vali.txt").unlink()
    err = _one_line_error(mslr, capsys)
    assert f"{mslr / 'Fold3' / 'vali.txt'}: missing" in err
    yahoo = copy_of(collections["yahoo"], tmp_path / "yahoo")
    (yahoo / "set1.test.txt").unlink()
    assert f"{yahoo / 'set1.test.txt'}: missing" in _one_line_error(yahoo, capsys)
    letor = copy_of(collections["letor4"], tmp_path / "letor")
    (letor / "Fold5" / "train.txt").rename(letor / "train.txt")
    for p in (letor / "Fold5").iterdir():
        p.unlink()
    (letor / "Fold5").rmdir()
    assert "expected Fold1..Fold5 as the collection ships, found Fold1, Fold2, Fold3, Fold4" in (
        _one_line_error(letor, capsys)
    )


def _set_line(path: Path, number: int, edit) -> None:
    lines = path.read_text().splitlines()
    lines[number - 1] = edit(lines[number - 1])
    path.write_text("\n".join(lines) + "\n")


def test_a_bad_line_is_named_by_file_and_line_number(collections, tmp_path, capsys):
    ist = copy_of(collections["istella"], tmp_path / "istella")
    test = ist / "sample" / "test.txt"
    _set_line(test, 5, lambda line: line.replace(" 7:", " 7:abc", 1).replace("abc0", "abc"))
    err = _one_line_error(ist, capsys)
    assert f"{test}:5: expected a finite number after '7:'" in err


def test_a_feature_id_beyond_the_collection_is_named(collections, tmp_path, capsys):
    mslr = copy_of(collections["mslr"], tmp_path / "mslr")
    train = mslr / "Fold2" / "train.txt"
    _set_line(train, 9, lambda line: line + " 137:1.0")
    assert f"{train}:9: feature id 137 exceeds n_features=136" in _one_line_error(mslr, capsys)
    yahoo = copy_of(collections["yahoo"], tmp_path / "yahoo")
    valid = yahoo / "set1.valid.txt"
    _set_line(valid, 2, lambda line: line + " 701:0.5")
    assert f"{valid}:2: feature id 701 exceeds n_features=700" in _one_line_error(yahoo, capsys)


def test_a_grade_outside_the_collection_is_named(collections, tmp_path, capsys):
    letor = copy_of(collections["letor4"], tmp_path / "letor")
    test = letor / "Fold4" / "test.txt"
    _set_line(test, 3, lambda line: "3" + line[1:])
    err = _one_line_error(letor, capsys)
    assert f"{test}:3: grade 3; LETOR 4.0 (MQ2007/MQ2008) grades are 0-2" in err


def test_an_unknown_layout_or_feature_count_is_one_line(collections, tmp_path, capsys):
    assert "no collection layout here" in _one_line_error(tmp_path, capsys)
    mslr = copy_of(collections["mslr"], tmp_path / "odd")
    _set_line(mslr / "Fold1" / "train.txt", 1, lambda line: line + " 140:1")
    err = _one_line_error(mslr, capsys)
    assert (
        "train.txt:1: feature ids up to 140; expected 46 (LETOR 4.0 (MQ2007/MQ2008)) or 136" in err
    )


def test_a_query_in_two_splits_of_a_fold_is_refused(collections, tmp_path, capsys):
    ist = copy_of(collections["istella"], tmp_path / "istella")
    vali = ist / "sample" / "vali.txt"
    _set_line(vali, 1, lambda line: line.replace(f"qid:{QUERIES['train'] + 1} ", "qid:1 ", 1))
    assert f"{vali}: 1 queries also in train.txt (e.g. qid:1)" in _one_line_error(ist, capsys)


def test_rotated_parts_are_parsed_once_and_counted_in_every_fold(tmp_path, capsys):
    root = make_rotated(tmp_path / "MSLR")
    part = (root / "Fold1" / "vali.txt").stat().st_size  # the parts are about equal in size
    code, out, err = check(root, capsys)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[2:17]]
    assert [r[-3:] for r in rows] == [["12", "72", "0"], ["4", "24", "0"], ["4", "24", "0"]] * 5
    parsed = float(out.rsplit("(", 1)[1].split(" MB parsed")[0])
    total = sum(f.stat().st_size for f in root.rglob("*.txt"))
    assert parsed < 0.3 * total / 2**20 and parsed >= 4 * part / 2**20 - 0.1


def test_a_bad_line_in_a_shared_part_or_a_train_file_is_still_found(tmp_path, capsys):
    root = make_rotated(tmp_path / "parts")
    _set_line(root / "Fold3" / "test.txt", 6, lambda line: "9" + line[1:])  # S2, also Fold4 vali
    err = _one_line_error(root, capsys)
    assert f"{root / 'Fold3' / 'test.txt'}:6: grade 9; MSLR-WEB10K/30K grades are 0-4" in err
    root = make_rotated(tmp_path / "train")
    train = root / "Fold2" / "train.txt"  # no longer its three parts end to end: parsed in full
    _set_line(train, 30, lambda line: line + " 200:1")
    assert f"{train}:30: feature id 200 exceeds n_features=136" in _one_line_error(root, capsys)


# ------------------------------------------------------------------ the switch onto a collection


def test_one_option_takes_folds_and_normalisation_from_the_layout(collections):
    fold_file = REPRODUCE / "fpdgd_dp.toml"  # a file on MQ2008's folds
    sc = load_scenario(fold_file, [f"dataset.path={collections['mslr']}"])
    assert sc.folds == (1, 2, 3, 4, 5) and sc.repeats == 5
    cfg = sc.variants["FPDGD"].dataset
    assert cfg.path == str(collections["mslr"]) and cfg.normalise is True
    sc = load_scenario(REPRODUCE / "noniid_type2.toml", [f"dataset.path={collections['yahoo']}"])
    assert sc.folds == () and sc.repeats == 5  # seeds of the one fixed split
    assert sc.variants["IID"].dataset.path == str(collections["yahoo"])
    sc = load_scenario(fold_file, [f"dataset.path={collections['istella']}"])
    assert sc.folds == () and sc.variants["FPDGD"].dataset.path.endswith("sample")
    sc = load_scenario(
        fold_file,
        [f"dataset.path={collections['letor4']}", "dataset.folds=[2]", "dataset.normalise=true"],
    )
    assert sc.folds == (2,) and sc.variants["FPDGD"].dataset.normalise is True
    train = collections["mslr"] / "Fold3" / "train.txt"  # a file: read as given, no folds
    sc = load_scenario(fold_file, [f"dataset.path={train}"])
    assert sc.folds == () and sc.variants["FPDGD"].dataset.path == str(train)


def test_letor_files_of_no_published_collection_run_but_fail_the_check(tmp_path, capsys):
    """A written synthetic profile (700 features: yahoo-like) is no collection's layout: the
    check says so, a run reads it as plain LETOR files."""
    out = tmp_path / "yahoo-like"
    assert (
        main(["dataset", "make", "--profile", "yahoo-like", "--queries", "30", "--out", str(out)])
        == 0
    )
    capsys.readouterr()
    err = _one_line_error(out, capsys)
    assert f"{out / 'train.txt'}:1: feature ids up to 700; expected 220 (Istella-S)" in err
    sc = load_scenario(REPRODUCE / "fpdgd_dp.toml", [f"dataset.path={out}"])
    assert sc.folds == () and sc.variants["FPDGD"].dataset.path == str(out)
    assert sc.variants["FPDGD"].dataset.normalise is False


def test_large_files_report_their_progress_on_stderr(collections, capsys, monkeypatch):
    import foltr_async.cli

    monkeypatch.setattr(foltr_async.cli, "PROGRESS_BYTES", 1)
    code, out, err = check(collections["yahoo"], capsys)
    assert code == 0 and "Yahoo! LTR set 1" in out
    train = collections["yahoo"] / "set1.train.txt"
    size = train.stat().st_size / 2**20
    assert f"reading {train}: {size:,.0f} of {size:,.0f} MB" in err


def test_a_path_that_is_no_collection_fails_the_scenario_in_one_line(tmp_path, capsys):
    code = main(
        [
            "validate",
            "--build",
            str(REPRODUCE / "fpdgd_dp.toml"),
            "--set",
            f"dataset.path={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"--set dataset.path: {tmp_path}: no collection layout here" in err


TINY = [
    "federation.clients=2",
    "federation.rounds=2",
    "federation.queries_per_client=1",
    "evaluation.every=1",
]


def run_tiny(path: Path, out: Path, *extra: str) -> tuple[dict, list[dict]]:
    """fpdgd_vs_foltres.toml's FPDGD arm, tiny, on ``path``; its results and dataset events."""
    sets = [a for s in (f"dataset.path={path}", *TINY) for a in ("--set", s)]
    argv = [str(REPRODUCE / "fpdgd_vs_foltres.toml"), "--only", "FPDGD", "--quiet", "--out"]
    assert main([*argv, str(out), *sets, *extra]) == 0
    results = json.loads((out / "results.json").read_text())
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return results, [e for e in events if e.get("event") == "dataset"]


def test_a_reproduce_file_runs_on_an_mslr_layout_with_5_grade_users(collections, tmp_path):
    results, seen = run_tiny(collections["mslr"], tmp_path / "out")
    repeats = results["variants"]["FPDGD"]["repeats"]
    assert [r["fold"] for r in repeats] == [1, 2, 3, 4, 5]
    assert [e["source"] for e in seen] == [
        str(collections["mslr"] / f"Fold{f}") for f in range(1, 6)
    ]
    assert {(e["features"], e["click_grades"]) for e in seen} == {(136, 5)}


def test_a_reproduce_file_runs_on_a_yahoo_layout_with_5_grade_users(collections, tmp_path):
    results, seen = run_tiny(collections["yahoo"], tmp_path / "out")
    (repeat,) = results["variants"]["FPDGD"]["repeats"]
    assert "fold" not in repeat and len(repeat["offline"]["ndcg@10"]) == 2
    ((event),) = seen
    assert event["source"] == str(collections["yahoo"]) and event["click_grades"] == 5
    assert event["train_queries"] == QUERIES["train"] and event["features"] == 699


def test_what_a_collection_lacks_is_one_line(collections, capsys):
    path = collections["mslr"]
    code = main(
        ["validate", "--build", str(REPRODUCE / "csfltr.toml"), "--set", f"dataset.path={path}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "dataset.path: expected no path: protocol 'csfltr' learns from a text corpus" in err
    code = main(
        [
            "validate",
            "--build",
            str(REPRODUCE / "noniid_type1.toml"),
            "--set",
            f"dataset.path={path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "federation.partition.intents: the dataset has no intents" in err


# ------------------------------------------------------------------ the real MQ2008


@pytest.fixture(scope="module")
def mq2008() -> Path:
    return shared_data(SHARED / "data" / "MQ2008" / "Fold1").parent


def test_the_real_mq2008_is_recognised_and_counted(mq2008, capsys):
    code, out, err = check(mq2008, capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{mq2008}: LETOR 4.0 MQ2008, 5 folds (Fold1..Fold5)"
    # the counts its README gives for Fold1: train 9,630 lines / 471 queries, vali 2,707 / 157,
    # test 2,874 / 156
    assert lines[2].split()[:4] == ["Fold1", "train", "471", "9,630"]
    assert lines[3].split()[:3] == ["vali", "157", "2,707"]
    assert lines[4].split()[:3] == ["test", "156", "2,874"]
    assert "max id 46 of the collection's 46" in out and "values 0 .. 1" in out
    assert "the 3-grade cascade tables (thesis Table 2.1)" in out
    # its five parts are parsed (8.9 MB of the folds' 44.6 MB), the rest matched byte for byte
    assert "checked 44.6 MB in" in out and "(8.9 MB parsed;" in out


def test_a_reproduce_file_runs_on_the_real_mq2008_with_3_grade_users(mq2008, tmp_path):
    layout = recognise(mq2008)
    assert layout.folds == (1, 2, 3, 4, 5) and layout.collection.normalise is False
    results, seen = run_tiny(mq2008, tmp_path / "out", "--set", "dataset.folds=[1]")
    assert [r["fold"] for r in results["variants"]["FPDGD"]["repeats"]] == [1]
    assert [(e["features"], e["click_grades"]) for e in seen] == [(46, 3)]


def test_recognise_refuses_a_file(tmp_path):
    (tmp_path / "train.txt").write_text("0 qid:1 1:0.5\n")
    with pytest.raises(DatasetError, match="is a file; expected a collection folder"):
        recognise(tmp_path / "train.txt")
