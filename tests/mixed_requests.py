"""Requests of every kind a rollout mixes (sampling settings, stop tokens, a length limit of
one, a long prompt), and their outputs as comparable lists: the cases the tests of steps
launched ahead run (tests/engine/test_ahead.py, test_ahead_drafts.py)."""
from tailrl import LLM, SamplingParams

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4], [5, 6, 7, 8]]
PARAMS = [SamplingParams(n=3, temperature=1.0, max_tokens=40, stop_token_ids=[11, 23], seed=3),
          SamplingParams(n=2, temperature=0.0, max_tokens=25, stop_token_ids=[7]),
          SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_tokens=30, seed=5),
          SamplingParams(n=2, temperature=1.0, max_tokens=1, seed=8),
          SamplingParams(n=3, temperature=1.2, max_tokens=35, stop_token_ids=[3, 50], seed=9)]


def outputs(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]
