"""A learned drafter in an engine that launches its bulk's plain steps ahead
(``SpeculativeConfig.ahead_above``), its tail always speculating (``tail="speculate"``; the
measured tail with a drafter: tests/speculative/test_drafter_source.py): the bulk's steps hand
out their hidden states as they settle (engine/ahead.py ``HandOut``), so the drafter drafts in
the tail from pasts that begin with the prompts. Outputs are plain decoding's."""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine import engine as engine_mod

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])   # on a GPU: its graphs and copies

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=3, max_tokens=40, seed=1), SamplingParams(n=2, temperature=0, max_tokens=30),
          SamplingParams(n=2, top_p=0.8, max_tokens=40, ignore_eos=True), SamplingParams(n=2, max_tokens=24)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_drafter_drafts_in_the_tail_after_steps_launched_ahead(model, drafter_dir, monkeypatch, device):
    kw = dict(dtype="bfloat16", max_num_seqs=64, device=device, kv_cache_gib=0.25)
    plain = LLM(model, **kw)
    spec = LLM(model, async_scheduling=True, speculative=SpeculativeConfig(
        policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0, ahead_above=8,
        tail="speculate"), **kw)
    spec.engine.speculator.choice.always = True
    assert spec.engine.tail is None
    past = spec.engine.speculator.sources[0].past
    starts: dict[str, int] = {}
    inner = past.add_spans

    def recording(hidden, spans):
        for req, start, _, _ in spans:
            starts.setdefault(req.request_id, start)
        return inner(hidden, spans)
    past.add_spans = recording
    launched = [0]
    step_ahead = engine_mod.LLMEngine._step_ahead

    def counting(self, *args, **kwargs):
        launched[0] += 1
        return step_ahead(self, *args, **kwargs)
    monkeypatch.setattr(engine_mod.LLMEngine, "_step_ahead", counting)
    for _ in range(2):
        want = [(list(c.token_ids), c.finish_reason) for o in plain.generate(PROMPTS, PARAMS) for c in o.outputs]
        got = [(list(c.token_ids), c.finish_reason) for o in spec.generate(PROMPTS, PARAMS) for c in o.outputs]
        assert got == want
        assert spec.last_metrics["rollout/spec_drafter_calls"] > 0      # it drafted in the tail
    assert launched[0] > 20                                             # after steps launched ahead
    assert min(starts.values()) == 0                                    # handed out from the prompts on
