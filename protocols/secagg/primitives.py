"""SecAgg's primitives: the ChaCha20 PRG and HKDF keys, X25519 key pairs, the fixed-point ring
Z_2^64, Shamir secret sharing over GF(2^31 - 1) (vectorised with numpy; why not a library: see
the package docstring) and the Harary neighbour graph of SecAgg+."""

from __future__ import annotations

import math

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from foltr_async.runtime.secure import SecureAggregationError

PRIME = 2**31 - 1  # Shamir field; products of two elements fit in int64
CHUNKS = 16  # a 32-byte secret as 16 uint16 values
KEY_LEN = 32
_NONCE16 = bytes(16)  # ChaCha20 (cryptography): 4-byte counter + 12-byte nonce


def prg(seed: bytes, n: int) -> np.ndarray:
    """n pseudo-random uint64 values: the ChaCha20 keystream under a 32-byte seed."""
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE16), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(8 * n)), dtype="<u8")


def kdf(secret: bytes, label: str) -> bytes:
    """A 32-byte key for one purpose (``label`` names it, its parties and the round)."""
    return HKDF(hashes.SHA256(), 32, None, label.encode()).derive(secret)


def public_key(raw: bytes) -> X25519PublicKey:
    return X25519PublicKey.from_public_bytes(raw)


def private_key(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def pair_label(a: str, b: str, round: int) -> str:
    lo, hi = sorted((a, b))
    return f"foltr-secagg mask {lo}|{hi}@{round}"


def pair_mask(sk: X25519PrivateKey, pk: bytes, a: str, b: str, round: int, n: int) -> np.ndarray:
    """PRG(s_ab): the pairwise mask of clients a and b (one's private key, the other's public
    key), the same from either side, as the client adds it and the server removes it."""
    return prg(kdf(sk.exchange(public_key(pk)), pair_label(a, b, round)), n)


def share_label(src: str, dst: str, round: int) -> str:
    return f"foltr-secagg share {src}>{dst}@{round}"


def to_ring(x: np.ndarray, bits: int, clients: int) -> np.ndarray:
    """Fixed-point encoding in Z_2^64 (two's complement), refusing values whose sum over
    ``clients`` could wrap around."""
    limit = 2.0 ** (63 - bits) / max(1, clients)
    top = float(np.max(np.abs(x))) if x.size else 0.0
    if not top < limit:  # also catches NaN
        raise SecureAggregationError(
            f"update value {top:g} is outside the fixed-point range +-{limit:g} "
            f"({bits} fractional bits, {clients} clients)"
        )
    return np.rint(x * 2.0**bits).astype(np.int64).view(np.uint64)


def from_ring(z: np.ndarray, bits: int) -> np.ndarray:
    """Decode a (summed) ring vector to floats."""
    return np.ascontiguousarray(z, dtype=np.uint64).view(np.int64) / 2.0**bits


def secret_values(secret: bytes) -> np.ndarray:
    return np.frombuffer(secret, dtype="<u2").astype(np.int64)


def secret_bytes(values: np.ndarray, what: str) -> bytes:
    if values.size != CHUNKS or values.min() < 0 or values.max() > 0xFFFF:
        raise SecureAggregationError(f"{what}: the shares do not agree on a secret")
    return values.astype("<u2").tobytes()


def shamir_split(
    secret: np.ndarray, threshold: int, n: int, rng: np.random.Generator
) -> np.ndarray:
    """t-out-of-n Shamir shares of each value of ``secret`` (ints in [0, PRIME)).

    Row i is ``[x_i = i + 1, f_1(x_i), ...]`` (uint32), f_j a random polynomial of degree
    ``threshold - 1`` over GF(PRIME) with f_j(0) = secret[j]; any ``threshold`` rows give the
    secret back, fewer say nothing about it.
    """
    s = np.asarray(secret, dtype=np.int64)
    if not 1 <= threshold <= n < PRIME:
        raise ValueError(f"Shamir: need 1 <= threshold ({threshold}) <= n ({n})")
    if s.size and (s.min() < 0 or s.max() >= PRIME):
        raise ValueError("Shamir: secret values must lie in [0, PRIME)")
    coef = rng.integers(0, PRIME, size=(threshold - 1, s.size), dtype=np.int64)
    x = np.arange(1, n + 1, dtype=np.int64)[:, None]
    acc = np.zeros((n, s.size), dtype=np.int64)
    for c in coef[::-1]:  # Horner: ((c_{t-1} x + c_{t-2}) x + ...) x, < 2^63 at every step
        acc = (acc + c) * x % PRIME
    acc = (acc + s) % PRIME
    return np.hstack([x, acc]).astype(np.uint32)


def _inverse(a: np.ndarray) -> np.ndarray:
    """a^(PRIME - 2) mod PRIME elementwise (Fermat), by square and multiply."""
    result = np.ones_like(a)
    base = a % PRIME
    e = PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    return result


def shamir_combine(shares: np.ndarray, threshold: int) -> np.ndarray:
    """The secret from the first ``threshold`` shares with distinct x (Lagrange at 0)."""
    rows = np.asarray(shares, dtype=np.int64).reshape(-1, np.shape(shares)[-1])
    _, first = np.unique(rows[:, 0], return_index=True)
    rows = rows[np.sort(first)][:threshold]
    if len(rows) < threshold or threshold < 1:
        raise SecureAggregationError(f"{len(rows)} distinct shares, threshold {threshold}")
    x, y = rows[:, 0], rows[:, 1:]
    if (x <= 0).any() or (x >= PRIME).any():
        raise SecureAggregationError("a share has an x coordinate outside the field")
    # basis l_j(0) = prod_{m != j} x_m / (x_m - x_j): one vector step per m
    num = np.ones(threshold, dtype=np.int64)
    den = np.ones(threshold, dtype=np.int64)
    others = ~np.eye(threshold, dtype=bool)
    for m in range(threshold):
        num = np.where(others[m], num * x[m] % PRIME, num)
        den = np.where(others[m], den * ((x[m] - x) % PRIME) % PRIME, den)
    basis = num * _inverse(den) % PRIME
    return (basis[:, None] * (y % PRIME) % PRIME).sum(axis=0) % PRIME


def harary(ids: list[str], degree: int, rng: np.random.Generator) -> dict[str, list[str]]:
    """Each client's neighbours: everyone (``degree`` 0 or >= n - 1), else the Harary graph
    H(k, n) of even degree k (``degree`` rounded up) over a random order of the clients: the
    k/2 nearest on each side of a ring (Bell et al. 2020)."""
    n = len(ids)
    k = degree + degree % 2
    if degree <= 0 or k >= n - 1:
        return {u: [v for v in ids if v != u] for u in ids}
    order = np.asarray(ids, dtype=object)[rng.permutation(n)]
    half = np.arange(1, k // 2 + 1)
    ring = (np.arange(n)[:, None] + np.concatenate([half, -half])[None, :]) % n
    return {order[i]: sorted(order[ring[i]].tolist()) for i in range(n)}


def threshold_of(neighbours: int, fraction: float) -> int:
    """Shares needed of a client's ``neighbours``: more than half of them at least."""
    return max(1, min(neighbours, math.floor(fraction * neighbours) + 1))
