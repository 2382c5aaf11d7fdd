"""Variants compared at equal simulated time, for runs whose evaluations are not round-aligned.

A synchronous round lasts until its slowest selected client replies; an asynchronous server
reports every fixed period. Their final metrics are therefore measured at different simulated
times, and "final" would reward whichever ran longer. Here every variant is read at one horizon:
the latest simulated time every repeat of every variant reached, taking each repeat's last
evaluation at or before it.
"""

from __future__ import annotations

from foltr_async.observe.stats import summarise


def is_timed(variants: dict[str, list[dict]]) -> bool:
    """True when some repeat ran asynchronously (it reports its staleness)."""
    return any("staleness" in rep for reps in variants.values() for rep in reps)


def at_common_time(variants: dict[str, list[dict]], metric: str) -> dict | None:
    """``{"time": T, "variants": {name: mean/std/n of the metric at T}}``, or None when no
    repeat has evaluations with simulated times."""
    ends = [
        rep["sim_times"][-1] for reps in variants.values() for rep in reps if rep.get("sim_times")
    ]
    if not ends:
        return None
    horizon = min(ends)

    def value(rep: dict) -> float | None:
        times = rep.get("sim_times") or []
        values = (rep.get("offline") or {}).get(metric) or []
        seen = [v for t, v in zip(times, values, strict=False) if t <= horizon + 1e-9]
        return seen[-1] if seen else None

    return {
        "time": horizon,
        "metric": metric,
        "variants": {name: summarise(value(r) for r in reps) for name, reps in variants.items()},
    }
