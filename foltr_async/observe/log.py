"""structlog as the one logging path of a run.

Every event logged through ``structlog.get_logger()`` (with its bound or contextvar context such
as variant, repeat, round) goes to two sinks from one processor chain:

- ``events.jsonl`` in the out dir: one JSON object per line, every level from debug up (or from
  ``events_level``), so high-rate debug events (message drops, every round's aggregation) are
  kept for later analysis without reaching a screen;
- stderr: readable ``key=value`` lines (or JSON lines with ``json_logs``) from ``level`` up, and
  only warnings and errors while the rich live console owns the terminal.

stdlib ``logging`` warnings (asyncio, third-party libraries) are forwarded into the same chain.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import structlog

from foltr_async.errors import ScenarioError

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_HEAD = ("timestamp", "level", "event", "logger")


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON data: numpy scalars and arrays unwrapped, NaN/inf as None, paths and
    other unknown objects as strings (a log line or result file must never fail to encode)."""
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [jsonable(v) for v in obj]
    return str(obj)


def _kv_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str):
        return v if v and not any(c.isspace() or c in "\"'=" for c in v) else repr(v)
    return json.dumps(v, separators=(",", ":")) if isinstance(v, dict | list) else str(v)


def render_kv(ev: Mapping[str, Any]) -> str:
    """One readable line: ``time [level] event key=value ...`` (+ traceback lines if any)."""
    ts = str(ev.get("timestamp", ""))
    head = f"{ts[11:23] if len(ts) >= 23 else ts} [{ev.get('level', ''):<7}] {ev.get('event', '')}"
    rest = [
        f"{k}={_kv_value(v)}"
        for k, v in ev.items()
        if k not in ("timestamp", "level", "event", "exception")
    ]
    line = " ".join([head, *rest])
    exc = ev.get("exception")
    return f"{line}\n{exc}" if exc else line


def render_json(ev: Mapping[str, Any]) -> str:
    return json.dumps(ev, ensure_ascii=False, separators=(",", ":"))


def _ordered_plain(_logger: Any, _name: str, ev: dict) -> dict:
    """Put timestamp/level/event first and make every value JSON-safe."""
    out = {k: jsonable(ev[k]) for k in _HEAD if k in ev}
    for k, v in ev.items():
        if k not in out:
            out[k] = jsonable(v)
    return out


class _Sinks:
    """Where rendered events go; swapped as a whole on every reconfiguration.

    Debug events for the file are kept as dicts and rendered in bulk (``DEBUG_BATCH`` at a time,
    before any event of level info or up, and on close): rendered one at a time between rounds,
    with cold caches, each cost ~5x more CPU than in a batch.
    """

    #: debug events held before rendering: a few hundred KB of dicts at most
    DEBUG_BATCH = 1024

    def __init__(
        self,
        file: IO[str] | None,
        stderr_level: int,
        json_logs: bool,
        stream: IO[str] | None,
        file_level: int = LEVELS["debug"],
    ) -> None:
        self.file = file
        self.file_level = file_level
        self.stderr_level = stderr_level
        self.json_logs = json_logs
        self.stream = stream
        self.lock = threading.Lock()
        self.held: list[dict] = []

    def emit(self, ev: dict) -> None:
        level = LEVELS.get(ev.get("level", "info"), 20)
        with self.lock:
            if self.file is not None and not self.file.closed and level >= self.file_level:
                if level >= LEVELS["info"]:  # the rest survive a kill
                    self._write_held()
                    self.file.write(render_json(ev) + "\n")
                    self.file.flush()
                else:
                    self.held.append(ev)
                    if len(self.held) >= self.DEBUG_BATCH:
                        self._write_held()
            if level >= self.stderr_level:
                # resolved per call: rich Live and pytest replace sys.stderr while running
                stream = self.stream or sys.stderr
                stream.write((render_json(ev) if self.json_logs else render_kv(ev)) + "\n")
                stream.flush()

    def _write_held(self) -> None:
        """The held debug events into the file, in the order they came (lock held)."""
        if self.held:
            self.file.write("".join([render_json(ev) + "\n" for ev in self.held]))
            self.held.clear()

    def close(self) -> None:
        with self.lock:
            if self.file is not None and not self.file.closed:
                self._write_held()
                self.file.close()
            self.file = None


class _SinkLogger:
    """The structlog "logger" at the end of the chain: hands the event dict to the sinks."""

    def __init__(self, sinks: _Sinks) -> None:
        self._sinks = sinks

    def _emit(self, **ev: Any) -> None:
        self._sinks.emit(ev)

    msg = debug = info = warning = warn = error = critical = fatal = exception = _emit


class _ForwardHandler(logging.Handler):
    """Sends stdlib log records (asyncio, libraries) through structlog."""

    def emit(self, record: logging.LogRecord) -> None:
        level = max(lv for lv in LEVELS.values() if lv <= max(record.levelno, 10))
        try:
            structlog.get_logger(record.name).log(
                level, record.getMessage(), logger=record.name, exc_info=record.exc_info
            )
        except Exception:  # pragma: no cover - logging must never raise into the caller
            self.handleError(record)


_state: dict[str, Any] = {"sinks": None, "handler": None}
_state_lock = threading.Lock()


def configure_logging(
    *,
    events_path: Path | None,
    json_logs: bool,
    level: str = "info",
    console: bool,
    stream: IO[str] | None = None,
    events_level: str = "debug",
) -> None:
    """(Re)configure structlog for a run; closes the events file of any earlier configuration.

    ``level`` is the stderr threshold, ``events_level`` the events file's: below both, a log
    call returns at once (~1 us instead of the ~30 us of a line written). With ``console`` (rich
    live display active) stderr only gets warnings and errors. ``stream`` replaces stderr
    (tests; default: ``sys.stderr`` at the time of each write).
    """
    name, file_name = str(level).lower(), str(events_level).lower()
    for what, value in (("log level", name), ("events level", file_name)):
        if value not in LEVELS:
            raise ScenarioError(f"{what}: expected one of {', '.join(LEVELS)}, got {value!r}")
    stderr_level = max(LEVELS[name], LEVELS["warning"]) if console else LEVELS[name]
    file_level = LEVELS[file_name]
    with _state_lock:
        _shutdown_locked()
        file = None
        if events_path is not None:
            path = Path(events_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close_logging
        sinks = _Sinks(file, stderr_level, json_logs, stream, file_level)
        min_level = min(stderr_level, file_level) if file is not None else stderr_level
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                _ordered_plain,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(min_level),
            logger_factory=lambda *_args: _SinkLogger(sinks),
            cache_logger_on_first_use=False,
        )
        handler = _ForwardHandler(level=logging.WARNING)
        logging.getLogger().addHandler(handler)
        _state["sinks"] = sinks
        _state["handler"] = handler


def _shutdown_locked() -> None:
    sinks, handler = _state["sinks"], _state["handler"]
    if handler is not None:
        logging.getLogger().removeHandler(handler)
    if sinks is not None:
        sinks.close()
    _state["sinks"] = _state["handler"] = None


def close_logging() -> None:
    """Flush and close the events file and detach from stdlib logging.

    Later log calls still reach stderr with the last thresholds, so a late warning is not lost.
    """
    with _state_lock:
        sinks = _state["sinks"]
        _shutdown_locked()
        if sinks is not None:
            sinks_left = _Sinks(None, sinks.stderr_level, sinks.json_logs, sinks.stream)
            structlog.configure(
                wrapper_class=structlog.make_filtering_bound_logger(sinks.stderr_level),
                logger_factory=lambda *_args: _SinkLogger(sinks_left),
            )


atexit.register(close_logging)
