"""Results of a run as files a researcher keeps: results.json, curves.csv, summary.md and the
figures (curves.pdf, curves.png).

The numbers (results.json, curves.csv, summary.md) are rewritten after every finished repeat
(write to a temporary file, fsync, rename), so an interrupted run leaves valid files describing
exactly the repeats it finished, marked ``"complete": false``. results.json is written first and
the figures last: a plotting failure is logged and never costs the numbers. A figure (0.3-1 CPU
s as PDF and 300-dpi PNG) is redrawn after a repeat only while drawing stays under a tenth of
the wall time since the last drawing (the first time 30 s into the run), and always at
``run_done``, so short repeats and short runs are not dominated by matplotlib.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from foltr_async.errors import FoltrError
from foltr_async.ltr.metrics import ONLINE_GAMMA
from foltr_async.observe.audit import audit_results, plot_audit, render_audit_md
from foltr_async.observe.log import jsonable
from foltr_async.observe.observer import Observer
from foltr_async.observe.plots import metric_label, plot_curves, scenario_question
from foltr_async.observe.stats import (
    PAIRED_TEST,
    bonferroni,
    curve,
    fmt_num,
    holm,
    mean_std,
    paired_test,
    summarise,
)
from foltr_async.observe.timecurve import AXES, at_common, is_timed
from foltr_async.observe.unlearning import render_unlearning_md, unlearning_results

_log = structlog.get_logger("foltr_async.observe.results")

CSV_HEADER = ("variant", "repeat", "seed", "round", "metric", "value")
#: Offline metrics a protocol's paper reports instead of the scenario's: where a run has them,
#: summary.md gives them a column, the reference comparisons are made in them too
#: (``comparisons_by_metric``) and the conclusions state them. FedIPS is reported in nDCG@5.
PAPER_METRICS = ("ndcg@5",)
#: Offline metrics with their own mean curve in the summary and figure (``curves-maxrr@10.png``)
#: beside the scenario's metric: FOLtR-ES is reported in MaxRR, and unlearning's relevance reset
#: in its loss on the forgotten clients' relabelled queries.
EXTRA_CURVES = ("maxrr@10", *PAPER_METRICS, "relevance_reset_loss")
OWN_KEYS = (
    "scenario",
    "seed",
    "config",
    "reference",
    "metric",
    "planned",
    "variants",
    "comparisons",
    "comparisons_by_metric",
    "conclusions",
    "complete",
    "nothing_learned",
    "nothing_measured",
    "not_as_asked",
    "equal_time",
    "equal_interactions",
    "code",
    "audit",
)
#: Offline metrics defined by relevance labels: a repeat whose held-out queries have no
#: relevant document measured nothing in them (MaxRR follows the click model and still does).
LABEL_METRICS = ("ndcg", "err")

NO_RELEVANT = {
    "skip": "queries without a relevant document are left out of the mean "
    "(the FPDGD authors' convention)",
    "exclude": "queries without a relevant document are left out of the mean "
    "(the FPDGD authors' convention)",
    "zero": "queries without a relevant document count as nDCG 0 (the PDGD authors' convention)",
}


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_results(path: Path) -> dict:
    """A run's results.json, given the file or its folder; one line if it is not one."""
    path = Path(path)
    if not path.exists():
        raise FoltrError(f"{path}: no such run folder or results.json")
    file = path / "results.json" if path.is_dir() else path
    try:
        res = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise FoltrError(f"{file}: not a readable results.json ({exc})") from None
    if not isinstance(res, dict) or not isinstance(res.get("variants"), dict):
        raise FoltrError(f"{file}: not a run's results.json (no 'variants' table)")
    return res


def final_value(rep: dict, metric: str) -> float | None:
    """A repeat's ``metric`` at its last evaluated round (None if it evaluated nothing, or if
    the metric measured nothing: see ``measured_nothing``)."""
    values = _measured(rep, metric)
    return values[-1] if values else None


def measured_nothing(rep: dict) -> bool:
    """A repeat none of whose held-out queries has a relevant document: its nDCG and ERR are
    0 whatever the model, not a result. (False for a repeat without the count on record.)"""
    return rep.get("judged_queries") == 0


