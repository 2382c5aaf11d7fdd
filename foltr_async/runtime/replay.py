"""The replay guard: each receiver drops a (source, seq) pair it accepted before."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from foltr_async.runtime.wire import Envelope

__all__ = ["ReplayGuard"]


@functools.cache
def _window_mask(window: int) -> int:
    """``window`` one bits, made once: every receiver has a guard and a 4096-bit int is ~0.5 kB
    (62,500 clients held 35 MB of equal masks)."""
    return (1 << window) - 1


class ReplayGuard:
    """Remembers the (src, seq) pairs one receiver accepted, in bounded memory and time.

    Per source: the highest seq seen and a bitmap of the ``window`` seqs below it (a Python
    int, bit i = seq ``high - i``). A seq seen before, or older than the window, is
    ``replayed``; one more than ``window`` above the highest (a source not seen yet counts from
    0) is ``seq_ahead``: honest senders number each link 1, 2, 3, ..., so a jump past the window
    is forged or corrupt. Accepting it would move the window past the real sender's numbers and
    silence it; since an accepted seq is at most ``window`` ahead, the sender's next real seq
    is still inside the window. State is at most ``window`` bits per source and at most
    ``max_sources`` sources (beyond that the oldest-tracked is forgotten), whatever the seqs.
    """

    __slots__ = ("window", "max_sources", "_mask", "_state")

    def __init__(self, window: int = 4096, max_sources: int = 65536) -> None:
        if window < 1:
            raise ValueError("ReplayGuard window must be >= 1")
        self.window = window
        self.max_sources = max_sources
        self._mask = _window_mask(window)
        self._state: dict[str, tuple[int, int]] = {}

    def check(self, env: Envelope) -> str | None:
        """None for a fresh (src, seq), now remembered; else the drop reason."""
        seq = env.seq
        st = self._state.get(env.src)
        high, bits = (0, 1) if st is None else st
        if seq > high:
            jump = seq - high
            if jump > self.window:
                return "seq_ahead"
            if st is None and len(self._state) >= self.max_sources:
                del self._state[next(iter(self._state))]
            self._state[env.src] = (seq, ((bits << jump) | 1) & self._mask)
            return None
        age = high - seq
        if age >= self.window or bits >> age & 1:
            return "replayed"
        self._state[env.src] = (high, bits | 1 << age)
        return None

    def highs(self) -> dict[str, int]:
        """The highest seq accepted from each source (a checkpoint of this guard)."""
        return {src: high for src, (high, _) in self._state.items()}

    def resume(self, highs: Mapping[str, int]) -> None:
        """Continue from ``highs()``: every seq up to each high counts as seen (nothing was in
        flight at the checkpoint), so a resumed receiver takes the next seqs and no replays."""
        for src, high in highs.items():
            self._state[src] = (high, self._mask)

    def forget(self, src: str) -> None:
        self._state.pop(src, None)
