"""Compiled (numba) pieces of batched PDGD: the draws, a whole batch of linear learners, and
one interaction step of many jobs.

Every entry point runs without the GIL and comes twice, compiled from one inlined body: with
its loops over jobs run by numba's thread pool (``parallel=True``, ``prange``; the threads of
``foltr_async.ltr.threads``) and serially, for batches too small to pay for starting the
threads (``use_threads`` picks). Jobs share only read-only data and each draws from its own
generator, so the thread count and the schedule never change a result.

Imported only by ``pdgd_batch``'s trainers on their first call, so runs that never train a
batched FPDGD learner pay neither numba's import nor a compilation. Functions are compiled on
first use and cached on disk (``cache=True``: in ``NUMBA_CACHE_DIR`` when set, else next to
this file, else, when that is read-only, numba's user-wide cache directory); where no cache
location is writable they are compiled in memory each run.

Draws without the numpy call overhead, bit for bit. Each job's numpy ``Generator`` is read
through its bit generator's C interface (``bit_generator.ctypes``: the state address and the
``next_double`` / ``next_uint32`` functions), and the kernel draws exactly what numpy's
``Generator`` methods would: ``integers(n)`` is Lemire's bounded ``uint32`` draw numpy uses for
ranges below 2^32 (nothing drawn for ``n == 1``), ``random`` is ``next_double``, and ``gumbel``
is numpy's ``loc - scale * log(-log(1 - next_double))`` retried on ``1 - u == 1`` (both sides
call the C library's ``log``). Numba's own ``Generator`` support would do the same but costs
~8 us per call to unbox the generator; tests compare the streams with numpy's over many seeds.

The step: Gumbel-top-k ranking of ``score + noise`` (ties: lower document first, which is what
the reference's stable sort does when the query has at most ``k`` documents; longer queries tie
with probability zero), cascade or position-based clicks, the shown nDCG@k summed in numpy's
pairwise order (the same float as ``metrics.dcg_at_k``), then the pairs, the closed-form
debiasing of the ``pdgd_batch`` module doc, the gradient (linear, or ``MLPRanker.grad``'s
backward pass for one hidden layer), the step (with FedProx's proximal part) and the DP
clipping.
"""

from __future__ import annotations

import ctypes
import os

from foltr_async.ltr.threads import cores, layer, threads

# numba sizes its thread pool once, from NUMBA_NUM_THREADS (default: every CPU of the machine,
# not this process's affinity); leave room for a --threads above the cores.
os.environ.setdefault("NUMBA_NUM_THREADS", str(max(cores(), threads())))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import config  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

#: numba's threading layer, by one rule rather than "whichever loads first" (numba's default
#: tries TBB, then OpenMP): ``workqueue``, which ships with numba, so every machine runs the
#: same layer; a ``NUMBA_THREADING_LAYER`` set by the user wins. Results do not depend on it.
#: Measured on a shared 2-core machine (load ~10): GNU OpenMP's spinning threads made a batch
#: of 10 jobs take 40 ms instead of 0.2 ms, and with ``OMP_WAIT_POLICY=PASSIVE`` a round of
#: 1000 jobs took 28 ms with two threads against workqueue's 16 (one thread: 20). Workqueue is
#: not safe to launch from two Python threads at once: the simulator calls the kernel from one.
LAYER = config.THREADING_LAYER = layer()

#: the smallest batch (interactions) run in parallel: starting workqueue's threads costs
#: ~30-40 us, what 2 threads save on ~16 interactions of MQ2007 size (4-5 us each)
PARALLEL_FROM = 16

__all__ = [
    "LAYER",
    "PARALLEL_FROM",
    "draw",
    "generator_pointers",
    "jit",
    "linear_scores",
    "logged_linear",
    "pair_weights",
    "step",
    "train_linear",
    "use_threads",
    "workspace",
]


def jit(fn=None, **options):
    """``njit(cache=True, nogil=True)``, or without the disk cache where numba finds no
    writable place (also as ``@jit(**options)``)."""
    if fn is None:
        return lambda f: jit(f, **options)
    try:
        return njit(cache=True, nogil=True, error_model="numpy", **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True, error_model="numpy", **options)(fn)


def _parallel(fn):
    """``jit`` with ``prange`` loops over jobs run by numba's thread pool."""
    return jit(fn, parallel=True)


def use_threads(n_jobs: int, interactions: int) -> tuple:
    """The kernels for a batch of ``n_jobs`` and their thread count: ``(train_linear, draw,
    step, n)`` run by ``n = threads()`` threads (at most numba's pool), or their serial twins
    (same code and results, no threads to start) and 1 for one job, one thread or fewer than
    ``PARALLEL_FROM`` interactions."""
    n = min(threads(), config.NUMBA_NUM_THREADS)
    if n > 1 and n_jobs > 1 and interactions >= PARALLEL_FROM:
        numba.set_num_threads(n)
        return train_linear, draw, step, n
    return _train_linear_serial, _draw_serial, _step_serial, 1


