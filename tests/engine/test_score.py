"""Teacher-forced scoring with the engine's kernels (``tailrl.engine.score.Scorer``) gives the
log-probabilities the rollout reported: bit for bit in bfloat16 (plain and speculative
rollouts, sampled, tempered and greedy, one engine or a group sharing its prefill), to float64
rounding in float64; new weights are scored as loaded; bad input is named."""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine.score import Scorer
from tailrl.model.loader import load_state_dict

PROMPTS = [[3, 17, 5, 9], [4, 4, 21, 8, 2, 30], [11, 12], [6, 19, 2, 40, 41, 42, 43, 44, 45]]
PARAMS = [SamplingParams(n=3, temperature=1.0, max_tokens=40, seed=1),
          SamplingParams(n=2, temperature=0.7, max_tokens=30, seed=2),
          SamplingParams(n=2, temperature=0, max_tokens=20),
          SamplingParams(n=3, temperature=1.0, top_p=0.8, max_tokens=50, seed=3)]


def rollout(llm: LLM) -> tuple[list, list, list, list]:
    outs = llm.generate(PROMPTS, PARAMS)
    prompts, responses, logprobs, temps = [], [], [], []
    for o, sp in zip(outs, PARAMS, strict=True):
        for c in o.outputs:
            prompts.append(list(o.prompt_token_ids))
            responses.append(list(c.token_ids))
            logprobs.append(list(c.logprobs))
            temps.append(sp.temperature)
    return prompts, responses, logprobs, temps


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(policy="fixed")])
def test_bfloat16_scores_equal_the_rollout_bit_for_bit(model, spec):
    llm = LLM(model, speculative=spec)
    for _ in range(2):                               # the second call drafts from the first's history
        prompts, responses, want, temps = rollout(llm)
    if spec is not None:
        assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0
    scorer = Scorer(model, max_batch_tokens=200)     # several forwards, sequences grouped differently
    assert scorer.logprobs(prompts, responses, temps) == want


def test_float64_scores_equal_the_rollout_to_rounding(model):
    llm = LLM(model, dtype="float64")
    prompts, responses, want, temps = rollout(llm)
    got = Scorer(model, dtype="float64").logprobs(prompts, responses, temps)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-9)


def test_new_weights_are_scored_as_the_engine_samples_with_them(model):
    sd = load_state_dict(model)
    sd = {k: v * 1.5 if k.endswith("down_proj.weight") else v for k, v in sd.items()}
    llm, scorer = LLM(model), Scorer(model)
    llm.load_weights(sd)
    scorer.load_weights(sd)
    prompts, responses, want, temps = rollout(llm)
    assert scorer.logprobs(prompts, responses, temps) == want
    assert Scorer(model).logprobs(prompts, responses, temps) != want      # the old weights differ


def test_bad_input_is_named(model):
    scorer = Scorer(model)
    with pytest.raises(ValueError, match="non-empty"):
        scorer.logprobs([[1, 2]], [[]])
    with pytest.raises(ValueError, match="differ in number"):
        scorer.logprobs([[1, 2]], [[3], [4]])
    with pytest.raises(ValueError, match="temperature"):
        scorer.logprobs([[1, 2]], [[3]], [1.0, 0.5])
    with pytest.raises(ValueError, match="context"):
        scorer.logprobs([[1] * 1000], [[2] * 100])
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Scorer(model, max_batch_tokens=0)
    assert len(scorer.logprobs([[1, 2]], [[3, 4, 5]])[0]) == 3 and torch.is_grad_enabled()
