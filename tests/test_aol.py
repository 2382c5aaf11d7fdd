"""AOL4FOLTR: the reader (metadata + streamed LETOR, user pick, time split, the authors'
normalisation, one-line errors) and clients replaying their users' logged queries."""

from __future__ import annotations

import csv
import importlib.util
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from foltr_async import cli
from foltr_async.errors import DatasetError
from foltr_async.ltr.aol import (
    CLICKED_GRADE,
    GLOBAL_FEATURES,
    N_FEATURES,
    load_aol,
    read_metadata,
    select_users,
)
from foltr_async.ltr.queryset import QuerySet
from foltr_async.observe.observer import Observer
from foltr_async.protocols.users import Users
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]
T0 = datetime(2006, 3, 1, tzinfo=UTC)
HEADER = ["qid", "user_id", "timestamp", "query", "target_doc_id", "candidate_doc_ids"]


def feature_rows(qid: int, clicked: int) -> list[str]:
    """20 LETOR lines of one qid: raw, query-dependent values; globally normalised columns
    are constant within the query."""
    lines = []
    for d in range(20):
        vals = [(qid * 7 + d * (j % 5 + 1) + j) % 97 + 0.25 * (j % 3) for j in range(N_FEATURES)]
        for j in GLOBAL_FEATURES:
            vals[j] = float((qid * 13 + j) % 29)
        feats = " ".join(f"{j + 1}:{v}" for j, v in enumerate(vals))
        lines.append(f"{int(d == clicked)} qid:{qid} {feats}")
    return lines


