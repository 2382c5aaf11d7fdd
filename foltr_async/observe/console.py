"""What a person watching a run sees: a rich live console, or plain structured lines.

:class:`LiveConsole` only records state in the observer calls (O(1) each, under a lock) and
builds the screen in rich's refresh thread at ``refresh_per_second``; so a runner that reports
thousands of simulated rounds per wall second pays almost nothing, and large federations are
shown as counts per role/state plus the most recently changed agents, never as a huge table.
:class:`PlainReporter` is for pipes, CI logs and ``--quiet``: one structlog line per evaluated
round and per repeat, beside ``progress.ProgressLines`` in place of the panel. On a terminal
too small for the whole panel, it shows what fits: progress first, then the metrics.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter, deque
from itertools import islice
from typing import IO, Any

import numpy as np
import structlog
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from foltr_async.observe.observer import Observer, Observers
from foltr_async.observe.progress import ProgressLines, clock_text
from foltr_async.observe.results import final_value, learner_path, nobody_online_share
from foltr_async.observe.stats import summarise

BLOCKS = np.array(list("▁▂▃▄▅▆▇█"))
SPARK_WIDTH = 24  # the most recent evaluations a curve shows
BAR_WIDTH = 30  # progress bars on a wide terminal
_STATE_STYLE = {
    "active": "green",
    "joined": "green",
    "idle": "cyan",
    "training": "green",
    "left": "dim",
    "crashed": "red",
    "malicious": "magenta",
    "unlearned": "yellow",
}


def sparkline(values: Any, width: int = 24) -> str:
    """The last ``width`` finite values as unicode blocks scaled to their own min..max."""
    v = np.asarray(list(values)[-width:], dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return ""
    lo, hi = float(v.min()), float(v.max())
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return "".join(BLOCKS[np.full(v.size, 3)])
    return "".join(BLOCKS[np.rint((v - lo) / (hi - lo) * 7).astype(np.int64)])


def _human(x: float) -> str:
    """Compact number: 950, 12.3k, 4.56M."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}" if isinstance(x, float) and not float(x).is_integer() else f"{int(x)}"


def _fields(fields: dict, limit: int = 90) -> str:
    text = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )
    return text if len(text) <= limit else text[: limit - 1] + "…"