def _measured(rep: dict, metric: str) -> list | None:
    """A repeat's curve of ``metric``, None when it measured nothing."""
    if measured_nothing(rep) and metric.startswith(LABEL_METRICS):
        return None
    return (rep.get("offline") or {}).get(metric)


def learned_nothing(rep: dict) -> bool:
    """A repeat none of whose rounds took in a client update: its model is the initial one.
    (False for a repeat without round contributions on record.)"""
    per_round = (rep.get("contributions") or {}).get("per_round")
    return per_round is not None and not any(per_round)


def clients_per_round(contributions: dict) -> float | None:
    """Mean clients per round over the rounds that asked clients (not the server's own)."""
    asked = len(contributions["per_round"]) - contributions.get("server_rounds", 0)
    return sum(contributions["per_round"]) / asked if asked else None


def nothing_learned(summaries: dict[str, dict]) -> dict[str, int]:
    """Variants with repeats that learned nothing, and how many such repeats each has (read
    from the variants' summaries, which count them)."""
    counts = {name: s["contributions"]["learned_nothing"] for name, s in summaries.items()}
    return {name: n for name, n in counts.items() if n}


def learner_path(counts: dict | None) -> str | None:
    """Which path a run's PDGD learners trained by (``learner_interactions`` of a repeat: its
    interactions per path): the one path they all took, ``"mixed: ..."`` naming each path's
    interactions otherwise, None when nothing was trained."""
    used = {path: n for path, n in (counts or {}).items() if n}
    if len(used) <= 1:
        return next(iter(used), None)
    return "mixed: " + "; ".join(f"{path} ({n} interactions)" for path, n in used.items())


def nobody_online_share(contrib: dict) -> float | None:
    """The share of a repeat's simulated round time that began with no client online."""
    total = contrib.get("rounds_s")
    return contrib["nobody_online_s"] / total if total else None


def nothing_measured(variants: dict[str, list[dict]]) -> dict[str, int]:
    """Variants with repeats that measured nothing, and how many such repeats each has."""
    counts = {name: sum(map(measured_nothing, reps)) for name, reps in variants.items()}
    return {name: n for name, n in counts.items() if n}


def not_as_asked(variants: dict[str, dict]) -> dict[str, list[str]]:
    """What a distributed run did not do as planned, from its repeats' transport facts:
    ``lines`` one sentence per repeat with clients no worker hosted (they never took part),
    hosted only after round 1 or lost with their worker mid-run (they missed rounds);
    ``no_clients`` the variants with a repeat in which no honest client took part, so nothing
    was measured."""
    lines: list[str] = []
    none: list[str] = []
    for name, entry in variants.items():
        for i, rep in enumerate(entry["repeats"]):
            t = rep.get("transport") or {}
            n, missing = t.get("clients", 0), t.get("clients_missing", 0)
            late, lost = t.get("clients_late", 0), t.get("clients_lost", 0)
            where = f"{name} repeat {rep.get('repeat', i)}"
            if missing:
                lines.append(
                    f"{where}: {missing} of {n} clients never joined (no worker hosted them)"
                )
                if missing >= n and name not in none:
                    none.append(name)
            if late:
                lines.append(
                    f"{where}: {late} of {n} clients joined only after round 1 (their worker "
                    "came late: they missed rounds)"
                )
            if lost:
                lines.append(
                    f"{where}: {lost} of {n} clients were lost with their worker during the run "
                    "(they missed rounds)"
                )
    return {"lines": lines, "no_clients": none}


def repeat_curve(rep: dict, metric: str) -> tuple[list[int], list]:
    """A repeat's evaluated rounds and ``metric`` values, from round 0 (the model before any
    training) where the repeat recorded it."""
    start = (rep.get("initial") or {}).get(metric)
    first = [] if start is None else [start]
    values = (rep.get("offline") or {}).get(metric) or []
    return [0] * len(first) + list(rep.get("rounds") or []), first + list(values)


