"""Our decoder-only transformer (Qwen2 / Qwen3 / Llama / Mistral / Ministral 3 / Phi-3 / Gemma 2-3 /
OLMo 2-3 / SmolLM3 / GLM-4, mixtures of experts: moe.py, GLM-4.5's and gpt-oss's among them, Qwen3.5's
hybrid of attention and Gated DeltaNet layers: deltanet.py, and DeepSeek-V3's latent attention:
mla.py) over flattened tokens and a row KV cache.

Hugging Face's module is the reference in tests; this one is the hot path: fused QKV and
gate/up projections, RoPE applied once to Q and K together, K/V written into a preallocated
cache, logits computed only for the rows that are sampled.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tailrl.kernels import AttentionMeta, Backend, Rope, RopeTables, select
from tailrl.kernels.backend import origins
from tailrl.model.args import ModelArgs
from tailrl.model.deltanet import GatedDeltaNet
from tailrl.model.hf_names import check, checkpoint_names, load_hf, slots
from tailrl.model.mla import LatentAttention
from tailrl.model.moe import SparseMoe, sigmoid_rows
from tailrl.model.rope import rope_table


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, sparse: bool = False, kind: int = 0, ranks: int = 1, index: int = 0):
        super().__init__()
        self.a, self.index = a, index
        self.kind = kind                    # which of the forward's Rope objects its attention reads
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        # the norms before attention and the MLP (OLMo: none)
        self.input_norm = nn.Parameter(torch.ones(a.hidden_size)) if a.pre_norms else None
        self.post_norm = nn.Parameter(torch.ones(a.hidden_size)) if a.pre_norms else None
        # Qwen3.5: a Gated DeltaNet in place of attention (deltanet.py)
        self.linear = GatedDeltaNet(a) if index in a.linear_layers else None
        # DeepSeek-V3: multi-head latent attention (mla.py), its own projections
        self.mla = LatentAttention(a) if a.mla is not None and self.linear is None else None
        attends = self.linear is None and self.mla is None
        # Qwen3.5's attention: its output gate's rows first, [gate | q | k | v]
        gate = q if a.attn_output_gate else 0
        self.qkv = nn.Linear(a.hidden_size, gate + q + 2 * kv, bias=a.qkv_bias) if attends else None
        self.o = nn.Linear(q, a.hidden_size, bias=a.o_bias) if attends else None
        # q/k norm weights stacked per head: [H + KV, D] (Qwen3, Gemma); None elsewhere
        self.qk_norm = nn.Parameter(torch.ones(a.num_heads + a.num_kv_heads, a.head_dim)) \
            if a.qk_norm and attends else None
        # OLMo: q's and k's norms over all heads at once, [H * D] and [KV * D] (a split layer's: the
        # whole model's, over every one of its ``ranks``' heads: ``_whole_norm``)
        self.q_norm = nn.Parameter(torch.ones(q * ranks)) if a.qk_norm_whole else None
        self.k_norm = nn.Parameter(torch.ones(kv * ranks)) if a.qk_norm_whole else None
        # gpt-oss: each query head's attention sink, a logit in its softmax weighing no value [H]
        self.sinks = nn.Parameter(torch.zeros(a.num_heads)) if a.attn_sinks and attends else None
        # Gemma, OLMo: the attention's output and the MLP's normed before they join the residual stream
        self.attn_out_norm = nn.Parameter(torch.ones(a.hidden_size)) if a.sandwich_norms else None
        self.mlp_out_norm = nn.Parameter(torch.ones(a.hidden_size)) if a.sandwich_norms else None
        self.moe = SparseMoe(a) if sparse else None          # a mixture of experts' layer, else the dense MLP
        self.gate_up = None if sparse else nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down = None if sparse else nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        # tensor parallelism: the sum over ranks of the output projection's and the MLP's partial
        # products (parallel.OrderedSum); None: this layer is whole
        self.reduce = None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None, kernels: Backend, rope: Rope, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``x`` with the previous layer's MLP output ``y`` still to add
        (None before the first layer; added here, fused with the norm that reads the sum).
        Returns this layer's (stream, MLP output)."""
        a = self.a
        x, h = self._joined(kernels, x, y, self.input_norm)
        if self.linear is not None:         # k_cache, v_cache: this layer's conv and delta-rule states
            out = self.linear(h, kernels, (k_cache, v_cache), meta.states, self.index)
        elif self.mla is not None:
            out = self.mla(h, kernels, rope, k_cache, v_cache, meta)
        else:
            out = kernels.linear(self._attend(h, kernels, rope, k_cache, v_cache, meta), self.o.weight, self.o.bias)
        out = out if self.reduce is None else self.reduce(out)
        if self.attn_out_norm is not None:
            out = kernels.rms_norm(out, self.attn_out_norm, a.rms_norm_eps)
        x, h = self._joined(kernels, x, out, self.post_norm)
        if self.moe is not None:
            y = self.moe(h, kernels)
        elif a.hidden_act == "silu":
            gate_up = kernels.linear(h, self.gate_up.weight, self.gate_up.bias)   # [N, 2I]
            y = kernels.silu_mul_linear(gate_up, self.down.weight, self.down.bias)
        else:                                                                   # Gemma's GeGLU
            gate_up = kernels.linear(h, self.gate_up.weight, self.gate_up.bias)
            y = kernels.linear(kernels.gelu_tanh_mul(gate_up), self.down.weight, self.down.bias)
        y = y if self.reduce is None else self.reduce(y)
        return x, y if self.mlp_out_norm is None else kernels.rms_norm(y, self.mlp_out_norm, a.rms_norm_eps)

    def _joined(self, kernels: Backend, x: torch.Tensor, y: torch.Tensor | None,
                norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream ``x + y`` (``y`` None: ``x``) and what the next block reads: its RMS norm
        times ``norm``, or (no norm: OLMo) the stream itself."""
        if norm is None:
            x = x if y is None else x + y
            return x, x
        if y is None:
            return x, kernels.rms_norm(x, norm, self.a.rms_norm_eps)
        return kernels.add_rms_norm(x, y, norm, self.a.rms_norm_eps)

    def _attend(self, h: torch.Tensor, kernels: Backend, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMeta) -> torch.Tensor:
        """The projection [N, (H+2KV)*D], q/k norms where the model has them, RoPE, the K/V
        writes, attention: [N, H*D]."""
        a = self.a
        if self.qk_norm is None and self.q_norm is None and rope.query_scale is None:
            return kernels.linear_rope_attend(h, self.qkv.weight, self.qkv.bias, rope, k_cache, v_cache, meta,
                                              a.num_heads, self.sinks)
        qkv = kernels.linear(h, self.qkv.weight, self.qkv.bias)
        gate = None
        if a.attn_output_gate:              # Qwen3.5: [gate | q | k | v]
            q = a.num_heads * a.head_dim
            gate, qkv = qkv[:, :q], qkv[:, q:]
        qkv = self._qk_normed(kernels, qkv)
        if rope.query_scale is not None:    # Ministral 3: queries scaled by position (RoPE is linear: before it)
            qkv[:, :a.num_heads * a.head_dim] *= rope.query_scale
        out = kernels.rope_attend(qkv, rope, k_cache, v_cache, meta, a.num_heads, self.sinks)
        return out if gate is None else out * sigmoid_rows(gate)     # (row-invariant: moe.py)

    def _qk_normed(self, kernels: Backend, qkv: torch.Tensor) -> torch.Tensor:
        """The projection with q and k normed where the model norms them, between projection and
        RoPE (a new tensor; ``qkv`` itself where it does not)."""
        a, n = self.a, qkv.shape[0]
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        if self.qk_norm is not None:        # Qwen3, Gemma: each Q and K head
            nqk = a.num_heads + a.num_kv_heads
            qk = qkv[:, :q + kv].reshape(n * nqk, a.head_dim)
            qk = (kernels.rms_norm(qk, torch.ones_like(self.qk_norm[0]), a.rms_norm_eps).view(n, nqk, a.head_dim)
                  * self.qk_norm).view(n, -1)
        elif self.q_norm is not None:       # OLMo: Q over all its heads, then K
            qk = torch.cat([self._whole_norm(kernels, qkv[:, :q], self.q_norm),
                            self._whole_norm(kernels, qkv[:, q:q + kv], self.k_norm)], dim=1)
        else:
            return qkv
        return torch.cat([qk, qkv[:, q + kv:]], dim=1)

    def _whole_norm(self, kernels: Backend, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMS norm over all heads at once (OLMo's q or k); in a layer split over ranks, over every
        rank's heads gathered, this rank's part kept: the whole model's bits."""
        if self.reduce is None:
            return kernels.rms_norm(x, weight, self.a.rms_norm_eps)
        width = x.shape[1]
        whole = kernels.rms_norm(self.reduce.gather(x), weight, self.a.rms_norm_eps)
        return whole[:, self.reduce.rank * width:(self.reduce.rank + 1) * width]


class Transformer(nn.Module):
    """Its weights are allocated on ``device`` in ``dtype`` and left as they were in memory: a
    checkpoint fills them (``load_hf_state_dict``; loader.load_model), so none is initialised,
    and none passes through float32 or another device first. One rank's part of a model split
    over devices (parallel.py: ``a`` its shape, ``reduce`` the sum across ranks) computes no
    logits unless it has the ``head``."""

    def __init__(self, a: ModelArgs, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", reduce=None, head: bool = True):
        super().__init__()
        self.args, self.head = a, head
        # the kinds of attention layer: (sliding window or 0, the RoPE tables it reads: ``rope_tables``)
        kinds = [(a.window(i), "nope_" if i in a.nope_layers else "local_" if a.window(i) and a.local_rope_theta
                  else "") for i in range(a.num_layers)]
        self.kinds = sorted(set(kinds))
        with torch.device("meta"):
            self.embed = nn.Embedding(a.vocab_size, a.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(a, i in a.sparse_layers, self.kinds.index(kinds[i]),
                                                     reduce.size if reduce is not None else 1, i)
                                        for i in range(a.num_layers))
            self.norm = nn.Parameter(torch.ones(a.hidden_size))
            untied = head and not a.tie_word_embeddings
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False) if untied else None
        for layer in self.layers:
            layer.reduce = reduce
        self.to(dtype)
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.keep_float32()                                    # GLM-4.5's router
        self.to_empty(device=device)
        acc = torch.float64 if dtype == torch.float64 else torch.float32   # the native kernels' accumulation type
        for prefix, theta, linear in (("", a.rope_theta, a.rope_linear), ("local_", a.local_rope_theta, 1.0)):
            if theta:                                                       # [max_len, D] each
                llama3, yarn = (a.rope_llama3, a.rope_yarn) if not prefix else (None, None)
                for suffix, dt in (("", dtype), ("_acc", acc)):
                    cos, sin = rope_table(a.head_dim, max_len, theta, dt, device, llama3=llama3, linear=linear,
                                          yarn=yarn, rotary_dim=a.rotary_dim)
                    self.register_buffer(f"{prefix}cos{suffix}", cos, persistent=False)
                    self.register_buffer(f"{prefix}sin{suffix}", sin, persistent=False)
        if a.nope_layers:                   # SmolLM3's layers without RoPE: a rotation by 0, [1, D] (``_rope``)
            for suffix, dt in (("", dtype), ("_acc", acc)):
                self.register_buffer(f"nope_cos{suffix}", torch.ones(1, a.head_dim, dtype=dt, device=device),
                                     persistent=False)
                self.register_buffer(f"nope_sin{suffix}", torch.zeros(1, a.head_dim, dtype=dt, device=device),
                                     persistent=False)
        # Ministral 3: the queries' factor at each 1 + floor(p / original) (``_rope``), computed once
        # in float64 and rounded to the dtype: a lookup per step, the same bits for a token in any
        # batch by construction (no elementwise function whose vectorised and scalar paths could
        # differ: README's limits)
        table = None
        if a.query_scale:
            beta, original = a.query_scale
            table = (1 + beta * torch.log1p(torch.arange(max_len // original + 1, dtype=torch.float64)))
        self.register_buffer("query_scale", None if table is None else table.to(dtype=dtype, device=device),
                             persistent=False)
        # Gemma: embeddings times sqrt(hidden_size), that factor rounded to the model's dtype first
        scale = torch.tensor(a.hidden_size ** 0.5, dtype=dtype, device=device) if a.scale_embeddings else None
        self.register_buffer("embed_scale", scale, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMeta) -> torch.Tensor:
        """input_ids, positions: [N]; caches: per layer (key blocks [rows, KV, cap * D], values
        [rows, KV, cap, D]), a DeltaNet layer's (conv states, delta-rule states)
        (``KVCache.layers()``). Returns normed hidden [N, hidden]."""
        x = self.embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        kernels = select(x.device, x.dtype)                                 # the one place a backend is chosen
        a = self.args
        ropes = [self._rope(kernels, positions, window, tables) for window, tables in self.kinds]
        y = None
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            x, y = layer(x, y, kernels, ropes[layer.kind], k_cache, v_cache, meta)
        if y is None:
            return kernels.rms_norm(x, self.norm, a.rms_norm_eps)
        return kernels.add_rms_norm(x, y, self.norm, a.rms_norm_eps)[1]

    def _rope(self, kernels: Backend, positions: torch.Tensor, window: int, tables: str) -> Rope:
        """What one kind of layer's attention reads this forward. A layer without RoPE (SmolLM3's
        NoPE) reads its one-row tables at row 0 for every token, a rotation by 0: q and k times
        1 plus their partners times 0, themselves exactly (its window's origins from the true
        positions)."""
        a = self.args
        if tables != "nope_":
            rope = kernels.rope(self.rope_tables(tables), positions, window, a.attn_scale or None,
                                a.attn_softcap or None)
            if self.query_scale is None:
                return rope
            return replace(rope, query_scale=self.query_scale[positions // a.query_scale[1]][:, None])
        rope = kernels.rope(self.rope_tables(tables), torch.zeros_like(positions), 0, a.attn_scale or None,
                            a.attn_softcap or None)
        return replace(rope, origin=origins(positions, window))

    def advance_states(self, states, plan, runs) -> None:
        """Accepted draft nodes into the recurrent states (engine/kv/states.py ``accept``)."""
        states.advance(self, plan, runs)

    def rope_tables(self, prefix: str = "") -> RopeTables:
        """The RoPE tables of the full-attention layers (``prefix`` ""), of Gemma 3's sliding-window
        ones ("local_"), or of the layers without RoPE ("nope_": [1, D], cos 1 and sin 0)."""
        return RopeTables(*(getattr(self, f"{prefix}{name}") for name in ("cos", "sin", "cos_acc", "sin_acc")))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] (Gemma 2: soft-capped as Hugging Face's, in the model's dtype;
        elementwise, so a row's logits stay its own)."""
        if not self.head:
            raise RuntimeError("Transformer.logits: this rank's part of the model has no LM head")
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = select(hidden.device, hidden.dtype).linear(hidden, weight)
        cap = self.args.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every product ``forward`` and ``logits`` compute."""
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        out = []
        for layer in self.layers:
            mods = (layer.qkv, layer.o, layer.gate_up, layer.down) if layer.linear is None else \
                (layer.linear.in_proj, layer.linear.out, layer.gate_up, layer.down)
            out += [(m.weight, m.bias) for m in mods if m is not None]
            if layer.mla is not None:
                out += layer.mla.linears()
            if layer.moe is not None:
                out += layer.moe.linears()
        return out + [(head, None)] if self.head else out

    def prepare_kernels(self) -> None:
        """Let the backend decide per weight now what it would decide in the first step."""
        select(self.norm.device, self.norm.dtype).prepare(self.linears())

    def weight_names(self) -> list[str]:
        """The Hugging Face names of a complete checkpoint of this model."""
        return checkpoint_names(slots(self))

    def check_weights(self, shapes, complete: bool) -> set[str]:
        """``hf_names.check``: the checkpoint names tensors of these (name, shape) would write."""
        return check(self, shapes, complete)

    def load_weights(self, weights, complete: bool) -> set[str]:
        """``load_hf``: Hugging Face tensors copied in place; the checkpoint names written."""
        return load_hf(self, weights, complete)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a complete set of Hugging Face tensors into ours (fusing QKV and gate/up), names
        and shapes checked before anything is copied. Used at load time and for in-place weight
        updates from a trainer (hf_names.py; ``load_hf`` for a part of the weights)."""
        load_hf(self, sd, complete=True)
