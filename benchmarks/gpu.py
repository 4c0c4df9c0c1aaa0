"""tailrl on a GPU, one command, one invocation: the figures of the GPU engine in one JSON line.

Sets up what it needs: the 0.5b stand-in of `small` (`small`'s tokens at Qwen2.5-0.5B's cost,
built into ``--standin-dir`` on first use; ``--model`` takes another stand-in, preset or
checkpoint directory). Then, on ``--device``:

1. The weight-read floor: a device-to-device copy's bandwidth (bytes read + written) and the
   model's weight bytes give the batch-1 decode bound, tokens/s = bandwidth / weight bytes.
2. Batch-1 greedy decode: one prompt, ``--decode-tokens`` new tokens (EOS ignored), after a
   warm-up call: tokens/s, with the decode steps replayed from CUDA graphs (the default on a
   GPU) and without (``cuda_graphs=False``: every kernel launched from Python), and without
   steps launched ahead (``async_scheduling=False``: each step waits for the last); the step's
   stages in ms (forward: launching it; sample: waiting for it, sampling, the copy back); on a
   GPU also with the MLP's activation computed inside the down projection
   (``decode_b1_fused_act_tok_s``: ``TAILRL_MATMUL_ACT_ROWS``, off by default; the same bits); on a
   GPU, at the very end of the run, ``--profile-steps`` more steps under ``torch.profiler``: two
   tables (by device time and by host time per operator) in the log. Last, because a process's
   CUDA calls stay slower after a profiler session: every timing comes before it.
3. The rollout: ``--prompts`` held-out task prompts x ``--n``, T=1, ``--max-tokens``; round 1
   (the history) then the timed round 2, for tailrl plain, plain without steps launched ahead
   (``plain_sync_s``, ``ahead_speedup``) and tailrl default speculation (each its own engine),
   and Hugging Face ``generate`` on the same model (bf16, sampling at
   T=1 without top-k, the batch padded on the left; after a 32-token call on the same batch).
   Per setting: the makespan; tailrl's responses compared with each other (the identical
   share: 1.0 means speculation changed no token and no log-probability's bits;
   ``identical_token_share``: tokens alone); one request alone against the same request in the
   batch, tokens and log-probabilities (``alone_equals_batch``). Then variants of speculation against plain:
   ``policy="fixed"`` (every request drafts 6 tokens at every step; also 3 and 12:
   ``best_fixed``, ``default_over_best_fixed``: #34 asks the default within 10%), the
   default with CUDA graphs up to 2048 tokens (``cuda_graph_max_tokens``; 2 GiB of graphs), the
   default with verify steps of up to 110 tokens sampling inside their graphs (``sample_graphs_64``:
   ``cuda_graph_sample_mib=64``; the default 8 MiB: 13 tokens at the 0.5b's vocabulary), the
   default with suffix trees of up to 4 paths (``trees_4``: ``max_tree_paths=4``),
   the default with every step one at a time (``ahead_above=0``: no plain steps launched ahead
   in the bulk) or the bulk's plain steps launched ahead above 16 or 256 rows (``ahead_16``,
   ``ahead_256``; the default 64), the tail always speculating (``tail_speculate``: the default
   measures which way its steps are faster, engine/tail_choice.py; ``tail_steps``: how many
   went each way), 16 or 64 rows drafting inside steps launched ahead (``drafts_ahead_16``,
   with the default split; ``drafts_ahead_16_all``, ``drafts_ahead_64_all``: every step
   launched ahead; engine/ahead_drafts.py; the rows draft where the rollout measures it faster,
   engine/drafts_gate.py, ``gate_steps``: how many steps went each way, ``gate_rates``: each
   way's last rate, tokens a second of the rows that gain least; ``..._always``: they
   always draft; ``follow_ups``: queries following up verifications, and hits; these run
   first, 64 rows always drafting first of all: on a CPU the fewest steps, 268 to plain's
   513), and plain and the default with attention's float32 FMA dots instead of tensor cores
   (``ieee_plain``, ``ieee_default``: ``TAILRL_ATTENTION_DOTS=ieee``, other bits). The
   first engine's rollout is also timed before any other engine is made
   (``plain_before_others_s``), and a new plain engine's after them (``plain_fresh_s``;
   ``default_over_fresh_plain``: the default against it). Each engine takes
   ``--gpu-memory-utilization``. Before each engine and each timed round the garbage of the
   parts before is collected and the device's cached memory released (``settle_heap``), so that
   no dropped engine's collection lands in a timed round; each timed round reports the caching
   allocator's device allocations and retries, and the kernels Triton compiled in it
   (``compiles``: new specialisations of tailrl's kernels); where steps launched ahead lose to waiting
   steps, one more round of the plain engine counts the operations that made the host wait
   for the device, by source line (``plain_sync_sites``); if the new engine is much faster,
   the first engine again with its graphs captured anew (``plain_recaptured_s``).
4. The no-tail bound T* = max(total tokens / saturated tokens/s, longest response x batch-1
   step time): saturated throughput from the plain engine on ``--bound-rows`` rows of
   ``--bound-tokens`` tokens each, EOS ignored; each makespan's ratio to T*.
5. Peak device memory (``torch.cuda.max_memory_allocated``); per timed rollout, the CUDA graph
   pool (the share of steps replayed, captures, the pool's bytes against its budget) and the
   speculator's host time per step (``timing_s/draft`` + ``timing_s/observe``) beside the step,
   and the engine's stages per step (``stage_ms``: where a host-bound bulk shows).
6. ``tailrl train configs/demo.yaml --set device=...`` for ``--train-steps`` steps (0: skipped):
   seconds per GRPO step (median), its rollout and update shares.
7. On a GPU, the batch-invariant matmul's cost: one forward's matmuls (per layer qkv, o,
   gate/up, down; the LM head) at M = 1, 64, 512 and 2048 rows, replayed from a CUDA graph,
   bfloat16, best of ``--matmul-reps``: through ``F.linear`` (cuBLAS, not invariant), through
   the engine's invariant path (cuBLAS for the shapes its probe found invariant, the Triton
   matmul for the others: kernels/gpu/stock.py) and through the Triton matmul alone; the
   ratios invariant / stock (#34 asks <= 1.15 for the whole step) and Triton / stock; which
   kernel each weight shape got (``stock_decisions``) and the probes' seconds.
8. On a GPU, `small`'s float64 greedy tokens there against the CPU engine's, ``--compare-prompts``
   prompts x ``--compare-tokens`` tokens: equal responses, and for the others the top-2 logit
   margin where they part (near-ties within 1e-6 counted).
A part that fails prints its traceback and is recorded in "errors"; the parts that do not need
its results still run (the exit status is then 1). With ``--partial-json PATH`` the figures so far
are written to PATH after every part (``"partial_after"``: the last part), so that a run cut
short by a time limit still leaves what it measured.

The last line is one JSON object: {"device", "model", "weights_gb", "copy_tb_s", "floor_tok_s",
"decode_b1_tok_s", "decode_b1_over_floor", "decode_b1_eager_tok_s", "decode_b1_sync_tok_s", "rollout": {"tokens",
"plain_s", "plain_sync_s", "ahead_speedup", "plain_sync_identical", "default_s", "hf_s", "default_speedup",
"plain_over_hf", "identical_share", "identical_token_share",
"accept_length", "variants": {"fixed", "fixed_3", "fixed_12", "graphs_2048", "one_at_a_time":
{"seconds", "speedup", ...}},
"best_fixed", "default_over_best_fixed", "bound_s",
"plain_over_bound", "default_over_bound", "steps": {"plain",
"default": {"steps", "step_ms", "spec_host_ms", "stage_ms", "graph_share", "graph_captures", "graph_mb",
"graph_budget_mb"}}}, "saturated_tok_s", "train": {"steps", "step_s", "rollout_s", "update_s"},
"matmul": {M: {"stock_ms", "invariant_ms", "triton_ms", "ratio", "triton_ratio"}, "stock_decisions",
"probe_s"}, "cpu_vs_gpu": {"equal", "differ", "near_ties",
"margins"}, "decode_b1_stage_ms", "peak_mem_gb", "errors", "seconds"}.

Usage (on the GPU machine; ``python3 setup.py build_ext --inplace`` first builds the CPU parts,
which the GPU path does not need):
  python benchmarks/gpu.py [--model 0.5b] [--prompts 64 --n 8 --max-tokens 512]
A smoke test of the script on a CPU: python benchmarks/gpu.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_round import (  # noqa: E402
    HISTORY_SEED,
    TIMED_SEED,
    allocator,
    compiled_kernels,
    rollout,
    rollout_args,
    settle_heap,
    step_figures,
    sync_sites,
)
from regime import model_dir  # noqa: E402

from tailrl import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from tailrl.model.loader import read_args  # noqa: E402
from tailrl.tasks import mixture  # noqa: E402


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mb: int = 256, reps: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    x = torch.empty(mb << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * reps / (time.perf_counter() - t0)


def hf_rollout(mdir: str, prompts: list[list[int]], a: argparse.Namespace, eos: tuple[int, ...]) -> tuple[float, int]:
    """Hugging Face generate on the same device: (seconds, useful tokens) of one rollout."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16).to(a.device).eval()
    rows = [p for p in prompts for _ in range(a.n)]
    width = max(map(len, rows))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=a.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=a.device)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              max_new_tokens=a.max_tokens, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 32})     # warm-up: the full batch's shapes
        sync(a.device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(a.device)
        seconds = time.perf_counter() - t0
    useful = 0
    for row in out[:, width:].tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos:
                n = i + 1
                break
        useful += n
    del model
    return seconds, useful


def layer_shapes(args) -> list[tuple[int, int]]:
    """A decoder layer's weights [N, K]: qkv, o, gate/up, down."""
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return [(q + 2 * kv, h), (h, q), (2 * args.intermediate_size, h), (h, args.intermediate_size)]


def matmul_cost(args, device: str, reps: int, ms=(1, 64, 512, 2048), triton=None) -> dict:
    """One forward's matmuls (``args``' shapes, bfloat16, each layer its own weights) at each M
    of ``ms``, replayed from a CUDA graph as the engine's steps are: milliseconds through
    ``F.linear`` (cuBLAS), the engine's invariant path (``TRITON.linear``: cuBLAS where probed
    invariant, else Triton) and the Triton matmul alone (``triton``: default
    ``matmul.linear``), best of ``reps``. A failed capture is reported, not raised."""
    import torch.nn.functional as F

    from tailrl.engine.graph_pool import cuda_capture
    from tailrl.kernels.gpu import matmul, stock
    from tailrl.kernels.gpu.backend import TRITON
    triton = triton or matmul.linear
    h, shapes = args.hidden_size, layer_shapes(args)
    layers = [[torch.randn(n, k, dtype=torch.bfloat16, device=device) for n, k in shapes]
              for _ in range(args.num_layers)]
    head = torch.randn(args.vocab_size, h, dtype=torch.bfloat16, device=device)
    t = time.perf_counter()
    TRITON.prepare([(w, None) for w in layers[0] + [head]])           # the probes, timed apart
    out: dict = {"probe_s": round(time.perf_counter() - t, 2)}
    for m in ms:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16, device=device) for k in {k for _, k in shapes}}

        def forward(lin) -> float:
            def fn() -> torch.Tensor:
                for weights in layers:
                    for w in weights:
                        lin(xs[w.shape[1]], w)
                return lin(xs[h], head)
            replay, _ = cuda_capture(fn)
            best = float("inf")
            for _ in range(reps):
                sync(device)
                t = time.perf_counter()
                replay()
                sync(device)
                best = min(best, time.perf_counter() - t)
            return best * 1e3
        try:
            ms_ = {name: forward(lin) for name, lin in (("stock", F.linear), ("invariant", TRITON.linear),
                                                         ("triton", triton))}
        except Exception as exc:                      # the capture or a kernel failed: say so, go on
            out[m] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        out[m] = {f"{k}_ms": round(v, 3) for k, v in ms_.items()}
        out[m].update(ratio=round(ms_["invariant"] / ms_["stock"], 3),
                      triton_ratio=round(ms_["triton"] / ms_["stock"], 3))
    out["stock_decisions"] = stock.decisions()
    return out


