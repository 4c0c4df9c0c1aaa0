"""The drafter's exact acceptance on given responses: every root's accepted length equals
greedy drafting step by step (the drafter's own chain, float64), and the walk over a
response is the drafter-alone verification's (next root = root + accepted + 1)."""
import pytest
import torch

from tailrl.drafter.evaluate import accepted_per_root, chain_acceptance
from tailrl.drafter.network import Drafter, DrafterConfig, DrafterData


def small_drafter(seed: int = 0, h: int = 16, v: int = 5) -> Drafter:
    torch.manual_seed(seed)
    d = Drafter(DrafterConfig(h, 24, v, 2, 8), torch.randn(v, h), torch.randn(v, h)).double()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return d.eval()


def greedy_accepted(d: Drafter, hidden: torch.Tensor, tokens: torch.Tensor, root: int, depth: int) -> int:
    """Draft the greedy chain at ``root`` with ``Drafter.step`` (its own tokens fed back) and
    count its leading tokens equal to the sequence's."""
    n = tokens.shape[0]
    if root + 2 >= n:
        return 0
    k_all, v_all = d.committed_kv(hidden[:root], tokens[1:root + 1], torch.arange(root))
    past = (k_all.permute(1, 2, 0)[None], v_all.transpose(0, 1)[None], torch.zeros(1, root, dtype=hidden.dtype))
    feat, tok, path, accepted = hidden[root][None], tokens[root + 1][None], None, 0
    for depth_i in range(depth):
        t = root + depth_i
        if t + 2 >= n:
            break
        feat, logits, k, v = d.step(feat, tok, torch.tensor([t]), past if root else None, None, path)
        tok = logits.argmax(-1)
        if int(tok) != int(tokens[t + 2]):
            break
        accepted += 1
        k, v = k[:, :, None], v[:, :, None]
        path = (k, v) if path is None else (torch.cat([path[0], k], 2), torch.cat([path[1], v], 2))
    return accepted


def test_every_root_equals_greedy_drafting_step_by_step():
    d = small_drafter()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 16, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, 5, (40,), generator=gen)
    got = accepted_per_root(d, hidden, tokens, depth=4).tolist()
    want = [greedy_accepted(d, hidden, tokens, r, 4) for r in range(40)]
    assert got == want
    assert max(want) >= 2 and min(want) == 0          # chains of several lengths: the test can fail
    assert got[-2:] == [0, 0]                         # no position left to draft


def test_the_walk_is_drafter_alone_verification():
    d = small_drafter(seed=3)
    gen = torch.Generator().manual_seed(4)
    lens, first = [30, 25, 2], [5, 0, 0]
    hidden = torch.randn(sum(lens), 16, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, 5, (sum(lens),), generator=gen)
    offsets = torch.tensor([0] + lens).cumsum(0)
    data = DrafterData(hidden, tokens, offsets, torch.tensor(first))
    total = steps = 0
    for s, (n, r) in enumerate(zip(lens, first)):
        lo = int(offsets[s])
        acc = [greedy_accepted(d, hidden[lo:lo + n], tokens[lo:lo + n], i, 3) for i in range(n)]
        while r + 2 < n:
            total, steps, r = total + acc[r] + 1, steps + 1, r + acc[r] + 1
    mean, count = chain_acceptance(d, data, 3)
    assert count == steps and mean == pytest.approx(total / steps, abs=1e-12)
    assert mean > 1.0
    assert not d.training


def test_depth_is_checked():
    d = small_drafter()
    data = DrafterData(torch.zeros(3, 16, dtype=torch.float64), torch.zeros(3, dtype=torch.long),
                       torch.tensor([0, 3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="depth"):
        chain_acceptance(d, data, 0)
