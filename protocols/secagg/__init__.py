"""Secure aggregation after Bonawitz et al. (CCS 2017), with the sparse-graph variant SecAgg+ of
Bell et al. (CCS 2020): the server learns the sum of the clients' updates and nothing else about
any one of them, even when clients drop out after sharing their keys.

One round, every message an ordinary envelope through the server (clients never talk directly):

1. ``secagg.advertise`` server -> selected; ``secagg.keys`` back: two fresh X25519 public keys
   per client, ``c`` for the share channel, ``s`` for the pairwise masks. Responders: U1.
2. ``secagg.roster`` server -> each u in U1: its neighbours N(u) with their public keys and the
   threshold t. ``degree = 0``: everyone is everyone's neighbour (SecAgg); ``degree = k``: a
   Harary graph of degree k over a random permutation of U1 (SecAgg+), so a client's cost grows
   with k = O(log n), not n. Each client draws a self-mask seed b_u, splits its mask key s_u^SK
   and b_u into t-out-of-|N(u)| Shamir shares, encrypts the share for v with ChaCha20-Poly1305
   under HKDF(X25519(c_u, c_v)) and sends them in ``secagg.shares``. Responders: U2 (clients
   left with fewer than t neighbours in U2 are pruned: their masks could never be removed).
3. ``secagg.relay`` server -> each v in U2: the ciphertexts addressed to it. Then the protocol's
   own broadcast (the global model) goes to U2; each client trains and, instead of its plain
   reply, sends ``secagg.masked``: y_u = x_u + PRG(b_u) + sum_{v in N(u) & U2} +-PRG(s_uv) in
   Z_2^64, x_u the fixed-point encoding of [w_u * theta_u, w_u] (``precision_bits`` fractional
   bits), s_uv = HKDF(X25519(s_u, s_v)), + when u < v, - otherwise, so pairwise masks cancel in
   the sum. Responders: U3.
4. ``secagg.unmask`` server -> each u in U3: which of its neighbours survived. u answers
   ``secagg.reveal`` with its shares of b_v for surviving neighbours and of s_v^SK for dropped
   ones, never both for one v, and refuses when fewer than t neighbours survived. The server
   rebuilds each b_u (u in U3) and each dropped client's s_v^SK from t shares (a rebuilt key
   must match the advertised public key), removes PRG(b_u) and the dropped clients' pairwise
   masks, and decodes sum_u [w_u theta_u, w_u]; the FPDGD strategy gets the weighted mean.

Choices, stated:

- PRG: the ChaCha20 keystream (``cryptography``) keyed by the 32-byte seed, nonce 0; every seed is
  used once per round (fresh keys each round).
- Shamir: implemented here over GF(2^31 - 1), a 32-byte secret as 16 little-endian 16-bit chunks
  with independent polynomials, vectorised with numpy. The well-kept library that fits,
  PyCryptodome (``Crypto.Protocol.SecretSharing.Shamir``), is not a dependency, shares 16-byte
  secrets over GF(2^128) in pure Python (about 4 ms per split and 16 ms per combine at t = 11 of
  20 on this machine: seconds per round for 100 clients, a minute for the complete graph) and
  draws its coefficients from the OS, which would break the simulator's seeded reproducibility.
- Randomness: keys, seeds and share coefficients come from the client's seeded stream
  (``rng("secagg", id)``), so a scenario and seed replay bit-identically; a deployment would use
  the OS's randomness. Dropout draws have their own stream (``rng("secagg-dropout", id)``), so a
  dropout sweep drops nested sets of clients.
- Threat model: honest-but-curious server and eavesdroppers. Bonawitz et al.'s active variant
  (signed keys under a PKI, the consistency-check round) is not implemented; the threshold is
  kept above half the neighbourhood, which that variant needs.
- ``dropout``: a client that has shared its keys fails to upload with this probability (it has
  trained, its users saw their rankings, then its upload is lost): the case the shares exist for.

Layout: ``primitives`` (PRG, keys, ring, Shamir, Harary graph), ``messages`` (kinds and wire
layout), ``client`` and ``server`` (the two halves), ``scheme`` (settings, a run's halves),
``eavesdropper`` (what a masked upload tells), ``measurement`` (``cost(...)``: one
configuration's per-round cost on the real bus with vector clients, for the benchmark).
"""

from __future__ import annotations

from foltr_async.protocols import eavesdrop, fpdgd
from foltr_async.protocols.secagg import measurement, messages
from foltr_async.protocols.secagg.eavesdropper import MaskedEavesdropper
from foltr_async.protocols.secagg.measurement import cost
from foltr_async.protocols.secagg.scheme import make_run
from foltr_async.protocols.secagg.settings import Settings
from foltr_async.registry import BehaviourEntry
from foltr_async.runtime.secure import Scheme, SecureRun, Summable

__all__ = ["cost"]


def _build(ctx, spec: Summable, settings: dict) -> SecureRun:
    return make_run(spec, settings, ctx.rng, ctx.emit)


def _build_eavesdropper(ctx, proto, group, aid, queries, rng):
    targets, candidates = eavesdrop.targets_of(group), group.params.candidates
    return MaskedEavesdropper(aid, ctx, targets, rng, candidates)


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *messages.KINDS,
    *measurement.KINDS,  # the bench's vector clients (bench secagg)
    Scheme(
        "secagg",
        "Bonawitz et al. 2017 secure aggregation; SecAgg+ with degree",
        Settings.FIELDS,
        _build,
    ),
    BehaviourEntry(
        "secagg_eavesdropper",
        "eavesdropper",
        "taps FPDGD uplinks, plain or masked by secure aggregation: update recovery, query "
        "inference",
        (fpdgd.NAME,),
        eavesdrop.Params,
        _build_eavesdropper,
        check=eavesdrop.check_targets,
    ),
)
