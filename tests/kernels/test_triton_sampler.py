"""The sampler's row sums on the GPU backend (kernels/gpu/scan.py), under Triton's interpreter
where there is no GPU: the running sums, totals and log-sum-exps of rows against PyTorch's, a
row's bits alone equal to its bits in any batch, and the sampler through them: every setting's
tokens and log-probabilities the same for a row alone as in a batch, and the tokens those of
the CPU's sums for the same noise. And the GPU backend's top-k, ties kept and ordered by column."""
import pytest
import torch

pytest.importorskip("triton")

from tailrl.engine import sampler  # noqa: E402
from tailrl.kernels.backend import Backend  # noqa: E402
from tailrl.kernels.gpu import backend as gpu_backend  # noqa: E402
from tailrl.kernels.gpu.backend import TRITON  # noqa: E402
from tailrl.noise import uniform  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH = Backend()                    # the base class: PyTorch's own sums


@pytest.fixture
def small_blocks(monkeypatch):
    """Rows of a few hundred columns walked in several blocks, the last one partial, as a
    152k vocabulary is in 4096-column blocks (and few enough steps for the interpreter)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(gpu_backend, "SCAN_BLOCK", 64)


def rows(m: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=g) * torch.linspace(0.5, 6, m)[:, None]
    x[0, 5:50] = float("-inf")                        # masked logits (a top-k row's filter)
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_sums_match_pytorch_and_end_at_their_total(small_blocks, dtype):
    x = rows(9, 300, 0, dtype)
    cdf, total, mx = TRITON.softmax_cdf(x)
    want, want_total, want_mx = TORCH.softmax_cdf(x.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(cdf.float(), want, rtol=tol, atol=tol) and torch.equal(mx.float(), want_mx)
    assert torch.equal(total, cdf[:, -1])             # the inverse CDF's guard finds it in the row
    assert torch.allclose(total.float(), want_total, rtol=tol)
    sums = TRITON.cumsum_rows(x.float().clamp(min=-3))
    assert torch.allclose(sums, x.float().clamp(min=-3).cumsum(-1), rtol=1e-5, atol=1e-4)
    lse = TRITON.logsumexp_rows(x.float())
    assert torch.allclose(lse, x.float().logsumexp(-1), rtol=1e-6, atol=1e-5)


def test_row_sums_alone_equal_row_sums_in_a_batch(small_blocks):
    """Bit for bit, at every batch size (PyTorch's CUDA cumsum takes CUB for one row and fewer
    threads per row from ~512 rows of a 152k vocabulary: not so here)."""
    x = rows(40, 333, 1)
    cdf, total, mx = TRITON.softmax_cdf(x)
    lse, sums = TRITON.logsumexp_rows(x), TRITON.cumsum_rows(x.clamp(min=-3))
    for lo, hi in ((0, 1), (7, 8), (3, 20), (39, 40)):
        part = TRITON.softmax_cdf(x[lo:hi])
        assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part, (cdf, total, mx)))
        assert torch.equal(TRITON.logsumexp_rows(x[lo:hi]), lse[lo:hi])
        assert torch.equal(TRITON.cumsum_rows(x[lo:hi].clamp(min=-3)), sums[lo:hi])
    y = x.clamp(min=-3)
    assert torch.equal(TRITON.cumsum_rows(y, inplace=True), sums) and torch.equal(y, sums)   # in place: the same


def _sample_settings(m: int):
    temp = [0.0, 1.0, 0.7, 1.3] * (m // 4)
    top_k = [-1, -1, -1, 20, -1, 50] * (m // 6)
    top_p = [1.0, 0.02, 0.5, 0.9, 0.99, 0.95, 0.2, 1.0] * (m // 8)
    u = [uniform(9, t) for t in range(m)]
    return temp, top_k, top_p, u


def test_the_sampler_through_the_gpu_sums(small_blocks, monkeypatch):
    """Greedy, T, top-k, top-k + top-p, top-p down to 0.02 (redraws and the bisection): a
    row's token and log-probability alone equal its own in a batch of 24, the batch's tokens
    equal the CPU sums' for the same noise, and ``token_logprobs`` reproduces the log-probabilities."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(24, 700, generator=g) * torch.linspace(0.2, 4, 24)[:, None]).to(DEVICE)
    temp, top_k, top_p, u = _sample_settings(24)
    cpu_tokens, cpu_lp = sampler.sample(logits.cpu(), temp, top_k, top_p, u)
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    launches = []
    scan = gpu_backend.TritonBackend._scan
    monkeypatch.setattr(gpu_backend.TritonBackend, "_scan", lambda self, x, exp, write, out=None: (
        launches.append((exp, write)), scan(self, x, exp, write, out))[1])
    together = sampler.sample(logits, temp, top_k, top_p, u)
    alone = [sampler.sample(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], u[i:i + 1])
             for i in range(24)]
    assert together[0] == [a[0][0] for a in alone]
    assert together[1] == [a[1][0] for a in alone]
    assert together[0] == cpu_tokens
    assert max(abs(a - b) for a, b in zip(together[1], cpu_lp)) < 1e-4
    assert sampler.token_logprobs(logits, temp, together[0]) == together[1]
    assert {(True, True), (True, False), (False, True)} <= set(launches)   # every sum went through scan.py


