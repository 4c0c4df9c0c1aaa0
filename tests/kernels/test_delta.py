"""Gated DeltaNet's recurrence (Qwen3.5's linear attention, kernels/delta.py) on the CPU's native
kernel and the GPU's Triton kernels (under Triton's interpreter where there is no GPU): each equals
the reference to rounding; a draft node's output equals the same token committed,
and accepting it (its kept inputs run through again) leaves the states a committed token leaves,
bit for bit; a row's outputs and states are its own alone or beside other rows, on any number of
threads; a row starting at position 0 starts from zeros; a snapshot after s tokens is the states
s tokens leave."""
import pytest
import torch

from tailrl.kernels import cpu, delta, select
from tailrl.kernels.reference import REFERENCE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIMS = (2, 4, 8, 16, 4)                          # key heads, value heads, key dim, value dim, conv width
C = 2 * 2 * 8 + 4 * 16
ROWS = 5


@pytest.fixture
def six_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(6)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["cpu", "triton"])
def backend(request):
    """(kernels for a dtype, the device their tensors live on)."""
    if request.param == "cpu":
        if not cpu.NATIVE:
            pytest.skip("the native CPU kernels are not built")
        return lambda dtype: select("cpu", dtype), "cpu"
    pytest.importorskip("triton")
    from tailrl.kernels.gpu.backend import TRITON

    def kernels(dtype):
        if dtype == torch.float64:
            pytest.skip("no float64 Triton kernels (the reference serves it)")
        return TRITON
    return kernels, DEVICE


