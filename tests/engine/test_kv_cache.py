"""KVCache in the key-block layout: every operation agrees with a plain [L, 2, rows, KV, cap, D]
model of the cache (positions written, grown, rows and positions moved, exported, imported)."""
import torch

from tailrl.engine.kv_cache import KVCache
from tailrl.kernels.layout import BLOCK, unpack_keys
from tailrl.kernels.reference import write_keys
from tailrl.model.args import ModelArgs

ARGS = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=64,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                 max_position_embeddings=200, tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                 mlp_bias=False, qk_norm=False, eos_token_ids=(2,))


def plain(kv: KVCache, row: int, length: int) -> torch.Tensor:
    """[L, 2, KV, length, D] read back through the model's own views."""
    ks = [unpack_keys(k[row], ARGS.head_dim)[:, :, :length].transpose(-1, -2) for k, _ in kv.layers()]
    vs = [v[row, :, :length] for _, v in kv.layers()]
    return torch.stack([torch.stack([k, v]) for k, v in zip(ks, vs)])


def fill(kv: KVCache, row: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(ARGS.num_layers, 2, ARGS.num_kv_heads, length, ARGS.head_dim, generator=g,
                       dtype=torch.float64)
    rows, pos = torch.full((length,), row), torch.arange(length)
    for layer, (k, v) in enumerate(kv.layers()):
        write_keys(k, rows, pos, data[layer, 0].transpose(0, 1))        # [n, KV, D]
        v[row, :, :length] = data[layer, 1]
    return data


def test_layout_operations_match_a_plain_cache():
    kv = KVCache(ARGS, torch.float64, "cpu", budget_tokens=4096, max_rows=8, max_len=190)
    assert kv.cap % BLOCK == 0
    a = fill(kv, 0, 50, seed=1)
    assert kv.reserve(3, 150) and kv.cap % BLOCK == 0 and kv.cap >= 150   # grown: data kept
    assert torch.equal(plain(kv, 0, 50), a)
    b = fill(kv, 1, 150, seed=2)
    kv.move_row(1, 2, 150)
    assert torch.equal(plain(kv, 2, 150), b)
    assert torch.equal(kv.export_row(2, 150), b)
    kv.import_row(0, b[:, :, :, :70])
    assert torch.equal(plain(kv, 0, 70), b[:, :, :, :70])
    kv.move_positions(2, [140, 141, 149], [33, 34, 35])                   # tree nodes accepted
    want = b.clone()
    want[:, :, :, [33, 34, 35]] = b[:, :, :, [140, 141, 149]]
    assert torch.equal(plain(kv, 2, 150), want)


def test_budget_counts_whole_blocks():
    kv = KVCache(ARGS, torch.float32, "cpu", budget_tokens=300, max_rows=8, max_len=128)
    assert kv.fits(2, 100) and not kv.fits(3, 100)                        # 3 x 128 slots > 300
    assert kv.reserve(2, 100) and kv.rows * kv.cap <= 300