def test_processed_rows_through_the_gpu_sums(small_blocks, monkeypatch):
    """Rows with penalties, min_p and min_tokens (engine/logits_process.py) on the GPU
    backend: a row alone equals the row in the batch, and the tokens are the CPU sums'."""
    from tailrl.config import SamplingParams
    from tailrl.engine.batch import RowPlan
    from tailrl.engine.logits_process import positions
    from tailrl.engine.request import Request
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 700, generator=g) * 3).to(DEVICE)
    kinds = [dict(repetition_penalty=1.5), dict(min_p=0.1, temperature=0.7), dict(frequency_penalty=0.8, top_k=40),
             dict(min_tokens=9, presence_penalty=1.0, top_p=0.5), dict(temperature=0.0, repetition_penalty=2.0), {}]
    params = [SamplingParams(max_tokens=50, **kinds[i % len(kinds)]) for i in range(12)]
    plans = []
    for i, p in enumerate(params):
        req = Request(str(i), [1, 2, 3, 500 + i], p, seed_key=i)
        req.output_token_ids = [7, 7, 8, 100 + i, 3][: i % 6]
        plans.append(RowPlan(req, 1, [], [], i))
    procs = positions(plans, 12, (3,))
    temp, top_k, top_p = [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params]
    u = [uniform(7, i) for i in range(12)]
    cpu = sampler.sample(logits.cpu(), temp, top_k, top_p, u, procs)
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    together = sampler.sample(logits, temp, top_k, top_p, u, procs)
    alone = [sampler.sample(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], u[i:i + 1],
                            procs[i:i + 1] if procs[i] else None) for i in range(12)]
    assert together == ([a[0][0] for a in alone], [a[1][0] for a in alone])
    assert together[0] == cpu[0]
    assert sampler.token_logprobs(logits, temp, together[0]) == together[1]


@pytest.mark.parametrize("k", [1, 20, 300])
def test_top_k_keeps_and_orders_ties_by_column(k):
    """Values on a coarse grid (bfloat16 logits tie near the top): each row keeps its k largest,
    ties kept and ordered lowest column first, alone or in a batch (CUDA's ``topk`` picks its
    algorithm by the number of rows)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 6, (16, 300), generator=g).float() * 0.5
    x[3] = 1.0                                        # a row of ties only
    x[5, 7:] = float("-inf")                          # fewer finite values than k
    x = x.to(DEVICE)
    vals, idx = TRITON.top_k(x, k)
    for r in range(16):
        row = x[r].tolist()
        want = sorted(range(300), key=lambda c: (-row[c], c))[:k]
        assert idx[r].tolist() == want and vals[r].tolist() == [row[c] for c in want]
    for lo, hi in ((0, 1), (3, 4), (5, 12)):
        alone = TRITON.top_k(x[lo:hi], k)
        assert torch.equal(alone[0], vals[lo:hi]) and torch.equal(alone[1], idx[lo:hi])