def cpu_vs_gpu(device: str, prompts: list[list[int]], tokens: int, tie: float = 1e-6) -> dict:
    """`small`'s greedy tokens in float64, on ``device`` and on the CPU, for ``prompts``: how
    many responses are equal, and for each that is not, the top-2 logit margin at the first
    token where they part (Hugging Face's float64 forward of the CPU response's prefix): a
    margin within ``tie`` is a near-tie that either device may break its own way."""
    import transformers

    from tailrl.tasks.models import get_model
    small = get_model("small")
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    run = lambda llm: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]   # noqa: E731
    gpu = run(LLM(small, dtype="float64", device=device, gpu_memory_utilization=0.1))
    cpu = run(LLM(small, dtype="float64"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(small, dtype=torch.float64).eval()
    margins = []
    for p, g, c in zip(prompts, gpu, cpu):
        if g == c:
            continue
        at = next(i for i, (x, y) in enumerate(zip(g, c)) if x != y)
        with torch.no_grad():
            logits = ref(torch.tensor([p + c[:at]])).logits[0, -1]
        top = torch.topk(logits, 2).values
        margins.append(float(top[0] - top[1]))
    return {"prompts": len(prompts), "tokens": tokens, "equal": len(prompts) - len(margins),
            "differ": len(margins), "near_ties": sum(m <= tie for m in margins),
            "margins": [float(f"{m:.3g}") for m in sorted(margins)]}


def train_steps(a: argparse.Namespace) -> dict:
    """``--train-steps`` GRPO steps of the demo config on ``--device``: median seconds per step,
    per rollout and per update."""
    import statistics
    import tempfile

    from tailrl.rl.config import load_config
    from tailrl.rl.trainer import Trainer
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"device={a.device}", f"total_steps={a.train_steps}", f"output_dir={tmp}", "progress=false",
                "log_tensorboard=false", "checkpoint_every=0"] + (["max_tokens=32"] if a.quick else [])
        rows = Trainer(load_config(HERE.parent / "configs" / "demo.yaml", over)).train(log_fn=lambda line: None)
    med = lambda key: round(statistics.median(r[key] for r in rows), 3)   # noqa: E731
    return {"steps": len(rows), "step_s": med("timing_s/step"), "rollout_s": med("timing_s/gen"),
            "update_s": med("timing_s/update")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rollout_args(ap)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--bound-rows", type=int, default=512)
    ap.add_argument("--bound-tokens", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                    help="each engine's share of the GPU (up to three are alive at once)")
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--variants", default="drafts_ahead_64_all_always,drafts_ahead_64_all,sample_graphs_64,"
                                          "trees_4,drafts_ahead_16,"
                                          "drafts_ahead_16_all,drafts_ahead_16_all_always,tail_speculate,fixed_12",
                    help="speculation's variants to run (comma-separated; '' for none)")
    ap.add_argument("--train-steps", type=int, default=3, help="GRPO steps of configs/demo.yaml (0: skip)")
    ap.add_argument("--matmul-reps", type=int, default=20)
    ap.add_argument("--compare-prompts", type=int, default=64, help="small's float64 greedy GPU vs CPU (0: skip)")
    ap.add_argument("--compare-tokens", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=32, help="batch-1 decode steps under torch.profiler (0: skip)")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 2, max 32: checks the script in a minute")
    ap.add_argument("--partial-json", default=None, help="after each part, the figures so far (JSON) to this file")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.n, a.max_tokens, a.decode_tokens, a.bound_rows, a.bound_tokens = 4, 2, 32, 16, 8, 16
        a.train_steps, a.compare_prompts, a.compare_tokens = min(a.train_steps, 1), 4, 16
    cuda = torch.device(a.device).type == "cuda"
    t_start = time.perf_counter()
    mdir = model_dir(a.model, Path(a.standin_dir))
    args = read_args(mdir)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(mdir)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
    out: dict = {"device": torch.cuda.get_device_name() if cuda else a.device,
                 "model": a.model}
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    errors: dict = {}

    def attempt(name: str, fn):
        """Run one part; a failure is printed and recorded (``errors``), and the parts that do
        not need its results still run."""
        try:
            return fn()
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name} failed: {errors[name]}", flush=True)
            return None
        finally:                      # what is measured so far survives a kill (a session's time limit)
            if a.partial_json:
                Path(a.partial_json).write_text(json.dumps({**out, "errors": errors, "partial_after": name}))

    # 1-2. the floor and batch-1 decode
    weights = args.num_parameters * 2
    bw = copy_bandwidth(a.device)
    out.update(weights_gb=round(weights / 1e9, 3), copy_tb_s=round(bw / 1e12, 3),
               floor_tok_s=round(bw / weights, 1))    # a decode step reads the weights once (at copy speed)
    greedy = SamplingParams(temperature=0.0, max_tokens=a.decode_tokens, ignore_eos=True)
    mem = {"gpu_memory_utilization": a.gpu_memory_utilization} if cuda else {}

    def decode(name: str = "", **kw) -> tuple[LLM, float]:
        settle_heap(a.device)
        llm = LLM(mdir, device=a.device, seed=0, **mem, **kw)
        llm.generate([prompts[0]], greedy)
        llm.generate([prompts[0]], greedy)
        m = llm.last_metrics                # where a step's time goes (forward: launching; sample: waits for it)
        out[f"decode_b1{name}_stage_ms"] = {
            k.split("/")[1]: round(v / a.decode_tokens * 1e3, 3) for k, v in m.items()
            if k.startswith("timing_s/") and k != "timing_s/gen"}
        return llm, m["timing_s/gen"] / a.decode_tokens

    plain, step_s = attempt("decode", decode) or (None, None)
    roll: dict = {}
    out["rollout"] = roll

    def timed(llm: LLM) -> tuple[list, float, dict]:
        """The timed round of ``llm`` (its history round before it): outputs, seconds, and its
        step figures with the allocator's device allocations and retries during it."""
        rollout(llm, prompts, a, HISTORY_SEED)
        settle_heap(a.device)
        before = {**allocator(), "compiles": compiled_kernels()} if cuda else {}
        got, secs = rollout(llm, prompts, a, TIMED_SEED)
        after = {**allocator(), "compiles": compiled_kernels()} if cuda else {}
        return got, secs, {**step_figures(llm.last_metrics), **{k: after[k] - before[k] for k in after}}

    def plain_first() -> None:
        """The first engine's rollout before any other engine is made: the H200 run of stop 46
        timed it 2.1x slower after three other engines had come and gone than an engine made
        later, and its batch-1 graph launches 263 us at the end against 0.23 ms steps at the
        start (made before them, or slowed by them?)"""
        _, secs, figures = timed(plain)
        roll.update(plain_before_others_s=round(secs, 3), plain_before_others_step_ms=figures.get("step_ms"))
        print(f"rollout: plain, the first engine before any other {secs:.2f} s", flush=True)
    if plain is not None:
        attempt("rollout_plain_first", plain_first)
    eager_s = (attempt("decode_eager", lambda: decode("_eager", cuda_graphs=False)) or (None, None))[1]
    # without steps launched ahead (engine/ahead.py): each step waits for the one before it
    sync_s = (attempt("decode_sync", lambda: decode("_sync", async_scheduling=False)) or (None, None))[1]

    def fused_act() -> float | None:   # the down projection computing the MLP's activation (ACT_ROWS)
        from tailrl.kernels.gpu import backend as gpu_backend
        from tailrl.kernels.gpu import matmul
        if gpu_backend.ACT_ROWS:
            return None
        gpu_backend.ACT_ROWS = matmul.TILES.bm
        try:
            return decode("_fused_act")[1]
        finally:
            gpu_backend.ACT_ROWS = 0
    act_s = attempt("decode_fused_act", fused_act) if cuda else None
    if act_s:
        out["decode_b1_fused_act_tok_s"] = round(1 / act_s, 1)
        print(f"batch-1 decode with the activation inside the down projection {1 / act_s:.0f} tokens/s", flush=True)
    if step_s:
        out.update(decode_b1_tok_s=round(1 / step_s, 1), decode_b1_over_floor=round(1 / step_s / (bw / weights), 3))
        print(f"batch-1 decode {1 / step_s:.0f} tokens/s; weight-read floor {bw / weights:.0f} tokens/s "
              f"({weights / 1e9:.2f} GB of weights, copy {bw / 1e12:.2f} TB/s)", flush=True)
    if eager_s:
        out["decode_b1_eager_tok_s"] = round(1 / eager_s, 1)
        print(f"batch-1 decode without CUDA graphs {1 / eager_s:.0f} tokens/s", flush=True)
    if sync_s:
        out["decode_b1_sync_tok_s"] = round(1 / sync_s, 1)
        print(f"batch-1 decode without steps launched ahead {1 / sync_s:.0f} tokens/s", flush=True)

    def profile() -> None:
        """Where a batch-1 decode step's time goes, operator by operator (host and device)."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        steps = SamplingParams(temperature=0.0, max_tokens=a.profile_steps, ignore_eos=True)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            plain.generate([prompts[0]], steps)
        table = prof.key_averages()
        for key in ("self_device_time_total", "self_cpu_time_total"):
            print(f"batch-1 decode, {a.profile_steps} steps, by {key}:\n"
                  + table.table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)

    # 3. the rollout
    def engine(**kw) -> LLM:
        settle_heap(a.device)
        return LLM(mdir, device=a.device, seed=0, **mem, **kw)

    def rollouts() -> None:
        plain_out, plain_s, figures = timed(plain)
        steps = {"plain": figures}
        lengths = [len(x[0]) for xs in plain_out for x in xs]
        roll.update(tokens=sum(lengths), max_length=max(lengths), plain_s=round(plain_s, 3), steps=steps)
        # one request alone against the same request in the batch
        alone, _ = rollout(plain, prompts[:1], a, TIMED_SEED)
        roll["alone_equals_batch"] = alone[0] == plain_out[0]
        print(f"rollout: plain {plain_s:.2f} s, {sum(lengths)} tokens; a request alone equals it in the batch: "
              f"{roll['alone_equals_batch']}", flush=True)

        def plain_sync() -> None:           # plain without steps launched ahead (engine/ahead.py)
            got, secs, steps["plain_sync"] = timed(engine(async_scheduling=False))
            roll.update(plain_sync_s=round(secs, 3), ahead_speedup=round(secs / plain_s, 3),
                        plain_sync_identical=got == plain_out)
            print(f"rollout: plain without steps ahead {secs:.2f} s ({secs / plain_s:.2f}x the plain time); "
                  f"identical {got == plain_out}", flush=True)
            # a new engine stepping ahead, made after the others: the first engine's history, or not?
            _, fresh_s, steps["plain_fresh"] = timed(engine())
            roll["plain_fresh_s"] = round(fresh_s, 3)
            print(f"rollout: plain, a new engine stepping ahead {fresh_s:.2f} s", flush=True)
            if cuda and secs < plain_s:     # steps launched ahead lost: where did the host wait for the GPU?
                roll["plain_sync_sites"] = sync_sites(plain, prompts, a)
                print(f"synchronising operations of the plain rollout: {json.dumps(roll['plain_sync_sites'])}",
                      flush=True)
                if fresh_s < 0.8 * plain_s:     # the first engine is slow: its graphs, or the rest of it?
                    from tailrl.engine.graphs import warm_up
                    e = plain.engine
                    e.runner.graphs.pool.clear()
                    warm_up(e.runner.graphs, e.config, False)   # captured again, now that every kernel is loaded
                    _, again_s, steps["plain_recaptured"] = timed(plain)
                    roll["plain_recaptured_s"] = round(again_s, 3)
                    print(f"rollout: plain, the first engine with its graphs captured again {again_s:.2f} s",
                          flush=True)
        attempt("rollout_plain_sync", plain_sync)
        spec = engine(speculative=SpeculativeConfig())
        spec_out, spec_s, steps["default"] = timed(spec)
        pairs = [(x, y) for xs, ys in zip(plain_out, spec_out) for x, y in zip(xs, ys)]
        if "plain_fresh_s" in roll:      # against an engine made as recently as this one
            roll["default_over_fresh_plain"] = round(roll["plain_fresh_s"] / spec_s, 3)
        roll.update(default_s=round(spec_s, 3), default_speedup=round(plain_s / spec_s, 3),
                    identical_share=sum(x == y for x, y in pairs) / len(pairs),
                    identical_token_share=sum(x[0] == y[0] for x, y in pairs) / len(pairs),
                    accept_length=round(spec.last_metrics.get("rollout/spec_accept_length", 0.0), 2))
        print(f"rollout: plain {plain_s:.2f} s, default {spec_s:.2f} s ({plain_s / spec_s:.2f}x), identical "
              f"{roll['identical_share']:.3f}; steps {json.dumps(steps)}", flush=True)
        del spec
        # against the default: every request drafting a fixed depth at every step; graphs up to
        # 2048 tokens (verify steps of a full batch replayed instead of launched from Python)
        variants = {
                    # 16 or 64 rows drafting inside steps launched ahead (engine/ahead_drafts.py),
                    # with the default split, or with every step launched ahead (ahead_above=1);
                    # where the rollout measures drafting faster (engine/drafts_gate.py), or always
                    # (first: the question the next GPU run answers, before a time limit can stop it)
                    "drafts_ahead_16": (SpeculativeConfig(ahead_drafts=16), {}),
                    "drafts_ahead_16_all": (SpeculativeConfig(ahead_drafts=16, ahead_above=1), {}),
                    "drafts_ahead_16_all_always": (SpeculativeConfig(ahead_drafts=16, ahead_above=1,
                                                                     ahead_drafts_gate="always"), {}),
                    "drafts_ahead_64_all": (SpeculativeConfig(ahead_drafts=64, ahead_above=1), {}),
                    "drafts_ahead_64_all_always": (SpeculativeConfig(ahead_drafts=64, ahead_above=1,
                                                                     ahead_drafts_gate="always"), {}),
                    "fixed": (SpeculativeConfig(policy="fixed"), {}),
                    "fixed_3": (SpeculativeConfig(policy="fixed", max_draft_tokens=3), {}),
                    "fixed_12": (SpeculativeConfig(policy="fixed", max_draft_tokens=12), {}),
                    "graphs_2048": (SpeculativeConfig(), {"cuda_graph_max_tokens": 2048, "cuda_graph_gib": 2.0}),
                    # verify steps of up to 110 tokens sampling inside their graphs (the default: 13)
                    "sample_graphs_64": (SpeculativeConfig(), {"cuda_graph_sample_mib": 64.0}),
                    # the priced default with suffix trees of up to 4 paths (the allocator takes a
                    # side branch's nodes only where the measured curve makes them pay: a GPU's flat
                    # one should; on the CPU they did not, docs/speculation.md)
                    "trees_4": (SpeculativeConfig(max_tree_paths=4), {}),
                    "one_at_a_time": (SpeculativeConfig(ahead_above=0), {}),
                    # the tail always speculating (its steps not chosen by measurement: engine/tail_choice.py)
                    "tail_speculate": (SpeculativeConfig(tail="speculate"), {}),
                    # the bulk's plain steps launched ahead above 16 or 256 rows (the default: 64)
                    "ahead_16": (SpeculativeConfig(ahead_above=16), {}),
                    "ahead_256": (SpeculativeConfig(ahead_above=256), {}),
                    # attention's float32 FMA dots instead of tensor cores (other bits: the share
                    # identical to plain compares the two kernels, not speculation)
                    "ieee_plain": (None, {"dots": "ieee"}),
                    "ieee_default": (SpeculativeConfig(), {"dots": "ieee"})}
        roll["variants"] = {}
        for name, (cfg, kw) in variants.items():
            if name not in a.variants.split(","):
                continue
            def variant() -> None:
                from tailrl.kernels.gpu import backend as gpu_backend
                opts = dict(kw)
                dots, before = opts.pop("dots", gpu_backend.DOTS), gpu_backend.DOTS
                gpu_backend.DOTS = dots         # read at every launch: set for the engine's whole life
                try:
                    llm = engine(speculative=cfg, **opts)
                    got, secs, figures = timed(llm)
                finally:
                    gpu_backend.DOTS = before
                same = [x == y for xs, ys in zip(plain_out, got) for x, y in zip(xs, ys)]
                roll["variants"][name] = {
                    "seconds": round(secs, 3), "speedup": round(plain_s / secs, 3),
                    "identical_share": sum(same) / len(same),
                    "accept_length": round(llm.last_metrics.get("rollout/spec_accept_length", 0.0), 2),
                    "gate_steps": {w: int(llm.last_metrics[f"rollout/ahead_{w}_steps"]) for w in ("draft", "plain")
                                   if f"rollout/ahead_{w}_steps" in llm.last_metrics},
                    "gate_rates": {w: round(llm.last_metrics[f"rollout/ahead_{w}_rate"], 1) for w in ("draft", "plain")
                                   if f"rollout/ahead_{w}_rate" in llm.last_metrics},
                    "follow_ups": {k: int(llm.last_metrics.get(f"rollout/ahead_follow_{k}", 0))
                                   for k in ("ups", "hits")},
                    "steps": figures}
                print(f"rollout: {name} {secs:.2f} s ({plain_s / secs:.2f}x plain): {roll['variants'][name]}",
                      flush=True)
            attempt(f"rollout_{name}", variant)
        fixed = {k: v["seconds"] for k, v in roll["variants"].items() if k.startswith("fixed")}
        if fixed:                     # #34: the default within 10% of the best fixed depth
            best = min(fixed, key=fixed.get)
            roll.update(best_fixed=best, default_over_best_fixed=round(fixed[best] / spec_s, 3))

    if plain is not None:
        attempt("rollout", rollouts)

    # 4. the no-tail bound
    def no_tail_bound() -> None:
        rows = max(1, a.bound_rows // a.n)
        fill = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.bound_tokens, ignore_eos=True, seed=1)
        plain.generate([prompts[i % len(prompts)] for i in range(rows)], fill)
        saturated = plain.last_metrics["perf/tokens_per_s"]
        bound = max(roll["tokens"] / saturated, roll["max_length"] * step_s)
        roll.update(bound_s=round(bound, 3), plain_over_bound=round(roll["plain_s"] / bound, 3))
        if "default_s" in roll:
            roll["default_over_bound"] = round(roll["default_s"] / bound, 3)
        out["saturated_tok_s"] = round(saturated, 1)

    if plain is not None and "tokens" in roll:
        attempt("bound", no_tail_bound)

    def hf() -> None:
        hf_s, hf_tokens = hf_rollout(mdir, prompts, a, args.eos_token_ids)
        roll.update(hf_s=round(hf_s, 3), hf_tokens=hf_tokens)
        if "plain_s" in roll:
            roll["plain_over_hf"] = round(roll["plain_s"] / hf_s, 3)
        print(f"Hugging Face generate: {hf_s:.2f} s ({hf_tokens} useful tokens)", flush=True)

    if not a.no_hf:
        attempt("hf", hf)
    if cuda:
        out["matmul"] = attempt("matmul", lambda: matmul_cost(args, a.device, a.matmul_reps))
        print(f"invariant matmul / cuBLAS per forward: {out['matmul']}", flush=True)
    if a.train_steps > 0:
        out["train"] = attempt("train", lambda: train_steps(a))
        print(f"tailrl train configs/demo.yaml on {a.device}: {out['train']}", flush=True)
    if cuda and a.compare_prompts > 0:
        out["cpu_vs_gpu"] = attempt("cpu_vs_gpu", lambda: cpu_vs_gpu(
            a.device, (prompts * a.compare_prompts)[:a.compare_prompts], a.compare_tokens))
        print(f"small, float64 greedy, GPU vs CPU: {out['cpu_vs_gpu']}", flush=True)
    # last: after a profiler session, this process's CUDA calls stay slower (measured on the H100:
    # the plain rollout 2.55 s right after it, 1.49-1.62 s in benchmarks/step_profile.py's process)
    if plain is not None and a.profile_steps > 0 and cuda:
        attempt("profile", profile)
    plain = None
    if cuda:
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    if errors:
        out["errors"] = errors
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
