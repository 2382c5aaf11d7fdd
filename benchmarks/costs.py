"""Suites ``secagg`` and ``csfltr``: what two protocols' own machinery costs. ``secagg``: a
secure-aggregation round against the number of clients; ``csfltr``: CS-F-LTR's reverse top-K,
RTK-Sketch against NAIVE."""

from __future__ import annotations

from foltr_async.benchmarks.measure import N_FEATURES, Sizes, progress


def bench_secagg(sz: Sizes, seed: int) -> dict[str, dict]:
    """Cost of a secure-aggregation round against the number of clients (FPDGD-sized vectors):
    plaintext, the complete graph (SecAgg) and the sparse graph (SecAgg+, degree 16), plus 30 %
    dropout after key sharing; and the largest error of the unmasked mean."""
    from foltr_async.plugins import load_plugins
    from foltr_async.protocols.secagg import cost

    load_plugins()  # the scheme's and the bench clients' message kinds
    if sz.fpdgd_clients < 100:  # --scale for smoke tests: the same shapes, tiny
        plan = [(6, False, 0, 0.0), (6, True, 0, 0.0), (12, True, 4, 0.0), (12, True, 0, 0.3)]
    else:
        large = sz.fpdgd_clients >= 1000  # the full suite adds the 1000-client SecAgg+ round
        plan = [(n, False, 0, 0.0) for n in (10, 30, 100)]
        plan += [(n, True, 0, 0.0) for n in (10, 30, 100)]
        plan += [(n, True, 16, 0.0) for n in ((100, 300, 1000) if large else (100, 300))]
        plan += [(100, True, 0, 0.3), (100, True, 40, 0.3)]
    rows = []
    for clients, secure, degree, dropout in plan:
        r = cost(
            clients, dim=N_FEATURES + 1, degree=degree, dropout=dropout, secure=secure, seed=seed
        )
        rows.append(r)
        graph = "plain" if not secure else ("complete" if degree == 0 else f"k={degree}")
        progress(
            f"secagg: {clients} clients {graph} dropout {dropout:.0%}: "
            f"{r['wall_s_per_round']:.3f} s/round, {r['messages_per_round']:.0f} messages, "
            f"{r['bytes_per_client_round'] / 1e3:.1f} kB per client"
        )
    errors = [r["max_rel_error"] for r in rows if r["secure"] and r["max_rel_error"] is not None]
    full = [r for r in rows if r["secure"] and r["degree"] == 0 and r["dropout"] == 0]
    top = max(full, key=lambda r: r["clients"])  # the largest complete-graph round
    return {
        "secagg": {
            "max_rel_error": max(errors),
            "complete_s_per_round": top["wall_s_per_round"],
            "complete_kb_per_client": top["bytes_per_client_round"] / 1e3,
            "rows": rows,
            "on": {
                "vector": f"{N_FEATURES + 1} values (weights + interaction count)",
                "complete graph clients": top["clients"],
                "rounds per setting": 2,
                "threshold": 0.5,
            },
        }
    }


def bench_csfltr(sz: Sizes, seed: int) -> dict[str, dict]:
    """CS-F-LTR's reverse top-K, RTK-Sketch against NAIVE, on one owner's embedded collection
    at each size (scenario defaults: K 150, alpha 5, beta 0.1, w 200, z 30, z1 10, epsilon 0.5);
    the targets read the first size."""
    from foltr_async.protocols.rtk_cost import cost

    rows = []
    for docs in sz.rtk_docs:
        r = cost(docs, seed=seed, queries=100 if docs >= 2_000 else 20)
        rows.append(r)
        progress(
            f"csfltr: {docs} documents: RTK {r['rtk']['ms_per_term']:.3f} ms/term, NAIVE "
            f"{r['naive']['ms_per_term']:.2f} ms/term ({r['speedup']:.1f}x); cover on "
            f"{r['rankable_terms']} rankable terms RTK {r['rtk']['cover_rate_rankable'] or 0:.3f} "
            "(by the K-th count: "
            + ", ".join(f"{b}: {c:.2f}" for b, (c, _) in r["rtk"]["cover_by_kth"].items())
            + ")"
        )
    first = rows[0]
    return {
        "csfltr": {
            "speedup": first["speedup"],
            "cover_rate_rankable": first["rtk"]["cover_rate_rankable"] or 0.0,
            "rtk_ms_per_term": first["rtk"]["ms_per_term"],
            "naive_ms_per_term": first["naive"]["ms_per_term"],
            "rows": rows,
            "on": {
                "documents": first["docs"],
                "queries": first["queries"],
                "terms": first["terms"],
                "rankable terms": first["rankable_terms"],
                "K, alpha, w, z, z1": "150, 5, 200, 30, 10",
            },
        }
    }
