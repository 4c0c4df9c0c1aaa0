"""The CPU backend's bfloat16 matmul: a row's bits never depend on the other rows of the product,
and every output is the fixed reduction its header defines (checked against an emulation)."""
import pytest
import torch
import torch.nn.functional as F

from tailrl.kernels import cpu, select

pytestmark = pytest.mark.skipif(not cpu.NATIVE_GEMM, reason="native matmul not built")

LANES = 16


def defined(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """_gemm.cpp's definition in PyTorch: per chunk of 32 positions of K (zero-padded), lane l
    takes an FMA of the even position 2l, then of the odd one; then the 16 lanes are added
    pairwise (8 + 8, 4 + 4, ...), the bias added, the sum rounded to bfloat16. An FMA in
    float32 is emulated exactly enough in float64: the product of two bfloat16 values is exact."""
    m, k = x.shape
    chunks = -(-k // (2 * LANES))
    pad = chunks * 2 * LANES - k
    xp = F.pad(x.float(), (0, pad)).view(m, chunks, LANES, 2)         # [M, C, lane, even/odd]
    wp = F.pad(w.float(), (0, pad)).view(w.shape[0], chunks, LANES, 2)
    acc = torch.zeros(m, w.shape[0], LANES, dtype=torch.float32)
    for c in range(chunks):
        for half in range(2):
            prod = xp[:, None, c, :, half].double() * wp[None, :, c, :, half].double()
            acc = (prod + acc.double()).float()                           # one rounding: an FMA
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    out = acc[..., 0]
    if b is not None:
        out = out + b.float()
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("k,n", [(64, 48), (100, 37), (33, 5), (256, 70)])
def test_every_output_is_the_defined_reduction(k, n):
    g = torch.Generator().manual_seed(k * n)
    x = torch.randn(9, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    lin = cpu.CPU.linear
    assert torch.equal(lin(x, w, b), defined(x, w, b))
    assert torch.equal(lin(x, w), defined(x, w, None))


@pytest.mark.parametrize("k,n", [(256, 1024), (896, 1152), (4864, 96), (130, 67)])
def test_a_row_alone_equals_the_row_in_any_product(k, n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    lin = select("cpu", torch.bfloat16).linear
    alone = torch.cat([lin(x[i:i + 1], w, b) for i in range(70)])
    for m in (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 70):
        assert torch.equal(lin(x[:m], w, b), alone[:m]), m
    # a strided view of rows computes the same bits
    wide = torch.randn(70, k + 8, generator=g).bfloat16()
    wide[:, :k] = x
    assert torch.equal(lin(wide[:, :k], w, b), alone)
    ref = x.double() @ w.double().T + b.double()
    assert (alone.double() - ref).abs().max() <= 0.01 * ref.abs().max()   # bfloat16 rounding


def test_empty_and_mismatched_inputs():
    w = torch.randn(8, 32).bfloat16()
    assert cpu.CPU.linear(torch.zeros(0, 32).bfloat16(), w).shape == (0, 8)
    with pytest.raises(ValueError, match="linear"):
        cpu.CPU.linear(torch.zeros(2, 31).bfloat16(), w)
    # other dtypes are PyTorch's
    x = torch.randn(3, 32)
    assert torch.equal(cpu.CPU.linear(x, w.float()), F.linear(x, w.float()))
