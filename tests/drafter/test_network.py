"""The learned drafter: checkpoint round trip (and the old format refused by name), shapes,
training's whole-sequence unroll equal to step-by-step drafting, and that training teaches it."""
import json
import time

import pytest
import torch

from tailrl.drafter.network import CONFIG_FILE, Drafter, DrafterConfig, DrafterData
from tailrl.drafter.train import drafter_loss, sample_batch, teacher_forced, train
from tailrl.model.loader import load_model


@pytest.fixture(scope="module")
def target(ckpt_dir):
    path = ckpt_dir("qwen2", init_std=3.0, max_pos=1024)
    return path, load_model(path)


def perturbed(d: Drafter, scale: float = 0.05) -> Drafter:
    with torch.no_grad():
        for p in d.parameters():
            p.add_(scale * torch.randn_like(p))             # not the initial weights
    return d


def test_save_load_round_trip(target, tmp_path):
    path, model = target
    d = perturbed(Drafter.for_target(model))
    assert (d.cfg.num_heads, d.cfg.head_dim) == (model.args.num_kv_heads, model.args.head_dim)
    d.save(str(tmp_path / "dr"))
    e = Drafter.load(str(tmp_path / "dr"), model)
    assert e.cfg == d.cfg
    for (na, a), (nb, b) in zip(d.state_dict().items(), e.state_dict().items(), strict=True):
        assert na == nb and torch.equal(a, b)
    h, c = model.args.hidden_size, d.cfg
    feat, tok, pos = torch.randn(3, h), torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9])
    seen = torch.tensor([[True] * 4 + [False], [False] * 5, [True] * 5])
    past = (torch.randn(3, c.num_heads, c.head_dim, 5), torch.randn(3, c.num_heads, 5, c.head_dim),
            torch.zeros(3, 5).masked_fill(~seen, float("-inf")))
    for x, y in zip(d.step(feat, tok, pos, past), e.step(feat, tok, pos, past)):
        assert torch.equal(x, y)
    out, logits, k, v = e.step(feat, tok, pos, past)
    assert out.shape == (3, h) and logits.shape == (3, model.args.vocab_size)
    assert k.shape == v.shape == (3, c.num_heads, c.head_dim)


def test_load_rejects_a_missing_file_an_old_format_or_another_target(target, ckpt_dir, tmp_path):
    path, model = target
    with pytest.raises(ValueError, match="drafter.json"):
        Drafter.load(str(tmp_path), model)
    Drafter.for_target(model).save(str(tmp_path / "dr"))
    other = load_model(ckpt_dir("qwen2", hidden_size=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="hidden_size"):
        Drafter.load(str(tmp_path / "dr"), other)
    cfg_path = tmp_path / "dr" / CONFIG_FILE
    raw = json.loads(cfg_path.read_text())
    old = {k: raw[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "rms_norm_eps")}
    cfg_path.write_text(json.dumps(old))                   # the format before attention
    with pytest.raises(ValueError, match="'num_heads'.*older format"):
        Drafter.load(str(tmp_path / "dr"), model)
    cfg_path.write_text(json.dumps({**raw, "window": 3}))
    with pytest.raises(ValueError, match="window"):
        Drafter.load(str(tmp_path / "dr"), model)


def test_shared_weights_are_frozen_and_not_saved(target):
    _, model = target
    d = Drafter.for_target(model)
    names = {n for n, _ in d.named_parameters()}
    assert not any("embed" == n or "head" == n for n in names)
    assert "embed" not in d.state_dict() and "head" not in d.state_dict()
    assert torch.equal(d.head, model.embed.weight.float() if model.lm_head is None else model.lm_head.weight.float())


def test_unroll_equals_drafting_step_by_step():
    """Training's whole-sequence unroll step k at position t is depth k + 1 of the draft rooted
    at t - k: the committed K/V of positions < t - k, then the path's own K/V (float64)."""
    torch.manual_seed(0)
    h, v = 32, 50
    d = perturbed(Drafter(DrafterConfig(h, 48, v, 2, 8), torch.randn(v, h), torch.randn(v, h)).double(), 0.3)
    hidden, tokens, lengths = torch.randn(2, 12, h, dtype=torch.float64), torch.randint(0, v, (2, 12)), [12, 9]
    outs = d.unroll(hidden, tokens, torch.tensor(lengths), 3)
    for b, n in enumerate(lengths):
        k_all, v_all = d.committed_kv(hidden[b, :n - 1], tokens[b, 1:n], torch.arange(n - 1))
        for root in range(n - 1):
            bias = torch.zeros(1, n - 1, dtype=torch.float64).masked_fill((torch.arange(n - 1) >= root)[None], -torch.inf)
            past = (k_all.permute(1, 2, 0)[None], v_all.transpose(0, 1)[None], bias)
            feat, path = hidden[b, root][None], None
            for depth in range(min(3, n - 1 - root)):
                t = root + depth
                feat, logits, k, vv = d.step(feat, tokens[b, t + 1][None], torch.tensor([t]), past, None, path)
                assert torch.allclose(feat[0], outs[depth][0][b, t], atol=1e-10)
                assert torch.allclose(logits[0], outs[depth][1][b, t], atol=1e-10)
                k, vv = k[:, :, None], vv[:, :, None]
                path = (k, vv) if path is None else (torch.cat([path[0], k], 2), torch.cat([path[1], vv], 2))


def test_sample_batch_crops_and_pads():
    lens = [10, 3, 40]
    data = DrafterData(torch.arange(53.0)[:, None].repeat(1, 4), torch.arange(53), torch.tensor([0] + lens).cumsum(0),
                       torch.tensor([2, 1, 30]))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = sample_batch(data, 16, gen)
        assert int(batch.lengths.sum()) >= 16 and int(batch.lengths.max()) <= 16
        for b, n in enumerate(batch.lengths.tolist()):
            row = batch.tokens[b, :n]
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + n))     # a contiguous crop
            assert torch.equal(batch.hidden[b, :n, 0], row.float())
            seq = int((torch.tensor([0] + lens).cumsum(0)[1:] <= int(row[0])).sum())
            start = int(row[0]) - [0, 10, 13][seq]
            assert int(batch.first[b]) == max(0, [2, 1, 30][seq] - start)
            assert int(batch.first[b]) <= n - 2                # every crop holds a root that counts


