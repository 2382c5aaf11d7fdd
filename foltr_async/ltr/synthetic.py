"""Embedded synthetic LETOR datasets shaped like the seed papers' collections.

Real collections cannot ship with the project, yet every scenario must run and *leave room to
learn*: if all methods saturate within a few thousand interactions, FPDGD vs FOLtR-ES, attacks
and non-IID remedies cannot be told apart. Every profile is built the same way, with its own
sizes and knobs (:class:`Profile`):

1. Documents per query are log-normal around ``docs_mean`` (clipped); queries are i.i.d.
2. Each document has ``n_latent`` latent factors ``u`` (standard normal plus a per-query topic
   shift, so feature distributions differ between queries).
3. Latent relevance per intent: a linear part ``u @ beta`` plus ``nonlinearity`` times a synergy
   of the two strongest factors, a second factor product, a "just right" square and a hinge (the
   part a linear ranker cannot express), plus a per-query offset (``query_effect``: some queries
   have many relevant documents, some none). Grades are ``relevance + label_noise * noise`` cut
   at global quantiles that reproduce the collection's grade distribution (``grade_probs``).
   Intents use orthogonal ``beta`` directions, so they prefer different documents.
4. Features, in shuffled column order: *signal* features read one or two latent factors (a few
   read one intent's relevance) through noise of widely varying strength (``feature_noise``)
   plus ``n_nuisance`` relevance-free document factors (``nuisance``; length, popularity...),
   then a monotone transform (identity, exp and log-counts for heavy tails, softplus, tanh);
   *nuisance readers* measure the nuisance factors, so the best linear ranker is a contrast of
   correlated features (ill-conditioned: gradient learners approach it slowly, as on real
   LETOR data); *copies* are noisy duplicates of signal features; *query-level* features are
   constant within a query (0 after normalisation, as in LETOR 4.0); the rest is pure noise
   (normal, Student-t, log-normal). Every feature is then min-max normalised per query (LETOR
   4.0's QueryLevelNorm; the PDGD/FPDGD authors' MSLR preprocessing), entries are zeroed with
   probability ``sparsity`` (Yahoo's missing values), and values are rounded to six decimals
   (as LETOR files carry them, so ``write_letor``/``load_letor`` round-trip exactly).

Measured on seed 0 at default sizes, nDCG@10 on the test split over queries with a relevant
document. random: random scores; linear: full-information ridge on per-query-centred features
fitted to the train grades; quadratic: the same with squares and products of the 16 features
most associated with the grades; oracle: the noise-free latent relevance (the ceiling). PDGD:
centralised linear PDGD (``ltr.pdgd.run_centralised``, lr 0.1, zero init) after 1k / 5k / 10k /
40k interactions with perfect and informational cascade clicks.

==================  ======  ======  =====  ======  =======================  =======================
profile             random  linear  quad.  oracle  PDGD perfect             PDGD informational
==================  ======  ======  =====  ======  =======================  =======================
mq2007-like         0.245   0.410   0.429  0.791   .394 .403 .408 .413      .339 .366 .387 .402
mslr-like           0.193   0.437   0.474  0.775   .369 .419 .429 .443      .265 .383 .396 .419
istella-like        0.093   0.598   0.588  0.792   .483 .571 .572 .573      .189 .497 .482 .558
yahoo-like          0.473   0.643   0.684  0.895   .575 .625 .621 .631      .508 .527 .585 .606
intent-change-like  0.253   0.372   0.409  0.794   .322 .363 .372 .371      .266 .347 .339 .368
==================  ======  ======  =====  ======  =======================  =======================

(For comparison, linear PDGD reaches about 0.43 on MSLR-WEB10K after 10^5 interactions.)
The table is one seed, and seeds differ far more than noise: each draws which latent factors
the features read, their transforms and noise levels. PDGD informational at 10k interactions,
seeds 0-4: mq2007-like .354 .738 .388 .600 .686; mslr-like .397 .564 .415 .465 .481;
istella-like .479 .352 .404 .152 .474; yahoo-like .598 .581 .544 .621 .605; intent-change-like
.312 .400 .367 .645 .295. Compare methods on one dataset seed.
Curves with realistic (informational) clicks still rise at 40k interactions; perfect clicks on
istella-like and intent-change-like level off after about 10k. Default sizes generate in about
0.2 s (46 features) to 1 s (mslr-like, yahoo-like) on one core; ``n_queries`` scales them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from foltr_async import rng as rng_module
from foltr_async.errors import DatasetError
from foltr_async.ltr.cache import cache_dir, read_npz, write_npz
from foltr_async.ltr.data import write_letor
from foltr_async.ltr.queryset import QuerySet
from foltr_async.rng import stream

__all__ = [
    "PROFILES",
    "Profile",
    "latent_relevance",
    "make_dataset",
    "make_dataset_files",
    "profile_names",
]

SPLITS = (("train", 0.6), ("vali", 0.2), ("test", 0.2))


@dataclass(frozen=True)
class Profile:
    """Parameters of one synthetic collection (see the module docstring for their roles)."""

    name: str
    n_features: int
    grade_probs: tuple[float, ...]  # P(grade = g), g = 0..max grade
    docs_mean: float
    docs_min: int
    docs_max: int
    docs_sigma: float  # log-normal spread of documents per query
    n_queries: int  # default number of queries over all splits
    n_latent: int = 8  # latent document factors relevance is a function of
    frac_signal: float = 0.4  # features that read latent factors
    frac_copies: float = 0.15  # noisy duplicates of signal features
    frac_query: float = 0.05  # query-level features (constant within a query)
    frac_nuisance: float = 0.1  # features that mostly read the nuisance factors
    n_nuisance: int = 3  # relevance-free document factors (length, popularity, spamminess)
    nuisance: float = 2.5  # how strongly nuisance factors load on signal features
    nuisance_share: float = 0.5  # chance that a nuisance factor loads on a signal feature
    nuisance_noise: float = 0.3  # noise of the nuisance readers
    tail: float = 1.5  # exponent scale of the heavy-tailed transforms
    feature_noise: float = 2.0  # median noise scale of signal features (x 1/4 .. 4)
    label_noise: float = 0.6  # assessor noise added to the standardised relevance
    nonlinearity: float = 2.5  # weight of the non-linear relevance terms
    query_effect: float = 0.5  # spread of per-query relevance offsets
    topic_shift: float = 0.5  # spread of per-query latent factor means
    sparsity: float = 0.0  # fraction of feature values zeroed (missing)
    n_intents: int = 1  # > 1 fills ``intent_labels``; ``labels`` is intent 0

    @property
    def max_grade(self) -> int:
        return len(self.grade_probs) - 1


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="mq2007-like",
            n_features=46,
            grade_probs=(0.74, 0.21, 0.05),
            docs_mean=40,
            docs_min=6,
            docs_max=147,
            docs_sigma=0.35,
            n_queries=1700,
            feature_noise=1.5,
            nonlinearity=1.5,
            nuisance=1.0,
        ),
        Profile(
            name="mslr-like",
            n_features=136,
            grade_probs=(0.514, 0.325, 0.134, 0.019, 0.008),
            docs_mean=120,
            docs_min=5,
            docs_max=600,
            docs_sigma=0.55,
            n_queries=1667,
        ),
        Profile(
            name="istella-like",
            n_features=220,
            grade_probs=(0.87, 0.05, 0.04, 0.025, 0.015),
            docs_mean=100,
            docs_min=5,
            docs_max=400,
            docs_sigma=0.4,
            n_queries=1000,
        ),
        Profile(
            name="yahoo-like",
            n_features=700,
            grade_probs=(0.26, 0.36, 0.28, 0.08, 0.02),
            docs_mean=24,
            docs_min=2,
            docs_max=120,
            docs_sigma=0.5,
            n_queries=1500,
            frac_signal=0.3,
            sparsity=0.4,
        ),
        Profile(
            name="intent-change-like",
            n_features=46,
            grade_probs=(0.74, 0.21, 0.05),
            docs_mean=40,
            docs_min=6,
            docs_max=147,
            docs_sigma=0.35,
            n_queries=1700,
            n_intents=4,
            feature_noise=1.5,
            nonlinearity=1.5,
            nuisance=1.0,
        ),
    )
}


def profile_names() -> list[str]:
    """Names of the embedded profiles, in definition order."""
    return list(PROFILES)


def profile_summary(profile: str) -> str:
    """One line of a profile's shape (for ``list``)."""
    p = _profile(profile)
    return (
        f"{p.n_features} features, grades 0-{len(p.grade_probs) - 1}, "
        f"~{p.docs_mean:.0f} documents per query, {p.n_queries} queries"
    )


