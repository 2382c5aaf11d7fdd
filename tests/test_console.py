import fcntl
import io
import json
import logging
import os
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import structlog
from rich.console import Console

from foltr_async.errors import ScenarioError
from foltr_async.observe.console import LiveConsole, PlainReporter, make_reporter, sparkline
from foltr_async.observe.log import close_logging, configure_logging
from foltr_async.observe.progress import ProgressLines

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
INFO = {
    "scenario": "demo",
    "out_dir": "results/demo",
    "seed": 3,
    "variants": ["10H-0M", "9H-1M"],
    "repeats": 2,
    "rounds": {"10H-0M": 50, "9H-1M": 50},
    "reference": "10H-0M",
    "metric": "ndcg@10",
}
MESSAGES = {"sent": 120, "delivered": 110, "bytes": 40960, "dropped": {"loss": 7, "late": 3}}


@pytest.fixture(autouse=True)
def _reset_logging():
    yield
    close_logging()
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def feed(obs, n_agents=5, rounds=40, variant="9H-1M"):
    obs.run_started(INFO)
    obs.repeat_started(variant, 1, 1234)
    obs.agent_changed("server", "server", "active", 0, None)
    for i in range(n_agents):
        obs.agent_changed(f"client-{i:04d}", "client", "active", 0, None)
    for r in range(1, rounds + 1):
        metrics = {"ndcg@10": 0.3 + 0.002 * r} if r % 5 == 0 else None
        obs.round_done(variant, 1, r, metrics=metrics, messages=MESSAGES, sim_time=2.0 * r)
    obs.agent_changed("client-0003", "client", "crashed", rounds, "update")
    obs.event("crash", agent="client-0003", round=rounds)


# --- rich live console -----------------------------------------------------------------------

PTY_SCRIPT = textwrap.dedent(
    """
    from foltr_async.observe.console import LiveConsole

    info = {info!r}
    msgs = {msgs!r}
    with LiveConsole(refresh_per_second=20) as live:
        live.run_started(info)
        live.repeat_started("9H-1M", 1, 1234)
        for i in range(6):
            live.agent_changed(f"client-{{i:04d}}", "client", "active", 0, None)
        for r in range(1, 38):
            m = {{"ndcg@10": 0.3 + 0.004 * r}} if r % 4 == 0 else None
            live.round_done("9H-1M", 1, r, metrics=m, messages=msgs, sim_time=1.5 * r)
            if r == 20:
                live.event("attack", agent="eve-0", kind="lie")
                live._live.refresh()  # a frame mid-run, however slow the refresh thread is
        live.agent_changed("eve-0", "attacker", "malicious", 37, "update")
    """
)


def test_live_console_draws_in_a_pseudo_terminal(tmp_path):
    script = tmp_path / "feed.py"
    script.write_text(PTY_SCRIPT.format(info=INFO, msgs=MESSAGES))
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 130, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        proc.wait(timeout=30)
    raw = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, raw
    screen = ANSI.sub("", raw)
    assert "\x1b[" in raw  # drawn as a live terminal display, not plain text
    assert "round 37/50" in screen
    assert "round 20/50" in screen  # a frame drawn while the run was going
    for agent in ("client-0000", "client-0005", "eve-0"):
        assert agent in screen
    assert "malicious" in screen and "attack" in screen
    assert "9H-1M" in screen and "10H-0M (ref)" in screen
    assert re.search(r"[▁▂▃▄▅▆▇█]{5,}", screen)  # the metric sparkline
    assert "dropped" in screen or "drops" in screen


def tall() -> Console:
    """A terminal with room for the whole panel."""
    return Console(file=io.StringIO(), width=130, height=60)


def render(live: LiveConsole) -> str:
    out = io.StringIO()
    Console(file=out, width=130, force_terminal=False, color_system=None).print(live._render())
    return out.getvalue()


