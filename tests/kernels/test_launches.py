"""The GPU launches of a decode step's layer, counted exactly on any machine: Triton kernels
(under the interpreter on a CPU) and PyTorch operations that would launch one on a GPU.

At a few rows a step's device time is its launches' (an H100: ~290 launches, ~1 ms, for the
0.5B's 24 layers at batch 1, four times its weights' reading time), so every launch a layer
loses is a few microseconds a layer off every decode step. The counts here are the design's:
a new launch in the layer fails this test until it is counted and justified."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# operations that make no kernel: views, allocations, metadata
FREE = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "slice", "select", "alias", "detach",
        "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "reshape", "_reshape_alias", "split",
        "chunk", "lift_fresh", "unbind", "empty_like"}


class Launches(TorchDispatchMode):
    """Counts launches: PyTorch operations outside FREE, and Triton kernels (``kernel[grid](...)``:
    the operations the interpreter runs inside a kernel are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if not self.inside and name not in FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    from triton.runtime import interpreter, jit
    counter = Launches()
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        run = cls.run

        def counted(self, *a, _run=run, **kw):
            counter.ops.append(getattr(self, "__name__", "triton"))
            counter.inside += 1
            try:
                return _run(self, *a, **kw)
            finally:
                counter.inside -= 1
        monkeypatch.setattr(cls, "run", counted)
    return counter


@pytest.mark.parametrize("fused_act", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("stock_shapes", ["none", "qkv+gate_up"])
def test_a_decode_layer_launches(ckpt_dir, monkeypatch, launches, stock_shapes, split, fused_act):
    """A layer of a one-row decode step (Qwen2: the projection has a bias), bfloat16:
    the norm with the residual add, the fused projection (its bias added in RoPE's pass where
    cuBLAS computes it, in the matmul's last pass where Triton does), RoPE with the K/V write,
    attention (its lanes merged by the last to finish), the output projection, the second norm,
    gate/up, the MLP's activation and the down projection (a split of K, added up by each
    tile's last range to finish): 9 launches, with K split in ranges (as the 0.5B's down
    projection is at few rows) or not; 8 where the down projection computes the activation as
    it reads it (``ACT_ROWS``). The 0.5B's layer took 12 before the bias, the lanes' merge and
    split-K's reduce were fused in."""
    from tailrl import LLM, SamplingParams
    from tailrl.kernels.gpu import backend, matmul, stock
    from tailrl.model.transformer import DecoderLayer
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    monkeypatch.setattr(backend, "ACT_ROWS", matmul.TILES.bm if fused_act else 0)
    path = ckpt_dir("qwen2", init_std=3.0)
    llm = LLM(path, dtype="bfloat16", device=DEVICE, kv_cache_gib=0.25, cuda_graphs=False)
    widths = {llm.engine.model.layers[0].qkv.weight.shape[0], llm.engine.model.layers[0].gate_up.weight.shape[0]}
    monkeypatch.setattr(stock, "use_stock", lambda w: stock_shapes != "none" and w.shape[0] in widths)
    if split:
        monkeypatch.setattr(matmul, "splits", lambda n, k, tiles=matmul.TILES: 2)
    per_layer = []
    forward = DecoderLayer.forward

    def counted(self, x, *a, **kw):
        before = len(launches.ops)
        out = forward(self, x, *a, **kw)
        if x.shape[0] == 1:
            per_layer.append(launches.ops[before:])
        return out
    monkeypatch.setattr(DecoderLayer, "forward", counted)
    with launches:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert per_layer, "no decode step ran"
    for ops in per_layer:
        assert len(ops) == (8 if fused_act else 9), ops
