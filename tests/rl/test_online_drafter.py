"""`drafter: true` in a training run: config keys checked by name, the spot trainer trains
inside the rollout and between rollout and update, the drafter is in every checkpoint and
`--resume` restores it; responses are those of the run without a drafter."""
import copy
import os
import shutil

import pytest
import torch

from tailrl.drafter.network import Drafter
from tailrl.drafter.spot_trainer import STATE_FILE
from tailrl.model.loader import load_model
from tailrl.rl.config import TrainConfig
from tailrl.rl.metrics import read_jsonl
from tailrl.rl.trainer import Trainer

DRAFTER = dict(drafter=True, speculative={"policy": "fixed", "sources": ["self"]}, drafter_size=32,
               drafter_batch=8, drafter_spot_batch=64, drafter_train_steps=3)


def config(tmp_path, name: str, **kw) -> TrainConfig:
    base = dict(model="test", task_family="add", task_difficulty=2, train_size=4, batch_size=2, group_size=4,
                max_tokens=24, total_steps=2, speculative=False, output_dir=str(tmp_path / name),
                progress=False, checkpoint_every=1, num_threads=1, lr=3e-3, log_tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("key,value,match", [
    ("drafter", "yes", "'drafter'"), ("drafter_lr", 0.0, "'drafter_lr'"), ("drafter_buffer", 0, "'drafter_buffer'"),
    ("drafter_batch", 0, "'drafter_batch'"), ("drafter_spot_batch", -1, "'drafter_spot_batch'"),
    ("drafter_train_steps", -2, "'drafter_train_steps'"), ("drafter_size", 0, "'drafter_size'"),
    ("drafter_init", "/nowhere", "'drafter_init'"), ("drafter_eval", 1, "'drafter_eval'"),
    ("drafter_vocab", -1, "'drafter_vocab'"), ("drafter_vocab", 1.5, "'drafter_vocab'")])
def test_bad_drafter_keys_are_named(tmp_path, key, value, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, "bad", **{**DRAFTER, key: value})


def test_drafter_needs_speculation(tmp_path):
    with pytest.raises(ValueError, match="'drafter'.*speculative"):
        config(tmp_path, "a", **{**DRAFTER, "speculative": False})
    with pytest.raises(ValueError, match="'drafter'.*speculative.drafter"):
        config(tmp_path, "c", **{**DRAFTER, "speculative": {"drafter": str(tmp_path)}})
    cfg = config(tmp_path, "d", **DRAFTER)
    assert cfg.speculative_config().method == "suffix"          # validated without the drafter
    assert cfg.speculative_config(str(tmp_path)).method == "hybrid"


def test_online_drafter_trains_checkpoints_and_resumes(tmp_path):
    plain = Trainer(config(tmp_path, "plain", total_steps=2))
    plain.train()
    full = Trainer(config(tmp_path, "full", total_steps=2, **DRAFTER))
    assert full.llm.speculative.method == "hybrid"
    rows = full.train()
    assert all(r["drafter/train_steps"] >= 3 for r in rows[1:]) and rows[-1]["drafter/version"] > 0
    assert sum(r["drafter/spot_steps"] for r in rows) > 0 and rows[-1]["timing_s/spot_train"] >= 0
    assert "rollout/spec_draft_tokens/drafter" in rows[-1]
    # drafts never change responses
    assert read_jsonl(tmp_path / "full" / "rollouts.jsonl") == read_jsonl(tmp_path / "plain" / "rollouts.jsonl")
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002" / "drafter"
    assert (ckpt / STATE_FILE).is_file()
    saved = Drafter.load(str(ckpt), load_model(full.model_dir, "float32"))   # a deployable drafter
    want = full.spot.shadow.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in saved.state_dict().items())
    # resume from step 1 restores that checkpoint's drafter, optimizer and version
    step1 = tmp_path / "full" / "checkpoints" / "step_000001" / "drafter"
    at1 = Drafter.load(str(step1), load_model(full.model_dir, "float32")).state_dict()
    for d in ("step_000002",):
        import shutil
        shutil.rmtree(tmp_path / "full" / "checkpoints" / d)
    resumed = Trainer(config(tmp_path, "full", total_steps=2, **{**DRAFTER, "drafter_lr": 5e-4}), resume=True)
    assert resumed.step == 1 and resumed.spot.version == torch.load(step1 / STATE_FILE)["version"] > 0
    for drafter in (resumed.spot.drafter, resumed.spot.shadow):
        assert all(torch.equal(v, at1[k]) for k, v in drafter.state_dict().items())
    assert len(resumed.spot.optimizer.state) > 0                     # AdamW moments restored
    with pytest.raises(ValueError, match="'drafter'"):
        Trainer(config(tmp_path, "full", total_steps=2), resume=True)   # the drafter key may not change


