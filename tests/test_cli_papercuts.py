"""Small command-line promises: --version, refused --jobs / --executor before anything is
written, secret keys kept out of git, dataset check taking what a run takes, a relative
dataset.path saying where it was looked for, the licence and citation files."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import SHARED, shared_data

from foltr_async import __version__
from foltr_async.cli import main
from foltr_async.outdir import RESULT_FILES

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "fpdgd_batch.toml"


def test_version_names_the_installed_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"foltr-async {__version__}"


def test_jobs_zero_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(SCENARIO), "--jobs", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "error: --jobs: expected an integer >= 1, got 0\n"
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed")
def test_ray_missing_fails_before_any_results_file(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(SCENARIO), "--executor", "ray", "--out", str(out), "--set", "federation.rounds=1"]
    assert main(argv) == 2
    assert "Ray is not installed" in capsys.readouterr().err
    assert not out.exists() or not [n for n in RESULT_FILES if (out / n).exists()]
    assert main(argv) == 2  # the same command again: refused for Ray, not for the folder
    assert "Ray is not installed" in capsys.readouterr().err


# ---------------------------------------------------------------- keys and git


def _git_repo(path: Path) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git")


@needs_git
def test_keys_refuse_a_work_tree_that_would_commit_them(tmp_path, capsys):
    repo = _git_repo(tmp_path / "repo")
    keys = repo / "keys"
    assert main(["keys", "init", str(keys)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could be committed" in err and "--in-work-tree" in err
    assert not keys.exists()  # refused before any key was made
    assert main(["keys", "init", str(keys), "--in-work-tree"]) == 0
    assert "warning: keys:" in capsys.readouterr().err
    assert (keys / "server.key_secret").is_file()
    assert main(["keys", "add", str(keys), "extra"]) == 2  # add checks as init does
    capsys.readouterr()


@needs_git
def test_keys_are_written_where_git_ignores_them(tmp_path, capsys):
    repo = _git_repo(tmp_path / "repo")
    (repo / ".gitignore").write_text("*.key_secret\n")
    assert main(["keys", "init", str(repo / "keys")]) == 0
    assert "warning" not in capsys.readouterr().err
    outside = tmp_path / "elsewhere"  # no work tree at all
    assert main(["keys", "init", str(outside)]) == 0
    assert (outside / "worker-0.key_secret").is_file()


@needs_git
def test_the_projects_gitignore_covers_key_folders():
    for path in ("keys/server.key_secret", "deploy/worker-3.key_secret"):
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path], check=False
        )
        assert proc.returncode == 0, f"{path} is not ignored"


# ---------------------------------------------------------------- dataset check


@pytest.fixture(scope="module")
def mq2008_fold1() -> Path:
    return shared_data(SHARED / "data" / "MQ2008" / "Fold1")


def test_dataset_check_takes_a_train_and_test_folder(mq2008_fold1, tmp_path, capsys):
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("train.txt", "test.txt"):
        shutil.copy(mq2008_fold1 / name, folder / name)
    assert main(["dataset", "check", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder}: LETOR 4.0 MQ2008, one fold's folder")
    assert " train " in out and " test " in out and " vali " not in out


def test_dataset_check_takes_a_training_file(mq2008_fold1, tmp_path, capsys):
    train = mq2008_fold1 / "train.txt"
    assert main(["dataset", "check", str(train)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{train}: LETOR 4.0 MQ2008, a training file and the test.txt beside")
    lone = tmp_path / "lone.txt"
    shutil.copy(train, lone)
    assert main(["dataset", "check", str(lone)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'test.txt'}: missing" in err


def test_a_relative_dataset_path_says_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    scenario = tmp_path / "rel.toml"
    scenario.write_text(
        '[scenario]\nname = "rel"\n[dataset]\npath = "no/such/folder"\n'
        '[federation]\nprotocol = "fpdgd"\nclients = 2\nrounds = 1\n'
    )
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no/such/folder: dataset file does not exist (a relative path: looked up from " in err
    assert str(tmp_path) in err
    assert main(["validate", str(scenario), "--set", "dataset.path=other"]) == 2
    assert f"looked up from the current folder {tmp_path}" in capsys.readouterr().err


# ---------------------------------------------------------------- licence and citation


def test_licence_and_citation_agree_with_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"]["text"] == "MIT"
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "the foltr_async authors" in licence
    cff = (ROOT / "CITATION.cff").read_text()
    assert "cff-version: 1.2.0" in cff and "license: MIT" in cff
    assert f'version: "{project["version"]}"' in cff
