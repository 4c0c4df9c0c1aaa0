"""The check that speculation changes nothing: bfloat16, T=1, chains then trees of drafts, tokens
and log-probabilities identical to plain decoding's."""
from __future__ import annotations

from tailrl import LLM, SamplingParams, SpeculativeConfig

PROMPTS = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41], [7] * 12]


def assert_speculation_lossless(path: str, max_tokens: int = 48, max_draft_tokens: int = 6) -> None:
    """Three prompts x 3 samples of ``max_tokens`` tokens, twice (the second call drafting from the
    first's history), by plain decoding and with drafts of ``max_draft_tokens`` (chains, then
    trees of 3 paths): every token and log-probability identical, and drafts accepted."""
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=3)
    plain = LLM(path)
    want = [plain.generate(PROMPTS, sp) for _ in range(2)]
    for paths in (1, 3):
        spec = LLM(path, speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=max_draft_tokens,
                                                       max_tree_paths=paths))
        for a in want:
            b = spec.generate(PROMPTS, sp)
            for x, y in zip(a, b, strict=True):
                for cx, cy in zip(x.outputs, y.outputs, strict=True):
                    assert (cy.token_ids, cy.logprobs) == (cx.token_ids, cx.logprobs), paths
        assert spec.last_metrics["rollout/spec_accepted_tokens"] > 0