def test_live_console_summarises_large_federations():
    live = LiveConsole(tall(), max_agents=10)
    live.start = lambda: None  # render by hand, no live thread
    feed(live, n_agents=500)
    screen = render(live)
    assert "agents 501" in screen
    assert "client [active 499, crashed 1]" in screen
    assert "server [active 1]" in screen
    rows = [ln for ln in screen.splitlines() if re.search(r"\bclient-\d{4}\b +client", ln)]
    assert len(rows) == 10  # only the most recently changed agents
    assert "client-0003" in rows[0] and "crashed" in rows[0]
    assert "round 40/50" in screen
    assert "0.3800" in screen  # latest metric of the variant
    assert "loss 7" in screen and "sent 120" in screen
    assert "sent 120 (1.5/sim s" in screen  # 120 messages over 80 simulated seconds


def test_live_console_progress_over_repeats():
    live = LiveConsole(tall())
    live.start = lambda: None
    feed(live, rounds=50, variant="10H-0M")
    live.repeat_done("10H-0M", 1, {"seed": 1234, "offline": {"ndcg@10": [0.35, 0.4]}})
    live.repeat_started("9H-1M", 0, 99)
    live.round_done("9H-1M", 0, 1, metrics=None, messages=MESSAGES, sim_time=1.0)
    screen = render(live)
    assert "51/200 rounds" in screen
    assert "repeats 1/4" in screen
    assert "0.4000 ± 0.0000 (1)" in screen
    live.run_done({"variants": {}})
    assert "done" in render(live)


def test_sparkline_scales_to_range():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([0.5, 0.5]) == "▄▄"
    assert sparkline([np.nan, 1.0, 2.0]) == "▁█"
    assert sparkline([]) == ""
    assert len(sparkline(np.arange(100.0), width=24)) == 24


def test_make_reporter_picks_plain_output_off_a_terminal():
    def kinds(reporter) -> list[type]:
        return [type(o) for o in getattr(reporter, "observers", [reporter])]

    assert kinds(make_reporter(False, io.StringIO())) == [PlainReporter, ProgressLines]
    assert kinds(make_reporter(True, io.StringIO())) == [PlainReporter, ProgressLines]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(make_reporter(False, Tty()), LiveConsole)
    assert kinds(make_reporter(True, Tty())) == [PlainReporter, ProgressLines]


# --- plain reporter and structlog setup ------------------------------------------------------


def test_plain_reporter_logs_evaluated_rounds_and_repeats(tmp_path):
    err = io.StringIO()
    configure_logging(
        events_path=tmp_path / "events.jsonl", json_logs=True, console=False, stream=err
    )
    rep = PlainReporter()
    feed(rep, rounds=20)
    rep.repeat_done(
        "9H-1M",
        1,
        {
            "seed": 1234,
            "offline": {"ndcg@10": [0.31, 0.34]},
            "online": {"ndcg@10_discounted": 88.5},
            "wall_s": 1.25,
        },
    )
    rep.run_done({"complete": True})
    lines = [json.loads(ln) for ln in err.getvalue().splitlines()]
    rounds = [ln for ln in lines if ln["event"] == "round"]
    assert [ln["round"] for ln in rounds] == [5, 10, 15, 20]
    assert rounds[0]["ndcg@10"] == pytest.approx(0.31) and rounds[0]["variant"] == "9H-1M"
    assert rounds[0]["dropped"] == 10 and rounds[0]["sim_time"] == 10.0
    (done,) = [ln for ln in lines if ln["event"] == "repeat_done"]
    assert done["ndcg@10"] == 0.34 and done["ndcg@10_discounted"] == 88.5 and done["seed"] == 1234
    assert [ln["event"] for ln in lines][0] == "run_started" and lines[-1]["event"] == "run_done"


