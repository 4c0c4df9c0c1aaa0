"""The CPU backend: the native kernels of ``_attention.cpp`` (see its header for why a kernel of
our own, and for batch invariance): row attention for decode, verify (chains and trees) and
prefill chunks, fused with RoPE and the K/V writes, and RMS norm; and for bfloat16 the
row-invariant matmul of ``_gemm.cpp`` (oneDNN's bfloat16 GEMM changes a row's bits with the
number of rows on AVX512 CPUs without native bfloat16 dot products; this one is exact by
construction on every CPU, and measured faster than oneDNN there: its header), and its float64
form (MKL's float64 product changes a row's bits with the number of rows and of threads). OpenMP inside;
tensors are handed over as raw pointers with element strides, checked here.

Available when the extensions are built (``NATIVE``, ``NATIVE_GEMM``; ``TAILRL_PURE_PYTHON=1``
turns them off) for bfloat16, float32 and float64; otherwise ``tailrl.kernels.select`` picks
the reference. Float32 matmuls are PyTorch's (not batch invariant: float32 is not an exact dtype here).
"""
from __future__ import annotations

import importlib
import logging
import os
import weakref

import torch
import torch.nn.functional as F

from tailrl.kernels.backend import Backend, Rope, RopeTables
from tailrl.kernels.layout import AttentionMeta, check_caches


def _load(name: str, what: str):
    """The extension ``name``, or None (not built: no compiler at install time)."""
    try:
        if os.environ.get("TAILRL_PURE_PYTHON"):
            raise ImportError("TAILRL_PURE_PYTHON is set")
        return importlib.import_module(f"tailrl.kernels.{name}")
    except ImportError as exc:
        logging.getLogger(__name__).warning("tailrl.kernels: native %s unavailable (%s); using PyTorch's (slower%s)",
                                            what, exc, "" if name == "_attention" else ", not row-invariant")
        return None


_native = _load("_attention", "row attention")
_gemm = _load("_gemm", "bfloat16 and float64 matmuls")
NATIVE = _native is not None
NATIVE_GEMM = _gemm is not None

_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}
# ``draft_linear``'s crossover (benchmarks/drafter_step.py's shapes, bfloat16, this CPU: the
# native product 3.1x / 1.8x faster than oneDNN at 1 row of small's / a 0.5B drafter's, 2.3x /
# 1.5x at 2, 1.3x / 0.7x at 4, 0.9x / 0.8x at 8)
DRAFT_ROWS = 3


def supports(dtype: torch.dtype) -> bool:
    return NATIVE and dtype in _DTYPE_CODE


def _vis(meta: AttentionMeta, origin: torch.Tensor | None) -> tuple[int, ...]:
    if origin is not None and (origin.dtype != torch.int32 or not origin.is_contiguous()
                               or origin.shape != (meta.num_tokens,)):
        raise ValueError(f"attend: origin must be [{meta.num_tokens}] contiguous int32, got "
                         f"{tuple(origin.shape)} {origin.dtype}")
    return (meta.q_row.data_ptr(), meta.prefix.data_ptr(), meta.estart.data_ptr(), meta.ecount.data_ptr(),
            meta.extra.data_ptr(), meta.block_table.data_ptr(), meta.block_table.stride(0),
            0 if origin is None else origin.data_ptr())


