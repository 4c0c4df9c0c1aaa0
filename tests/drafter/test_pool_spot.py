"""The spot trainer over a rollout pool: an instance with nothing to run trains the drafter one
step at a time, every instance trains between rollouts, and the pool then drafts with one
averaged drafter; outputs are those of plain decoding (float64)."""
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.drafter.network import Drafter
from tailrl.drafter.pool_spot import PoolSpot
from tailrl.drafter.spot_trainer import SpotConfig
from tailrl.model.loader import load_model
from tailrl.rl.online_drafter import spot_on_engine

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
# static placement gives instance 0 the first two prompts (short), instance 1 the long ones:
# instance 0 runs dry early and trains while instance 1 still decodes
PARAMS = [SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=1), SamplingParams(n=2, max_tokens=4, seed=2),
          SamplingParams(n=2, max_tokens=90, ignore_eos=True, seed=3),
          SamplingParams(n=2, top_p=0.8, max_tokens=90, ignore_eos=True, seed=4)]


def tokens(outs):
    return [(list(c.token_ids), c.finish_reason) for o in outs for c in o.outputs]


def test_idle_instances_train_and_the_pool_agrees_on_one_drafter(model, drafter_dir, tmp_path):
    want = tokens(LLM(model, dtype="float64").generate(PROMPTS, PARAMS))
    llm = LLM(model, dtype="float64", instances=2, scheduler="static", pool={"processes": False},
              speculative=SpeculativeConfig(method="drafter", drafter=drafter_dir, min_token_prob=0.0))
    spot_cfg = SpotConfig(threshold=0, min_windows=4, batch=16, unroll=2, lr=1e-3)   # no tail steps: idle only
    spot = PoolSpot(llm.pool, spot_on_engine, (4096, spot_cfg, 0, None))
    for _ in range(2):
        spot.reset_metrics()
        assert tokens(llm.generate(PROMPTS, PARAMS)) == want
        assert llm.last_metrics["pool/idle_train_steps"] > 0          # instance 0 trained while 1 decoded
        assert spot.train(4) >= 2
        m = spot.metrics()
        assert m["drafter/train_steps"] >= llm.last_metrics["pool/idle_train_steps"] + 2
        weights = llm.pool.spot("weights")
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])   # one drafter
        assert all(torch.equal(v, weights[0][k]) for k, v in spot.weights().items())
        drafters = [next(s for s in h.worker.engine.speculator.sources if s.name == "drafter").drafter
                    for h in llm.pool.instances]
        assert all(torch.equal(a, b) for a, b in zip(drafters[0].parameters(), drafters[1].parameters()))
    spot.save(str(tmp_path / "saved"))
    again = Drafter.load(str(tmp_path / "saved"), load_model(model, "float32"))
    assert all(torch.allclose(p, weights[0][k].float()) for k, p in again.named_parameters())
