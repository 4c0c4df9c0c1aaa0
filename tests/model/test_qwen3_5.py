"""Qwen3.5 (Qwen3_5ForCausalLM, and the language model of Qwen3_5ForConditionalGeneration),
Qwen3.5-MoE (Qwen3_5MoeForCausalLM: Qwen2-MoE's mixture in every layer) and Qwen3-Next (the same
layers, its projections fused per key head): three layers of four
Gated DeltaNet with a recurrent state per request (model/deltanet.py, engine/kv/states.py), the
fourth attention with an output gate. Configs read as transformers reads them; logits and greedy
generation Hugging Face's; speculation lossless in bfloat16 and float64 and a request alone the
same as in a batch (a group's samples starting from the states their prompt left in a sibling),
through chunked prefill, preemption and migration; the scorer's log-probabilities the rollout's;
what the states can not do refused by name."""
import dataclasses
import os

import pytest
import torch
import transformers
from parity import assert_fields_make_hf_logits, our_logits

from tailrl import LLM, EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.engine.score import Scorer
from tailrl.model.args import parse_config
from tailrl.model.transformer import Transformer

PROMPTS = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41], [7] * 12, list(range(3, 60))]


@pytest.fixture(scope="module")
def path(ckpt_dir):
    return ckpt_dir("qwen3_5", num_layers=4)


