"""Block-scaled FP8 checkpoints (DeepSeek-V3's, Kimi K2's, Qwen's -FP8: model/quantized.py): each
float8 weight and its ``weight_scale_inv`` dequantized as they are read, as transformers
dequantizes them, whole and split over ranks, blocks that do not divide the weight included."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from tailrl import LLM, SamplingParams
from tailrl.model import quantized
from tailrl.model.loader import load_model, load_state_dict, tensor_shapes
from tailrl.model.parallel import Shard

BLOCK = (16, 24)                     # 24 does not divide the tiny model's 64 columns: a partial block


def _fp8_checkpoint(src: str, dst: str) -> dict[str, torch.Tensor]:
    """A copy of ``src`` whose 2-D projections are float8 with a float32 factor per block (as
    DeepSeek's quantizer makes them: the block's largest magnitude to 448), its config saying so;
    and the weights the FP8 ones stand for (float8 times factor, in float32)."""
    sd, want = {}, {}
    for name, w in load_state_dict(src).items():
        if w.dim() != 2 or not name.endswith("proj.weight") or name.endswith("mlp.gate.weight"):
            sd[name] = w
            continue
        rows, cols = w.shape
        grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        big = w.float().abs()
        pad = torch.zeros(grid[0] * BLOCK[0], grid[1] * BLOCK[1])
        pad[:rows, :cols] = big
        scale = pad.view(grid[0], BLOCK[0], grid[1], BLOCK[1]).amax(dim=(1, 3)).clamp(min=1e-12) / 448
        full = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
        sd[name] = (w.float() / full).to(torch.float8_e4m3fn)
        sd[name + "_scale_inv"] = scale
        want[name] = sd[name].float() * full
    os.makedirs(dst)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                  "weight_block_size": list(BLOCK)}}, f)
    return want


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3"])
def test_an_fp8_checkpoint_loads_its_weights_times_their_blocks_factors(ckpt_dir, tmp_path, arch):
    path = ckpt_dir(arch)
    fp8 = str(tmp_path / "fp8")
    want = _fp8_checkpoint(path, fp8)
    assert len(want) >= 5 and tensor_shapes(fp8) == tensor_shapes(path)
    sd = load_state_dict(fp8, torch.float32)
    assert all(torch.equal(sd[name], w) for name, w in want.items())
    q = next(name for name in want if name.endswith("q_proj.weight") or name.endswith("q_a_proj.weight"))
    with pytest.raises(ValueError, match="FP8 weight"):       # scales that do not fit the weight
        list(quantized.dequantized([(q, torch.zeros(3, 3, dtype=torch.float8_e4m3fn)),
                                    (q + "_scale_inv", torch.ones(5, 5))], torch.float32, block=BLOCK))
    plain = str(tmp_path / "plain")                           # the same weights as a float32 checkpoint
    os.makedirs(plain)
    save_file({**load_state_dict(path), **want}, os.path.join(plain, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(plain, "config.json"), "w") as g:
        g.write(f.read())
    for dtype in ("float32", "bfloat16"):
        a, b = load_model(fp8, dtype), load_model(plain, dtype)
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    for rank in range(2):                                     # a rank's part: cut once dequantized
        a, b = load_model(fp8, "float32", shard=Shard(rank, 2)), load_model(plain, "float32", shard=Shard(rank, 2))
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert LLM(fp8).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids == \
        LLM(plain).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids


def test_blocks_that_divide_the_weight_give_transformers_bits_and_a_lone_half_is_refused():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 3, generator=g) + 0.01
    for dtype in (torch.float32, torch.bfloat16):
        ours = quantized.dequantize_fp8(w, scale, (16, 32), dtype)
        assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(w, scale, output_dtype=dtype))
    with pytest.raises(ValueError, match="no partner"):
        list(quantized.dequantized([("model.layers.0.self_attn.q_proj.weight", w)], torch.float32, block=(16, 32)))
    with pytest.raises(ValueError, match="weight_block_size"):
        list(quantized.dequantized([("a.weight", w), ("a.weight_scale_inv", scale)], torch.float32))
