"""Protocols of federated online learning to rank.

Each module declares what it provides (message kinds, a ``ProtocolEntry``, behaviours, ...) in
its ``PROVIDES``; importing it (or this package) installs nothing. ``foltr_async.plugins``
lists the modules and installs their entries (``load_plugins``).
"""

if __name__ != "foltr_async.protocols":  # e.g. `import protocols` from the checkout's root
    raise ImportError(f"import foltr_async.protocols, not {__name__}: a second name runs it twice")
