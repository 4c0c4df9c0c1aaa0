"""A stand-in computes its source's function: equal logits (float32 rounding) on random
checkpoints of every supported family, the same greedy and sampled tokens and log-probs as
the shipped `small` through our LLM on task prompts; bad names and shapes are rejected."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from tailrl import LLM, SamplingParams
from tailrl.cli.make_model import main as make_model_main
from tailrl.engine.batch import build_batch
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request
from tailrl.model.loader import load_model, read_args
from tailrl.model.standin import STANDINS, StandinSpec, build_standin, get_standin, head_slots
from tailrl.tasks import mixture
from tailrl.tasks.models import shipped_model

# Random sources are hidden 64, 4 heads of 16 dims, MLP 128, 2 layers (tests/checkpoints.py);
# the stand-in regroups their query heads 4 per KV head (MHA: 2 per KV head).
REDUCED = StandinSpec("reduced", hidden_size=128, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=320)
SOURCES = {
    "qwen2_biases_untied": ("qwen2", {}, REDUCED),
    "qwen2_gqa_tied": ("qwen2", dict(num_kv_heads=1, tie=True), REDUCED),
    "qwen3": ("qwen3", {}, REDUCED),
    "llama_mha": ("llama", dict(num_kv_heads=4), replace(REDUCED, num_kv_heads=4)),
}


def our_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """Prefill ``tokens`` as one chunk through our module (float32): logits [T, V]."""
    model = load_model(path)
    kv = KVCache(model.args, torch.float32, "cpu", 4096, 4, 512)
    kv.grow(0, len(tokens))
    batch = build_batch([(Request("r", tokens, SamplingParams(), 0), len(tokens))], {}, kv)
    return model.logits(model(batch.input_ids, batch.positions, kv.layers(), batch.meta))


@pytest.mark.parametrize("src_heads,src_kv,heads,kv", [(8, 4, 16, 8), (8, 4, 28, 4), (8, 4, 12, 4), (4, 1, 8, 2),
                                                        (4, 4, 8, 8), (4, 2, 4, 2)])
def test_source_heads_keep_their_kv_head(src_heads, src_kv, heads, kv):
    q, k = head_slots(src_heads, src_kv, heads, kv)
    assert len(set(q)) == src_heads and max(q) < heads and len(set(k)) == src_kv and max(k) < kv
    for i, slot in enumerate(q):              # query head i read KV head i // g0; its slot must too
        assert slot // (heads // kv) == k[i // (src_heads // src_kv)]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_logits_equal_the_source(ckpt_dir, tmp_path, name):
    arch, kw, spec = SOURCES[name]
    source = ckpt_dir(arch, **kw)
    out = tmp_path / "standin"
    build_standin(spec, source, out)
    args = read_args(str(out))
    assert (args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.intermediate_size) == \
        (128, 6, 8, spec.num_kv_heads, 320) and args.head_dim == read_args(source).head_dim
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref, got = our_logits(source, tokens), our_logits(str(out), tokens)
    # float32 rounding: sums over more (zero) terms and the rescaled norm weights
    assert (got - ref).abs().max().item() <= 2e-5 * ref.abs().max().item(), name
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # transformers reads the same config the same way (head_dim, eps, layer types)
    hf_src = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    hf_out = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = hf_src(torch.tensor([tokens])).logits[0], hf_out(torch.tensor([tokens])).logits[0]
    assert (a - b).abs().max().item() <= 2e-5 * a.abs().max().item(), name


@pytest.fixture(scope="module")
def small_standin(tmp_path_factory) -> tuple[str, str]:
    """The shipped `small` and a reduced stand-in of it (hidden 384, 8 layers, 12 query heads
    on 4 KV heads: a new grouping), written as make-model writes stand-ins."""
    small = shipped_model("small")
    if small is None:
        pytest.skip("this checkout ships no models/small")
    out = tmp_path_factory.mktemp("standin") / "small-384"
    spec = StandinSpec("reduced", hidden_size=384, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=1024)
    build_standin(spec, small, out)
    return str(small), str(out)


def test_files_dtypes_and_figures(small_standin):
    small, out = map(Path, small_standin)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (small / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert config["rms_norm_eps"] == pytest.approx(1e-6 * 256 / 384) and config["head_dim"] == 32
    assert config["dtype"] == "bfloat16" and len(config["layer_types"]) == 8
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
        # small ties its LM head to the embedding and also saves a copy: counted once
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k != "lm_head.weight")
    norms = {k for k in dtypes if k.endswith("norm.weight")}
    assert len(norms) == 2 * 8 + 1 and all(dtypes[k] == torch.float32 for k in norms)
    assert all(dtypes[k] == torch.bfloat16 for k in dtypes.keys() - norms)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    info = json.loads((out / "standin_info.json").read_text())
    assert info["figures"]["bytes"] == (out / "model.safetensors").stat().st_size
    assert info["figures"]["params"] == params


def test_same_tokens_and_logprobs_as_small(small_standin):
    small, out = small_standin
    tok = transformers.AutoTokenizer.from_pretrained(small)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(4)]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=3)
    runs = {}
    for path in (small, out):
        llm = LLM(model=path, dtype="float32", seed=0)
        runs[path] = llm.generate(prompts, greedy) + llm.generate(prompts, sampled)
    n = 0
    for a, b in zip(runs[small], runs[out]):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
            n += len(x.token_ids)
    assert n > 4 * 3 * 10                     # the comparison covered real responses


def test_bfloat16_samples_mostly_identical(small_standin):
    """bfloat16 sums in another order and rounds the rescaled norm weights, so a near-tie can
    flip a sampled token. Prints the share of identical responses (8 prompts x 4, T=1); checks
    that, up to where a pair diverges, the two models' log-probs agree to bfloat16 noise."""
    small, out = small_standin
    tok = transformers.AutoTokenizer.from_pretrained(small)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(8)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=128, seed=5)
    a, b = (LLM(model=p, dtype="bfloat16", seed=0).generate(prompts, params) for p in (small, out))
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra.outputs, rb.outputs)]
    same = sum(x.token_ids == y.token_ids for x, y in pairs)
    print(f"bfloat16 responses identical to small's: {same}/{len(pairs)}")
    diffs = []
    for x, y in pairs:
        n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t),
                 min(len(x.token_ids), len(y.token_ids)))
        diffs += (torch.tensor(x.logprobs[:n]) - torch.tensor(y.logprobs[:n])).abs().tolist()
    total = sum(len(x.token_ids) for x, _ in pairs)
    assert len(diffs) > total / 2                   # most tokens lie before any divergence
    assert sum(diffs) / len(diffs) < 0.02           # measured 0.002; a wrong model is off by ~1


