"""What a scenario may set for SecAgg (``[federation.secagg]``): read by both halves (client
and server) and by the scheme that builds them, so it sits below all three."""

from __future__ import annotations

from foltr_async.params import param, parameters


@parameters
class Settings:
    degree: int = param(
        0, "neighbours per client: 0 = all (SecAgg), k = Harary graph (SecAgg+)", min=0
    )
    threshold: float = param(
        0.5, "shares needed = floor(threshold * neighbours) + 1", min=0.5, max=1.0
    )
    precision_bits: int = param(
        32, "fractional bits of the fixed-point encoding in Z_2^64", min=8, max=48
    )
    deadline: float | None = param(
        None, "simulated seconds per key/unmask phase (default: federation.deadline)", min=0.0
    )
    dropout: float = param(
        0.0, "probability a client fails to upload after sharing its keys", min=0.0, max=1.0
    )
