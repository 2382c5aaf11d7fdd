"""Worked examples of docs/EXTENDING.md: a protocol and an attack written against
``foltr_async.protocols.api``, loaded as plugins
(``FOLTR_ASYNC_PLUGINS=examples.fedavgm,examples.signflip``)."""