def _curve(repeats: list[dict], metric: str) -> dict:
    """The mean curve over the repeats that measured ``metric``, from round 0."""
    pairs = [repeat_curve(rep, metric) for rep in repeats if _measured(rep, metric)]
    return curve([r for r, _ in pairs], [v for _, v in pairs])


def summarise_variant(repeats: list[dict], metric: str) -> dict:
    """Per-variant summary: final offline metrics, online metrics, mean curve, costs."""
    metrics: list[str] = []
    online_keys: list[str] = []
    for rep in repeats:
        metrics += [k for k in (rep.get("offline") or {}) if k not in metrics]
        online_keys += [k for k in (rep.get("online") or {}) if k not in online_keys]
    final = {m: summarise(final_value(rep, m) for rep in repeats) for m in metrics}
    online = {
        k: summarise((rep.get("online") or {}).get(k) for rep in repeats) for k in online_keys
    }
    cur = _curve(repeats, metric)
    msgs = [rep.get("messages") or {} for rep in repeats]
    contrib = [rep["contributions"] for rep in repeats if rep.get("contributions")]
    return {
        "final": final,
        "online": online,
        "curve": cur,
        "contributions": {
            "rounds": summarise(len(c["per_round"]) for c in contrib),
            "empty_rounds": summarise(c["empty_rounds"] for c in contrib),
            "clients_per_round": summarise(map(clients_per_round, contrib)),
            "learned_nothing": sum(map(learned_nothing, repeats)),
            "nobody_online_rounds": summarise(c.get("nobody_online_rounds") for c in contrib),
            "nobody_online_share": summarise(map(nobody_online_share, contrib)),
        },
        "curves": {m: _curve(repeats, m) for m in EXTRA_CURVES if m in metrics},
        "messages": {
            "sent": summarise(m.get("sent") for m in msgs),
            "delivered": summarise(m.get("delivered") for m in msgs),
            "bytes": summarise(m.get("bytes") for m in msgs),
            "dropped": summarise(sum((m.get("dropped") or {}).values()) for m in msgs),
        },
        "wall_s": summarise(rep.get("wall_s") for rep in repeats),
        "sim_s": summarise(rep.get("sim_s") for rep in repeats),
        **_learner(repeats),
    }


def _learner(repeats: list[dict]) -> dict:
    """``learner.path`` of a variant: the path its repeats' PDGD learners trained by (nothing
    for a protocol without one)."""
    total: dict[str, int] = {}
    for rep in repeats:
        for path, n in (rep.get("learner_interactions") or {}).items():
            total[path] = total.get(path, 0) + n
    path = learner_path(total)
    return {"learner": {"path": path}} if path else {}


def paired_finals(
    repeats: list[dict], reference: list[dict], metric: str
) -> tuple[list[float], list[float]]:
    """The final ``metric`` of a variant's repeats and of the reference's, paired by seed (a
    seed missing or unmeasured on either side is left out)."""

    def finals(reps: list[dict]) -> dict:
        return {rep.get("seed"): final_value(rep, metric) for rep in reps}

    mine, ref = finals(repeats), finals(reference)
    seeds = [s for s in mine if s in ref and mine[s] is not None and ref[s] is not None]
    return [mine[s] for s in seeds], [ref[s] for s in seeds]


def paper_metrics(results: dict) -> list[str]:
    """The ``PAPER_METRICS`` some variant of ``results`` has a final value of."""
    finals = [(v.get("summary") or {}).get("final") or {} for v in results["variants"].values()]
    return [m for m in PAPER_METRICS if any((f.get(m) or {}).get("n") for f in finals)]


