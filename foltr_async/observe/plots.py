"""Learning-curve figures of a results dict: ``curves.pdf`` (vector) and ``curves.png`` (300 dpi).

Drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas: headless, and it leaves
pyplot's global backend and figure registry alone for anyone else in the process.

Every variant keeps one colour, line style and marker (``variant_styles``, by its place in the
scenario) in every panel and figure of a run, so a variant has one look in a paper's figures and
two curves that coincide for most of a run (an attacked variant and its unlearned copy) stay
apart. Round axes are integer and start at round 0, the starting model.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np

from foltr_async.observe.timecurve import is_timed

#: a print figure's raster resolution (the PDF beside it is vector)
DPI = 300
COLOURS = tuple(f"C{i}" for i in range(10))
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
#: markers per curve at most: enough to tell curves apart, few enough to keep them lines
MARKS_PER_CURVE = 8
BAND = "band: ± 1 sample standard deviation over the repeats (n in the legend)"
#: privacy panel: one line style per accountant (observe/privacy.py keys) and its legend label:
#: realised bounds (the rounds each client took part in) vs a priori ones (over the sampling)
ACCOUNTANT_STYLES = {
    "basic": "-",
    "rdp": ":",
    "pld": "--",
    "a_priori_basic": "-.",
    "a_priori_pld": (0, (6, 2, 1, 2, 1, 2)),
}
ACCOUNTANT_LABELS = {
    "basic": "basic, realised",
    "rdp": "RDP, realised",
    "pld": "PLD, realised",
    "a_priori_basic": "basic, a priori (sampled)",
    "a_priori_pld": "PLD, a priori (sampled)",
}


def metric_label(metric: str) -> str:
    """Human spelling of a metric key: ``ndcg@10`` -> ``nDCG@10``."""
    if metric == "relevance_reset_loss":
        return "relevance-reset loss (forgotten queries)"
    return metric.replace("ndcg", "nDCG").replace("maxrr", "MaxRR").replace("err", "ERR")


def variant_styles(results: dict) -> dict[str, dict]:
    """Per variant, by its place in the scenario (planned order, then any other), the colour,
    line style and marker it has in every panel: 20 variants before a pair repeats."""
    names = list((results.get("planned") or {}).get("variants") or [])
    names += [n for n in results.get("variants", {}) if n not in names]
    return {
        name: {
            "color": COLOURS[i % len(COLOURS)],
            "linestyle": LINESTYLES[i % len(LINESTYLES)],
            "marker": MARKERS[i % len(MARKERS)],
            "order": i,
        }
        for i, name in enumerate(names)
    }


def _line(ax, xs, ys, style: dict, n_styles: int, **kw):
    """One variant's curve in its style; its markers are spread over the curve and shifted
    from the other variants', so curves that coincide still show every variant's marks."""
    n = len(xs)
    step = max(1, -(-n // MARKS_PER_CURVE))
    start = (style["order"] * step // max(1, n_styles)) % step if step > 1 else 0
    (line,) = ax.plot(
        xs,
        ys,
        color=style["color"],
        linestyle=style["linestyle"],
        marker=style["marker"],
        markevery=(start, step),
        ms=4,
        mew=0.8,
        mfc="none" if style["order"] % 2 else style["color"],
        lw=1.5,
        zorder=2 + style["order"] / max(1, n_styles),
        **kw,
    )
    return line


def _round_axis(ax) -> None:
    """Whole rounds from round 0 (the starting model) on."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(left=0)


def scenario_question(results: dict) -> str | None:
    """The scenario's ``description`` (its question), from the variants' resolved configs."""
    config = results.get("config") or {}
    described = [
        (c.get("scenario") or {}).get("description")
        for c in config.values()
        if isinstance(c, dict) and isinstance(c.get("scenario"), dict)
    ]
    return next((d for d in described if d), None)


def figure_title(results: dict) -> str:
    """The scenario's question, else its name."""
    title = scenario_question(results) or results.get("scenario", "")
    if not results.get("complete", True):
        title += " (partial)"
    return title