def _profile(profile: str) -> Profile:
    try:
        return PROFILES[profile]
    except KeyError:
        raise DatasetError(
            f"unknown synthetic profile {profile!r}; known: {', '.join(PROFILES)}"
        ) from None


def make_dataset(
    profile: str, seed: int, *, n_queries: int | None = None, cache: bool = True
) -> dict[str, QuerySet]:
    """Train/vali/test QuerySets (60/20/20 of the queries) of a profile; same seed, same bytes.

    Generating takes about a second at default sizes, most of a run's start-up; the splits are
    therefore kept in the LETOR cache directory (``ltr.cache.cache_dir``), keyed by the profile's
    knobs, seed, size, numpy's version and this generator's source, so a second run loads them
    (~0.1 s) and a changed generator can never be served stale.
    """
    p = _profile(profile)
    if not cache:
        return _build(p, seed, n_queries)[0]
    entry = cache_dir() / f"synthetic-{_cache_key(p, seed, n_queries)[:40]}.npz"
    got = _read_splits(entry, p)
    if got is None:
        got = _build(p, seed, n_queries)[0]
        write_npz(
            entry,
            {
                f"{split}.{name}": arr
                for split, qs in got.items()
                for name, arr in _split_arrays(qs).items()
            },
        )
    return got


def _split_arrays(qs: QuerySet) -> dict[str, np.ndarray]:
    arrays = {"features": qs.features, "labels": qs.labels, "qptr": qs.qptr, "qids": qs.qids}
    if qs.intent_labels is not None:
        arrays["intent_labels"] = qs.intent_labels
    return arrays


