"""SGLang's native ``/generate``: its request body -> per-sample calls, its answer's shape.

RL frameworks built on SGLang (slime, and others that talk to its HTTP server) send every
sample as ``POST /generate`` with the prompt's token ids and a ``sampling_params`` dict, and
read ``text``, ``output_ids`` and ``meta_info`` (``finish_reason.type``, and with
``return_logprob`` the ``output_token_logprobs`` as ``[logprob, token id, text]``). Here each
sample is one call of the per-sample front (``samples.SampleServer``): the same grouping,
history and noise as verl's path, so ``sampling_seed`` s gives exactly
``LLM.generate(ids, SamplingParams(seed=s, n=N))``'s samples.

With ``stream`` (one prompt, one sample) the answer is server-sent events, each chunk the
whole answer so far (SGLang's default, cumulative: ``text``, ``output_ids`` and the logprobs
lists grow; ``finish_reason`` is null until the last), then ``data: [DONE]``.

Every field is checked before anything runs; a field we do not implement (grammars, LoRA,
images, ...) with a non-default value is a 400 naming it, never ignored. Log-probabilities
are tailrl's (and SGLang's default): of the tempered distribution, T = 1 for greedy.
"""
from __future__ import annotations

from dataclasses import dataclass

from tailrl.config import MAX_LOGPROBS, SamplingParams
from tailrl.engine.stop_strings import cut_text
from tailrl.serve.errors import APIError
from tailrl.serve.samples import Sample

# sampling_params fields: ours by SGLang's name, and SGLang's defaults
_SAMPLING = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
             "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
             "stop": None, "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True,
             "no_stop_trim": False, "n": 1, "sampling_seed": None,
             # accepted: with a fast tokenizer no text ever has spaces between special tokens
             "spaces_between_special_tokens": True,
             # accepted: SGLang hands them to a custom logit processor only, and there is none here
             "custom_params": None,
             # SGLang's streaming granularity: here a chunk per engine update that added tokens
             "stream_interval": None}
_SAMPLING_UNSUPPORTED = ("json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "stop_regex")
# top-level fields: accepted ones, and those refused unless absent / false / default
_TOP = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
        "return_text_in_logprobs", "stream", "rid", "log_metrics", "data_parallel_rank", "priority"}
