"""The speculation-policy protocol, and the fixed policy used by tests and ablations.

Per engine step the ``Speculator`` calls, in order:

1. ``max_paths(batch_size) -> int``: how many tree paths sources may propose this step;
   ``0`` means "do not speculate at this batch size", and the sources are not even asked
   (drafting costs CPU time; at batch 256 it is pure waste). *Extension of the contract.*
   ``draft_limit(req) -> int``: the most draft nodes the policy could give this request
   this step (its window, the arm's size, ...); sources are asked for no more, since
   growing nodes that will be cut is wasted CPU time. *Extension.*
2. ``allocate(proposals, batch_size) -> list[int]``: draft nodes to verify per proposal
   (``0`` = plain decode). The caller truncates each draft with ``draft.truncate(k)``.
3. ``observe_draft(seconds, requests)``: CPU time this step spent drafting for ``requests``
   requests (the per-request cost scales with how many ask). *Extension.*
4. ``update(req, draft_nodes, accepted, source, max_depth=..., score=...)``: after
   verification of one request's draft: nodes verified, tokens accepted (bonus excluded), the
   draft's deepest path (full acceptance = ``accepted == max_depth``; defaults to
   ``draft_nodes``, i.e. a chain) and its score (expected accepted nodes by its own path
   probabilities).
5. ``observe_step(batch_size, num_tokens, seconds)``: every decode step, drafts or not (steps
   with prefill chunks are not reported); ``seconds`` is the whole step, drafting included.
6. ``finish(req)``: the request left this engine.

``batch_size`` is the number of requests sampling a token in the step.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tailrl.speculative.draft import Draft


@runtime_checkable
class SpecPolicy(Protocol):
    def max_paths(self, batch_size: int) -> int: ...

    def draft_limit(self, req: Any) -> int: ...

    def allocate(self, proposals: list[tuple[Any, Draft]], batch_size: int,
                 max_tokens: int | None = None) -> list[int]: ...

    def observe_draft(self, seconds: float, requests: int = 1) -> None: ...

    def update(self, req: Any, draft_nodes: int, accepted: int, source: str, *,
               max_depth: int | None = None, score: float | None = None) -> None: ...

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None: ...

    def finish(self, req: Any) -> None: ...


class FixedPolicy:
    """``k`` draft nodes for every proposal (capped by the draft's size), at any batch size.

    ``max_spec_batch > 0`` switches speculation off above that batch size.
    """

    def __init__(self, k: int, paths: int = 1, max_spec_batch: int = 0) -> None:
        if k < 0 or paths < 1:
            raise ValueError(f"FixedPolicy needs k >= 0 and paths >= 1, got k={k}, paths={paths}")
        self.k = k
        self.paths = paths
        self.max_spec_batch = max_spec_batch

    def _on(self, batch_size: int) -> bool:
        return self.k > 0 and (self.max_spec_batch == 0 or batch_size <= self.max_spec_batch)

    def max_paths(self, batch_size: int) -> int:
        return self.paths if self._on(batch_size) else 0

    def draft_limit(self, req: Any) -> int:
        return self.k

    def allocate(self, proposals: list[tuple[Any, Draft]], batch_size: int,
                 max_tokens: int | None = None) -> list[int]:
        if not self._on(batch_size):
            return [0] * len(proposals)
        return [min(self.k, len(d)) for _, d in proposals]

    def observe_draft(self, seconds: float, requests: int = 1) -> None:
        pass

    def update(self, req: Any, draft_nodes: int, accepted: int, source: str, *,
               max_depth: int | None = None, score: float | None = None) -> None:
        pass

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        pass

    def finish(self, req: Any) -> None:
        pass
