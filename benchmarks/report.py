"""The bench's targets and its readable output: a table of every metric against its target,
what each suite measured on, optional figures of another implementation side by side."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from foltr_async.errors import FoltrError


@dataclass(frozen=True)
class Check:
    """A target: ``suite.key`` compared with ``limit`` (``>=`` or ``<=``/``<``)."""

    suite: str
    key: str
    op: str
    limit: float
    label: str

    def ok(self, value: float) -> bool:
        return {">=": value >= self.limit, "<=": value <= self.limit, "<": value < self.limit}[
            self.op
        ]


TARGETS = (
    Check("fpdgd", "queries_per_s", ">=", 50_000, "FPDGD queries/s"),
    Check("foltr_es", "s_per_round", "<", 0.3, "FOLtR-ES s/round"),
    Check("bus", "us_per_update", "<=", 50, "bus us/update"),
    Check("startup", "s", "<", 1.0, "start-up s"),
    Check("memory", "mb_per_1000_clients", "<=", 300, "MB per 1000 clients"),
    Check("memory", "rss_62500_mb", "<=", 4096, "RSS with 62,500 clients (MB)"),
    Check("zmq", "msgs_per_s", ">=", 20_000, "zmq msgs/s"),
    Check("parse", "mslr_parse_s", "<", 60, "MSLR-size parse s"),
    Check("parse", "mslr_cached_s", "<", 2, "MSLR-size cached load s"),
    Check("secagg", "max_rel_error", "<=", 1e-6, "secure sum vs plaintext FedAvg (relative)"),
    Check("csfltr", "speedup", ">=", 100, "RTK-Sketch vs NAIVE reverse top-K speed-up"),
    Check("csfltr", "cover_rate_rankable", ">=", 0.9, "RTK-Sketch cover rate (rankable terms)"),
)


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


# (suite, key, label, unit) shown in the table besides the targets
_SHOWN = (
    ("fpdgd", "queries_per_s", "queries/s", ""),
    ("fpdgd", "s_per_round", "round", "s"),
    ("fpdgd", "paper_run_s", "200-round paper run (extrapolated)", "s"),
    ("pdgd_kernel", "us_per_client", "FPDGD local training per client (2 queries)", "us"),
    ("pdgd_kernel", "us_per_query_alone", "per query, one client alone (5 queries)", "us"),
    ("pdgd", "interactions_per_s", "centralised interactions/s", ""),
    ("eval", "queries_per_s", "offline nDCG@10 queries/s", ""),
    ("foltr_es", "s_per_round", "round", "s"),
    ("bus", "us_per_update", "per client update", "us"),
    ("bus", "floor_cpu_us_per_update", "bare asyncio + msgpack floor, CPU", "us"),
    ("bus", "msgs_per_s", "messages/s", ""),
    ("bus", "bytes_per_s", "bytes/s", ""),
    ("startup", "s", "start-up to round 1", "s"),
    ("startup", "round1_s", "start-up to the end of round 1", "s"),
    ("startup", "cold_s", "start-up, dataset not cached yet", "s"),
    ("memory", "mb_per_1000_clients", "RSS per 1000 clients", "MB"),
    ("memory", "rss_62500_mb", "RSS with 62,500 clients", "MB"),
    ("zmq", "msgs_per_s", "messages/s", ""),
    ("parse", "lines_per_s", "lines/s (cold)", ""),
    ("parse", "cached_s", "cached load", "s"),
    ("parse", "mslr_parse_s", "MSLR-size parse (extrapolated)", "s"),
    ("parse", "mslr_cached_s", "MSLR-size cached load (extrapolated)", "s"),
    ("secagg", "complete_s_per_round", "round, complete graph (largest)", "s"),
    ("secagg", "complete_kb_per_client", "sent per client, complete graph", "kB"),
    ("secagg", "max_rel_error", "unmasked mean vs plaintext (relative)", ""),
    ("csfltr", "rtk_ms_per_term", "RTK-Sketch reverse top-K per term", "ms"),
    ("csfltr", "naive_ms_per_term", "NAIVE reverse top-K per term", "ms"),
    ("csfltr", "speedup", "speed-up", "x"),
    ("csfltr", "cover_rate_rankable", "RTK cover rate, rankable terms", ""),
)


def _on(d: dict) -> str:
    """One line of what a suite measured on (its sizes), for the readable output."""
    return ", ".join(
        f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
        for k, v in d.get("on", {}).items()
    )


def render(results: dict) -> None:
    """The readable output: one row per metric with its target and a pass/fail mark, then what
    each suite measured on (and the profile when asked for)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()

    def show(table: Table) -> None:
        """A table at its natural width off a terminal (a pipe, a log file), where rich would
        otherwise wrap its cells at 80 columns: one line per row, for the eye and for grep."""
        if console.is_terminal:
            console.print(table)
            return
        from rich.measure import Measurement

        narrow = console.width
        wide = console.options.update(width=1000, max_width=1000)
        console.width = max(narrow, Measurement.get(console, wide, table).maximum)
        console.print(table)
        console.width = narrow  # the prose below still wraps as it would

    meta = results["meta"]
    checks = {c["metric"]: c for c in results["checks"]}
    dirty = " + local changes" if meta["dirty"] else ""
    table = Table(
        title=f"foltr_async bench{' --quick (smaller sizes)' if meta['quick'] else ''}",
        caption=f"commit {(meta['commit'] or '?')[:10]}{dirty}, {meta['cores']} cores, "
        f"Python {meta['python']}, numpy {meta['numpy']}, load average {meta['load_average']}; "
        "CPU share = CPU s per wall s of the timed span (< 1: other processes competed)",
    )
    table.add_column("suite")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    table.add_column("")
    table.add_column("CPU share", justify="right")
    for suite, key, label, unit in _SHOWN:
        d = results.get(suite)
        if d is None or key not in d:
            continue
        c = checks.get(f"{suite}.{key}")
        mark = "" if c is None else ("[green]pass[/]" if c["ok"] else "[red]FAIL[/]")
        target = f"{c['target']} {unit}".strip() if c else ""
        cpu = f"{d['cpu_share']:.2f}" if "cpu_share" in d else ""
        table.add_row(suite, label, f"{_fmt(d[key])} {unit}".strip(), target, mark, cpu)
    for suite, d in results.items():
        if isinstance(d, dict) and "error" in d:
            table.add_row(suite, "suite failed", "error", "", "[red]FAIL[/]")
    show(table)
    console.print(
        "target: the speed, size or accuracy the project aims for (docs/PERFORMANCE.md: which "
        "are met); FAIL marks a miss on this run (a busy machine misses more: see CPU share) "
        "and sets the exit code only with --check",
        highlight=False,
    )
    for suite, d in results.items():
        if not isinstance(d, dict) or suite in ("meta",):
            continue
        if "error" in d:
            console.print(f"[bold]{suite}[/] failed: {d['error']}", highlight=False)
        elif "on" in d:
            console.print(f"[bold]{suite}[/] on: {_on(d)}", highlight=False)
    scaling = results.get("pdgd_kernel", {}).get("scaling") or []
    if len(scaling) > 1:
        st = Table(title="PDGD kernel alone, a round's batch by threads (--threads)")
        for col in ("threads", "wall ms", "CPU ms", "queries/s", "per CPU s", "speed-up"):
            st.add_column(col, justify="right")
        st.add_column("serial share (Amdahl)", justify="right")
        for r in scaling:
            share = r.get("serial_share")
            st.add_row(
                str(r["threads"]),
                f"{r['wall_s'] * 1e3:.2f}",
                f"{r['cpu_s'] * 1e3:.2f}",
                _fmt(r["queries_per_s"]),
                _fmt(r["queries_per_cpu_s"]),
                f"{r['speedup']:.2f}x",
                "" if share is None else f"{share:.2f}",
            )
        show(st)
    rows = results.get("reference", {}).get("rows")
    if rows:
        rt = Table(title=f"next to {results['reference']['name']}")
        for col in ("metric", "this run", "CPU share", "reference", "times better", "on"):
            rt.add_column(col, justify="left" if col in ("metric", "on") else "right")
        for r in rows:
            cpu = "" if r["cpu_share"] is None else f"{r['cpu_share']:.2f}"
            rt.add_row(
                r["metric"],
                _fmt(r["ours"]),
                cpu,
                _fmt(r["reference"]),
                f"{r['times_better']:.1f}x",
                str(r["reference_on"]),
            )
        show(rt)
    rows = results.get("secagg", {}).get("rows")
    if rows:
        st = Table(title="secure aggregation: cost per round against the number of clients")
        for col in ("clients", "graph", "dropout", "rounds ok", "messages", "kB/client", "s"):
            st.add_column(col, justify="right")
        for r in rows:
            graph = (
                "plain"
                if not r["secure"]
                else ("complete" if r["degree"] == 0 else f"k={r['degree']}")
            )
            st.add_row(
                str(r["clients"]),
                graph,
                f"{r['dropout']:.0%}",
                f"{r['completed_rounds']}/{r['rounds']}",
                f"{r['messages_per_round']:.0f}",
                f"{r['bytes_per_client_round'] / 1e3:.1f}",
                f"{r['wall_s_per_round']:.3f}",
            )
        show(st)
    rows = results.get("csfltr", {}).get("rows")
    if rows:
        ct = Table(title="CS-F-LTR reverse top-K on one owner: RTK-Sketch vs NAIVE per term")
        ct.caption = "cover: rankable terms / all terms; kB per answer; MB: RTK-Sketch / sketches"
        for col in ("docs", "rankable", "RTK ms", "NAIVE ms", "x", "RTK cover", "NAIVE cover"):
            ct.add_column(col, justify="right")
        for col in ("kB", "MB"):
            ct.add_column(col, justify="right")
        for r in rows:
            a, b = r["rtk"], r["naive"]
            ct.add_row(
                str(r["docs"]),
                f"{r['rankable_terms']}/{r['terms']}",
                f"{a['ms_per_term']:.3f}",
                f"{b['ms_per_term']:.2f}",
                f"{r['speedup']:.1f}",
                f"{a['cover_rate_rankable'] or 0:.3f} / {a['cover_rate']:.3f}",
                f"{b['cover_rate_rankable'] or 0:.3f} / {b['cover_rate']:.3f}",
                f"{a['bytes_per_term'] / 1e3:.0f} / {b['bytes_per_term'] / 1e3:.0f}",
                f"{a['memory_bytes'] / 1e6:.0f} / {b['memory_bytes'] / 1e6:.0f}",
            )
        console.print(ct)
    for suite in ("fpdgd", "foltr_es"):
        prof = results.get(suite, {}).get("profile")
        if not prof:
            continue
        pt = Table(title=f"cProfile of the timed {suite} rounds: own time per file")
        for col in ("file", "own s", "share"):
            pt.add_column(col, justify="left" if col == "file" else "right")
        for r in prof["files"][:12]:
            pt.add_row(r["file"], f"{r['tottime_s']:.3f}", f"{r['share']:.0%}")
        console.print(pt)
        pt = Table(title=f"cProfile of the timed {suite} rounds: top functions by own time")
        for col in ("function", "calls", "own s", "share", "cumulative s"):
            pt.add_column(col, justify="left" if col == "function" else "right")
        for r in prof["functions"]:
            pt.add_row(
                r["function"],
                str(r["calls"]),
                f"{r['tottime_s']:.3f}",
                f"{r['share']:.0%}",
                f"{r['cumtime_s']:.3f}",
            )
        console.print(pt)


