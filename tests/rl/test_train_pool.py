"""GRPO on a rollout pool: the same training run as on one engine (weights reach every
instance after each update; the history policy reads the lengths generate recorded)."""
from test_train import EXACT_KEYS, brevity_reward, tiny_config

from tailrl.rl.trainer import Trainer


def test_pool_trains_exactly_like_one_engine(tmp_path):
    kw = dict(dtype="float64", total_steps=3, save_rollouts=False, checkpoint_every=0)
    plain = Trainer(tiny_config(tmp_path, "plain", **kw), reward_fn=brevity_reward).train()
    tr = Trainer(tiny_config(tmp_path, "pool", instances=2, scheduler="history", chunk_tokens=16, **kw),
                 reward_fn=brevity_reward)
    try:
        pooled = tr.train()
        assert tr.llm.pool is not None and len(tr.llm.pool.alive) == 2
        assert all(r["pool/instances"] == 2 for r in pooled)
    finally:
        tr.llm.close()
    for a, b in zip(plain, pooled):
        assert {k: a[k] for k in EXACT_KEYS} == {k: b[k] for k in EXACT_KEYS}
