"""Sampling: reproducible whatever the batch, distributionally right, logprobs are the model's."""
import numpy as np
import pytest
import torch
import transformers

from tailrl import LLM, SamplingParams
from tailrl.engine import sampler
from tailrl.engine.sampler import _cdf, _nucleus, sample
from tailrl.noise import SCALAR_UNIFORMS, uniform, uniforms


def test_same_tokens_alone_and_in_batch_of_64(ckpt_dir):
    path = ckpt_dir("qwen2")
    llm = LLM(path, dtype="float64")
    target = [5, 9, 2, 33]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1234, ignore_eos=True)
    alone = llm.generate([target], sp)[0]
    g = torch.Generator().manual_seed(0)
    others = [torch.randint(0, 97, (int(k),), generator=g).tolist() for k in torch.randint(2, 40, (63,), generator=g)]
    params = [SamplingParams(temperature=t, max_tokens=int(m), ignore_eos=True)
              for t, m in zip(np.linspace(0.5, 1.5, 63), np.linspace(5, 60, 63))]
    batch = llm.generate(others[:30] + [target] + others[30:], params[:30] + [sp] + params[30:])
    assert [c.token_ids for c in batch[30].outputs] == [c.token_ids for c in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids      # samples of a group differ


def test_seed_none_differs_between_calls_and_engine_seed_matters(ckpt_dir):
    path = ckpt_dir("qwen2")
    sp = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    a = LLM(path, seed=0)
    first, second = a.generate([[1, 2, 3]], sp)[0], a.generate([[1, 2, 3]], sp)[0]
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
    again = LLM(path, seed=0).generate([[1, 2, 3]], sp)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = LLM(path, seed=1).generate([[1, 2, 3]], sp)[0]
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 3, 1.0), (1.3, -1, 0.8)])
def test_sampler_chi_square(temperature, top_k, top_p):
    """20k draws of the counter-based sampler on a 6-token vocabulary match the exact filtered
    distribution (chi-square, p > 1e-3) and never emit a filtered-out token."""
    from scipy.stats import chisquare
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], dtype=torch.float64)
    n = 20000
    toks, _ = sample(logits.expand(n, 6), [temperature] * n, [top_k] * n, [top_p] * n,
                     [uniform(12345, t) for t in range(n)])
    counts = np.bincount(toks, minlength=6)
    p = torch.softmax(logits[0] / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros(6, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or mass >= top_p:
            break
        keep[i] = True
        mass += p[i].item()
    q = torch.where(keep, p, torch.zeros_like(p))
    q = (q / q.sum()).numpy()
    assert counts[~keep.numpy()].sum() == 0
    nz = q > 0
    assert chisquare(counts[nz], q[nz] * n).pvalue > 1e-3


def _chi_square_ok(counts: np.ndarray, q: np.ndarray) -> bool:
    from scipy.stats import chisquare
    nz = q > 0
    if counts[~nz].sum():
        return False
    return nz.sum() == 1 or chisquare(counts[nz], q[nz] * counts.sum()).pvalue > 1e-3


@pytest.mark.parametrize("top_p,nucleus", [(0.3, [0]), (0.5, [0, 1, 2, 3]), (0.95, [0, 1, 2, 3, 4])])
@pytest.mark.parametrize("attempts", [8, 0])
def test_top_p_keeps_ties_at_the_edge_and_follows_the_filtered_distribution(top_p, nucleus, attempts):
    """The nucleus is every token with mass(logits above it) < top_p: tied tokens at its edge are
    all kept (p = [.44, .16, .16, .16, .06, .02]: 0.5 keeps the three tied 1.0s). The redraws
    (attempts=8) and the bisection alone (attempts=0) both follow the filtered distribution."""
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    n = 20000
    x = logits.expand(n, 6)
    cdf, total, mx = _cdf(x)
    u = np.array([uniform(777, t) for t in range(n)])
    first = torch.searchsorted(cdf, (torch.as_tensor(u) * total)[:, None], right=True).squeeze(1)
    toks = _nucleus(x, mx, cdf, total, first, torch.full((n,), top_p, dtype=torch.float64), u, attempts=attempts)
    p = torch.softmax(logits, -1).numpy()
    q = np.zeros(6)
    q[nucleus] = p[nucleus]
    assert _chi_square_ok(np.bincount(toks.numpy(), minlength=6), q / q.sum())


def test_top_p_token_is_the_unfiltered_one_when_that_lies_in_the_nucleus():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 500, generator=g) * 3
    u = [uniform(5, t) for t in range(200)]
    plain, _ = sample(logits, [1.0] * 200, [-1] * 200, [1.0] * 200, u)
    nucleus, _ = sample(logits, [1.0] * 200, [-1] * 200, [0.9] * 200, u)
    probs = logits.softmax(-1)
    inside = [(probs[i][logits[i] > logits[i, t]].sum() < 0.9).item() for i, t in enumerate(plain)]
    assert 100 < sum(inside) < 200
    assert all(a == b for a, b, ok in zip(plain, nucleus, inside) if ok)
    assert all(a != b for a, b, ok in zip(plain, nucleus, inside) if not ok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_sampler_rows_alone_equal_rows_in_a_batch(dtype, chunk_rows, monkeypatch):
    """Every setting (greedy, T, top-k, top-k + top-p, top-p down to 0.02, where redraws and the
    bisection run) gives a row the same token and log-probability alone as in a batch of 48,
    whole or in chunks of 5 rows; ``token_logprobs`` gives the same log-probabilities."""
    if chunk_rows:
        monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 5000 * chunk_rows)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(48, 5000, generator=g) * torch.linspace(0.2, 4, 48)[:, None]).to(dtype)
    temp = [0.0, 1.0, 0.7, 1.3] * 12
    top_k = [-1, -1, -1, 20, -1, 50] * 8
    top_p = [1.0, 0.02, 0.5, 0.9, 0.99, 0.95, 0.2, 1.0] * 6
    u = [uniform(9, t) for t in range(48)]
    together = sample(logits, temp, top_k, top_p, u)
    alone = [sample(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], u[i:i + 1]) for i in range(48)]
    assert together[0] == [a[0][0] for a in alone]
    assert together[1] == [a[1][0] for a in alone]
    assert sampler.token_logprobs(logits, temp, together[0]) == together[1]


