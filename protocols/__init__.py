"""Protocols of federated online learning to rank; importing this package registers them all.

Each module defines its messages (registered with the codec), its client and server roles, and
registers its scenario names in ``foltr_async.registry.REGISTRY``.
"""

if __name__ != "foltr_async.protocols":  # e.g. `import protocols` from the checkout's root
    raise ImportError(f"import foltr_async.protocols, not {__name__}: a second name runs it twice")

from foltr_async.protocols import (  # noqa: F401  (registration on import)
    aggregation,
    attacks,
    csfltr,
    eavesdrop,
    fedips,
    foltr_es,
    fpdgd,
    fpdgd_async,
    noniid,
    pdgd_central,
    secagg,
)