class LiveConsole(Observer):
    """Rich live view of a run: progress, agents, message rates, metrics, recent events.

    Use as a context manager (starts and stops ``rich.live.Live``). ``max_agents`` is the
    number of agent rows shown; beyond it the table switches to counts per role and state plus
    the ``max_agents`` most recently changed agents. With ``log_lines`` it also logs the
    :class:`PlainReporter` lines, which reach events.jsonl (stderr shows only warnings while the
    console is live), so a live run's log file holds its progress too.
    """

    def __init__(
        self,
        console: Console | None = None,
        refresh_per_second: float = 8,
        *,
        max_agents: int = 10,
        max_events: int = 8,
        log_lines: bool = True,
    ) -> None:
        self.console = console or Console()
        self._plain = PlainReporter() if log_lines else Observer()
        self.refresh_per_second = refresh_per_second
        self.max_agents = max_agents
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._implicit = False
        # run
        self._info: dict = {}
        self._t0 = time.monotonic()
        self._rounds_finished = 0  # rounds of finished repeats
        self._repeats_finished = 0
        self._complete: bool | None = None
        # current repeat
        self._cur: dict[str, Any] = {}
        self._cur_rounds = 0  # training rounds (up to the variant's planned rounds)
        self._cur_after = 0  # rounds of a later phase (e.g. unlearning calibration)
        self._cur_empty = 0  # rounds that took in no client update
        self._cur_nobody = 0  # of them, rounds that began with no client online
        self._rep_t0 = self._t0
        self._messages: dict = {}
        self._sim_time = 0.0
        # agents, metrics, events
        self._agents: dict[str, tuple[str, str, int, str | None]] = {}
        self._counts: Counter[tuple[str, str]] = Counter()
        self._latest: dict[str, tuple[int, float]] = {}
        self._history: dict[str, deque[float]] = {}
        self._finals: dict[str, list[float]] = {}
        self._events: deque[tuple[str, str, str]] = deque(maxlen=max_events)

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._live is None:
            self._live = Live(
                console=self.console,
                refresh_per_second=self.refresh_per_second,
                get_renderable=self._render,
                redirect_stdout=True,
                redirect_stderr=True,
            )
            self._live.start()

    def stop(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()  # renders the final state once more

    def __enter__(self) -> LiveConsole:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- observer ---------------------------------------------------------------------------
    def run_started(self, info: dict) -> None:
        self._plain.run_started(info)
        with self._lock:
            self._info = dict(info)
            self._t0 = time.monotonic()
            for name in info.get("variants", []):
                self._history.setdefault(name, deque(maxlen=48))
        if self._live is None:
            self._implicit = True
            self.start()

    def repeat_started(self, variant: str, repeat: int, seed: int) -> None:
        with self._lock:
            self._cur = {"variant": variant, "repeat": repeat, "seed": seed, "round": None}
            self._cur_rounds = self._cur_after = self._cur_empty = self._cur_nobody = 0
            self._rep_t0 = time.monotonic()
            self._messages = {}
            self._sim_time = 0.0
            self._agents.clear()
            self._counts.clear()
            self._history.setdefault(variant, deque(maxlen=48)).clear()

    def agent_changed(
        self,
        agent_id: str,
        role: str,
        state: str,
        rounds_joined: int,
        last_kind: str | None,
    ) -> None:
        with self._lock:
            old = self._agents.pop(agent_id, None)  # re-insert: dict order = recency
            if old is not None:
                self._counts[(old[0], old[1])] -= 1
            self._agents[agent_id] = (role, state, rounds_joined, last_kind)
            self._counts[(role, state)] += 1

    def round_done(
        self,
        variant: str,
        repeat: int,
        round: int,
        *,
        metrics: dict[str, float] | None,
        messages: dict,
        sim_time: float,
    ) -> None:
        if metrics:
            self._plain.round_done(
                variant, repeat, round, metrics=metrics, messages=messages, sim_time=sim_time
            )
        with self._lock:
            planned = int((self._info.get("rounds") or {}).get(variant, 0))
            if planned and round > planned:
                self._cur_after += 1  # progress is of the planned training rounds
            else:
                self._cur_rounds += 1
            self._cur["round"] = round
            self._messages = messages
            self._sim_time = sim_time
            metric = self._info.get("metric", "ndcg@10")
            if metrics and metrics.get(metric) is not None:
                value = float(metrics[metric])
                self._latest[variant] = (round, value)
                self._history.setdefault(variant, deque(maxlen=48)).append(value)

    def event(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._events.append((time.strftime("%H:%M:%S"), event, _fields(fields)))
            if event == "round_empty":
                self._cur_empty += 1
                self._cur_nobody += fields.get("online") == 0

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        self._plain.repeat_done(variant, repeat, result)
        metric = self._info.get("metric", "ndcg@10")
        final = final_value(result, metric)  # the table's and the conclusions' definition
        with self._lock:
            # the finished repeat's line stays as it ended (its rounds now count as finished):
            # resetting its after-training rounds here drew its last round over the planned
            # ones ("round 220/200") until the next repeat started
            self._rounds_finished += self._cur_rounds
            if self._cur:
                self._cur["finished"] = True
            self._repeats_finished += 1
            if final is not None:
                self._finals.setdefault(variant, []).append(float(final))

    def run_done(self, results: dict) -> None:
        self._plain.run_done(results)
        with self._lock:
            self._complete = not results.get("interrupted", False)
        if self._implicit:
            self.stop()

    # --- rendering (rich's refresh thread) ---------------------------------------------------
    def _render(self) -> Panel:
        with self._lock:
            parts = _fit(
                self.console.height - 2,  # inside the panel's borders
                self._progress(),
                self._metrics(),
                self._rates(),
                self._events_table(),
                self._agents_table(),
            )
            info = self._info
        title = f"foltr_async · {info.get('scenario', '')}"
        if info.get("seed") is not None:
            title += f" · seed {info['seed']}"
        subtitle = str(info.get("out_dir", "")) or None
        if self._complete is not None:
            subtitle = ("done" if self._complete else "stopped") + (
                f" · {subtitle}" if subtitle else ""
            )
        return Panel(Group(*parts), title=title, subtitle=subtitle)

    def _progress(self) -> Table:
        info = self._info
        variants = info.get("variants") or []
        repeats = int(info.get("repeats") or 1)
        rounds = info.get("rounds") or {}
        total = sum(int(rounds.get(v, 0)) for v in variants) * repeats
        cur = self._cur
        done = self._rounds_finished + (0 if cur.get("finished") else self._cur_rounds)
        elapsed = time.monotonic() - self._t0
        # a narrow terminal gets shorter bars, so each line stays one line
        bar = max(8, min(BAR_WIDTH, self.console.width - 90))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(no_wrap=True)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        eta = ""
        if total and done:
            eta = f"  ETA {clock_text(elapsed * (total - done) / done)}"
        pct = f"{100 * done / total:.0f}%" if total else ""
        grid.add_row(
            "overall",
            ProgressBar(total=max(total, 1), completed=min(done, total or 0), width=bar),
            f"{done}/{total} rounds {pct}  repeats {self._repeats_finished}/"
            f"{repeats * len(variants)}  wall {clock_text(elapsed)}{eta}",
        )
        if cur:
            v = cur["variant"]
            planned = int(rounds.get(v, 0))
            rnd = "-" if cur["round"] is None else str(cur["round"])
            if self._cur_after:
                rnd = f"{planned}/{planned} + {self._cur_after} after training"
            else:
                rnd += f"/{planned or '?'}"
            line = Text(
                f"{v}  repeat {cur['repeat'] + 1}/{repeats} (seed {cur['seed']})  "
                f"round {rnd}  sim {self._sim_time:.1f}s",
                no_wrap=True,
                overflow="ellipsis",
            )
            if self._cur_empty:
                line.append(f"  empty rounds {self._cur_empty}", style="bold red")
                if self._cur_nobody:
                    line.append(f" (nobody online in {self._cur_nobody})", style="bold red")
            grid.add_row(
                "current",
                ProgressBar(
                    total=max(planned, 1), completed=min(self._cur_rounds, planned), width=bar
                ),
                line,
            )
        return grid

    def _rates(self) -> Text | None:
        m = self._messages
        if not m:
            return None
        wall = max(time.monotonic() - self._rep_t0, 1e-9)
        sim = self._sim_time

        def rate(x: float) -> str:
            per_sim = f"{_human(x / sim)}/sim s" if sim > 0 else "-/sim s"
            return f"{per_sim}, {_human(x / wall)}/wall s"

        sent = float(m.get("sent", 0))
        delivered = float(m.get("delivered", 0))
        nbytes = float(m.get("bytes", 0))
        dropped = m.get("dropped") or {}
        n_drop = float(sum(dropped.values()))
        text = Text()
        text.append("messages ", style="bold")
        text.append(f"sent {_human(sent)} ({rate(sent)})  delivered {_human(delivered)}  ")
        text.append(f"bytes {_human(nbytes)}B ({rate(nbytes)})\n")
        text.append("drops    ", style="bold")
        style = "red" if n_drop else ""
        text.append(f"{_human(n_drop)} ({rate(n_drop)})", style=style)
        if dropped:
            top = sorted(dropped.items(), key=lambda kv: -kv[1])[:5]
            text.append("  " + "  ".join(f"{k} {_human(v)}" for k, v in top), style="dim")
        return text

    def _metrics(self) -> Text | None:
        names = list(dict.fromkeys([*self._info.get("variants", []), *self._latest]))
        if not names:
            return None
        metric = self._info.get("metric", "ndcg@10")
        ref = self._info.get("reference")
        header = ("variant", f"{metric} latest", "at round", "final (n)", "curve")
        rows = []
        for name in names:
            latest = self._latest.get(name)
            s = summarise(self._finals.get(name, []))
            rows.append(
                (
                    f"{name} (ref)" if name == ref else name,
                    "-" if latest is None else f"{latest[1]:.4f}",
                    "-" if latest is None else str(latest[0]),
                    f"{s['mean']:.4f} ± {s['std']:.4f} ({s['n']})" if s["n"] else "-",
                )
            )
        # the curve takes what the terminal has left (inside the panel), never the numbers
        used = sum(max(len(r[i]) for r in [header, *rows]) + 2 for i in range(4))
        width = max(4, min(SPARK_WIDTH, self.console.width - 4 - used))
        curves = [sparkline(self._history.get(name, ()), width) for name in names]
        rows = [(*r, c) for r, c in zip(rows, curves, strict=True)]
        return _columns(header, rows, right=(1, 2, 3), styles={4: "cyan"})

    def _agents_table(self) -> Text | None:
        if not self._agents:
            return None
        recent = islice(reversed(self._agents.items()), self.max_agents)
        rows = [
            (agent_id, role, state, str(rounds_joined), last_kind or "-")
            for agent_id, (role, state, rounds_joined, last_kind) in recent
        ]
        header = ("agent", "role", "state", "rounds", "last message")
        table = _columns(header, rows, right=(3,), styles={2: _STATE_STYLE})
        if len(self._agents) <= self.max_agents:
            return table
        counts = Text(no_wrap=True, overflow="ellipsis")
        counts.append(f"agents {len(self._agents)}: ", style="bold")
        by_role: dict[str, list[str]] = {}
        for (role, state), n in sorted(self._counts.items()):
            if n > 0:
                by_role.setdefault(role, []).append(f"{state} {n}")
        counts.append("   ".join(f"{r} [{', '.join(s)}]" for r, s in by_role.items()))
        counts.append(f"\nmost recent {self.max_agents}:\n", style="dim")
        return counts + table

    def _events_table(self) -> Text | None:
        if not self._events:
            return None
        return _columns(None, list(self._events), styles={0: "dim", 1: "bold"})


def _fit(height: int, progress: Table, *parts: Text | None) -> list:
    """The panel's parts that fit ``height`` lines, in order of importance (progress, then
    metrics, rates, events, agents); the metrics table keeps its header and as many variants
    as fit, saying how many it leaves out. The full panel needs ~36 lines: an 80x24 terminal
    shows the progress and the metrics of the variants that fit."""
    out: list = [progress]
    left = height - progress.row_count
    for i, part in enumerate(parts):
        if part is None:
            continue
        lines = part.plain.count("\n") + 1
        if lines <= left:
            out.append(part)
            left -= lines
        elif i == 0 and left >= 3:  # the metrics: header, the rows that fit, "... more"
            rows = part.split("\n")
            shown = left - 1
            more = Text(f"... {len(rows) - shown} more variants (a taller terminal shows them)")
            out.append(Text("\n", no_wrap=True).join([*rows[:shown], more]))
            left = 0
    return out


def _columns(
    header: tuple[str, ...] | None,
    rows: list[tuple[str, ...]],
    *,
    right: tuple[int, ...] = (),
    styles: dict[int, str | dict[str, str]] | None = None,
) -> Text:
    """Fixed-width columns as one Text: a rich Table costs ~10x more to lay out, and this is
    redrawn several times per second while the simulation shares the interpreter."""
    styles = styles or {}
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    text = Text(no_wrap=True, overflow="ellipsis")
    for n, row in enumerate(all_rows):
        if n:
            text.append("\n")
        for i, cell in enumerate(row):
            pad = widths[i] - len(cell)
            cell_text = " " * pad + cell if i in right else cell + " " * pad
            style = styles.get(i, "")
            if header and n == 0:
                style = "bold"
            elif isinstance(style, dict):
                style = style.get(cell, "")
            text.append(cell_text, style=style)
            if i < len(row) - 1:
                text.append("  ")
    return text


class PlainReporter(Observer):
    """One structured log line per evaluated round and per repeat (non-TTY, ``--quiet``).

    ``event()`` calls are not repeated here: the runner logs its events through structlog
    itself, and they reach the same sinks.
    """

    def __init__(self) -> None:
        self._log = structlog.get_logger("foltr_async.progress")
        self._metric = "ndcg@10"

    def run_started(self, info: dict) -> None:
        self._metric = info.get("metric", self._metric)
        self._log.info(
            "run_started",
            scenario=info.get("scenario"),
            seed=info.get("seed"),
            variants=info.get("variants"),
            repeats=info.get("repeats"),
            out_dir=info.get("out_dir"),
        )

    def round_done(
        self,
        variant: str,
        repeat: int,
        round: int,
        *,
        metrics: dict[str, float] | None,
        messages: dict,
        sim_time: float,
    ) -> None:
        if not metrics:
            return
        self._log.info(
            "round",
            variant=variant,
            repeat=repeat,
            round=round,
            **metrics,
            sent=messages.get("sent"),
            dropped=sum((messages.get("dropped") or {}).values()),
            sim_time=round_sim(sim_time),
        )

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        values = (result.get("offline") or {}).get(self._metric) or []
        self._log.info(
            "repeat_done",
            variant=variant,
            repeat=repeat,
            seed=result.get("seed"),
            **{self._metric: values[-1] if values else None},
            **(result.get("online") or {}),
            empty_rounds=(result.get("contributions") or {}).get("empty_rounds"),
            nobody_online=nobody_online_text(result.get("contributions") or {}),
            learner=learner_path(result.get("learner_interactions")),
            wall_s=result.get("wall_s"),
            sim_s=result.get("sim_s"),
        )

    def run_done(self, results: dict) -> None:
        self._log.info("run_done", complete=results.get("complete"))


def nobody_online_text(contrib: dict) -> str | None:
    """'N of R rounds, X% of the simulated time' began with no client online (None: unknown)."""
    if contrib.get("nobody_online_rounds") is None:
        return None
    share = nobody_online_share(contrib) or 0.0
    return (
        f"{contrib['nobody_online_rounds']} of {len(contrib['per_round'])} rounds, "
        f"{100 * share:.3g}% of the simulated time"
    )


def round_sim(t: float) -> float:
    """Simulated time rounded for a log line (6 significant digits)."""
    return float(f"{t:.6g}")


def make_reporter(quiet: bool, stream: IO[str] | None = None) -> Observer:
    """The live console on an interactive terminal; else (or with ``quiet``) plain log lines
    and, on ``stream``, progress lines ("repeat k of n", ETA) in place of the panel."""
    stream = stream if stream is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    if quiet or not (callable(isatty) and isatty()):
        return Observers([PlainReporter(), ProgressLines(stream)])
    return LiveConsole(Console(file=stream))
