"""FLGo's system models (``[network.flgo]``): the keys, our draws against FLGo 0.4.4's formulas
at fixed seeds, and what they do to synchronous and asynchronous runs."""

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.rng import stream
from foltr_async.runtime.clock import run
from foltr_async.runtime.flgo import FlgoClient, FlgoModels, FlgoSystem, sln_factor, yc_window
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation


def system(table, clients, test_labels=(0, 1, 2), seed=0):
    return FlgoSystem(
        FlgoModels.from_dict(table), clients, test_labels, lambda *p: stream(seed, *p)
    )


def population(n, size=10, labels=(0, 1, 2), batch=4):
    return [FlgoClient(f"client-{i:04d}", size, frozenset(labels), batch) for i in range(n)]


def frequencies(sys, rounds, ids):
    """Per round, which of ``ids`` FLGo's availability leaves online (rows: rounds)."""
    out = []
    for r in rounds:
        on = sys.available(r, set(ids))
        out.append([a in on for a in ids])
    return np.array(out)


# ---------------------------------------------------------------------- keys


def test_defaults_are_flgos_and_parameters_belong_to_their_mode():
    m = FlgoModels.from_dict({"availability": "SLN", "responsiveness": "LN"})
    assert m.params["availability"] == {"beta": 0.1}
    assert m.params["responsiveness"] == {"mean_latency": 100.0, "var_latency": 10.0}
    assert m.modes == {
        "availability": "SLN",
        "connectivity": "IDL",
        "completeness": "IDL",
        "responsiveness": "LN",
    }
    assert FlgoModels.from_dict({"availability": "YC", "availability_beta": 0.3}).param(
        "availability", "beta"
    ) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('availability = "sln"', "got 'sln' (did you mean 'SLN'?)"),
        ('availability = "SNL"', "(did you mean 'SLN'?)"),
        ("availabilty_beta = 0.3", "availabilty_beta: unknown key (did you mean"),
        ('availability = "IDL"\navailability_beta = 0.3', "not a parameter of availability IDL"),
        ('completeness = "ADU"', "ADU and ASU draw local epochs"),
        ("connectivity_gamma = 2.0", "connectivity_gamma: expected a finite number in [0.0, 1.0]"),
        ('availability = "LN"\navailability_beta = 1.0', "expected a number < 0.999999 for LN"),
        (
            'responsiveness = "UNI"\n'
            "responsiveness_min_latency = 3\nresponsiveness_max_latency = 3",
            "responsiveness_max_latency: expected an integer > responsiveness_min_latency",
        ),
        ("time_unit = 0.0", "time_unit: expected a finite number >= 1e-09"),
    ],
)
def test_bad_flgo_keys_are_one_line_errors_naming_the_file(tmp_path, line, message):
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[federation]\nprotocol = "fpdgd"\n[network.flgo]\n{line}\n')
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario)
    text = str(err.value)
    assert text.startswith(f"{scenario}: network.flgo: ") and message in text
    assert "\n" not in text


# ---------------------------------------------------------------------- availability formulas


def test_static_availability_modes_follow_flgos_formulas():
    mixed = [
        FlgoClient("client-0000", 8, frozenset({0}), 4),
        FlgoClient("client-0001", 2, frozenset({1, 2}), 4),
        FlgoClient("client-0002", 4, frozenset({0, 1, 2}), 4),
    ]
    b = 0.4

    def probs(mode):
        table = {"availability": mode} | ({"availability_beta": b} if mode != "IDL" else {})
        return system(table, mixed).prob_available(1)

    # YMF: beta * min(labels_i) / max(1, label_num - 1) + (1 - beta), 3 test labels
    np.testing.assert_allclose(probs("YMF"), [0.6, b * 1 / 2 + 0.6, 0.6])
    # YFF: beta * |labels_i| / label_num + (1 - beta)
    np.testing.assert_allclose(probs("YFF"), [b / 3 + 0.6, 2 * b / 3 + 0.6, 1.0])
    # MDF: |D_i|^beta / max;  LDF: |D_i|^-beta / max
    np.testing.assert_allclose(probs("MDF"), np.array([8, 2, 4]) ** b / 8**b)
    np.testing.assert_allclose(probs("LDF"), np.array([8, 2, 4]) ** -b / 2**-b)
    np.testing.assert_allclose(probs("HOMO"), [0.6] * 3)
    np.testing.assert_allclose(probs("IDL"), [1.0] * 3)