def _cache_key(p: Profile, seed: int, n_queries: int | None) -> str:
    h = hashlib.sha256(f"synthetic {p!r} seed={seed} n={n_queries} np={np.__version__}".encode())
    for module in (__file__, rng_module.__file__):
        h.update(Path(module).read_bytes())
    return h.hexdigest()


def _read_splits(entry: Path, p: Profile) -> dict[str, QuerySet] | None:
    """The cached splits, or None when missing or inconsistent (then they are generated)."""
    names = ("features", "labels", "qptr", "qids", *(("intent_labels",) if p.n_intents > 1 else ()))
    arrays = read_npz(entry, tuple(f"{split}.{name}" for split, _ in SPLITS for name in names))
    if arrays is None:
        return None
    out = {}
    for split, _ in SPLITS:
        a = {name: arrays[f"{split}.{name}"] for name in names}
        f, qptr = a["features"], a["qptr"]
        if not (
            f.ndim == 2
            and f.shape[1] == p.n_features
            and a["labels"].shape == (len(f),)
            and qptr.ndim == 1
            and qptr[0] == 0
            and qptr[-1] == len(f)
            and a["qids"].shape == (len(qptr) - 1,)
        ):
            return None
        out[split] = QuerySet(**a, name=split)
    return out


def latent_relevance(
    profile: str, seed: int, *, n_queries: int | None = None
) -> dict[str, np.ndarray]:
    """The noise-free latent relevance of every document (intent 0), per split.

    Ranking by it is the best any scorer can do; it gives the ceiling curves are compared to.
    """
    return _build(_profile(profile), seed, n_queries, features=False)[1]


