"""Counter-based sampling noise: the uniform of request r at output position t is a pure
function of (r's 64-bit seed key, t), splitmix64 of the two. Keys are ``mix`` hashes of
(engine seed, prompt seed, sample index), so the noise, hence every sampled token, does not
depend on batch composition, on what ran before, or on whether the token was drafted. Every
layer that derives seeds (the engine's inputs, the server, the TRL adapter) uses this module.
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix(*parts: int) -> int:
    """Hash a tuple of ints (any sign, any size) into a 64-bit key."""
    h = 0x6A09E667F3BCC908
    for p in parts:
        h = splitmix64(h ^ (int(p) & MASK64))
    return h


def uniform(key: int, position: int) -> float:
    """U[0, 1) with 53 random bits, for request key at output position."""
    return (splitmix64(key ^ splitmix64(position)) >> 11) * (1.0 / (1 << 53))


_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)
SCALAR_UNIFORMS = 12        # up to this many pairs, Python's ints beat numpy's fixed ~11-13 us a call


def splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    return x ^ (x >> _S31)


def uniforms(keys: list[int] | np.ndarray, positions: list[int] | np.ndarray) -> np.ndarray:
    """``uniform`` of many (key, position) pairs at once (uint64 arithmetic wraps as in Python's
    & MASK64); a few pairs (a step of a few rows, every step of a GPU's tail) one by one."""
    if len(keys) <= SCALAR_UNIFORMS:
        return np.array([uniform(int(k), int(p)) for k, p in zip(keys, positions)], dtype=np.float64)
    k = np.array(keys, dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64)
    return (splitmix64_np(k ^ splitmix64_np(p)) >> _S11).astype(np.float64) * (1.0 / (1 << 53))