def inputs(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    mixed = torch.randn(n, C, generator=g).to(dtype)
    ba = torch.randn(n, 8, generator=g).to(dtype)
    w = (0.5 * torch.randn(C, 4, generator=g)).to(dtype)
    neg_a, dtb = -torch.rand(4, generator=g).to(acc) * 2, torch.randn(4, generator=g).to(acc)
    return mixed, ba[:, :4], ba[:, 4:], w, neg_a, dtb


def states(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (torch.randn(ROWS, 2, C, 3, generator=g).to(dtype),
            0.1 * torch.randn(ROWS, 2, 4, 8, 16, generator=g).to(acc))


def run(kernels, x, st, seqs, out=True):
    mixed, b, a, w, neg_a, dtb = x
    return kernels.delta_rule(mixed, b, a, w, neg_a, dtb, st[0], st[1],
                              torch.tensor(seqs, dtype=torch.int64, device=mixed.device), DIMS, out)


def on(device, *xs):
    return tuple(x.to(device) for x in xs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_kernels_are_the_references_to_rounding(backend, dtype):
    make, device = backend
    x = inputs(dtype, 9)
    # a row (snapshot after 2 tokens), a fresh row, a row with a draft node
    seqs = [[3, 0, 4, 4, 0, 2], [1, 4, 3, 3, 1, 0], [0, 7, 2, 1, 0, 1]]
    a, b = on(device, *states(dtype)), states(dtype)
    ours, ref = run(make(dtype), on(device, *x), a, seqs).cpu(), run(REFERENCE, x, b, seqs)
    tol = {torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert (ours.double() - ref.double()).abs().max() <= tol * ref.double().abs().max()
    for s, t in zip(a, b):
        assert (s.cpu().double() - t.double()).abs().max() <= tol * t.double().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_draft_node_is_the_token_committed_and_accepting_it_leaves_the_same_states(backend, six_threads, dtype):
    make, device = backend
    kernels = make(dtype)
    x = on(device, *inputs(dtype, 6))
    committed, drafted, base = (on(device, *states(dtype)) for _ in range(3))
    out_c = run(kernels, x, committed, [[2, 0, 6, 6, 0, 0]])
    out_d = run(kernels, x, drafted, [[2, 0, 6, 2, 0, 0]])              # 2 committed, 4 draft nodes
    assert torch.equal(out_c, out_d)
    for s, t in zip(drafted, base):                                  # drafts left the states as after 2 tokens
        assert not torch.equal(s[2, 0], t[2, 0]) and torch.equal(s[2, 1], t[2, 1])
        assert torch.equal(s[[0, 1, 3, 4]], t[[0, 1, 3, 4]])
    after_two = [s.clone() for s in drafted]
    kept = tuple(t[2:5] for t in x[:3])                              # accept 3 of the 4 nodes
    kernels.delta_rule(*kept, *x[3:], drafted[0], drafted[1], torch.tensor([[2, 0, 3, 3, 0, 0]], device=device),
                       DIMS, False)
    five = on(device, *states(dtype))
    run(kernels, x, five, [[2, 0, 5, 5, 0, 0]])
    assert all(torch.equal(s, t) for s, t in zip(drafted, five)) and not torch.equal(after_two[1], five[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_rows_outputs_and_states_are_its_own_in_any_batch(backend, six_threads, dtype):
    make, device = backend
    kernels = make(dtype)
    x = on(device, *inputs(dtype, 12))
    together = on(device, *states(dtype))
    seqs = [[4, 0, 1, 1, 0, 0], [0, 1, 5, 2, 0, 2], [2, 6, 3, 3, 1, 3], [1, 9, 3, 3, 0, 0]]
    out = run(kernels, x, together, seqs)
    for row, t0, cnt, done, fresh, snap in seqs:
        alone = on(device, *states(dtype))
        sub = tuple(t[t0:t0 + cnt] for t in x[:3]) + x[3:]
        got = run(kernels, sub, alone, [[row, 0, cnt, done, fresh, snap]])
        assert torch.equal(got, out[t0:t0 + cnt])
        assert torch.equal(alone[0][row], together[0][row]) and torch.equal(alone[1][row], together[1][row])


def test_a_fresh_row_starts_from_zeros_and_the_gated_norm_is_the_references(backend):
    make, device = backend
    kernels = make(torch.float32)
    x = on(device, *inputs(torch.float32, 3))
    noisy, zero = on(device, *states(torch.float32)), on(device, *(torch.zeros_like(t) for t in states(torch.float32)))
    assert torch.equal(run(kernels, x, noisy, [[1, 0, 3, 3, 1, 0]]), run(kernels, x, zero, [[1, 0, 3, 3, 0, 0]]))
    g = torch.Generator().manual_seed(2)
    o, z, w = torch.randn(7, 64, generator=g), torch.randn(9, 64, generator=g)[:7], torch.rand(16, generator=g)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        ref = delta.gated_norm(o.to(dtype), z.to(dtype), w.to(dtype), 1e-6).float()
        got = make(dtype).gated_norm(*on(device, o.to(dtype), z.to(dtype), w.to(dtype)), 1e-6).cpu().float()
        assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_a_snapshot_is_the_states_after_its_tokens_and_the_states_go_on(backend):
    make, device = backend
    kernels = make(torch.bfloat16)
    x = on(device, *inputs(torch.bfloat16, 7))
    snapped, three, seven = (on(device, *states(torch.bfloat16)) for _ in range(3))
    out = run(kernels, x, snapped, [[1, 0, 7, 7, 1, 3]])
    run(kernels, x, three, [[1, 0, 3, 3, 1, 0]])
    assert torch.equal(out, run(kernels, x, seven, [[1, 0, 7, 7, 1, 0]]))
    for s, t, u in zip(snapped, three, seven):
        assert torch.equal(s[1, 1], t[1, 0]) and torch.equal(s[1, 0], u[1, 0]) and not torch.equal(s[1, 0], s[1, 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runs_of_no_tokens_move_nothing_and_tokens_in_no_run_output_zeros(backend, dtype):
    """A CUDA graph's bucket pads a step with runs of no tokens and tokens in no run
    (engine/graphs.py): those runs leave every state and snapshot as it was, those tokens output
    0 (never what the memory held: NaN there would sample past the vocabulary), and the real
    run's outputs and states are those of the step without the padding."""
    kernels, device = backend
    kernels = kernels(dtype)
    x = on(device, *inputs(dtype, 6))
    plain = on(device, *states(dtype))
    padded = on(device, *states(dtype))
    want = run(kernels, x, plain, [[2, 0, 3, 3, 0, 0]])
    got = run(kernels, x, padded, [[2, 0, 3, 3, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert torch.equal(got[:3], want[:3]) and not got[3:].any()
    assert all(torch.equal(p, q) for p, q in zip(plain, padded))
    fresh = on(device, *states(dtype))
    run(kernels, x, fresh, [[0, 0, 0, 0, 0, 0]] * 4)
    assert all(torch.equal(p, q) for p, q in zip(fresh, on(device, *states(dtype))))
