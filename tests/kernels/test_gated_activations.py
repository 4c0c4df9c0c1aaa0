"""The MLP's gated activations on the CPU (``_attention.cpp`` ``act_mul``: SiLU and GELU's tanh
form, times up): a row's bits are its own alone or in a batch on any number of threads, at any
width (PyTorch's elementwise SiLU is not: it computes an element by a vectorised or a scalar
algorithm by its place in the flattened tensor and the threads' split of it, and on 6 threads
rows of a 4,864-wide batch differed from themselves alone in float32 and float64), and the values
are PyTorch's to rounding."""
import pytest
import torch
import torch.nn.functional as F

from tailrl.kernels import cpu, select

pytestmark = pytest.mark.skipif(not cpu.NATIVE, reason="the native CPU kernels are not built")
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-13}


@pytest.fixture
def six_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(6)                    # more than this machine's cores: splits rows mid-row
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["silu", "gelu", "swiglu"])
def test_a_rows_activation_is_its_own_alone_or_in_a_batch_and_pytorchs_to_rounding(six_threads, dtype, kind):
    """(swiglu: gpt-oss's clamped one, limit 7 and alpha 1.702: the gate's values reach past the limit.)"""
    kernels = select("cpu", dtype)
    f = {"silu": kernels.silu_mul, "gelu": kernels.gelu_tanh_mul,
         "swiglu": lambda gu: kernels.swiglu_clamped(gu, 1.702, 7.0)}[kind]
    ref = {"silu": F.silu, "gelu": lambda x: F.gelu(x, approximate="tanh"),
           "swiglu": lambda x: x.clamp(max=7.0) * torch.sigmoid(1.702 * x.clamp(max=7.0))}[kind]
    g = torch.Generator().manual_seed(0)
    for width in (13, 100, 4864):
        for rows in (7, 37):
            gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
            out = f(gate_up)
            assert all(torch.equal(f(gate_up[t:t + 1])[0], out[t]) for t in range(rows))
            gate, up = gate_up.chunk(2, dim=-1)
            up = up.double().clamp(-7.0, 7.0) + 1 if kind == "swiglu" else up.double()
            exact = ref(gate.double()) * up
            assert (out.double() - exact).abs().max() <= TOL[dtype] * exact.abs().max()