_VOID_P = ir.IntType(8).as_pointer()


def _c_call(nb_ret, ir_ret, c_ret):
    """An intrinsic calling the C function at address ``fn`` with the bit generator's state
    (through ctypes when ``NUMBA_DISABLE_JIT`` runs the kernel as Python, for debugging)."""
    if config.DISABLE_JIT:
        c_type = ctypes.CFUNCTYPE(c_ret, ctypes.c_void_p)
        as_numpy = np.float64 if c_ret is ctypes.c_double else np.uint32
        return lambda fn, state: as_numpy(c_type(int(fn))(int(state)))

    @intrinsic
    def call(typingctx, fn, state):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir_ret, [_VOID_P])
            f = builder.inttoptr(args[0], fnty.as_pointer())
            return builder.call(f, [builder.inttoptr(args[1], _VOID_P)])

        return nb_ret(types.uint64, types.uint64), codegen

    return call


_next_double = _c_call(types.float64, ir.DoubleType(), ctypes.c_double)
_next_uint32 = _c_call(types.uint32, ir.IntType(32), ctypes.c_uint32)

#: numpy's bit generators, whose C functions are the same for every instance of the class
_BUILTIN = (
    np.random.PCG64,
    np.random.PCG64DXSM,
    np.random.MT19937,
    np.random.Philox,
    np.random.SFC64,
)
_FUNCTIONS: dict[type, tuple[int, int]] = {}


def generator_pointers(rngs) -> np.ndarray:
    """(jobs, 3) uint64: each generator's ``next_double``, ``next_uint32`` and state address.

    The generators must outlive the kernel call that uses these addresses (jobs hold them),
    and no other thread may draw from them meanwhile (numpy's per-generator lock is not taken).
    """
    out = np.empty((len(rngs), 3), dtype=np.uint64)
    for j, rng in enumerate(rngs):
        bg = rng.bit_generator
        c = bg.ctypes  # built once per generator by numpy, then cached on it
        fns = _FUNCTIONS.get(type(bg))
        if fns is None:
            fns = (
                ctypes.cast(c.next_double, ctypes.c_void_p).value,
                ctypes.cast(c.next_uint32, ctypes.c_void_p).value,
            )
            if type(bg) in _BUILTIN:
                _FUNCTIONS[type(bg)] = fns
        out[j, 0], out[j, 1], out[j, 2] = fns[0], fns[1], c.state_address
    return out


@jit
def _bounded(fn32, state, high):
    """numpy's ``integers(high)`` for 1 < high < 2^32: Lemire's rejection on ``next_uint32``."""
    rng = np.uint32(high - 1)
    rng_excl = np.uint64(rng) + np.uint64(1)
    m = np.uint64(_next_uint32(fn32, state)) * rng_excl
    leftover = m & np.uint64(0xFFFFFFFF)
    if leftover < rng_excl:
        threshold = np.uint64((np.uint32(0xFFFFFFFF) - rng) % np.uint32(rng_excl))
        while leftover < threshold:
            m = np.uint64(_next_uint32(fn32, state)) * rng_excl
            leftover = m & np.uint64(0xFFFFFFFF)
    return np.int64(m >> np.uint64(32))


@jit
def _layout(owned, owned_ptr, steps, sizes, k, grp):
    """Where each job's draws go: its first Gumbel and uniform slot (``goff``, ``uoff``; room
    for ``steps[j]`` of its largest owned or shared query, so jobs can draw at once), the
    longest job's steps and the largest query."""
    sh, sh_ptr = grp[1], grp[2]
    n_jobs = steps.size
    goff = np.zeros(n_jobs + 1, dtype=np.int64)
    uoff = np.zeros(n_jobs + 1, dtype=np.int64)
    n_steps = 0
    max_docs = 0
    for j in range(n_jobs):
        biggest = 0
        for i in range(owned_ptr[j], owned_ptr[j + 1]):
            if not 0 <= owned[i] < sizes.size:
                raise IndexError("a job owns a query the training set does not have")
            biggest = max(biggest, sizes[owned[i]])
        for i in range(sh_ptr[j], sh_ptr[j + 1]):
            if not 0 <= sh[i] < sizes.size:
                raise IndexError("a job shares a query the training set does not have")
            biggest = max(biggest, sizes[sh[i]])
        n_steps = max(n_steps, steps[j])
        if steps[j] > 0:
            max_docs = max(max_docs, biggest)
        goff[j + 1] = goff[j] + steps[j] * biggest
        uoff[j + 1] = uoff[j] + steps[j] * 2 * min(k, biggest)
    return goff, uoff, n_steps, max_docs


