"""Variants compared at equal simulated time and at equal user interactions, for runs whose
evaluations are not round-aligned.

A synchronous round lasts until its slowest selected client replies; an asynchronous server
reports every fixed period. Their final metrics are therefore measured at different simulated
times, and "final" would reward whichever ran longer. In the same simulated time, asynchronous
clients also serve several times more users (fast devices never idle), so equal time mixes speed
with data. Here every variant is read at one horizon on each axis: the latest simulated time
(or interaction count) every repeat of every variant reached, taking each repeat's last
evaluation at or before it. A horizon before some repeat's first evaluation would compare a
measured variant with an unmeasured one: then there is no common horizon and no comparison.
"""

from __future__ import annotations

from foltr_async.observe.stats import summarise

#: axis key in a repeat's result -> the results.json key of the comparison on it
AXES = {"sim_times": "equal_time", "interactions": "equal_interactions"}


def is_timed(variants: dict[str, list[dict]]) -> bool:
    """True when some repeat ran asynchronously (it reports its staleness)."""
    return any("staleness" in rep for reps in variants.values() for rep in reps)


def at_common(variants: dict[str, list[dict]], metric: str, axis: str = "sim_times") -> dict | None:
    """``{"at": X, "axis": axis, "variants": {name: mean/std/n of the metric at X}}`` (``time``
    too for simulated time), or None when no repeat has evaluations on that axis.

    ``measured``: per variant, the span of the axis in which every one of its repeats has an
    evaluation. ``at`` is None (and ``variants`` empty) when no point lies in every variant's
    span: a short run whose synchronous variant ended before the asynchronous ones' first
    evaluation."""
    spans = {
        name: [max(rep[axis][0] for rep in timed), min(rep[axis][-1] for rep in timed)]
        for name, reps in variants.items()
        for timed in [[rep for rep in reps if rep.get(axis)]]
        if timed
    }
    if not spans:
        return None
    first = max(lo for lo, _ in spans.values())
    horizon = min(hi for _, hi in spans.values())

    def value(rep: dict) -> float | None:
        xs = rep.get(axis) or []
        values = (rep.get("offline") or {}).get(metric) or []
        seen = [v for x, v in zip(xs, values, strict=False) if x <= horizon + 1e-9]
        return seen[-1] if seen else None

    common = first <= horizon + 1e-9
    out = {
        "at": horizon if common else None,
        "axis": axis,
        "metric": metric,
        "measured": spans,
        "variants": {
            name: summarise(value(r) for r in reps) for name, reps in variants.items() if common
        },
    }
    if axis == "sim_times":
        out["time"] = out["at"]
    return out
