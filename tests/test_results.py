import csv
import json

import numpy as np
import pytest
from scipy import stats as sps

from foltr_async.observe import plots, results
from foltr_async.observe.observer import Observer, Observers
from foltr_async.observe.results import ResultsWriter

ROUNDS = [5, 10, 15, 20]
SEEDS = [11, 12, 13]


def make_repeat(seed: int, shift: float, rng: np.random.Generator) -> dict:
    """A repeat object as the runner builds it (numpy values and protocol extras included)."""
    curve = np.linspace(0.2, 0.4, len(ROUNDS)) + shift + rng.normal(0, 0.01, len(ROUNDS))
    return {
        "seed": seed,
        "rounds": list(ROUNDS),
        "offline": {"ndcg@10": curve, "err@10": curve / 2},
        "online": {"ndcg@10_discounted": np.float64(100 + 10 * shift + rng.normal())},
        "messages": {"sent": 400, "delivered": 390, "bytes": 51200, "dropped": {"loss": 7}},
        "wall_s": 0.5,
        "sim_s": 120.0,
        "privacy": {"epsilon": np.float32(1.2), "per_round": np.ones(2)},
    }


def info(variants=("base", "better")) -> dict:
    return {
        "scenario": "unit",
        "out_dir": "ignored",
        "seed": 7,
        "variants": list(variants),
        "repeats": len(SEEDS),
        "rounds": {v: ROUNDS[-1] for v in variants},
        "reference": "base",
        "metric": "ndcg@10",
    }


def run(writer: Observer, n_repeats: int = len(SEEDS), variants=("base", "better")) -> list:
    rng = np.random.default_rng(0)
    writer.run_started(info(variants))
    done = []
    for r, seed in enumerate(SEEDS[:n_repeats]):
        for v in variants:
            rep = make_repeat(seed, 0.05 if v == "better" else 0.0, rng)
            writer.repeat_started(v, r, seed)
            writer.repeat_done(v, r, rep)
            done.append((v, rep))
    return done


@pytest.fixture
def writer(tmp_path):
    return ResultsWriter(
        tmp_path / "out",
        scenario="unit",
        seed=7,
        config={"evaluation": {"no_relevant": "skip"}, "rounds": 20},
        reference="base",
        conclusions=lambda res: [f"{len(res['comparisons'])} variant compared to base"],
    )


def test_complete_run_writes_every_file(writer):
    done = run(writer)
    writer.run_done(writer.results)
    out = writer.out_dir
    for name in ("results.json", "curves.csv", "summary.md", "curves.png"):
        assert (out / name).stat().st_size > 0
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = json.loads((out / "results.json").read_text())
    assert res["complete"] is True
    assert res["scenario"] == "unit" and res["seed"] == 7 and res["reference"] == "base"
    assert res["config"]["rounds"] == 20
    better = res["variants"]["better"]
    assert [r["seed"] for r in better["repeats"]] == SEEDS
    # unknown keys of a repeat object are kept (numpy values made plain)
    assert better["repeats"][0]["privacy"]["epsilon"] == pytest.approx(1.2)
    finals = [float(rep["offline"]["ndcg@10"][-1]) for v, rep in done if v == "better"]
    summ = better["summary"]
    assert summ["final"]["ndcg@10"]["mean"] == pytest.approx(np.mean(finals))
    assert summ["final"]["ndcg@10"]["std"] == pytest.approx(np.std(finals, ddof=1))
    assert summ["final"]["ndcg@10"]["n"] == 3
    assert "err@10" in summ["final"]
    assert summ["online"]["ndcg@10_discounted"]["n"] == 3
    assert summ["curve"]["rounds"] == ROUNDS and len(summ["curve"]["mean"]) == len(ROUNDS)
    assert summ["messages"]["dropped"]["mean"] == 7

    (comp,) = res["comparisons"]
    base_finals = [float(rep["offline"]["ndcg@10"][-1]) for v, rep in done if v == "base"]
    assert comp["variant"] == "better" and comp["reference"] == "base" and comp["n"] == 3
    assert comp["diff_mean"] == pytest.approx(np.mean(np.subtract(finals, base_finals)))
    assert comp["p_value"] == pytest.approx(sps.ttest_rel(finals, base_finals).pvalue)
    assert "paired t-test (two-sided" in comp["test"]
    assert res["conclusions"] == ["1 variant compared to base"]

    md = (out / "summary.md").read_text()
    assert "| better |" in md and "reference" in md and "p=" in md
    assert "left out of the mean" in md  # the nDCG convention from config
    assert "- 1 variant compared to base" in md


