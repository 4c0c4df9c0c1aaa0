"""Which part of every weight each rank of a split model holds (model/parallel.py)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from tailrl.model.loader import load_state_dict, read_args
from tailrl.model.parallel import OrderedSum, Shard, read_part, shard_args, shard_tensor


@pytest.mark.parametrize("arch", ["qwen2", "llama_bias", "phi3", "qwen2_moe", "mixtral", "glm4_moe"])
def test_the_ranks_parts_tile_every_weight_and_read_only_their_bytes(ckpt_dir, arch):
    path = ckpt_dir(arch)
    args = read_args(path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as g:
        for name in g.keys():
            whole = g.get_tensor(name)
            parts = [read_part(name, g.get_slice(name), args, Shard(r, 2)) for r in range(2)]
            for r, p in enumerate(parts):
                assert torch.equal(p, shard_tensor(name, whole, args, Shard(r, 2))), name
            if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):   # Phi-3's fused: each part's rows
                sizes = ([args.intermediate_size // 2] * 2 if "gate_up" in name else
                         [args.num_heads * args.head_dim // 2] + [args.num_kv_heads * args.head_dim // 2] * 2)
                pieces = [t.split(sizes) for t in parts]                  # [q; k; v] or [gate; up] of each rank
                assert torch.equal(torch.cat([x for same in zip(*pieces) for x in same]), whole)
            elif name.endswith(("o_proj.bias", "down_proj.bias")):        # rank 0 adds the bias, once
                assert torch.equal(parts[0], whole) and not parts[1].any()
            elif name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):   # columns: a rank's inputs
                assert torch.equal(torch.cat(parts, 1), whole) and parts[0].shape[1] * 2 == whole.shape[1]
            elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1.", "w3.")):
                assert torch.equal(torch.cat(parts, 0), whole) and parts[0].shape[0] * 2 == whole.shape[0]
            else:                                                         # norms, embedding, LM head, routers
                assert all(torch.equal(p, whole) for p in parts), name


def test_a_trainers_fused_experts_split_as_each_experts_tensors_do(ckpt_dir):
    """transformers' module: [E, 2I, H] gate and up, [E, H, I] down; a checkpoint: each expert's."""
    import transformers
    path = ckpt_dir("qwen3_moe")
    args, ckpt = read_args(path), load_state_dict(path)
    module = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    p = "model.layers.0.mlp."                        # (layer 1 is dense)
    for shard in (Shard(0, 2), Shard(1, 2)):
        gate_up = shard_tensor(p + "experts.gate_up_proj", module[p + "experts.gate_up_proj"], args, shard)
        down = shard_tensor(p + "experts.down_proj", module[p + "experts.down_proj"], args, shard)
        assert gate_up.shape[1] == args.moe_intermediate_size
        for e in range(args.num_experts):
            part = {k: shard_tensor(f"{p}experts.{e}.{k}_proj.weight", ckpt[f"{p}experts.{e}.{k}_proj.weight"],
                                    args, shard) for k in ("gate", "up", "down")}
            assert torch.equal(gate_up[e], torch.cat([part["gate"], part["up"]]))
            assert torch.equal(down[e], part["down"])


def test_a_split_divides_heads_and_width_or_names_what_does_not_divide(ckpt_dir):
    args = read_args(ckpt_dir("qwen2"))                      # 4 heads, 2 K/V heads, 128 MLP units
    half = shard_args(args, 2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size, half.head_dim) == (2, 1, 64, args.head_dim)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's 2 K/V heads"):
        shard_args(args, 4)


class _Gather:
    """A process group of ``parts`` (the other ranks' partials fixed), as OrderedSum calls it."""

    def __init__(self, parts):
        self.parts = parts

    def allgather(self, outs, ins):
        for o, p in zip(outs[0], [ins[0], *self.parts]):
            o.copy_(p)
        return self

    def wait(self):
        return True

    def rank(self):
        return 0


def test_the_sum_of_partials_is_added_in_float32_and_rounded_once():
    """1 + 2^-8 + 2^-8: in float32 1 + 2^-7, a bfloat16 number; added in bfloat16 each 2^-8 would
    round away (a tie to even) and leave 1."""
    mine = torch.tensor([[1.0, -3.0]], dtype=torch.bfloat16)
    theirs = [torch.tensor([[2 ** -8, 1.0]], dtype=torch.bfloat16)] * 2
    got = OrderedSum(_Gather(theirs), 3)(mine)
    assert got.dtype == torch.bfloat16 and got.tolist() == [[1.0 + 2 ** -7, -1.0]]
    assert ((mine + theirs[0]) + theirs[1]).tolist() == [[1.0, -1.0]]


def test_gathered_rows_are_every_ranks_side_by_side_in_rank_order():
    mine = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    theirs = [torch.tensor([[5.0, 6.0], [7.0, 8.0]]), torch.tensor([[9.0, 10.0], [11.0, 12.0]])]
    group = OrderedSum(_Gather(theirs), 3)
    assert group.rank == 0 and torch.equal(group.gather(mine), torch.cat([mine, *theirs], dim=1))
