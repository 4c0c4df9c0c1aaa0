"""A CUDA stream of the spot trainer's own (``SpotConfig.stream="side"``): a training step is
queued there, beside the rollout's steps on the current stream, and the host goes on at once.

- ``launch(fn, inputs)``: the side stream first waits for what the current stream has queued
  (the hidden states a step handed out, the last weights published), then ``fn`` queues its
  kernels on the side stream; ``inputs`` (tensors made on the current stream that those
  kernels read) are marked as used there, so the allocator does not hand their memory to the
  rollout before the side stream is done with them. An event marks the step's end.
- ``done()``: whether that step has finished (asks the device, never waits).
- ``join()``: the current stream waits for the side stream (queued on the device, the host
  does not wait): what the current stream queues next sees the step's results.
- ``wait()``: the host waits for the step (then ``join``, before the host reads its results).

At most one step is queued at a time (the trainer launches the next only once ``done``), so a
rollout step shares the device with at most one training step's kernels.
"""
from __future__ import annotations

from typing import Callable

import torch


class SideStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._event: torch.cuda.Event | None = None

    def launch(self, fn: Callable[[], None], inputs: list[torch.Tensor]) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn()
        for x in inputs:
            x.record_stream(self.stream)
        self._event = torch.cuda.Event()
        self._event.record(self.stream)

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
