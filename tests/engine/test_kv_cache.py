"""The block pool: every operation agrees with a plain per-row model of the cache (positions
written through slots, rows moved, shared, exported, imported, tree positions moved), blocks are
handed out all or nothing and come back, shared blocks are counted and never copied, and the
pool is allocated once."""
import numpy as np
import pytest
import torch

from tailrl.engine.kv import KVCache
from tailrl.kernels.layout import BLOCK, gather_rows, unpack_keys
from tailrl.kernels.reference import write_kv
from tailrl.model.args import ModelArgs

ARGS = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=64,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                 max_position_embeddings=200, tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                 mlp_bias=False, qk_norm=False, eos_token_ids=(2,))


def plain(kv: KVCache, row: int, length: int) -> torch.Tensor:
    """[L, 2, KV, length, D] read back through the block table, as the kernels read it."""
    out = []
    for k, v in kv.layers():
        keys, values = gather_rows(k, v, kv.table, torch.tensor([row]), length)
        out.append(torch.stack([unpack_keys(keys[0], ARGS.head_dim)[:, :, :length].transpose(-1, -2),
                                values[0, :, :length]]))
    return torch.stack(out)


def fill(kv: KVCache, row: int, length: int, seed: int, start: int = 0) -> torch.Tensor:
    """Random K/V written at the row's positions start .. length - 1 through their slots."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(ARGS.num_layers, 2, ARGS.num_kv_heads, length, ARGS.head_dim, generator=g,
                       dtype=torch.float64)
    pos = np.arange(start, length)
    slots = torch.from_numpy(kv.slots(np.full_like(pos, row), pos))
    for layer, (k, v) in enumerate(kv.layers()):
        write_kv(k, v, slots, data[layer, 0, :, start:].transpose(0, 1), data[layer, 1, :, start:].transpose(0, 1))
    return data


def test_layout_operations_match_a_plain_cache():
    kv = KVCache(ARGS, torch.float64, "cpu", budget_tokens=4096, max_rows=8, max_len=190)
    assert kv.grow(3, 70) and kv.grow(0, 50)
    kv.release(3)                                   # fragments the pool: row 1's blocks are not in order
    assert kv.grow(1, 150)
    assert not np.all(np.diff(kv.table[1, :5].numpy()) == 1)
    a = fill(kv, 0, 50, seed=1)
    b = fill(kv, 1, 150, seed=2)
    assert torch.equal(plain(kv, 0, 50), a) and torch.equal(plain(kv, 1, 150), b)
    kv.move_row(1, 2)
    assert torch.equal(plain(kv, 2, 150), b) and kv.held[1] == 0
    assert torch.equal(kv.export_row(2, 150), b)
    assert kv.grow(4, 70)
    kv.import_row(4, b[:, :, :, :70])
    assert torch.equal(plain(kv, 4, 70), b[:, :, :, :70])
    kv.move_positions(2, [140, 141, 149], [33, 34, 35])                   # tree nodes accepted
    want = b.clone()
    want[:, :, :, [33, 34, 35]] = b[:, :, :, [140, 141, 149]]
    assert torch.equal(plain(kv, 2, 150), want)
    kv.move_positions([4, 2, 4], [69, 100, 31], [3, 36, 64])              # several rows at once (follow-ups)
    want[:, :, :, 36] = want[:, :, :, 100]
    mine = b[:, :, :, :70].clone()
    mine[:, :, :, [3, 64]] = mine[:, :, :, [69, 31]]
    assert torch.equal(plain(kv, 2, 150), want) and torch.equal(plain(kv, 4, 70), mine)
    with pytest.raises(ValueError, match="holds"):
        kv.import_row(5, b[:, :, :, :40])                                 # row 5 holds no blocks


def test_blocks_are_handed_out_all_or_none_and_come_back():
    kv = KVCache(ARGS, torch.float32, "cpu", budget_tokens=10 * BLOCK, max_rows=8, max_len=128)
    assert kv.num_blocks == 10 and kv.free_blocks == 10
    assert kv.grow_rows([(0, 100), (1, 64)])                              # 4 + 2 blocks
    assert kv.used == 6 and kv.need(0, 128) == 0 and kv.need(0, 129) == 1
    assert not kv.grow_rows([(2, 96), (3, 64)])                           # 3 + 2 > 4 free: nothing taken
    assert kv.used == 6 and kv.held[2] == 0
    kv.release(0)
    assert kv.free_blocks == 8 and kv.peak_used == 6
    assert kv.grow_rows([(2, 96), (3, 64)])
    first = int(kv.table[2, 0])
    kv.release(2)
    assert kv.grow(5, 1) and int(kv.table[5, 0]) == first                # the block just freed is reused first


def test_siblings_share_the_prompts_full_blocks_and_copy_the_partial_one():
    kv = KVCache(ARGS, torch.float64, "cpu", budget_tokens=40 * BLOCK, max_rows=8, max_len=200)
    prompt = 3 * BLOCK + 5
    assert kv.grow(0, prompt)
    a = fill(kv, 0, prompt, seed=3)
    free = kv.free_blocks
    assert kv.share(0, 1, prompt - 1)                                     # 3 full blocks shared, 1 copied
    assert kv.free_blocks == free - 1 and kv.shared == 3 and kv.held[1] == 4
    assert list(kv.table[1, :3]) == list(kv.table[0, :3]) and kv.table[1, 3] != kv.table[0, 3]
    assert torch.equal(plain(kv, 1, prompt - 1), a[:, :, :, :prompt - 1])
    assert kv.grow(1, prompt + 20)
    b = fill(kv, 1, prompt + 20, seed=4, start=prompt - 1)                # the sibling writes past the prompt
    assert torch.equal(plain(kv, 0, prompt), a)                           # the lender's K/V untouched
    assert torch.equal(plain(kv, 1, prompt - 1), a[:, :, :, :prompt - 1])
    assert torch.equal(plain(kv, 1, prompt + 20)[:, :, :, prompt - 1:], b[:, :, :, prompt - 1:])
    assert kv.share(1, 2, prompt - 1) and kv.shared == 3 and kv.peak_shared == 3
    kv.release(0)                                                         # the others keep the shared blocks
    assert kv.shared == 3 and torch.equal(plain(kv, 2, prompt - 1), a[:, :, :, :prompt - 1])
    kv.release(1)
    assert kv.shared == 0
    kv.release(2)
    assert kv.free_blocks == kv.num_blocks and not kv.refs.any()


def test_the_pool_is_allocated_once_and_given_back_when_empty():
    kv = KVCache(ARGS, torch.float32, "cpu", budget_tokens=8 * BLOCK, max_rows=4, max_len=128)
    assert kv.allocations == 1 and kv.data.shape == (2, 2, 8 + 1, 2, BLOCK * 8)     # + the scratch block
    assert kv.scratch_slot == 8 * BLOCK
    assert kv.grow(0, 100)
    kv.layers()
    assert kv.allocations == 1
    with pytest.raises(RuntimeError, match="hold"):
        kv.free_memory()
    kv.release(0)
    kv.free_memory()
    assert kv._data is None and kv.allocations == 1
    kv.layers()
    assert kv.allocations == 2


def test_budget_counts_whole_blocks():
    kv = KVCache(ARGS, torch.float32, "cpu", budget_tokens=300, max_rows=8, max_len=128)
    assert kv.num_blocks == 300 // BLOCK
    assert kv.grow(0, 128) and kv.grow(1, 128) and not kv.grow(2, 128)   # 3 x 4 blocks > 9
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        KVCache(ARGS, torch.float32, "cpu", budget_tokens=100, max_rows=8, max_len=128)


def test_a_few_slots_in_python_equal_the_array_lookup():
    """``slot_list`` (a step of a few tokens) gives ``slots``' values for the same pairs."""
    kv = KVCache(ARGS, torch.float32, "cpu", budget_tokens=40 * BLOCK, max_rows=8, max_len=200)
    for row, length in enumerate((5, 70, 130)):
        assert kv.grow(row, length)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 3, 40)
    positions = np.array([rng.integers(0, (5, 70, 130)[r]) for r in rows], dtype=np.int64)
    want = kv.slots(rows, positions).tolist()
    assert kv.slot_list(rows.tolist(), positions.tolist()) == want and len(set(want)) == len(set(zip(rows, positions)))