def test_events_file_gets_everything_stderr_only_its_level(tmp_path):
    err = io.StringIO()
    path = tmp_path / "out" / "events.jsonl"
    configure_logging(events_path=path, json_logs=False, console=False, stream=err)
    log = structlog.get_logger()
    structlog.contextvars.bind_contextvars(variant="9H-1M")
    log.bind(repeat=2).info("round", round=np.int64(7), **{"ndcg@10": np.float32(0.5)})
    log.debug("drop", reason="loss", src="client-0001")
    log.warning("slow", extra=float("nan"))
    close_logging()
    events = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["round", "drop", "slow"]
    first = events[0]
    assert list(first)[:3] == ["timestamp", "level", "event"]
    assert first["round"] == 7 and first["ndcg@10"] == 0.5 and first["repeat"] == 2
    assert first["variant"] == "9H-1M" and first["level"] == "info"
    assert events[2]["extra"] is None
    text = err.getvalue()
    assert "round" in text and "round=7" in text and "variant=9H-1M" in text
    assert "drop" not in text  # debug only to the file
    assert "[warning] slow" in text
    assert not text.lstrip().startswith("{")


def test_held_debug_events_reach_the_file_in_order_by_each_info_event_and_close(tmp_path):
    """Debug events are rendered in bulk, yet none is lost or reordered: each info event finds
    every earlier event on disk (a killed run keeps them), and close writes the rest."""
    path = tmp_path / "events.jsonl"
    configure_logging(events_path=path, json_logs=False, console=False, stream=io.StringIO())
    log = structlog.get_logger()
    expected = []
    for r in range(2500):  # more than one bulk of held debug events
        log.debug("aggregation", round=r)
        expected.append(("aggregation", r))
        if r in (10, 1500):
            log.info("round", round=r)
            expected.append(("round", r))
            on_disk = [json.loads(ln) for ln in path.read_text().splitlines()]
            assert [(e["event"], e["round"]) for e in on_disk] == expected
    close_logging()
    events = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(e["event"], e["round"]) for e in events] == expected


def test_console_mode_keeps_stderr_to_warnings(tmp_path):
    err = io.StringIO()
    configure_logging(events_path=tmp_path / "e.jsonl", json_logs=True, console=True, stream=err)
    log = structlog.get_logger()
    log.info("round", round=1)
    log.error("crash", agent="client-9")
    logging.getLogger("asyncio").warning("Task was destroyed %s", "x")
    lines = [json.loads(ln) for ln in err.getvalue().splitlines()]
    assert [ln["event"] for ln in lines] == ["crash", "Task was destroyed x"]
    assert lines[1]["logger"] == "asyncio"
    close_logging()
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 3


def test_reconfiguring_closes_the_previous_file(tmp_path):
    err = io.StringIO()
    configure_logging(events_path=tmp_path / "a.jsonl", json_logs=False, console=False, stream=err)
    structlog.get_logger().info("first")
    configure_logging(events_path=tmp_path / "b.jsonl", json_logs=False, console=False, stream=err)
    structlog.get_logger().info("second")
    configure_logging(events_path=None, json_logs=False, console=False, stream=err)
    structlog.get_logger().info("third")
    assert [json.loads(x)["event"] for x in (tmp_path / "a.jsonl").read_text().splitlines()] == [
        "first"
    ]
    assert [json.loads(x)["event"] for x in (tmp_path / "b.jsonl").read_text().splitlines()] == [
        "second"
    ]
    assert "third" in err.getvalue()
    with pytest.raises(ScenarioError, match="log level"):
        configure_logging(events_path=None, json_logs=False, level="loud", console=False)


def test_live_console_progress_lines_go_to_the_file_not_the_screen(tmp_path):
    err = io.StringIO()
    configure_logging(
        events_path=tmp_path / "events.jsonl", json_logs=False, console=True, stream=err
    )
    live = LiveConsole(Console(file=io.StringIO()))
    live.start = lambda: None
    feed(live, rounds=10)
    live.repeat_done("9H-1M", 1, {"seed": 1234, "offline": {"ndcg@10": [0.31, 0.32]}})
    close_logging()
    events = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_started", "round", "round", "repeat_done"]
    assert err.getvalue() == ""


def test_rounds_after_training_do_not_push_progress_past_100_percent():
    live = LiveConsole(tall())
    live.start = lambda: None
    info = {**INFO, "variants": ["9H-1M"], "repeats": 1, "rounds": {"9H-1M": 40}}
    live.run_started(info)
    live.repeat_started("9H-1M", 0, 1)
    for r in range(1, 45):  # 40 training rounds, then 4 of unlearning calibration
        live.round_done("9H-1M", 0, r, metrics=None, messages=MESSAGES, sim_time=1.0 * r)
    screen = render(live)
    assert "40/40 rounds 100%" in screen
    assert "round 40/40 + 4 after training" in screen


