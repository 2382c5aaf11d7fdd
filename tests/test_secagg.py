"""Secure aggregation: the primitives, then each protocol step on the real bus with vector clients
(fast: no learning to rank), including dropouts, below-threshold failures and what one masked
upload tells an eavesdropper or the server."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foltr_async.protocols.eavesdrop import cosine
from foltr_async.protocols.secagg import messages
from foltr_async.protocols.secagg.measurement import (
    BENCH_UPDATE,
    cost,
    plaintext_mean,
    relative_error,
    vector_rounds,
)
from foltr_async.protocols.secagg.primitives import (
    PRIME,
    from_ring,
    harary,
    prg,
    shamir_combine,
    shamir_split,
    threshold_of,
    to_ring,
)
from foltr_async.runtime.clock import run
from foltr_async.runtime.secure import SecureAggregationError, Summable
from foltr_async.runtime.wire import Envelope, decode

# --------------------------------------------------------------------------- primitives


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(0, 8), st.integers(0, 2**16 - 1), st.randoms())
def test_any_threshold_shares_rebuild_the_secret(t, extra, value, rnd):
    n = t + extra
    rng = np.random.default_rng(rnd.getrandbits(32))
    secret = np.array([value, 0, 2**16 - 1, rnd.getrandbits(16)])
    shares = shamir_split(secret, t, n, rng)
    assert shares.shape == (n, 1 + secret.size) and shares.dtype == np.uint32
    subset = shares[rng.permutation(n)[:t]]
    assert np.array_equal(shamir_combine(subset, t), secret)


def test_fewer_shares_than_the_threshold_are_refused_and_say_nothing():
    rng = np.random.default_rng(0)
    shares = shamir_split(np.array([7]), 3, 5, rng)
    with pytest.raises(SecureAggregationError, match="2 distinct shares, threshold 3"):
        shamir_combine(np.vstack([shares[:2], shares[:2]]), 3)  # duplicates count once
    # t - 1 = 1 share of a 2-out-of-n sharing is uniform over the field whatever the secret
    for secret in (0, 2**16 - 1):
        ys = np.array([shamir_split(np.array([secret]), 2, 2, rng)[0, 1] for _ in range(4000)])
        assert abs(ys.mean() / PRIME - 0.5) < 0.02
        assert abs((ys < PRIME // 2).mean() - 0.5) < 0.03


def test_prg_is_a_deterministic_stream_per_seed():
    a, b = prg(b"a" * 32, 1000), prg(b"b" * 32, 1000)
    assert np.array_equal(a, prg(b"a" * 32, 1000)) and not np.array_equal(a, b)
    assert np.array_equal(prg(b"a" * 32, 10), a[:10])  # a prefix of the same keystream
    bits = np.unpackbits(a.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.01


def test_fixed_point_ring_sums_exactly_and_refuses_what_could_wrap():
    rng = np.random.default_rng(1)
    xs = rng.normal(scale=100.0, size=(50, 30))
    total = np.sum([to_ring(x, 32, 50) for x in xs], axis=0, dtype=np.uint64)
    assert np.allclose(from_ring(total, 32), xs.sum(axis=0), rtol=0, atol=50 * 2.0**-32)
    with pytest.raises(SecureAggregationError, match="outside the fixed-point range"):
        to_ring(np.array([2.0**31 / 4]), 32, 4)
    with pytest.raises(SecureAggregationError):
        to_ring(np.array([np.nan]), 32, 1)


def test_summable_view_is_weighted_vector_and_back():
    spec = Summable("k", "v", "w")
    x = spec.encode({"v": np.array([1.0, -2.0]), "w": 3})
    assert np.array_equal(x, [3.0, -6.0, 3.0])
    assert spec.decode(x + np.array([1.0, 0.0, 1.0]))["w"] == 4
    with pytest.raises(SecureAggregationError, match="total weight"):
        spec.decode(np.zeros(3))


def test_neighbour_graphs_are_symmetric_and_regular():
    ids = [f"c{i:02d}" for i in range(20)]
    rng = np.random.default_rng(2)
    full = harary(ids, 0, rng)
    assert all(len(v) == 19 and u not in v for u, v in full.items())
    for degree, k in ((4, 4), (5, 6)):  # odd degrees round up to the next even one
        g = harary(ids, degree, rng)
        assert all(len(v) == k for v in g.values())
        assert all(u in g[v] for u in ids for v in g[u])
    assert harary(ids[:5], 4, rng) == harary(ids[:5], 0, rng)  # k >= n - 1: complete
    assert [threshold_of(k, 0.5) for k in (1, 2, 9, 10)] == [1, 2, 5, 6]  # more than half
    assert threshold_of(10, 1.0) == 10


# --------------------------------------------------------------------------- protocol rounds


def play(clients=10, rounds=1, seed=0, dim=25, prepare=None, network=None, **settings):
    return run(
        vector_rounds(clients, dim, rounds, settings, seed, network=network, prepare=prepare)
    )


def silence(agent, kind):
    """This client ignores ``kind`` from now on (a process that died at that step)."""
    agent._handlers[kind] = (lambda env: None, False)


@pytest.mark.parametrize("degree", [0, 4])
def test_unmasked_sum_equals_plaintext_fedavg(degree):
    vr = play(clients=12, rounds=2, degree=degree)
    for rep in vr.reports:
        assert rep.aggregated and rep.replied == 12
        assert relative_error(vr, rep) < 1e-6
        facts = rep.facts["secure_aggregation"]
        assert facts["advertised"] == facts["shared"] == facts["masked"] == 12
    plain = run(vector_rounds(12, 25, 2, None, 0))  # the same inputs without masking
    for r in (1, 2):
        assert np.allclose(vr.strategy.means[r], plain.strategy.means[r], rtol=1e-6, atol=0)


def test_thirty_percent_dropping_after_key_sharing_still_completes():
    taps = []

    def prepare(vr):
        for aid in ("client-0001", "client-0004", "client-0008"):
            vr.halves()[aid].dropout = 1.0  # shares its keys, then its upload fails
        vr.bus.tap(lambda data, h: taps.append(decode(data)), kinds=messages.REVEAL)

    vr = play(clients=10, prepare=prepare)
    rep = vr.reports[0]
    facts = rep.facts["secure_aggregation"]
    assert rep.aggregated and facts["shared"] == 10 and facts["dropped"] == 3
    assert sorted(rep.clients) == sorted(
        set(vr.agents) - {"client-0001", "client-0004", "client-0008"}
    )
    assert relative_error(vr, rep) < 1e-6  # the 7 survivors' FedAvg, exactly
    assert vr.secure.server.totals["keys_rebuilt"] == 3
    # no client ever reveals both secrets of one neighbour: b-shares of survivors only,
    # mask-key shares of the dropped only
    b_owners = {o for env in taps for o in env.body["b_of"]}
    sk_owners = {o for env in taps for o in env.body["sk_of"]}
    assert sk_owners == {"client-0001", "client-0004", "client-0008"}
    assert b_owners == set(rep.clients) and not b_owners & sk_owners


def test_below_threshold_the_round_fails_with_a_clear_error_and_the_next_one_works():
    def prepare(vr):
        for i in range(5):  # 5 of 10 drop: survivors have 4 surviving neighbours, need 5
            vr.halves()[f"client-{i:04d}"].dropout = 1.0

    def recover(vr):
        prepare(vr)

        async def before(r):  # from round 2 on, nobody drops
            if r == 2:
                for half in vr.halves().values():
                    half.dropout = 0.0

        vr.server._before_round = before

    vr = play(clients=10, rounds=2, prepare=recover)
    first, second = vr.reports
    assert not first.aggregated and 1 not in vr.strategy.means
    assert first.facts["secure_aggregation"]["error"] == (
        "round 1: 5 of 10 clients dropped after sharing keys; client-0005 has 4 surviving "
        "neighbours, threshold 5"
    )
    assert vr.secure.server.failures == [
        {"round": 1, "error": first.facts["secure_aggregation"]["error"][len("round 1: ") :]}
    ]
    assert second.aggregated and relative_error(vr, second) < 1e-6


def test_clients_that_miss_a_setup_step_are_left_out_and_the_rest_aggregate():
    def prepare(vr):
        silence(vr.agents["client-0002"], messages.ADVERTISE)  # never advertises keys
        silence(vr.agents["client-0005"], messages.ROSTER)  # advertises, never shares

    vr = play(clients=8, prepare=prepare)
    rep = vr.reports[0]
    facts = rep.facts["secure_aggregation"]
    assert (facts["selected"], facts["advertised"], facts["shared"]) == (8, 7, 6)
    assert rep.aggregated and "client-0002" not in rep.clients and "client-0005" not in rep.clients
    assert relative_error(vr, rep) < 1e-6
    # neither of them was sent the model, so neither trained
    assert all(c not in {k[1] for k in vr.truth} for c in ("client-0002", "client-0005"))


def test_unmask_tolerates_silent_survivors_up_to_the_threshold():
    def few(vr):
        for aid in ("client-0000", "client-0003"):
            silence(vr.agents[aid], messages.UNMASK)  # uploaded, then gone before unmasking

    vr = play(clients=8, prepare=few)
    rep = vr.reports[0]
    assert rep.aggregated and len(rep.clients) == 8 and relative_error(vr, rep) < 1e-6
    assert rep.facts["secure_aggregation"]["revealed"] == 6

    def many(vr):
        for i in range(4):
            silence(vr.agents[f"client-{i:04d}"], messages.UNMASK)

    vr = play(clients=8, prepare=many)
    rep = vr.reports[0]
    assert not rep.aggregated
    assert rep.facts["secure_aggregation"]["error"] == (
        "round 1: client-0004's self-mask seed: 3 shares arrived, threshold 4"  # 0-3 are silent
    )


def test_a_client_refuses_to_unmask_when_told_too_few_neighbours_survived():
    vr = play(clients=6)
    agent = vr.agents["client-0000"]
    st = agent.secure.state
    assert st.sent and st.revealed and st.threshold == 3
    sent = []
    agent.send = lambda *a: sent.append(a)
    st.revealed = False
    handle, _ = agent._handlers[messages.UNMASK]  # the agent's own table reaches its half

    def unmask(survivors):
        handle(Envelope(messages.UNMASK, st.server, agent.id, {"survivors": survivors}, st.round))

    unmask(st.u2[:2])  # 2 survivors < threshold 3: nothing revealed
    assert not sent and agent.counters["secagg_refused"] == 1
    unmask(["client-9999"])  # not a neighbour that shared
    assert not sent and agent.counters["secagg_bad_unmask"] == 1
    unmask(st.u2)
    ((dst, kind, body, _),) = sent
    assert kind == messages.REVEAL and body["b_of"] == st.u2 and body["sk_of"] == []
    unmask([])
    assert len(sent) == 1  # never a second answer in one round


def test_a_client_half_is_plain_state_that_survives_a_checkpoint():
    from foltr_async.runtime.checkpoint import dumps, loads

    vr = play(clients=4)
    agent = vr.agents["client-0001"]
    copy = loads(dumps(agent.secure, {}), {})  # plain data: no key objects, no agent reference
    assert copy.state.s_raw == agent.secure.state.s_raw and copy.state.sent
    agent.secure = copy  # a restored half takes over the agent's handlers and replies
    sent = []
    agent.send = lambda *a: sent.append(a)
    handle, _ = agent._handlers[messages.ADVERTISE]
    handle(Envelope(messages.ADVERTISE, "server", agent.id, {}, 2))
    assert copy.state.round == 2 and sent[0][1] == messages.KEYS


def test_one_masked_upload_tells_an_eavesdropper_nothing():
    seen: list[tuple[int, str, np.ndarray]] = []

    def tap(vr):
        def on(data, header):
            seen.append((header.round, header.src, decode(data).body))

        vr.bus.tap(on, kinds=(messages.MASKED, BENCH_UPDATE))

    masked = play(clients=10, rounds=4, dim=137, prepare=tap)
    cos_masked = []
    for r, src, body in seen:
        vector, weight = masked.truth[r, src]
        guess = from_ring(body["y"], 32)[:-1] / weight  # the plaintext would read w * vector
        cos_masked.append(cosine(guess, vector))
    seen.clear()
    plain = run(vector_rounds(10, 137, 4, None, 0, prepare=tap))
    cos_plain = [cosine(body["vector"], plain.truth[r, src][0]) for r, src, body in seen]
    assert len(cos_masked) == len(cos_plain) == 40
    assert abs(np.mean(cos_masked)) < 0.05 and np.std(cos_masked) < 0.15  # ~N(0, 1/137)
    assert np.mean(cos_plain) == pytest.approx(1.0)
    # and the aggregate the server unmasks is still the true FedAvg
    assert all(relative_error(masked, rep) < 1e-6 for rep in masked.reports)


def test_message_and_byte_cost_per_round():
    vr = play(clients=10, rounds=2)
    plain = run(vector_rounds(10, 25, 2, None, 0))
    # advertise, keys, roster, shares, relay, model, masked, unmask, reveal: 9 per client
    assert vr.bus.stats.sent == 9 * 10 * 2 and plain.bus.stats.sent == 2 * 10 * 2
    kinds = vr.bus.stats.kinds
    assert kinds[messages.SHARES].bytes_sent > 10 * 2 * 9 * messages.CT_LEN  # 9 ciphertexts each
    sparse = play(clients=30, rounds=1, degree=6)
    full = play(clients=30, rounds=1)
    per = {
        name: r.bus.stats.kinds[messages.SHARES].bytes_sent
        for name, r in (("sparse", sparse), ("full", full))
    }
    assert per["sparse"] < per["full"] / 3  # 6 neighbours instead of 29


def test_cost_reports_per_round_numbers():
    out = cost(8, dim=10, rounds=1)
    assert out["completed_rounds"] == 1 and out["messages_per_round"] == 72
    assert out["max_rel_error"] < 1e-6 and out["bytes_per_client_round"] > 0
    plain = cost(8, dim=10, rounds=1, secure=False)
    assert plain["messages_per_round"] == 16 and plain["max_rel_error"] == 0.0


def test_lost_messages_only_cost_participants_never_correctness():
    from foltr_async.runtime.network import NetworkModel

    vr = play(clients=20, rounds=4, network=NetworkModel(loss=0.02), degree=0)
    assert vr.bus.stats.dropped["lost"] > 0
    done = [rep for rep in vr.reports if rep.aggregated]
    assert any(rep.replied < 20 for rep in done), [rep.facts for rep in vr.reports]
    for rep in done:
        assert relative_error(vr, rep) < 1e-6
        assert np.allclose(vr.strategy.means[rep.round], plaintext_mean(vr, rep))