def test_csv_has_one_row_per_round_metric_and_repeat(writer):
    run(writer)
    with open(writer.csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["variant", "repeat", "seed", "round", "metric", "value"]
    assert len(rows) == 2 * len(SEEDS) * len(ROUNDS) * 2  # variants x repeats x rounds x metrics
    first = [r for r in rows if r["variant"] == "base" and r["repeat"] == "0"]
    assert {r["seed"] for r in first} == {"11"}
    assert [int(r["round"]) for r in first if r["metric"] == "ndcg@10"] == ROUNDS


def test_partial_run_keeps_valid_results(writer, monkeypatch):
    monkeypatch.setattr(results, "FIRST_PLOT_S", 0.0)  # a run long enough for partial figures
    run(writer, n_repeats=1)  # interrupted after one seed: no run_done
    res = json.loads(writer.json_path.read_text())
    assert res["complete"] is False
    assert [len(v["repeats"]) for v in res["variants"].values()] == [1, 1]
    (comp,) = res["comparisons"]
    assert comp["n"] == 1 and comp["p_value"] is None and comp["diff_mean"] is not None
    assert "partial" in writer.md_path.read_text()
    assert writer.png_path.exists()


def test_a_short_run_draws_its_figures_once_at_its_end(writer, monkeypatch):
    """Drawing (matplotlib's import, PDF and PNG) would dominate a run of seconds: its numbers
    are written after every repeat, its figures only when it ends."""
    drawn = []
    monkeypatch.setattr(results, "plot_curves", lambda res, path, **kw: drawn.append(path))
    run(writer, n_repeats=3)
    assert drawn == [] and writer.json_path.exists()
    writer.run_done({})
    assert drawn == [writer.png_path]


def test_results_exist_before_any_repeat_and_variant_without_reference_data(tmp_path):
    w = ResultsWriter(tmp_path, scenario="s", seed=1, config={}, reference="base")
    w.run_started(info())
    res = json.loads(w.json_path.read_text())
    assert res["complete"] is False and set(res["variants"]) == {"base", "better"}
    w.repeat_done("better", 0, make_repeat(11, 0.0, np.random.default_rng(1)))
    (comp,) = json.loads(w.json_path.read_text())["comparisons"]
    assert comp["n"] == 0 and comp["diff_mean"] is None and comp["p_value"] is None


def test_interrupted_run_done_stays_incomplete(writer):
    run(writer, n_repeats=2)
    writer.run_done({"interrupted": True, "stopped_by": "SIGINT"})
    res = json.loads(writer.json_path.read_text())
    assert res["complete"] is False and res["stopped_by"] == "SIGINT"


def test_plot_failure_does_not_lose_results(writer, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(results, "plot_curves", broken)
    run(writer)
    res = json.loads(writer.json_path.read_text())
    assert len(res["variants"]["base"]["repeats"]) == 3
    assert writer.csv_path.exists() and writer.md_path.exists()
    assert not writer.png_path.exists()


def test_failing_conclusions_keep_previous_sentences(tmp_path):
    calls = []

    def conclude(res):
        calls.append(len(res["variants"]["base"]["repeats"]))
        if len(calls) > 2:
            raise KeyError("boom")
        return [f"seen {calls[-1]}"]

    w = ResultsWriter(
        tmp_path, scenario="s", seed=1, config={}, reference="base", conclusions=conclude
    )
    run(w, variants=("base",))
    assert json.loads(w.json_path.read_text())["conclusions"] == ["seen 1"]
    assert calls == [0, 1, 2, 3]


def test_plot_curves_marks_partial(tmp_path):
    res = {"scenario": "x", "metric": "ndcg@10", "complete": False, "variants": {}}
    path = plots.plot_curves(res, tmp_path / "c.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert plots.metric_label("ndcg@10") == "nDCG@10"


def test_a_legend_beside_the_axes_is_not_cut_off(tmp_path):
    """Many variants put the legend right of the axes: long names widen the figure."""
    import struct

    def width(names):
        curve = {"rounds": [1, 2], "mean": [0.1, 0.2], "std": [0.0, 0.0]}
        res = {"metric": "ndcg@10", "variants": {n: {"summary": {"curve": curve}} for n in names}}
        png = plots.plot_curves(res, tmp_path / "c.png").read_bytes()
        return struct.unpack(">I", png[16:20])[0]  # IHDR width in pixels

    short = width([f"v{i}" for i in range(6)])
    long = width([f"9H-1M-unlearned-store{i}-n4-with-a-long-name" for i in range(6)])
    assert long > short + 100


class Recorder(Observer):
    def __init__(self):
        self.calls = []

    def round_done(self, variant, repeat, round, *, metrics, messages, sim_time):
        self.calls.append((variant, repeat, round, metrics, sim_time))

    def event(self, event, **fields):
        self.calls.append((event, fields))


class Broken(Observer):
    entered = False

    def __enter__(self):
        self.entered = True
        return self

    def round_done(self, *a, **k):
        raise RuntimeError("broken observer")


def test_observers_fan_out_survives_a_failing_observer():
    rec, broken = Recorder(), Broken()
    obs = Observers([broken, rec])
    with obs:
        assert broken.entered
        for r in range(3):
            obs.round_done("v", 0, r, metrics=None, messages={}, sim_time=1.0 * r)
        obs.event("join", agent="client-1")
    assert [c[2] for c in rec.calls[:3]] == [0, 1, 2]
    assert rec.calls[3] == ("join", {"agent": "client-1"})
    # every base method exists and is a no-op
    base = Observer()
    base.run_started({})
    base.agent_changed("a", "client", "active", 0, None)
    base.run_done({})


def test_summary_states_the_ndcg_convention_of_per_variant_configs(tmp_path):
    cfg = {
        "a": {"evaluation": {"no_relevant": "zero"}},
        "b": {"evaluation": {"no_relevant": "zero"}},
    }
    w = ResultsWriter(tmp_path, scenario="s", seed=1, config=cfg, reference="a")
    w.run_started(info(("a", "b")))
    md = w.md_path.read_text()
    assert md.count("nDCG convention:") == 1 and "count as nDCG 0" in md
    cfg["b"]["evaluation"]["no_relevant"] = "skip"
    w.write(plot=False)
    md = w.md_path.read_text()
    assert "a: queries without a relevant document count as nDCG 0" in md
    assert "b: queries without a relevant document are left out" in md


def test_a_library_run_logs_to_its_events_file_not_stdout(tmp_path, mq2008_dir, capsys):
    import structlog

    from foltr_async.experiment import run_scenario
    from foltr_async.scenario.load import load_scenario

    structlog.reset_defaults()  # what a program importing foltr_async starts with
    path = tmp_path / "lib.toml"
    path.write_text(
        f'[scenario]\nname = "lib"\nseed = 1\n[dataset]\npath = "{mq2008_dir.as_posix()}"\n'
        '[federation]\nprotocol = "fpdgd"\nclients = 3\nqueries_per_client = 2\nrounds = 3\n'
    )
    out = tmp_path / "out"
    run_scenario(load_scenario(path), out, Observer())
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "aggregation" and e["level"] == "debug" for e in events)
    assert not structlog.is_configured()  # the caller's logging is left as it was


def test_summary_names_the_dataset_of_each_variant(tmp_path):
    cfg = {
        "a": {
            "scenario": {"seed": 4},
            "dataset": {"path": None, "profile": "mslr-like", "seed": None, "n_queries": 200},
        },
        "b": {"scenario": {"seed": 4}, "dataset": {"path": "MQ2008/Fold1", "normalise": True}},
    }
    w = ResultsWriter(tmp_path, scenario="s", seed=4, config=cfg, reference="a")
    w.run_started(info(("a", "b")))
    md = w.md_path.read_text()
    assert "Dataset: a: synthetic mslr-like (seed 4, 200 queries)." in md
    assert "Dataset: b: MQ2008/Fold1 (query-normalised)." in md
    cfg["b"] = cfg["a"]
    w.write(plot=False)
    assert w.md_path.read_text().count("Dataset: synthetic mslr-like (seed 4, 200 queries).") == 1


def test_rounds_after_training_are_shaded_and_named_in_the_figure(tmp_path):
    from matplotlib.figure import Figure

    rep = {"rounds": [10, 20, 21, 22], "offline": {"ndcg@10": [0.3, 0.4, 0.35, 0.38]}}
    res = {
        "planned": {"rounds": {"9H-1M-unlearned": 20, "10H-0M": 20}},
        "variants": {
            "9H-1M-unlearned": {
                "repeats": [{**rep, "unlearning": {"strategy": "federaser", "rounds": 2}}],
                "summary": {"curve": {"rounds": rep["rounds"]}},
            },
            "10H-0M": {"repeats": [], "summary": {"curve": {"rounds": [10, 20]}}},
        },
    }
    ax = Figure().add_subplot(1, 1, 1)
    ax.plot([10, 22], [0.3, 0.4])
    plots._mark_after_training(ax, res, ["9H-1M-unlearned", "10H-0M"])
    assert [t.get_text() for t in ax.texts] == ["unlearning: federaser → "]
    assert ax.lines[-1].get_xdata()[0] == 20  # the dotted line where training ended
    res["variants"]["9H-1M-unlearned"]["summary"]["curve"]["rounds"] = [10, 20]
    ax = Figure().add_subplot(1, 1, 1)
    plots._mark_after_training(ax, res, ["9H-1M-unlearned", "10H-0M"])
    assert not ax.texts  # nothing after training: no mark
    # several variants forgetting by several strategies after the same round: one mark for all
    for i, method in enumerate(("retrain", "pga", "fedremove")):
        res["variants"][f"u{i}"] = {
            "repeats": [{**rep, "unlearning": {"strategy": method, "rounds": 2}}],
            "summary": {"curve": {"rounds": rep["rounds"]}},
        }
        res["planned"]["rounds"][f"u{i}"] = 20
    ax = Figure().add_subplot(1, 1, 1)
    plots._mark_after_training(ax, res, ["u0", "u1", "u2"])
    assert [t.get_text() for t in ax.texts] == ["unlearning (3 strategies) → "]


def test_conclusions_leave_variants_that_learned_nothing_out_of_the_ranking():
    from foltr_async.experiment import conclusions

    def variant(final):
        return {"repeats": [{}], "summary": {"final": {"ndcg@10": {"mean": final, "n": 1}}}}

    res = {"variants": {"idle": variant(0.5), "busy": variant(0.3)}, "nothing_learned": {}}
    assert conclusions(res) == ["Highest final ndcg@10: idle (0.5000)."]
    res["nothing_learned"] = {"idle": 1}
    lines = conclusions(res)
    assert lines[0].startswith("Nothing was learned in idle: in 1 of 1 repeats")
    assert lines[1] == "Highest final ndcg@10: busy (0.3000)."
    res["nothing_learned"] = {"idle": 1, "busy": 1}
    assert not any(line.startswith("Highest") for line in conclusions(res))


@pytest.mark.parametrize("metric", ["maxrr@10", "relevance_reset_loss"])
def test_own_curves_get_a_summary_curve_and_a_figure_beside_the_main_metric(writer, metric):
    """FOLtR-ES's MaxRR and the relevance reset's loss on the forgotten queries."""
    rng = np.random.default_rng(1)
    writer.run_started(info())
    reps = []
    for r, seed in enumerate(SEEDS):
        rep = make_repeat(seed, 0.0, rng)
        rep["offline"][metric] = rep["offline"]["ndcg@10"] / 3
        reps.append(rep)
        writer.repeat_done("base", r, rep)
    writer.run_done({})
    summary = writer.results["variants"]["base"]["summary"]
    assert set(summary["curves"]) == {metric}  # err@10 has no curve of its own
    want = np.mean([rep["offline"][metric] for rep in reps], axis=0)
    np.testing.assert_allclose(summary["curves"][metric]["mean"], want)
    assert summary["curves"][metric]["rounds"] == ROUNDS
    assert (writer.out_dir / f"curves-{metric}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_throttled_writer_rewrites_after_a_repeat_only_when_due_and_always_at_the_end(
    tmp_path, monkeypatch
):
    """The run's writer (``throttled``): the first repeat is written at once; later ones when
    ten times the last rewrite's cost has passed (a clock ticking 1 s per reading: a rewrite
    reads it a few times, so the next is due some tens of readings later); ``run_done``
    writes every repeat."""
    import foltr_async.observe.results as results

    ticks = iter(range(10**6))
    monkeypatch.setattr(results.time, "monotonic", lambda: float(next(ticks)))
    w = ResultsWriter(tmp_path, scenario="s", seed=1, config={}, reference="base", throttled=True)
    w.run_started(info())
    rng = np.random.default_rng(1)

    def written() -> int:
        res = json.loads(w.json_path.read_text())
        return sum(len(v["repeats"]) for v in res["variants"].values())

    w.repeat_done("base", 0, make_repeat(11, 0.0, rng))
    assert written() == 1
    for r in range(1, 4):
        w.repeat_done("base", r, make_repeat(11 + r, 0.0, rng))
    assert written() == 1  # not due yet: the repeats are kept, the files wait
    for r in range(4, 80):
        w.repeat_done("base", r, make_repeat(11 + r, 0.0, rng))
    assert 1 < written() < 80
    w.run_done({})
    assert written() == 80 and json.loads(w.json_path.read_text())["complete"] is True


def test_events_level_info_leaves_the_per_round_lines_out_and_the_results_alone(
    tmp_path, mq2008_dir
):
    from foltr_async.cli import main

    path = tmp_path / "ev.toml"
    path.write_text(
        f'[scenario]\nname = "ev"\nseed = 1\n[dataset]\npath = "{mq2008_dir.as_posix()}"\n'
        '[federation]\nprotocol = "fpdgd"\nclients = 3\nqueries_per_client = 2\nrounds = 4\n'
    )
    runs = {}
    for level in ("debug", "info"):
        out = tmp_path / level
        assert main(["run", str(path), "--quiet", "--out", str(out), "--events-level", level]) == 0
        lines = (out / "events.jsonl").read_text().splitlines()
        runs[level] = (
            [json.loads(line) for line in lines],
            json.loads(out.joinpath("results.json").read_text())["variants"],
        )
    debug, info = runs["debug"][0], runs["info"][0]
    assert sum(e["event"] == "aggregation" for e in debug) == 4
    assert not any(e["level"] == "debug" for e in info)
    assert [e["event"] for e in info] == [e["event"] for e in debug if e["level"] != "debug"]
    for name, variant in runs["debug"][1].items():
        (a,) = variant["repeats"]
        (b,) = runs["info"][1][name]["repeats"]
        assert a["offline"] == b["offline"]