def make_dataset_files(
    profile: str, out_dir: str | Path, seed: int, n_queries: int | None = None
) -> list[Path]:
    """Write ``train.txt``, ``vali.txt`` and ``test.txt`` of a profile in LETOR format."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetError(f"{out}: cannot create output directory ({exc.strerror})") from None
    sets = make_dataset(profile, seed, n_queries=n_queries)
    return [write_letor(qs, out / f"{split}.txt") for split, qs in sets.items()]


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def _fits_in_memory(p: Profile, nq: int) -> None:
    """Refuse a size this machine cannot hold, before allocating, rather than let the
    out-of-memory killer end the run. Generating costs about 10 bytes per document and column
    (float32 features plus 32 latent and working columns, 2.5 copies at the peak: measured)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: no check
        return
    need = nq * p.docs_mean * (p.n_features + 32) * 10
    if need > ram:
        raise DatasetError(
            f"synthetic profile {p.name}: n_queries = {nq} needs ~{need / 2**30:,.0f} GB to"
            f" generate, more than this machine's {ram / 2**30:,.0f} GB"
        )


def _build(
    p: Profile, seed: int, n_queries: int | None, *, features: bool = True
) -> tuple[dict[str, QuerySet], dict[str, np.ndarray]]:
    """The splits and their latent relevance; ``features=False`` stops before the (costly)
    features, which are drawn last so the relevance is the same either way."""
    nq = p.n_queries if n_queries is None else int(n_queries)
    if nq < 5:
        raise DatasetError(f"synthetic profile {p.name}: n_queries must be at least 5, got {nq}")
    _fits_in_memory(p, nq)
    model = stream(seed, "synthetic", p.name, "model")  # the collection's fixed structure
    draw = stream(seed, "synthetic", p.name, "data", nq)  # the sampled queries and documents

    sizes = np.clip(
        np.rint(p.docs_mean * draw.lognormal(-0.5 * p.docs_sigma**2, p.docs_sigma, size=nq)),
        p.docs_min,
        p.docs_max,
    ).astype(np.int64)
    qptr = np.zeros(nq + 1, dtype=np.int64)
    np.cumsum(sizes, out=qptr[1:])
    n = int(qptr[-1])
    qidx = np.repeat(np.arange(nq), sizes)

    k = p.n_latent
    u = draw.standard_normal((n, k), dtype=np.float32)
    u += p.topic_shift * draw.standard_normal((nq, k), dtype=np.float32)[qidx]

    rel = _relevance(p, model, draw, u, qidx, nq)  # (n_intents, n) noise-free
    graded = rel + p.label_noise * draw.standard_normal(rel.shape, dtype=np.float32)
    cuts = np.cumsum(p.grade_probs)[:-1]
    labels = np.stack(
        [np.searchsorted(np.quantile(g, cuts), g, side="right") for g in graded]
    ).astype(np.int8)

    splits = [0]
    for _, frac in SPLITS[:-1]:
        splits.append(splits[-1] + round(frac * nq))
    splits.append(nq)
    latent = {
        split: rel[0, qptr[a] : qptr[b]].copy()
        for (split, _), a, b in zip(SPLITS, splits[:-1], splits[1:], strict=True)
    }
    if not features:
        return {}, latent

    by_feature = _features(p, model, draw, u, rel, qidx, nq)
    _normalise_rows(by_feature, qptr)
    if p.sparsity > 0:
        by_feature[draw.random(by_feature.shape, dtype=np.float32) < p.sparsity] = 0.0
    # Six decimals, as LETOR files carry: exact LETOR round trips and fast writing. The steps
    # k are exact in float32 (k <= 1e6); k / 1e6 is computed in float64, as a parser does.
    features = np.empty((n, p.n_features), dtype=np.float32)
    for r0 in range(0, n, 1 << 16):  # blocks bound the float64 temporary
        steps = np.rint(by_feature[:, r0 : r0 + (1 << 16)] * np.float32(1e6))
        features[r0 : r0 + (1 << 16)] = (steps / 1e6).T
    del by_feature

    qids = np.array([str(i + 1) for i in range(nq)])
    out = {}
    for (split, _), a, b in zip(SPLITS, splits[:-1], splits[1:], strict=True):
        docs = slice(int(qptr[a]), int(qptr[b]))
        out[split] = QuerySet(
            features=features[docs],  # a row range of a C-contiguous array stays contiguous
            labels=labels[0, docs].copy(),
            qptr=qptr[a : b + 1] - qptr[a],
            qids=qids[a:b],
            name=split,
            intent_labels=labels[:, docs].copy() if p.n_intents > 1 else None,
        )
    return out, latent