def outputs(outs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_the_config_is_read_as_transformers_reads_it():
    hf = transformers.Qwen3_5TextConfig()
    a = parse_config({"architectures": ["Qwen3_5ForCausalLM"]})
    assert a.linear_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention")
    assert len(a.linear_layers) == 24 and a.attention_layers == (3, 7, 11, 15, 19, 23, 27, 31)
    assert a.linear_dims == (hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                             hf.linear_value_head_dim, hf.linear_conv_kernel_dim)
    assert a.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert a.rope_theta == hf.rope_parameters["rope_theta"] and a.norm_plus_one and a.attn_output_gate
    assert a.kv_bytes_per_token == 2 * 8 * hf.num_key_value_heads * hf.head_dim
    with torch.device("meta"):
        hf_model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(num_hidden_layers=4, vocab_size=512))
    small = parse_config({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4, "vocab_size": 512})
    ours = sum(p.numel() for p in Transformer(small, 1, torch.bfloat16, "meta").parameters())
    stacked = (small.num_heads + small.num_kv_heads - 2) * small.head_dim      # our q/k norms: a weight per head
    assert small.num_parameters == ours == sum(p.numel() for p in hf_model.parameters()) + stacked
    vl = parse_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "eos_token_id": 7,
                       "text_config": {"num_hidden_layers": 8}})
    assert vl.architecture == "Qwen3_5ForConditionalGeneration" and vl.num_layers == 8 and vl.eos_token_ids == (7,)
    with pytest.raises(ValueError, match="layer_types"):
        parse_config({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 2,
                      "layer_types": ["linear_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        parse_config({"architectures": ["Qwen3_5ForCausalLM"], "linear_num_value_heads": 24})
    with pytest.raises(ValueError, match="linear_conv_kernel_dim"):
        parse_config({"architectures": ["Qwen3_5ForCausalLM"], "linear_conv_kernel_dim": 32})
    with pytest.raises(ValueError, match="attention_bias"):
        parse_config({"architectures": ["Qwen3_5ForCausalLM"], "attention_bias": True})


def test_the_mixtures_config_is_read_as_transformers_reads_it():
    hf = transformers.Qwen3_5MoeTextConfig()
    a = parse_config({"architectures": ["Qwen3_5MoeForCausalLM"]})
    assert (a.num_experts, a.experts_per_token, a.moe_intermediate_size, a.shared_expert_size) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.shared_expert_intermediate_size)
    assert a.sparse_layers == tuple(range(hf.num_hidden_layers)) and a.norm_topk_prob and a.shared_expert_gate
    assert a.linear_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention")
    small = dict(num_hidden_layers=4, vocab_size=512, num_experts=16)
    ours = sum(p.numel() for p in Transformer(parse_config({"architectures": ["Qwen3_5MoeForCausalLM"], **small}), 1,
                                              torch.bfloat16, "meta").parameters())
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3_5MoeForCausalLM(
            transformers.Qwen3_5MoeTextConfig(**small)).parameters())
    assert ours == theirs + (hf.num_attention_heads + hf.num_key_value_heads - 2) * hf.head_dim


def test_the_mixtures_logits_are_hugging_faces_and_its_speculation_lossless(ckpt_dir, monkeypatch):
    moe = ckpt_dir("qwen3_5_moe")
    assert_fields_make_hf_logits(moe, monkeypatch, dict(norm_topk_prob=False))
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=32, ignore_eos=True, seed=3)
    plain = LLM(moe)
    want = [outputs(plain.generate(PROMPTS, sp)) for _ in range(2)]
    spec = LLM(moe, speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    assert [outputs(spec.generate(PROMPTS, sp)) for _ in range(2)] == want
    assert spec.last_metrics["rollout/spec_accepted_tokens"] > 0


def test_qwen3_next_is_read_as_transformers_reads_it_and_gives_its_logits_losslessly(ckpt_dir, monkeypatch):
    """Qwen3-Next: the same layers, the DeltaNet's projections fused per key head in the checkpoint
    (loaded into our [q | k | v | z | b | a] by a row order), Qwen2-MoE's mixture where
    decoder_sparse_step and mlp_only_layers put it."""
    hf = transformers.Qwen3NextConfig()
    a = parse_config({"architectures": ["Qwen3NextForCausalLM"]})
    assert a.deltanet_grouped and a.linear_layers == tuple(i for i, t in enumerate(hf.layer_types)
                                                           if t == "linear_attention")
    assert (a.num_experts, a.experts_per_token, a.shared_expert_size, a.rotary_dim, a.vocab_size) == (
        hf.num_experts, hf.num_experts_per_tok, hf.shared_expert_intermediate_size, 64, hf.vocab_size)
    small = dict(num_hidden_layers=4, vocab_size=512, num_experts=16, mlp_only_layers=[2])
    args = parse_config({"architectures": ["Qwen3NextForCausalLM"], **small})
    assert args.sparse_layers == (0, 1, 3)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3NextForCausalLM(
            transformers.Qwen3NextConfig(**small)).parameters())
    assert args.num_parameters == theirs + (hf.num_attention_heads + hf.num_key_value_heads - 2) * hf.head_dim
    nxt = ckpt_dir("qwen3_next")
    assert_fields_make_hf_logits(nxt, monkeypatch, dict(norm_plus_one=False))
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=32, ignore_eos=True, seed=3)
    want = [outputs(LLM(nxt).generate(PROMPTS, sp))] * 2
    spec = LLM(nxt, speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    assert [outputs(spec.generate(PROMPTS, sp)) for _ in range(2)] == want
    assert spec.last_metrics["rollout/spec_accepted_tokens"] > 0


def test_logits_are_hugging_faces_and_its_norms_and_rope_are_what_makes_them(path, monkeypatch):
    assert_fields_make_hf_logits(path, monkeypatch, dict(norm_plus_one=False), dict(rotary_dim=0))


def test_the_image_text_models_language_model_is_loaded_its_vision_and_mtp_skipped(path, tmp_path):
    text = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = transformers.Qwen3_5Config(text_config=text.config.to_dict(),
                                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                        out_hidden_size=text.config.hidden_size))
    vl = transformers.Qwen3_5ForConditionalGeneration(cfg)
    vl.model.language_model.load_state_dict(text.model.state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    vl.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file
    file = os.path.join(tmp_path, "model.safetensors")
    state = load_file(file)
    assert any(k.startswith("model.visual.") for k in state)
    state["mtp.fc.weight"] = torch.zeros(4, 4)                          # a published checkpoint's MTP module
    save_file(state, file, metadata={"format": "pt"})
    tokens = list(range(3, 40))
    with torch.no_grad():
        ref = text(torch.tensor([tokens])).logits[0]
    assert (our_logits(str(tmp_path), tokens) - ref).abs().max().item() < 1e-4


def test_greedy_generation_is_hugging_faces(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32")
    for prompt in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert out[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_speculation_is_lossless_and_a_request_alone_is_itself_in_a_batch(path, dtype):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=40, ignore_eos=True, seed=3)
    plain = LLM(path, dtype=dtype)
    want = [outputs(plain.generate(PROMPTS, sp)) for _ in range(2)]
    assert want[0] == want[1]
    spec = LLM(path, dtype=dtype, speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    for w in want:                                  # the second round drafts from the first's history
        assert outputs(spec.generate(PROMPTS, sp)) == w
    assert spec.last_metrics["rollout/spec_accepted_tokens"] > 0
    one = LLM(path, dtype=dtype, max_num_seqs=1)               # no sibling running: each prefills its prompt
    assert outputs(one.generate(PROMPTS, sp)) == want[0]
    assert one.last_metrics["rollout/batched_tokens"] == sum(3 * (len(p) + 39) for p in PROMPTS)
    # a group's prompt computed once: the siblings start from the lender's snapshot of its states
    assert plain.last_metrics["rollout/batched_tokens"] == sum(len(p) + 2 + 3 * 39 for p in PROMPTS)


def test_steps_launched_ahead_then_a_speculative_tail_give_the_same_tokens(path):
    """Plain steps launched ahead in the bulk (their states advanced in launch order), speculative
    steps one at a time in the tail (a row that verified sits out the step launched before its
    acceptance is known): tokens and log-probabilities those of plain decoding one step at a time."""
    sp = [SamplingParams(n=3, temperature=1.0, max_tokens=m, ignore_eos=True, seed=3) for m in (10, 20, 60, 40)]
    want = outputs(LLM(path).generate(PROMPTS, sp))
    assert outputs(LLM(path, async_scheduling=True).generate(PROMPTS, sp)) == want
    llm = LLM(path, async_scheduling=True, speculative=SpeculativeConfig(policy="fixed", ahead_above=6,
                                                                         tail="speculate"))
    assert [outputs(llm.generate(PROMPTS, sp)) for _ in range(2)] == [want, want]
    assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("ahead", [False, True], ids=["waiting", "ahead"])
def test_plain_steps_from_graphs_give_eager_steps_tokens_and_verify_steps_stay_eager(path, dtype, ahead):
    """Steps replayed from graphs' static inputs (engine/graphs.py; on a CPU the capture is an
    eager call over the same buffers): a bucket stages its rows' runs beside the tokens, every
    run past the step's of no tokens, so its padding moves no row's states; steps that verify
    drafts take no bucket (their nodes' kept inputs vary). Tokens and log-probabilities those of
    eager plain decoding, one step at a time and launched ahead, and a speculative engine's."""
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, eager_capture
    from tailrl.engine.graphs import StepGraphs, warm_up

    def with_graphs(llm):
        e = llm.engine
        e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64))
        warm_up(e.runner.graphs, e.config, e.speculator is not None)   # padding steps before any real one
        return e.runner.graphs

    sp = [SamplingParams(n=3, temperature=1.0, max_tokens=m, ignore_eos=True, seed=3) for m in (10, 20, 60, 40)]
    want = outputs(LLM(path, dtype=dtype).generate(PROMPTS, sp))
    plain = LLM(path, dtype=dtype, async_scheduling=ahead)
    graphs = with_graphs(plain)
    assert [outputs(plain.generate(PROMPTS, sp)) for _ in range(2)] == [want, want]
    assert plain.last_metrics["graphs/replayed_steps"] > 20 and all(b.seqs is not None for b in graphs._static.values())
    # a speculative engine's bulk stepped plainly and ahead (above 6 requests), its tail verifying
    spec = LLM(path, dtype=dtype, async_scheduling=True, speculative=SpeculativeConfig(policy="fixed", ahead_above=6,
                                                                                        tail="speculate"))
    graphs = with_graphs(spec)
    assert [outputs(spec.generate(PROMPTS, sp)) for _ in range(2)] == [want, want]
    m = spec.last_metrics
    assert m["rollout/spec_accepted_tokens"] > 0 and m["graphs/replayed_steps"] > 0
    assert m["graphs/replayed_steps"] < m["rollout/num_forward"] - 5       # the verify steps ran eagerly


def test_chunked_prefill_preemption_and_migration_give_the_same_tokens(path):
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True, seed=5)
    want = outputs(LLM(path, dtype="float64").generate(PROMPTS, sp))
    small = LLM(path, dtype="float64", max_model_len=128, kv_cache_tokens=300)
    assert outputs(small.generate(PROMPTS, sp)) == want
    assert small.last_metrics["rollout/preemptions"] > 0
    chunked = LLM(path, dtype="float64", max_num_batched_tokens=16)   # prompts prefilled in chunks, snapshots inside
    assert outputs(chunked.generate(PROMPTS, sp)) == want
    src, dst = (LLMEngine(EngineConfig(model=path, dtype="float64")) for _ in range(2))
    req = Request("x", PROMPTS[3], SamplingParams(max_tokens=30, ignore_eos=True, seed=5), seed_key=3)
    ref = Request("x", PROMPTS[3], SamplingParams(max_tokens=30, ignore_eos=True, seed=5), seed_key=3)
    solo = LLMEngine(EngineConfig(model=path, dtype="float64"))
    solo.add_request(ref)
    while solo.has_unfinished():
        solo.step()
    src.add_request(req)
    for _ in range(6):
        src.step()
    state = src.export_request("x")
    assert state.kv is None and len(state.output_token_ids) > 0       # the states do not travel: recomputed
    moved = dst.import_request(state)
    while dst.has_unfinished():
        dst.step()
    assert moved.output_token_ids == ref.output_token_ids and moved.output_logprobs == ref.output_logprobs


