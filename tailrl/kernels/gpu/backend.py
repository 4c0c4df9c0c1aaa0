"""The GPU backend: Triton kernels (attention.py, norm.py with the residual add fused,
activation.py, matmul.py) behind the ``Backend`` interface.

Each launch has a fixed configuration (never tuned per batch) and one program per token (and
head), so a token's result depends on its own inputs alone: the same batch invariance as the
CPU kernels, the matmul included (matmul.py: fixed tiles and a split of K fixed per weight
shape, where cuBLAS picks its kernel by M; cuBLAS itself for a weight shape where a
measurement at start-up found it invariant, stock.py). float64 has no kernels here (the
reference serves it). On a CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``),
which is how CI tests them.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from tailrl.kernels.backend import Backend, Rope, RopeTables, combine_experts
from tailrl.kernels.gpu import experts, matmul, stock
from tailrl.kernels.gpu.activation import silu_mul_kernel, swiglu_clamped_kernel
from tailrl.kernels.gpu.arrivals import counters
from tailrl.kernels.gpu.attention import attend_kernel, rope_write_kernel
from tailrl.kernels.gpu.delta import delta_conv_kernel, delta_rule_kernel, gated_norm_kernel
from tailrl.kernels.gpu.norm import add_rms_norm_kernel, rms_norm_kernel
from tailrl.kernels.gpu.scan import row_scan_kernel
from tailrl.kernels.layout import BLOCK, AttentionMeta, check_caches
from tailrl.kernels.reference import REFERENCE

log = logging.getLogger(__name__)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SILU_BLOCK = 1024                      # columns of the MLP's activation per program
DELTA_CHANNELS = 64                    # Gated DeltaNet: conv channels per program (delta.py)
DELTA_VALUES = 32                      # ... and a value head's state columns per program ([DK, 32] in registers)
SCAN_BLOCK = 4096                      # the sampler's row sums: columns per step of a row's walk
# attention: a query's blocks dealt to this many lanes (attention.py); one value per process,
# as the matmul's tiles (rows differ between processes that differ in it)
LANES = int(os.environ.get("TAILRL_ATTENTION_LANES", "16"))
# attention: keys a lane gathers per step of its walk (a multiple of the pool's BLOCK); one value
# per process too. A lane's walk is a chain of dependent steps (the block table, then K, then V):
# fewer, wider steps shorten it. At 16 keys a step (one pool block) attention was 43% of an
# H100's time in the plain rollout, its programs ~34 us per layer for contexts of a few hundred
# tokens (benchmarks/step_profile.py). At 32, half the steps; ptxas for sm_90 at 0.5B's heads and
# 4 warps: 146 registers (one program per token and KV head) and 122 (per lane), no spills; 64 keys
# spill at 4 warps, hence 8 there. benchmarks/attention.py measures the choices on a GPU.
KEYS = int(os.environ.get("TAILRL_ATTENTION_KEYS", "32"))
if KEYS < BLOCK or KEYS & (KEYS - 1):
    raise ValueError(f"TAILRL_ATTENTION_KEYS must be a power of two >= {BLOCK} (the K/V pool's block), got {KEYS}")
WHOLE_PROGRAMS = 132                   # from this many (token, KV head) programs each runs all its lanes
# attention: a row's consecutive queries (a chain of drafts, a prefill chunk) walk its K/V together,
# up to this many (attention.py); a query's bits are the same at any GROUP. 4 (at 0.5B's heads a
# tile of 32 query rows): 139 and 112 registers at 32 keys and 4 warps, no spills (8: spills of
# 0.7-1.4 KB a thread). Not yet measured on a GPU; TAILRL_ATTENTION_GROUP=1 turns groups off.
GROUP = int(os.environ.get("TAILRL_ATTENTION_GROUP", "4"))
if GROUP < 1 or GROUP & (GROUP - 1):
    raise ValueError(f"TAILRL_ATTENTION_GROUP must be a power of two >= 1, got {GROUP}")
# attention's dots (attention.py): "tensor", tensor cores on the pool's 16-bit dtype (q, K, V and
# the softmax weights in it, float32 sums: what flash attention computes), or "ieee", float32 FMA
# loops over the same operands widened (float32 pools always take these). One value per process,
# as the tiles (the two give other bits). Both are row-invariant: each output element is a chain of
# the same instructions in the same order at any number of rows; tensor cores' mma.sync, the same
# at any tile below 64 rows (Triton picks wgmma at 64, hence tiles of at most 32 query rows here).
# On an H200 (benchmarks/attention.py, stop 46) tensor cores took one layer 1.3-2.2x less time at
# one row, 2.5-3.8x less from 64 rows; its GPU tests passed (grouped bits = ungrouped, a query
# alone = in a batch, graph steps = eager), and a rollout's bits with and without speculation
# were equal
DOTS = os.environ.get("TAILRL_ATTENTION_DOTS", "tensor")
if DOTS not in ("tensor", "ieee"):
    raise ValueError(f"TAILRL_ATTENTION_DOTS must be 'tensor' or 'ieee', got {DOTS!r}")
TC_ROWS = 32                           # a tensor-core tile's query rows at most (mma.sync, not wgmma)
TC_DEPTH = 16                          # a 16-bit tensor-core dot's depth at least (Triton 3.6 on sm_90)
FMA_DEPTH = 8                          # a float32 dot's depth at least: narrower heads take the reference
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"     # 16-bit dots widened there (attention._dot16)
# the MLP's activation computed inside the down projection's matmul (``silu_mul_linear``) in steps
# of at most this many rows (at most one tile of rows, ``matmul.TILES.bm``: above, each column tile
# would compute it again): a launch fewer a layer, the same bits (the same wgmma m64n64k16
# instruction either way; ptxas for sm_90, Triton 3.6). Off (0) by default: on an H100 the fused
# form's dots, fed from registers, serialise (ptxas says so), and a batch-1 decode step's profile
# there gave that down projection 45% of the step's device time (22 us a layer, 0.55 ms a step),
# where the whole forward's products on the invariant path (cuBLAS where probed invariant, the
# unfused Triton matmul for the down projection and the head) took 0.65 ms in the same run
# (benchmarks/gpu.py, matmul at M = 1). TAILRL_MATMUL_ACT_ROWS=64 turns it on; an engine may
# differ from another in it (the bits are the same)
ACT_ROWS = int(os.environ.get("TAILRL_MATMUL_ACT_ROWS", "0"))
if not 0 <= ACT_ROWS <= matmul.TILES.bm:
    raise ValueError(f"TAILRL_MATMUL_ACT_ROWS must be 0 (off) to {matmul.TILES.bm} (a tile's rows), got {ACT_ROWS}")
# No multiply-add contraction where two kernels must give the same bits from the same code
# (attention's two modes, the norm with and without the residual add): each kernel's
# compiler would otherwise fuse where its own context lets it
EXACT = {"enable_fp_fusion": False}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def attention_tiles(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    multi: bool) -> tuple[bool, int, int, int, int]:
    """Attention's tiles for a step: (tensor-core dots, query heads per K/V head G, G padded,
    a row's queries walking its K/V together QT, query rows of a program's tile MP). Tensor
    cores where DOTS says so, the pool holds 16-bit floats and a head is at least 16 wide (their
    dot's depth: Triton refuses q . k over fewer), in tiles of at most TC_ROWS rows (fewer
    queries a group where G is wide; none where G alone is wider)."""
    g = heads // kv_heads
    gp = max(16, _pow2(g))
    tc = (DOTS == "tensor" and dtype in (torch.bfloat16, torch.float16) and _pow2(g) <= TC_ROWS
          and head_dim >= TC_DEPTH)
    qt = GROUP if multi else 1                 # queries of a row walking its K/V together
    if tc:
        qt = min(qt, TC_ROWS // _pow2(g))
    return tc, g, gp, qt, max(16, _pow2(qt * g))


class TritonBackend(Backend):
    name = "triton"

    def rotary(self, tables: RopeTables, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.cos_acc, tables.sin_acc                               # float32 tables, full

    def attends(self, head_dim: int) -> bool:
        """Triton's ranges are powers of two and its dots at least ``FMA_DEPTH`` deep: other heads
        take the reference."""
        return not head_dim & (head_dim - 1) and head_dim >= FMA_DEPTH

    def linear_rope_attend(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope: Rope,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
                           heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Where cuBLAS computes the projection (its bias would be a launch of its own, stock.py),
        RoPE's pass adds the bias, rounded as that add rounds it: the same bits, a launch fewer
        a layer (the Triton matmul adds a bias in its own last pass)."""
        if bias is None or bias.dtype != h.dtype or not bias.is_contiguous() or self._product(h, weight) != "stock":
            return super().linear_rope_attend(h, weight, bias, rope, k_cache, v_cache, meta, heads, sinks)
        return self.rope_attend(stock.stock_linear(h, weight), rope, k_cache, v_cache, meta, heads, sinks, bias)

    def rope_attend(self, qkv: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, heads: int, sinks: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """Two launches: RoPE and the K/V writes (every token's, before any attention reads
        them; ``bias``: the projection's, added first), then attention (few tokens: a program
        per lane, the last of a query's lanes to finish merging them; ``sinks``: gpt-oss's,
        joined to each query's merged softmax state before its store)."""
        n = qkv.shape[0]
        kv_heads, d = v_cache.shape[1], v_cache.shape[3]
        if not self.attends(d):
            if bias is not None:
                qkv = qkv + bias
            cos, sin = (t[rope.positions].to(qkv.dtype).unsqueeze(1) for t in (rope.cos, rope.sin))
            return REFERENCE.rope_attend(qkv, replace(rope, cos=cos, sin=sin), k_cache, v_cache, meta, heads, sinks)
        if qkv.stride(-1) != 1:
            raise ValueError("rope_attend: qkv rows must be contiguous")
        check_caches(k_cache, v_cache, meta)
        out = torch.empty(n, heads * d, dtype=qkv.dtype, device=qkv.device)
        if n == 0:
            return out
        tc, g, gp, qt, mp = attention_tiles(heads, kv_heads, d, k_cache.dtype, meta.multi)
        q = torch.empty(n, heads, d, dtype=k_cache.dtype if tc else torch.float32, device=qkv.device)
        rope_write_kernel[(n, heads + 2 * kv_heads)](
            qkv, qkv.stride(0), bias if bias is not None else qkv, rope.cos, rope.sin, rope.positions,
            meta.write_slot, q, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), H=heads, KV=kv_heads, D=d, BLOCK=BLOCK, HAS_BIAS=bias is not None)
        whole = n * kv_heads >= WHOLE_PROGRAMS
        part = out if whole else torch.empty(n, kv_heads, LANES, gp, d + 2, dtype=torch.float32, device=qkv.device)
        count = part if whole else counters(qkv.device, n * kv_heads)
        attend_kernel[(n, kv_heads) if whole else (n, kv_heads, LANES)](
            q, k_cache, v_cache, out, part, count, meta.block_table, meta.q_row, meta.prefix, meta.estart, meta.ecount,
            meta.extra, meta.prefix if rope.origin is None else rope.origin, meta.prefix if sinks is None else sinks,
            k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), meta.block_table.stride(0), n,
            d ** -0.5 if rope.scale is None else rope.scale, rope.softcap or 1.0, H=heads, G=g, GP=gp, MP=mp, D=d,
            BLOCK=BLOCK, KEYS=KEYS, LANES=LANES, QT=qt, WHOLE=whole, TC=tc, WIDEN=INTERPRETED,
            WINDOW=rope.origin is not None, CAP=bool(rope.softcap), SINK=sinks is not None,
            num_warps=4 if KEYS <= 32 else 8, **EXACT)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.shape[0]:
            rms_norm_kernel[(x.shape[0],)](x, x.stride(0), weight, out, x.shape[1], eps, BC=_pow2(x.shape[1]), **EXACT)
        return out

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch: the sum, then its norm by rms_norm_kernel's own code (the same bits)."""
        if x.dim() != 2 or not (x.is_contiguous() and y.is_contiguous() and weight.is_contiguous()) \
                or y.shape != x.shape or y.dtype != x.dtype:
            return super().add_rms_norm(x, y, weight, eps)
        s, out = torch.empty_like(x), torch.empty_like(x)
        if x.shape[0]:
            add_rms_norm_kernel[(x.shape[0],)](x, y, s, weight, out, x.shape[1], eps, BC=_pow2(x.shape[1]), **EXACT)
        return s, out

    def delta_rule(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor,
                   neg_a: torch.Tensor, dt_bias: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                   seqs: torch.Tensor, dims: tuple[int, int, int, int, int], out: bool = True) -> torch.Tensor | None:
        """Two launches (delta.py): the conv of width 4 into float32 [N, C], then the rule; the
        reference where the shape is not the kernels' (another width, heads not powers of two)."""
        kh, vh, dk, dv, width = dims
        if width != 4 or mixed.dtype not in DTYPES or _pow2(dk) != dk or _pow2(dv) != dv or \
                mixed.stride(1) != 1 or b.stride(0) != a.stride(0):
            return super().delta_rule(mixed, b, a, conv_w, neg_a, dt_bias, conv, ssm, seqs, dims, out)
        n, c, rows = mixed.shape[0], mixed.shape[1], seqs.shape[0]
        # a token in no run (a graph's padding) outputs 0, not what the memory held (NaN logits there
        # would sample past the vocabulary)
        res = torch.zeros(n, vh * dv, dtype=mixed.dtype, device=mixed.device) if out else None
        if not rows:
            return res
        co = torch.empty(n, c, dtype=torch.float32, device=mixed.device)
        delta_conv_kernel[(rows, triton.cdiv(c, DELTA_CHANNELS))](mixed, mixed.stride(0), conv_w, conv, seqs, co, c,
                                                                 BC=DELTA_CHANNELS, **EXACT)
        bv = min(dv, DELTA_VALUES)
        delta_rule_kernel[(rows, vh, dv // bv)](co, c, b, a, b.stride(0), neg_a.float(), dt_bias.float(), ssm, seqs,
                                                 co if res is None else res, vh, dk ** -0.5, KH=kh, DK=dk, DV=dv, BV=bv,
                                                 WRITE=res is not None, **EXACT)
        return res

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dv = weight.shape[0]
        if o.dtype not in DTYPES or _pow2(dv) != dv or not o.is_contiguous() or z.stride(1) != 1:
            return super().gated_norm(o, z, weight, eps)
        out = torch.empty_like(o)
        if o.shape[0]:
            h = o.shape[1] // dv
            gated_norm_kernel[(o.shape[0] * h,)](o, z, z.stride(0), weight.contiguous(), out, h, eps, DV=dv, **EXACT)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            return super().silu_mul(gate_up)
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, i, dtype=gate_up.dtype, device=gate_up.device)
        if m:
            silu_mul_kernel[(m, triton.cdiv(i, SILU_BLOCK))](gate_up, out, i, BLOCK=SILU_BLOCK)
        return out

    def swiglu_clamped(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2 or gate_up.dtype not in DTYPES:
            return super().swiglu_clamped(gate_up, alpha, limit)
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, i, dtype=gate_up.dtype, device=gate_up.device)
        if m:
            swiglu_clamped_kernel[(m, triton.cdiv(i, SILU_BLOCK))](gate_up, out, i, alpha, limit, BLOCK=SILU_BLOCK)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Batch-invariant for 2-D inputs of the kernels' dtypes: cuBLAS where it was measured
        invariant for this weight's shape (stock.py), else the Triton matmul (matmul.py);
        anything else PyTorch's."""
        kind = self._product(x, weight)
        if kind is None:
            return F.linear(x, weight, bias)
        if kind == "stock":
            return stock.stock_linear(x, weight, bias)
        return matmul.linear(x, weight, bias)

    @staticmethod
    def _product(x: torch.Tensor, weight: torch.Tensor) -> str | None:
        """Which kernel ``linear`` takes for ``x`` and ``weight``: "stock" (cuBLAS, stock.py),
        "triton" (matmul.py), or None (PyTorch's, for what the kernels do not take)."""
        if x.dim() != 2 or x.dtype not in DTYPES or weight.stride(-1) != 1:
            return None
        return "stock" if stock.use_stock(weight) else "triton"

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """In steps of at most ``ACT_ROWS`` rows, where the Triton matmul computes the product, it
        computes the activation as it reads its tiles (``matmul.linear(act=True)``:
        silu_mul_kernel's arithmetic, the same bits, a launch fewer a layer)."""
        if gate_up.shape[-1] % 2 or gate_up.shape[0] > ACT_ROWS or weight.dtype != gate_up.dtype \
                or self._product(gate_up, weight) != "triton":
            return super().silu_mul_linear(gate_up, weight, bias)
        return matmul.linear(gate_up, weight, bias, act=True)

    captures_experts = True

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
        """Grouped by expert on the device (experts.py: no host synchronisation, so graph steps
        capture it): the [gate | up] products of each (token, j) pair, the activation, the down
        products, then the weighted sum in order (``combine_experts``); gpt-oss's biases added to
        each product, gathered by the pair's expert (pairs are in (token, j) order)."""
        if x.dim() != 2 or x.dtype not in DTYPES or x.stride(-1) != 1 or gate_up.dtype != x.dtype \
                or not (gate_up.is_contiguous() and down.is_contiguous()):
            return super().experts(x, gate_up, down, ids, weights, biases, swiglu)
        t, k = ids.shape
        blocks = experts.expert_blocks(ids, gate_up.shape[0])
        gu = experts.expert_products(x, gate_up, blocks, t * k, k)
        pair_expert = ids.reshape(-1)
        if biases is not None:
            gu = gu + biases[0][pair_expert]
        act = self.silu_mul(gu) if swiglu is None else self.swiglu_clamped(gu, *swiglu)
        ys = experts.expert_products(act, down, blocks, t * k, 1)
        if biases is not None:
            ys = ys + biases[1][pair_expert]
        return combine_experts(ys.view(t, k, -1), weights)

    # ---- the sampler's row sums: one program per row, in order (scan.py) ----------------------
    def _scan(self, x: torch.Tensor, exp: bool, write: bool, out: torch.Tensor | None = None):
        m, v = x.shape
        if out is None and write:
            out = torch.empty(m, v, dtype=x.dtype, device=x.device)
        total = torch.empty(m, dtype=x.dtype, device=x.device)
        mx = torch.empty(m, dtype=x.dtype, device=x.device) if exp else total
        if m and v:
            row_scan_kernel[(m,)](x, x.stride(0), out if write else total, total, mx, v, BLOCK=SCAN_BLOCK,
                                  EXP=exp, WRITE=write, num_warps=8)
        return out, total, mx

    @staticmethod
    def _scannable(x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype in DTYPES and x.stride(-1) == 1 and x.shape[-1] > 0

    def softmax_cdf(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._scannable(x):
            return super().softmax_cdf(x)
        return self._scan(x, exp=True, write=True)

    def cumsum_rows(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        if not self._scannable(x):
            return super().cumsum_rows(x, inplace)
        return self._scan(x, exp=False, write=True, out=x if inplace and x.is_contiguous() else None)[0]

    def top_k(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ties broken by column, lowest first, in which values are kept and in their order.
        CUDA's ``topk`` picks its algorithm by the number of rows, and bfloat16 logits tie often
        near the top: which of two tied tokens a row keeps, and the order the inverse CDF walks
        them in, could change with the batch. The k-th largest value is exact whatever the
        algorithm; the values above it and the first ties at it (an integer count) are the row's
        own; a second ``topk`` over distinct integer keys lists them by column, and a stable
        sort by value orders them."""
        v = x.shape[-1]
        kth = x.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        above, tied = x > kth, x == kth
        keep = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        cols = torch.arange(v, 0, -1, device=x.device)                   # the first column keys highest
        idx = torch.where(keep, cols, 0).topk(k, dim=-1, sorted=True).indices
        vals = x.gather(-1, idx)
        order = vals.argsort(dim=-1, descending=True, stable=True)
        return vals.gather(-1, order), idx.gather(-1, order)

    def logsumexp_rows(self, x: torch.Tensor) -> torch.Tensor:
        if not self._scannable(x):
            return super().logsumexp_rows(x)
        _, total, mx = self._scan(x, exp=True, write=False)
        return mx + total.log()

    def prepare(self, linears: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Probe each weight shape for cuBLAS's invariance now (stock.py), not in a first step;
        one log line says what the new probes decided and what they took."""
        t0, known = time.perf_counter(), len(stock.decisions())
        for w, _ in linears:
            if w.dtype in DTYPES and w.stride(-1) == 1:
                stock.use_stock(w)
        new = stock.decisions()[known:]
        if new:
            log.info("matmuls: %s (batch-invariance probes, %.2f s)", ", ".join(
                f"[{d['n']}, {d['k']}] {d['dtype']} {'cuBLAS' if d['kernel'] == 'stock' else 'Triton'}" for d in new),
                time.perf_counter() - t0)


TRITON = TritonBackend()
