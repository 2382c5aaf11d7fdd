"""Claims of record: the verdict rules, the claims file's checks, records and their staleness,
and the generated report with its --check."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from foltr_async.errors import ScenarioError
from foltr_async.provenance import code_stamp
from foltr_async.reproduction import verdict as V
from foltr_async.reproduction.claims import _words, check_quotes, load_claims
from foltr_async.reproduction.records import load_records, make_record, write_record
from foltr_async.reproduction.report import _claim_line, differences, evaluate, render

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT.parent / "shared" / "seeds"
needs_seeds = pytest.mark.skipif(not SEEDS.is_dir(), reason=f"the seed texts ({SEEDS}) are absent")


def paired(effect: float, n: int = 25, sd: float = 0.01, seed: int = 0):
    """Pairs whose differences have mean ``effect`` and sample std ``sd`` exactly."""
    rng = np.random.default_rng(seed)
    b = rng.normal(0.6, 0.05, n)
    z = rng.normal(size=n)
    z = (z - z.mean()) / z.std(ddof=1)
    return list(b + effect + sd * z), list(b)


def judge(a, b, expect="greater", significant=True, effect=None, m=1):
    return V.judge(
        a,
        b,
        expect=expect,
        published_significant=significant,
        published_effect=effect,
        m=m,
        alpha=0.05,
    ).verdict


def test_direction_claims_follow_the_written_rules():
    assert judge(*paired(0.02)) == V.REPRODUCED
    assert judge(*paired(0.002, n=5)) == V.DIRECTION  # right sign, too few pairs to tell
    assert judge(*paired(-0.02)) == V.CONTRADICTED
    assert judge(*paired(-0.001, n=5)) == V.NULL
    assert judge(*paired(-0.02), expect="less") == V.REPRODUCED


def test_bonferroni_family_can_take_significance_away():
    a, b = paired(0.0125, n=8, seed=3)  # t 3.5: p 0.0095
    assert judge(a, b, m=1) == V.REPRODUCED
    assert judge(a, b, m=40) == V.DIRECTION


def test_a_null_is_reproduced_only_when_the_seed_reports_none_and_n_would_detect_it():
    small_n = paired(0.0005, n=5)
    big_n = paired(0.0005, n=25, sd=0.002)
    # the seed reports "no significant difference" of size 0.01
    assert judge(*small_n, expect="equal", effect=0.01) == V.NULL  # n = 5 detects only ~0.02
    assert judge(*big_n, expect="equal", effect=0.01) == V.REPRODUCED
    assert judge(*big_n, expect="equal", effect=None) == V.NULL  # no published size: never
    assert judge(*paired(0.03), expect="equal", effect=0.01) == V.CONTRADICTED
    # "lower, not significantly": significant here is direction only
    assert judge(*paired(-0.03), expect="less", significant=False, effect=0.01) == V.DIRECTION
    assert judge(*big_n[::-1], expect="less", significant=False, effect=0.01) == V.REPRODUCED


def test_a_claim_takes_its_weakest_comparison_and_any_contradiction():
    assert V.combine([V.REPRODUCED, V.DIRECTION]) == V.DIRECTION
    assert V.combine([V.REPRODUCED, V.NULL, V.DIRECTION]) == V.NULL
    assert V.combine([V.REPRODUCED, V.CONTRADICTED]) == V.CONTRADICTED
    assert V.combine([]) == V.NOT_RUN


STUDY = (
    '[studies.fpdgd]\nfile = "001_b76816e974be733a.txt"\ntitle = "FPDGD"\n'
    '[topics.dp]\ntitle = "Privacy"\n'
)
CLAIM = """
[[claim]]
id = "dp-lower"
study = "fpdgd"
topic = "dp"
title = "DP costs effectiveness"
source = { place = "title", lines = [3, 3] }
finding = "Effective and Privacy-preserving Federated Online Learning to Rank"
published = "lower"
expect = "less"
runs = ["run-a"]
comparisons = [{ arm = "dp", against = "plain" }]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "claims.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (('expect = "less"', 'expect = "lower"'), "claims.toml:8: claim.expect: expected one of"),
        (('published = "lower"', 'publish = "lower"'), "unknown key (did you mean 'published'?)"),
        (('study = "fpdgd"', 'study = "fedips"'), "claim.study: expected one of fpdgd"),
        (('topic = "dp"', 'topic = "privacy"'), "claim.topic: expected one of dp, got 'privacy'"),
        (("lines = [3, 3]", "lines = [4, 3]"), "claim.source.lines: expected [first, last]"),
        (('runs = ["run-a"]\n', ""), "expected runs and comparisons, or not_comparable"),
    ],
)
def test_a_bad_claims_file_is_one_line_naming_the_key(tmp_path, edit, message):
    path = write(tmp_path, STUDY + "\n" + CLAIM.replace(*edit))
    with pytest.raises(ScenarioError) as err:
        load_claims(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_claim_id_is_used_once(tmp_path):
    with pytest.raises(ScenarioError, match="'dp-lower' is used twice"):
        load_claims(write(tmp_path, STUDY + CLAIM + CLAIM))


def test_a_study_outside_the_seeds_is_read_from_its_repository_figures(tmp_path):
    """A study whose text is not a seed names its repository; its claims name a figure, no
    lines, and are not held against a seed text (there is none to quote)."""
    repo_study = STUDY.replace('file = "001_b76816e974be733a.txt"', 'repository = "o/r"')
    figure = CLAIM.replace("lines = [3, 3]", "").replace('place = "title", ', 'place = "fig.png"')
    claims = load_claims(write(tmp_path, repo_study + figure))
    assert check_quotes(claims, tmp_path) == []  # no seed folder needed
    [claim] = claims.claims
    assert "read from the figure `fig.png` of GitHub `o/r`" in _claim_line(claim)
    with pytest.raises(ScenarioError, match="claim.source.lines: expected none"):
        load_claims(write(tmp_path, repo_study + CLAIM))
    both = STUDY.replace('title = "FPDGD"', 'title = "FPDGD"\nrepository = "o/r"')
    with pytest.raises(ScenarioError, match="studies.fpdgd: expected a seed file or a repository"):
        load_claims(write(tmp_path, both + CLAIM))


@needs_seeds
def test_a_quote_must_be_in_its_seed_at_its_lines(tmp_path):
    good = load_claims(write(tmp_path, STUDY + CLAIM))
    assert check_quotes(good, SEEDS) == []
    moved = load_claims(write(tmp_path, STUDY + CLAIM.replace("[3, 3]", "[40, 60]")))
    assert "the finding is not at lines 40-60" in check_quotes(moved, SEEDS)[0]
    made_up = STUDY + CLAIM.replace("Online Learning", "Offline Learning")
    assert check_quotes(load_claims(write(tmp_path, made_up)), SEEDS)


@given(st.lists(st.sampled_from(["a", "b", " ", "\n", "\t", "\u2019", "'"]), max_size=30))
def test_whitespace_and_typographic_quotes_do_not_matter(chars):
    text = "".join(chars)
    assert _words(text) == _words(text.replace("\n", " ").replace("\u2019", "'"))
    assert "  " not in _words(text)


def results(values: dict[str, list[float]]) -> dict:
    return {
        "complete": True,
        "scenario": "tiny",
        "reference": "plain",
        "config": {"plain": {"federation": {"rounds": 4}}},
        "code": code_stamp(),
        "variants": {
            name: {
                "repeats": [
                    {
                        "fold": 1 + i % 5,
                        "seed": 1 + i // 5,
                        "rounds": [2, 4],
                        "offline": {"ndcg@10": [v - 0.01, v]},
                        "online_at": [1.0, 2.0],
                        "online": {"ndcg@10_discounted": 2.0},
                        "interactions": [10, 20],
                        "wall_s": 1.0,
                    }
                    for i, v in enumerate(vals)
                ]
            }
            for name, vals in values.items()
        },
    }


def test_records_answer_claims_and_a_changed_file_makes_them_stale(tmp_path):
    a, b = paired(-0.02)
    folder = tmp_path / "records"
    write_record(make_record(results({"dp": a, "plain": b}), "run-a", "cmd"), folder)
    claims = load_claims(write(tmp_path, STUDY + CLAIM))
    records = load_records(folder)
    [e] = evaluate(claims, records)
    assert e.verdict == V.REPRODUCED and e.outcomes[0].n == 25 and not e.stale
    data = json.loads(gzip.decompress((folder / "run-a.json.gz").read_bytes()))
    data["files"]["protocols/fpdgd.py"] = "0" * 16
    (folder / "run-a.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    [e] = evaluate(claims, load_records(folder))
    assert e.stale == ("run-a",) and "stale: run-a" in render([e], load_records(folder), claims)


def test_a_record_comes_from_a_complete_run_of_this_code():
    res = results({"plain": [0.5]})
    with pytest.raises(Exception, match="made by other code"):
        make_record({**res, "code": {"source": "0" * 16}}, "r", "")
    with pytest.raises(Exception, match="not complete"):
        make_record({**res, "complete": False}, "r", "")


def test_a_round_the_record_lacks_is_said_not_guessed(tmp_path):
    a, b = paired(-0.02)
    folder = tmp_path / "records"
    write_record(make_record(results({"dp": a, "plain": b}), "run-a", "cmd"), folder)
    claims = load_claims(write(tmp_path, STUDY + CLAIM.replace("expect =", "round = 3\nexpect =")))
    [e] = evaluate(claims, load_records(folder))
    assert e.verdict == V.NOT_RUN and "ndcg@10 at round 3 not recorded" in e.problems[0]


def test_the_check_names_the_claim_whose_numbers_differ(tmp_path):
    a, b = paired(-0.02)
    folder = tmp_path / "records"
    write_record(make_record(results({"dp": a, "plain": b}), "run-a", "cmd"), folder)
    claims = load_claims(write(tmp_path, STUDY + CLAIM))
    text = render(evaluate(claims, load_records(folder)), load_records(folder), claims)
    assert differences(text, text) == []
    mean = f"{np.mean(a):.4f}"
    assert mean in text
    assert differences(text.replace(mean, "0.9999"), text) == ["dp-lower"]
    assert differences(text.replace("reproduced", "direction only"), text) == [
        "(table)",  # the verdict counts
        "topic-dp",  # the topic's table
        "dp-lower",
    ]


@needs_seeds
def test_the_shipped_report_is_what_the_committed_records_give():
    """The README's claims check: every quote in its seed, every number and verdict of
    docs/REPRODUCTION.md recomputed from reproduce/claims/records/."""
    out = subprocess.run(
        [sys.executable, "-m", "foltr_async", "claims", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr


def test_a_learning_claim_reads_one_arm_against_its_own_early_round(tmp_path):
    folder = tmp_path / "records"
    write_record(make_record(results({"plain": [0.6] * 5}), "run-a", "cmd"), folder)
    learns = CLAIM.replace('expect = "less"', 'expect = "greater"').replace(
        '{ arm = "dp", against = "plain" }',
        '{ arm = "plain", against = "plain", against_round = 2 }',
    )
    claims = load_claims(write(tmp_path, STUDY + learns))
    [e] = evaluate(claims, load_records(folder))
    # each repeat ends 0.01 above its round-2 evaluation: no spread, so no test (direction only)
    assert e.outcomes[0].diff == pytest.approx(0.01) and e.verdict == V.DIRECTION
    assert "plain vs plain at round 2" in render([e], load_records(folder), claims)
