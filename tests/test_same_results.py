"""What "deterministic" means here, tested as stated in the README:

- on one machine, the same scenario, seed and version give bit-identical results (every number,
  every message count), also in a fresh process with another hash seed;
- on another machine (CPU, BLAS, numba build) they are equal up to float rounding: integers and
  strings exactly, floats within a relative 1e-6, against results recorded on the reference
  machine (tests/data/same_results/; a change that adds a result key adds it there, all else
  equal, and its commit says so). A compiled kernel or BLAS may sum in another order there,
  which moves the last bits of update statistics such as a cosine's mean and std; a change of
  logic moves them far more than 1e-6.

Each case covers other parts of the path: lognormal latencies, an attacker and unlearning's
calibration rounds; secure aggregation with dropouts; an eavesdropper's tap with DP noise.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).resolve().parent / "data" / "same_results"
REL_TOL, ABS_TOL = 1e-6, 1e-12

CASES = [
    ("unlearn_attacker.toml", "9H-1M-unlearned", ["federation.rounds=30"]),
    ("secagg_dropout.toml", "secagg-drop30", ["federation.rounds=4", "federation.clients=12"]),
    ("eavesdropper.toml", "FPDGD-dp-4.5-5", ["federation.rounds=3", "federation.clients=20"]),
]


def _result(file: str, variant: str, sets: list[str]) -> dict:
    sc = load_scenario(ROOT / "scenarios" / file, sets)
    result = run(Simulation(sc.variants[variant], 1, Observer()).run())
    result.pop("wall_s")
    return json.loads(json.dumps(result, sort_keys=True))  # tuples -> lists, as recorded


def _differences(got, want, path="result") -> list[str]:
    """Every place where ``got`` is not ``want`` up to float rounding (bools and ints exact)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got!r} != {want!r}"]
        pairs = enumerate(zip(got, want, strict=True))
        return [d for i, (g, w) in pairs for d in _differences(g, w, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, float | int) and not isinstance(got, bool):
        if math.isclose(got, want, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return []
        return [f"{path}: {got!r} != {want!r}"]
    return [] if type(got) is type(want) and got == want else [f"{path}: {got!r} != {want!r}"]


@pytest.mark.parametrize(("file", "variant", "sets"), CASES)
def test_results_equal_the_recorded_ones_up_to_float_rounding(file, variant, sets):
    want = json.loads((RECORDED / f"{file.removesuffix('.toml')}--{variant}.json").read_text())
    got = _result(file, variant, sets)
    assert _differences(got, want) == []
    assert got["messages"] == want["messages"]  # every count, exactly


def test_the_comparison_catches_a_change_beyond_rounding():
    want = {"a": [1, 0.5], "m": {"n": 3}}
    assert _differences({"a": [1, 0.5 * (1 + 1e-9)], "m": {"n": 3}}, want) == []
    assert _differences({"a": [1, 0.5001], "m": {"n": 3}}, want) == ["result.a[1]: 0.5001 != 0.5"]
    assert _differences({"a": [1, 0.5], "m": {"n": 4}}, want) == ["result.m.n: 4 != 3"]
    assert _differences({"a": [1], "m": {"n": 3}}, want) != []


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.test_same_results import _result
print(json.dumps(_result(sys.argv[2], sys.argv[3], sys.argv[4:]), sort_keys=True))
"""


def test_bit_identical_on_one_machine_also_in_a_fresh_process():
    file, variant, sets = CASES[0]
    here = _result(file, variant, sets)
    assert _result(file, variant, sets) == here  # the same process, a second time
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), file, variant, *sets],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=ROOT,
    ).stdout
    assert json.loads(out.splitlines()[-1]) == here  # == on floats: bit for bit
