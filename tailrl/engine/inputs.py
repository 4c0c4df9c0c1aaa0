"""From user input to engine requests and back: validation, tokenization, seed keys, outputs.

One place turns ``(prompts, sampling params, prompt ids)`` into ``Request`` groups, so that
``LLM.generate``, the rollout pool and the server make the same requests (and therefore the
same tokens) for the same input. Every check runs before any request is made: bad input
raises ``ValueError`` naming the field and nothing is queued.

Seed keys: sample ``j`` of a prompt whose ``SamplingParams.seed`` is ``s`` gets the key
``mix(engine seed, s, j)``; with ``seed=None`` the prompt seed is ``mix(call, i)`` for the
``i``-th prompt of the ``call``-th batch, so successive calls differ. Two prompts sharing one
``SamplingParams(seed=s)`` therefore get the same noise per sample index (as vLLM's
per-request seed): pass distinct seeds, or ``seed=None``, for independent samples.
"""
from __future__ import annotations

import hashlib
import os

from tailrl.config import SamplingParams
from tailrl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tailrl.engine.request import Request
from tailrl.engine.stop_strings import cut_text
from tailrl.noise import mix

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The checkpoint's Hugging Face tokenizer, or None if it ships none (token-id prompts only)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def default_prompt_id(token_ids: list[int]) -> str:
    """The id a prompt gets when the caller gives none: a digest of its tokens."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


class InputProcessor:
    """Validates user input against one model (vocabulary, context, tokenizer) and makes requests."""

    def __init__(self, vocab_size: int, max_model_len: int, tokenizer=None, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.seed = seed

    def prompt_tokens(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """(text or None, token ids) per prompt; ``prompts`` is a str or one prompt dict, or a list of
        str / list[int] / prompt dicts: vLLM's ``TokensPrompt`` (``{"prompt_token_ids": [...]}``) and
        ``TextPrompt`` (``{"prompt": "..."}``), nothing else in them."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of str or list[int], got {type(prompts).__name__}")
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                p = self._from_dict(p, f"prompts[{i}]")
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is a string but the model has no tokenizer files; pass token ids")
                toks = self.tokenizer.encode(p) if p else []      # special tokens (bos) as in HF and vLLM
                texts.append(p)
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                toks = list(p)
                texts.append(None)
            else:
                raise ValueError(f"prompts[{i}] must be a str or a list of int token ids")
            self.check_tokens(toks, f"prompts[{i}]")
            ids.append(toks)
        return texts, ids

    @staticmethod
    def _from_dict(p: dict, name: str) -> str | list[int]:
        """A vLLM prompt dict's text or token ids; other keys (multi-modal data, a second
        prompt) are refused: nothing the caller asked for is dropped silently."""
        keys = set(p)
        if keys == {"prompt_token_ids"}:
            return p["prompt_token_ids"]
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        raise ValueError(f"{name} must be {{'prompt_token_ids': [int, ...]}} or {{'prompt': str}}, got keys "
                         f"{sorted(keys)}")

    def chat_tokens(self, messages: list[dict], name: str = "messages") -> list[int]:
        """One conversation's prompt: the tokenizer's chat template over ``messages`` (dicts of
        ``role`` and ``content``) with the assistant's turn opened, as token ids (the server's
        chat route and ``LLM.chat`` alike)."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"{name}: this model has no chat template; pass prompts to generate")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:                   # a template may reject roles or orders (jinja raises)
            raise ValueError(f"{name}: the chat template rejected the messages: {e}") from None
        ids = tok.encode(text, add_special_tokens=False)
        self.check_tokens(ids, name)
        return ids

    def check_tokens(self, toks: list[int], name: str) -> None:
        if not toks:
            raise ValueError(f"{name} is empty")
        bad = [t for t in toks if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(toks) >= self.max_model_len:
            raise ValueError(f"{name} has {len(toks)} tokens: longer than the context "
                             f"(max_model_len={self.max_model_len}, which must leave room for one new token)")

    def sampling_params(self, sampling_params, n_prompts: int) -> list[SamplingParams]:
        """One ``SamplingParams`` per prompt (a single one is shared), each re-validated."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        plist = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n_prompts
        if len(plist) != n_prompts:
            raise ValueError(f"sampling_params has {len(plist)} entries for {n_prompts} prompts")
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            p.__post_init__()                            # re-check fields mutated after construction
            bad = [t for t in (p.stop_token_ids or []) if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            if p.stop and self.tokenizer is None:
                raise ValueError("stop: stop strings need the model's tokenizer files; pass stop_token_ids")
        return plist

    def prompt_ids(self, prompt_ids, ids: list[list[int]]) -> list[str]:
        """Stable id per prompt (the RL uid): the caller's, else a digest of the tokens."""
        if prompt_ids is None:
            return [default_prompt_id(t) for t in ids]
        if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) != len(ids):
            n = len(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else type(prompt_ids).__name__
            raise ValueError(f"prompt_ids has {n} entries for {len(ids)} prompts")
        return [str(p) for p in prompt_ids]

    @staticmethod
    def prompt_seed(params: SamplingParams, call: int, i: int) -> int:
        """The prompt seed of the ``i``-th prompt of the ``call``-th batch (module docstring)."""
        return params.seed if params.seed is not None else mix(call, i)

    def group(self, group_id: str, token_ids: list[int], params: SamplingParams, prompt_id: str,
              prompt_seed: int) -> list[Request]:
        """The ``params.n`` requests of one prompt (one GRPO group)."""
        return [Request(f"{group_id}-{j}", list(token_ids), params, mix(self.seed, prompt_seed, j),
                        group_id=group_id, prompt_id=prompt_id, index=j) for j in range(params.n)]

    def requests(self, call: int, prompts, sampling_params=None,
                 prompt_ids=None) -> tuple[list[str | None], list[list[int]], list[str], list[list[Request]]]:
        """Validate everything, then make the request groups of the ``call``-th batch.
        Returns (texts, token ids, prompt ids, groups)."""
        texts, ids = self.prompt_tokens(prompts)
        plist = self.sampling_params(sampling_params, len(ids))
        pids = self.prompt_ids(prompt_ids, ids)
        groups = [self.group(f"{call}-{i}", toks, p, pids[i], self.prompt_seed(p, call, i))
                  for i, (toks, p) in enumerate(zip(ids, plist))]
        return texts, ids, pids, groups

    def output(self, group_id: str, text: str | None, ids: list[int], prompt_id: str,
               group: list[Request]) -> RequestOutput:
        out = RequestOutput(group_id, text, list(ids), prompt_id)
        done = [r for r in group if r.params.prompt_logprobs is not None and not r.prompt_logprobs_pending]
        if done:                             # the group's prompt, computed by the sample that prefilled it
            out.prompt_logprobs = [None] + self._named(done[0].prompt_top_logprobs or [], done[0].params.detokenize)
        for r in group:
            p = r.params
            decoded = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=p.skip_special_tokens) \
                if self.tokenizer and p.detokenize else ""
            if p.stop and r.finish_reason == "stop":
                decoded = cut_text(decoded, p.stop, keep=p.include_stop_str_in_output)
            out.outputs.append(CompletionOutput(r.index, decoded, list(r.output_token_ids),
                                                list(r.output_logprobs), r.finish_reason, self.alternatives(r)))
        return out

    def alternatives(self, r: Request) -> list[dict[int, Logprob]] | None:
        """``CompletionOutput.top_logprobs`` of a finished request (None where it asked none)."""
        if r.output_top_logprobs is None:
            return [] if r.params.logprobs else None
        return self._named(r.output_top_logprobs, r.params.detokenize)

    def _named(self, entries: list[dict], detokenize: bool) -> list[dict[int, Logprob]]:
        """Engine entries {id: (logprob, rank)} as vLLM's {id: Logprob}, each token's text decoded once."""
        text = self.tokenizer is not None and detokenize
        names: dict[int, str | None] = {}
        for entry in entries:
            for t in entry:
                if t not in names:
                    names[t] = self.tokenizer.decode([t]) if text else None
        return [{t: Logprob(lp, rank, names[t]) for t, (lp, rank) in entry.items()} for entry in entries]
