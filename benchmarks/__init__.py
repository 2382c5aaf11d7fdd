"""``python -m foltr_async bench``: how fast and how big the simulator is, against its targets.

A package beside ``foltr_async`` and ``protocols``, not inside the runtime: the suites drive
protocols, so the runtime never imports them; the CLI's ``bench`` command hands its arguments to
:func:`foltr_async.benchmarks.cli.main` (``tools/bench.py`` does the same from a checkout).

Every suite runs the project's real code paths at a stated size and reports what it measured on
what, so a number can be reproduced and compared across commits:

- ``fpdgd`` (:mod:`~.rounds`): FPDGD rounds through the memory bus in virtual time
  (linear ranker, held-out evaluation every 10 rounds), timed over whole rounds after round 1 so
  start-up is apart; also centralised PDGD interactions/s and offline evaluation queries/s on the
  same data.
- ``foltr_es`` (:mod:`~.rounds`): FOLtR-ES rounds (2000 clients x 4 queries at full
  size).
- ``bus`` (:mod:`~.transport`): coordination cost per client update with training
  stubbed out (echo clients speaking the FPDGD messages: encode, schedule, deliver, decode,
  replay check, FedAvg).
- ``startup`` (:mod:`~.footprint`): a fresh process to the first round's broadcast on
  the embedded dataset.
- ``memory`` (:mod:`~.footprint`): RSS growth of started FPDGD client agents on one
  shared dataset (fresh process).
- ``zmq`` (:mod:`~.transport`): two processes over loopback TCP (PUSH/PULL), FPDGD
  update envelopes with 136 float64.
- ``parse`` (:mod:`~.parse`): LETOR parsing from text (cold cache) and from the binary
  cache, extrapolated to the MSLR-WEB10K Fold1 training file.
- ``secagg`` and ``csfltr`` (:mod:`~.costs`): a secure-aggregation round against the
  number of clients; CS-F-LTR's reverse top-K, RTK-Sketch against NAIVE.

Timings are wall-clock on this machine, each with its CPU share (CPU seconds per wall second):
on a shared machine the share says how much the wall number understates the code. Nothing here
is asserted by a test. Suites that need a clean process (start-up, memory, zmq) run children
with ``sys.executable``; docs/PERFORMANCE.md records a measured run.
"""

if __name__ != "foltr_async.benchmarks":  # e.g. `import benchmarks` from the checkout's root
    raise ImportError(f"import foltr_async.benchmarks, not {__name__}: a second name runs it twice")
