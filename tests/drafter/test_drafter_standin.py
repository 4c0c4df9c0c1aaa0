"""A learned drafter widened for a stand-in (tailrl/drafter/standin.py) drafts as the source's."""
from dataclasses import replace

import pytest
import torch

from tailrl.drafter.network import Drafter
from tailrl.drafter.standin import build_standin_drafter
from tailrl.model.loader import load_model
from tailrl.model.standin import StandinSpec, build_standin

# random sources (tests/checkpoints.py: hidden 64, 4 heads of 16, MLP 128, 2 layers), widened
REDUCED = StandinSpec("reduced", hidden_size=128, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=320)
SOURCES = {
    "qwen2_gqa_tied": ("qwen2", dict(num_kv_heads=1, tie=True), REDUCED),
    "llama_mha": ("llama", dict(num_kv_heads=4), replace(REDUCED, num_kv_heads=4)),
}


@pytest.mark.parametrize("name, draft_vocab", [("qwen2_gqa_tied", False), ("llama_mha", False), ("llama_mha", True)])
def test_a_widened_drafter_drafts_as_the_source_drafter(ckpt_dir, tmp_path, name, draft_vocab):
    """A drafter of the source, widened for the stand-in, reads the stand-in's features (the
    source's with zero channels) and gives the source drafter's logits and features (zero-
    padded) at every unroll step, float32 rounding apart; it loads as a drafter of the
    stand-in, sized as one made for it."""
    arch, kw, spec = SOURCES[name]
    source = ckpt_dir(arch, **kw)
    out = tmp_path / "standin"
    build_standin(spec, source, out)
    src_model, big_model = load_model(source), load_model(str(out))
    vocab = torch.arange(0, src_model.args.vocab_size, 3) if draft_vocab else None   # the same tokens on both
    drafter = Drafter.for_target(src_model, vocab=vocab)
    with torch.no_grad():                                     # every weight non-zero, norms away from 1
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3
                    + (1.0 if p.dim() == 1 else 0.0))
    drafter.save(str(tmp_path / "d"))
    build_standin_drafter(spec, source, tmp_path / "d", tmp_path / "d_big")
    wide = Drafter.load(str(tmp_path / "d_big"), big_model)
    assert wide.cfg == Drafter.for_target(big_model, vocab=vocab).cfg   # as a drafter made for the stand-in
    assert vocab is None or torch.equal(wide.vocab, vocab)
    gen = torch.Generator().manual_seed(3)
    h0 = drafter.cfg.hidden_size
    feats = torch.randn(2, 24, h0, generator=gen)
    tokens = torch.randint(0, 97, (2, 24), generator=gen)
    lengths = torch.tensor([24, 17])
    with torch.no_grad():
        ref = drafter.unroll(feats, tokens, lengths, 3)
        got = wide.unroll(torch.nn.functional.pad(feats, (0, 128 - h0)), tokens, lengths, 3)
    for (f_ref, l_ref), (f_got, l_got) in zip(ref, got, strict=True):
        for b, n in enumerate(lengths.tolist()):
            assert (l_got[b, :n] - l_ref[b, :n]).abs().max() <= 1e-4 * l_ref[b, :n].abs().max()
            assert (f_got[b, :n, :h0] - f_ref[b, :n]).abs().max() <= 1e-4 * f_ref[b, :n].abs().max()
            assert f_got[b, :n, h0:].abs().max() == 0
