"""GRPO: group-normalised advantages and the clipped policy-gradient loss.

The objective (Shao et al. 2024, DeepSeekMath) for a group of G responses o_i to a prompt q:
    A_i = (r_i - mean(r)) / std(r)
    L = -E_t[ min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i) ] + beta KL(pi || pi_ref)
with rho_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t).

Departures from the paper, each a setting:
- Loss aggregation is token-level by default (DAPO, verl ``token-mean``): the per-token
  losses of the whole batch are summed and divided by the number of response tokens, so
  long responses weigh by their length. ``seq-mean-token-mean`` is the paper's per-response
  mean, then the mean over responses.
- The clip range may be asymmetric: [1 - clip_ratio_low, 1 + clip_ratio_high] (DAPO
  clip-higher); the default is symmetric 0.2.
- pi_old is the behaviour policy's log-probabilities as the rollout engine reported them
  (``old_logprobs: engine``), and the current policy's log-probabilities are computed with the
  engine's own kernels (``exact_logprobs``, tailrl/engine/score.py; the gradient comes from the
  Hugging Face policy's forward): in bfloat16 the two are equal bit for bit before the first
  optimizer step, so the first ratio is exactly 1 (``actor/first_ratio_dev``) and
  ``actor/rollout_logprob_diff`` is 0, with no second forward for pi_old. ``old_logprobs:
  recompute`` takes pi_old from the trainer's policy before the update instead (verl).
- The KL term is off by default (DAPO, Dr. GRPO); when on it uses the k3 estimator
  exp(ref - logp) - (ref - logp) - 1 per token, added to the loss as in the paper (not to
  the reward).
- ``norm_adv_by_std=False`` drops the division by std (Dr. GRPO). std is the unbiased
  sample std (as torch, TRL and verl compute it), plus eps = 1e-6.
- One optimizer step per rollout batch by default (``ppo_minibatches=1``, fully on-policy
  as in nanochat): the ratio is then 1 and the clip only acts with ``ppo_minibatches > 1``.
  The paper's multiple GRPO iterations per batch are not used.
- The current policy's log-probabilities use logits / temperature, the distribution the
  responses were sampled from (verl does the same); top-k / top-p truncation is ignored.
"""
from __future__ import annotations

import torch

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True) -> torch.Tensor:
    """[B * G] rewards, groups contiguous -> [B * G] advantages, one per response."""
    r = rewards.reshape(-1, group_size).to(torch.float64)               # [B, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + EPS)                  # unbiased std; all-equal group -> 0
    return adv.reshape(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float, num_seqs: float
              ) -> torch.Tensor:
    """Sum of this micro-batch's share of the batch loss. ``num_tokens``/``num_seqs`` are the
    whole batch's counts, so micro-batch losses add up to the full-batch loss exactly."""
    if mode == "token-mean":
        return (per_token * mask).sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / num_seqs
    raise ValueError(f"loss_agg_mode must be 'token-mean' or 'seq-mean-token-mean', got {mode!r}")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
              ref_logp: torch.Tensor | None = None, mode: str = "token-mean",
              num_tokens: float | None = None, num_seqs: float | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO loss of a (micro-)batch. logp/old_logp/ref_logp/mask: [B, T] over response
    tokens (mask 1 = real token); advantages: [B]. Returns (loss, detached statistics)."""
    num_tokens = float(mask.sum()) if num_tokens is None else num_tokens
    num_seqs = float(mask.shape[0]) if num_seqs is None else num_seqs
    adv = advantages[:, None].to(logp.dtype)                            # [B, 1]: one advantage per response
    ratio = torch.exp(logp - old_logp)                                  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)                       # pessimistic bound
    stats = {"pg_loss": aggregate(per_token, mask, mode, num_tokens, num_seqs).detach(),
             "clip_frac": ((clipped > unclipped).to(mask.dtype) * mask).sum().detach() / num_tokens}
    if kl_coef > 0 and ref_logp is not None:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1                               # k3: >= 0, unbiased for KL(pi || ref)
        stats["kl"] = aggregate(kl, mask, mode, num_tokens, num_seqs).detach()
        per_token = per_token + kl_coef * kl
    return aggregate(per_token, mask, mode, num_tokens, num_seqs), stats