def _standardise(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(axis=-1, keepdims=True)) / (x.std(axis=-1, keepdims=True) + 1e-12)


def _relevance(
    p: Profile,
    model: np.random.Generator,
    draw: np.random.Generator,
    u: np.ndarray,
    qidx: np.ndarray,
    nq: int,
) -> np.ndarray:
    """Noise-free relevance per intent: linear + interaction + hinge terms + query offset."""
    k = p.n_latent
    basis = np.linalg.qr(model.standard_normal((k, k)))[0].astype(np.float32)
    offset = p.query_effect * draw.standard_normal(nq, dtype=np.float32)[qidx]
    out = np.empty((p.n_intents, len(u)), dtype=np.float32)
    for i in range(p.n_intents):
        beta = basis[:, i]
        a, b = np.argsort(-np.abs(beta))[:2]  # the intent's two strongest factors
        c, d, e = model.permutation(np.setdiff1d(np.arange(k), [a, b]))[:3]
        inter = (
            np.sign(beta[a] * beta[b]) * u[:, a] * u[:, b]  # synergy of the strongest factors
            + 0.7 * u[:, c] * u[:, d]
            - 0.8 * np.square(u[:, e])  # a "just right" factor: both extremes hurt
            + 1.2 * np.sign(beta[a]) * np.maximum(np.sign(beta[a]) * u[:, a] - 0.5, 0.0)
        )
        out[i] = _standardise(u @ beta) + p.nonlinearity * _standardise(inter)
        out[i] = _standardise(out[i]) + offset
    return out