def compare(variants: dict[str, list[dict]], reference: str | None, metric: str) -> list[dict]:
    """Each variant's final metric against the reference's, paired by repeat seed; ``p_holm``
    and ``p_bonferroni`` are the p-value adjusted over all the scenario's comparisons (Holm,
    which the verdicts use; Bonferroni, which the published studies use)."""
    if reference is None or reference not in variants:
        return []
    out = []
    for name, repeats in variants.items():
        if name == reference:
            continue
        mine, ref = paired_finals(repeats, variants[reference], metric)
        diff, p = paired_test(mine, ref)
        out.append(
            {
                "variant": name,
                "reference": reference,
                "metric": metric,
                "diff_mean": diff,
                "p_value": p,
                "test": PAIRED_TEST,
                "n": len(mine),
            }
        )
    raw = [c["p_value"] for c in out]
    for comp, by_holm, by_bonferroni in zip(out, holm(raw), bonferroni(raw), strict=True):
        comp["p_holm"] = by_holm
        comp["p_bonferroni"] = by_bonferroni
    return out


def _conventions(config: dict) -> list[str]:
    """The nDCG convention(s) ``evaluation.no_relevant`` names, in the config itself or, when the
    config maps variant names to configs, per variant (one line when all variants agree)."""

    def describe(v: object) -> str:
        return NO_RELEVANT.get(str(v), f"no_relevant = {v!r}")

    top = (config.get("evaluation") or {}) if isinstance(config.get("evaluation"), dict) else {}
    if "no_relevant" in top:
        return [describe(top["no_relevant"])]
    per = {
        name: c["evaluation"]["no_relevant"]
        for name, c in config.items()
        if isinstance(c, dict)
        and isinstance(c.get("evaluation"), dict)
        and "no_relevant" in c["evaluation"]
    }
    if len(set(map(str, per.values()))) == 1:
        return [describe(next(iter(per.values())))]
    return [f"{name}: {describe(v)}" for name, v in per.items()]


def render_summary_md(results: dict) -> str:
    """The markdown table a researcher pastes, then the scenario's conclusions."""
    metric = results.get("metric", "ndcg@10")
    label = metric_label(metric)
    ref = results.get("reference")
    variants = results.get("variants", {})
    done = sum(len(v["repeats"]) for v in variants.values())
    planned = (results.get("planned") or {}).get("repeats")
    total = f"{done}/{planned * len(variants)}" if planned else str(done)
    lines = [f"# {results.get('scenario', 'run')}", ""]
    question = scenario_question(results)
    if question:
        lines += [f"{question}", ""]
    complete = results.get("complete")
    status = "complete" if complete else "partial (interrupted or still running)"
    unmeasured = results.get("nothing_measured") or {}
    notes = [
        f"nothing was {what} in "
        + ", ".join(
            f"{name} ({n} of {len(variants[name]['repeats'])} repeats)"
            for name, n in counts.items()
        )
        for what, counts in (("learned", results.get("nothing_learned")), ("measured", unmeasured))
        if counts
    ]
    if complete and unmeasured:  # every repeat ran, yet some gave no result
        status = "finished, but " + "; ".join(notes)
    elif notes:
        status += "; " + "; ".join(notes)
    lines.append(f"Seed {results.get('seed')}; {total} repeats finished; run {status}.")
    for line in not_as_asked(variants)["lines"]:
        lines.append(f"**Not as asked**: {line}.")
    for data in _datasets(results.get("config") or {}):
        lines.append(f"Dataset: {data}.")
    code = results.get("code")
    if code:
        commit = f", commit {code['commit'][:12]}" if code.get("commit") else ""
        commit += " with changes" if code.get("modified") else ""
        lines.append(
            f"Code: foltr_async {code.get('version')} (source {code.get('source')}{commit}), "
            f"Python {code.get('python')}, numpy {code.get('numpy')}."
        )
    lines.append(
        f"Final = offline {label} at the last evaluated round, mean ± sample std (n repeats)."
    )
    if ref is not None:
        lines.append(
            f"Δ = mean paired difference vs reference `{ref}`; p from a {PAIRED_TEST}; "
            "Holm (and Bonferroni, the published studies' correction) = p adjusted over all the "
            "comparisons with the reference."
        )
    online_key = f"{metric}_discounted"
    lines.append(
        f"Online discounted {label} = sum over the rankings shown to users, in order, of "
        f"{ONLINE_GAMMA}^t x their {label}, mean ± sample std; n/a: no user was shown a ranking."
    )
    for conv in _conventions(results.get("config") or {}):
        lines.append(f"nDCG convention: {conv}.")
    extra = paper_metrics(results)
    lines += [
        "",
        f"| variant | final {label} | Δ vs reference (p) | "
        + "".join(f"final {metric_label(m)} | " for m in extra)
        + f"online discounted {label} | empty rounds | messages sent / dropped | wall s |",
        "|---|---|---|" + "---|" * len(extra) + "---|---|---|---|",
    ]
    comps = {c["variant"]: c for c in results.get("comparisons", [])}
    for name, entry in variants.items():
        s = entry.get("summary") or {}
        final = mean_std((s.get("final") or {}).get(metric), ".4f")
        if unmeasured.get(name) == len(entry["repeats"]):
            final = "**not measured**"
        if name == ref:
            delta = "reference"
        elif name in comps and comps[name]["diff_mean"] is not None:
            c = comps[name]
            p = "n/a" if c["p_value"] is None else f"{c['p_value']:.3g}"
            if c.get("p_holm") is not None:
                p += f", Holm {c['p_holm']:.3g}"
            if c.get("p_bonferroni") is not None:
                p += f", Bonferroni {c['p_bonferroni']:.3g}"
            delta = f"{c['diff_mean']:+.4f} (p={p}, n={c['n']})"
        else:
            delta = "–"
        online_s = (s.get("online") or {}).get(online_key)
        online = mean_std(online_s, ".4g", ".2g", n=False)
        if online_s is not None and not online_s["n"]:  # every repeat: no online users
            online = "n/a"
        m = s.get("messages") or {}
        sent, dropped = (m.get("sent") or {}).get("mean"), (m.get("dropped") or {}).get("mean")
        msgs = f"{fmt_num(sent, ',.0f')} / {fmt_num(dropped, ',.0f')}"
        wall = fmt_num((s.get("wall_s") or {}).get("mean"), ".1f")
        empty = _empty_rounds(s.get("contributions") or {})
        cells = "".join(f"{mean_std((s.get('final') or {}).get(m), '.4f')} | " for m in extra)
        lines.append(
            f"| {name} | {final} | {delta} | {cells}{online} | {empty} | {msgs} | {wall} |"
        )
    lines += render_unlearning_md(results.get("unlearning") or {})
    lines += render_audit_md(results.get("audit") or {})
    conclusions = results.get("conclusions") or []
    if conclusions:
        lines += ["", "## Conclusions", ""] + [f"- {c}" for c in conclusions]
    return "\n".join(lines) + "\n"


