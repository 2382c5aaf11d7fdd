"""A scenario of one's own: ``new NAME --protocol P`` writes a file that validates (built as a
run builds it) for every protocol and runs; ``[plugins]`` names the modules a file needs; the
Python API of docs/SCENARIOS.md runs, its example executed as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import foltr_async
from foltr_async.cli import main
from foltr_async.errors import FoltrError
from foltr_async.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = sorted(load_plugins().protocols)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_new_writes_a_commented_scenario_that_builds(protocol, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["new", "mine", "--protocol", protocol]) == 0
    text = (tmp_path / "mine.toml").read_text()
    assert f'protocol = "{protocol}"' in text and text.count("\n#") >= 5
    assert main(["validate", "--build", "mine.toml"]) == 0, capsys.readouterr().err
    assert "mine.toml: ok (2 variants x 2 repeats: baseline, more-clients)" in (
        capsys.readouterr().out
    )


def test_new_refuses_to_replace_a_file_or_an_unknown_protocol(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text("mine\n")
    assert main(["new", "mine"]) == 2
    assert "exists already; nothing was replaced" in capsys.readouterr().err
    assert (tmp_path / "mine.toml").read_text() == "mine\n"
    assert main(["new", "other", "--protocol", "fpgdg"]) == 2
    assert "(did you mean 'fpdgd'?)" in capsys.readouterr().err
    assert main(["new", "a/b"]) == 2
    assert "scenario.name: expected a name for one folder" in capsys.readouterr().err


def test_a_new_scenario_runs_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["new", "mine"]) == 0
    argv = ["mine.toml", "--set", "federation.rounds=2", "--out", "out", "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "results.json").is_file()


# ---------------------------------------------------------------- [plugins]

PLUGGED = """
[plugins]
modules = ["{module}"]
[dataset]
n_queries = 60
[federation]
protocol = "fpdgd_retire"
clients = 2
rounds = 1
"""


def test_plugins_named_in_the_file_are_loaded_before_it_is_checked(tmp_path, capsys, monkeypatch):
    # set (empty), so that it is put back as it was afterwards, even when it was unset
    monkeypatch.setenv("FOLTR_ASYNC_PLUGINS", "")
    path = tmp_path / "plugged.toml"
    path.write_text(PLUGGED.format(module="plugin_retire"))  # tests/ is on sys.path
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert "fpdgd_retire" in load_plugins().protocols
    import os

    assert os.environ["FOLTR_ASYNC_PLUGINS"] == "plugin_retire"  # what its processes inherit


def test_a_missing_plugin_is_one_line_naming_file_and_key(tmp_path, capsys):
    path = tmp_path / "plugged.toml"
    path.write_text(PLUGGED.format(module="no_such_plugin_module"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {path}: plugins.modules: cannot import 'no_such_plugin_module'")
    path.write_text(PLUGGED.format(module="plugin_retire").replace("modules", "module"))
    assert main(["validate", str(path)]) == 2
    assert "plugins.module: expected a [plugins] table" in capsys.readouterr().err


# ---------------------------------------------------------------- from Python


def _doc_example() -> str:
    text = (ROOT / "docs" / "SCENARIOS.md").read_text()
    section = text.split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_documented_python_example_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["new", "mine"]) == 0
    exec(compile(_doc_example(), "docs/SCENARIOS.md", "exec"), {})
    out = capsys.readouterr().out
    assert "baseline: ndcg@10 " in out and "files in runs/mine" in out
    assert (tmp_path / "runs" / "mine" / "summary.md").is_file()


def test_run_takes_a_loaded_scenario_and_refuses_overrides_with_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["new", "mine"]) == 0
    sc = foltr_async.load_scenario("mine.toml", ["federation.rounds=1"], only=["baseline"])
    res = foltr_async.run(sc, out="one")
    assert list(res.variants) == ["baseline"] and len(res.variants["baseline"].finals) == 2
    assert res.raw["config"]["baseline"]["federation"]["rounds"] == 1
    with pytest.raises(FoltrError, match="overrides, seed and only apply to a scenario file"):
        foltr_async.run(sc, ["federation.rounds=2"])