def test_training_lowers_the_loss(target):
    path, _ = target
    gen = torch.Generator().manual_seed(0)
    seqs = [([5, 6, 7], torch.randint(0, 97, (40,), generator=gen).tolist()) for _ in range(4)]
    data = teacher_forced(path, seqs)
    assert data.windows(2) == 4 * (43 - 2 - 2)
    d = Drafter.for_target(load_model(path))
    batch = sample_batch(data, 200, torch.Generator().manual_seed(1))
    before = drafter_loss(d, batch, 2)[0].item()
    train(d, data, steps=60, batch=128, lr=3e-3, unroll=2)
    with torch.no_grad():
        after = drafter_loss(d, batch, 2)[0].item()
    assert after < 0.8 * before


def test_a_time_budget_ends_training_with_the_decay_done(target):
    """``max_seconds``: training stops with the first of its steps and its seconds spent, the
    cosine decay following whichever is further along; a generous budget runs every step."""
    path, _ = target
    gen = torch.Generator().manual_seed(0)
    data = teacher_forced(path, [([5, 6, 7], torch.randint(0, 97, (40,), generator=gen).tolist())
                                 for _ in range(4)])
    d = Drafter.for_target(load_model(path))
    batch = sample_batch(data, 200, torch.Generator().manual_seed(1))
    before = drafter_loss(d, batch, 2)[0].item()
    assert train(d, data, steps=60, batch=128, lr=3e-3, unroll=2, max_seconds=3600)["steps"] == 60
    with torch.no_grad():
        assert drafter_loss(d, batch, 2)[0].item() < 0.8 * before
    t0 = time.perf_counter()
    short = train(d, data, steps=10**6, batch=128, lr=3e-3, unroll=2, max_seconds=0.5)
    assert 1 <= short["steps"] < 10**6 and time.perf_counter() - t0 < 5


def test_a_bfloat16_copy_rotates_positions_as_the_float32_drafter():
    """RoPE frequencies stay float64 in a low-precision copy (``.to(bfloat16)`` used to round
    them: position 2000's cosines were off by up to 0.33): its committed keys equal the float32
    drafter's to bfloat16 rounding at any position, so either copy's queries read them alike."""
    import copy
    torch.manual_seed(0)
    d = Drafter(DrafterConfig(64, 64, 100, 4, 16), torch.randn(100, 64), torch.randn(100, 64))
    fast = copy.deepcopy(d).to(torch.bfloat16)
    assert fast.inv_freq.dtype == torch.float64
    h, toks, pos = torch.randn(3, 64), torch.tensor([1, 2, 3]), torch.tensor([5, 2000, 4000])
    with torch.no_grad():
        k32, _ = d.committed_kv(h, toks, pos)
        k16, _ = fast.committed_kv(h.bfloat16(), toks, pos)
    assert torch.allclose(k16.float(), k32, atol=0.05 * k32.abs().max().item())