def _empty_rounds(c: dict) -> str:
    """Rounds that kept the old model, of the rounds played (means over repeats), and the
    repeats that learned nothing at all."""
    empty, rounds = c.get("empty_rounds") or {}, c.get("rounds") or {}
    if not empty.get("n"):
        return "–"
    text = f"{fmt_num(empty['mean'], '.4g')} of {fmt_num(rounds['mean'], '.4g')}"
    idle = c.get("learned_nothing", 0)
    if idle == empty["n"]:
        return f"**{text}: nothing learned**"
    return f"{text} ({idle} repeats learned nothing)" if idle else text


def _datasets(config: dict) -> list[str]:
    """Which data the variants ran on (one line when they share it): the LETOR path, or the
    synthetic profile with the seed that drew it."""

    def describe(cfg: dict) -> str:
        d = cfg["dataset"]
        if d.get("path"):
            return f"{d['path']}" + (" (query-normalised)" if d.get("normalise") else "")
        seed = d.get("seed")
        seed = (cfg.get("scenario") or {}).get("seed") if seed is None else seed
        size = "" if d.get("n_queries") is None else f", {d['n_queries']} queries"
        return f"synthetic {d.get('profile')} (seed {seed}{size})"

    per = {
        name: describe(c)
        for name, c in config.items()
        if isinstance(c, dict) and isinstance(c.get("dataset"), dict)
    }
    if len(set(per.values())) == 1:
        return [next(iter(per.values()))]
    return [f"{name}: {text}" for name, text in per.items()]


