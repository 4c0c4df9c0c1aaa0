"""``SampleServer.update_weights`` in buckets: a trainer's sync (verl's, bucket by bucket) loads
between engine steps, holds new calls until the last bucket, and checks that every tensor came."""
from __future__ import annotations

import asyncio
import time

import pytest

from tailrl import LLM, SamplingParams
from tailrl.model.loader import load_state_dict
from tailrl.serve.samples import SampleServer

PROMPT = [5, 17, 30, 8, 9]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=11)


def reference(path: str, max_tokens: int) -> tuple[list[int], list[float]]:
    out = LLM(path, dtype="bfloat16").generate([PROMPT], params(max_tokens))[0].outputs[0]
    return out.token_ids, out.logprobs


def test_buckets_hold_new_calls_until_the_last_and_running_calls_finish_on_the_old_weights(ckpt_dir):
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    items = list(load_state_dict(new).items())
    buckets = [items[i:i + 7] for i in range(0, len(items), 7)]
    samples = SampleServer(LLM(old, dtype="bfloat16"))

    async def run():
        running = asyncio.create_task(samples.generate("a", PROMPT, params(40)))
        await asyncio.sleep(0.05)
        await samples.update_weights(buckets[0], done=False)      # the running call finishes first
        waiting = asyncio.create_task(samples.generate("b", PROMPT, params(16)))
        for bucket in buckets[1:-1]:
            await samples.update_weights(bucket, done=False)
            await asyncio.sleep(0.01)
            assert not waiting.done()                               # admission is closed until the last bucket
        epoch = samples.groups.epoch
        await samples.update_weights(buckets[-1], done=True)
        assert samples.groups.epoch == epoch + 1
        return running.result(), await waiting

    try:
        before, after = asyncio.run(run())
    finally:
        samples.loop.stop()
    assert (before.token_ids, before.logprobs) == reference(old, 40)
    assert (after.token_ids, after.logprobs) == reference(new, 16)


def test_an_update_missing_a_tensor_is_an_error_naming_it_and_admission_reopens(ckpt_dir):
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    items = [(n, t) for n, t in load_state_dict(new).items() if n != "model.layers.1.mlp.down_proj.weight"]
    samples = SampleServer(LLM(old, dtype="bfloat16"))

    async def run():
        await samples.update_weights(items[:5], done=False)
        with pytest.raises(ValueError, match="not 'model.layers.1.mlp.down_proj.weight'"):
            await samples.update_weights(items[5:], done=True)
        with pytest.raises(ValueError, match="no tensor named 'x'"):       # a bad bucket ends its update
            await samples.update_weights([("x", items[0][1])], done=False)
        return await asyncio.wait_for(samples.generate("c", PROMPT, params(4)), 30)

    try:
        assert len(asyncio.run(run()).token_ids) == 4
    finally:
        samples.loop.stop()


def test_requests_of_any_front_wait_outside_the_engine_during_an_update(ckpt_dir):
    """A group submitted to the engine loop itself (the OpenAI routes' way) between two buckets
    joins the engine only once the last is in, and runs on the new weights."""
    from tailrl.engine.request import Request
    from tailrl.noise import mix
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    items = list(load_state_dict(new).items())
    llm = LLM(old, dtype="bfloat16")
    samples = SampleServer(llm)
    got = []
    try:
        samples.loop.update_weights(items[:10], done=False).result(30)
        req = Request("r0", list(PROMPT), params(16), mix(llm.seed, 11, 0), group_id="g", prompt_id="p", index=0)
        samples.loop.submit([req], got.extend)
        samples.loop.update_weights(items[10:20], done=False).result(30)
        assert got == [] and not llm.engine.has_unfinished()
        samples.loop.update_weights(items[20:], done=True).result(30)
        for _ in range(300):
            if got and got[-1].finish_reason is not None:
                break
            time.sleep(0.02)
    finally:
        samples.loop.stop()
    assert ([t for u in got for t in u.token_ids], [x for u in got for x in u.logprobs]) == reference(new, 16)
