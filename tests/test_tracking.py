"""Experiment tracking export (MLflow, TensorBoard): optional, so skipped without the extra."""

import sys
import time

import pytest

from foltr_async.cli import main
from foltr_async.errors import FoltrError
from foltr_async.observe.tracking import flatten, make_trackers, metric_name

SCENARIO = """
[scenario]
name = "tracked"
seed = 3
[dataset]
profile = "mq2007-like"
n_queries = 80
[federation]
protocol = "fpdgd"
clients = 3
rounds = 4
data = "shared"
[evaluation]
every = 2
max_test_queries = 20
[variants.plain]
[variants.dp]
federation.params = { dp = true }
"""


def test_names_and_params_are_what_the_trackers_accept():
    assert metric_name("offline/ndcg@10") == "offline/ndcg_at_10"
    assert dict(flatten({"a": {"b": 1, "c": [1, 2]}, "d": None})) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "d": "None",
    }


@pytest.mark.parametrize("name, module", [("mlflow", "mlflow"), ("tensorboard", "tensorboardX")])
def test_a_missing_extra_is_a_one_line_error(monkeypatch, tmp_path, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(
        FoltrError, match=rf"^--track {name}: needs the tracking extra: .*\[tracking\]"
    ):
        make_trackers([name], tmp_path, {}, None)


@pytest.mark.parametrize("jobs", [1, 2])
def test_mlflow_reads_back_one_run_per_repeat_with_curves_params_and_artifacts(
    tmp_path, monkeypatch, jobs
):
    """The default store opens with mlflow's own client and no environment flags; a child run
    exists from its repeat's start, and each metric is stamped within it (serially: as its round
    was evaluated); nothing lands in the working folder."""
    pytest.importorskip("mlflow", reason="the tracking extra (mlflow-skinny) is not installed")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    scenario = tmp_path / "t.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    args = [str(scenario), "--out", str(out), "--quiet", "--track", "mlflow", "--jobs", str(jobs)]
    assert main(args) == 0
    assert list(cwd.iterdir()) == []
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert sorted(children) == ["dp #0", "plain #0"]
    dp = children["dp #0"]
    assert dp.info.status == "FINISHED"
    assert dp.data.params["federation.params.dp"] == "True"
    history = client.get_metric_history(dp.info.run_id, "offline/ndcg_at_10")
    assert [m.step for m in history] == [2, 4]
    stamps = [m.timestamp for m in history]
    assert dp.info.start_time <= stamps[0] <= stamps[1] <= dp.info.end_time
    assert [m.step for m in client.get_metric_history(dp.info.run_id, "sim_time_s")] == [2, 4]
    # 4 rounds of epsilon 4.5 per round, sqrt(46) more under the paper's L2 clipping
    assert dp.data.metrics["privacy/run_basic"] == pytest.approx(4 * 4.5 * 46**0.5)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert parent.info.start_time <= dp.info.start_time
    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.json", "summary.md", "curves.pdf", "curves.png"} <= names
    assert (out / "mlartifacts").is_dir()


def test_mlflow_stamps_each_round_when_it_was_evaluated(tmp_path):
    """Serial runs log a round as it is evaluated: the stamps of one repeat's rounds differ
    when the rounds take wall time (here: 0.2 s sleeps between evaluations)."""
    pytest.importorskip("mlflow", reason="the tracking extra (mlflow-skinny) is not installed")
    from mlflow.tracking import MlflowClient

    from foltr_async.observe.tracking import MlflowTracker

    tracker = MlflowTracker(tmp_path, {"v": {"federation": {"rounds": 4}}})
    tracker.run_started({"scenario": "stamps", "seed": 1})
    tracker.repeat_started("v", 0, 1)
    for r in (2, 4):
        time.sleep(0.2)
        metrics = {"ndcg@10": 0.1 * r}
        tracker.round_done("v", 0, r, metrics=metrics, messages={}, sim_time=float(r))
    result = {"rounds": [2, 4], "offline": {"ndcg@10": [0.2, 0.4]}, "sim_times": [2.0, 4.0]}
    tracker.repeat_done("v", 0, result)
    tracker.run_done({"complete": True})
    client = MlflowClient(tracker.uri)
    (child,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name("stamps").experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    ]
    history = client.get_metric_history(child.info.run_id, "offline/ndcg_at_10")
    assert [(m.step, m.value) for m in history] == [(2, 0.2), (4, 0.4)]  # logged once each
    assert history[1].timestamp - history[0].timestamp >= 150


def test_mlflow_uri_needs_mlflow_tracking(tmp_path, capsys):
    scenario = tmp_path / "t.toml"
    scenario.write_text(SCENARIO)
    assert main([str(scenario), "--out", str(tmp_path / "o"), "--mlflow-uri", "file:x"]) == 2
    assert "--mlflow-uri: only with --track mlflow" in capsys.readouterr().err