@jit
def _draw_job(
    j, ptrs, owned, owned_ptr, steps, sizes, k, grp, query, gptr, uptr, gumbel, uniform,
    model_at, from_shared,
):  # fmt: skip
    """Job ``j``'s draws in the sequential order, from ``gptr[j, 0]`` and ``uptr[j, 0]`` on
    (``grp``: ``_draws``'s users)."""
    order, sh, sh_ptr, mix, mix_ptr, smix, smix_ptr, kinds = grp
    fn_d, fn_u, state = ptrs[j, 0], ptrs[j, 1], ptrs[j, 2]
    first = owned_ptr[j]
    n_owned = owned_ptr[j + 1] - first
    s_first = sh_ptr[j]
    n_sh = sh_ptr[j + 1] - s_first
    played = order[j]
    go = gptr[j, 0]
    uo = uptr[j, 0]
    for s in range(steps[j]):
        other = False
        if n_sh > 0:  # PDGDLearner.train: integers(own + shared) >= own picks the shared users
            other = _bounded(fn_u, state, n_owned + n_sh) >= n_owned
        if other:
            pick = 0 if n_sh == 1 else _bounded(fn_u, state, n_sh)
            q = sh[s_first + pick]
            models, m_first, n_mix = smix, smix_ptr[j], smix_ptr[j + 1] - smix_ptr[j]
        else:
            if played >= 0:  # a replayed log: its next query, nothing drawn
                pick = played
                played += 1
            else:
                pick = 0 if n_owned == 1 else _bounded(fn_u, state, n_owned)
            q = owned[first + pick]
            models, m_first, n_mix = mix, mix_ptr[j], mix_ptr[j + 1] - mix_ptr[j]
        query[j, s] = q
        from_shared[j, s] = other
        n = sizes[q]
        gptr[j, s] = go
        for i in range(n):
            u = 1.0 - _next_double(fn_d, state)
            while not u < 1.0:
                u = 1.0 - _next_double(fn_d, state)
            gumbel[go + i] = 0.0 - 1.0 * np.log(-np.log(u))
        go += n
        # a mixture's users draw which model clicks (integers(len(models)))
        model = models[m_first + (0 if n_mix == 1 else _bounded(fn_u, state, n_mix))]
        model_at[j, s] = model
        uptr[j, s] = uo
        n_u = min(k, n) * (2 if kinds[model] == 0 else 1)  # cascade: random((2, m)); PBM: m
        for i in range(n_u):
            uniform[uo + i] = _next_double(fn_d, state)
        uo += n_u


@jit(inline="always")
def _draws(ptrs, owned, owned_ptr, steps, sizes, k, shared, grp):
    """Every job's draws in the sequential order (``draw``, inlined so its ``prange`` runs in
    the caller's thread pool).

    Returns ``query``, ``gptr``, ``uptr`` (jobs, max steps), the Gumbel and uniform buffers, a
    NaN-filled (jobs, max steps) nDCG array for ``step``, ``model_at`` (the click model of each
    step) and ``from_shared`` (whether the step's users were the shared data's). Job ``j`` step
    ``s``: with shared queries ``integers(n_owned + n_shared) >= n_owned`` picks the shared
    users; its query ``query[j, s]`` (``owned[integers(len(owned))]``, the shared users' alike,
    or a replayed log's next one, nothing drawn; -1 for steps it does not run), then
    ``gumbel(size=n)`` at ``gumbel[gptr[j, s]:]``, for a mixture of click models
    ``integers(len(models))``, and the model's uniforms at ``uniform[uptr[j, s]:]``
    (cascade: ``random((2, min(k, n)))`` raveled; position-based: ``random(min(k, n))``). Jobs
    draw in parallel, each from its own generator, unless ``shared`` (some jobs share a
    generator): then one after the other, in job order.

    ``grp`` is the jobs' users: ``order`` (per job: -1 to draw queries at random, else the
    replayed log's position of its next query), the shared queries ``sh`` per job
    (``sh_ptr``), the click models (numbers) of the job's own users ``mix`` (``mix_ptr``; more
    than one: a mixture) and of its shared users ``smix`` (``smix_ptr``), and each model's
    kind (``kinds``: 0 cascade, 1 position-based).
    """
    goff, uoff, n_steps, _ = _layout(owned, owned_ptr, steps, sizes, k, grp)
    n_jobs = steps.size
    query = np.full((n_jobs, n_steps), -1, dtype=np.int64)
    gptr = np.zeros((n_jobs, n_steps), dtype=np.int64)
    uptr = np.zeros((n_jobs, n_steps), dtype=np.int64)
    for j in range(n_jobs):
        if n_steps:
            gptr[j, 0], uptr[j, 0] = goff[j], uoff[j]
    gumbel = np.empty(goff[n_jobs])
    uniform = np.empty(uoff[n_jobs])
    model_at = np.zeros((n_jobs, n_steps), dtype=np.int64)
    from_shared = np.zeros((n_jobs, n_steps), dtype=np.bool_)
    out = (query, gptr, uptr, gumbel, uniform, model_at, from_shared)
    if shared:
        for j in range(n_jobs):
            _draw_job(j, ptrs, owned, owned_ptr, steps, sizes, k, grp, *out)
    else:
        for j in prange(n_jobs):
            _draw_job(j, ptrs, owned, owned_ptr, steps, sizes, k, grp, *out)
    ndcg = np.full((n_jobs, n_steps), np.nan)
    return query, gptr, uptr, gumbel, uniform, ndcg, model_at, from_shared


