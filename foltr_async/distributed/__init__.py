"""Agents as separate processes across hosts: ``serve``, ``join`` and the local launcher.

Honest clients live in *worker* processes, each building its share of them from its own copy
of the scenario and the data; the server process runs the experiment and every message
crosses it, so attackers and eavesdroppers there see every link as in memory. One module per
part: ``claims`` (which clients a worker hosts), ``control`` (what server and workers agree
on), ``server``, ``worker``, ``launcher`` (``--workers``). The transport is
``runtime.zmq_*``.
"""
