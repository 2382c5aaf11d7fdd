"""A plugin protocol with a timeline action of its own (tests/test_contract.py loads it through
FOLTR_ASYNC_PLUGINS): FPDGD whose clients may ``retire`` (they leave; nothing is unlearned)."""

from __future__ import annotations

from types import MappingProxyType

from foltr_async.protocols import fpdgd
from foltr_async.protocols.api import ProtocolEntry


class RetiringFPDGD(fpdgd.FPDGD):
    actions = MappingProxyType({**fpdgd.FPDGD.actions, "retire": "left"})

    async def act(self, agent, action: str) -> None:
        if action != "retire":
            return await super().act(agent, action)
        await agent.leave()


PROVIDES = (
    ProtocolEntry("fpdgd_retire", "FPDGD whose clients may retire", fpdgd.Params, RetiringFPDGD),
)
