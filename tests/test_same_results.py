"""Speed work must not change results: small runs of shipped scenarios against numbers recorded
before the message path was made cheaper (commit 65eadf9, this repository's reference machine).
The secure-aggregation and eavesdropper digests were recorded again after the compiled PDGD
kernel, whose gradient sums in another order: the only change was in the last bit of the update
statistics (cosine mean and std); metrics and messages were equal. Both were recorded again when
FPDGD's DP model message began to carry the round's noise shares (8 bytes more per model
message) and the privacy report grew: every other number was equal.

Each case covers other parts of the path: lognormal latencies, an attacker and unlearning's
calibration rounds; secure aggregation with dropouts; an eavesdropper's tap with DP noise. The
digest is over the whole result (wall time excepted), so any change shows: in the messages,
their order, the batches training sees or the numbers it computes.
"""

import hashlib
import json
from pathlib import Path

import pytest

from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"

CASES = [
    # (file, variant, overrides, digest, final nDCG@10, messages delivered)
    (
        "unlearn_attacker.toml",
        "9H-1M-unlearned",
        ["federation.rounds=30"],
        "0a474f5decea1b4f",
        0.33131961472342064,
        653,
    ),
    (
        "secagg_dropout.toml",
        "secagg-drop30",
        ["federation.rounds=4", "federation.clients=12"],
        "7f131beb9235b5dd",
        0.3884418586518614,
        390,
    ),
    (
        "eavesdropper.toml",
        "FPDGD-dp-4.5-5",
        ["federation.rounds=3", "federation.clients=20"],
        "7a16d11bfa6e863e",
        0.28120476401835376,
        120,
    ),
]


@pytest.mark.parametrize(("file", "variant", "sets", "digest", "ndcg", "delivered"), CASES)
def test_results_equal_the_recorded_ones(file, variant, sets, digest, ndcg, delivered):
    sc = load_scenario(SCENARIOS / file, sets)
    result = run(Simulation(sc.variants[variant], 1, Observer()).run())
    result.pop("wall_s")
    assert result["offline"]["ndcg@10"][-1] == ndcg
    assert result["messages"]["delivered"] == delivered
    text = json.dumps(result, sort_keys=True, default=repr)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == digest