def _mark_after_training(ax, results: dict, names: list[str]) -> None:
    """Shade the rounds after a variant's planned training rounds (a later phase such as
    unlearning calibration continues the round numbers), so they do not read as training."""
    planned = (results.get("planned") or {}).get("rounds") or {}
    variants = results.get("variants", {})
    ends: dict[int, set[str]] = {}  # training's last round -> the strategies after it
    last = 0
    for name in names:
        mine = max(variants[name]["summary"]["curve"]["rounds"], default=0)  # 0: not measured
        last = max(last, mine)
        if planned.get(name) and mine > planned[name]:
            ends.setdefault(planned[name], set()).update(
                rep["unlearning"].get("strategy", "federaser")
                for rep in variants[name].get("repeats", [])
                if "unlearning" in rep
            )
    for end, methods in sorted(ends.items()):
        if not methods:
            text = "after training"
        elif len(methods) <= 2:
            text = f"unlearning: {', '.join(sorted(methods))}"
        else:  # the legend's names say which variant forgot by which
            text = f"unlearning ({len(methods)} strategies)"
        ax.axvline(end, color="0.4", ls=":", lw=1)
        ax.axvspan(end, last, color="0.5", alpha=0.08, lw=0)
        ax.text(  # left of the line: a short later phase leaves little room on its right
            end,
            0.02,
            f"{text} → ",
            ha="right",
            transform=ax.get_xaxis_transform(),
            fontsize="small",
        )


