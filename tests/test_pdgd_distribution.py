"""tools/pdgd_distribution.py: the simulator's FPDGD learns as the ltr/pdgd.py reference does on
real MQ2008, and the check fails when FPDGD is changed."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import SHARED, shared_data

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "pdgd_distribution.py"
SMALL = [
    "--folds",
    "1",
    "--seeds",
    "4",
    "--clients",
    "10",
    "--rounds",
    "30",
    "--clicks",
    "informational",
    "--no-dp-arm",
]


def check(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    data = shared_data(SHARED / "data" / "MQ2008" / "Fold1").parent
    out = tmp_path / "table.json"
    done = subprocess.run(
        [sys.executable, str(TOOL), "--data", str(data), *SMALL, "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(out.read_text())["cells"][0]


def test_fpdgd_matches_the_pdgd_reference_in_distribution(tmp_path):
    code, cell = check(tmp_path)
    assert code == 0 and cell["pass"]
    assert cell["runs"] == 4
    # both sides learned (a zero model ranks MQ2008 fold 1 at about 0.3)
    assert cell["fpdgd_mean"] > 0.6 and cell["reference_mean"] > 0.6
    assert abs(cell["fpdgd_mean"] - cell["reference_mean"]) < cell["spread"]


def test_the_check_fails_when_fpdgd_learns_differently(tmp_path):
    # noise the reference does not add: what a broken update path would look like
    noisy = ["federation.params.dp=true", "federation.params.epsilon=0.5"]
    code, cell = check(tmp_path, "--set", noisy[0], "--set", noisy[1])
    assert code == 1 and not cell["pass"]
    assert cell["fpdgd_mean"] < cell["reference_mean"] - cell["spread"]