_TOP_UNSUPPORTED = ("input_embeds", "image_data", "video_data", "audio_data", "token_ids_logprob", "lora_path",
                    "lora_id", "session_params", "custom_logit_processor", "return_hidden_states",
                    "return_routed_experts", "bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass
class PromptCall:
    """One prompt of a /generate body: its samples are calls ``0..params.n-1``."""

    rid: str
    input_ids: list[int]
    params: SamplingParams          # n = the prompt's samples; each call runs it with n = 1
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int          # -1: output logprobs only
    logprob_text: bool


def _per_prompt(body: dict, name: str, default, count: int) -> list:
    """A field given once for every prompt, or as a list of one value per prompt."""
    value = body.get(name, default)
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(400, f"field '{name}' has {len(value)} entries for {count} prompts", param=name)
        return value
    return [value] * count


def _prompts(body: dict, inputs) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the body was a batch (its answer is then a list)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text" if ids is None else "input_ids")
    if ids is not None:
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        lists = ids if batch else [ids]
        if not isinstance(lists, list) or not lists or not all(
                isinstance(t, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in t) for t in lists):
            raise APIError(400, "field 'input_ids' must be a list of token ids or a list of such lists",
                           param="input_ids")
        for i, t in enumerate(lists):
            try:
                inputs.check_tokens(t, "input_ids" if not batch else f"input_ids[{i}]")
            except ValueError as e:
                raise APIError(400, str(e), param="input_ids") from None
        return lists, batch
    batch = isinstance(text, list)
    texts = text if batch else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise APIError(400, "field 'text' must be a string or a non-empty list of strings", param="text")
    try:
        _, lists = inputs.prompt_tokens(texts)
    except ValueError as e:
        raise APIError(400, str(e).replace("prompts", "text"), param="text") from None
    return lists, batch


def _sampling(d, inputs, cfg, logprobs: int, prompt_logprobs: int | None) -> SamplingParams:
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise APIError(400, "field 'sampling_params' must be an object (or a list of them)", param="sampling_params")
    for k, v in d.items():
        if k in _SAMPLING_UNSUPPORTED and v is not None:
            raise APIError(400, f"field 'sampling_params.{k}' is not supported by this server", param=k)
        if k not in _SAMPLING and k not in _SAMPLING_UNSUPPORTED:
            raise APIError(400, f"unknown field 'sampling_params.{k}'", param=k)
    p = {**_SAMPLING, **{k: v for k, v in d.items() if v is not None or k in ("stop", "stop_token_ids")}}
    if p["stream_interval"] is not None:
        raise APIError(400, "field 'sampling_params.stream_interval' is not supported (a chunk per engine update)",
                       param="stream_interval")
    n, max_new = p["n"], p["max_new_tokens"]
    if not isinstance(n, int) or not 1 <= n <= cfg.max_n:
        raise APIError(400, f"field 'sampling_params.n' must be in [1, {cfg.max_n}], got {n!r}", param="n")
    if not isinstance(max_new, int) or not 1 <= max_new <= cfg.max_tokens_limit:
        raise APIError(400, f"field 'sampling_params.max_new_tokens' must be in [1, {cfg.max_tokens_limit}], "
                       f"got {max_new!r}", param="max_new_tokens")
    stop = [p["stop"]] if isinstance(p["stop"], str) else p["stop"]
    if stop and len(stop) > cfg.max_stop_strings:
        raise APIError(400, f"field 'sampling_params.stop' has more than {cfg.max_stop_strings} strings",
                       param="stop")
    top_k = p["top_k"]
    if isinstance(top_k, int) and top_k >= inputs.vocab_size:       # SGLang's "all" may be 1 << 30
        top_k = -1
    try:
        params = SamplingParams(
            n=n, temperature=float(p["temperature"]), top_p=float(p["top_p"]), top_k=top_k, max_tokens=max_new,
            seed=p["sampling_seed"], stop_token_ids=p["stop_token_ids"], ignore_eos=bool(p["ignore_eos"]),
            stop=stop or None, presence_penalty=float(p["presence_penalty"]),
            frequency_penalty=float(p["frequency_penalty"]), repetition_penalty=float(p["repetition_penalty"]),
            min_p=float(p["min_p"]), min_tokens=p["min_new_tokens"], include_stop_str_in_output=bool(p["no_stop_trim"]),
            skip_special_tokens=bool(p["skip_special_tokens"]), logprobs=logprobs or None,
            prompt_logprobs=prompt_logprobs)
        return inputs.sampling_params(params, 1)[0]
    except (ValueError, TypeError) as e:
        field = str(e).split(" ", 1)[0].rstrip(":")
        field = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
                 "include_stop_str_in_output": "no_stop_trim"}.get(field, field)
        raise APIError(400, f"field 'sampling_params.{field}': {e}", param=field) from None


