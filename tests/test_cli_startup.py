"""A usage error answers before the heavy libraries load: what a command imports before it
refuses a bad flag, a missing file or a mistyped name is checked in a fresh process (no
wall-clock assertion: the set of loaded modules says whether the answer waited for them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what a one-line refusal must not wait for (statistics, plots, the compiled kernel, trackers)
HEAVY = ("scipy", "numba", "matplotlib", "mlflow", "tensorboardX", "ray")

PROBE = f"""
import json, sys
from foltr_async.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))
"""

SCENARIO = "scenarios/fpdgd_batch.toml"
BAD = {
    "missing file": ["nosuch.toml"],
    "run, missing file": ["run", "nosuch.toml"],
    "bad flag": ["--no-such-flag", SCENARIO],
    "validate, missing file": ["validate", "nosuch.toml"],
    "mistyped variant": [SCENARIO, "--only", "B3"],
    "mistyped key": [SCENARIO, "--set", "federation.roundz=3"],
    "missing data": [SCENARIO, "--set", "dataset.path=no/such/folder"],
    "merge, missing run": ["merge", "no-such-run", "other-run", "--out", "{tmp}/merged"],
    "dataset check, missing": ["dataset", "check", "no/such/folder"],
    "serve, missing file": ["serve", "nosuch.toml", "--bind", "tcp://127.0.0.1:0", "--insecure"],
    "join, missing file": [
        "join",
        "nosuch.toml",
        "--connect",
        "tcp://127.0.0.1:1",
        "--agents",
        "client-0",
        "--insecure",
    ],
    "bench, bad flag": ["bench", "--no-such-flag"],
    "list, bad flag": ["list", "--no-such-flag"],
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_usage_error_loads_no_heavy_library(case, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in BAD[case]]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rc, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rc == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert loaded == [], f"{case}: loaded {loaded} before refusing: {proc.stderr.strip()}"
