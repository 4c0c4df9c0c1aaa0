"""The spot trainer's steps queued beside the rollout's (``SpotConfig.stream="side"``,
tailrl/drafter/side_stream.py). On the CPU a stand-in lane runs a queued step only once the
lane reports it done, some boundaries later, as a CUDA stream finishes it while the rollout
goes on: the scheduling (one step in flight, published only between steps once landed, the
host's reads waiting for it) is checked with the trainer's own objects; on a GPU the real
stream. Outputs equal plain decoding's either way (drafts are verified)."""
import pytest
import torch
import torch.nn.functional as F
from test_spot_trainer import PARAMS, PROMPTS, outputs

from tailrl import LLM, SpeculativeConfig
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.drafter.spot_trainer import SpotConfig, SpotTrainer
from tailrl.drafter.train import drafter_loss, sample_batch


class QueuedLane:
    """The side stream's interface on the CPU: ``launch`` keeps the step, which runs when
    ``done`` has been asked ``after`` times (the device finished it) or the host ``wait``s."""

    def __init__(self, after: int = 3) -> None:
        self.after, self.fn, self.asked, self.launches, self.joins = after, None, 0, 0, 0

    def launch(self, fn, inputs) -> None:
        assert self.fn is None and inputs                # one step in flight at most
        self.fn, self.asked = fn, 0
        self.launches += 1

    def _run(self) -> None:
        fn, self.fn = self.fn, None
        fn()

    def done(self) -> bool:
        self.asked += 1
        if self.fn is not None and self.asked >= self.after:
            self._run()
        return self.fn is None

    def join(self) -> None:
        assert self.fn is None                           # joined only once finished
        self.joins += 1

    def wait(self) -> None:
        if self.fn is not None:
            self._run()


def side_llm(model, drafter_dir, lane, **spot) -> tuple[LLM, SpotTrainer]:
    llm = LLM(model, dtype="float64", speculative=SpeculativeConfig(policy="fixed", method="drafter",
                                                                    drafter=drafter_dir, min_token_prob=0.0))
    src = next(s for s in llm.engine.speculator.sources if s.name == "drafter")
    llm.engine.speculator.choice.always = True
    cfg = dict(threshold=1000, min_windows=8, batch=16, unroll=2, max_share=1.0, lr=1e-3, stream="side")
    cfg.update(spot)
    trainer = SpotTrainer(src.drafter, DrafterBuffer(4096), SpotConfig(**cfg), lane=lane)
    llm.engine.speculator.collector = trainer.buffer
    llm.engine.idle_work = trainer
    return llm, trainer


def test_queued_steps_publish_only_once_landed_between_steps_and_keep_plain_outputs(model, drafter_dir):
    lane = QueuedLane(after=3)
    llm, trainer = side_llm(model, drafter_dir, lane)
    plain = LLM(model, dtype="float64")
    published: list[tuple[int, int]] = []                # (launches so far, queries so far) per publish
    inner = trainer.publish

    def publish():
        assert lane.fn is None                           # the step that made these weights has run
        published.append((lane.launches, lane.asked))
        inner()
    trainer.publish = publish
    for _ in range(2):
        assert outputs(llm.generate(PROMPTS, PARAMS)) == outputs(plain.generate(PROMPTS, PARAMS))
    m = trainer.metrics()                                # waits for the last step, then reads it
    assert lane.launches >= 3 and trainer.version == lane.launches == trainer.steps
    assert all(asked >= lane.after for _, asked in published[:-1])   # landed when the lane said so
    assert m["drafter/spot_steps"] > 0 and m["drafter/loss"] > 0
    assert llm.last_metrics["rollout/spec_draft_tokens/drafter"] > 0


