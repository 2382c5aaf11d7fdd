"""What a privacy-audit canary leaves in the simulator's oracle (never in a message): its secret
bits, read by the auditor only to score its guesses (``protocols/audit.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: the oracle key of a canary's secret: (CANARY_TRUTH, canary id) -> CanaryTruth
CANARY_TRUTH = "audit.canary"


@dataclass
class CanaryTruth:
    """A canary's secret: the bit of each release (round, slot), and its FedAvg weight."""

    bits: dict[tuple[int, int], int] = field(default_factory=dict)
    weight: dict[int, int] = field(default_factory=dict)
    #: a canary owner's answers (CS-F-LTR): request -> its counts without the canary, the shift
    answers: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
