"""Smoke test of ``bench --quick --json`` on tiny sizes: the keys and their meaning, not speed."""

import json
import math

import pytest
import structlog

from foltr_async.benchmarks.cli import SUITES, main
from foltr_async.benchmarks.measure import FULL
from foltr_async.benchmarks.report import TARGETS


@pytest.fixture(autouse=True)
def _default_logging():
    yield
    structlog.reset_defaults()  # the bench quiets the simulator's logs process-wide


KEYS = {
    "fpdgd": ("queries_per_s", "s_per_round", "paper_run_s"),
    "pdgd_kernel": ("us_per_client", "us_per_query_in_round", "us_per_query_alone"),
    "pdgd": ("interactions_per_s",),
    "eval": ("queries_per_s",),
    "foltr_es": ("s_per_round",),
    "bus": ("us_per_update", "floor_cpu_us_per_update", "msgs_per_s", "bytes_per_s"),
    "startup": ("s",),
    "memory": ("mb_per_1000_clients",),
    "zmq": ("msgs_per_s",),
    "parse": ("lines_per_s", "cached_s"),
    "secagg": ("max_rel_error", "complete_s_per_round", "complete_kb_per_client"),
    "csfltr": ("speedup", "rtk_ms_per_term", "naive_ms_per_term"),
}


def run_json(capsys, *args):
    rc = main(["--quick", "--json", "--scale", "0.01", *args])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip() else None, out.err


@pytest.mark.slow
def test_quick_json_has_every_suite_key(capsys):
    rc, res, err = run_json(capsys)
    assert rc == 0, err
    for suite, keys in KEYS.items():
        for key in keys:
            v = res[suite][key]
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (suite, key, v)
        assert res[suite]["on"], suite  # every suite says what it measured on
    assert "rss_62500_mb" not in res["memory"]  # --quick skips the 62,500-client run
    # sizes are the tiny ones asked for, and the counts agree with each other
    assert res["fpdgd"]["on"]["clients"] == 2 and res["fpdgd"]["on"]["features"] == 136
    assert res["bus"]["bytes_per_msg"] > 136 * 8  # an envelope carries the whole model
    assert res["zmq"]["bytes_per_msg"] > 136 * 8
    assert res["zmq"]["on"]["messages"] == 200  # 20,000 x 0.01
    assert res["meta"]["quick"] is True and res["meta"]["cores"] >= 1
    # every target whose metric was measured is checked, with the right verdict
    checked = {c["metric"]: c for c in res["checks"]}
    for t in TARGETS:
        metric = f"{t.suite}.{t.key}"
        if t.key in res.get(t.suite, {}):
            assert checked[metric]["ok"] == t.ok(res[t.suite][t.key])
    assert "memory.rss_62500_mb" not in checked
    assert any(line.startswith("bench: fpdgd: ") for line in err.splitlines())  # progress


def test_data_file_drives_fpdgd_and_parse(capsys, mq2008_dir):
    rc, res, _ = run_json(
        capsys, "--data", str(mq2008_dir / "train.txt"), "--suite", "fpdgd", "--suite", "parse"
    )
    assert rc == 0
    assert set(res) == {"meta", "fpdgd", "pdgd_kernel", "pdgd", "eval", "parse", "checks"}
    assert res["fpdgd"]["on"]["features"] == 46 and res["fpdgd"]["on"]["train_queries"] == 69
    assert res["eval"]["on"]["test_queries"] == 36
    assert res["parse"]["on"]["lines"] == res["fpdgd"]["on"]["train_docs"]
    assert "mslr_parse_s" not in res["parse"]  # too small a file to extrapolate from


@pytest.mark.parametrize("bad", ["missing-dir", "train.txt"])
def test_bad_data_is_one_line_exit_2(capsys, tmp_path, bad):
    path = tmp_path / bad
    if bad.endswith(".txt"):
        path.write_text("0 qid:1 1:0.5\n")  # exists, but no test.txt beside it
    rc, res, err = run_json(capsys, "--data", str(path))
    assert rc == 2 and res is None
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --data ") and str(path) in lines[0]


def test_suite_names_are_checked(capsys):
    assert main(["--suite", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert set(SUITES) == {
        "fpdgd", "foltr_es", "bus", "startup", "memory", "zmq", "parse", "secagg", "csfltr"
    }  # fmt: skip


def test_reference_figures_are_printed_with_the_ratio(capsys, tmp_path):
    ref = tmp_path / "authors.json"
    ref.write_text(json.dumps({"name": "authors", "foltr_es": {"s_per_round": 100.0, "on": "x"}}))
    rc, res, _ = run_json(capsys, "--suite", "foltr_es", "--reference", str(ref))
    assert rc == 0 and res["reference"]["name"] == "authors"
    (row,) = res["reference"]["rows"]
    assert row["metric"] == "foltr_es.s_per_round" and row["reference"] == 100.0
    assert row["times_better"] == pytest.approx(100.0 / res["foltr_es"]["s_per_round"])
    ref.write_text(json.dumps({"fpdgd": {"queries_per_s": -1}}))
    rc, res, err = run_json(capsys, "--suite", "foltr_es", "--reference", str(ref))
    assert rc == 2 and res is None and "fpdgd.queries_per_s" in err


def test_clients_and_interactions_size_the_paper_scale_runs():
    sizes = FULL.at_scale(62_500, 1_000_000)
    assert (sizes.fpdgd_clients, sizes.es_clients, sizes.bus_clients) == (62_500,) * 3
    assert sizes.fpdgd_window == 8  # 62,500 clients x 2 queries x 8 rounds = 10^6
    assert FULL.at_scale(None, None) == FULL


def test_the_table_keeps_one_line_per_row_when_piped(capsys, monkeypatch):
    from foltr_async.benchmarks.report import render

    monkeypatch.setenv("COLUMNS", "80")  # what a pipe or a batch log gets by default
    meta = {
        "commit": "abcdef123456",
        "dirty": False,
        "quick": True,
        "cores": 2,
        "python": "3.11",
        "numpy": "2.1",
        "load_average": "1.0",
    }
    results = {
        "meta": meta,
        "checks": [{"metric": "pdgd_kernel.us_per_client", "target": "< 100", "ok": True}],
        "fpdgd": {"paper_run_s": 24.6, "cpu_share": 0.93},
        "pdgd_kernel": {"us_per_client": 45.6, "cpu_share": 0.97},
    }
    render(results)
    out = capsys.readouterr().out.splitlines()
    for label, value in (
        ("200-round paper run (extrapolated)", "24.6 s"),
        ("FPDGD local training per client (2 queries)", "45.6 us"),
    ):
        row = next(line for line in out if label.split()[0] in line)
        assert label in row and value in row, row
