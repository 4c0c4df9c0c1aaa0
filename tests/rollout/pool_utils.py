"""Shared pieces of the pool tests: a workload with varied lengths and an exact comparison."""
from __future__ import annotations

from tailrl import SamplingParams

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], list(range(10, 40)), [4, 4], [7, 7, 7, 1], [3, 1, 4, 1, 5]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=40)


def pool_ckpt(ckpt_dir) -> str:
    """A random model with an EOS token, so lengths vary (a tail to schedule around)."""
    return ckpt_dir("qwen2", eos_token_id=5, max_pos=1024)   # (calibration probes 512 positions)


def assert_same(outs, ref) -> None:
    """Tokens and finish reasons identical; logprobs as exact as the engine is across batch
    compositions (float64 sums in a different order differ in the last bits)."""
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    assert [[c.finish_reason for c in o.outputs] for o in outs] == [[c.finish_reason for c in o.outputs] for o in ref]
    worst = max(abs(x - y) for o, r in zip(outs, ref) for c, d in zip(o.outputs, r.outputs)
                for x, y in zip(c.logprobs, d.logprobs))
    assert worst < 1e-9


def lengths(outs) -> list[list[int]]:
    return [[len(c.token_ids) for c in o.outputs] for o in outs]


# explicit seeds: repeated generate calls on one LLM give the same outputs
SEEDED = [PARAMS.clone(seed=1000 + i) for i in range(len(PROMPTS))]


class KillAt:
    """Kill one instance once the pool has seen `fraction` of `total` tokens (a real kill:
    SIGKILL for a local process, ray.kill for an actor), from the driver's progress hook."""

    def __init__(self, instance, total: int, fraction: float = 0.3) -> None:
        self.instance, self.limit, self.killed_at = instance, int(total * fraction), None

    def __call__(self, driver) -> None:
        if self.killed_at is None and driver.tokens >= self.limit:
            self.killed_at = driver.tokens
            if hasattr(self.instance, "kill"):
                self.instance.kill()
            else:
                import os
                import signal
                os.kill(self.instance.pid, signal.SIGKILL)