def test_greedy_rows_of_a_real_vocabulary_alone_equal_rows_in_a_batch():
    """At Qwen2.5's 151,936 tokens PyTorch's CPU ``logsumexp`` splits a lone row between threads
    (other bits than the row in a batch); the normaliser every row takes is a running sum in
    order, so a greedy row's log-probability is the same alone as in a batch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 151936, generator=g) * 3        # row 4: PyTorch's logsumexp differs alone
    temp, top_k, top_p, u = [0.0] * 12, [-1] * 12, [1.0] * 12, [0.5] * 12
    together = sample(logits, temp, top_k, top_p, u)
    for i in range(12):
        assert sample(logits[i:i + 1], [0.0], [-1], [1.0], [0.5]) == ([together[0][i]], [together[1][i]])


def test_rows_go_whole_off_the_cpu(monkeypatch):
    """Chunks of rows are for a CPU's cache: on any other device (a GPU) a chunk would cost its
    launches and a wait, so the sampler's function sees every row at once."""
    seen = []

    def fn(logits, rows):
        seen.append(logits.shape[0])
        return (torch.tensor(rows),)

    monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 2 * 100)
    rows = list(range(64))
    assert sampler._in_chunks(fn, torch.empty(64, 100, device="meta"), rows).lists() == (rows,)
    assert seen == [64]
    seen.clear()
    assert sampler._in_chunks(fn, torch.empty(64, 100), rows).lists() == (rows,)
    assert seen == [2] * 32


def test_logprobs_are_hf_log_softmax_at_temperature(ckpt_dir):
    path = ckpt_dir("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [4, 8, 15, 16, 23, 42]
    out = LLM(path, dtype="float32").generate([prompt], SamplingParams(temperature=0.7, top_k=5, max_tokens=20, ignore_eos=True))[0]
    toks = out.outputs[0].token_ids
    with torch.no_grad():
        lp = (hf(torch.tensor([prompt + toks])).logits[0] / 0.7).log_softmax(-1)
    ref = [lp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(toks)]
    assert np.allclose(ref, out.outputs[0].logprobs, atol=1e-4)
    top5 = [set(torch.topk(lp[len(prompt) - 1 + t], 5).indices.tolist()) for t in range(len(toks))]
    assert all(tok in s for tok, s in zip(toks, top5))


def test_top_k_1_is_greedy(ckpt_dir):
    path = ckpt_dir("qwen2")
    llm = LLM(path)
    greedy = llm.generate([[7, 7, 1]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    topk1 = llm.generate([[7, 7, 1]], SamplingParams(temperature=1.0, top_k=1, max_tokens=20, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == topk1.outputs[0].token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_noise_next_to_one_never_picks_a_filtered_token(dtype):
    """u * total may round up to total: the pick must stay on a token with probability mass,
    not fall on the last vocabulary id (here filtered out by top-k, top-p, or -inf)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5], [0.0, 5.0, 1.0, 2.0], [1.0, 2.0, 3.0, float("-inf")]]).to(dtype)
    u = [1.0 - 2.0 ** -30] * 3
    tokens, _ = sample(logits.float(), [1.0] * 3, [2, -1, -1], [1.0, 0.5, 1.0], u)
    assert tokens[0] in (0, 1)            # top-k 2 keeps ids 0 and 1
    assert tokens[1] == 1                 # top-p 0.5 keeps the argmax only
    assert tokens[2] == 2                 # the last id has no mass


def test_top_k_row_with_ties_ignores_the_other_rows_k():
    """Tied logits at a row's top-k edge: the row samples the same tokens whatever top-k its
    batch neighbours ask for (rows go to topk by their own k)."""
    row = torch.tensor([[3.0] + [1.0] * 40 + [0.0] * 59])
    other = torch.randn(1, 100)
    for t in range(50):
        u = [uniform(77, t), uniform(78, t)]
        alone, _ = sample(row, [1.0], [5], [1.0], u[:1])
        mixed, _ = sample(torch.cat([row, other]), [1.0, 1.0], [5, 60], [1.0, 1.0], u)
        assert alone[0] == mixed[0]


def test_uniforms_many_at_once_equal_one_by_one():
    """A step's uniforms (numpy's uint64 arithmetic above ``SCALAR_UNIFORMS`` pairs, Python's
    ints up to it) are exactly ``uniform``'s for every pair, on both sides of the switch."""
    import random
    rng = random.Random(0)
    for n in (1, SCALAR_UNIFORMS, SCALAR_UNIFORMS + 1, 300):
        keys = [rng.getrandbits(64) for _ in range(n)]
        positions = [rng.randrange(1 << 20) for _ in range(n)]
        got = uniforms(keys, positions)
        assert got.dtype == np.float64 and got.shape == (n,)
        assert got.tolist() == [uniform(k, p) for k, p in zip(keys, positions)]
