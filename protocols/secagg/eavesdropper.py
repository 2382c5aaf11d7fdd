"""What one masked upload tells an eavesdropper (and so the server)."""

from __future__ import annotations

import dataclasses

from foltr_async.protocols import eavesdrop, fpdgd
from foltr_async.protocols.secagg.messages import MASKED
from foltr_async.protocols.secagg.primitives import from_ring
from foltr_async.protocols.secagg.settings import Settings
from foltr_async.runtime.wire import Envelope, decode, encode


class MaskedEavesdropper(eavesdrop.FPDGDEavesdropper):
    """The FPDGD eavesdropper, also on masked uploads: it reads a ``secagg.masked`` vector as the
    plaintext would be read ([B * theta, B] in fixed point) and scores that guess with
    ``FPDGDEavesdropper``'s own update-recovery and query-inference measures. The server sees
    exactly these messages, so the scores are also what the server learns from one upload."""

    taps = {**eavesdrop.FPDGDEavesdropper.taps, MASKED: "src"}

    def __init__(self, agent_id, ctx, targets, rng, candidates) -> None:
        super().__init__(agent_id, ctx, targets, rng, candidates)
        self.batch = ctx.config.federation.queries_per_client
        self.bits = Settings(**ctx.config.federation.secagg).precision_bits
        self.masked = 0

    def observe(self, header, data: bytes) -> None:
        if header.kind != MASKED:
            super().observe(header, data)
            return
        self.masked += 1
        guess = from_ring(decode(data).body["y"], self.bits)[:-1] / self.batch
        plain = Envelope(
            fpdgd.UPDATE,
            header.src,
            header.dst,
            {"params": guess, "n_interactions": self.batch},
            header.round,
            header.seq,
            header.sent_at,
        )
        super().observe(dataclasses.replace(header, kind=fpdgd.UPDATE), encode(plain))

    def summary(self) -> dict:
        return {
            **super().summary(),
            "masked_updates": self.masked,
            "secure_aggregation": self.ctx.config.federation.secure_aggregation,
        }