def write_release(folder: Path, log: list[tuple[int, int, int]], letor_for=None) -> Path:
    """metadata.csv + letor.txt for rows (qid, user, seconds after 2006-03-01), in the
    release's layout (extra columns, a quoted candidate set with commas)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metadata.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(HEADER)
        for qid, user, sec in sorted(log, key=lambda r: (r[2], r[0])):
            stamp = (T0 + timedelta(seconds=sec)).strftime("%Y-%m-%d %H:%M:%S")
            w.writerow([qid, user, stamp, f"q {qid}", "d3", "{'d1', 'd2', 'd3'}"])
    qids = [r[0] for r in sorted(log, key=lambda r: (r[2], r[0]))]
    if letor_for is not None:
        qids = letor_for
    text = "\n".join(line for q in qids for line in feature_rows(q, q % 20)) + "\n"
    (folder / "letor.txt").write_text(text)
    return folder


# users 10, 20, 30, 40 with 6, 5, 4, 2 queries; times interleave
LOG = [
    (0, 10, 0),
    (1, 20, 60),
    (2, 10, 3600),
    (3, 30, 3700),
    (4, 20, 7200),
    (5, 10, 7300),
    (6, 30, 9000),
    (7, 40, 9100),
    (8, 10, 20000),
    (9, 20, 20001),
    (10, 30, 30000),
    (11, 10, 40000),
    (12, 20, 50000),
    (13, 40, 60000),
    (14, 10, 70000),
    (15, 20, 80000),
    (16, 30, 90000),
]


@pytest.fixture
def release(tmp_path: Path) -> Path:
    return write_release(tmp_path / "aol", LOG)


def test_reads_users_split_in_time_and_logged_order(release):
    data = load_aol(release, 4, seed=0, test_fraction=0.2, normalise=False, cache=False)
    # 17 queries: the first int(17 * 0.8) = 13 in time train, the last 4 are held out
    assert list(data.train.qids) == [str(q) for q in range(13)]
    assert list(data.test.qids) == ["13", "14", "15", "16"]
    assert data.train.n_docs == 13 * 20 and (np.diff(data.train.qptr) == 20).all()
    # the logged click is grade 2, the others 0; one per query
    assert set(data.train.labels.tolist()) == {0, CLICKED_GRADE}
    assert (data.train.labels.reshape(13, 20).argmax(1) == np.arange(13) % 20).all()
    # raw features as written (the letor file's first feature of qid 0, document 0)
    assert data.train.features[0, 0] == pytest.approx(0.0)
    assert data.train.features[21, 1] == pytest.approx((7 + 1 * 2 + 1) % 97 + 0.25)
    logs = {u.user: u for u in data.users}
    assert sorted(logs) == [10, 20, 30, 40]
    # user 10's training queries in logged order, seconds since the first training query
    assert logs[10].queries.tolist() == [0, 2, 5, 8, 11]
    assert logs[10].offsets.tolist() == [0, 3600, 7300, 20000, 40000]
    assert logs[40].queries.tolist() == [7]  # its other query is held out


def test_user_pick_is_seeded_and_filtered(tmp_path):
    rows, qid = [], 0
    for user in range(1, 41):
        for k in range(user % 7 + 1):  # users with 1..7 queries
            rows.append((qid, user, user * 100 + k))
            qid += 1
    log = read_metadata(write_release(tmp_path / "many", rows) / "metadata.csv")
    a = select_users(log, 5, 3, "sample", np.random.default_rng(4))
    b = select_users(log, 5, 3, "sample", np.random.default_rng(4))
    c = select_users(log, 5, 3, "sample", np.random.default_rng(5))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    counts = {u: u % 7 + 1 for u in range(1, 41)}
    assert all(counts[u] >= 3 for u in a.tolist() + c.tolist())
    # the most active: 7 queries (users 6, 13, 20, 27, 34), ties to the lower id
    top = select_users(log, 3, 1, "most_active", np.random.default_rng(0))
    assert top.tolist() == [6, 13, 20]
    with pytest.raises(DatasetError, match="6 users have at least 7 queries|5 users have"):
        select_users(log, 6, 7, "sample", np.random.default_rng(0))


def test_normalisation_is_the_authors(release):
    raw = load_aol(release, 4, normalise=False, cache=False)
    norm = load_aol(release, 4, normalise=True, cache=False)
    every = np.vstack([raw.train.features, raw.test.features]).astype(np.float64)
    got = np.vstack([norm.train.features, norm.test.features])
    glob = set(GLOBAL_FEATURES.tolist())
    want = np.empty_like(every)
    for j in range(N_FEATURES):  # as aol4foltr's LetorDataset: per query, then globally
        col = every[:, j]
        if j in glob:
            lo, hi = col.min(), col.max()
            want[:, j] = (col - lo) / (hi - lo) if hi > lo else col
            continue
        for q0 in range(0, len(col), 20):
            block = col[q0 : q0 + 20]
            lo, hi = block.min(), block.max()
            want[q0 : q0 + 20, j] = (block - lo) / (hi - lo) if hi > lo else 0.0
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got[:, GLOBAL_FEATURES].std(axis=0).max() > 0  # global columns not flattened


def test_nan_reads_as_zero_as_the_authors_reader(tmp_path):
    folder = write_release(tmp_path / "nan", LOG)
    text = re.sub(r" 5:[^ ]+", " 5:nan", (folder / "letor.txt").read_text(), count=1)
    (folder / "letor.txt").write_text(text)
    data = load_aol(folder, 4, normalise=False, cache=False)
    assert data.train.features[0, 4] == 0.0 and data.train.features[1, 4] != 0.0


def test_cache_returns_the_same_arrays(release):
    a = load_aol(release, 3, seed=2)
    b = load_aol(release, 3, seed=2)
    np.testing.assert_array_equal(a.train.features, b.train.features)
    assert [u.user for u in a.users] == [u.user for u in b.users]
    assert all((x.offsets == y.offsets).all() for x, y in zip(a.users, b.users, strict=True))


def test_users_replay_their_queries_in_order_once_issued():
    train = QuerySet(
        np.zeros((20, 2), dtype=np.float32),
        np.tile(np.array([0, 2], dtype=np.int8), 10),
        np.arange(0, 21, 2),
        np.array([str(q) for q in range(10)]),
    )
    queries = np.array([7, 3, 9, 4])
    users = Users(
        train, queries, None, np.random.default_rng(0), None, arrivals=np.array([0.0, 1, 1, 5])
    )
    assert users.pending(-0.1) == 0 and users.pending(0.0) == 1
    assert users.next_query() == 7 and users.pending(0.5) == 0
    assert users.next_arrival() == 1.0 and users.pending(1.0) == 2
    assert [users.next_query(), users.next_query()] == [3, 9]
    assert users.pending(4.9) == 0 and users.pending(100) == 1
    assert users.next_query() == 4 and users.next_arrival() is None


SCENARIO = """
[scenario]
name = "aol"
seed = 1

