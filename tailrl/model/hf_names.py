"""Hugging Face tensor names -> the model's own tensors, for loads and weight updates.

Every name a checkpoint or a trainer's module uses has a *slot*: the view of one of our tensors
it is copied into (a row range of the fused QKV or gate/up projection, one expert of the experts'
[E, ...] tensors), the shape it must have, and the checkpoint names it writes: itself, or, for a
trainer's fused expert tensor (``mlp.experts.gate_up_proj`` [E, 2I, H]), every expert's names as
a checkpoint saves them. The model is complete once every checkpoint name has been written.

A complete set of weights (``load_hf``'s ``complete``) and a bucket (a mapping or a list of
(name, tensor) pairs, any part of the model) are checked whole, names and shapes, before
anything is copied; a stream (an iterator of pairs) is checked one tensor at a time.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from tailrl.model.rope import head_order

# names a checkpoint may hold that are not weights of ours (rotary tables of old Llama
# checkpoints; an image-text model's vision tower and projector, Qwen3.5's ``visual``; Qwen3.5's
# multi-token-prediction module, not loaded: the engine does not draft with it)
NOT_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector|visual)\.|"
                         r"^mtp\.")
# an image-text model's language model (Gemma 3's): its names under these prefixes (the published
# checkpoints', transformers 5's) are the text model's own
TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head."))


# a decoder layer's name: its index
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Skip:
    """Names a checkpoint of this model may hold that are not its weights: a tied model's LM
    head (the embedding's; also a rank that computes no logits), and GLM-4.5's
    multi-token-prediction layers, ``mtp`` of them after the model's ``layers`` (not loaded:
    the engine does not draft with them)."""
    tied: bool
    layers: int = 0
    mtp: int = 0

    @staticmethod
    def of(model) -> "Skip":
        return Skip(model.lm_head is None, model.args.num_layers, model.args.mtp_layers)

    def skips(self, name: str) -> bool:
        if self.tied and name == "lm_head.weight":
            return True
        m = LAYER.match(name)
        return m is not None and self.layers <= int(m.group(1)) < self.layers + self.mtp


@dataclass(frozen=True)
class Slot:
    dest: torch.Tensor                  # the view of our tensor the name is copied into
    shape: tuple[int, ...]              # the shape the name's tensor must have
    writes: tuple[str, ...]             # the checkpoint names it writes
    plus_one: bool = False              # copied as 1 + the tensor (Gemma's norms scale by 1 + weight)
    order: torch.Tensor | None = None   # our row i is the tensor's row order[i] (RoPE's order: rope.head_order)
    reshaped: bool = False              # the tensor copied as reshaped to dest's shape (a view reading ours its way)


def _own(table: dict[str, Slot], name: str, dest: torch.Tensor, shape: tuple[int, ...] | None = None,
         plus_one: bool = False, order: torch.Tensor | None = None) -> None:
    table[name] = Slot(dest, tuple(dest.shape) if shape is None else shape, (name,), plus_one, order)


def _rows(table: dict[str, Slot], names: list[str], tensor: torch.Tensor, sizes: list[int],
          orders: list[torch.Tensor | None] | None = None) -> None:
    """Consecutive row ranges of a fused tensor (its first dimension), one per name (each with
    its order of rows, or None)."""
    for name, part, order in zip(names, torch.split(tensor, sizes), orders or [None] * len(names)):
        _own(table, name, part, order=order)


def _experts(table: dict[str, Slot], moe, p: str) -> None:
    """A sparse layer's router and experts (moe.SparseMoe), under every layout that names them:
    a checkpoint's (one tensor per expert and projection; Mixtral's under block_sparse_moe.) and
    a trainer's module's (transformers 5: the experts fused, under mlp.)."""
    a = moe.a
    mixtral = a.architecture == "MixtralForCausalLM"
    i, mlp = a.moe_intermediate_size, p + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    _own(table, mlp + "gate.weight", moe.router)
    if moe.score_bias is not None:              # GLM-4.5's correction bias (a buffer of the router's)
        _own(table, mlp + "gate.e_score_correction_bias", moe.score_bias)
    gates_ups, downs = [], []
    for e in range(a.num_experts):
        x = f"{mlp}experts.{e}."
        _rows(table, [x + gate + ".weight", x + up + ".weight"], moe.gate_up[e], [i, i])
        _own(table, x + down + ".weight", moe.down[e])
        gates_ups += [x + gate + ".weight", x + up + ".weight"]
        downs.append(x + down + ".weight")
    fused = p + "mlp."                  # a trainer's module (transformers 5): fused experts under mlp.
    if mixtral:
        table[fused + "gate.weight"] = Slot(moe.router, tuple(moe.router.shape), (mlp + "gate.weight",))
    table[fused + "experts.gate_up_proj"] = Slot(moe.gate_up, tuple(moe.gate_up.shape), tuple(gates_ups))
    table[fused + "experts.down_proj"] = Slot(moe.down, tuple(moe.down.shape), tuple(downs))
    if moe.shared_gate_up is not None:          # Qwen2-MoE's shared_expert., GLM-4.5's shared_experts.
        x, s = mlp + ("shared_expert." if moe.shared_gate is not None else "shared_experts."), a.shared_expert_size
        _rows(table, [x + "gate_proj.weight", x + "up_proj.weight"], moe.shared_gate_up.weight, [s, s])
        _own(table, x + "down_proj.weight", moe.shared_down.weight)
    if moe.shared_gate is not None:
        _own(table, mlp + "shared_expert_gate.weight", moe.shared_gate)


def _gpt_oss_experts(table: dict[str, Slot], moe, p: str) -> None:
    """gpt-oss's router (``mlp.router.``, with its bias) and experts as its module and checkpoints
    hold them (MXFP4 ones dequantized at load: quantized.py): [gate | up] per unit side by side and
    transposed ([E, H, 2I], unit u's gate at column 2u and its up at 2u + 1; the bias [E, 2I]
    alike), down [E, I, H]; copied into our [E, 2I, H] and [E, H, I] through views of them that
    read them so."""
    e, h, i = moe.a.num_experts, moe.a.hidden_size, moe.a.moe_intermediate_size
    x = p + "mlp."
    _own(table, x + "router.weight", moe.router)
    _own(table, x + "router.bias", moe.router_bias)
    for name, dest, shape in (("gate_up_proj", moe.gate_up.view(e, 2, i, h).permute(0, 3, 2, 1), (e, h, 2 * i)),
                              ("gate_up_proj_bias", moe.gate_up_bias.view(e, 2, i).transpose(1, 2), (e, 2 * i))):
        table[x + "experts." + name] = Slot(dest, shape, (x + "experts." + name,), reshaped=True)
    _own(table, x + "experts.down_proj", moe.down.transpose(1, 2))
    _own(table, x + "experts.down_proj_bias", moe.down_bias)


def slots(model) -> dict[str, Slot]:
    """Every Hugging Face name ``model`` (transformer.Transformer) takes, with its slot."""
    a, table = model.args, {}
    _own(table, "model.embed_tokens.weight", model.embed.weight)
    _own(table, "model.norm.weight", model.norm, plus_one=a.norm_plus_one)
    if model.lm_head is not None:
        _own(table, "lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        _norms(table, layer, p, a)
        if layer.linear is not None:
            _deltanet(table, layer.linear, p + "linear_attn.", a)
        elif layer.mla is not None:
            _latent(table, layer.mla, p + "self_attn.")
        else:
            _attention(table, layer, p + "self_attn.", a)
        if layer.moe is not None:
            (_gpt_oss_experts if a.expert_bias else _experts)(table, layer.moe, p)
            continue
        mlp = p + "mlp."
        if a.architecture in FUSED_MLP:
            _own(table, mlp + "gate_up_proj.weight", layer.gate_up.weight)
        else:
            _rows(table, [mlp + "gate_proj.weight", mlp + "up_proj.weight"], layer.gate_up.weight,
                  [a.intermediate_size] * 2)
        _own(table, mlp + "down_proj.weight", layer.down.weight)
        if a.mlp_bias:
            _rows(table, [mlp + "gate_proj.bias", mlp + "up_proj.bias"], layer.gate_up.bias,
                  [a.intermediate_size] * 2)
            _own(table, mlp + "down_proj.bias", layer.down.bias)
    return table


# the checkpoint's MLP gate/up projection fused as ours (Phi-3's QKV too)
FUSED_MLP = ("Phi3ForCausalLM", "Glm4ForCausalLM")


def _norms(table: dict[str, Slot], layer, p: str, a) -> None:
    """A layer's norms: Llama's before attention and the MLP; Gemma's, OLMo's and GLM-4's after
    them too (OLMo: only after)."""
    one = a.norm_plus_one
    if layer.input_norm is not None:
        _own(table, p + "input_layernorm.weight", layer.input_norm, plus_one=one)
    if layer.attn_out_norm is None:         # Llama's: the MLP's input norm
        _own(table, p + "post_attention_layernorm.weight", layer.post_norm, plus_one=one)
    elif a.architecture == "Glm4ForCausalLM":
        _own(table, p + "post_self_attn_layernorm.weight", layer.attn_out_norm)
        _own(table, p + "post_attention_layernorm.weight", layer.post_norm)
        _own(table, p + "post_mlp_layernorm.weight", layer.mlp_out_norm)
    else:                                   # Gemma's, OLMo's: the attention output's; the MLP's input's
        # (Gemma) and its output's
        _own(table, p + "post_attention_layernorm.weight", layer.attn_out_norm, plus_one=one)
        if layer.post_norm is not None:
            _own(table, p + "pre_feedforward_layernorm.weight", layer.post_norm, plus_one=one)
        _own(table, p + "post_feedforward_layernorm.weight", layer.mlp_out_norm, plus_one=one)


def _attention(table: dict[str, Slot], layer, att: str, a) -> None:
    """A layer's attention projections (each query and key head's rows in our RoPE's order:
    rope.head_order) and q/k norms."""
    d = a.head_dim
    q, kv = a.num_heads * d, a.num_kv_heads * d
    order = head_order(d, a.rotary_dim, a.rope_interleaved)
    q_rows, k_rows = (None, None) if order is None else (
        (torch.arange(n)[:, None] * d + order).reshape(-1) for n in (a.num_heads, a.num_kv_heads))
    if a.architecture == "Phi3ForCausalLM":     # the checkpoint's QKV fused as ours
        rows = None if order is None else torch.cat([q_rows, q + k_rows, torch.arange(q + kv, q + 2 * kv)])
        _own(table, att + "qkv_proj.weight", layer.qkv.weight, order=rows)
    elif a.attn_output_gate:                # Qwen3.5: q_proj's rows per head [q | gate], ours [gate | q | k | v]
        heads = torch.arange(a.num_heads)[:, None] * 2 * d
        gates = (heads + d + torch.arange(d)).reshape(-1)
        queries = (heads + (torch.arange(d) if order is None else order)).reshape(-1)
        _rows(table, [att + f"{x}_proj.weight" for x in "qkv"], layer.qkv.weight, [2 * q, kv, kv],
              [torch.cat([gates, queries]), k_rows, None])
    else:
        _rows(table, [att + f"{x}_proj.weight" for x in "qkv"], layer.qkv.weight, [q, kv, kv], [q_rows, k_rows, None])
    if a.qkv_bias:
        _rows(table, [att + f"{x}_proj.bias" for x in "qkv"], layer.qkv.bias, [q, kv, kv], [q_rows, k_rows, None])
    _own(table, att + "o_proj.weight", layer.o.weight)
    if a.o_bias:
        _own(table, att + "o_proj.bias", layer.o.bias)
    if layer.qk_norm is not None:           # one [D] weight per projection, every head's
        _own(table, att + "q_norm.weight", layer.qk_norm[:a.num_heads], (d,), a.norm_plus_one, order)
        _own(table, att + "k_norm.weight", layer.qk_norm[a.num_heads:], (d,), a.norm_plus_one, order)
    if layer.sinks is not None:             # gpt-oss: each query head's sink
        _own(table, att + "sinks", layer.sinks)
    if layer.q_norm is not None:            # OLMo: over all heads, [H * D] and [KV * D]
        _own(table, att + "q_norm.weight", layer.q_norm, order=q_rows)
        _own(table, att + "k_norm.weight", layer.k_norm, order=k_rows)


def _latent(table: dict[str, Slot], mla, att: str) -> None:
    """DeepSeek-V3's latent attention's tensors (model/mla.py), each as the checkpoint holds it."""
    for name, mod in (("q_proj", mla.q), ("q_a_proj", mla.q_a), ("q_b_proj", mla.q_b), ("kv_a_proj_with_mqa", mla.kv_a),
                      ("kv_b_proj", mla.kv_b), ("o_proj", mla.o)):
        if mod is not None:
            _own(table, att + name + ".weight", mod.weight)
    if mla.q_a_norm is not None:
        _own(table, att + "q_a_layernorm.weight", mla.q_a_norm)
    _own(table, att + "kv_a_layernorm.weight", mla.kv_a_norm)


def _deltanet(table: dict[str, Slot], net, p: str, a) -> None:
    """A Gated DeltaNet layer's tensors (model/deltanet.py): the four input projections as row
    ranges of our fused one; the conv's [C, 1, K] weight into our [C, K]."""
    kh, vh, kd, vd, width = a.linear_dims
    if a.deltanet_grouped:                  # Qwen3-Next: per key head [q | k | its v | its z] and [its b | its a]
        qkvz, ba = _grouped_rows(a)
        split = a.conv_channels + vh * vd
        _own(table, p + "in_proj_qkvz.weight", net.in_proj.weight[:split], order=qkvz)
        _own(table, p + "in_proj_ba.weight", net.in_proj.weight[split:], order=ba)
    else:
        _rows(table, [p + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")], net.in_proj.weight,
              [a.conv_channels, vh * vd, vh, vh])
    _own(table, p + "conv1d.weight", net.conv.unsqueeze(1))
    for name, dest in (("dt_bias", net.dt_bias), ("A_log", net.A_log), ("norm.weight", net.norm),
                       ("out_proj.weight", net.out.weight)):
        _own(table, p + name, dest)


def _grouped_rows(a) -> tuple[torch.Tensor, torch.Tensor]:
    """Where our DeltaNet projection's rows [q | k | v | z] and [b | a] sit in Qwen3-Next's
    in_proj_qkvz (per key head g: its q, its k, then the v and z of its VH / KH value heads) and
    in_proj_ba (per key head: its value heads' b, then their a)."""
    kh, vh, kd, vd, _ = a.linear_dims
    r = vh // kh
    width = 2 * kd + 2 * r * vd
    g, d = torch.arange(kh)[:, None], torch.arange(kd)[None, :]
    h, e = torch.arange(vh)[:, None], torch.arange(vd)[None, :]
    v_at = (h // r) * width + 2 * kd + (h % r) * vd + e
    qkvz = torch.cat([(g * width + d).reshape(-1), (g * width + kd + d).reshape(-1), v_at.reshape(-1),
                      (v_at + r * vd).reshape(-1)])
    heads = torch.arange(vh)
    return qkvz, torch.cat([(heads // r) * 2 * r + heads % r, (heads // r) * 2 * r + r + heads % r])


def checkpoint_names(table: dict[str, Slot]) -> list[str]:
    """The names a complete checkpoint holds (each written by itself), in the model's order."""
    return [name for name, s in table.items() if s.writes == (name,)]


def pairs_of(weights: Mapping | Iterable) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a mapping or an iterable of pairs, each checked to be one."""
    for item in (weights.items() if isinstance(weights, Mapping) else weights):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"weights: expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str):
            raise ValueError(f"weights: names must be strings, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weights: {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        yield name, tensor


def text_name(name: str) -> str:
    """A name of an image-text model's language model as the text model's own (others as they are)."""
    for prefix, own in TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return own + name[len(prefix):]
    return name


def _slot(table: dict[str, Slot], skip: Skip, name: str, shape: tuple[int, ...]) -> Slot | None:
    """The slot of a tensor of this name and shape, None for a name that is not a weight, or a
    ValueError naming it."""
    slot = table.get(text_name(name))
    if slot is None:
        if NOT_WEIGHTS.search(name) or skip.skips(text_name(name)):
            return None
        raise ValueError(f"weights: the model has no tensor named {name!r}")
    if tuple(shape) != slot.shape:
        raise ValueError(f"weights: {name!r} has shape {tuple(shape)}, the model's is {slot.shape}")
    return slot


def check(model, shapes: Iterable[tuple[str, tuple[int, ...]]], complete: bool) -> set[str]:
    """The checkpoint names tensors of these (name, shape) would write in ``model``, or a
    ValueError naming the first that does not fit (or, where ``complete``, a missing one)."""
    return _check(slots(model), Skip.of(model), shapes, complete)


def _check(table: dict[str, Slot], skip: Skip, shapes: Iterable[tuple[str, tuple[int, ...]]],
           complete: bool) -> set[str]:
    written = {w for n, shape in shapes if (s := _slot(table, skip, n, shape)) is not None for w in s.writes}
    missing = [n for n in checkpoint_names(table) if n not in written] if complete else []
    if missing:
        raise ValueError(f"model: weights are missing the tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return written


@torch.no_grad()
def load_hf(model, weights: Mapping | Iterable, complete: bool) -> set[str]:
    """Copy Hugging Face tensors into ``model`` in place; returns the checkpoint names written.
    ``complete``: ``weights`` must write every checkpoint name. Otherwise any part: a mapping or
    a sequence of (name, tensor) pairs (a bucket) has every name and shape checked before
    anything is copied, as a complete set does; pairs from an iterator (a stream) are checked one
    tensor at a time, before each is copied."""
    table, skip = slots(model), Skip.of(model)
    pairs = pairs_of(weights)
    if complete or isinstance(weights, (Mapping, list, tuple)):
        pairs = list(pairs)
        _check(table, skip, [(n, t.shape) for n, t in pairs], complete)
    written = set()
    for name, tensor in pairs:
        slot = _slot(table, skip, name, tensor.shape)
        if slot is not None:
            if slot.order is not None:
                tensor = tensor.index_select(0, slot.order.to(tensor.device))
            if slot.reshaped:
                tensor = tensor.reshape(slot.dest.shape)
            slot.dest.copy_(tensor.double() + 1 if slot.plus_one else tensor)
            written.update(slot.writes)
    return written
