"""The drafter's draft vocabulary: which tokens it covers, that its logits are the whole-vocabulary
drafter's at those tokens (so its drafts are that drafter's best among them), that it travels
with the checkpoint, the stand-in and the bfloat16 copy, bad vocabularies refused by name, and
speculation with it lossless."""
import copy
import json

import pytest
import torch

from tailrl.drafter.evaluate import StepEvaluator, accepted_per_root
from tailrl.drafter.network import CONFIG_FILE, Drafter, DrafterConfig, DrafterData
from tailrl.drafter.vocab import frequent_tokens, response_tokens
from tailrl.model.loader import load_model

H, V = 32, 50


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def drafters(vocab: torch.Tensor) -> tuple[Drafter, Drafter]:
    """A whole-vocabulary drafter (random weights, float64) and one over ``vocab`` with the same weights."""
    torch.manual_seed(0)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    full = Drafter(DrafterConfig(H, 48, V, 2, 8), embed, head).double()
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.3 * torch.randn_like(p))
    small = Drafter(DrafterConfig(H, 48, V, 2, 8, draft_vocab=len(vocab)), embed, head, vocab=vocab).double()
    small.load_state_dict({**full.state_dict(), "vocab": vocab})
    return full, small


def test_the_most_frequent_response_tokens_then_the_lowest_ids():
    data = DrafterData(torch.zeros(9, 2), torch.tensor([7, 7, 7, 3, 3, 5, 9, 9, 4]), torch.tensor([0, 5, 9]),
                       torch.tensor([1, 0]))       # sequence 0's responses: 7 3 3; sequence 1's: 9 9 4
    tokens = response_tokens(data)
    assert tokens.tolist() == [7, 3, 3, 9, 9, 4]
    assert frequent_tokens(tokens, 10, 2).tolist() == [3, 9]            # 3 and 9 twice, 7 and 4 once
    assert frequent_tokens(tokens, 10, 3).tolist() == [3, 4, 9]         # 4 before 7 (lower id)
    assert frequent_tokens(tokens, 10, 6).tolist() == [0, 1, 3, 4, 7, 9]   # then tokens never seen, lowest ids
    assert frequent_tokens(tokens, 10, 3, always=(8,)).tolist() == [3, 8, 9]   # e.g. end-of-sequence ids first
    assert frequent_tokens(tokens, 10, 10) is None                      # the whole vocabulary: no reduction
    assert frequent_tokens(tokens, 10, 0) is None
    with pytest.raises(ValueError, match="draft_vocab"):
        frequent_tokens(tokens, 10, -1)
    with pytest.raises(ValueError, match="always kept"):
        frequent_tokens(tokens, 10, 3, always=(10,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        frequent_tokens(torch.tensor([12]), 10, 4)


def test_logits_are_the_whole_vocabularys_at_its_tokens_in_drafting_and_training():
    vocab = torch.tensor([0, 3, 4, 17, 30, 49])
    full, small = drafters(vocab)
    assert tuple(small.head.shape) == (len(vocab), H)
    feat, tok, pos = torch.randn(3, H, dtype=torch.float64), torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9])
    with torch.no_grad():
        a, la, ka, va = full.step(feat, tok, pos)
        b, lb, kb, vb = small.step(feat, tok, pos)
        assert torch.equal(a, b) and torch.equal(ka, kb) and torch.equal(va, vb)
        close(lb, la[:, vocab])                    # the head's product over fewer columns: float64 rounding
        assert torch.equal(small.token_ids(lb.argmax(-1)), vocab[la[:, vocab].argmax(-1)])
        assert torch.equal(full.token_ids(la.argmax(-1)), la.argmax(-1))
        hid, toks = torch.randn(2, 6, H, dtype=torch.float64), torch.randint(0, V, (2, 6))
        for (fa, ga), (fb, gb) in zip(full.unroll(hid, toks, torch.tensor([6, 4]), 2),
                                      small.unroll(hid, toks, torch.tensor([6, 4]), 2), strict=True):
            assert torch.equal(fa, fb)
            close(gb, ga[..., vocab])


def test_exact_acceptance_compares_the_target_token_ids():
    """``accepted_per_root`` maps the head's indices to token ids: a drafter over the tokens a
    sequence uses accepts at every root what the whole-vocabulary drafter's argmax among them gets."""
    tokens = torch.tensor([4, 17, 4, 17, 4, 17, 4, 17, 4, 17])
    vocab = torch.tensor([4, 17])
    full, small = drafters(vocab)
    with torch.no_grad():
        hidden = torch.randn(len(tokens), H, dtype=torch.float64)
        got = accepted_per_root(small, hidden, tokens, 3)
        # the same with the whole-vocabulary drafter's logits restricted to the two tokens by hand
        outs = full.unroll(hidden[None], tokens[None], torch.tensor([len(tokens)]), 3)
    t = len(tokens)
    want = torch.zeros(t, dtype=torch.long)
    alive = torch.ones(t, dtype=torch.bool)
    for k, (_, logits) in enumerate(outs):
        guess = vocab[logits[0][:, vocab].argmax(-1)]
        for r in range(t):
            ok = r + k + 2 < t and bool(guess[min(r + k, t - 1)] == tokens[r + k + 2])
            alive[r] = alive[r] and ok
        want += alive.long()
    assert torch.equal(got, want) and int(got.sum()) > 0


def test_the_vocabulary_travels_with_the_checkpoint_the_bfloat16_copy_and_the_target(ckpt_dir, tmp_path):
    model = load_model(ckpt_dir("qwen2", init_std=3.0))
    vocab = torch.tensor([1, 5, 6, 40, 90])
    d = Drafter.for_target(model, vocab=vocab)
    assert d.cfg.draft_vocab == 5 and torch.equal(d.head, model.lm_head.weight[vocab].float())
    d.save(str(tmp_path / "dr"))
    assert json.loads((tmp_path / "dr" / CONFIG_FILE).read_text())["draft_vocab"] == 5
    e = Drafter.load(str(tmp_path / "dr"), model)
    assert torch.equal(e.vocab, vocab) and torch.equal(e.head, d.head)
    fast = copy.deepcopy(e).to(torch.bfloat16)
    assert fast.vocab.dtype == torch.long and torch.equal(fast.vocab, vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    e.share_target(model)
    assert torch.equal(e.head, model.lm_head.weight[vocab].float())
    assert torch.equal(StepEvaluator(str(tmp_path / "dr"), 3).vocab, vocab)
    Drafter.for_target(model).save(str(tmp_path / "whole"))         # no vocab: the format before it
    assert Drafter.load(str(tmp_path / "whole"), model).vocab is None


@pytest.mark.parametrize("vocab, match", [
    (None, "needs a vocab of that many"),
    (torch.tensor([1, 2]), "needs a vocab of that many"),
    (torch.tensor([1.0, 2.0, 3.0]), "needs a vocab of that many"),
    (torch.tensor([3, 2, 1]), "ascending distinct"),
    (torch.tensor([1, 1, 2]), "ascending distinct"),
    (torch.tensor([1, 2, V]), "below vocab_size"),
])
def test_a_vocabulary_that_does_not_fit_is_refused_by_name(vocab, match):
    with pytest.raises(ValueError, match=match):
        Drafter(DrafterConfig(H, 48, V, 2, 8, draft_vocab=3), torch.randn(V, H), torch.randn(V, H), vocab=vocab)
    with pytest.raises(ValueError, match="draft_vocab=0"):
        Drafter(DrafterConfig(H, 48, V, 2, 8), torch.randn(V, H), torch.randn(V, H), vocab=torch.tensor([1, 2, 3]))