def test_the_scorers_log_probabilities_are_the_rollouts(path):
    llm = LLM(path, dtype="bfloat16")
    outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=30, ignore_eos=True, seed=1))
    prompts = [o.prompt_token_ids for o in outs for _ in o.outputs]
    responses = [c.token_ids for o in outs for c in o.outputs]
    got = Scorer(path, dtype="bfloat16").logprobs(prompts, responses)
    assert got == [c.logprobs for o in outs for c in o.outputs]


def test_what_the_states_can_not_do_is_refused_by_name(path):
    with pytest.raises(ValueError, match="max_tree_paths"):
        LLM(path, speculative=SpeculativeConfig(max_tree_paths=3))
    with pytest.raises(ValueError, match="ahead_drafts"):
        LLM(path, speculative=SpeculativeConfig(ahead_drafts=2))
    llm = LLM(path)
    assert llm.engine.kv.prefix is None and llm.engine.kv.data.shape[0] == 2          # K/V of its 2 attention layers
    assert dataclasses.astuple(llm.engine.args)[0] == "Qwen3_5ForCausalLM"


def test_the_states_of_rows_no_request_ran_in_take_no_memory():
    """Qwen3.5-9B's shapes, 64 rows: 6 GiB of states and snapshots allocated, a few MiB resident
    until requests run there (each row is written before it is read)."""
    from tailrl.engine.kv.states import RecurrentStates

    def resident() -> int:                                  # bytes (Linux)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    args = parse_config({"architectures": ["Qwen3_5ForCausalLM"]})
    before = resident()
    states = RecurrentStates(args, torch.bfloat16, "cpu", 64)
    assert states.bytes == 0 and states.conv.shape[1] == 64 and states.bytes > 6 * 2**30
    assert resident() - before < 64 * 2**20


