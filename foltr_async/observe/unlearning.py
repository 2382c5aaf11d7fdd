"""Unlearning across a run's variants: what each strategy cost and how close it came to retraining.

A repeat whose protocol forgot clients reports ``unlearning`` (``protocols/fpdgd.py``): the
strategy, the leavers, the phase's rounds, interactions and messages beside retraining's, and the
final model. Retraining without the leavers is the gold standard the field measures against, so
when a variant of the run retrained (``strategy = "retrain"``, the same leavers), every other
unlearning variant's final model is compared with the retrained one of the same fold and seed:
its L2 distance and its cosine distance (1 - cos; a linear ranker's ranking depends only on the
direction of its weights, so a model may be far in L2 and still rank alike). With the relevance
reset on (``federation.params.relevance_reset``), the relevance-reset difference: the loss on the
leavers' relabelled queries after unlearning minus after training (the study's RelR
difference; 0 for a model left as trained, positive when the relabelling was unlearned).
"""

from __future__ import annotations

import numpy as np

from foltr_async.observe.stats import fmt_num, mean_std, summarise

HEADER = (
    "variant",
    "strategy",
    "rounds",
    "interactions (of retraining's)",
    "messages",
    "simulated s",
    "L2 to retrained",
    "cosine distance to retrained",
    "relevance-reset difference",
)


def _key(rep: dict) -> tuple:
    return rep.get("fold"), rep["seed"]


def _distances(model: list[float], retrained: list[float]) -> tuple[float, float]:
    a, b = np.asarray(model, dtype=float), np.asarray(retrained, dtype=float)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    cosine = 1.0 - float(a @ b) / (na * nb) if na > 0.0 and nb > 0.0 else None
    return float(np.linalg.norm(a - b)), cosine


def unlearning_results(variants: dict[str, list[dict]]) -> dict:
    """Per variant that unlearned: its strategy, mean costs and, where a variant of the run
    retrained the same leavers, the distances of its final models to the retrained ones
    (paired by fold and seed); empty when no variant unlearned."""
    costs = {
        name: [rep["unlearning"] for rep in reps if rep.get("unlearning")]
        for name, reps in variants.items()
    }
    costs = {name: c for name, c in costs.items() if c}
    retrained: dict[tuple, dict[tuple, list[float]]] = {}  # leavers -> (fold, seed) -> model
    for reps in variants.values():
        for rep in reps:
            u = rep.get("unlearning") or {}
            if u.get("strategy") == "retrain":
                retrained.setdefault(tuple(u["clients"]), {})[_key(rep)] = u["final_model"]
    out = {}
    for name, cs in costs.items():
        l2, cosine, against = [], [], None
        for rep in variants[name]:
            u = rep.get("unlearning")
            if not u or u.get("strategy") == "retrain":
                continue
            other = retrained.get(tuple(u["clients"]), {}).get(_key(rep))
            if other is not None:
                d, c = _distances(u["final_model"], other)
                l2.append(d)
                cosine.append(c)
                against = "retrain"
        share = [
            c["interactions"] / c["retrain_interactions"] for c in cs if c["retrain_interactions"]
        ]
        reset = [c["relevance_reset"]["difference"] for c in cs if "relevance_reset" in c]
        out[name] = {
            "strategy": cs[0]["strategy"],
            "clients": len(cs[0]["clients"]),
            "rounds": summarise(c["rounds"] for c in cs),
            "interactions": summarise(c["interactions"] for c in cs),
            "interactions_of_retraining": summarise(share),
            "messages": summarise(c["messages"] for c in cs),
            "sim_s": summarise(c.get("sim_s") for c in cs),
            "l2_to_retrained": summarise(l2) if against else None,
            "cosine_to_retrained": summarise(cosine) if against else None,
            "relevance_reset_difference": summarise(reset) if reset else None,
        }
    return out


def render_unlearning_md(block: dict) -> list[str]:
    """summary.md's unlearning section (nothing when no variant unlearned)."""
    if not block:
        return []
    lines = [
        "",
        "## Unlearning",
        "",
        "Cost of each variant's unlearning phase (means over repeats), beside retraining's: "
        "every training round again without the forgotten clients. Simulated s: the phase's "
        "rounds (PGA's ascent ran at the request, before them). Distances: the final "
        "model against the retrained variant's of the same fold and seed, mean ± sample std. "
        "Relevance-reset difference (with federation.params.relevance_reset): the loss on the "
        "forgotten clients' relabelled queries after unlearning minus after training; 0 when "
        "the model kept what it learned from them.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for name, u in block.items():
        share = u["interactions_of_retraining"]
        of = f" ({share['mean']:.1%})" if share["mean"] is not None else ""
        rounds, inter, msgs = (u[k]["mean"] for k in ("rounds", "interactions", "messages"))
        l2, cosine, reset = (
            mean_std(u["l2_to_retrained"], ".4g"),
            mean_std(u["cosine_to_retrained"], ".4f"),
            mean_std(u["relevance_reset_difference"], ".4f"),
        )
        sim = fmt_num(u["sim_s"]["mean"], ",.1f")
        lines.append(
            f"| {name} | {u['strategy']} | {rounds:,.0f} | {inter:,.0f}{of} | {msgs:,.0f} | "
            f"{sim} | {l2} | {cosine} | {reset} |"
        )
    return lines
