"""The trainer's policy: a Hugging Face causal LM, its teacher-forced log-probabilities, and
the hand-over of its weights to the rollout engine."""
from __future__ import annotations

import contextlib
import copy
import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def native_bf16(device: torch.device | str) -> bool:
    """Whether bfloat16 matmuls run at least as fast as float32 on ``device``: on a GPU, and on
    an x86 CPU with AVX512 (oneDNN's bfloat16 kernels; AVX512-BF16 and AMX among them). On an
    AVX2-only CPU PyTorch's bfloat16 matmul was 6-8x slower than float32 (2,048 x 256 x 1,024:
    87 vs 13 ms, AMD EPYC znver3, torch 2.13), and the demo's update 40-85 s a step against
    1-4 s without autocast; elsewhere (ARM, other CPUs) it has not been measured: off."""
    if torch.device(device).type != "cpu":
        return True
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve_autocast(setting: bool | str, device: torch.device | str) -> bool:
    """The config's ``autocast`` (true, false or "auto") as a decision for ``device``; "auto"
    is on where bfloat16 is native (``native_bf16``). Logged, since it shapes the update."""
    on = native_bf16(device) if setting == "auto" else bool(setting)
    why = "" if setting != "auto" else (" (bfloat16 native here)" if on else
                                         f" (CPU capability {torch.backends.cpu.get_cpu_capability()}: "
                                         "bfloat16 matmuls are emulated, slower than float32)")
    log.info("policy update: bfloat16 autocast %s%s", "on" if on else "off", why)
    return on


def load_policy(model_dir: str, dtype: str = "float32", attn_implementation: str = "eager") -> torch.nn.Module:
    """Eager attention: for the update's short sequences it is the fastest on CPU (the demo's
    update, bfloat16 autocast: SDPA's CPU flash kernel 0.21 s forward + 0.52 s backward, eager
    0.20 + 0.32 s; its flash backward alone was 38% of the update)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model.train()


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Right-padded prompt+response rows. Returns input ids [B, L], attention mask [B, L],
    response mask [B, R] and the offset ``start`` such that response token j of row b is
    predicted by the logits at position prompt_len(b) - 1 + j."""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, rows))
    resp_width = max(max(map(len, responses)), 1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp_mask = torch.zeros((len(rows), resp_width))
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        attn[b, : len(row)] = 1
        resp_mask[b, : len(responses[b])] = 1
    return ids, attn, resp_mask, resp_width


def response_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                      temperature: float, pad_id: int = 0, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(response token | prompt, previous tokens) at ``temperature``, teacher-forced, on
    the model's device (the batch built on the host, copied once); ``autocast``: the forward
    (and so its backward) in bfloat16 autocast, the log-softmax in at least float32. Returns
    (logp [B, R], mask [B, R]); padded positions hold 0 and mask 0."""
    device = next(model.parameters()).device
    ids, attn, mask, resp_width = (t.to(device) if isinstance(t, torch.Tensor) else t
                                   for t in pad_batch(prompts, responses, pad_id))
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast:
        logits = model(input_ids=ids, attention_mask=attn).logits             # [B, L, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    B = ids.shape[0]
    # position of the logits that predict response token j of row b: prompt_len(b) - 1 + j
    plen = torch.tensor([len(p) for p in prompts]).to(device)              # [B]
    pos = (plen[:, None] - 1 + torch.arange(resp_width, device=device)[None, :]).clamp(max=ids.shape[1] - 1)   # [B, R]
    tgt_pos = (pos + 1).clamp(max=ids.shape[1] - 1)
    targets = ids.gather(1, tgt_pos)                                          # [B, R]
    logp = logp_all[torch.arange(B, device=device)[:, None], pos, targets]     # [B, R]
    return logp * mask.to(logp.dtype), mask.to(logp.dtype)


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached weights under Hugging Face names, what ``LLM.load_weights`` takes."""
    return {k: v.detach() for k, v in model.state_dict().items()}


class _WithValues(torch.autograd.Function):
    """``values`` forward, the gradient to ``ref`` (see ``with_values``)."""

    @staticmethod
    def forward(ctx, ref: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def with_values(ref: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``values`` (bit for bit: not ``ref + (values - ref)``, which rounds)
    whose gradient flows to ``ref`` as if it were ``ref``: the engine kernels' exact
    log-probabilities with the gradient of the policy's own forward (the two differ by the
    rounding of bfloat16 weights and kernels, so the gradient is the reference's at nearly the
    same point)."""
    return _WithValues.apply(ref, values.to(ref.dtype))