def _features(
    p: Profile,
    model: np.random.Generator,
    draw: np.random.Generator,
    u: np.ndarray,
    rel: np.ndarray,
    qidx: np.ndarray,
    nq: int,
) -> np.ndarray:
    """Raw feature matrix, feature-major ``(n_features, n_docs)`` so every column op is a row op."""
    n, k = u.shape
    d = p.n_features
    n_sig = max(1, round(p.frac_signal * d))
    n_copy = round(p.frac_copies * d)
    n_query = round(p.frac_query * d)
    n_nuis = round(p.frac_nuisance * d)
    n_noise = d - n_sig - n_copy - n_query - n_nuis
    if n_noise < 0:
        raise ValueError(f"profile {p.name}: feature fractions exceed 1")
    out = np.empty((d, n), dtype=np.float32)
    rows = model.permutation(d)  # where each kind of feature lands
    sig_rows, copy_rows, query_rows, nuis_rows, noise_rows = np.split(
        rows, np.cumsum([n_sig, n_copy, n_query, n_nuis])
    )
    # Nuisance factors: relevance-free, loaded on most signal features. They make the best
    # linear direction a contrast between correlated features, which a gradient learner
    # finds only slowly (an ill-conditioned problem, as with real LETOR features).
    m = p.n_nuisance
    nuis = draw.standard_normal((m, n), dtype=np.float32)

    # Signal: loadings on one or two factors (a few read the relevance itself), nuisance,
    # noise of widely varying strength, then a monotone transform.
    load = np.zeros((n_sig, k), dtype=np.float32)
    idx = np.arange(n_sig)
    load[idx, model.integers(k, size=n_sig)] = model.choice([-1.0, 1.0], size=n_sig)
    second = model.random(n_sig) < 0.5
    load[idx[second], model.integers(k, size=n_sig)[second]] += model.normal(
        0, 0.7, size=second.sum()
    )
    reads_rel = model.random(n_sig) < 0.05  # each reads the relevance of one intent
    nuis_load = (model.random((n_sig, m)) < p.nuisance_share) * model.uniform(
        0.5, 1.5, size=(n_sig, m)
    )
    noise_w = p.feature_noise * np.exp(model.uniform(np.log(0.25), np.log(4.0), size=n_sig))
    kind = model.integers(len(_TRANSFORMS), size=n_sig)
    z = load @ u.T
    z[reads_rel] = rel[model.integers(len(rel), size=int(reads_rel.sum()))]
    z += draw.standard_normal((n_sig, n), dtype=np.float32) * noise_w[:, None].astype(np.float32)
    z += (p.nuisance * nuis_load).astype(np.float32) @ nuis
    for t, fn in enumerate(_TRANSFORMS):
        sel = kind == t
        z[sel] = fn(z[sel], p.tail)
    out[sig_rows] = z

    # Nuisance readers (document length and the like): one or two nuisance factors + noise.
    nl = (model.random((n_nuis, m)) < 0.5) * model.uniform(0.5, 1.5, size=(n_nuis, m))
    nl[np.arange(n_nuis), model.integers(m, size=n_nuis)] += 1.0
    zn = nl.astype(np.float32) @ nuis
    zn += p.nuisance_noise * draw.standard_normal((n_nuis, n), dtype=np.float32)
    kind_n = model.integers(len(_TRANSFORMS), size=n_nuis)
    for t, fn in enumerate(_TRANSFORMS):
        sel = kind_n == t
        zn[sel] = fn(zn[sel], p.tail)
    out[nuis_rows] = zn

    # Copies: rescaled signal features plus a little noise (correlated feature groups).
    src = model.integers(n_sig, size=n_copy)
    scale = model.uniform(0.5, 2.0, size=n_copy).astype(np.float32)
    jitter = (0.3 * z[src].std(axis=1) * scale).astype(np.float32)
    out[copy_rows] = z[src] * scale[:, None]
    out[copy_rows] += draw.standard_normal((n_copy, n), dtype=np.float32) * jitter[:, None]
    del z

    # Query-level features: one value per query (normalise to 0, as in LETOR 4.0).
    out[query_rows] = draw.lognormal(0, 1, size=(n_query, nq)).astype(np.float32)[:, qidx]

    # Pure noise: normal, Student-t (heavy tails), log-normal.
    kind = model.integers(3, size=n_noise)
    noise = draw.standard_normal((n_noise, n), dtype=np.float32)
    noise[kind == 1] = draw.standard_t(3, size=(int((kind == 1).sum()), n))
    noise[kind == 2] = np.exp(noise[kind == 2])
    out[noise_rows] = noise
    return out


def _normalise_rows(x: np.ndarray, qptr: np.ndarray) -> None:
    """In-place per-query min-max of a feature-major matrix (constant within a query -> 0)."""
    sizes = np.diff(qptr)
    lo = np.minimum.reduceat(x, qptr[:-1], axis=1)
    span = np.maximum.reduceat(x, qptr[:-1], axis=1) - lo
    inv = np.divide(1.0, span, out=np.zeros_like(span), where=span > 0)
    x -= np.repeat(lo, sizes, axis=1)
    x *= np.repeat(inv, sizes, axis=1)
    np.clip(x, 0.0, 1.0, out=x)


def _softplus(z: np.ndarray, tail: float) -> np.ndarray:
    return np.logaddexp(0.0, z).astype(np.float32)


def _exp(z: np.ndarray, tail: float) -> np.ndarray:  # heavy right tail
    return np.exp(np.clip(tail * z, -30, 30))


def _counts(z: np.ndarray, tail: float) -> np.ndarray:  # term-frequency-like integers
    return np.floor(np.exp(np.clip(0.9 * tail * z + 1.0, -30, 30)))


_TRANSFORMS = (
    lambda z, tail: z,
    _exp,
    _softplus,
    lambda z, tail: np.tanh(z),  # saturating
    _counts,
)