@_parallel
def draw(ptrs, owned, owned_ptr, steps, sizes, k, shared, grp):
    """``_draws``, jobs in parallel (``use_threads`` picks it)."""
    return _draws(ptrs, owned, owned_ptr, steps, sizes, k, shared, grp)


@jit
def _draw_serial(ptrs, owned, owned_ptr, steps, sizes, k, shared, grp):
    """``_draws``, one job after the other."""
    return _draws(ptrs, owned, owned_ptr, steps, sizes, k, shared, grp)


@jit
def _logaddexp(x, y):
    """numpy's ``npy_logaddexp``."""
    if x == y:
        return x + np.log(2.0)
    tmp = x - y
    if tmp > 0:
        return x + np.log1p(np.exp(-tmp))
    if tmp <= 0:
        return y + np.log1p(np.exp(tmp))
    return tmp


@jit
def _block_sum(a, lo, n):
    """numpy's sum of at most 128 contiguous float64: in order below 8, else 8 accumulators."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    blocks = n - n % 8
    for i in range(lo + 8, lo + blocks, 8):
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(lo + blocks, lo + n):
        res += a[i]
    return res


@jit
def _pairwise_sum(a, n):
    """numpy's pairwise sum of ``a[:n]`` (``np.add.reduce`` of a contiguous float64 array):
    blocks of at most 128, halved at multiples of 8 above that. numpy recurses; this walks the
    same tree with a stack (recursive functions do not load reliably from numba's cache)."""
    if n <= 128:
        return _block_sum(a, 0, n)
    lo = np.empty(64, dtype=np.int64)  # depth ~ log2(n / 128): 64 is plenty
    size = np.empty(64, dtype=np.int64)
    stage = np.zeros(64, dtype=np.int64)
    done = np.empty(64)
    top, n_done = 0, 0
    lo[0], size[0] = 0, n
    while top >= 0:
        m = size[top]
        half = m // 2 - (m // 2) % 8
        if m <= 128:
            done[n_done] = _block_sum(a, lo[top], m)
            n_done += 1
            top -= 1
        elif stage[top] < 2:  # visit the left half, then the right half
            first = lo[top] + (half if stage[top] else 0)
            count = (m - half) if stage[top] else half
            stage[top] += 1
            top += 1
            lo[top], size[top], stage[top] = first, count, 0
        else:
            n_done -= 1
            done[n_done - 1] = done[n_done - 1] + done[n_done]
            top -= 1
    return done[0]


@jit
def _log_rest(scores, go, n, top_i, m, is_shown):
    """log sum of exp(score) over the query's documents not shown (``-inf`` when all are):
    scores at ``scores[go:go + n]``, the shown ones ``top_i[:m]``; ``is_shown`` (at least n,
    all False) is left all False."""
    if n <= m:
        return -np.inf
    for i in range(m):
        is_shown[top_i[i]] = True
    top = -np.inf
    for i in range(n):
        if not is_shown[i]:
            top = max(top, scores[go + i])
    total = 0.0
    for i in range(n):
        if not is_shown[i]:
            total += np.exp(scores[go + i] - top)
    for i in range(m):
        is_shown[top_i[i]] = False
    return top + np.log(total)


@jit
def _coefficients(shown, clicked, m, last_click, log_rest, log_d, ratio, coef):
    """PDGD's weight of each of the ``m`` shown positions (``coef[:m]``) from their scores
    ``shown``, the clicks and ``log_rest`` (``_log_rest``); ``log_d`` and ``ratio`` are work
    space of at least ``m`` and ``m x m``."""
    acc = shown[m - 1]
    log_d[m - 1] = _logaddexp(acc, log_rest)
    for p in range(m - 2, -1, -1):
        acc = _logaddexp(acc, shown[p])
        log_d[p] = _logaddexp(acc, log_rest)

    # Pairs: each click over every unclicked position up to one below the last click;
    # rho = 1 / (1 + prod_{lo < p <= hi} (1 + ratio[lo, p] - ratio[hi, p])) (module doc of
    # pdgd_batch: the product is P(shown) / P(swapped)).
    upto = min(last_click + 2, m)
    for i in range(upto):
        for p in range(1, upto):
            ratio[i, p] = np.exp(shown[i] - log_d[p])
    coef[:m] = 0.0
    for a in range(upto):
        if not clicked[a]:
            continue
        for b in range(upto):
            if clicked[b]:
                continue
            lo, hi = min(a, b), max(a, b)
            odds = 1.0
            for p in range(lo + 1, hi + 1):
                # below 0 only by rounding, when shown[hi] dominates D(p)
                odds *= max(1.0 + (ratio[lo, p] - ratio[hi, p]), 0.0)
            rho = 1.0 / (1.0 + odds)
            e = np.exp(-abs(shown[a] - shown[b]))
            pw = e / (1.0 + e) ** 2 * rho
            coef[a] += pw
            coef[b] -= pw


@jit
def pair_weights(scores, ranking, clicks):
    """Per-document PDGD weights of one displayed ranking, for any ranker's ``grad``: what
    ``pdgd.pair_weights`` computes, with the batched path's closed-form debiasing (equal up to
    float rounding). ``scores`` float64 of every document, ``ranking`` int64, ``clicks`` bool."""
    n, m = scores.size, ranking.size
    out = np.zeros(n)
    last_click = -1
    for i in range(m):
        if clicks[i]:
            last_click = i
    if last_click < 0:
        return out
    shown = np.empty(m)
    for i in range(m):
        shown[i] = scores[ranking[i]]
    log_rest = _log_rest(scores, 0, n, ranking, m, np.zeros(n, dtype=np.bool_))
    coef = np.empty(m)
    _coefficients(shown, clicks, m, last_click, log_rest, np.empty(m), np.empty((m, m)), coef)
    for i in range(m):
        out[ranking[i]] = coef[i]
    return out


@jit
def workspace(k, max_docs):
    """The step's scratch arrays for SERPs of ``k`` and queries of up to ``max_docs``
    documents: Gumbel-top-k values and documents, clicks, shown scores, log D, coefficients,
    pair ratios, and an all-False mask of the shown documents."""
    return (
        np.empty(k), np.empty(k, dtype=np.int64), np.zeros(k, dtype=np.bool_), np.empty(k),
        np.empty(k), np.empty(k), np.empty((k, k)), np.zeros(max_docs, dtype=np.bool_),
    )  # fmt: skip


@jit
def _interact(
    j, s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, gains, discount, ideal,
    tables, n_grades, model_at, kinds, pbm, ndcg, k, work,
):  # fmt: skip
    """Interaction ``s`` of job ``j`` (its query ``query[j, s] >= 0``, its current scores at
    ``scores[gptr[j, s]:]``): rank, click (the step's model ``model_at[j, s]``: a cascade's
    row of ``tables``, or a position-based model's P(click) per position and label in
    ``pbm``, its last column for labels past the table), write the shown nDCG@k to
    ``ndcg[j, s]``, and when something was clicked leave each shown position's PDGD weight in
    ``coef`` and its document (within the query) in ``top_i`` (``work``: ``workspace``'s
    arrays). Returns the number of positions to update from (0: no click)."""
    q = query[j, s]
    first = qptr[q]
    n = qptr[q + 1] - first
    go = gptr[j, s]
    m = min(k, n)
    top_v, top_i, clicked, shown, log_d, coef, ratio, is_shown = work

    # Gumbel-top-k of score + noise, best first; ties keep the lower document first and
    # NaN sorts last (as numpy's stable argsort of -z).
    cnt = 0
    for i in range(n):
        v = scores[go + i] + gumbel[go + i]
        if cnt == m:
            last = top_v[m - 1]
            if not (v > last or (last != last and v == v)):
                continue
            p = m - 1
        else:
            p = cnt
            cnt += 1
        while p > 0:
            prev = top_v[p - 1]
            if v > prev or (prev != prev and v == v):
                top_v[p] = prev
                top_i[p] = top_i[p - 1]
                p -= 1
            else:
                break
        top_v[p] = v
        top_i[p] = i

    # Clicks from the uniforms (cascade or position-based); nDCG@k of the shown list.
    uo = uptr[j, s]
    model = model_at[j, s]
    cascade = kinds[model] == 0
    g_top = n_grades[model] - 1
    past = pbm.shape[2] - 1  # the position-based table's column for labels past it
    any_click = False
    last_click = -1
    stopped = False
    for i in range(m):
        d = first + top_i[i]
        shown[i] = gains[d] * discount[m, i]  # reused below for the scores
        c = False
        if not cascade:
            g = np.int64(labels[d])
            if uniform[uo + i] < pbm[model, i, g if 0 <= g < past else past]:
                c = True
                any_click = True
                last_click = i
        elif not stopped:
            g = min(max(np.int64(labels[d]), 0), g_top)
            if uniform[uo + i] < tables[model, 0, g]:
                c = True
                any_click = True
                last_click = i
                if uniform[uo + m + i] < tables[model, 1, g]:
                    stopped = True
        clicked[i] = c
    best = ideal[q]
    ndcg[j, s] = _pairwise_sum(shown, m) / best if best > 0 else 0.0
    if not any_click:
        return 0

    # log D(p): the shown documents at positions >= p plus every document not shown.
    for i in range(m):
        shown[i] = scores[go + top_i[i]]
    log_rest = _log_rest(scores, go, n, top_i, m, is_shown)
    _coefficients(shown, clicked, m, last_click, log_rest, log_d, ratio, coef)
    return m


@jit
def _ascend(w, j, grad, params, w0):
    """``w[j] += lr * grad``, with FedProx's proximal part ``- lr mu (w[j] - w0[j])`` when the
    job's ``mu = params[j, 4]`` is not 0 (``w0``: the jobs' start weights), then DP clipping to
    the job's norm bound (``params[j]``), in the L2 norm, or the L1 norm when ``params[j, 3]``
    is 1."""
    n_par = w.shape[1]
    lr = params[j, 0]
    mu = params[j, 4]
    l1 = params[j, 3] == 1.0
    total = 0.0
    if mu == 0.0:
        for f in range(n_par):
            w[j, f] = w[j, f] + lr * grad[f]
            total += abs(w[j, f]) if l1 else w[j, f] * w[j, f]
    else:
        lr_mu = lr * mu  # the reference's ``lr * mu * (theta - start)``, in its order
        for f in range(n_par):
            w[j, f] = w[j, f] + (lr * grad[f] - lr_mu * (w[j, f] - w0[j, f]))
            total += abs(w[j, f]) if l1 else w[j, f] * w[j, f]
    bound = params[j, 1]
    norm = total if l1 else np.sqrt(total)
    if norm > bound:
        scale = bound / norm
        for f in range(n_par):
            w[j, f] = w[j, f] * scale


@jit
def _linear_grad(grad, coef, top_i, m, features, first):
    """The linear ranker's gradient: the coefficient-weighted shown documents."""
    grad[:] = 0.0
    for i in range(m):
        c = coef[i]
        if c != 0.0:
            row = features[first + top_i[i]]
            for f in range(grad.size):
                grad[f] += c * row[f]


@jit
def _mlp_grad(grad, coef, top_i, m, features, first, acts, wj, dpre):
    """``MLPRanker.grad`` of the coefficients for one hidden layer of ``H = acts.shape[1]``
    tanh units (``acts``: the query's activations; ``wj``: ``W`` (n_features, H) row-major,
    ``b``, output ``v``)."""
    n_feat, h_n = features.shape[1], acts.shape[1]
    o_b = n_feat * h_n  # offsets of b and v in the parameters
    o_v = o_b + h_n
    grad[:] = 0.0
    for i in range(m):
        c = coef[i]
        if c == 0.0:
            continue
        a = acts[top_i[i]]
        row = features[first + top_i[i]]
        for h in range(h_n):
            grad[o_v + h] += c * a[h]
            dpre[h] = c * wj[o_v + h] * (1.0 - a[h] * a[h])
            grad[o_b + h] += dpre[h]
        for f in range(n_feat):
            x = np.float64(row[f])
            base = f * h_n
            for h in range(h_n):
                grad[base + h] += x * dpre[h]


@jit
def linear_scores(features, first, n, wj, out, o):
    """``out[o:o + n]`` = the scores of documents ``first .. first + n - 1``: float64 sums of
    the float32 (or float64) rows times ``wj``, four partial sums per row (so LLVM can keep
    them in vector lanes), no upcast copy of the rows."""
    n_feat = wj.size
    top = n_feat - n_feat % 4
    for i in range(n):
        row = features[first + i]
        a0 = 0.0
        a1 = 0.0
        a2 = 0.0
        a3 = 0.0
        for f in range(0, top, 4):
            a0 += np.float64(row[f]) * wj[f]
            a1 += np.float64(row[f + 1]) * wj[f + 1]
            a2 += np.float64(row[f + 2]) * wj[f + 2]
            a3 += np.float64(row[f + 3]) * wj[f + 3]
        acc = (a0 + a1) + (a2 + a3)
        for f in range(top, n_feat):
            acc += np.float64(row[f]) * wj[f]
        out[o + i] = acc


@jit
def _chunks(n_jobs, n_threads):
    """Bounds of the job ranges a parallel loop hands out: a few per thread, so uneven jobs
    balance, each allocating its scratch arrays once (results do not depend on them)."""
    n = min(n_jobs, 4 * n_threads)
    bounds = np.zeros(n + 1, dtype=np.int64)
    for c in range(1, n + 1):
        bounds[c] = c * n_jobs // n
    return bounds


@jit(inline="always")
def _train_linear(
    ptrs, owned, owned_ptr, steps, sizes, k, shared, qptr, labels, features, gains, discount,
    ideal, tables, n_grades, params, w, w0, n_threads, served, seen, grp, pbm,
):  # fmt: skip
    """A whole batch of linear learners in one call: ``draw``, then every job's interactions
    (score its query with its current weights, rank, click, nDCG, update ``w[j]`` in place),
    jobs in parallel. Returns ``draw``'s ``query``, the shown nDCG@k and ``from_shared``
    (``step``'s arguments otherwise, ``grp`` ``draw``'s users, ``n_threads`` the threads in
    force). When ``served`` has rows (jobs,
    steps, k), each interaction's shown documents (offsets in the query) go to ``served[j, s]``
    and its clicks to ``seen[j, s]`` (entries past the shown list untouched), and nothing is
    learned (serving: the weights stay as they were)."""
    query, gptr, uptr, gumbel, uniform, ndcg, model_at, from_shared = _draws(
        ptrs, owned, owned_ptr, steps, sizes, k, shared, grp
    )
    kinds = grp[7]
    max_docs = 0
    for q in range(sizes.size):
        max_docs = max(max_docs, sizes[q])
    scores = np.empty_like(gumbel)
    bounds = _chunks(steps.size, n_threads)
    for c in prange(bounds.size - 1):
        work = workspace(k, max_docs)
        coef, top_i, clicked = work[5], work[1], work[2]
        grad = np.empty(w.shape[1])
        for j in range(bounds[c], bounds[c + 1]):
            wj = w[j]
            for s in range(steps[j]):
                first = qptr[query[j, s]]
                n = qptr[query[j, s] + 1] - first
                linear_scores(features, first, n, wj, scores, gptr[j, s])
                m = _interact(
                    j, s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, gains,
                    discount, ideal, tables, n_grades, model_at, kinds, pbm, ndcg, k, work,
                )  # fmt: skip
                if served.shape[0]:
                    for i in range(min(k, n)):
                        served[j, s, i] = top_i[i]
                        seen[j, s, i] = clicked[i]
                if served.shape[0]:
                    continue
                if m:
                    _linear_grad(grad, coef, top_i, m, features, first)
                elif params[j, 4] != 0.0:  # FedProx steps without a click too
                    grad[:] = 0.0
                else:
                    continue
                _ascend(w, j, grad, params, w0)
    return query, ndcg, from_shared


@_parallel
def train_linear(
    ptrs, owned, owned_ptr, steps, sizes, k, shared, qptr, labels, features, gains, discount,
    ideal, tables, n_grades, params, w, w0, n_threads, served, seen, grp, pbm,
):  # fmt: skip
    """``_train_linear``, jobs in parallel (``use_threads`` picks it)."""
    return _train_linear(
        ptrs, owned, owned_ptr, steps, sizes, k, shared, qptr, labels, features, gains,
        discount, ideal, tables, n_grades, params, w, w0, n_threads, served, seen, grp, pbm,
    )  # fmt: skip


@jit
def _train_linear_serial(
    ptrs, owned, owned_ptr, steps, sizes, k, shared, qptr, labels, features, gains, discount,
    ideal, tables, n_grades, params, w, w0, n_threads, served, seen, grp, pbm,
):  # fmt: skip
    """``_train_linear``, one job after the other."""
    return _train_linear(
        ptrs, owned, owned_ptr, steps, sizes, k, shared, qptr, labels, features, gains,
        discount, ideal, tables, n_grades, params, w, w0, n_threads, served, seen, grp, pbm,
    )  # fmt: skip


@jit(inline="always")
def _step(
    s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, features, gains, discount,
    ideal, tables, n_grades, params, w, w0, ndcg, k, acts, aptr, max_docs, n_threads,
    model_at, kinds, pbm,
):  # fmt: skip
    """Interaction ``s`` of every job with ``query[j, s] >= 0``: rank, click, nDCG, update.

    ``scores[gptr[j, s]:]`` hold the job's current scores of its query's documents.
    ``params[j]`` is (learning rate, clip norm or inf, first click model, clip order 2 or 1,
    FedProx mu; ``w0[j]`` the start weights mu pulls back to, read only when mu is not 0). The
    step's click model is ``model_at[j, s]`` (``draw``'s) of kind ``kinds``: a cascade's row of
    ``tables`` is (P(click | grade), P(stop | click, grade)) for its ``n_grades`` grades, a
    position-based model's ``pbm`` row P(click) per position and label. ``discount[m, :m]``
    is ``metrics._discount(m)``; ``gains`` per document. Updates ``w[j]`` in place and writes
    the shown nDCG@k to ``ndcg[j, s]``; queries have at most ``max_docs`` documents;
    ``n_threads`` sizes the job ranges.
    Linear rankers: ``acts`` is (0, 0). One-hidden-layer tanh MLPs (``MLPRanker`` with
    ``hidden = (H,)``, ``w[j]`` its flat parameters): job ``j``'s hidden activations of its
    query's documents are at ``acts[aptr[j]:]`` (numpy computed them with the scores).
    """
    bounds = _chunks(query.shape[0], n_threads)
    for c in prange(bounds.size - 1):
        work = workspace(k, max_docs)
        coef, top_i = work[5], work[1]
        grad = np.empty(w.shape[1])
        dpre = np.empty(acts.shape[1])
        for j in range(bounds[c], bounds[c + 1]):
            if query[j, s] < 0:
                continue
            m = _interact(
                j, s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, gains,
                discount, ideal, tables, n_grades, model_at, kinds, pbm, ndcg, k, work,
            )  # fmt: skip
            first = qptr[query[j, s]]
            if not m:
                if params[j, 4] == 0.0:
                    continue
                grad[:] = 0.0  # FedProx steps without a click too
            elif acts.shape[1]:
                _mlp_grad(grad, coef, top_i, m, features, first, acts[aptr[j] :], w[j], dpre)
            else:
                _linear_grad(grad, coef, top_i, m, features, first)
            _ascend(w, j, grad, params, w0)


@_parallel
def step(
    s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, features, gains, discount,
    ideal, tables, n_grades, params, w, w0, ndcg, k, acts, aptr, max_docs, n_threads,
    model_at, kinds, pbm,
):  # fmt: skip
    """``_step``, jobs in parallel (``use_threads`` picks it)."""
    _step(
        s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, features, gains, discount,
        ideal, tables, n_grades, params, w, w0, ndcg, k, acts, aptr, max_docs, n_threads,
        model_at, kinds, pbm,
    )  # fmt: skip


@jit
def _step_serial(
    s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, features, gains, discount,
    ideal, tables, n_grades, params, w, w0, ndcg, k, acts, aptr, max_docs, n_threads,
    model_at, kinds, pbm,
):  # fmt: skip
    """``_step``, one job after the other."""
    _step(
        s, query, gptr, uptr, scores, gumbel, uniform, qptr, labels, features, gains, discount,
        ideal, tables, n_grades, params, w, w0, ndcg, k, acts, aptr, max_docs, n_threads,
        model_at, kinds, pbm,
    )  # fmt: skip


@jit
def logged_linear(qptr, queries, rankings, clicks, features, w, lr, every, scale):
    """PDGD of a linear ranker from logged interactions (centralised PDGD's server): for each
    ``t``, query ``queries[t]`` showed documents ``rankings[t]`` (offsets in the query, ``-1``
    pads the end) with ``clicks[t]``. Each one's gradient at the current weights ``w`` (updated
    in place) is summed; every ``every`` interactions ``w += lr * sum`` (0: never), and the
    remainder's ``w += lr * scale * sum`` at the end. Returns how many were logged."""
    n_log, k = rankings.shape
    n_par = w.size
    max_docs = 0
    for t in range(n_log):
        max_docs = max(max_docs, qptr[queries[t] + 1] - qptr[queries[t]])
    scores = np.empty(max_docs)
    top_i = np.empty(k, dtype=np.int64)
    clicked = np.zeros(k, dtype=np.bool_)
    shown, log_d, coef, ratio = np.empty(k), np.empty(k), np.empty(k), np.empty((k, k))
    is_shown = np.zeros(max_docs, dtype=np.bool_)
    grad, pending = np.empty(n_par), np.zeros(n_par)
    for t in range(n_log):
        m = 0
        last_click = -1
        while m < k and rankings[t, m] >= 0:
            top_i[m] = rankings[t, m]
            clicked[m] = clicks[t, m]
            if clicked[m]:
                last_click = m
            m += 1
        if last_click >= 0:
            first = qptr[queries[t]]
            n = qptr[queries[t] + 1] - first
            linear_scores(features, first, n, w, scores, 0)
            for i in range(m):
                shown[i] = scores[top_i[i]]
            log_rest = _log_rest(scores, 0, n, top_i, m, is_shown)
            _coefficients(shown, clicked, m, last_click, log_rest, log_d, ratio, coef)
            _linear_grad(grad, coef, top_i, m, features, first)
            for f in range(n_par):
                pending[f] += grad[f]
        if every > 0 and (t + 1) % every == 0:
            for f in range(n_par):
                w[f] = w[f] + lr * pending[f]
                pending[f] = 0.0
    step = lr * scale
    for f in range(n_par):
        w[f] = w[f] + step * pending[f]
    return n_log
