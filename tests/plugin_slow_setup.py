"""A plugin protocol for tests/test_zmq.py (loaded through FOLTR_ASYNC_PLUGINS): FPDGD whose
first client built in a process takes ``FOLTR_TEST_SLOW_SETUP`` seconds, as loading a large
dataset or compiling does; the variable is given to workers only, so only their set-up is slow."""

from __future__ import annotations

import os
import time

from foltr_async.protocols import fpdgd
from foltr_async.protocols.api import ProtocolEntry

_slept: set[int] = set()  # processes that paid the delay (module state: not checkpointed)


class SlowSetupFPDGD(fpdgd.FPDGD):
    def client(self, agent_id, queries, rng):
        delay = float(os.environ.get("FOLTR_TEST_SLOW_SETUP", "0"))
        if delay and os.getpid() not in _slept:
            _slept.add(os.getpid())
            time.sleep(delay)  # blocks the worker's loop: no heartbeats meanwhile
        return super().client(agent_id, queries, rng)


PROVIDES = (
    ProtocolEntry(
        "fpdgd_slow_setup",
        "FPDGD whose first client takes a while to build",
        fpdgd.Params,
        SlowSetupFPDGD,
    ),
)