# The drafter's figures a resumed run must reproduce exactly (timings are not reproducible).
EXACT_DRAFTER_KEYS = ("drafter/train_steps", "drafter/loss", "drafter/agreement", "drafter/version",
                      "drafter/buffer_tokens", "drafter/eval_accept_length", "drafter/eval_verify_steps",
                      "rollout/spec_draft_tokens/drafter", "rollout/spec_accepted_tokens/drafter",
                      "rollout/spec_accept_length/drafter")


def test_resume_continues_the_drafter_exactly(tmp_path):
    """A run resumed at step 2 restores the drafter's training buffer with its weights and
    optimizer, so at steps 3 and 4 its drafter trains on the same data and drafts and accepts
    exactly as the uninterrupted run's: equal losses, buffer, exact acceptance on the step's
    responses (``drafter_eval``) and acceptance of its verified drafts in the rollout; its final
    weights are equal bit for bit. Deterministic by construction: no training inside rollouts
    (whether a spot step fits its share of the rollout's time depends on the clock) and the
    drafter alone with a fixed depth (hybrid's per-request choice is priced by measured times)
    on a float32 engine (a bfloat16 one drafts in whichever copy of the drafter, float32 or
    bfloat16, it measured faster); the buffer is small enough to evict."""
    kw = {**DRAFTER, "speculative": {"method": "drafter", "policy": "fixed"}, "drafter_spot_batch": 0,
          "drafter_eval": True, "drafter_buffer": 400, "dtype": "float32"}
    full = Trainer(config(tmp_path, "run", total_steps=4, **kw))
    rows = full.train()
    assert rows[-1]["drafter/buffer_tokens"] <= 400 < full.spot.buffer.added       # it evicted
    assert all(r["drafter/train_steps"] == 3 and r["rollout/spec_draft_tokens/drafter"] > 0 for r in rows)
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (3, 4):                                   # interrupted after step 2
        shutil.rmtree(ckpts / f"step_{step:06d}")
    resumed = Trainer(config(tmp_path, "run", total_steps=4, **kw), resume=True)
    assert resumed.step == 2 and len(resumed.spot.buffer) > 0
    again = resumed.train()
    assert len(again) == 2
    for want, got in zip(rows[2:], again):
        assert {k: got[k] for k in EXACT_DRAFTER_KEYS} == {k: want[k] for k in EXACT_DRAFTER_KEYS}
    want = full.spot.shadow.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in resumed.spot.shadow.state_dict().items())


def test_online_drafter_on_a_pool_of_worker_processes(tmp_path):
    """Each instance trains in its own worker process; the pool drafts with the averaged drafter,
    which every checkpoint holds; responses are the one-engine run's."""
    plain = Trainer(config(tmp_path, "plain", total_steps=2))
    plain.train()
    tr = Trainer(config(tmp_path, "pool", total_steps=2, instances=2, scheduler="static", **DRAFTER))
    try:
        rows = tr.train()
        pids = {h.pid for h in tr.llm.pool.instances}
        assert len(pids) == 2 and os.getpid() not in pids               # real worker processes
    finally:
        tr.llm.close()
    assert all(r["drafter/train_steps"] >= 3 for r in rows[1:]) and rows[-1]["drafter/version"] > 0
    assert all("pool/idle_train_steps" in r for r in rows)
    assert read_jsonl(tmp_path / "pool" / "rollouts.jsonl") == read_jsonl(tmp_path / "plain" / "rollouts.jsonl")
    ckpt = tmp_path / "pool" / "checkpoints" / "step_000002" / "drafter"
    assert (ckpt / STATE_FILE).is_file()
    frozen = Trainer(config(tmp_path, "pool-frozen", total_steps=1, instances=2, scheduler="static",
                            **{**DRAFTER, "drafter_spot_batch": 0, "drafter_train_steps": 0}))
    try:                                          # never trained: no idle-instance training either
        rows = frozen.train()
        assert not frozen.llm.pool.idle_training
    finally:
        frozen.llm.close()
    assert rows[-1]["pool/idle_train_steps"] == 0 and rows[-1]["drafter/version"] == 0