[dataset]
format = "aol4foltr"
path = "{path}"
normalise = true
time_scale = {scale}
{extra}

[clicks]
model = "navigational"

[federation]
protocol = "fpdgd"
clients = {clients}
rounds = {rounds}
round_gap = {gap}
deadline = 1.0e6

[evaluation]
every = 1

[variants.sync]
federation.params = {{ lr = 0.1 }}

[variants.fedbuff]
federation.protocol = "fpdgd_async"
federation.params = {{ mode = "fedbuff", buffer = 2, period = {gap}, compute_time = 0.01 }}
"""


def scenario(
    tmp_path: Path, folder: Path, *, clients=4, rounds=12, gap=10.0, scale=1000.0, extra=""
):
    p = tmp_path / "aol.toml"
    p.write_text(
        SCENARIO.format(
            path=folder, scale=scale, clients=clients, rounds=rounds, gap=gap, extra=extra
        )
    )
    return p


def arrivals_of(sim) -> list[np.ndarray]:
    return [c.arrivals for c in sim.ctx.partition.clients]


def test_sync_clients_play_exactly_the_queries_issued_before_each_round(tmp_path, release):
    sc = load_scenario(scenario(tmp_path, release))
    sim = Simulation(sc.variants["sync"], 1, Observer())
    res = run(sim.run())
    arrivals = np.concatenate(arrivals_of(sim))
    # rounds every 10 s, no latency or compute time: round r plays what was issued by (r-1)*10
    times = res["sim_times"]
    assert times == [10.0 * r for r in range(12)]
    issued = [int((arrivals <= t).sum()) for t in times]
    assert res["interactions"] == issued  # never a query before its time, none left behind
    assert res["replay"]["played"] == issued[-1] == 13
    # a client with nothing new since the last round sent an empty update
    empty = 0
    for a in arrivals_of(sim):
        by_round = np.searchsorted(a, times, side="right")
        empty += int((np.diff(by_round, prepend=0) == 0).sum())
    assert res["replay"]["empty_updates"] == empty > 0
    for aid, own in sim.ctx.partition.by_agent.items():
        assert sim.agents[aid].learner.users.played == int((own.arrivals <= times[-1]).sum())
    again = run(Simulation(sc.variants["sync"], 1, Observer()).run())
    assert again["offline"] == res["offline"] and again["online"] == res["online"]


def test_fedbuff_clients_hold_the_model_until_their_user_searches(tmp_path, release):
    sc = load_scenario(scenario(tmp_path, release, rounds=10, gap=10.0))
    sim = Simulation(sc.variants["fedbuff"], 1, Observer())
    res = run(sim.run())
    arrivals = np.concatenate(arrivals_of(sim))
    for t, n in zip(res["sim_times"], res["interactions"], strict=True):
        assert n <= (arrivals <= t).sum()  # never ahead of the log
        assert n >= (arrivals <= t - 1.0).sum()  # and a second behind at most (0.01 s/query)
    assert res["replay"]["holds"] > 0 and res["replay"]["empty_updates"] == 0
    assert res["replay"]["played"] == int((arrivals <= 100.0).sum())


def test_the_generated_sample_runs_the_shipped_scenario(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "make_aol_sample", ROOT / "tools/make_aol_sample.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    folder = tool.make_sample(tmp_path / "sample", users=12, queries=15, days=10, seed=3)
    lines = (folder / "letor.txt").read_text().count("\n")
    rows = len(read_metadata(folder / "metadata.csv").qids)
    assert lines == 20 * rows
    sc = load_scenario(
        ROOT / "scenarios/aol_replay.toml",
        [f'dataset.path="{folder}"', "federation.clients=6", "federation.rounds=20"],
    )
    import foltr_async.protocols.learner as pdgd_learner

    for name in ("sync", "fedbuff"):
        res = run(Simulation(sc.variants[name], 1, Observer()).run())
        assert res["replay"]["played"] > 0 and res["partition"]["train_queries"] > 0
        assert res["offline"]["ndcg@10"][-1] > 0
        # the replayed logs train on the batched path: the run one query at a time is this one
        paths = res["learner_interactions"]
        assert paths["batched"] == res["replay"]["played"] == sum(paths.values())
        with monkeypatch.context() as m:
            m.setattr(pdgd_learner, "train_pool", lambda ctx: None)
            one = run(Simulation(sc.variants[name], 1, Observer()).run())
        assert one["replay"] == res["replay"] and one["online"] == pytest.approx(res["online"])
        np.testing.assert_allclose(one["offline"]["ndcg@10"], res["offline"]["ndcg@10"], rtol=1e-9)


BAD = {
    "missing column": (
        lambda f: (f / "metadata.csv").write_text("qid,user,timestamp\n1,2,2006-03-01 00:00:00\n"),
        "metadata.csv:1: expected column(s) 'user_id' in the header",
    ),
    "bad timestamp": (
        lambda f: (f / "metadata.csv").write_text(
            (f / "metadata.csv").read_text().replace("2006-03-01 01:00:00", "yesterday")
        ),
        "metadata.csv:4: timestamp: expected 'YYYY-MM-DD HH:MM:SS', got 'yesterday'",
    ),
    "duplicate qid": (
        lambda f: (f / "metadata.csv").write_text(
            (f / "metadata.csv").read_text().replace("\n2,10,", "\n1,10,")
        ),
        "metadata.csv:4: qid 1 appears twice (first at line 3)",
    ),
    "qid without lines": (
        lambda f: write_release(f, LOG, letor_for=[q for q, _, _ in LOG if q != 5]),
        "letor.txt: no lines for qid 5 (",
    ),
    "label beyond a click": (
        lambda f: (f / "letor.txt").write_text("2" + (f / "letor.txt").read_text()[1:]),
        "letor.txt:1: expected label 0 or 1",
    ),
    "bad letor line": (
        lambda f: (f / "letor.txt").write_text((f / "letor.txt").read_text() + "0 qid:3 104:1\n"),
        "letor.txt:341: feature id 104 exceeds n_features=103",
    ),
    "too few users": (lambda f: None, "4 users have at least 1 queries"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_release_is_one_line_naming_file_and_line(tmp_path, capsys, case):
    folder = write_release(tmp_path / "aol", LOG)
    damage, message = BAD[case]
    damage(folder)
    clients = 5 if case == "too few users" else 4
    path = scenario(tmp_path, folder, clients=clients)
    code = cli.main(["validate", "--build", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0] and str(folder) in lines[0], lines[0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("[federation.partition]\niid = true", "federation.partition: expected no table"),
        ("", "does not replay logged queries"),
        # an empty update carries no noise share: the round's noise would not be the Laplace
        # the accounting states
        ("dp", "federation.params.dp: expected false"),
    ],
)
def test_replay_refuses_what_it_cannot_honour(tmp_path, capsys, release, extra, message):
    path = scenario(tmp_path, release)
    text = path.read_text()
    if extra == "dp":
        text = text.replace("{ lr = 0.1 }", "{ lr = 0.1, dp = true }")
        text = text.split("[variants.fedbuff]")[0]
    elif extra:
        text = text.replace("[evaluation]", extra + "\n\n[evaluation]")
    else:
        text = text.replace('protocol = "fpdgd"', 'protocol = "foltr_es"')
        text = text.split("[variants.sync]")[0]
    path.write_text(text)
    code = cli.main(["validate", "--build", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err, err


def test_a_pick_of_some_users_reads_only_their_lines(release):
    every = load_aol(release, 4, normalise=False, cache=False)
    two = load_aol(release, 2, select="most_active", normalise=False, cache=False)
    assert [u.user for u in two.users] == [10, 20]  # 6 and 5 logged queries
    theirs = [q for q, user, _ in LOG if user in (10, 20)]  # already in logged order
    n_train = int(len(theirs) * 0.8)
    assert two.train.qids.tolist() == [str(q) for q in theirs[:n_train]]
    assert two.test.qids.tolist() == [str(q) for q in theirs[n_train:]]
    rows = {q: every.train.features[20 * i : 20 * i + 20] for i, q in enumerate(range(13))}
    for i, q in enumerate(theirs[:n_train]):
        np.testing.assert_array_equal(two.train.features[20 * i : 20 * i + 20], rows[q])


def test_a_replayed_log_over_zeromq_is_one_line_before_anything_starts(tmp_path, capsys, release):
    """Its users' queries arrive by one run's simulated clock, which another process does not
    share: refused at the start, with no worker launched and no results file."""
    out = tmp_path / "out"
    code = cli.main(
        ["--quiet", str(scenario(tmp_path, release)), "--transport", "zmq", "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "[variant sync]: dataset.format: 'aol4foltr'" in err and "ZeroMQ" in err, err
    assert not (out / "results.json").exists() and not (out / "workers").exists()


def test_later_loads_map_the_store_and_the_cached_metadata(release, monkeypatch, request):
    from foltr_async.ltr import aol

    first = load_aol(release, 3, seed=2)
    conversions = request.getfixturevalue("conversions")  # counting from here
    reads = []
    real_read = aol.read_metadata
    monkeypatch.setattr(aol, "read_metadata", lambda p: reads.append(p) or real_read(p))
    again = load_aol(release, 3, seed=2)
    other = load_aol(release, 4, select="most_active", normalise=False)
    assert conversions == [] and reads == []  # neither file is read as text again
    uncached = load_aol(release, 3, seed=2, cache=False)
    for a, b in ((first, again), (first, uncached)):
        np.testing.assert_array_equal(a.train.features, b.train.features)
        np.testing.assert_array_equal(a.test.labels, b.test.labels)
        assert [u.user for u in a.users] == [u.user for u in b.users]
    assert other.train.n_queries + other.test.n_queries == len(LOG)

    (release / "metadata.csv").write_text((release / "metadata.csv").read_text() + "\n")
    load_aol(release, 3, seed=2)
    assert len(reads) == 2  # cache=False, then the edited file


def test_dataset_convert_makes_the_stores_a_run_maps(release, tmp_path, capsys):
    letor = tmp_path / "fold" / "train.txt"
    letor.parent.mkdir()
    letor.write_text("2 qid:a 1:0.5 3:1\n0 qid:a 1:0.25\n1 qid:b 2:3\n")
    (letor.parent / "test.txt").write_text("1 qid:c 1:1\n")
    assert cli.main(["dataset", "convert", "--aol", str(letor.parent)]) == 2
    assert "an AOL4FOLTR folder holds" in capsys.readouterr().err  # --aol: paths are releases
    assert cli.main(["dataset", "convert", str(letor.parent)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "train.txt: 2 queries, 3 documents x 3 features" in out[0]
    assert cli.main(["dataset", "convert", "--aol", str(release)]) == 0
    out = capsys.readouterr().out
    assert f"{len(LOG)} queries" in out and "4 users" in out
