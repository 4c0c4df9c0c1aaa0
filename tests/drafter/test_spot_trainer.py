"""The spot trainer: trains a shadow of the drafter inside the rollout's tail, one step at a
time between engine steps; publishes versions only at step boundaries; outputs are identical
with training on and off (float64; drafts are verified)."""
import time

import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.drafter.spot_trainer import SpotConfig, SpotTrainer
from tailrl.speculative.sources import drafter_source as source_module

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=3, max_tokens=40, seed=1), SamplingParams(n=2, temperature=0, max_tokens=30),
          SamplingParams(n=3, top_k=5, temperature=0.7, max_tokens=50, seed=2),
          SamplingParams(n=2, top_p=0.8, max_tokens=40, ignore_eos=True)]


def spot_llm(model, drafter_dir, method="drafter", **spot) -> tuple[LLM, SpotTrainer]:
    llm = LLM(model, dtype="float64", speculative=SpeculativeConfig(policy="fixed", method=method, drafter=drafter_dir,
                                                                    min_token_prob=0.0))
    src = next(s for s in llm.engine.speculator.sources if s.name == "drafter")
    llm.engine.speculator.choice.always = True                 # the trained drafts are verified, whatever they cost
    cfg = dict(threshold=1000, min_windows=8, batch=16, unroll=2, max_share=1.0, lr=1e-3)
    cfg.update(spot)
    trainer = SpotTrainer(src.drafter, DrafterBuffer(4096), SpotConfig(**cfg))
    llm.engine.speculator.collector = trainer.buffer
    llm.engine.idle_work = trainer
    return llm, trainer


def outputs(outs):
    """Tokens and finish reasons (logprobs agree to float64 rounding, not bit for bit, when a
    token was verified in a larger forward)."""
    return [(list(c.token_ids), c.finish_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("method", ["drafter", "hybrid"])
def test_outputs_identical_with_spot_training_on_and_off_float64(model, drafter_dir, method):
    plain = LLM(model, dtype="float64")
    frozen = LLM(model, dtype="float64", speculative=SpeculativeConfig(policy="fixed", method=method, drafter=drafter_dir,
                                                                       min_token_prob=0.0))
    llm, trainer = spot_llm(model, drafter_dir, method)
    for _ in range(2):
        base = plain.generate(PROMPTS, PARAMS)
        want = outputs(base)
        assert outputs(frozen.generate(PROMPTS, PARAMS)) == want
        trained = llm.generate(PROMPTS, PARAMS)
        assert outputs(trained) == want
        lp = [(a, b) for o, p in zip(base, trained) for c, d in zip(o.outputs, p.outputs)
              for a, b in zip(c.logprobs, d.logprobs)]
        assert max(abs(a - b) for a, b in lp) < 1e-9
    assert trainer.version > 0 and trainer.metrics()["drafter/spot_steps"] > 0
    assert llm.last_metrics["rollout/spec_draft_tokens/drafter"] > 0


def test_versions_change_only_between_steps_and_a_step_waits_for_one_training_step(monkeypatch, model, drafter_dir):
    llm, trainer = spot_llm(model, drafter_dir)
    engine, drafter = llm.engine, trainer.drafter
    seen: list[tuple[int, int, float]] = []           # (engine step, version, weight checksum) per drafter depth
    step_no = [0]
    trained: list[int] = []                            # training steps run after each engine step
    inner_step, inner_draft, inner_paged = engine.step, drafter.step, source_module.paged_step

    def draft_step(*a):
        seen.append((step_no[0], trainer.version, float(drafter.fc.weight.sum())))
        return inner_draft(*a)

    def paged_step(d, *a):                             # chains: a depth on the engine's kernels
        assert d is drafter
        seen.append((step_no[0], trainer.version, float(drafter.fc.weight.sum())))
        return inner_paged(d, *a)
    monkeypatch.setattr(source_module, "paged_step", paged_step)

    def engine_step():
        before = trainer.steps
        out = inner_step()
        trained.append(trainer.steps - before)
        step_no[0] += 1
        return out

    drafter.step, engine.step = draft_step, engine_step
    llm.generate(PROMPTS, PARAMS)
    assert max(trained) == 1 and sum(trained) > 5      # never more than one drafter step per engine step
    per_step: dict[int, set] = {}
    for s, v, w in seen:
        per_step.setdefault(s, set()).add((v, w))
    assert all(len(vw) == 1 for vw in per_step.values())     # one version, whole weights, per step
    versions = [next(iter(vw))[0] for _, vw in sorted(per_step.items())]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    by_version: dict[int, set] = {}
    for _, v, w in seen:
        by_version.setdefault(v, set()).add(w)
    assert all(len(ws) == 1 for ws in by_version.values())   # a version's weights never change


def test_the_engine_drafter_changes_only_on_publish(model, drafter_dir):
    llm, trainer = spot_llm(model, drafter_dir, threshold=0, publish_every=3)
    llm.generate(PROMPTS, PARAMS)                       # threshold 0: no training inside the rollout
    assert trainer.steps == 0 and len(trainer.buffer) > 0
    served = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    for _ in range(2):
        assert trainer.train_step()
        assert all(torch.equal(served[k], v) for k, v in trainer.drafter.state_dict().items())
    assert trainer.train_step() and trainer.version == 1
    assert all(torch.equal(trainer.shadow.state_dict()[k], v) for k, v in trainer.drafter.state_dict().items())
    assert trainer.train(2) == 2 and trainer.version == 2      # train() publishes its last steps
    assert trainer.shadow.head is trainer.drafter.head         # the frozen target head is shared


def test_the_spot_trainer_learns_and_waits_for_data(model, drafter_dir):
    llm, trainer = spot_llm(model, drafter_dir, threshold=0, min_windows=10**6)
    llm.generate(PROMPTS, PARAMS)
    assert trainer.train(5) == 0 and trainer.version == 0      # not enough windows yet
    trainer.config.min_windows = 8
    trainer.train(1)
    first = trainer.metrics()["drafter/loss"]
    trainer.reset_metrics()
    trainer.train(60)
    m = trainer.metrics()
    assert m["drafter/train_steps"] == 60 and m["drafter/loss"] < first


def test_spot_training_stays_within_its_share_of_the_rollout(model, drafter_dir):
    llm, trainer = spot_llm(model, drafter_dir, max_share=0.2)
    llm.generate(PROMPTS, PARAMS)                       # fills the buffer (and trains a little)
    trainer.reset_metrics()
    t0 = time.perf_counter()
    llm.generate(PROMPTS, PARAMS)
    elapsed = time.perf_counter() - t0
    m = trainer.metrics()
    assert m["drafter/spot_steps"] >= 1
    # a step is taken when the previous step's time still fits: the overshoot is one step's jitter
    one_step = m["timing_s/spot_train"] / m["drafter/spot_steps"]
    assert m["timing_s/spot_train"] <= 0.2 * elapsed + one_step + 0.01
    # the longest wait a rollout step had for training: one step, at least the mean one
    assert one_step <= m["timing_s/spot_step_max"] <= m["timing_s/spot_train"]


@pytest.mark.parametrize("key,value", [("lr", 0.0), ("max_share", 0.0), ("max_share", 1.5), ("batch", 0), ("unroll", 0), ("threshold", -1),
                                       ("min_windows", 0), ("publish_every", 0)])
def test_spot_config_names_the_bad_key(key, value):
    with pytest.raises(ValueError, match=key):
        SpotConfig(**{key: value})
