"""Progress lines for output that is not a terminal (nohup, a batch scheduler's log file, a
pipe), where the live panel cannot redraw: one line per finished repeat ("repeat k of n"),
and during a long repeat a line at most every ``every`` wall seconds, each with the overall
share of rounds done, the wall time and an ETA."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

from foltr_async.observe.observer import Observer
from foltr_async.observe.results import learner_path

#: wall seconds between two round lines of one repeat (finished repeats always get a line)
EVERY_S = 30.0


def clock_text(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressLines(Observer):
    """Plain progress lines on ``stream``. ``clock`` (wall seconds) is injectable so what is
    printed when can be tested without waiting."""

    def __init__(
        self,
        stream: IO[str],
        *,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.every = every
        self.clock = clock
        self._t0 = self._last = clock()
        self._planned: dict[str, int] = {}
        self._metric = "ndcg@10"
        self._runs = 0  # variant x repeat runs planned
        self._total = 0  # their training rounds
        self._done_rounds = 0  # of finished repeats
        self._started = 0  # runs started so far (k of "repeat k of n")
        self._cur: dict[str, Any] = {}
        self._cur_rounds = 0

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self._last = self.clock()

    def _overall(self, done: int) -> str:
        elapsed = self.clock() - self._t0
        text = f"wall {clock_text(elapsed)}"
        if self._total:
            text = f"overall {100 * min(done, self._total) / self._total:.0f}%, {text}"
            if done:
                text += f", ETA {clock_text(elapsed * max(self._total - done, 0) / done)}"
        return text

    def run_started(self, info: dict) -> None:
        variants = list(info.get("variants") or [])
        repeats = int(info.get("repeats") or 1)
        self._planned = {v: int((info.get("rounds") or {}).get(v, 0)) for v in variants}
        self._metric = info.get("metric", self._metric)
        self._runs = len(variants) * repeats
        self._total = sum(self._planned.values()) * repeats
        self._t0 = self.clock()
        self._say(
            f"{info.get('scenario', 'run')}: {len(variants)} variants x {repeats} repeats = "
            f"{self._runs} runs, {self._total} rounds"
        )

    def repeat_started(self, variant: str, repeat: int, seed: int) -> None:
        self._started += 1
        self._cur = {"variant": variant, "seed": seed, "k": self._started}
        self._cur_rounds = 0

    def round_done(self, variant: str, repeat: int, round: int, **_: Any) -> None:
        planned = self._planned.get(variant, 0)
        if not planned or round <= planned:  # later phases (unlearning) add no progress
            self._cur_rounds += 1
        if self.clock() - self._last < self.every:
            return
        self._say(
            f"repeat {self._cur.get('k', '?')} of {self._runs}: {variant} "
            f"(seed {self._cur.get('seed')}) round {min(round, planned) if planned else round}"
            f"/{planned or '?'}; {self._overall(self._done_rounds + self._cur_rounds)}"
        )

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        planned = self._planned.get(variant, 0)
        self._done_rounds += self._cur_rounds or planned  # a resumed or reused one: all of it
        self._cur_rounds = 0
        values = (result.get("offline") or {}).get(self._metric) or []
        final = values[-1] if values else None
        value = f" {self._metric} {final:.4f}" if isinstance(final, int | float) else ""
        path = learner_path(result.get("learner_interactions"))
        learner = f", learner {path}" if path else ""
        self._say(
            f"repeat {self._cur.get('k', self._started)} of {self._runs} done: {variant} "
            f"(seed {result.get('seed', self._cur.get('seed'))}){value}{learner}; "
            f"{self._overall(self._done_rounds)}"
        )
