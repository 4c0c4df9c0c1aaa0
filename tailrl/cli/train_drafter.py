"""``tailrl train-drafter --model DIR --out DIR``: warm-start the learned drafter on the model's
own responses (sampled with ``LLM``), then save it (the training itself: tailrl/drafter/train.py)."""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from tailrl.drafter.network import Drafter
from tailrl.drafter.train import teacher_forced, train
from tailrl.drafter.vocab import DRAFT_VOCAB, frequent_tokens, response_tokens

log = logging.getLogger(__name__)


def sample_responses(model_dir: str, prompts: list[list[int]], n: int, max_tokens: int, seed: int,
                     dtype: str = "bfloat16", device: str = "cpu") -> list[tuple[list[int], list[int]]]:
    """The model's own responses (temperature 1) to ``prompts``, ``n`` each."""
    from tailrl import LLM, SamplingParams
    llm = LLM(model_dir, dtype=dtype, seed=seed, device=device)
    outs = llm.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed))
    return [(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]


def warm_start(model_dir: str, out_dir: str, prompts: list[list[int]], n: int = 4, max_tokens: int = 512,
               steps: int = 1000, batch: int = 1024, lr: float = 1e-3, unroll: int = 3,
               seed: int = 0, size: int | None = None, device: str = "cpu",
               max_seconds: float | None = None, draft_vocab: int = DRAFT_VOCAB) -> dict[str, float]:
    """Sample, teacher-force, train and save a drafter for ``model_dir`` into ``out_dir``, all
    on ``device`` (the target in float32 for its states and the drafter's frozen head);
    ``max_seconds``: the training's time budget besides its ``steps`` (``train``);
    ``draft_vocab``: its head covers that many tokens, the responses' most frequent first, then
    the lowest ids (``tailrl.drafter.vocab``; 0: the whole vocabulary)."""
    import transformers

    from tailrl.config import check_device, require_device
    from tailrl.model.loader import load_model
    check_device(device)
    require_device(device)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    seqs = sample_responses(model_dir, prompts, n, max_tokens, seed, device=device)
    t1 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    data = teacher_forced(hf, seqs)
    del hf
    if data.windows(1) == 0:
        raise ValueError("train-drafter: no response is long enough to train on (raise --max-tokens)")
    target = load_model(model_dir, "float32", device)
    vocab = frequent_tokens(response_tokens(data), target.args.vocab_size, draft_vocab,
                            always=target.args.eos_token_ids)    # a response's last token, however rare
    drafter = Drafter.for_target(target, size, vocab)
    del target
    t2 = time.perf_counter()
    figures = train(drafter, data, steps, batch, lr, unroll, seed, max_seconds)
    drafter.save(out_dir)
    figures.update(sequences=float(len(seqs)), windows=float(data.windows(unroll)), sample_s=t1 - t0,
                   draft_vocab=float(len(drafter.head)),
                   train_s=time.perf_counter() - t2)
    return figures


def task_prompts(model_dir: str, count: int) -> list[list[int]]:
    """The first ``count`` training prompts of the task mixture (never held-out ones), tokenised."""
    from itertools import islice

    from tailrl.engine.inputs import load_tokenizer
    from tailrl.tasks import mixture
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ValueError(f"model: {model_dir!r} has no tokenizer to encode the task prompts")
    return [tok.encode(ex.prompt) for ex in islice(mixture.training_examples(), count)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tailrl train-drafter", description="warm-start the learned drafter")
    ap.add_argument("--model", required=True, help="target checkpoint directory")
    ap.add_argument("--out", required=True, help="drafter directory to write")
    ap.add_argument("--prompts", type=int, default=128, help="training prompts to sample")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1024, help="positions per training step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--unroll", type=int, default=3, help="drafter steps trained on its own features")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=None, help="the drafter's MLP width (default: the model's)")
    ap.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB,
                    help="the drafter's head covers this many tokens: the sampled responses' most frequent, "
                         "then the lowest ids (0: the whole vocabulary)")
    ap.add_argument("--device", default="cpu", help="where to sample and train: cpu, cuda or cuda:N")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="the training's time budget (after sampling): it ends with the first of this and --steps")
    a = ap.parse_args(argv)
    for name in ("prompts", "n", "max_tokens", "steps", "batch", "unroll", "size"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    from tailrl.config import check_device, require_device
    try:
        check_device(a.device, "--device")
        require_device(a.device, "--device")
    except ValueError as e:
        ap.error(str(e))
    if a.draft_vocab < 0:
        ap.error("--draft-vocab must be >= 0")
    if a.max_seconds is not None and not a.max_seconds > 0:
        ap.error("--max-seconds must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    figures = warm_start(a.model, a.out, task_prompts(a.model, a.prompts), a.n, a.max_tokens, a.steps,
                         a.batch, a.lr, a.unroll, a.seed, a.size, a.device, a.max_seconds, a.draft_vocab)
    log.info("drafter saved to %s", a.out)
    print(json.dumps({"out": a.out, **figures}))
    return 0
