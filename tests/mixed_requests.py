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


def lossless_engines(model: str, dtype: str) -> list[LLM]:
    """Engines whose outputs must equal a plain engine's: steps launched ahead, chains, trees, a
    pool whose requests move between instances in chunks of 16 tokens, and rows drafting inside
    steps launched ahead (the tests of settings that read a step's logits: logits processing,
    top logprobs)."""
    from tailrl import SpeculativeConfig
    fixed = dict(policy="fixed", max_draft_tokens=8)
    return [LLM(model, dtype=dtype, async_scheduling=True),
            LLM(model, dtype=dtype, speculative=SpeculativeConfig(**fixed)),
            LLM(model, dtype=dtype, speculative=SpeculativeConfig(**fixed, max_tree_paths=3)),
            LLM(model, dtype=dtype, instances=2, pool={"processes": False, "chunk_tokens": 16}),
            LLM(model, dtype=dtype, async_scheduling=True,
                speculative=SpeculativeConfig(policy="fixed", ahead_drafts=8, ahead_above=1,
                                              ahead_drafts_gate="always"))]