def test_the_states_memory_goes_back_with_the_caches_and_comes_back_as_it_was(path):
    llm = LLM(path)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, ignore_eos=True, seed=2)
    want = outputs(llm.generate(PROMPTS, sp))
    states = llm.engine.kv.states
    assert states.bytes == states.conv.numel() * 2 + states.ssm.numel() * 4 > 0      # bf16 conv, float32 ssm
    llm.engine.free_cache()
    assert states.bytes == 0 and llm.engine.kv.bytes == 0
    assert outputs(llm.generate(PROMPTS, sp)) == want and states.bytes > 0


def test_a_gpus_budget_counts_the_recurrent_states_of_max_num_seqs_rows(monkeypatch):
    """On a (faked) 80 GiB GPU, Qwen3.5 of transformers' default shape (9B-style): the K/V budget is
    what the weights, a step's activations, the graphs and the states of max_num_seqs rows (with
    their snapshots: 96 MiB a row at 24 DeltaNet layers) leave; too many rows is a ValueError
    naming max_num_seqs."""
    from tailrl.engine.kv import budget as kv_budget
    from tailrl.engine.kv.states import RecurrentStates
    args = parse_config({"architectures": ["Qwen3_5ForCausalLM"]})
    assert RecurrentStates.row_bytes(args, 2) == 2 * 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    monkeypatch.setattr(kv_budget, "device_memory", lambda device: (80 * 2**30, 80 * 2**30))
    cfg = EngineConfig(model="unused", device="cuda", max_num_seqs=64)
    spare = (0.9 * 80 * 2**30 - args.num_parameters * 2 - kv_budget.step_activation_bytes(args, cfg, 2)
             - cfg.cuda_graph_gib * 2**30 - 64 * RecurrentStates.row_bytes(args, 2))
    assert kv_budget.size_kv(args, cfg, 2)[0] == int(spare // (args.kv_bytes_per_token * 2))
    with pytest.raises(ValueError, match="max_num_seqs"):
        kv_budget.size_kv(args, EngineConfig(model="unused", device="cuda", max_num_seqs=1024), 2)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_split_over_two_ranks_it_is_the_whole_model_and_speculation_stays_lossless(ckpt_dir, arch):
    """Each rank holds half of every layer's heads, a DeltaNet's key and value heads with their
    states among them: float64 tokens the whole model's and log-probabilities to its rounding;
    in bfloat16 speculation (rank 0's acceptances reaching the other rank's states) and a
    group's snapshot lent to its siblings on both ranks change no bit."""
    path = ckpt_dir(arch, num_layers=4) if arch == "qwen3_5" else ckpt_dir(arch)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    whole = outputs(LLM(path, dtype="float64").generate(PROMPTS, sp))
    runs = []
    for kw in (dict(dtype="float64"), dict(dtype="bfloat16"),
               dict(dtype="bfloat16", speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))):
        llm = LLM(path, tensor_parallel_size=2, **kw)
        try:
            runs.append([outputs(llm.generate(PROMPTS, sp)) for _ in range(2)])
            accepted = llm.last_metrics.get("rollout/spec_accepted_tokens", 0)
        finally:
            llm.close()
    split = runs[0][0]
    assert [[t for t, _ in o] for o in split] == [[t for t, _ in o] for o in whole]
    assert max(abs(x - y) for a, b in zip(split, whole) for (_, p), (_, q) in zip(a, b) for x, y in zip(p, q)) < 1e-9
    assert runs[1][0] == runs[1][1] == runs[2][0] == runs[2][1] and accepted > 0
