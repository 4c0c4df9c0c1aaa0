"""cuBLAS where it is measured batch invariant (tailrl/kernels/gpu/stock.py): the probe, the
pieces above its rows, the per-shape decisions, and a model whose products mix the stock
kernel and the Triton matmul keeping its bits (on a CPU: PyTorch's CPU product in the stock
role, the Triton kernels under the interpreter)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tailrl.kernels.gpu import stock  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Invariant by construction: every row computed alone."""
    return torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])])


def by_batch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A product whose arithmetic changes with M, as cuBLAS's kernel choice does."""
    return rowwise(x, w) if x.shape[0] <= 5 else (x.double() @ w.double().T).to(x.dtype)


@pytest.fixture
def fresh(monkeypatch):
    """A process with no decisions yet, whose CPU tensors are probed too."""
    monkeypatch.setattr(stock, "_decided", {})
    monkeypatch.setattr(stock, "_seen", {})
    monkeypatch.setattr(stock, "DEVICES", ("cuda", "cpu"))
    return monkeypatch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_probe_tells_an_invariant_product_from_one_that_changes_with_the_batch(dtype):
    """``by_batch`` changes only how a row's sum is rounded (float64 then once, against
    float32 running sums): in bfloat16 ordinary random rows hardly ever show it, the probe's
    operands do, at every dtype."""
    w = torch.randn(40, 96).to(dtype)
    assert stock.invariant(w, 16, rowwise)
    assert not stock.invariant(w, 16, by_batch)
    assert stock.invariant(w, 5, by_batch)                        # below where it changes, it does not
    x = torch.randn(16, 96).to(dtype)
    hidden = (by_batch(x, w) != rowwise(x, w)).float().mean()
    assert dtype != torch.bfloat16 or hidden < 0.05               # what ordinary data would have shown
    x, wp = stock.probe_operands(16, w)
    assert wp.shape == w.shape and wp.dtype == dtype and torch.isfinite(by_batch(x, wp)).all()


def test_the_probe_operands_tell_two_orders_of_a_sum_apart():
    """The Triton matmul taking K 64 or 128 positions per step: on the probe's operands most
    elements differ (on ordinary random rows, measured once under this CPU's interpreter, no
    element did)."""
    from tailrl.kernels.gpu import matmul
    from tailrl.kernels.gpu.matmul import Tiles
    short, long = Tiles(16, 64, 64, 4, 3), Tiles(16, 64, 128, 4, 3)
    x, w = stock.probe_operands(8, torch.empty(40, 512, dtype=torch.bfloat16, device=DEVICE))
    assert (matmul.linear(x, w, tiles=short) != matmul.linear(x, w, tiles=long)).float().mean() > 0.5


def test_the_probe_sees_what_any_offset_of_ordinary_rows_shows():
    """PyTorch's own CPU product in bfloat16 (oneDNN picks kernels by shape): wherever some
    M and offset of ordinary random rows give a row other bits than alone, the probe says
    no."""
    g = torch.Generator().manual_seed(1)
    rows = 20
    for n, k in ((80, 96), (33, 130), (40, 1280), (64, 512)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(rows, k, generator=g).bfloat16()
        alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(rows)])
        direct = all(torch.equal(F.linear(x[o:o + m], w), alone[o:o + m])
                     for m in range(2, rows + 1) for o in range(rows - m + 1))
        assert direct or not stock.invariant(w, rows), (n, k)


def test_products_above_the_probed_rows_run_in_probed_pieces():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(10, 24, generator=g), torch.randn(7, 24, generator=g), torch.randn(7, generator=g)
    y = stock.stock_linear(x, w, b, rows=4, linear=by_batch)
    assert torch.equal(y, torch.cat([by_batch(x[i:i + 4], w) + b for i in (0, 4, 8)]))
    assert torch.equal(stock.stock_linear(x.T.contiguous().T, w, None, rows=4, linear=by_batch),
                       stock.stock_linear(x, w, None, rows=4, linear=by_batch))   # any row stride: probed layout


def test_a_shape_is_decided_once_per_process(fresh):
    fresh.setattr(stock, "ROWS", 8)
    fresh.setattr(stock, "PRODUCT", rowwise)
    w = torch.randn(12, 16)
    assert stock.use_stock(w)
    fresh.setattr(stock, "PRODUCT", by_batch)
    assert stock.use_stock(torch.randn(12, 16))                   # decided: the same for every later product
    assert not stock.use_stock(torch.randn(16, 12).T)             # other strides: another decision
    assert not stock.use_stock(torch.randn(12, 17))
    assert {(d["n"], d["k"], d["kernel"]) for d in stock.decisions()} == {
        (12, 16, "stock"), (12, 16, "triton"), (12, 17, "triton")}
    fresh.setattr(stock, "ROWS", 0)
    assert stock.use_stock(w)                                     # a weight keeps its decision
    assert not stock.use_stock(torch.randn(12, 16))               # TAILRL_STOCK_ROWS=0: Triton everywhere
    fresh.setattr(stock, "ROWS", 8)
    fresh.setattr(stock, "DEVICES", ("cuda",))
    assert not stock.use_stock(torch.randn(12, 18))               # a CPU tensor: not probed


def test_prepare_decides_before_the_first_step_and_says_so(fresh, caplog):
    from tailrl.kernels.gpu.backend import TRITON
    fresh.setattr(stock, "ROWS", 8)
    fresh.setattr(stock, "PRODUCT", lambda x, w: (rowwise if w.shape[0] % 2 else by_batch)(x, w))
    with caplog.at_level("INFO", logger="tailrl.kernels.gpu.backend"):
        TRITON.prepare([(torch.randn(13, 16), None), (torch.randn(12, 16), torch.randn(12)),
                        (torch.randn(13, 16), None)])
        TRITON.prepare([(torch.randn(13, 16), None)])                  # decided: no probe, no line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("matmuls:")]
    assert len(lines) == 1 and "[13, 16] float32 cuBLAS" in lines[0] and "[12, 16] float32 Triton" in lines[0]


def test_a_model_mixing_stock_and_triton_products_keeps_its_bits(triton_model, fresh):
    """bfloat16 through the Triton backend with the stock product where the probe allows it
    (rows probed up to 8, so steps of more rows run in pieces): graph steps equal eager steps,
    speculation equals plain, and a request alone equals it in the batch, bit for bit."""
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, cuda_capture, eager_capture
    from tailrl.engine.graphs import StepGraphs
    fresh.setenv("TAILRL_KERNELS", "triton")
    fresh.setattr(stock, "ROWS", 8)
    fresh.setattr(stock, "PRODUCT", lambda x, w: (rowwise if w.shape[0] % 2 else by_batch)(x, w))
    path = triton_model
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    run = lambda llm, ps=prompts: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(ps, sp)]   # noqa: E731,E501
    plain = LLM(path, device=DEVICE, cuda_graphs=False, kv_cache_gib=0.25)
    want = run(plain)
    kernels = {d["kernel"] for d in stock.decisions()}
    assert kernels == {"stock", "triton"}, stock.decisions()
    assert run(plain, prompts[1:2]) == want[1:2]
    llm = LLM(path, speculative=SpeculativeConfig(policy="fixed"), device=DEVICE, kv_cache_gib=0.25)
    e = llm.engine
    capture = cuda_capture if DEVICE == "cuda" else eager_capture
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, capture), 64))
    e.begin_rollout()
    assert run(llm) == want
    assert llm.last_metrics["graphs/replayed_steps"] > 0 and llm.last_metrics["rollout/spec_accepted_tokens"] > 0