def parse_generate(body, inputs, cfg) -> tuple[list[PromptCall], bool, bool]:
    """A /generate body -> its prompts' calls (every field checked), whether it was a batch, and
    whether it streams (one prompt, one sample: slime's streaming rollout)."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    for k, v in body.items():
        if k in _TOP_UNSUPPORTED and v not in (None, False, [], {}):
            raise APIError(400, f"field '{k}' is not supported by this server", param=k)
        if k not in _TOP and k not in _TOP_UNSUPPORTED:
            raise APIError(400, f"unknown field '{k}'", param=k)
    if body.get("data_parallel_rank") not in (None, 0):
        raise APIError(400, "field 'data_parallel_rank' must be 0 or absent (one engine per server)",
                       param="data_parallel_rank")
    prompts, batch = _prompts(body, inputs)
    count = len(prompts)
    if count > cfg.max_prompts:
        raise APIError(400, f"more than {cfg.max_prompts} prompts in one request", param="input_ids")
    if batch and isinstance(body.get("rid"), str):
        raise APIError(400, "field 'rid' must be a list of one id per prompt for a batch", param="rid")
    columns = {name: _per_prompt(body, name, default, count) for name, default in
               (("sampling_params", None), ("return_logprob", False), ("top_logprobs_num", 0),
                ("logprob_start_len", -1), ("return_text_in_logprobs", False), ("rid", None))}
    rids = [r for r in columns["rid"] if r is not None]
    if len(set(rids)) != len(rids):
        raise APIError(400, "field 'rid' has the same id twice", param="rid")
    calls = []
    for i, ids in enumerate(prompts):
        want, top, start = (columns[k][i] for k in ("return_logprob", "top_logprobs_num", "logprob_start_len"))
        if not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"field 'top_logprobs_num' must be in [0, {MAX_LOGPROBS}], got {top!r}",
                           param="top_logprobs_num")
        if not isinstance(start, int) or not -1 <= start < len(ids):
            raise APIError(400, f"field 'logprob_start_len' must be -1 or in [0, {len(ids)}) for a prompt of "
                           f"{len(ids)} tokens, got {start!r}", param="logprob_start_len")
        rid = columns["rid"][i]
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise APIError(400, f"field 'rid' must be a non-empty string, got {rid!r}", param="rid")
        want = bool(want)
        params = _sampling(columns["sampling_params"][i], inputs, cfg, top if want else 0,
                           top if want and start >= 0 else None)
        calls.append(PromptCall(rid, ids, params, want, top if want else 0, start if want else -1,
                                bool(columns["return_text_in_logprobs"][i])))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"field 'stream' must be true or false, got {stream!r}", param="stream")
    if stream and (batch or calls[0].params.n != 1):
        raise APIError(400, "field 'stream': streams one prompt's one sample (send each sample as its own call)",
                       param="stream")
    return calls, batch, stream


def finish_reason(call: PromptCall, s: Sample, text: str, eos: tuple[int, ...]) -> dict | None:
    """SGLang's ``finish_reason``: what matched (a token id or a stop string), the length, or abort
    (None while the sample is still growing)."""
    if s.finish_reason is None:
        return None
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    if s.finish_reason == "stop":
        p = call.params
        last = s.token_ids[-1] if s.token_ids else None
        if last is not None and (not p.ignore_eos and last in eos or last in (p.stop_token_ids or [])):
            return {"type": "stop", "matched": last}
        hits = sorted((text.find(x), x) for x in (p.stop or []) if text.find(x) >= 0)
        return {"type": "stop", "matched": hits[0][1] if hits else None}
    return {"type": "abort", "message": "aborted"}


def _triples(entry: dict, n: int, name) -> list[list]:
    """One position's top ``n`` as ``[logprob, token id, text]``, best first."""
    best = sorted(((rank, t, lp) for t, (lp, rank) in entry.items() if rank <= n))
    return [[lp, t, name(t)] for _, t, lp in best]


def answer(call: PromptCall, s: Sample, rid: str, tokenizer, eos: tuple[int, ...], weight_version: str,
           latency: float) -> dict:
    """One sample's ``{"text", "output_ids", "meta_info"}``."""
    p = call.params
    text = tokenizer.decode(s.token_ids, skip_special_tokens=p.skip_special_tokens) if tokenizer is not None else ""
    reason = finish_reason(call, s, text, eos)
    if p.stop and s.finish_reason == "stop":
        text = cut_text(text, p.stop, keep=p.include_stop_str_in_output)
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(call.input_ids),
            "completion_tokens": len(s.token_ids), "e2e_latency": latency, "weight_version": weight_version,
            "spec_verify_ct": s.spec_verify_steps, "spec_proposed_drafts": s.spec_draft_tokens,
            "spec_accepted_drafts": s.spec_accepted_tokens,
            "spec_accept_rate": s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0}
    if call.return_logprob:
        names: dict[int, str | None] = {}

        def name(t: int) -> str | None:
            if not call.logprob_text or tokenizer is None:
                return None
            if t not in names:
                names[t] = tokenizer.decode([t])
            return names[t]

        meta["output_token_logprobs"] = [[lp, t, name(t)] for lp, t in zip(s.logprobs, s.token_ids)]
        if call.top_logprobs_num:
            meta["output_top_logprobs"] = [_triples(e, call.top_logprobs_num, name) for e in s.top_logprobs or []]
        if call.logprob_start_len >= 0:
            ids, entries = call.input_ids, s.prompt_top_logprobs or []
            start = call.logprob_start_len
            meta["input_token_logprobs"] = [[None if i == 0 else entries[i - 1][ids[i]][0], ids[i], name(ids[i])]
                                            for i in range(start, len(ids))]
            if call.top_logprobs_num:
                meta["input_top_logprobs"] = [None if i == 0 else _triples(entries[i - 1], call.top_logprobs_num, name)
                                              for i in range(start, len(ids))]
    return {"text": text, "output_ids": list(s.token_ids), "meta_info": meta}
