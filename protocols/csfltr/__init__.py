"""CS-F-LTR: cross-silo federated learning to rank (Wang, Tong, Shi, Xu).

Parties (companies; the run's ``client-NNNN`` agents, ``federation.clients`` of them) each hold
raw documents, their own training queries and the qrels of those queries over *every* party's
documents (as the querier's click logs would give them), but never another party's text. To
train on (own query, other party's document) pairs, a party needs features of documents it
cannot read. It gets them with private sketch queries relayed by the server:

1. *Reverse top-K* (``csfltr.rtk_query`` / ``csfltr.rtk_answer``): for each of its queries and
   each other party, the querier sends the obfuscated hash columns and signs of the query's terms
   (:func:`foltr_async.ltr.sketch.obfuscate`: z1 private rows per real term, the rest decoys).
   The owner returns the contents of the requested cells of its body-field RTK-Sketch, every
   count shifted by one shared Laplace(1/epsilon) draw. The querier intersects softly
   over its private rows only and keeps the ``pool`` best documents (plus the query's judged
   documents of that owner, whose ids its qrels name).
2. *Term frequencies* (``csfltr.tf_query`` / ``csfltr.tf_answer``): for those documents the
   querier sends the same obfuscated columns; the owner answers every requested Count Sketch
   entry of both fields with one shared Laplace(1/epsilon) draw added to all of them (so each
   estimate alone is epsilon-DP; see :mod:`foltr_async.ltr.sketch` for what that does not
   cover), plus document lengths and distinct-term counts (document metadata, sent exactly).
   The querier's median over its private rows, rounded to an integer (post-processing), gives
   the term frequencies; with the owner's collection statistics it computes the 16 features
   (:mod:`foltr_async.ltr.textfeatures`) and keeps the estimated-BM25 top ``candidates`` plus
   the judged documents, as it does for its own documents.

An owner draws each answer's noise from a generator keyed by its own secret and the query's
content (kind, columns, signs, documents): a repeated query gets the same answer, so repeats
cannot be averaged away, and answers do not depend on the order queries arrive in, so a run gives
the same results on the memory bus and over ZeroMQ.

Collection statistics (``csfltr.stats``): each party publishes once, through the relay, its
document count, field lengths and per-term df and cf with Laplace(1/epsilon) noise per term
(a deviation: a vocabulary-wide df vector has so large an L2 norm that a w = 200 Count Sketch of
it is useless for IDF; a document changes many terms' df, so the document-level guarantee of
this table is weaker than epsilon). Sketches and queries leave out the ``stopwords`` most
frequent terms of the corpus (a public stop list): stop words would dominate every sketch's
error and every RTK cell. Features are min-max normalised per (query, collection) block, which
cancels an answer's shared noise in the features linear in tf and the per-collection scale of
the statistics.

The server relays: it forwards a query to its owner under a fresh token and the answer back,
so an owner never learns which party asked. Every message crosses the bus as bytes, so the
byte counts per kind in results.json are real.

Then training runs on the generic round engine: the server broadcasts ``csfltr.model`` (linear
weights over the 16 normalised features); each party takes ``local_epochs`` full-batch
ListNet steps (Cao et al., ICML 2007; ``learner = "pointwise"``: least-squares regression on
the grades instead) on its instances and replies ``csfltr.update``. With ``schedule =
"round_robin"`` (modes ``csfltr`` and ``global``) the parties train the model in turn instead
of FedAvg: round r's model is party (r - 1) mod n's update of round r - 1's, and from round 2 on
only that party is asked (round 1 asks every party, which generates its features then; the
server keeps party 0's update). Feature
generation is the first round's local work: a party receiving a round-1 model with
``generate = true`` runs steps 1-2 (event driven: its own inbox handles answers and the other
parties' queries meanwhile) and replies once its features are complete. Modes (``mode``):

- ``local``: own queries x own documents (exact features), trained alone;
- ``local+``: plus the cross-party instances, trained alone;
- ``global``: own instances, FedAvg across parties (horizontal FL, no privacy mechanism);
- ``csfltr``: own plus cross-party instances, FedAvg (the paper's method).

In the two local modes the parties still send their weights each round, but only so the server
can evaluate them (it never averages them): the reported metric is the mean over parties. The
evaluation is on an external test set: held-out queries whose candidates are each party's BM25
top ``local_candidates`` plus the judged documents, with exact features (each document's
statistics from its own party's collection, normalised per party block as in training);
nDCG@10 (queries with a relevant document), ERR@10 and nDCG over all candidates.

Measurements (``report()``, under ``csfltr``): for every reverse top-K answered during
generation, its cover rate against the exact top-K of the owner's collection (ties counted as
covered; see :func:`foltr_async.ltr.sketch.cover_rate`), the owner's and querier's compute time
per term and the bytes per term; NAIVE (``csfltr.naive_query``: every document's z entries of one
term, each document with its own noise, then the querier's median and top-K) is run on
``probe_terms`` terms per (querier, owner) pair for the same numbers, so the speed-up, byte
ratio and memory compare like with like. The big measurement (>= 10,000 documents per party) is
a documented command in docs/PERFORMANCE.md (`bench --suite csfltr`).

Layout: ``messages`` (kinds and schemas), ``corpus`` (the text and each party's sketches,
candidates, test set), ``primitives`` (ListNet, evaluation, both halves of a reverse top-K),
``party`` (the silo agent), ``server`` (strategy, relay, the run), ``measurement``,
``eavesdropper`` (the relay's tap); this module holds the parameters and registers the names.
"""