def render_curves_csv(results: dict) -> str:
    """``variant,repeat,seed,round,metric,value`` for every evaluated round and offline metric,
    from round 0 (the model before training) where the repeat recorded it."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for name, entry in results.get("variants", {}).items():
        for rep in entry["repeats"]:
            for m in rep.get("offline") or {}:
                rounds, values = repeat_curve(rep, m)
                w.writerows(
                    (name, rep.get("repeat"), rep.get("seed"), r, m, "" if v is None else v)
                    for r, v in zip(rounds, values, strict=False)
                )
    return buf.getvalue()


#: What the first drawing of a run's figures is taken to cost, in seconds (``_plot_due``)
FIRST_PLOT_S = 3.0


class ResultsWriter(Observer):
    """Observer that keeps results.json, curves.csv, summary.md and the figures up to date.

    ``conclusions(results)`` returns the scenario's sentences for the current results; it is
    called after every repeat, and a failing callback keeps the previous sentences.
    ``results`` (property) is the current results.json object, e.g. for the runner to pass to
    ``run_done``. ``code``: the stamp of the code that made the repeats
    (``foltr_async.provenance``), written from the first file on so an interrupted run has it.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        scenario: str,
        seed: int,
        config: dict,
        reference: str | None,
        metric: str = "ndcg@10",
        conclusions: Callable[[dict], list[str]] | None = None,
        throttled: bool = False,
        code: dict | None = None,
    ) -> None:
        #: rewrite after a repeat only when due (``_rewrite_due``), not after every one
        self.throttled = throttled
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.scenario = scenario
        self.seed = seed
        self.config = config
        self.reference = reference
        self.metric = metric
        self.code = code
        self._conclude = conclusions
        self._repeats: dict[str, dict[int, dict]] = {}
        self._planned: dict[str, Any] = {}
        self._conclusions: list[str] = []
        self._extra: dict[str, Any] = {}
        self._complete = False
        self._plot_cost = 0.0
        self._plotted_at: float | None = None
        self._rewrite_cost = 0.0
        self._rewritten_at: float | None = None

    # --- paths -------------------------------------------------------------------------------
    @property
    def json_path(self) -> Path:
        return self.out_dir / "results.json"

    @property
    def csv_path(self) -> Path:
        return self.out_dir / "curves.csv"

    @property
    def md_path(self) -> Path:
        return self.out_dir / "summary.md"

    @property
    def png_path(self) -> Path:
        return self.out_dir / "curves.png"

    # --- observer ----------------------------------------------------------------------------
    def run_started(self, info: dict) -> None:
        for name in info.get("variants", []):
            self._repeats.setdefault(name, {})
        self._planned = {
            "variants": list(info.get("variants", [])),
            "repeats": info.get("repeats"),
            "rounds": dict(info.get("rounds") or {}),
        }
        self._complete = False
        self.write(plot=False)
        # the first figures of a run that is still going: not before ten times a first
        # drawing's cost (matplotlib's import and two formats, ~3 s) has passed; a short run
        # draws once, at its end
        self._plotted_at, self._plot_cost = time.monotonic(), FIRST_PLOT_S

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        self.add(variant, repeat, result)
        if self._rewrite_due():
            start = time.monotonic()
            self.write()
            self._rewritten_at = time.monotonic()
            self._rewrite_cost = self._rewritten_at - start

    def _rewrite_due(self) -> bool:
        """After a repeat the files are rewritten whole (summaries, tests, every curve), which
        grows with the repeats done: the 305 repeats of model poisoning took ~70 CPU s of
        rewriting next to ~620 of training. So, as plots, at most ~10% of the time: the first
        repeat at once, then when ten times the last rewrite's cost has passed; ``run_done``
        always writes."""
        if not self.throttled or self._rewritten_at is None:
            return True
        return time.monotonic() - self._rewritten_at >= 10 * self._rewrite_cost

    def add(self, variant: str, repeat: int, result: dict) -> None:
        """Keep a finished repeat without rewriting the files (``merge`` adds many at once)."""
        rep = jsonable(result)  # a plain copy: numpy arrays and scalars become lists and floats
        rep.setdefault("repeat", repeat)
        self._repeats.setdefault(variant, {})[repeat] = rep

    def run_done(self, results: dict) -> None:
        """Marks the results complete, unless ``results`` says ``"interrupted": true``; other
        top-level keys the writer does not own are kept in results.json."""
        self._complete = not results.get("interrupted", False)
        self._extra.update({k: copy.deepcopy(v) for k, v in results.items() if k not in OWN_KEYS})
        self.write(force_plot=True)

    # --- results -----------------------------------------------------------------------------
    def _variants(self) -> dict[str, list[dict]]:
        return {name: [reps[i] for i in sorted(reps)] for name, reps in self._repeats.items()}

    @property
    def results(self) -> dict:
        """The current results.json object (JSON-safe plain data)."""
        variants = self._variants()
        summaries = {name: summarise_variant(reps, self.metric) for name, reps in variants.items()}
        res: dict[str, Any] = {
            "scenario": self.scenario,
            "seed": self.seed,
            "config": self.config,
            "reference": self.reference,
            "metric": self.metric,
            "planned": self._planned,
            "variants": {
                name: {"repeats": reps, "summary": summaries[name]}
                for name, reps in variants.items()
            },
            "comparisons": compare(variants, self.reference, self.metric),
            "conclusions": list(self._conclusions),
            "complete": self._complete,
            "nothing_learned": nothing_learned(summaries),
            "nothing_measured": nothing_measured(variants),
        }
        by_metric = {m: compare(variants, self.reference, m) for m in paper_metrics(res)}
        if any(by_metric.values()):  # the paper's metric, tested as the scenario's is
            res["comparisons_by_metric"] = {m: c for m, c in by_metric.items() if c}
        unmet = not_as_asked(res["variants"])["lines"]
        if unmet:
            res["not_as_asked"] = unmet
        if self.code is not None:
            res["code"] = self.code
        unlearning = unlearning_results(variants)
        if unlearning:  # some variants forgot clients: each strategy's cost and distance
            res["unlearning"] = unlearning
        audit = audit_results(variants)
        if audit:  # canaries and auditors ran: the empirical epsilon beside the claimed one
            res["audit"] = audit
        if is_timed(variants):  # asynchronous variants: at equal simulated time, interactions
            for axis, key in AXES.items():
                res[key] = at_common(variants, self.metric, axis)
        res.update(self._extra)
        return jsonable(res)

    def _refresh_conclusions(self, res: dict) -> None:
        if self._conclude is None:
            return
        try:
            sentences = self._conclude(copy.deepcopy(res))
            self._conclusions = [str(s) for s in (sentences or [])]
        except Exception:
            _log.exception("conclusions_failed", scenario=self.scenario)
        res["conclusions"] = list(self._conclusions)

    def _plot_due(self) -> bool:
        if self._plotted_at is None:
            return True
        return time.monotonic() - self._plotted_at >= 10 * self._plot_cost

    def write(self, *, plot: bool = True, force_plot: bool = False) -> dict:
        """Rewrite every results file from the current state; returns the results dict."""
        res = self.results
        self._refresh_conclusions(res)
        atomic_write_text(self.json_path, json.dumps(res, indent=1, allow_nan=False) + "\n")
        atomic_write_text(self.csv_path, render_curves_csv(res))
        atomic_write_text(self.md_path, render_summary_md(res))
        if force_plot or (plot and self._plot_due()):
            start = time.monotonic()
            try:
                plot_curves(res, self.png_path, metric=self.metric)
                if res.get("audit"):
                    plot_audit(res["audit"], self.out_dir / "audit.png")
                for m in EXTRA_CURVES:
                    if any(m in v["summary"]["curves"] for v in res["variants"].values()):
                        plot_curves(res, self.out_dir / f"curves-{m}.png", metric=m)
            except Exception:
                _log.exception("plot_failed", path=str(self.png_path))
            self._plotted_at = time.monotonic()
            self._plot_cost = self._plotted_at - start
        return res