def test_bad_names_and_shapes_name_the_field(ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="standin"):
        get_standin("1t")
    source = ckpt_dir("qwen2")                        # hidden 64, 4 heads on 2 KV heads, MLP 128
    cases = {"hidden_size": dict(hidden_size=32), "num_layers": dict(num_layers=1),
             "intermediate_size": dict(intermediate_size=64), "num_kv_heads": dict(num_heads=4, num_kv_heads=1),
             "num_heads": dict(num_heads=4, num_kv_heads=4)}   # groups of 1 cannot hold pairs
    base = dict(hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=256)
    for field, change in cases.items():
        with pytest.raises(ValueError, match=field):
            build_standin(StandinSpec("bad", **{**base, **change}), source, tmp_path / field)
        assert not (tmp_path / field).exists()            # rejected before anything is written
    with pytest.raises(ValueError, match="num_kv_heads"):
        StandinSpec("bad", **{**base, "num_kv_heads": 3})
    with pytest.raises(SystemExit):                        # the CLI turns it into a usage error
        make_model_main(["--standin", "1t", "--out", str(tmp_path / "cli")])
    with pytest.raises(SystemExit):
        make_model_main(["--standin", "50m", "--steps", "3", "--out", str(tmp_path / "cli")])


def test_cli_writes_a_standin(ckpt_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(STANDINS, "tiny", StandinSpec("tiny", 96, 3, 6, 2, 160))
    source = ckpt_dir("qwen2")
    assert make_model_main(["--standin", "tiny", "--source", source, "--out", str(tmp_path / "tiny")]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["standin"] == "tiny" and figures["bytes"] == (tmp_path / "tiny" / "model.safetensors").stat().st_size
    assert read_args(str(tmp_path / "tiny")).hidden_size == 96


@pytest.mark.parametrize("name", sorted(STANDINS))
def test_named_sizes_fit_small(name):
    """The named stand-ins are built from `small`: each must hold it (checked on its config alone)."""
    from tailrl.model.standin import check_fits

    small = shipped_model("small")
    if small is None:
        pytest.skip("this checkout ships no models/small")
    spec = get_standin(name)
    check_fits(read_args(str(small)), spec)
    assert spec.hidden_size == spec.num_heads * read_args(str(small)).head_dim   # q width = hidden, as in Qwen2


@pytest.mark.slow   # writes the full sizes (0.1 and 0.7 GB) and decodes them in float32: ~15 s quiet
@pytest.mark.parametrize("name", sorted(STANDINS))
def test_named_standins_decode_like_small(tmp_path, name):
    small = shipped_model("small")
    if small is None:
        pytest.skip("this checkout ships no models/small")
    build_standin(get_standin(name), small, tmp_path / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(small))
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(2)]
    params = SamplingParams(temperature=0, max_tokens=24)
    a, b = (LLM(model=str(p), dtype="float32").generate(prompts, params) for p in (small, tmp_path / name))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert torch.allclose(torch.tensor(x.outputs[0].logprobs), torch.tensor(y.outputs[0].logprobs), atol=1e-4)