def _strides(k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, q_strides=(0, 0)) -> tuple[int, ...]:
    return (*q_strides, *k_cache.stride()[:2], *v_cache.stride()[:3], out.stride(0), out.stride(1))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
           origin: torch.Tensor | None = None, scale: float | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, H, D] (RoPE applied, last dim contiguous); the pool's keys k_cache [blocks, KV,
    BLOCK * D] and values v_cache [blocks, KV, BLOCK, D] already hold this step's K/V. ``origin``
    [N] int32: the first position of its prefix each query sees (a sliding window; None: 0).
    ``scale``: the scores' factor (None: D ** -0.5); ``softcap``: their soft cap (None: none);
    ``sinks`` [H]: each head's attention sink (gpt-oss's; None: none). Returns [N, H*D]."""
    n, heads, d = q.shape
    if q.stride(-1) != 1:
        raise ValueError("attend: q's head dimension must be contiguous")
    check_caches(k_cache, v_cache, meta)
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    sinks = _sinks(sinks, heads, q.dtype)
    if n:
        _native.attend(_DTYPE_CODE[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       (n, heads, k_cache.shape[1], d), _strides(k_cache, v_cache, out, (q.stride(0), q.stride(1))),
                       _vis(meta, origin), d ** -0.5 if scale is None else scale, softcap or 0.0,
                       _ptr(sinks), torch.get_num_threads())
    return out.view(n, heads * d)


class CpuBackend(Backend):
    name = "cpu"

    def rotary(self, tables: RopeTables, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.cos_acc, tables.sin_acc                               # full tables, accumulation type

    def rope_attend(self, qkv: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """In one native call: RoPE in the accumulation type, the K/V writes, ``attend``."""
        n = qkv.shape[0]
        kv_heads, d = v_cache.shape[1], v_cache.shape[3]
        if qkv.stride(-1) != 1 or rope.positions.dtype != torch.long:
            raise ValueError("rope_attend: qkv rows must be contiguous and positions int64")
        check_caches(k_cache, v_cache, meta)
        if meta.write_slot.dtype != torch.long:
            raise ValueError("rope_attend: write slots must be int64")
        out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
        sinks = _sinks(sinks, heads, qkv.dtype)
        if n:
            _native.rope_attend(_DTYPE_CODE[qkv.dtype], qkv.data_ptr(), qkv.stride(0), rope.cos.data_ptr(),
                                rope.sin.data_ptr(), rope.positions.data_ptr(), meta.write_slot.data_ptr(),
                                k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), (n, heads, kv_heads, d),
                                _strides(k_cache, v_cache, out), _vis(meta, rope.origin),
                                d ** -0.5 if rope.scale is None else rope.scale, rope.softcap or 0.0,
                                _ptr(sinks), torch.get_num_threads())
        return out.view(n, heads * d)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """bfloat16 and float64: ``_gemm.cpp`` (row-invariant); float32: PyTorch's."""
        if not NATIVE_GEMM or x.dtype not in (torch.bfloat16, torch.float64) or x.dim() != 2:
            return F.linear(x, weight, bias)
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k or weight.dtype != x.dtype or weight.stride(-1) != 1 or (
                bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
            raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                             f"{weight.dtype} (rows contiguous, same dtype)")
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            fn = _gemm.linear if x.dtype == torch.bfloat16 else _gemm.linear_f64
            fn(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
               bias.data_ptr() if bias is not None else 0, out.data_ptr(), n, m, n, k, torch.get_num_threads())
        return out

    def linear_float32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """PyTorch's float32 product is not row-invariant: the float64 one of ``_gemm.cpp`` on
        the float32 values, rounded to float32 (a product of two float32 values is exact in
        float64, and K of them add with an error far below float32's rounding: a correctly
        rounded float32 product but for rare near-ties). The weight's float64 copy is kept
        while the weight is unchanged (``_as_float64``). Without the native matmul, PyTorch's."""
        if not NATIVE_GEMM or x.dim() != 2:
            return F.linear(x.float(), weight.float())
        return self.linear(x.float().double(), _as_float64(weight)).float()

    def draft_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """bfloat16 below ``DRAFT_ROWS`` rows: ``_gemm.cpp`` (it streams the weights once: 1.8-3x
        faster than oneDNN at 1 row of a drafter's products on this CPU); otherwise PyTorch's
        (oneDNN: faster from ~4 rows, where ``_gemm.cpp`` pays for its invariance)."""
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] < DRAFT_ROWS and NATIVE_GEMM:
            return self.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``_attention.cpp``'s ``act_mul``: every element by the same code (PyTorch's SiLU gives
        an element other bits by its place in the flattened tensor and the threads' split of it:
        a row's result changed with the rows beside it on a 6-thread CPU, in float32 and float64)."""
        return self._act_mul(gate_up, 0) if NATIVE else super().silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As ``silu_mul``, with GELU's tanh form (Gemma's GeGLU)."""
        return self._act_mul(gate_up, 1) if NATIVE else super().gelu_tanh_mul(gate_up)

    def swiglu_clamped(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """``_attention.cpp``'s ``swiglu_clamped``: every element by the same code (as ``silu_mul``)."""
        if not NATIVE:
            return super().swiglu_clamped(gate_up, alpha, limit)
        gate_up = _gate_up(gate_up)
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, i, dtype=gate_up.dtype, device=gate_up.device)
        if m and i:
            _native.swiglu_clamped(_DTYPE_CODE[gate_up.dtype], gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                                   m, i, alpha, limit, torch.get_num_threads())
        return out

    @staticmethod
    def _act_mul(gate_up: torch.Tensor, kind: int) -> torch.Tensor:
        gate_up = _gate_up(gate_up)
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, i, dtype=gate_up.dtype, device=gate_up.device)
        if m and i:
            _native.act_mul(_DTYPE_CODE[gate_up.dtype], kind, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                            m, i, torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Row-local (batch invariant): a fixed reduction per row."""
        if x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _native.rms_norm(_DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                         x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out


    def delta_rule(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor,
                   neg_a: torch.Tensor, dt_bias: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                   seqs: torch.Tensor, dims: tuple[int, int, int, int, int], out: bool = True) -> torch.Tensor | None:
        """``_attention.cpp``'s ``delta_rule``: a (row, value head)'s tokens on one thread, each by
        the same code, committed or drafted."""
        if not NATIVE:
            return super().delta_rule(mixed, b, a, conv_w, neg_a, dt_bias, conv, ssm, seqs, dims, out)
        _dense(mixed, b, a)
        if b.stride(0) != a.stride(0) or not (conv_w.is_contiguous() and conv.is_contiguous() and ssm.is_contiguous()
                                              and seqs.is_contiguous()):
            raise ValueError("delta_rule: b and a must share a row stride; weights, states and seqs be contiguous")
        n, vh, dv = mixed.shape[0], dims[1], dims[3]
        res = mixed.new_zeros(n, vh * dv) if out else None        # a token in no run (a graph's padding): 0
        _native.delta_rule(_DTYPE_CODE[mixed.dtype], mixed.data_ptr(), mixed.stride(0), b.data_ptr(), a.data_ptr(),
                           b.stride(0), conv_w.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(), conv.data_ptr(),
                           ssm.data_ptr(), seqs.data_ptr(), seqs.shape[0], n, 0 if res is None else res.data_ptr(),
                           dims, torch.get_num_threads())
        return res

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``_attention.cpp``'s ``gated_norm``: a (token, head) by the same code wherever it sits."""
        if not NATIVE:
            return super().gated_norm(o, z, weight, eps)
        _dense(o, z)
        o = o.contiguous()
        out = torch.empty_like(o)
        dv = weight.shape[0]
        weight = weight.contiguous()
        _native.gated_norm(_DTYPE_CODE[o.dtype], o.data_ptr(), z.data_ptr(), z.stride(0), weight.data_ptr(),
                           out.data_ptr(), o.shape[0], o.shape[1] // dv, dv, eps, torch.get_num_threads())
        return out


def _gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] with adjacent columns (copied where they are not), or a ValueError."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"act_mul: gate_up must be [M, 2I], got {tuple(gate_up.shape)}")
    return gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()


def _sinks(sinks: torch.Tensor | None, heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The sinks as the native kernels read them: [H] in the accumulation type (None: none)."""
    if sinks is None:
        return None
    if sinks.shape != (heads,):
        raise ValueError(f"attention: sinks must be [{heads}] (one per query head), got {tuple(sinks.shape)}")
    return sinks.to(torch.float64 if dtype == torch.float64 else torch.float32).contiguous()


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _dense(*xs: torch.Tensor) -> None:
    """Each [N, width] with its columns adjacent (rows may be strided), or a ValueError."""
    for x in xs:
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"delta_rule: inputs must be [N, width] with adjacent columns, got {tuple(x.shape)} "
                             f"strides {x.stride()}")


# id(weight) -> (a weak reference to it, its version counter when copied, its float64 copy)
_FLOAT64: dict[int, tuple] = {}


def _as_float64(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in float64, copied again only when it has changed since (an in-place write,
    through any view of it: a trainer's weight update, bumps its version counter; a tensor made
    in inference mode has none, and is copied every time)."""
    if weight.is_inference():
        return weight.double()
    hit = _FLOAT64.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == weight._version:
        return hit[2]
    copy = weight.detach().double()
    _FLOAT64[id(weight)] = (weakref.ref(weight, lambda _, key=id(weight): _FLOAT64.pop(key, None)), weight._version,
                            copy)
    return copy


CPU = CpuBackend()
