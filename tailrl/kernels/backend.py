"""The interface every kernel backend implements: the hot operations of a decoder layer.

A backend is chosen once per (device, dtype) by ``tailrl.kernels.select``; the model calls
its methods and never asks which backend it has. Every operation is row-local: a token's
result depends only on its own inputs (and, for attention, its own row's visible K/V), which
is what makes outputs identical with and without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tailrl.kernels import delta
from tailrl.kernels.layout import AttentionMeta


@dataclass
class RopeTables:
    """A model's rotary tables, [max_len, D] each: in the model's dtype and in the native
    kernels' accumulation type (float32; float64 for a float64 model)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_acc: torch.Tensor
    sin_acc: torch.Tensor


@dataclass
class Rope:
    """What one forward's attention layers of one kind need besides their projections
    (``Backend.rope``): the positions [N], the backend's rotary tables (full tables, or gathered
    at each token: [N, 1, D]), for a sliding-window layer the first position each token sees
    (``origin`` [N] int32; None: every position before it), the scores' factor (None: the
    head dimension ** -0.5) and their soft cap (Gemma 2's: a score s becomes
    ``softcap * tanh(s / softcap)`` before the softmax; None: none). ``query_scale`` [N, 1]
    (Ministral 3's, by position; None: none) multiplies each token's queries as projected: the
    model applies it (RoPE is linear), no kernel reads it."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    origin: torch.Tensor | None = None
    scale: float | None = None
    softcap: float | None = None
    query_scale: torch.Tensor | None = None


def origins(positions: torch.Tensor, window: int) -> torch.Tensor | None:
    """The first position a token at each of ``positions`` sees in a layer of sliding window
    ``window`` (Hugging Face's: the keys less than ``window`` positions behind it), int32 on
    their device; None for a layer without a window (0)."""
    if not window:
        return None
    return (positions - (window - 1)).clamp_(min=0).to(torch.int32)


def combine_experts(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's expert outputs ``ys`` [T, k, H] weighted by ``weights`` [T, k] and added in
    order, one term at a time, each term and each sum rounded to ``ys``'s dtype."""
    acc = (ys[:, 0] * weights[:, :1]).to(ys.dtype)
    for j in range(1, ys.shape[1]):
        acc = acc + (ys[:, j] * weights[:, j:j + 1]).to(ys.dtype)
    return acc


class Backend:
    name = "base"
    # a step through these kernels can be captured into a CUDA graph (no host-device
    # synchronisation inside: the reference's visibility mask reads its extras on the host)
    capturable = True

    def attends(self, head_dim: int) -> bool:
        """Its own attention serves heads ``head_dim`` wide (else a step takes the reference's,
        which reads a step's draft positions on the host: no CUDA graph can capture it)."""
        return True

    def rope(self, tables: RopeTables, positions: torch.Tensor, window: int = 0, scale: float | None = None,
             softcap: float | None = None) -> Rope:
        """Once per forward and kind of layer: what its layers' ``rope_attend`` read besides
        their projections (the tables at ``positions``, the ``window``'s origins, ``scale``,
        ``softcap``)."""
        cos, sin = self.rotary(tables, positions)
        return Rope(positions, cos, sin, origins(positions, window), scale, softcap)

    def rotary(self, tables: RopeTables, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) this backend's ``rope_attend`` reads: whole tables, or gathered at
        ``positions``."""
        raise NotImplementedError

    def rope_attend(self, qkv: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's attention from its fused projection ``qkv`` [N, (H + 2 KV) * D]: RoPE on
        query and key heads, this step's K/V written at (``meta.write_rows``,
        ``meta.write_pos``) of the key blocks ``k_cache`` [rows, KV, cap * D] and values
        ``v_cache`` [rows, KV, cap, D], then attention over each query's visible positions.
        ``sinks`` [H]: gpt-oss's attention sinks, one logit per query head that joins each
        softmax's denominator and weighs no value (None: none). Returns [N, H * D]."""
        raise NotImplementedError

    def linear_rope_attend(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope: Rope,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
                           heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``rope_attend`` of the fused projection ``linear(h, weight, bias)`` (a backend may
        add the bias in RoPE's pass rather than in a launch of its own)."""
        return self.rope_attend(self.linear(h, weight, bias), rope, k_cache, v_cache, meta, heads, sinks)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm over the last dimension of ``x`` times ``weight``."""
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's next value ``x + y`` and its RMS norm times ``weight`` (a
        backend may fuse the two; the sum is rounded to the dtype as PyTorch's add rounds it)."""
        s = x + y
        return s, self.rms_norm(s, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2I] rows [gate | up] -> silu(gate) * up [M, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2I] rows [gate | up] -> gelu(gate) * up [M, I], GELU's tanh form (Gemma's GeGLU;
        elementwise, so a row's result is its own)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def swiglu_clamped(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's activation of [M, 2I] rows [gate | up]: gate clamped above at ``limit``, up
        to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate) [M, I], each operation
        rounded to the dtype as Hugging Face's (elementwise)."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [M, K] @ ``weight`` [N, K]^T (+ ``bias`` [N]) -> [M, N] (``F.linear``)."""
        raise NotImplementedError

    def linear_float32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] (any float dtype, rounded to float32 first) @ the float32 ``weight``
        [N, K]^T -> float32 [M, N], row-invariant as ``linear`` is (GLM-4.5's router: Hugging
        Face computes it in float32 whatever the model's dtype). ``linear`` in float32 here."""
        return self.linear(x.float(), weight)

    def draft_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``'s result by the fastest product at hand, row invariance not required
        (the learned drafter's: its drafts are verified). PyTorch's by default."""
        return F.linear(x, weight, bias)

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """``linear(silu_mul(gate_up), weight, bias)`` (a backend may compute the activation as
        the product reads it, never storing it)."""
        return self.linear(self.silu_mul(gate_up), weight, bias)

    # a step through ``experts`` can be captured into a CUDA graph (this one groups a step's
    # tokens by expert on the host, so it waits for the device)
    captures_experts = False

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
        """A mixture of experts' routed MLPs (model/moe.py): ``x`` [T, H], the experts' [gate | up]
        weights [E, 2I, H] and down projections [E, H, I], each token's experts ``ids`` [T, k] in
        ascending order and their ``weights`` [T, k]. Row t: the sum over j, in order, of
        ``weights[t, j]`` times expert ``ids[t, j]``'s ``silu_mul_linear(linear(x[t], gate_up[e]),
        down[e])``, each term rounded to x's dtype and added in it. gpt-oss's: ``biases`` (the
        [gate | up] products' [E, 2I] and the down products' [E, H]) and ``swiglu`` ((alpha,
        limit): ``swiglu_clamped`` in place of SiLU's). Here: the tokens routed to an expert
        gathered, its two products on them (``linear``'s row invariance makes a token's result
        its own), the outputs scattered back to their (token, j) place and summed."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        ys = x.new_empty(t * k, x.shape[1])
        start = 0
        for e, c in enumerate(counts):
            if c:
                pairs = order[start:start + c]
                gu_b, down_b = (None, None) if biases is None else (biases[0][e], biases[1][e])
                gu = self.linear(x[pairs // k], gate_up[e], gu_b)
                ys[pairs] = self.silu_mul_linear(gu, down[e], down_b) if swiglu is None else \
                    self.linear(self.swiglu_clamped(gu, *swiglu), down[e], down_b)
                start += c
        return combine_experts(ys.view(t, k, -1), weights)

    # ---- Gated DeltaNet (Qwen3.5's linear attention: delta.py) ------------------------------
    def delta_rule(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor,
                   neg_a: torch.Tensor, dt_bias: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                   seqs: torch.Tensor, dims: tuple[int, int, int, int, int], out: bool = True) -> torch.Tensor | None:
        """A step's tokens through their rows' conv and delta-rule states (``delta.delta_rule``:
        committed tokens in place, draft nodes on a copy): o [N, VH * DV] (None without ``out``)."""
        return delta.delta_rule(mixed, b, a, conv_w, neg_a, dt_bias, conv, ssm, seqs, dims, out)

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The DeltaNet's gated RMS norm of o [N, VH * DV] by z (``delta.gated_norm``)."""
        return delta.gated_norm(o, z, weight, eps)

    # ---- the sampler's row sums (engine/sampler.py): each row's sums in one order -----------
    def softmax_cdf(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row of ``x`` [M, V]: the running sums of exp(x - max) [M, V] (an unnormalised
        CDF), their total (the last running sum) [M] and the max [M]."""
        mx = x.amax(dim=-1, keepdim=True)
        cdf = (x - mx).exp_().cumsum_(dim=-1)
        return cdf, cdf[:, -1].contiguous(), mx.squeeze(1)

    def cumsum_rows(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """The running sums of each row of ``x`` [M, V] (into ``x`` itself if ``inplace``)."""
        return x.cumsum_(dim=-1) if inplace else x.cumsum(dim=-1)

    def top_k(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``k`` largest values, largest first, and their column ids (``topk``)."""
        return x.topk(k, dim=-1, sorted=True)

    def logsumexp_rows(self, x: torch.Tensor) -> torch.Tensor:
        """log(sum(exp(x))) of each row of ``x`` [M, V], as max + log(the last running sum of
        ``softmax_cdf``): PyTorch's own ``logsumexp`` on a CPU splits a lone row of a 152k
        vocabulary between threads, and so gives it other bits alone than in a batch."""
        _, total, mx = self.softmax_cdf(x)
        return mx + total.log()

    def prepare(self, linears: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Before a model's first step: whatever ``linear`` decides per weight (``(weight,
        bias)`` pairs), decided now rather than inside the first step. Nothing by default."""