def test_empty_rounds_show_on_the_current_line():
    live = LiveConsole(tall())
    live.start = lambda: None
    feed(live, rounds=3)
    assert "empty rounds" not in render(live)
    live.event("round_empty", variant="9H-1M", repeat=1, round=4, selected=5, replied=0)
    live.event("round_empty", variant="9H-1M", repeat=1, round=5, selected=5, replied=0)
    assert "empty rounds 2" in render(live)


def test_final_column_fits_an_80_column_terminal():
    live = LiveConsole(Console(file=io.StringIO()))
    live.start = lambda: None
    info = {**INFO, "variants": ["9H-1M-unlearned", "10H-0M"]}
    live.run_started(info)
    live.repeat_started("9H-1M-unlearned", 4, 1)
    for r in range(1, 200):
        metrics = {"ndcg@10": 0.3 + 0.001 * r} if r % 5 == 0 else None
        live.round_done("9H-1M-unlearned", 4, r, metrics=metrics, messages=MESSAGES, sim_time=r)
    live.repeat_done("9H-1M-unlearned", 4, {"offline": {"ndcg@10": [0.41234]}})
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=False, color_system=None).print(live._render())
    row = next(ln for ln in out.getvalue().splitlines() if ln.startswith("│ 9H-1M-unlearned "))
    assert "0.4123 ± 0.0000 (1)" in row and "…" not in row
    assert re.search(r"[▁▂▃▄▅▆▇█]{4,}", row)  # a shorter curve, still there


def test_events_level_filters_the_file_only(tmp_path):
    err = io.StringIO()
    path = tmp_path / "events.jsonl"
    configure_logging(
        events_path=path, json_logs=False, console=False, stream=err, events_level="info"
    )
    log = structlog.get_logger()
    log.debug("drop", reason="loss")
    log.info("round", round=1)
    close_logging()
    assert [json.loads(ln)["event"] for ln in path.read_text().splitlines()] == ["round"]
    with pytest.raises(ScenarioError, match="events level"):
        configure_logging(events_path=None, json_logs=False, console=False, events_level="loud")


def test_final_column_reads_the_tables_definition_of_final():
    """A repeat that measured nothing (no held-out query with a relevant document) has no final
    value in the table, so none in the console either: its nDCG 0 is no result."""
    live = LiveConsole(Console(file=io.StringIO()))
    live.start = lambda: None
    live.run_started(INFO)
    live.repeat_started("10H-0M", 0, 1)
    live.repeat_done("10H-0M", 0, {"offline": {"ndcg@10": [0.5]}})
    live.repeat_started("10H-0M", 1, 2)
    live.repeat_done("10H-0M", 1, {"offline": {"ndcg@10": [0.0]}, "judged_queries": 0})
    screen = render(live)
    assert "0.5000 ± 0.0000 (1)" in screen and "(2)" not in screen


def test_a_finished_repeat_never_reads_past_its_planned_rounds():
    live = LiveConsole(tall())
    live.start = lambda: None
    info = {**INFO, "variants": ["9H-1M"], "repeats": 1, "rounds": {"9H-1M": 40}}
    live.run_started(info)
    live.repeat_started("9H-1M", 0, 1)
    for r in range(1, 45):  # 40 training rounds, then 4 of unlearning calibration
        live.round_done("9H-1M", 0, r, metrics=None, messages=MESSAGES, sim_time=1.0 * r)
    live.repeat_done("9H-1M", 0, {"seed": 1, "offline": {"ndcg@10": [0.4]}})
    live.run_done({"variants": {}})
    screen = render(live)  # the last frame
    assert "round 44/40" not in screen
    assert "round 40/40 + 4 after training" in screen
    assert "40/40 rounds 100%" in screen and "repeats 1/1" in screen


