"""Reproducible sampling: counter-based noise + inverse-CDF sampling, and target logprobs.

The uniform for request r at output position t is a pure function of (r's seed key, t)
(splitmix64 of the two), and the sampled token is the inverse CDF of the row's own filtered
distribution at that uniform (under top-p: of the unfiltered one, redrawn at a hash of the
uniform while outside the nucleus, ``_nucleus``). So a token depends only on the model's logits
for that prefix and on (seed, r, t): not on batch composition, not on what ran before, and not on
whether the token was drafted (speculative verification recomputes exactly the same function).
"""
from __future__ import annotations

import numpy as np
import torch

from tailrl.engine import logits_process
from tailrl.kernels import host_to_device, select
from tailrl.noise import splitmix64, splitmix64_np


def _kernels(x: torch.Tensor):
    """The backend whose row sums (``Backend.softmax_cdf``, ``cumsum_rows``, ``logsumexp_rows``)
    and ``top_k`` serve ``x``: on a GPU, Triton's, whose sums do not change with the batch
    (kernels/gpu/scan.py), nor its top-k's ties."""
    return select(x.device, x.dtype)


def _top_k_filter(scaled: torch.Tensor, top_k: int, top_p: torch.Tensor):
    """Rows with top-k (top-p applies inside it): their k best, sorted (found with ``top_k``, not
    a sort of the row), the tokens outside the top-p nucleus of the top-k distribution masked.
    Returns (filtered logits [M, k], vocabulary ids [M, k])."""
    vals, idx = _kernels(scaled).top_k(scaled, min(top_k, scaled.shape[-1]))
    probs = vals.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it >= top_p
    before = _kernels(probs).cumsum_rows(probs) - probs
    drop = before >= top_p[:, None]
    drop[:, 0] = False                                 # the top token always survives
    return vals.masked_fill(drop, float("-inf")), idx


