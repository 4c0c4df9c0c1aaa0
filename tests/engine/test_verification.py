"""The verification forward: a chain or tree of draft tokens scored in one batched forward."""
import random

import pytest
import torch
import transformers

from tailrl import LLM, SamplingParams
from tailrl.engine.batch import ModelRunner
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request
from tailrl.model.loader import load_model
from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.base import FixedPolicy
from tailrl.speculative.speculator import Speculator


def test_tree_logits_equal_feeding_each_path(ckpt_dir):
    path = ckpt_dir("qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path)
    kv = KVCache(model.args, torch.float32, "cpu", 4096, 4, 512)
    runner = ModelRunner(model, kv)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 3, 3]]
    reqs = [Request(f"r{i}", p, SamplingParams(), 0) for i, p in enumerate(prompts)]
    kv.grow_rows([(0, 64), (1, 64)])
    for i, r in enumerate(reqs):                           # prefill all but the last prompt token
        r.row = i
    runner.run(runner.build([(r, r.num_prompt_tokens - 1) for r in reqs], {}))
    for r in reqs:
        r.num_computed_tokens = r.num_prompt_tokens - 1
    tree = Draft([20, 21, 22, 23, 24, 25], [-1, 0, 0, 2, -1, 4], [1.0] * 6, "self")
    chain = Draft.chain([30, 31, 32])
    batch = runner.build([(reqs[0], 1), (reqs[1], 1)], {"r0": tree, "r1": chain})
    logits = runner.run(batch)                              # [M, V]: root + nodes, row after row
    for r, d, e in ((reqs[0], tree, 0), (reqs[1], chain, 1 + len(tree.tokens))):
        for k in range(-1, len(d.tokens)):
            path_toks = d.path_to(k)                        # [] for the root (k = -1)
            with torch.no_grad():
                ref = hf(torch.tensor([r.prompt_token_ids + path_toks])).logits[0, -1]
            got = logits[e + 1 + k]
            assert (got - ref).abs().max().item() < 1e-4, (r.request_id, k)


class OracleTreeSource:
    """Draft source for tests: knows each request's true continuation (from a plain run) and
    proposes trees whose main branch is corrupted at a random depth, with a correct sibling
    branch there, or else a wholly wrong chain, so acceptance, rejection and the K/V moves of
    accepted tree nodes are all exercised."""
    name = "oracle"

    def __init__(self, truth: dict, seed: int = 0):
        self.truth, self.rng = truth, random.Random(seed)

    def propose(self, req, max_tokens, max_paths):
        fut = self.truth[(tuple(req.prompt_token_ids), req.index)][req.num_output_tokens:]
        if len(fut) < 2 or max_tokens < 2:
            return None
        mode = self.rng.random()
        if mode < 0.2:                                      # wrong from the first token
            return Draft.chain([(fut[0] + 1) % 97, fut[1]], source=self.name)
        k = min(len(fut), max_tokens // 2 + 1)
        c = self.rng.randrange(1, k) if k > 1 else 1
        main = fut[:k]
        main[c - 1] = (main[c - 1] + 7) % 97                # corrupt depth c
        toks, parents = main, list(range(-1, len(main) - 1))
        sib = fut[c - 1:c + 1]
        toks = toks + sib
        parents = parents + [c - 2, len(main)]
        return Draft(toks[:max_tokens], parents[:max_tokens], [0.9] * min(len(toks), max_tokens), self.name)

    def observe(self, req, new_tokens):
        pass

    def start(self, req):
        pass

    def finish(self, req):
        pass


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_speculative_outputs_identical_to_plain(ckpt_dir, temperature, top_p):
    path = ckpt_dir("qwen2")
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4, 4, 4]]
    sp = SamplingParams(n=3, temperature=temperature, top_p=top_p, max_tokens=40, ignore_eos=True)
    plain = LLM(path, dtype="float64").generate(prompts, sp)
    truth = {(tuple(o.prompt_token_ids), c.index): c.token_ids for o in plain for c in o.outputs}
    llm = LLM(path, dtype="float64")
    llm.engine.speculator = Speculator(sources=[OracleTreeSource(truth)], policy=FixedPolicy(k=8, paths=2))
    spec = llm.generate(prompts, sp)
    for a, b in zip(plain, spec):
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-9
    m = llm.last_metrics
    assert m["rollout/spec_accepted_tokens"] > 0
    assert m["rollout/spec_accepted_tokens"] < m["rollout/spec_draft_tokens"]      # rejections happened
    assert m["rollout/num_forward"] < llm.last_metrics["response_length/max"] + 5