def test_an_80x24_terminal_gets_a_compact_panel_that_fits():
    live = LiveConsole(Console(file=io.StringIO(), width=80, height=24), max_agents=10)
    live.start = lambda: None
    variants = [f"{p}%-{agg}" for p in (0, 20, 40) for agg in ("fedavg", "krum", "median")]
    variants += [f"{v}-{i}" for i in range(2) for v in variants]  # 27 variants
    info = {**INFO, "variants": variants, "rounds": dict.fromkeys(variants, 50)}
    live.run_started(info)
    live.repeat_started(variants[0], 0, 1)
    for i in range(300):
        live.agent_changed(f"client-{i:04d}", "client", "active", 0, None)
    for r in range(1, 31):
        metrics = {"ndcg@10": 0.3 + 0.002 * r} if r % 5 == 0 else None
        live.round_done(variants[0], 0, r, metrics=metrics, messages=MESSAGES, sim_time=r)
        live.event("attack", agent="eve-0", round=r)
    out = io.StringIO()
    Console(file=out, width=80, height=24, force_terminal=False, color_system=None).print(
        live._render()
    )
    screen = out.getvalue().splitlines()
    assert len(screen) <= 24
    assert all(len(line) <= 80 for line in screen)
    text = "\n".join(screen)
    assert "overall" in text and "round 30/50" in text
    assert "0%-fedavg" in text and "more variants" in text
    tall_live = LiveConsole(tall(), max_agents=10)  # the same run on a tall terminal: all of it
    tall_live.start = lambda: None
    tall_live.run_started({**info, "variants": variants[:2]})
    tall_live.repeat_started(variants[0], 0, 1)
    tall_live.agent_changed("client-0000", "client", "active", 0, None)
    tall_live.event("attack", agent="eve-0", round=1)
    full = render(tall_live)
    assert "client-0000" in full and "attack" in full and "more variants" not in full


def test_progress_lines_say_repeat_k_of_n_and_an_eta_at_a_wall_clock_cadence():
    now = [0.0]
    out = io.StringIO()
    lines = ProgressLines(out, every=30.0, clock=lambda: now[0])
    info = {**INFO, "rounds": {"10H-0M": 50, "9H-1M": 50}}  # 2 variants x 2 repeats
    lines.run_started(info)
    for k, (variant, rep) in enumerate([("10H-0M", 0), ("9H-1M", 0)]):
        lines.repeat_started(variant, rep, 7 + k)
        for r in range(1, 56):  # 50 training rounds, 5 after: no progress past 100%
            now[0] += 1.0  # one wall second a round
            lines.round_done(variant, rep, r, metrics=None, messages=MESSAGES, sim_time=r)
        lines.repeat_done(variant, rep, {"seed": 7 + k, "offline": {"ndcg@10": [0.3, 0.41]}})
    text = out.getvalue().splitlines()
    assert text == [
        "demo: 2 variants x 2 repeats = 4 runs, 200 rounds",
        "repeat 1 of 4: 10H-0M (seed 7) round 30/50; overall 15%, wall 0:00:30, ETA 0:02:50",
        "repeat 1 of 4 done: 10H-0M (seed 7) ndcg@10 0.4100; overall 25%, wall 0:00:55, "
        "ETA 0:02:45",
        "repeat 2 of 4: 9H-1M (seed 8) round 30/50; overall 40%, wall 0:01:25, ETA 0:02:07",
        "repeat 2 of 4 done: 9H-1M (seed 8) ndcg@10 0.4100; overall 50%, wall 0:01:50, ETA 0:01:50",
    ]
    assert len(text) == 5  # a line per repeat, round lines no more often than every 30 s


def test_a_piped_run_prints_progress_lines_not_the_panel(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "foltr_async",
            str(ROOT / "scenarios" / "fpdgd_batch.toml"),
            "--only",
            "B2",
            "--set",
            "federation.rounds=3",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout  # no terminal drawing in a file
    assert "repeat 1 of 2 done: B2 (seed 1) ndcg@10 " in proc.stdout
    assert "repeat 2 of 2 done: B2 (seed 2)" in proc.stdout and "overall 100%" in proc.stdout