def plot_curves(results: dict, path: Path, *, metric: str | None = None) -> Path:
    """Mean line and ±1 std band per variant over evaluated rounds, as ``path`` (PNG at
    ``DPI``) and the same figure as a vector PDF beside it; both written atomically.

    Reads ``results["variants"][name]["summary"]["curve"]`` (another metric than the results':
    ``["curves"][metric]``); variants without points are left out of the plot (a partial run
    still gets a figure of what it finished) but keep their style's place.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    main = results.get("metric", "ndcg@10")
    metric = metric or main
    styles = variant_styles(results)
    curves = []
    for name, entry in results.get("variants", {}).items():
        summary = entry.get("summary") or {}
        cur = (summary.get("curve") if metric == main else None) or (
            (summary.get("curves") or {}).get(metric) or {}
        )
        if cur.get("rounds"):
            curves.append((name, len(entry.get("repeats", [])), cur))
    idle = results.get("nothing_learned") or {}
    many = len(curves) > 4  # legend beside the axes, lighter bands: curves stay readable
    panels = (
        _axis_panel(results, "sim_times", "simulated time (s)", styles),
        _axis_panel(results, "interactions", "user interactions", styles),
        _privacy_panel(results, styles),
    )
    extra = [p for p in panels if p is not None]
    width = (9.5 if many else 7.5) + 5.0 * len(extra)
    fig = Figure(figsize=(width, 4.9))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1 + len(extra), 1)
    for name, n_rep, cur in curves:
        rounds = np.asarray(cur["rounds"], dtype=float)
        mean = np.array([np.nan if v is None else v for v in cur["mean"]], dtype=float)
        std = np.array([np.nan if v is None else v for v in cur["std"]], dtype=float)
        style = styles[name]
        label = f"{name} (n={n_rep})" + (", nothing learned" if name in idle else "")
        _line(ax, rounds, mean, style, len(styles), label=label)
        band = 0.1 if many else 0.15
        ax.fill_between(
            rounds, mean - std, mean + std, color=style["color"], alpha=band, lw=0, zorder=1
        )
    _mark_after_training(ax, results, [name for name, _, _ in curves])
    _round_axis(ax)
    ax.set_xlabel("round")
    ax.set_ylabel(f"offline {metric_label(metric)}")
    ax.grid(True, alpha=0.3)
    beside = many and not extra  # the legend right of the axes, as wide as its longest name
    if beside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    elif many:  # other panels on the right: the legend stays inside
        ax.legend(loc="best", fontsize="x-small", frameon=False)
    elif curves:
        ax.legend(loc="best", fontsize="small", frameon=False)
    else:
        ax.text(
            0.5, 0.5, "no evaluated rounds yet", ha="center", va="center", transform=ax.transAxes
        )
    for i, draw in enumerate(extra):
        draw(fig.add_subplot(1, 1 + len(extra), 2 + i))
    title = textwrap.wrap(figure_title(results), int(width * 11)) or [""]  # lines as wide
    fig.suptitle("\n".join(title), fontsize="medium", y=0.985)
    top = 0.92 - 0.045 * (len(title) - 1)
    fig.text(
        0.01,
        0.01,
        f"{results.get('scenario', '')}, seed {results.get('seed')}: lines = mean over the "
        f"repeats of offline {metric_label(metric)}; {BAND}.",
        fontsize="x-small",
        color="0.3",
    )
    # fixed margins instead of tight_layout: one draw, not two
    if extra:
        fig.subplots_adjust(left=0.06, right=0.98, bottom=0.15, top=top, wspace=0.3)
    else:
        fig.subplots_adjust(
            left=0.08 if many else 0.1, right=0.74 if many else 0.97, bottom=0.15, top=top
        )
    path = Path(path)
    for target, fmt in ((path.with_suffix(".pdf"), "pdf"), (path, "png")):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:  # a legend beside the axes: the saved area fits it
            fig.savefig(tmp, format=fmt, dpi=DPI, bbox_inches="tight" if beside else None)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _axis_panel(results: dict, axis: str, label: str, styles: dict):
    """Offline metric against simulated time or user interactions, drawn when a variant ran
    asynchronously (its evaluations are not at the same times, nor after the same number of
    interactions, as a round-based variant's), else None."""
    variants = results.get("variants", {})
    if not is_timed({name: v.get("repeats", []) for name, v in variants.items()}):
        return None
    metric = results.get("metric", "ndcg@10")

    def draw(ax) -> None:
        for name, entry in variants.items():
            reps = [r for r in entry.get("repeats", []) if (r.get("offline") or {}).get(metric)]
            n = min((len(r.get(axis) or []) for r in reps), default=0)
            if n == 0:
                continue
            xs = np.mean([r[axis][:n] for r in reps], axis=0)
            values = np.mean([r["offline"][metric][:n] for r in reps], axis=0)
            _line(ax, xs, values, styles[name], len(styles), label=name)
        ax.set_xlim(left=0)
        ax.set_xlabel(label)
        ax.set_ylabel(f"offline {metric_label(metric)}")
        ax.set_title(f"against {label.split(' (')[0]} (means)", fontsize="medium")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small", frameon=False)

    return draw


def _worst_curve(curves: list[dict]) -> dict:
    """Per accountant and round the largest epsilon over the repeats (None where a repeat has
    none): a bound for every client of every seed, not a mean of each seed's worst."""
    rounds = curves[0]["rounds"]
    out: dict = {"rounds": rounds}
    for key in ACCOUNTANT_STYLES:
        if all(c.get(key) and c["rounds"] == rounds for c in curves):
            out[key] = [
                None if any(v is None for v in column) else max(column)
                for column in zip(*(c[key] for c in curves), strict=True)
            ]
    return out


def _privacy_panel(results: dict, styles: dict):
    """Each variant's privacy loss (epsilon of its worst client over the repeats) over rounds
    by accountant, realised and a priori, when reported: colour and marker are the variant's,
    the line style the accountant's."""
    series = []
    for name, entry in results.get("variants", {}).items():
        curves = [((r.get("privacy") or {}).get("curve") or {}) for r in entry.get("repeats") or []]
        if curves and all(c.get("rounds") for c in curves):
            series.append((name, _worst_curve(curves)))
    if not series:
        return None

    def draw(ax) -> None:
        from matplotlib.lines import Line2D

        used = []
        for name, curve in series:
            label = name  # colour = variant, line style = accountant (second legend)
            for key, linestyle in ACCOUNTANT_STYLES.items():
                values = curve.get(key)
                if not values:
                    continue
                used += [key] if key not in used else []
                style = {**styles[name], "linestyle": linestyle}
                ys = [np.nan if v is None else v for v in values]
                _line(ax, curve["rounds"], ys, style, len(styles), label=label)
                label = None
        _round_axis(ax)
        ax.set_xlabel("round")
        ax.set_ylabel("epsilon, worst client of all repeats")
        ax.set_yscale("log")
        ax.set_title("privacy loss over rounds", fontsize="medium")
        ax.grid(True, alpha=0.3)
        variants = ax.legend(loc="upper left", fontsize="x-small", frameon=False)
        ax.add_artist(variants)
        lines = [Line2D([], [], color="0.3", linestyle=ACCOUNTANT_STYLES[k]) for k in used]
        labels = [ACCOUNTANT_LABELS[k] for k in used]
        ax.legend(lines, labels, loc="lower right", fontsize="x-small", frameon=False)

    return draw