def test_homo_availability_is_one_draw_per_client_and_round():
    ids = [f"client-{i:04d}" for i in range(200)]
    sys = system({"availability": "HOMO", "availability_beta": 0.3}, population(200))
    on = frequencies(sys, range(1, 101), ids)
    assert on.mean() == pytest.approx(0.7, abs=0.01)
    # memoryless: P(online | online last round) equals P(online)
    assert on[1:][on[:-1]].mean() == pytest.approx(0.7, abs=0.015)
    assert sys.counts["offline"] == (~on).sum()
    again = system({"availability": "HOMO", "availability_beta": 0.3}, population(200))
    assert (frequencies(again, range(1, 101), ids) == on).all()  # fixed seed: same draws


def test_ln_availability_is_lognormal_over_its_maximum():
    beta = 0.3
    sys = system({"availability": "LN", "availability_beta": beta}, population(20000))
    q = sys.prob_available(1)
    assert q.max() == 1.0 and (q > 0).all()
    # log T_k ~ N(0, sigma^2), sigma = -ln(1 - beta - 1e-6); q = T_k / max T_k
    logs = np.log(q) - np.log(q).mean()
    assert logs.std() == pytest.approx(-np.log(1 - beta - 1e-6), rel=0.02)
    assert (sys.prob_available(7) == q).all()  # LN does not vary with time


def test_sln_availability_follows_the_sine_of_flgo_round_by_round():
    fts = 0.4 * np.sin(np.linspace(0, 2 * np.pi, 24)) + 0.5
    assert [sln_factor(t) for t in range(48)] == pytest.approx(list(fts) * 2)
    assert sln_factor(0) == pytest.approx(0.5) and sln_factor(23) == pytest.approx(0.5)
    n = 400
    ids = [f"client-{i:04d}" for i in range(n)]
    sys = system({"availability": "SLN", "availability_beta": 0.5}, population(n))
    q = sys.prob_available(0) / 0.5
    for t in (1, 6, 12, 18):
        np.testing.assert_allclose(sys.prob_available(t), fts[t] * q)
    # empirical per-client-and-phase frequencies over 40 cycles of 24 rounds
    on = frequencies(sys, range(1, 24 * 40 + 1), ids).reshape(40, 24, n)
    expect = np.outer(fts[np.arange(1, 25) % 24], q)
    assert np.abs(on.mean(axis=(0, 2)) - expect.mean(axis=1)).max() < 0.02  # per phase
    assert np.abs(on.mean(axis=(0, 1)) - expect.mean(axis=0)).max() < 0.07  # per client


def test_yc_availability_cycles_with_each_clients_label_range():
    clients = [
        FlgoClient("client-0000", 5, frozenset({0, 1, 2}), 4),  # window [0, 1]: always
        FlgoClient("client-0001", 5, frozenset({0, 1}), 4),  # [0, 1/2]
        FlgoClient("client-0002", 5, frozenset({1, 2}), 4),  # [1/2, 1]
        FlgoClient("client-0003", 5, frozenset({0}), 4),  # [0, 0]: never in the window
    ]
    beta = 0.8
    sys = system({"availability": "YC", "availability_beta": beta}, clients)
    for t in range(48):
        r = (1 + t % 24) / 24
        ic = [1, r <= 0.5, r >= 0.5, 0]
        np.testing.assert_allclose(sys.prob_available(t), beta * np.array(ic, float) + 1 - beta)
    lo, hi = np.array([0, 0]), np.array([1, 2])
    assert yc_window(11, lo, hi, 2).tolist() == [True, True]  # r = 12/24 = 1/2
    assert yc_window(12, lo, hi, 2).tolist() == [False, True]
    ids = [c.id for c in clients]
    on = frequencies(sys, range(1, 24 * 200 + 1), ids).reshape(200, 24, 4).mean(axis=0)
    expect = np.array([sys.prob_available(t) for t in range(1, 25)])
    assert np.abs(on - expect).max() < 0.12  # 200 draws per (phase, client)
    assert (on[expect == 1.0] == 1.0).all()  # in the window: always idle


# ---------------------------------------------------------------------- the other models


def test_connectivity_draws_follow_homo_and_uni():
    n = 20000
    uni = system({"connectivity": "UNI", "connectivity_gamma": 0.3}, population(n))
    nonzero = uni.prob_drop[uni.prob_drop > 0]
    assert nonzero.size / n == pytest.approx(0.3, abs=0.01)  # rand() < gamma
    assert nonzero.mean() == pytest.approx(0.5, abs=0.01)  # then uniform(0, 1)
    homo = system({"connectivity": "HOMO", "connectivity_gamma": 0.25}, population(n))
    ids = [f"client-{i:04d}" for i in range(n)]
    homo.dispatched(ids, 3)
    assert len(homo._dropped) / n == pytest.approx(0.25, abs=0.01)
    assert set(homo._dropped.values()) == {3}


