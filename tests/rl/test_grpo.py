"""GRPO advantages and loss on tiny hand-computed cases."""
import math

import pytest
import torch

from tailrl.rl.grpo import group_advantages, grpo_loss

S = 1 / math.sqrt(2)          # (1 - 0.5) / unbiased std of [1, 0] = 0.5 / 0.7071


def test_group_advantages_normalised_per_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    assert adv.tolist() == pytest.approx([S, -S, 0.0, 0.0], abs=1e-5)


def test_group_advantages_centre_only_dr_grpo():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 0.0]), group_size=3, norm_by_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])


def test_group_advantages_groups_are_contiguous():
    # [0, 1 | 2, 3]: each group has the same spread, so the same advantages
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), group_size=2)
    assert adv.tolist() == pytest.approx([-S, S, -S, S], abs=1e-5)


def test_loss_on_policy_is_minus_mean_advantage_per_token():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logp, logp.clone(), adv, mask)
    assert float(loss) == pytest.approx((-1 - 1 + 1) / 3)            # token-mean: long responses weigh more
    loss_seq, _ = grpo_loss(logp, logp.clone(), adv, mask, mode="seq-mean-token-mean")
    assert float(loss_seq) == pytest.approx((-1 + 1) / 2)            # per-response mean, then mean
    assert float(stats["clip_frac"]) == 0.0


def test_clipping_is_pessimistic_and_stops_the_gradient():
    # four tokens: (ratio, advantage) = (1.5, +1), (1.5, -1), (0.5, +1), (0.5, -1)
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    loss, stats = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # per token: max(-A r, -A clip(r)) = -1.2, 1.5, -0.5, 0.8
    assert float(loss.detach()) == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    assert float(stats["clip_frac"]) == pytest.approx(2 / 4)
    loss.backward()
    # clipped tokens get no gradient; unclipped: d(-A r)/dlogp = -A r, over 4 tokens
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])


def test_clip_higher_widens_the_upper_bound_only():
    old = torch.zeros(2, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0])
    loss, _ = grpo_loss(logp, old, adv, torch.ones(2, 1), clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx((-1.28 + 0.8) / 2)


def test_kl_k3_term():
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), math.log(2.0))
    loss, stats = grpo_loss(logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 2), kl_coef=0.5, ref_logp=ref)
    k3 = 2.0 - math.log(2.0) - 1.0                                     # exp(d) - d - 1 with d = log 2
    assert float(stats["kl"]) == pytest.approx(k3)
    assert float(loss) == pytest.approx(0.5 * k3)
    _, no_kl = grpo_loss(logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 2), kl_coef=0.0, ref_logp=ref)
    assert "kl" not in no_kl


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_add_up_to_the_batch_loss(mode):
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 5, generator=g) * 0.1, torch.randn(4, 5, generator=g) * 0.1
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float)
    full, _ = grpo_loss(logp, old, adv, mask, mode=mode)
    n_tok, n_seq = float(mask.sum()), 4.0
    parts = [grpo_loss(logp[s], old[s], adv[s], mask[s], mode=mode, num_tokens=n_tok, num_seqs=n_seq)[0]
             for s in (slice(0, 1), slice(1, 4))]
    assert float(sum(parts)) == pytest.approx(float(full), abs=1e-7)


def test_unknown_aggregation_mode_is_named():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), mode="sum")
