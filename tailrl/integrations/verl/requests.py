"""verl's per-sample requests as tailrl's request groups (no verl import here).

verl's agent loop sends every sample as its own request: ``rollout.n`` siblings with the same
prompt token ids, each under a fresh uuid (``det-<priority>`` with ``rollout.full_determinism``),
with no uid or group; verl 0.9.1 forwards per-sample priorities to vLLM only. So the server
rebuilds from the tokens what the engine needs:

- prompt id: a digest of the prompt tokens (``default_prompt_id``, as ``LLM.generate`` without
  prompt ids), so a prompt meets its own responses of the previous epoch (history drafts);
- group: the prompt's samples within one weight version (``epoch``, advanced by every weight
  update). Sample ``j`` is the ``j``-th request with these tokens in the epoch (under full
  determinism: its priority, whatever the arrival order). Siblings share the group id, so they
  feed each other's group drafts, and the engine sees them together (divided rollout);
- noise: sample ``j``'s key is ``mix(rollout seed, prompt seed, j)`` with prompt seed
  ``prompt_seed(epoch, tokens)``, which is exactly ``LLM(seed=rollout seed).generate(tokens,
  SamplingParams(n=N, seed=prompt_seed(epoch, tokens)))`` for the first N samples;
- history: once every sibling of a group has finished, their responses become the prompt's
  history (a group cut short by an abort records nothing).
"""
from __future__ import annotations

import re
import threading

from tailrl.config import SamplingParams
from tailrl.engine.inputs import InputProcessor, default_prompt_id
from tailrl.engine.request import Request
from tailrl.engine.sampler import mix

# verl's sampling parameters that tailrl takes, and those it takes only at their neutral value
TAKEN = {"temperature", "top_p", "top_k", "max_tokens", "max_new_tokens", "logprobs", "seed",
         "stop_token_ids", "ignore_eos"}
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
           "n": 1}
DETERMINISTIC_ID = re.compile(r"det-(\d+)$")


def prompt_seed(epoch: int, token_ids: list[int]) -> int:
    """The prompt seed of ``token_ids`` in weight version ``epoch`` (module docstring)."""
    return mix(epoch, int(default_prompt_id(token_ids), 16))


class VerlRequests:
    """Turns verl's ``generate(prompt_ids, sampling_params, request_id)`` calls into requests."""

    def __init__(self, inputs: InputProcessor, prompt_length: int, response_length: int,
                 ignore_eos: bool = False) -> None:
        self.inputs = inputs
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.ignore_eos = ignore_eos
        self.epoch = 0
        self._issued: dict[str, int] = {}                      # group id -> samples issued
        self._live: dict[str, int] = {}                        # group id -> samples running
        self._done: dict[str, list[list[int]] | None] = {}     # group id -> responses (None: cut short)
        self._lock = threading.Lock()                          # make: asyncio side; retire: loop thread

    def new_epoch(self) -> None:
        """New weights: the next requests of a prompt form a new group, with new noise."""
        with self._lock:
            self.epoch += 1
            self._issued.clear()

    def sampling_params(self, params: dict, prompt_len: int) -> tuple[SamplingParams, bool]:
        """(tailrl ``SamplingParams``, whether log-probabilities are wanted) from verl's dict;
        ``ValueError`` names a field tailrl does not take."""
        for key, value in params.items():
            if key in NEUTRAL and value is not None and value != NEUTRAL[key]:
                raise ValueError(f"sampling_params['{key}'] = {value!r} is not supported by tailrl "
                                 f"(only {NEUTRAL[key]!r})")
            if key not in TAKEN and key not in NEUTRAL:
                raise ValueError(f"sampling_params['{key}'] is not supported by tailrl")
        room = self.inputs.max_model_len - prompt_len
        max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
        if max_tokens is None:                       # verl's rule: the response length, within the budget
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        sp = SamplingParams(
            temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)), max_tokens=max(1, min(int(max_tokens), room)),
            seed=params.get("seed"), stop_token_ids=params.get("stop_token_ids"),
            ignore_eos=bool(params.get("ignore_eos", self.ignore_eos)))
        return self.inputs.sampling_params(sp, 1)[0], bool(params.get("logprobs"))

    def make(self, request_id: str, prompt_ids: list[int], params: dict) -> tuple[Request, bool]:
        """One engine request (and whether it wants log-probabilities); every check runs first."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt_ids = [int(t) for t in prompt_ids]
        self.inputs.check_tokens(prompt_ids, "prompt_ids")
        sp, logprobs = self.sampling_params(dict(params), len(prompt_ids))
        pid = default_prompt_id(prompt_ids)
        det = DETERMINISTIC_ID.match(request_id)
        with self._lock:
            epoch = self.epoch
            gid = f"verl{epoch}-{pid}"
            if det:
                j = int(det.group(1))
            else:
                j = self._issued.get(gid, 0)
                self._issued[gid] = j + 1
            self._live[gid] = self._live.get(gid, 0) + 1
        seed = sp.seed if sp.seed is not None else prompt_seed(epoch, prompt_ids)
        req = Request(f"{gid}-{j}-{request_id}", prompt_ids, sp, mix(self.inputs.seed, seed, j),
                      group_id=gid, prompt_id=pid, index=j)
        return req, logprobs

    def retire(self, requests: list[Request]) -> list[tuple[str, list[list[int]]]]:
        """Requests that ended (not aborted) -> the (prompt id, responses) pairs to record as
        history: a group's, once none of its siblings runs any more."""
        out = []
        with self._lock:
            for r in requests:
                done = self._done.setdefault(r.group_id, [])
                if done is not None:
                    done.append(list(r.output_token_ids))
                out += self._leave(r)
        return out

    def forget(self, request: Request) -> None:
        """A request that was aborted or failed: its group records nothing this time."""
        with self._lock:
            self._done[request.group_id] = None
            self._leave(request)

    def _leave(self, r: Request) -> list[tuple[str, list[list[int]]]]:
        self._live[r.group_id] -= 1
        if self._live[r.group_id]:
            return []
        del self._live[r.group_id]
        done = self._done.pop(r.group_id, None)
        return [(r.prompt_id, done)] if done else []