def test_a_drafter_that_is_never_trained_collects_nothing(tmp_path):
    """No spot training and no steps between rollout and update: no buffer collects hidden
    states (the engine hands them out only where drafter calls pay)."""
    frozen = Trainer(config(tmp_path, "frozen", total_steps=1, **{**DRAFTER, "drafter_spot_batch": 0,
                                                                 "drafter_train_steps": 0}))
    assert frozen.llm.engine.speculator.collector is None
    rows = frozen.train()
    assert rows[-1]["drafter/version"] == 0 and len(frozen.spot.buffer) == 0
    trained = Trainer(config(tmp_path, "trained", total_steps=1, **DRAFTER))
    assert trained.llm.engine.speculator.collector is trained.spot.buffer


def test_drafter_eval_measures_the_drafter_each_rollout_started_with(tmp_path):
    """``drafter_eval``: per step, the exact acceptance of the drafter the rollout started with
    on the step's responses, under the policy that sampled them (recomputed here from the
    weights and policy taken before the step); no metric without the key."""
    from tailrl.drafter.evaluate import on_policy, step_acceptance
    tr = Trainer(config(tmp_path, "eval", total_steps=2, drafter_eval=True, **DRAFTER))
    kept = {}
    rollout = tr.rollout
    tr.rollout = lambda step, batch: kept.setdefault(step, rollout(step, batch))
    for step in range(2):
        weights, policy = tr.spot.weights(), copy.deepcopy(tr.policy)
        m = tr.train_step()
        ids, groups, _ = kept[step]
        drafter = on_policy(tr.drafter_eval.cfg, weights, policy)
        want = step_acceptance(drafter, policy, ids, groups, tr.llm.speculative.max_draft_tokens)
        assert (m["drafter/eval_accept_length"], m["drafter/eval_verify_steps"]) == (want[0], float(want[1]))
        assert m["drafter/eval_verify_steps"] > 0 and 1.0 <= m["drafter/eval_accept_length"] <= 7.0
    assert tr.spot.version > 0                    # the second step's drafter is another one
    tr.logger.close()
    plain = Trainer(config(tmp_path, "no-eval", total_steps=1, **DRAFTER))
    assert plain.drafter_eval is None and "drafter/eval_accept_length" not in plain.train_step()


def test_a_fresh_drafter_covers_the_runs_prompts_answers_and_end_of_sequence(tmp_path):
    """``drafter_vocab``: a fresh drafter's head covers that many tokens, the run's prompts' and
    answers' among them and the model's end-of-sequence ids; the step's exact evaluation reads
    the same vocabulary. Not with a warm start (which has its own)."""
    tr = Trainer(config(tmp_path, "v", total_steps=1, drafter_vocab=40, drafter_eval=True, **DRAFTER))
    vocab = tr.spot.drafter.vocab
    assert len(vocab) == 40 and tr.spot.drafter.cfg.draft_vocab == 40
    assert set(tr._data_tokens()) <= set(vocab.tolist())
    assert set(load_model(tr.model_dir).args.eos_token_ids) <= set(vocab.tolist())
    assert torch.equal(tr.drafter_eval.vocab, vocab)
    m = tr.train_step()
    assert m["drafter/eval_verify_steps"] > 0
    with pytest.raises(ValueError, match="'drafter_vocab'"):
        config(tmp_path, "w", **{**DRAFTER, "drafter_size": None, "drafter_init": str(tmp_path / "v" / "drafter_init"),
                                 "drafter_vocab": 40})