def test_responsiveness_latencies_follow_ln_and_uni():
    n = 50000
    ln = system(
        {
            "responsiveness": "LN",
            "responsiveness_mean_latency": 30.0,
            "responsiveness_var_latency": 40.0,
        },
        population(n),
    ).latency
    assert ln.dtype.kind == "i"
    # int() truncates a lognormal of mean 30 and variance 40: mean about 29.5, var 40 + 1/12
    assert ln.mean() == pytest.approx(29.5, abs=0.1)
    assert ln.var() == pytest.approx(40.0 + 1 / 12, rel=0.05)
    uni = system(
        {"responsiveness": "UNI", "responsiveness_min_latency": 2, "responsiveness_max_latency": 6},
        population(n),
    ).latency
    assert set(uni.tolist()) == {2, 3, 4, 5}  # randint excludes its upper bound
    assert np.bincount(uni)[2:] / n == pytest.approx([0.25] * 4, abs=0.01)


def test_completeness_fractions_follow_pdu_and_fsu():
    n, batch = 4000, 4
    pdu = system({"completeness": "PDU", "completeness_p": 0.6}, population(n, batch=batch))
    amounts = np.array([pdu.work("client-0007", batch) for _ in range(n)])
    # with p: max(1, randint(0, 4)) -> 1 (2/4), 2, 3 (1/4 each); else all 4
    expect = [0.6 * 0.5, 0.6 * 0.25, 0.6 * 0.25, 0.4]
    assert np.bincount(amounts, minlength=5)[1:] / n == pytest.approx(expect, abs=0.02)
    assert pdu.counts["skipped_interactions"] == (batch - amounts).sum()
    assert pdu.counts["incomplete"] == (amounts < batch).sum()
    fsu = system({"completeness": "FSU"}, population(n, batch=10))
    static = np.array([fsu.work(f"client-{i:04d}", 10) for i in range(n)])
    assert [fsu.work(f"client-{i:04d}", 10) for i in range(5)] == static[:5].tolist()
    # max(1, int(10 U)): 1 with probability 0.2, 2..9 with 0.1 each
    hist = np.bincount(static, minlength=10)[1:] / n
    assert hist == pytest.approx([0.2] + [0.1] * 8, abs=0.02)


# ---------------------------------------------------------------------- runs

SCENARIO = """
[scenario]
seed = 3
[dataset]
n_queries = 60
[federation]
protocol = "fpdgd"
clients = 6
queries_per_client = 4
rounds = 8
deadline = 10.0
params = { compute_time = 0.5 }
[evaluation]
every = 8
"""


def simulate(tmp_path, flgo: str, extra: str = ""):
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO + extra + "[network.flgo]\n" + flgo + "\n")
    cfg = load_scenario(scenario).variants["default"]
    return run(Simulation(cfg, 3, Observer()).run())


def test_dropped_replies_leave_the_round_and_are_counted(tmp_path):
    res = simulate(tmp_path, 'connectivity = "HOMO"\nconnectivity_gamma = 0.5')
    lost = res["flgo"]["dropped"]
    assert 0 < lost < 48
    assert sum(res["contributions"]["per_round"]) == 6 * 8 - lost
    # a round that lost a reply waits its deadline: 8 rounds of 10 s at least one of them
    assert res["sim_s"] > 2.0 * 8


def test_latencies_delay_replies_and_overdue_ones_are_dropped(tmp_path):
    base = simulate(tmp_path, "")
    slow = 'responsiveness = "UNI"\nresponsiveness_min_latency = 3\nresponsiveness_max_latency = 4'
    in_time = simulate(tmp_path, slow + "\ntime_unit = 2.0")  # 6 s after 2 s of training
    assert in_time["sim_s"] == pytest.approx(base["sim_s"] + 8 * 6.0, abs=1.0)
    assert in_time["flgo"]["overdue"] == 0
    assert in_time["contributions"]["per_round"] == base["contributions"]["per_round"]
    late = simulate(tmp_path, slow + "\ntime_unit = 4.0")  # 12 s > the 10 s deadline
    assert late["flgo"]["overdue"] == 6 * 8
    assert late["contributions"]["empty_rounds"] == 8 and late["late_replies"] == 0