def _cdf(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the unnormalised CDF of exp(logits - max), its total and the max. Sampling and
    ``token_logprobs`` both take logsumexp from here (max + log(total)): the same bits."""
    return _kernels(logits).softmax_cdf(logits)


def _pick(cdf: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row: the index i with cdf[i-1] <= u*total < cdf[i] (the inverse CDF at u)."""
    target = (u.to(cdf.dtype) * total).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total (u within 2^-25 of 1 in float32): never go past the last
    # token with probability mass, which is where the cdf first reaches its total
    last = torch.searchsorted(cdf, total.unsqueeze(1), right=False).squeeze(1)
    return torch.minimum(idx, last)


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the inverse CDF's index at u, and logsumexp(row). logits may hold -inf."""
    cdf, total, mx = _cdf(logits)
    return _pick(cdf, total, u), mx + total.log()


def _retry(u: np.ndarray, attempt: int) -> np.ndarray:
    """A fresh uniform per row for a top-p row's ``attempt``-th redraw: a hash of u's 53 bits."""
    bits = (np.asarray(u, dtype=np.float64) * (1 << 53)).astype(np.uint64)
    mixed = splitmix64_np(bits ^ np.uint64(splitmix64(attempt))) >> np.uint64(11)
    return mixed.astype(np.float64) * (1.0 / (1 << 53))


def _probabilities(x: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """exp(x - mx) per row: the unnormalised probabilities ``_cdf`` sums."""
    return (x - mx[:, None]).exp_()


def _mass_above(e: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Per row r: the sum of e[r] over the tokens whose e is above ``value[r]``, overwriting e
    (a sequential scan in vocabulary order: the same bits whatever the batch or thread count)."""
    e.masked_fill_(e <= value[:, None], 0.0)                      # e where e > v, else 0
    return _kernels(e).cumsum_rows(e, inplace=True)[:, -1]


def _nucleus(x: torch.Tensor, mx: torch.Tensor, cdf: torch.Tensor, total: torch.Tensor, first: torch.Tensor,
             top_p: torch.Tensor, u: np.ndarray, attempts: int = 8) -> torch.Tensor:
    """Top-p without sorting the rows x (their max mx, ``_cdf``'s cdf and total). With
    e = exp(x - mx), the nucleus is every token whose e has mass(e above it) < top_p * total:
    the smallest set of most probable tokens reaching top_p, ties at its edge kept. A token
    drawn from the unfiltered distribution (``first``, at u) is kept if it lies in the
    nucleus, else redrawn at a hash of u (``_retry``): a kept token follows the filtered
    distribution exactly, and each draw lands in the nucleus with probability >= top_p. Rows
    still outside after ``attempts`` redraws find the nucleus's edge by bisection over their
    sorted e with the same membership test, and draw inside it."""
    bound = top_p * total
    tok = first.clone()
    todo = torch.arange(x.shape[0], device=x.device)
    for attempt in range(1, attempts + 2):
        e = _probabilities(x, mx) if attempt == 1 else _probabilities(x[todo], mx[todo])
        value = e.gather(1, tok[todo][:, None]).squeeze(1)
        todo = todo[_mass_above(e, value) >= bound[todo]]
        if not len(todo) or attempt > attempts:
            break
        tok[todo] = _pick(cdf[todo], total[todo], torch.as_tensor(_retry(u[todo.cpu().numpy()], attempt),
                                                                  device=x.device))
    for r in todo.tolist():
        e = _probabilities(x[r:r + 1], mx[r:r + 1])
        values = e.unique(sorted=True).tolist()                    # ascending; the top one is always kept
        lo, hi = 0, len(values) - 1                                # find the lowest kept value
        while lo < hi:
            mid = (lo + hi) // 2
            if _mass_above(e.clone(), e.new_tensor([values[mid]]))[0] < bound[r]:
                hi = mid
            else:
                lo = mid + 1
        kept = _kernels(e).cumsum_rows(e.masked_fill_(e < values[lo], 0.0), inplace=True)
        tok[r] = _pick(kept, kept[:, -1], torch.as_tensor(_retry(u[r:r + 1], attempts + 1), device=x.device))[0]
    return tok


def _scale(logits: torch.Tensor, temperature: list[float]) -> torch.Tensor:
    """logits / T per row (T = 0, greedy, reports at T = 1); untouched when every T is 0 or 1."""
    if all(t in (0.0, 1.0) for t in temperature):
        return logits
    inv_t = host_to_device(logits.device, [1.0 / t if t else 1.0 for t in temperature], logits.dtype)
    return logits * inv_t[:, None]


def _index(rows: list[int], m: int, device) -> torch.Tensor | slice:
    return slice(None) if len(rows) == m else host_to_device(device, rows)


CHUNK_ELEMENTS = 1 << 21          # rows go in chunks of about 8 MB of float32 logits (on a CPU)


class Fetched:
    """Per-row results of the sampler (tokens, log-probabilities): the tensors where they were
    computed (``tensors``: a next step's inputs can read its tokens there) and, from
    ``lists()``, on the host. On a GPU the copies back start at once, without waiting, and
    ``lists()`` waits for them: one wait per step, as late as its caller likes."""

    def __init__(self, tensors: tuple[torch.Tensor, ...] | None, lists: tuple[list, ...] | None = None):
        self.tensors, self._lists, self._event = tensors, lists, None
        if lists is None and tensors[0].device.type == "cpu":
            self._lists = tuple(t.tolist() for t in tensors)
        elif lists is None:
            self._host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        elif tensors is None:                       # a CPU's chunks, back as lists already
            self.tensors = tuple(torch.tensor(x, device="cpu") for x in lists)

    def lists(self) -> tuple[list, ...]:
        if self._lists is None:
            self._event.synchronize()
            self._lists = tuple(h.tolist() for h in self._host)
        return self._lists


def _in_chunks(fn, logits: torch.Tensor, *per_row: list) -> Fetched:
    """fn(logits chunk, *per_row chunks) -> a tuple of per-row tensors, over chunks of rows.
    Every row is computed on its own, so chunks keep each pass's data in a CPU's cache
    without changing a bit (at a 152k vocabulary and 64 rows: half the time of one pass over
    all). On a GPU the rows go whole: a chunk there buys nothing and costs its ~25 launches and
    a wait (13 rows per chunk at a 152k vocabulary: 580 operations for 256 rows, 28 whole)."""
    rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    if logits.shape[0] <= rows or logits.device.type != "cpu":
        return Fetched(fn(logits, *per_row))
    parts = [Fetched(fn(logits[i:i + rows], *(x[i:i + rows] for x in per_row))).lists()
             for i in range(0, logits.shape[0], rows)]
    return Fetched(None, tuple([v for part in parts for v in part[k]] for k in range(len(parts[0]))))


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           u: list[float] | np.ndarray, procs: list | None = None) -> tuple[list[int], list[float]]:
    """logits [M, V] -> (token per row, logprob of it under log_softmax(logits / T)).
    Temperature 0 is greedy (argmax, logprob at T = 1). Filtered rows (top-k / top-p, and the
    rows of ``procs``: logits_process.py) sample from the filtered distribution; their logprob
    is still the unfiltered tempered one (what a trainer recomputes for importance ratios)."""
    return sample_async(logits, temperature, top_k, top_p, u, procs).lists()


GRAPH_LOGITS_BYTES = 8 << 20     # a step graph samples in it where its float32 logits take at most this


def graph_mode(temperature: list[float], top_k: list[int], top_p: list[float]) -> str | None:
    """The form of the sampler that a step's CUDA graph can hold (its control flow fixed by the
    mode, its uniforms a static input): "sample" where every row samples at T = 1 without top-k
    or top-p (an RL rollout's), "greedy" where every row is greedy; else None (sampled eagerly)."""
    temps = set(temperature)                     # per row on a step's path: C-speed passes
    if temps == {1.0} and max(top_k, default=1) <= 0 and min(top_p, default=0.0) >= 1.0:
        return "sample"
    return "greedy" if temps == {0.0} else None


def sample_static(logits: torch.Tensor, mode: str, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample``'s tokens and log-probabilities of every row in ``graph_mode`` ``mode``, with the
    uniforms on the device already (float32, as ``_pick`` takes them: the host rounds them as
    the device would): the same operations on the same values, so the same bits, and nothing
    read from the host."""
    m = logits.shape[0]
    return _sample_rows(logits, [1.0 if mode == "sample" else 0.0] * m, [0] * m, [1.0] * m, u)


def for_sampling(logits: torch.Tensor) -> torch.Tensor:
    """The LM head's logits as the sampler takes them: float32 (bfloat16 CDFs are too coarse)."""
    return logits.float() if logits.dtype == torch.bfloat16 else logits


def sample_async(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                 u: list[float] | np.ndarray, procs: list | None = None) -> Fetched:
    """``sample`` without waiting for the device: its tokens stay readable there
    (``Fetched.tensors[0]``, int64 [M]) and come back with ``lists()``. ``procs``: per row, its
    ``logits_process.Position`` or None (None: no row processes its logits)."""
    return _in_chunks(_sample_rows, logits, temperature, top_k, top_p, u, *([procs] if procs else []))


def _normaliser(scaled: torch.Tensor, temperature: list[float]):
    """logsumexp of each row (greedy rows: at T = 1), the greedy and the sampled (T > 0) rows'
    indices, and the sampled rows' cdf, total and max (``_cdf``). ``sample`` and ``token_logprobs`` both take their
    log-probabilities' normaliser from here: the same bits."""
    m, dev = scaled.shape[0], scaled.device
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    sampled = [i for i, t in enumerate(temperature) if t != 0]
    lse = torch.empty(m, dtype=scaled.dtype, device=dev)
    if greedy:
        g = _index(greedy, m, dev)
        lse[g] = _kernels(scaled).logsumexp_rows(scaled[g])
    if not sampled:
        return lse, greedy, sampled, None
    cdf, total, mx = _cdf(scaled[_index(sampled, m, dev)])
    lse[_index(sampled, m, dev)] = mx + total.log()
    return lse, greedy, sampled, (cdf, total, mx)


def _sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                 u: list[float] | np.ndarray, procs: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    dev = logits.device
    m = logits.shape[0]
    scaled = _scale(logits, temperature)
    # the logits tokens are drawn from: the processed ones where a row asks (logits_process.py)
    draw = scaled if procs is None else logits_process.apply(logits, scaled, temperature, procs)
    lse, greedy, sampled, sums = _normaliser(draw, temperature)
    tokens = torch.empty(m, dtype=torch.long, device=dev)
    if greedy:
        tokens[_index(greedy, m, dev)] = draw[_index(greedy, m, dev)].argmax(dim=-1)
    if sampled:
        cdf, total, mx = sums
        if isinstance(u, torch.Tensor):          # float32 on the device already (a step graph's, graph_mode)
            uu, u_dev = None, u[_index(sampled, m, dev)]
        else:
            uu = np.asarray(u, dtype=np.float64)[sampled]
            u_dev = host_to_device(dev, uu)
        tokens[_index(sampled, m, dev)] = _pick(cdf, total, u_dev)
        by_p = [j for j, i in enumerate(sampled) if top_k[i] <= 0 and top_p[i] < 1]
        # a top-k row needs only its k best; rows go by their own k, so that tied logits come
        # out of topk in the same order whatever else is in the batch
        for k in sorted({top_k[i] for i in sampled if top_k[i] > 0}):
            by_k = [j for j, i in enumerate(sampled) if top_k[i] == k]
            at = host_to_device(dev, [sampled[j] for j in by_k])
            p = host_to_device(dev, [top_p[sampled[j]] for j in by_k], logits.dtype)
            vals, idx = _top_k_filter(draw[at], k, p)
            pick, _ = _inverse_cdf(vals, host_to_device(dev, uu[by_k]))
            tokens[at] = idx.gather(1, pick[:, None]).squeeze(1)
        if by_p:                                 # (every row: slices, not copies of [M, V] tensors)
            at = _index([sampled[j] for j in by_p], m, dev)
            j = _index(by_p, len(sampled), dev)
            p = host_to_device(dev, [top_p[sampled[i]] for i in by_p], logits.dtype)
            tokens[at] = _nucleus(draw[at], mx[j], cdf[j], total[j], tokens[at], p, uu[by_p])
    if draw is not scaled:                       # processed rows report the unprocessed log-probability
        rows = [i for i, q in enumerate(procs) if q is not None]
        lse[_index(rows, m, dev)] = _normaliser(scaled[_index(rows, m, dev)], [temperature[i] for i in rows])[0]
    # log p(token) = scaled[token] - logsumexp(scaled): the target's log-softmax, never a draft's
    lp = scaled.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens, lp


def token_logprobs(logits: torch.Tensor, temperature: list[float], tokens: list[int]) -> list[float]:
    """logits [M, V] -> log_softmax(logits / T)[token] per row, computed as ``sample`` computes
    the log-probability it reports (bit for bit: each row on its own, the same operations), for
    tokens known in advance (teacher forcing: ``tailrl.engine.score``)."""
    return _in_chunks(_token_logprobs_rows, logits, temperature, tokens).lists()[0]


def _token_logprobs_rows(logits: torch.Tensor, temperature: list[float], tokens: list[int]) -> tuple[torch.Tensor]:
    scaled = _scale(logits, temperature)
    lse = _normaliser(scaled, temperature)[0]
    tok = host_to_device(logits.device, tokens, torch.long)
    return (scaled.gather(1, tok[:, None]).squeeze(1) - lse,)
