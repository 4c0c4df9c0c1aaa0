"""What the rollout benchmarks share: their arguments (the model, the held-out task prompts,
samples per prompt, the length cap, rounds) and the prompts' token ids with stable ids."""
from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rollout_args(doc: str, rounds: int = 3) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "small"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap.parse_args()


def task_prompts(model: str, count: int) -> tuple[list[list[int]], list[str]]:
    """``count`` held-out task prompts as ``model``'s token ids, and their prompt ids."""
    from transformers import AutoTokenizer

    from tailrl.tasks import mixture
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(count)]
    return prompts, [f"p{i}" for i in range(len(prompts))]