def test_incomplete_trainings_serve_and_count_fewer_interactions(tmp_path):
    full = simulate(tmp_path, "")
    part = simulate(tmp_path, 'completeness = "PDU"\ncompleteness_p = 0.5')
    skipped = part["flgo"]["skipped_interactions"]
    assert full["online"]["interactions"] == 6 * 8 * 4
    assert skipped > 0 and part["online"]["interactions"] == 6 * 8 * 4 - skipped
    assert part["flgo"]["incomplete"] > 0


def test_availability_takes_clients_out_of_sync_and_async_runs(tmp_path):
    never = simulate(tmp_path, 'availability = "HOMO"\navailability_beta = 1.0')
    assert never["flgo"]["offline"] == 6 * 8
    assert never["contributions"]["empty_rounds"] == 8
    scenario = tmp_path / "a.toml"
    scenario.write_text(
        SCENARIO.replace('"fpdgd"', '"fpdgd_async"').replace(
            "compute_time = 0.5", 'compute_time = 0.5, mode = "fedbuff", buffer = 2, period = 5.0'
        )
        + '[network.flgo]\navailability = "SLN"\navailability_beta = 0.5\n'
        + 'connectivity = "HOMO"\nconnectivity_gamma = 0.2\n'
    )
    cfg = load_scenario(scenario).variants["default"]
    res = run(Simulation(cfg, 3, Observer()).run())
    assert res["flgo"]["offline"] > 0 and res["flgo"]["dropped"] > 0
    assert res["staleness"]["updates"] > 0


# ---------------------------------------------------------------------- FLGo itself


def _flgo_simulator():
    """FLGo 0.4.4's own mode functions and BasicSimulator (it imports torch)."""
    pytest.importorskip("flgo", reason="flgo is not installed (pip install flgo; needs torch)")
    try:
        from flgo.simulator import default_simulator as ds
        from flgo.simulator.base import BasicSimulator
    except ImportError as e:  # flgo installed without its torch
        pytest.skip(f"flgo's simulator does not import: {e}")
    return ds, BasicSimulator


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _flgo_world(BasicSimulator, clients, test_labels):
    """FLGo clients whose samples carry our clients' labels (one sample per labelled row)."""

    def data(c):
        labels = sorted(c.labels)
        return [(0.0, labels[i % len(labels)]) for i in range(c.size)]

    fl = [
        _Obj(id=i, num_steps=c.batch, train_data=data(c), val_data=[])
        for i, c in enumerate(clients)
    ]
    server = _Obj(clients=fl, test_data=[(0.0, y) for y in test_labels], current_round=1)
    return BasicSimulator([server, *fl]), server