#: (suite, key) rows a reference file may give, and whether more is better
REFERENCE_KEYS = {
    ("fpdgd", "queries_per_s"): True,
    ("fpdgd", "s_per_round"): False,
    ("fpdgd", "paper_run_s"): False,
    ("pdgd", "interactions_per_s"): True,
    ("eval", "queries_per_s"): True,
    ("foltr_es", "s_per_round"): False,
    ("startup", "s"): False,
}


def load_reference(path: Path) -> dict[str, dict]:
    """Recorded figures of another implementation (e.g. the papers' authors' code), as JSON::

        {"name": "authors' code", "fpdgd": {"queries_per_s": 1800, "s_per_round": 1.1,
         "on": "1000 clients x 2 queries, MSLR-shaped, same machine"}, "foltr_es": {...}}

    Only the metrics of ``REFERENCE_KEYS`` are compared; ``on`` says what they were measured on.
    """
    try:
        ref = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FoltrError(f"--reference {path}: cannot read a JSON object ({e})") from None
    if not isinstance(ref, dict):
        raise FoltrError(f"--reference {path}: expected a JSON object of suites")
    for (suite, key), _ in REFERENCE_KEYS.items():
        v = ref.get(suite, {}).get(key) if isinstance(ref.get(suite), dict) else None
        if v is not None and not (isinstance(v, int | float) and v > 0):
            raise FoltrError(f"--reference {path}: {suite}.{key} must be a positive number")
    return ref


def compare(results: dict, ref: dict) -> list[dict]:
    """Rows of this run's figure next to the reference's, with how many times better."""
    rows = []
    for (suite, key), more_is_better in REFERENCE_KEYS.items():
        theirs = ref.get(suite, {}).get(key) if isinstance(ref.get(suite), dict) else None
        ours = results.get(suite, {}).get(key)
        if theirs is None or ours is None:
            continue
        rows.append(
            {
                "metric": f"{suite}.{key}",
                "ours": ours,
                "reference": theirs,
                "times_better": ours / theirs if more_is_better else theirs / ours,
                "cpu_share": results[suite].get("cpu_share"),
                "reference_on": ref[suite].get("on", ""),
            }
        )
    return rows
