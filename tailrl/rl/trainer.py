"""The GRPO training loop: engine rollouts, rewards, one torch update, weights back to the engine.

One step: sample G responses for each of B prompts with the rollout engine (speculation on
or off; the responses are the same either way, since the sampling noise is keyed by (run
seed, step, prompt id, sample, position)), score them, compute group advantages, update the
Hugging Face policy, and push its weights into the engine in place. The engine's history
store (previous epoch's responses per prompt id, what history drafts read) is updated by
every ``generate`` and saved with each checkpoint.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tailrl import LLM, SamplingParams
from tailrl.config import require_device
from tailrl.drafter.evaluate import StepEvaluator
from tailrl.engine.score import Scorer
from tailrl.rl import checkpoint as ckpt
from tailrl.rl import online_drafter
from tailrl.rl.config import RESUMABLE_CHANGES, TrainConfig
from tailrl.rl.data import Prompt, RewardFn, batch_indices, compute_rewards, load_dataset, resolve_reward
from tailrl.rl.grpo import group_advantages, grpo_loss
from tailrl.rl.metrics import MetricsLogger, console_line
from tailrl.rl.policy import frozen_copy, hf_state_dict, load_policy, resolve_autocast, response_logprobs, with_values
from tailrl.threads import use_threads

log = logging.getLogger(__name__)


LOGPROB_CHECK_ROWS = 4     # responses per step scored by the engine's kernels to check exactness


def prompt_seed(run_seed: int, step: int, uid: str) -> int:
    """Per-prompt sampling seed: a pure function of (run seed, step, prompt id)."""
    digest = hashlib.sha256(f"{run_seed}/{step}/{uid}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def resolve_model(name: str) -> str:
    """A checkpoint directory for ``name``: a directory, or a preset ("test" builds on first
    use; "small" must have been shipped or built, since building it takes hours here)."""
    if Path(name).is_dir():
        return name
    from tailrl.tasks import models
    from tailrl.tasks.presets import PRESETS
    if name not in PRESETS:
        raise ValueError(f"config key 'model': {name!r} is neither a directory nor a preset {sorted(PRESETS)}")
    if name == "small":
        path = models.shipped_model("small") or models.cached_model_path(PRESETS["small"])
        if not models.is_complete(Path(path)):
            raise ValueError("config key 'model': the 'small' model is not available yet (not shipped in "
                             "models/small, not in the cache); build it with `tailrl make-model --preset small` "
                             "or use `model: test` / a checkpoint directory")
        return str(path)
    return models.get_model(name)


def pad_rows(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """Per-token values of each row, zero-padded to ``like``'s [B, R] shape, dtype and device
    (built on the host, copied once)."""
    out = torch.zeros(like.shape, dtype=like.dtype)
    for k, row in enumerate(rows):
        out[k, : len(row)] = torch.tensor(row, dtype=like.dtype)
    return out.to(like.device)


def encode_prompt(tok: Any, p: Prompt) -> list[int]:
    """A prompt's token ids for the rollout: chat messages through the tokenizer's template."""
    if isinstance(p.text, list) and getattr(tok, "chat_template", None):
        out = tok.apply_chat_template(p.text, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)   # transformers 5 returns a dict
    text = p.text if isinstance(p.text, str) else "\n".join(m["content"] for m in p.text)
    return tok.encode(text)          # the tokenizer's special tokens (e.g. <bos>) as in pretraining


class Trainer:
    def __init__(self, cfg: TrainConfig, reward_fn: RewardFn | None = None, resume: bool = False):
        self.cfg = cfg
        require_device(cfg.device)                               # before any work
        # a fixed thread count, or threads sized to the cores other processes leave free
        self.threads = use_threads(cfg.num_threads, cfg.dtype)   # the engine's dtype
        self.prompts: list[Prompt] = load_dataset(cfg)          # config and data errors before heavy work
        self.reward_fn = reward_fn or resolve_reward(cfg)
        self.model_dir = resolve_model(cfg.model)
        self.step = 0
        start_dir = ckpt.latest_checkpoint(cfg.output_dir) if resume else None
        if resume and start_dir is None:
            raise ValueError(f"--resume: no checkpoint under {Path(cfg.output_dir) / 'checkpoints'}")
        self.policy = load_policy(str(start_dir or self.model_dir), cfg.train_dtype).to(cfg.device)
        self.ref = frozen_copy(self.policy) if cfg.kl_coef > 0 else None
        self.autocast = resolve_autocast(cfg.autocast, cfg.device)   # "auto": where bfloat16 is native
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        # a pool when configured: weights go to every instance after each update (load_weights),
        # and the history policy reads the lengths that each generate records in llm.history
        drafter_dir = (online_drafter.drafter_dir(cfg, self.model_dir, start_dir, self._data_tokens)
                       if cfg.drafter else None)
        spec = cfg.speculative_config(drafter_dir)
        self.llm = LLM(model=self.model_dir, speculative=spec, dtype=cfg.dtype, seed=cfg.seed,
                       pool=cfg.pool_config(), num_threads=cfg.num_threads, device=cfg.device,
                       gpu_memory_utilization=cfg.gpu_memory_utilization)
        # the learned drafter, trained online on the rollout's hidden states (None: off)
        self.spot = online_drafter.attach(self.llm, cfg, start_dir) if cfg.drafter else None
        self.drafter_eval = (StepEvaluator(drafter_dir, spec.max_draft_tokens)
                             if cfg.drafter and cfg.drafter_eval else None)
        # the update's log-probability values from the engine's kernels (the rollout's, bit for bit)
        self.scorer = Scorer(self.model_dir, cfg.dtype, cfg.device) if cfg.exact_logprobs else None
        self._exact_s = 0.0                  # the scorer's seconds in the current update
        if self.llm.tokenizer is None:
            raise ValueError(f"config key 'model': {self.model_dir} has no tokenizer files")
        self.pad_id = self.llm.tokenizer.pad_token_id or 0
        if start_dir is not None:
            self._resume_from(start_dir)
        else:
            torch.manual_seed(cfg.seed)
            stale = Path(cfg.output_dir) / "checkpoints"
            if stale.is_dir():   # a fresh run must never be resumed from an older run's checkpoints
                log.warning("fresh run: removing the old checkpoints in %s", stale)
                shutil.rmtree(stale)
        self.logger = MetricsLogger(cfg.output_dir, cfg.log_tensorboard, resume_step=self.step if resume else None)

    def sync_weights(self) -> None:
        """The policy's weights to the rollout engines (and the scorer)."""
        sd = hf_state_dict(self.policy)
        self.llm.load_weights(sd)
        if self.scorer is not None:
            self.scorer.load_weights(sd)

    def _resume_from(self, path: Path) -> None:
        state = ckpt.load_state(path)
        if self.ref is not None:   # the reference is the run's initial model, not the checkpoint
            self.ref.load_state_dict(load_policy(self.model_dir, self.cfg.train_dtype).state_dict())
        saved, now = state["config"], self.cfg.to_dict()
        changed = sorted(k for k in now if k not in RESUMABLE_CHANGES and saved.get(k) != now[k])
        if changed:
            raise ValueError(f"--resume: config key {changed[0]!r} differs from the run's ({saved.get(changed[0])!r} "
                             f"-> {now[changed[0]]!r}); only {RESUMABLE_CHANGES} may change")
        ckpt.restore(path, self.optimizer, self.llm.history)
        self.sync_weights()
        self.step = state["step"]
        log.info("resumed from %s at step %d", path, self.step)

    def _data_tokens(self) -> list[int]:
        """Every token of the run's prompts (as encoded for the rollout) and their answers."""
        from tailrl.engine.inputs import load_tokenizer
        tok = load_tokenizer(self.model_dir)
        if tok is None:
            return []
        return [t for p in self.prompts for t in encode_prompt(tok, p) + tok.encode(str(p.answer))]

    # ---- one step ---------------------------------------------------------------------------
    def encode(self, p: Prompt) -> list[int]:
        return encode_prompt(self.llm.tokenizer, p)

    def rollout(self, step: int, batch: list[Prompt]) -> tuple[list[list[int]], list[list[list[int]]], list[list[list[float]]]]:
        cfg = self.cfg
        ids = [self.encode(p) for p in batch]
        params = [SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 max_tokens=cfg.max_tokens, seed=prompt_seed(cfg.seed, step, p.uid),
                                 repetition_penalty=cfg.repetition_penalty, min_p=cfg.min_p) for p in batch]
        outs = self.llm.generate(ids, params, prompt_ids=[p.uid for p in batch], use_tqdm=cfg.progress)
        return (ids, [[list(c.token_ids) for c in o.outputs] for o in outs],
                [[list(c.logprobs) for c in o.outputs] for o in outs])

    def micro_batches(self, rows: list[int], lengths: list[int]) -> list[list[int]]:
        """Rows grouped by length so that rows x longest row <= micro_batch_tokens: padding
        is small, and the loss is the same (micro-batch losses add up to the batch loss)."""
        out: list[list[int]] = []
        for i in sorted(rows, key=lambda i: lengths[i]):
            if out and (len(out[-1]) + 1) * lengths[i] <= self.cfg.micro_batch_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                 exact: list[list[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probabilities of the responses [B, R] with their mask. With
        ``exact_logprobs`` their values are the engine kernels' (``exact``, or ``self.scorer``'s
        now: bit for bit what the rollout reported in bfloat16) and their gradient the policy's
        own forward's."""
        cfg = self.cfg
        logp, mask = response_logprobs(self.policy, prompts, responses, cfg.temperature, self.pad_id, self.autocast)
        if self.scorer is None:
            return logp, mask
        if exact is None:
            exact = self.exact_logprobs(prompts, responses)
        return with_values(logp, pad_rows(exact, logp)), mask

    def exact_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """The engine kernels' log-probabilities of the responses under the scorer's weights."""
        t = time.perf_counter()
        out = self.scorer.logprobs(prompts, responses, self.cfg.temperature)
        self._exact_s += time.perf_counter() - t
        return out

    def update(self, prompts: list[list[int]], responses: list[list[int]], old_logp: list[list[float]],
               adv: torch.Tensor) -> dict[str, float]:
        """ppo_minibatches optimizer steps over the rollout batch."""
        cfg = self.cfg
        n = len(responses)
        per_mb = n // cfg.ppo_minibatches
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        sums: dict[str, float] = {}
        clock = {"old_log_prob": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._exact_s = 0.0                             # the scorer's share of the forwards
        recompute = cfg.old_logprobs == "recompute"
        before: list[list[float]] | None = None
        if recompute and cfg.ppo_minibatches > 1:       # pi_old = the policy before this batch's first step
            t = time.perf_counter()
            before = self._old_logprobs(prompts, responses, lengths, old_logp)
            clock["old_log_prob"] += time.perf_counter() - t
        self.policy.train()
        for lo in range(0, n, per_mb):
            rows = list(range(lo, lo + per_mb))
            num_tokens = float(max(sum(len(responses[i]) for i in rows), 1))
            self.optimizer.zero_grad(set_to_none=True)
            t = time.perf_counter()
            exact, diff = self._exact_values(lo == 0, rows, prompts, responses, old_logp)
            clock["forward"] += time.perf_counter() - t
            if diff is not None:
                sums["rollout_logprob_diff"] = diff
            for mb in self.micro_batches(rows, lengths):
                if self.threads is not None:
                    self.threads.tick()
                t = time.perf_counter()
                p, r = [prompts[i] for i in mb], [responses[i] for i in mb]   # the engine emits >= 1 token
                logp, mask = self.logprobs(p, r, None if exact is None else [exact[i] for i in mb])
                engine = pad_rows([old_logp[i] for i in mb], logp)
                old = self._pi_old(mb, logp, engine, before)
                if lo == 0:   # before any step of this batch: how far the engine's logprobs are from ours
                    if exact is None:
                        sums["rollout_logprob_diff"] = sums.get("rollout_logprob_diff", 0.0) + float(
                            ((logp.detach() - engine).abs() * mask).sum()) / num_tokens
                    dev = float(((torch.exp(logp.detach() - old) - 1).abs() * mask).max())
                    sums["first_ratio_dev"] = max(sums.get("first_ratio_dev", 0.0), dev)
                loss, stats = grpo_loss(logp, old, adv[mb], mask, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                        cfg.kl_coef, self._ref_logprobs(p, r), cfg.loss_agg_mode, num_tokens,
                                        float(per_mb))
                t1 = time.perf_counter()
                loss.backward()
                clock["forward"] += t1 - t
                clock["backward"] += time.perf_counter() - t1
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v) / cfg.ppo_minibatches
            t = time.perf_counter()
            if cfg.max_grad_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm) / cfg.ppo_minibatches
            self.optimizer.step()
            clock["optimizer"] += time.perf_counter() - t
        out = {f"actor/{k}": v for k, v in sums.items()}
        out["timing_s/old_log_prob"] = clock.pop("old_log_prob")
        out.update({f"timing_s/update_{k}": v for k, v in clock.items()})
        out["timing_s/update_exact"] = self._exact_s
        return out

    def _pi_old(self, mb: list[int], logp: torch.Tensor, engine: torch.Tensor,
                before: list[list[float]] | None) -> torch.Tensor:
        """pi_old of a micro-batch's tokens: recomputed before the batch's first step, or (one
        update per batch) the current policy detached, so the update depends on the responses
        only; else the rollout's (``engine``)."""
        if before is not None:
            return pad_rows([before[i] for i in mb], logp)
        return logp.detach() if self.cfg.old_logprobs == "recompute" else engine

    def _ref_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor | None:
        """The frozen reference's log-probabilities (the KL term), None without one."""
        if self.ref is None:
            return None
        with torch.no_grad():
            return response_logprobs(self.ref, prompts, responses, self.cfg.temperature, self.pad_id,
                                     self.autocast)[0]

    def _exact_values(self, first: bool, rows: list[int], prompts: list[list[int]], responses: list[list[int]],
                      old_logp: list[list[float]]) -> tuple[dict[int, list[float]] | None, float | None]:
        """With ``exact_logprobs``, the engine kernels' values of a minibatch's rows, and before
        the batch's first optimizer step the check that they are the rollout's. Then the
        policy still has the weights that sampled the batch, so the rollout's log-probabilities
        are its values bit for bit (``tests/engine/test_score.py``): they are used as they are,
        and ``LOGPROB_CHECK_ROWS`` rows are scored anew to measure ``rollout_logprob_diff``
        (0 in bfloat16). After a step the scorer scores the new weights."""
        if self.scorer is None:
            return None, None
        take = lambda idx: ([prompts[i] for i in idx], [responses[i] for i in idx])   # noqa: E731
        if not first:
            self.scorer.load_weights(hf_state_dict(self.policy))
            return dict(zip(rows, self.exact_logprobs(*take(rows)))), None
        check = rows[:LOGPROB_CHECK_ROWS]
        got = self.exact_logprobs(*take(check))
        gap = sum(abs(a - b) for i, g in zip(check, got) for a, b in zip(g, old_logp[i]))
        return {i: old_logp[i] for i in rows}, gap / max(sum(len(responses[i]) for i in check), 1)

    def _old_logprobs(self, prompts: list[list[int]], responses: list[list[int]], lengths: list[int],
                      old_logp: list[list[float]]) -> list[list[float]]:
        """pi_old before the batch's first optimizer step: with ``exact_logprobs`` the rollout's
        own log-probabilities (the policy still has the weights that sampled the batch, and the
        engine's kernels are what the update's values come from: nothing to recompute), else a
        policy forward."""
        cfg = self.cfg
        if self.scorer is not None:
            return old_logp
        before: list[list[float]] = [[] for _ in responses]
        with torch.no_grad():
            for mb in self.micro_batches(list(range(len(responses))), lengths):
                lp, _ = response_logprobs(self.policy, [prompts[i] for i in mb], [responses[i] for i in mb],
                                          cfg.temperature, self.pad_id, self.autocast)
                for k, i in enumerate(mb):
                    before[i] = lp[k, : len(responses[i])].tolist()
        return before

    def train_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        batch = [self.prompts[i] for i in batch_indices(step, cfg.batch_size, len(self.prompts), cfg.seed, cfg.shuffle)]
        if self.spot is not None:
            self.spot.reset_metrics()
        start = self.spot.weights() if self.drafter_eval is not None else None    # the drafter it drafts with
        prompt_ids, groups, logps = self.rollout(step, batch)
        m = {k: float(v) for k, v in self.llm.last_metrics.items()}
        if start is not None:              # before the update: the policy that sampled them
            m.update(self.drafter_eval.measure(start, self.policy, prompt_ids, groups))
        t1 = time.perf_counter()
        texts = [[self.llm.tokenizer.decode(r, skip_special_tokens=True) for r in g] for g in groups]
        rewards = compute_rewards(self.reward_fn, batch, texts)
        t2 = time.perf_counter()
        if self.spot is not None:                   # between rollout and update (TLT)
            self.spot.train(cfg.drafter_train_steps)
            m.update(self.spot.metrics())
        t2u = time.perf_counter()
        G = cfg.group_size
        adv = group_advantages(torch.tensor(rewards), G, cfg.norm_adv_by_std).to(cfg.device)   # the update's device
        flat_prompts = [p for p in prompt_ids for _ in range(G)]
        flat_resp = [r for g in groups for r in g]
        m.update(self.update(flat_prompts, flat_resp, [lp for g in logps for lp in g], adv))
        t3 = time.perf_counter()
        self.sync_weights()
        t4 = time.perf_counter()
        self.step += 1
        r = torch.tensor(rewards, dtype=torch.float64)
        solved = r.reshape(-1, G).max(dim=1).values
        mixed = (r.reshape(-1, G).std(dim=1) > 0).double()
        tokens = sum(map(len, flat_resp)) + sum(len(p) for p in flat_prompts)
        m.update({"critic/score/mean": float(r.mean()), "critic/score/max": float(r.max()),
                  "critic/score/min": float(r.min()), "critic/pass_at_group": float(solved.mean()),
                  "critic/mixed_groups": float(mixed.mean()),
                  "critic/advantages/mean": float(adv.mean()), "critic/advantages/max": float(adv.max()),
                  "critic/advantages/min": float(adv.min()),
                  "timing_s/reward": t2 - t1, "timing_s/update": t3 - t2u, "timing_s/sync_weights": t4 - t3,
                  "timing_s/step": t4 - t0, "perf/throughput": tokens / max(t4 - t0, 1e-9),
                  "training/epoch": step * cfg.batch_size / len(self.prompts)})
        self.logger.log(self.step, m)
        if cfg.save_rollouts:
            self.logger.log_rollouts(self.step, [p.uid for p in batch], groups, rewards)
        return m

    def save(self) -> Path:
        state = {"data_cursor": self.step * self.cfg.batch_size, "config": self.cfg.to_dict()}
        return ckpt.save_checkpoint(self.cfg.output_dir, self.step, self.policy, self.llm.tokenizer,
                                    self.optimizer, self.llm.history, state, drafter=self.spot)

    def train(self, log_fn=None) -> list[dict[str, float]]:
        """Run to ``total_steps``; ``log_fn(line)`` receives the console line of each step."""
        cfg = self.cfg
        rows = []
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train", unit="step", disable=not cfg.progress)
        try:
            while self.step < cfg.total_steps:
                m = self.train_step()
                rows.append(m)
                bar.update(1)
                line = console_line(self.step, cfg.total_steps, m)
                (log_fn or log.info)(line)
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or self.step == cfg.total_steps:
                    self.save()
        finally:
            bar.close()
            self.logger.close()
        return rows