def test_flgo_itself_draws_what_we_draw():
    ds, BasicSimulator = _flgo_simulator()
    from scipy import stats

    clients = [
        FlgoClient(f"client-{i:04d}", 3 + i % 7, frozenset(range(1 + i % 3)), 4)
        for i in range(3000)
    ]
    labels = (0, 1, 2)
    # deterministic modes: equal values
    for mode, fn in (("YFF", ds.y_fewer_first_client_availability), ("HOMO", None)):
        sim, _ = _flgo_world(BasicSimulator, clients, labels)
        if fn is None:
            ds.homogeneous_client_availability(sim, 0.3)
        else:
            fn(sim, 0.3)
        ours = system({"availability": mode, "availability_beta": 0.3}, clients, labels)
        np.testing.assert_allclose(sim.get_variable(sim.all_clients, "prob_available"), ours.base)
    for mode, fn in (
        ("YMF", ds.y_max_first_client_availability),
        ("MDF", ds.more_data_first_client_availability),
        ("LDF", ds.less_data_first_client_availability),
    ):
        sim, _ = _flgo_world(BasicSimulator, clients, labels)
        fn(sim, 0.3)
        ours = system({"availability": mode, "availability_beta": 0.3}, clients, labels)
        np.testing.assert_allclose(sim.get_variable(sim.all_clients, "prob_available"), ours.base)
    sim, server = _flgo_world(BasicSimulator, clients, labels)
    f = ds.y_cycle_client_availability(sim, 0.6)
    # FLGo 0.4.4's YC update iterates ``self.clients``, a dict of ids: as a list (ids are the
    # positions) its loop reads the clients and set_variable still finds them
    sim.clients = sim.get_clients()
    ours = system({"availability": "YC", "availability_beta": 0.6}, clients, labels)
    for t in range(1, 30):
        server.current_round = t
        f(sim)
        np.testing.assert_allclose(
            sim.get_variable(sim.all_clients, "prob_available"), ours.prob_available(t)
        )
    # random modes: same distributions (FLGo draws from numpy's global RandomState)
    np.random.seed(21)
    sim, server = _flgo_world(BasicSimulator, clients, labels)
    f = ds.sin_lognormal_client_availability(sim, 0.4)
    ours = system({"availability": "SLN", "availability_beta": 0.4}, clients, labels)
    first = None
    for t in (1, 5, 17):
        server.current_round = t
        f(sim)
        theirs = np.array(sim.get_variable(sim.all_clients, "prob_available"))
        first = theirs if first is None else first
        # the same time factor exactly; T_k / max T_k alike once the (random) max is taken out
        np.testing.assert_allclose(theirs / first, ours.prob_available(t) / ours.prob_available(1))
        a, b = np.log(theirs), np.log(ours.prob_available(t))
        assert stats.ks_2samp(a - a.mean(), b - b.mean()).pvalue > 1e-3
    sim, _ = _flgo_world(BasicSimulator, clients, labels)
    ds.lognormal_client_responsiveness(sim, 30, 40)
    ours = system(
        {
            "responsiveness": "LN",
            "responsiveness_mean_latency": 30.0,
            "responsiveness_var_latency": 40.0,
        },
        clients,
        labels,
    )
    theirs = np.array(sim.get_variable(sim.all_clients, "latency"))
    assert stats.ks_2samp(theirs, ours.latency).pvalue > 1e-3
    sim, _ = _flgo_world(BasicSimulator, clients, labels)
    ds.full_static_unifrom_client_completeness(sim)
    ours = system({"completeness": "FSU"}, clients, labels)
    theirs = np.array(sim.get_variable(sim.all_clients, "working_amount"))
    assert np.bincount(theirs, minlength=5) / len(clients) == pytest.approx(
        np.bincount(ours.working_amount, minlength=5) / len(clients), abs=0.04
    )
    sim, _ = _flgo_world(BasicSimulator, clients, labels)
    f = ds.part_dynamic_uniform_client_completeness(sim, 0.6)
    f(sim, sim.all_clients)  # one draw per client (FLGo then keeps it as the client's num_steps)
    theirs = np.array(sim.get_variable(sim.all_clients, "working_amount"))
    ours = system({"completeness": "PDU", "completeness_p": 0.6}, clients, labels)
    mine = np.array([ours.work(c.id, 4) for c in clients])
    assert np.bincount(theirs, minlength=5) / len(clients) == pytest.approx(
        np.bincount(mine, minlength=5) / len(clients), abs=0.04
    )
    sim, _ = _flgo_world(BasicSimulator, clients, labels)
    ds.uniform_client_connectivity(sim, 0.3)
    theirs = np.array(sim.get_variable(sim.all_clients, "prob_drop"))
    ours = system({"connectivity": "UNI", "connectivity_gamma": 0.3}, clients, labels).prob_drop
    assert (theirs > 0).mean() == pytest.approx((ours > 0).mean(), abs=0.04)
    assert stats.ks_2samp(theirs[theirs > 0], ours[ours > 0]).pvalue > 1e-3


def test_a_run_with_flgo_models_resumes_to_the_uninterrupted_result(tmp_path):
    from foltr_async.experiment import run_scenario
    from tests.test_resume import StopAt, comparable

    scenario = tmp_path / "s.toml"
    scenario.write_text(
        SCENARIO.replace("rounds = 8", "rounds = 12")
        + '[network.flgo]\navailability = "SLN"\navailability_beta = 0.3\n'
        + 'connectivity = "HOMO"\nconnectivity_gamma = 0.2\ncompleteness = "PDU"\n'
        + 'responsiveness = "UNI"\nresponsiveness_min_latency = 0\n'
        + "responsiveness_max_latency = 15\n"
    )
    sc = load_scenario(scenario)
    full = run_scenario(sc, tmp_path / "full", Observer())
    with pytest.raises(KeyboardInterrupt):
        run_scenario(sc, tmp_path / "cut", StopAt("default", 0, 7), checkpoint_every=3)
    resumed = run_scenario(sc, tmp_path / "cut", Observer(), resume=True)
    flgo = resumed["variants"]["default"]["repeats"][0]["flgo"]
    assert min(flgo[k] for k in ("offline", "dropped", "overdue", "incomplete")) > 0
    assert comparable(resumed) == comparable(full)


def test_completeness_is_refused_for_a_protocol_that_cannot_cut_its_work(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        SCENARIO.replace('"fpdgd"', '"foltr_es"').replace("params = { compute_time = 0.5 }\n", "")
        + '[network.flgo]\ncompleteness = "PDU"\n'
    )
    from foltr_async.preflight import check_scenario

    with pytest.raises(ScenarioError, match="network.flgo.completeness: expected 'IDL' for"):
        check_scenario(load_scenario(scenario))
