"""Each reported number has one definition, and a number a run did not measure is not 0."""

import json

import pytest

from foltr_async.contract import Probe
from foltr_async.observe.results import ResultsWriter


def _repeat(seed: int, online: float | None, final: float) -> dict:
    return {
        "seed": seed,
        "rounds": [1, 2],
        "offline": {"ndcg@10": [final / 2, final]},
        "online": {"ndcg@10_discounted": online, "interactions": 0 if online is None else 9},
    }


def test_a_run_that_showed_no_user_a_ranking_has_no_online_metric():
    probe = Probe()
    online, at = probe.online([1, 2])
    assert online == {"ndcg@10_discounted": None, "interactions": 0} and at == [None, None]
    probe.displayed(0.5, "client-0000", 1)
    online, at = probe.online([1, 2])
    assert online == {"ndcg@10_discounted": 0.5, "interactions": 1} and at == [0.5, 0.5]


def test_summary_and_results_say_n_a_for_variants_without_online_users(tmp_path):
    writer = ResultsWriter(tmp_path, scenario="cross-silo", seed=1, config={}, reference="local")
    writer.run_started({"variants": ["local", "csfltr"], "repeats": 2})
    for r in range(2):
        writer.repeat_done("local", r, _repeat(1 + r, None, 0.5))
        writer.repeat_done("csfltr", r, _repeat(1 + r, None, 0.6))
    writer.run_done({})
    res = json.loads((tmp_path / "results.json").read_text())
    online = res["variants"]["csfltr"]["summary"]["online"]["ndcg@10_discounted"]
    assert online == {"mean": None, "std": None, "n": 0}
    assert res["variants"]["csfltr"]["repeats"][0]["online"]["ndcg@10_discounted"] is None
    row = next(
        ln for ln in (tmp_path / "summary.md").read_text().splitlines() if "| csfltr |" in ln
    )
    assert row.split(" | ")[3] == "n/a"


def test_trackers_log_the_tables_final_value():
    """A repeat that measured nothing has no final nDCG in the table, nor in MLflow or
    TensorBoard (its 0 is no result); MaxRR, which follows clicks, still has one."""
    from foltr_async.observe.tracking import series

    rep = {"rounds": [1], "offline": {"ndcg@10": [0.0], "maxrr@10": [0.3]}, "judged_queries": 0}
    finals = {k: v for k, v, _ in series(rep, per_round=False) if k.startswith("final/")}
    assert finals == {"final/maxrr@10": 0.3}


def _timed(interactions: dict[str, list[list[int]]]) -> dict:
    return {
        name: [
            {
                "seed": seed,
                "rounds": list(range(1, len(xs) + 1)),
                "interactions": xs,
                "offline": {"ndcg@10": [0.1 * (i + 1) for i in range(len(xs))]},
            }
            for seed, xs in enumerate(per_repeat, start=1)
        ]
        for name, per_repeat in interactions.items()
    }


def _equal_sentences(variants: dict, same: dict) -> list[str]:
    from foltr_async.experiment import conclusions
    from foltr_async.observe.results import summarise_variant

    summaries = {
        n: {"repeats": r, "summary": summarise_variant(r, "ndcg@10")} for n, r in variants.items()
    }
    lines = conclusions({"variants": summaries, "equal_interactions": same})
    return [s for s in lines if "at equal" in s]


def test_equal_interactions_compare_only_where_every_repeat_was_measured():
    from foltr_async.observe.timecurve import at_common

    # a short run: sync ends at 648 and 616 interactions; one async repeat's first evaluation
    # is at 564, the other's at 856: at 616 the async variant is measured in one repeat of two
    short = _timed({"sync": [[64, 324, 648], [68, 316, 616]], "async": [[856, 1680], [564, 960]]})
    same = at_common(short, "ndcg@10", "interactions")
    assert same["at"] is None and same["variants"] == {}
    assert same["measured"] == {"sync": [68, 616], "async": [856, 960]}
    assert _equal_sentences(short, same) == [
        "ndcg@10 at equal user interactions: no point at which every repeat of every variant was "
        "measured, so no comparison (measured in: sync 68-616, async 856-960)."
    ]
    # longer: every repeat of both measured by 1,200 interactions, the last all reached
    long = _timed(
        {"sync": [[400, 800, 1300], [300, 700, 1200]], "async": [[856, 1680], [564, 960]]}
    )
    same = at_common(long, "ndcg@10", "interactions")
    assert same["at"] == 960
    assert {name: s["n"] for name, s in same["variants"].items()} == {"sync": 2, "async": 2}
    (line,) = _equal_sentences(long, same)
    assert line == "ndcg@10 at equal 960 user interactions: sync 0.2000, async 0.1500."


def test_a_papers_own_metric_is_in_the_table_the_tests_the_conclusions_and_a_figure(tmp_path):
    """FedIPS's paper reports nDCG@5: a run that measures it states it beside nDCG@10."""
    from foltr_async.experiment import conclusions

    writer = ResultsWriter(
        tmp_path,
        scenario="fedips",
        seed=1,
        config={},
        reference="FedIPS",
        conclusions=conclusions,
    )
    writer.run_started({"variants": ["FedIPS", "FedAvg"], "repeats": 3})
    for r in range(3):
        for name, level in (("FedIPS", 0.6), ("FedAvg", 0.5)):
            rep = _repeat(1 + r, 10.0, level + 0.01 * r * (name == "FedAvg"))
            rep["offline"]["ndcg@5"] = [v - 0.1 for v in rep["offline"]["ndcg@10"]]
            writer.repeat_done(name, r, rep)
    writer.run_done({})
    res = json.loads((tmp_path / "results.json").read_text())
    (comp,) = res["comparisons_by_metric"]["ndcg@5"]
    assert comp["variant"] == "FedAvg" and comp["diff_mean"] == pytest.approx(-0.09)
    assert "Highest final ndcg@5 (the paper's metric): FedIPS (0.5000)." in res["conclusions"]
    assert any(s.startswith("FedAvg vs FedIPS: -0.0900 ndcg@5") for s in res["conclusions"])
    md = (tmp_path / "summary.md").read_text()
    assert "| final nDCG@10 | Δ vs reference (p) | final nDCG@5 |" in md
    assert "| FedAvg | 0.5100 ± 0.0100 (3) |" in md and "| 0.4100 ± 0.0100 (3) |" in md
    assert (tmp_path / "curves-ndcg@5.png").exists()