from __future__ import annotations

from foltr_async.params import param, parameters
from foltr_async.protocols.csfltr import messages
from foltr_async.protocols.csfltr.eavesdropper import RelayEavesdropper
from foltr_async.protocols.csfltr.server import CSFLTR
from foltr_async.registry import BehaviourEntry, ProtocolEntry

#: its scenario name (``federation.protocol``)
NAME = "csfltr"

MODES = ("csfltr", "local", "local+", "global")
LEARNERS = ("listnet", "pointwise")
SCHEDULES = ("fedavg", "round_robin")


@parameters
class Params:
    mode: str = param("csfltr", "training mode", choices=MODES)
    corpus: str = param(
        "synthetic", "embedded generator or MS MARCO TSV files", choices=("synthetic", "msmarco")
    )
    collection: str | None = param(None, "msmarco: collection TSV")
    queries: str | None = param(None, "msmarco: queries TSV")
    qrels: str | None = param(None, "msmarco: qrels (TREC format)")
    run: str | None = param(None, "msmarco: optional top-100 run (candidate lists)")
    test_fraction: float = param(
        0.2, "msmarco: queries kept as the external test set", min=0.0, max=0.9
    )
    corpus_seed: int | None = param(None, "corpus seed (default: the run's seed)", min=0)
    docs_per_party: int = param(2000, "synthetic: documents per party", min=10)
    vocab_size: int = param(20000, "synthetic: vocabulary size", min=1000)
    topics: int = param(40, "synthetic: topics", min=1)
    body_len: int = param(1000, "synthetic: mean body length (tokens)", min=10)
    queries_per_party: int = param(40, "synthetic: training queries per party", min=1)
    test_queries: int = param(100, "synthetic: external test queries", min=1)
    judged: list = param([1, 3], "synthetic: documents judged 2 and 1 per query, corpus-wide")
    alpha: float = param(5.0, "RTK-Sketch: heap size alpha * K", min=1e-3)
    beta: float = param(0.1, "RTK-Sketch: soft intersection share of cells", min=0.0, max=1.0)
    w: int = param(200, "sketch columns", min=2)
    z: int = param(30, "sketch rows (hash functions)", min=1, max=52)
    z1: int = param(10, "rows hashing the real term (private to the querier)", min=1)
    k: int = param(150, "reverse top-K size K", min=1)
    epsilon: float = param(
        0.5, "Laplace(1/epsilon) noise per answer (inf: none)", min=1e-6, infinite=True
    )
    canary: bool = param(
        False,
        "privacy audit: party 0 answers term-frequency queries as a canary owner (docs/"
        "PROTOCOLS.md, Privacy auditing)",
    )
    decoys: str = param(
        "matched",
        "decoy terms: of matched frequency, frequency-weighted or uniform",
        choices=("matched", "frequency", "uniform"),
    )
    candidates: int = param(
        30, "cross-party documents per (query, owner), by estimated BM25", min=1
    )
    pool: int = param(90, "RTK documents per (query, owner) whose frequencies are asked", min=1)
    local_candidates: int = param(30, "own documents per query (BM25 top-N)", min=1)
    probe_terms: int = param(4, "terms per (querier, owner) measured with NAIVE too", min=0)
    stopwords: int = param(100, "most frequent terms left out of sketches and queries", min=0)
    lr: float = param(0.5, "learning rate of the local steps", min=0.0)
    local_epochs: int = param(10, "full-batch local steps per round", min=1)
    learner: str = param(
        "listnet",
        "local model: ListNet (listwise) or pointwise least squares on the grades",
        choices=LEARNERS,
    )
    schedule: str = param(
        "fedavg",
        "csfltr / global: FedAvg of every party's update each round, or round_robin: the "
        "parties train the one model in turn, one party a round",
        choices=SCHEDULES,
    )


def _eavesdropper(ctx, proto, group, aid, queries, rng):
    return RelayEavesdropper(aid, proto, rng)


@parameters
class EavesdropperParams:
    """The relay eavesdropper has no settings: it guesses from every relayed query."""


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *messages.KINDS,
    ProtocolEntry(
        NAME,
        "CS-F-LTR: cross-silo LTR with private sketch queries and RTK-Sketch",
        Params,
        CSFLTR,
    ),
    BehaviourEntry(
        "csfltr_eavesdropper",
        "eavesdropper",
        "taps the CS-F-LTR relay and guesses queried terms from the obfuscated hashes",
        (NAME,),
        EavesdropperParams,
        _eavesdropper,
    ),
)