def test_the_host_waits_for_a_queued_step_before_reading_or_training_on(model, drafter_dir):
    """``train``, ``weights``, ``set_weights``, ``save`` and ``metrics`` land a queued step first:
    none reads weights the step is still changing."""
    lane = QueuedLane(after=10**6)                        # never done on its own
    llm, trainer = side_llm(model, drafter_dir, lane)
    llm.generate(PROMPTS, PARAMS)
    assert lane.fn is not None and trainer.version == 0  # queued, never landed inside the rollout
    before = trainer.shadow.fc.weight.detach().clone()
    w = trainer.weights()
    assert lane.fn is None and trainer.version == 1
    assert not torch.equal(w["fc.weight"], before) and torch.equal(trainer.drafter.fc.weight, w["fc.weight"])
    trainer.after_step(1)                                # queues one more
    assert lane.fn is not None
    assert trainer.train(2) == 2 and lane.fn is None and trainer.version == 4    # landed, then two more


def test_side_needs_a_cuda_drafter_and_a_known_stream(model, drafter_dir):
    llm = LLM(model, speculative=SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir))
    src = llm.engine.speculator.sources[0]
    with pytest.raises(ValueError, match="stream='side' needs a drafter on a CUDA device"):
        SpotTrainer(src.drafter, DrafterBuffer(64), SpotConfig(stream="side"))
    with pytest.raises(ValueError, match="stream must be one of"):
        SpotConfig(stream="beside")


def test_the_loss_indexes_the_positions_that_count_as_a_boolean_mask_does(model, drafter_dir):
    """``drafter_loss`` gathers the positions that count with indices built on the host (no
    read-back); the loss and agreement equal the boolean-mask form's bit for bit."""
    llm, trainer = side_llm(model, drafter_dir, QueuedLane())
    llm.generate(PROMPTS, PARAMS)
    data = trainer.buffer.data(3)
    batch = sample_batch(data, 64, torch.Generator().manual_seed(3))
    d = trainer.shadow
    loss, agree = drafter_loss(d, batch, 3)
    outs = d.unroll(batch.hidden, batch.tokens, batch.lengths, 3)
    t = torch.arange(batch.tokens.shape[1])
    nxt = torch.cat([batch.hidden[:, 1:], torch.zeros_like(batch.hidden[:, :1])], 1)
    want = batch.hidden.new_zeros(())
    for k, (feat, logits) in enumerate(outs):
        keep = (t[None] - k >= batch.first[:, None]) & (t[None] + 1 < batch.lengths[:, None])
        target_p = torch.softmax(F.linear(nxt[keep], d.head), -1)
        ce = -(target_p * torch.log_softmax(logits[keep], -1)).sum(-1).mean()
        want = want + 0.7 ** k * (ce + F.smooth_l1_loss(feat[keep], nxt[keep]))
        if k == 0:
            want_agree = (logits[keep].argmax(-1) == target_p.argmax(-1)).float().mean()
    assert torch.equal(loss, want) and torch.equal(agree, want_agree)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_side_stream_trains_beside_the_rollout_with_plain_outputs(model, drafter_dir):
    """On a GPU: the spot trainer's steps on their own stream, the rollout's steps launched
    ahead beside them; outputs equal plain decoding's and versions are published."""
    kw = dict(dtype="bfloat16", device="cuda", kv_cache_gib=0.25)
    plain = LLM(model, **kw)
    llm = LLM(model, speculative=SpeculativeConfig(policy="fixed", method="hybrid", drafter=drafter_dir,
                                                   min_token_prob=0.0, ahead_above=4), **kw)
    src = next(s for s in llm.engine.speculator.sources if s.name == "drafter")
    trainer = SpotTrainer(src.drafter, DrafterBuffer(4096, "cuda"),
                          SpotConfig(threshold=1000, min_windows=8, batch=16, unroll=2, max_share=1.0, stream="side"))
    llm.engine.speculator.collector = trainer.buffer
    llm.engine.idle_work = trainer
    for _ in range(3):
        assert outputs(llm.generate(PROMPTS, PARAMS)) == outputs(plain.generate(PROMPTS, PARAMS))
    m = trainer.metrics()
    assert m["drafter/spot_steps"] > 0 and trainer.version > 0
