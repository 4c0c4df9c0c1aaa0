"""The CPU backend's bfloat16 and float64 matmuls: a row's bits never depend on the other rows of
the product nor on the thread count, and every output is the fixed reduction its header defines
(checked against an emulation)."""
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k,n", [(256, 1024), (896, 1152), (4864, 96), (130, 67)])
def test_a_row_alone_equals_the_row_in_any_product_with_any_threads(k, n, dtype):
    """PyTorch's float64 product on this machine changes a row's bits from one row to two and
    with the thread count at K = 896 (oneDNN's bfloat16 one, without AVX512-BF16, with the rows);
    these do not."""
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((70, k), (n, k), (n,)))
    lin = select("cpu", dtype).linear
    alone = torch.cat([lin(x[i:i + 1], w, b) for i in range(70)])
    for m in (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 70):
        assert torch.equal(lin(x[:m], w, b), alone[:m]), m
    # a strided view of rows computes the same bits
    wide = torch.randn(70, k + 8, generator=g).to(dtype)
    wide[:, :k] = x
    assert torch.equal(lin(wide[:, :k], w, b), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x, w, b), alone)
    finally:
        torch.set_num_threads(threads)
    ref = x.double() @ w.double().T + b.double()
    tol = 0.01 * ref.abs().max() if dtype == torch.bfloat16 else 1e-11      # bfloat16 rounding; float64's
    assert (alone.double() - ref).abs().max() <= tol


def test_empty_and_mismatched_inputs():
    w = torch.randn(8, 32).bfloat16()
    assert cpu.CPU.linear(torch.zeros(0, 32).bfloat16(), w).shape == (0, 8)
    with pytest.raises(ValueError, match="linear"):
        cpu.CPU.linear(torch.zeros(2, 31).bfloat16(), w)
    # float32 is PyTorch's
    x = torch.randn(3, 32)
    assert torch.equal(cpu.CPU.linear(x, w.float()), F.linear(x, w.float()))


def defined_f64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """_gemm.cpp's float64 definition: lane l of 8 takes an FMA of position 8c + l per chunk c
    (zero-padded), the lanes are added pairwise (4 + 4, 2 + 2, 1 + 1), then the bias. The FMA
    is emulated by a product rounded once with its sum: exact where the product is (small
    integers), which is what the test feeds it."""
    m, k = x.shape
    chunks = -(-k // 8)
    xp = F.pad(x, (0, chunks * 8 - k)).view(m, chunks, 8)
    wp = F.pad(w, (0, chunks * 8 - k)).view(w.shape[0], chunks, 8)
    acc = torch.zeros(m, w.shape[0], 8, dtype=torch.float64)
    for c in range(chunks):
        acc = acc + xp[:, None, c, :] * wp[None, :, c, :]
    width = 8
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    out = acc[..., 0]
    return out + b if b is not None else out


@pytest.mark.parametrize("k,n", [(64, 48), (100, 37), (13, 5)])
def test_float64_outputs_are_the_defined_reduction(k, n):
    """Operands whose products are exact (integers times powers of two), summed in an order
    where rounding shows: large and small terms mixed, so that another order gives other bits."""
    g = torch.Generator().manual_seed(k + n)
    x = torch.randint(-9, 10, (7, k), generator=g).double() * 2.0 ** torch.randint(-30, 30, (7, k), generator=g)
    w = torch.randint(-9, 10, (n, k), generator=g).double() * 2.0 ** torch.randint(-30, 30, (n, k), generator=g)
    b = torch.randn(n, generator=g).double()
    want = defined_f64(x, w, b)
    assert torch.equal(cpu.CPU.linear(x, w, b), want)
    assert torch.equal(cpu.CPU.linear(x, w), defined_f64(x, w, None))
    assert not torch.equal(F.linear(x, w, b), want) or k < 16      # the order is visible at this K
