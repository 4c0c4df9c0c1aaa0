"""Reproducible sampling: counter-based noise + inverse-CDF sampling, and target logprobs.

The uniform for request r at output position t is a pure function of (r's seed key, t)
(splitmix64 of the two), and the sampled token is the inverse CDF of the row's own filtered
distribution at that uniform. So a token depends only on the model's logits for that prefix
and on (seed, r, t): not on batch composition, not on what ran before, and not on whether the
token was drafted (speculative verification recomputes exactly the same function).
"""
from __future__ import annotations

import numpy as np
import torch

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


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(keys: list[int], positions: list[int]) -> np.ndarray:
    """``uniform`` of many (key, position) pairs at once (uint64 arithmetic wraps as in Python's & MASK64)."""
    k = np.array(keys, dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64)
    return (_splitmix64_np(k ^ _splitmix64_np(p)) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _filter_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int | None = None):
    """Sort each row descending and mask tokens outside top-k / the top-p nucleus.
    Returns (sorted filtered logits [M, C], sort indices [M, C]): C = V, or ``candidates``
    (top-k rows, top-p or not, need only their k best, found without sorting the row: at a
    152k vocabulary a full sort is most of a decode step)."""
    if candidates is not None and candidates < scaled.shape[-1]:
        vals, idx = scaled.topk(candidates, dim=-1, sorted=True)
    else:
        vals, idx = scaled.sort(dim=-1, descending=True)
    v = vals.shape[-1]
    rank = torch.arange(v, device=vals.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    drop = rank[None, :] >= k[:, None]
    probs = vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it >= top_p
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False                                 # the top token always survives
    return vals.masked_fill(drop, float("-inf")), idx


def _cdf(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the unnormalised CDF of exp(logits - max), its total and the max. Sampling and
    ``token_logprobs`` both take logsumexp from here (max + log(total)): the same bits."""
    mx = logits.amax(dim=-1, keepdim=True)
    cdf = (logits - mx).exp_().cumsum_(dim=-1)                        # [M, V], unnormalised
    return cdf, cdf[:, -1].contiguous(), mx.squeeze(1)


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the index i with cdf[i-1] <= u*total < cdf[i], and logsumexp(row).
    logits may hold -inf (filtered tokens)."""
    cdf, total, mx = _cdf(logits)
    target = (u.to(cdf.dtype) * total).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total (u within 2^-25 of 1 in float32): never go past the last
    # token with probability mass, which is where the cdf first reaches its total
    last = torch.searchsorted(cdf, total.unsqueeze(1), right=False).squeeze(1)
    return torch.minimum(idx, last), mx + total.log()


def _scale(logits: torch.Tensor, temperature: list[float]) -> torch.Tensor:
    """logits / T per row (T = 0, greedy, reports at T = 1); untouched when every T is 0 or 1."""
    if all(t in (0.0, 1.0) for t in temperature):
        return logits
    inv_t = torch.tensor([1.0 / t if t else 1.0 for t in temperature], dtype=logits.dtype, device=logits.device)
    return logits * inv_t[:, None]


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           u: list[float] | np.ndarray) -> tuple[list[int], list[float]]:
    """logits [M, V] -> (token per row, logprob of it under log_softmax(logits / T)).
    Temperature 0 is greedy (argmax, logprob at T = 1). Filtered rows (top-k / top-p) sample
    from the filtered distribution; their logprob is still the unfiltered tempered one (what a
    trainer recomputes for importance ratios)."""
    dev = logits.device
    m = logits.shape[0]
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    sampled = [i for i, t in enumerate(temperature) if t != 0]
    scaled = _scale(logits, temperature)
    tokens = torch.empty(m, dtype=torch.long, device=dev)
    lse = torch.empty(m, dtype=logits.dtype, device=dev)
    if greedy:
        g = torch.tensor(greedy, device=dev) if len(greedy) < m else slice(None)
        tokens[g] = scaled[g].argmax(dim=-1)
        lse[g] = scaled[g].logsumexp(dim=-1)
    if sampled:
        rows = torch.tensor(sampled, device=dev) if len(sampled) < m else slice(None)
        uu = torch.as_tensor(np.asarray(u, dtype=np.float64)[sampled], device=dev)
        tokens[rows], lse[rows] = _inverse_cdf(scaled[rows], uu)
        filt = [i for i in sampled if top_k[i] > 0 or top_p[i] < 1]
        by_k = [i for i in filt if top_k[i] > 0]        # a top-k row (top-p applies inside it): its k best suffice
        for group in (by_k, [i for i in filt if top_k[i] <= 0]):
            if not group:
                continue
            rows = torch.tensor(group, device=dev)
            k = torch.tensor([top_k[i] for i in group], device=dev)
            p = torch.tensor([top_p[i] for i in group], dtype=logits.dtype, device=dev)
            vals, idx = _filter_sorted(scaled[rows], k, p, max(top_k[i] for i in group) if group is by_k else None)
            pick, _ = _inverse_cdf(vals, torch.as_tensor(np.asarray(u, dtype=np.float64)[group], device=dev))
            tokens[rows] = idx.gather(1, pick[:, None]).squeeze(1)
    # log p(token) = scaled[token] - logsumexp(scaled): the target's log-softmax, never a draft's
    lp = scaled.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens.tolist(), lp.tolist()


def token_logprobs(logits: torch.Tensor, temperature: list[float], tokens: list[int]) -> list[float]:
    """logits [M, V] -> log_softmax(logits / T)[token] per row, computed as ``sample`` computes
    the log-probability it reports (bit for bit: each row on its own, the same operations), for
    tokens known in advance (teacher forcing: ``tailrl.engine.score``)."""
    dev = logits.device
    scaled = _scale(logits, temperature)
    lse = torch.empty(logits.shape[0], dtype=logits.dtype, device=dev)
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    sampled = [i for i, t in enumerate(temperature) if t != 0]
    if greedy:
        g = torch.tensor(greedy, device=dev) if len(greedy) < len(temperature) else slice(None)
        lse[g] = scaled[g].logsumexp(dim=-1)
    if sampled:
        rows = torch.tensor(sampled, device=dev) if len(sampled) < len(temperature) else slice(None)
        _, total, mx = _cdf(scaled[rows])
        lse[rows] = mx + total.log()
    tok = torch.tensor(tokens, dtype=torch.long, device=dev)
    return (scaled.gather(1, tok[:, None]).squeeze(1) - lse).tolist()
