"""A sign-flipping model-poisoning client against FedAvgM and FPDGD (the attack of
docs/EXTENDING.md).

It trains like an honest client, then sends the global weights moved ``scale`` times its honest
update the *other* way: ``w - scale * (theta - w)`` (the sign-flipping attack, e.g. Li et al.,
AAAI 2019). Under FedAvg a few such clients cancel the honest clients' progress. Both protocols'
clients send what ``make_update`` returns, so one mixin attacks either.
"""

from __future__ import annotations

import numpy as np

from examples.fedavgm import Client
from foltr_async.protocols.api import BehaviourEntry, FPDGDClient, param, parameters


@parameters
class Params:
    scale: float = param(4.0, "length of the flipped update, in honest updates", min=0.0)


class SignFlip:
    """Mixed in before a protocol's honest client class: flips what it would send."""

    def __init__(self, agent_id, ctx, queries, rng, scale: float) -> None:
        super().__init__(agent_id, ctx, queries, rng)
        self.scale = scale

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        honest = await super().make_update(round, start)  # its users still see rankings, click
        return start - self.scale * (honest - start)


class SignFlipClient(SignFlip, Client):
    pass


class FPDGDSignFlipClient(SignFlip, FPDGDClient):
    pass


#: the attacker's class for each protocol it speaks (the entry lists exactly these)
CLIENTS = {"fedavgm": SignFlipClient, "fpdgd": FPDGDSignFlipClient}


def build(ctx, proto, group, agent_id, queries, rng) -> SignFlip:
    cls = CLIENTS[ctx.config.federation.protocol]
    return cls(agent_id, ctx, queries, rng, group.params.scale)


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    BehaviourEntry(
        "sign_flip",
        "attacker",
        "sends its update with the sign flipped, scaled",
        tuple(CLIENTS),
        Params,
        build,
    ),
)
