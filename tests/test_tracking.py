"""Experiment tracking export (MLflow, TensorBoard): optional, so skipped without the extra."""

import sys

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


def test_mlflow_gets_one_run_per_repeat_with_curves_params_and_artifacts(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the tracking extra (mlflow-skinny) is not installed")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    scenario = tmp_path / "t.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    assert main([str(scenario), "--out", str(out), "--quiet", "--track", "mlflow"]) == 0
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert sorted(children) == ["dp #0", "plain #0"]
    dp = children["dp #0"]
    assert dp.data.params["federation.params.dp"] == "True"
    history = client.get_metric_history(dp.info.run_id, "offline/ndcg_at_10")
    assert [m.step for m in history] == [2, 4]
    # 4 rounds of epsilon 4.5 per round, sqrt(46) more under the paper's L2 clipping
    assert dp.data.metrics["privacy/run_basic"] == pytest.approx(4 * 4.5 * 46**0.5)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.json", "summary.md"} <= names


def test_tensorboard_gets_event_files_per_repeat(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tracking extra (tensorboardX) is not installed")
    scenario = tmp_path / "t.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    assert main([str(scenario), "--out", str(out), "--quiet", "--track", "tensorboard"]) == 0
    for variant in ("plain", "dp"):
        events = list((out / "tensorboard" / variant / "repeat-0").glob("events.out.tfevents.*"))
        assert len(events) == 1 and b"offline/ndcg_at_10" in events[0].read_bytes()


def test_mlflow_uri_needs_mlflow_tracking(tmp_path, capsys):
    scenario = tmp_path / "t.toml"
    scenario.write_text(SCENARIO)
    assert main([str(scenario), "--out", str(tmp_path / "o"), "--mlflow-uri", "file:x"]) == 2
    assert "--mlflow-uri: only with --track mlflow" in capsys.readouterr().err
