"""The recurrent states of a model with Gated DeltaNet layers (Qwen3.5: model/deltanet.py), a row
per running request beside its K/V blocks: per DeltaNet layer its causal conv's last K-1 inputs
(conv [L, rows, 2, C, K-1], the model's dtype) and its delta-rule state (ssm [L, rows, 2, VH, DK,
DV]: float32, float64 for a float64 model), allocated for ``max_rows`` rows at first use (given
back with the K/V pool's memory); index 1 of the third dimension is the row's snapshot of them
after its prompt but the last token.

A row's states hold exactly its committed tokens (kernels/delta.py): a step's committed tokens
advance them in place, draft nodes a copy; ``accept`` runs a row's accepted nodes through them
again from the inputs the step kept (the same kernel on the same inputs: the bits a plain step
would have given). A row whose first token of a step is position 0 starts from zeros, so a
request admitted or readmitted after preemption (recompute) needs no reset.

A group's samples share their prompt's prefill as the K/V pool shares its blocks (cache.py
``share``): the step whose committed tokens reach a prompt's last but one copies the row's
states to its snapshot (``plan``), and a sibling admitted with the prompt lent starts from the
lender's snapshot (``lend``), as if it had computed the prompt itself. What a state can not do,
the engine does not ask of it: no prefix is taken from the prefix cache (the state at a cached
prefix's end is not kept), a migrated request is recomputed, no tree drafts, no steps launched
with follow-ups (``refuse``). Split over tensor parallel ranks, each rank keeps its heads'
states; rank 0 plans, and its lends, moves and acceptances reach the others
(kv/mirrored.py, engine/tensor_parallel.py). A step's rows are planned from the arrays the host
built it from (``Batch.host``: no wait for the device); a step from a CUDA graph's bucket gets
them staged into the bucket's static runs, the bucket's other runs of no tokens (engine/graphs.py:
plain steps only, a step verifying drafts runs eagerly).
"""
from __future__ import annotations

import numpy as np
import torch

from tailrl.config import EngineConfig, SpeculativeConfig
from tailrl.kernels import select
from tailrl.kernels.delta import StatePlan
from tailrl.model.args import ModelArgs


def refuse(args: ModelArgs, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
    """A ValueError naming what a model with recurrent layers can not run with, before any work."""
    if not args.linear_layers:
        return
    if speculative is not None and speculative.max_tree_paths > 1:
        raise ValueError(f"speculative_config.max_tree_paths: {args.architecture} drafts chains only (a tree node "
                         f"would need a state of its own), got {speculative.max_tree_paths}")
    if speculative is not None and speculative.ahead_drafts:
        raise ValueError(f"speculative_config.ahead_drafts: not with {args.architecture}'s recurrent layers, got "
                         f"{speculative.ahead_drafts}")


class RecurrentStates:
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: str | torch.device, max_rows: int):
        kh, vh, kd, vd, width = args.linear_dims
        n = len(args.linear_layers)
        self.layers = {layer: j for j, layer in enumerate(args.linear_layers)}
        self._shapes = ((n, max_rows, 2, args.conv_channels, width - 1), dtype), (
            (n, max_rows, 2, vh, kd, vd), torch.float64 if dtype == torch.float64 else torch.float32)
        self.device = device
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def conv(self) -> torch.Tensor:
        return self._allocated()[0]

    @property
    def ssm(self) -> torch.Tensor:
        return self._allocated()[1]

    def _allocated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm), allocated at first use (again after ``free``) and left as they were in
        memory: a row's states are written before they are read (its first step starts at
        position 0, ``fresh``, or from a lender's snapshot, ``lend``), so on a CPU the OS gives
        a row's pages when a request first runs there (96 MiB a row at Qwen3.5-9B's shapes)."""
        if self._tensors is None:
            self._tensors = tuple(torch.empty(shape, dtype=dt, device=self.device) for shape, dt in self._shapes)
        return self._tensors

    def free(self) -> None:
        """Give the states' memory back (no row running: the K/V pool's ``free_memory``)."""
        self._tensors = None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``layer``'s (conv [rows, 2, C, K-1], ssm [rows, 2, VH, DK, DV])."""
        j = self.layers[layer]
        return self.conv[j], self.ssm[j]

    @property
    def bytes(self) -> int:
        """The states' bytes while allocated (0 after ``free``)."""
        return 0 if self._tensors is None else sum(t.numel() * t.element_size() for t in self._tensors)

    @staticmethod
    def row_bytes(args: ModelArgs, elem_bytes: int) -> int:
        """A row's states and snapshot over every DeltaNet layer, in bytes (the delta rule's in
        float32; float64's engine: 8 bytes, counted as such by its caller's ``elem_bytes``)."""
        kh, vh, kd, vd, width = args.linear_dims
        acc = max(elem_bytes, 4)
        return 2 * len(args.linear_layers) * (args.conv_channels * (width - 1) * elem_bytes + vh * kd * vd * acc)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s states (and snapshot) become row ``dst``'s."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def lend(self, src: int, dst: int) -> None:
        """Row ``dst`` starts from row ``src``'s snapshot (its prompt but the last token), which
        becomes its own snapshot too (a lender in turn)."""
        for t in (self.conv, self.ssm):
            t[:, dst, 0] = t[:, src, 1]
            t[:, dst, 1] = t[:, src, 1]

    @staticmethod
    def plan(batch, reqs: list) -> StatePlan:
        """The step's rows (``StatePlan``) from a built batch (``reqs[r]``: block-table row r's
        request; read from its host arrays, ``Batch.host``: no wait for the device): each run of
        tokens of one row, the nodes of its plan's draft last; the run whose committed tokens
        reach its prompt's last but one snapshots the states there."""
        rows, positions, sample = (np.asarray(x, dtype=np.int64) for x in batch.host)
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        counts = np.diff(np.r_[starts, len(rows)])
        drafting = [(i, int(rows[sample[p.entry]]), len(p.draft_tokens)) for i, p in enumerate(batch.plans)
                    if p.draft_tokens]
        drafted = {r: n for _, r, n in drafting}
        own = rows[starts]
        d = np.array([drafted.get(int(r), 0) for r in own], dtype=np.int64)
        first = positions[starts]
        prompt = np.array([reqs[r].num_prompt_tokens - 1 for r in own], dtype=np.int64)
        snap = np.where((first < prompt) & (prompt <= first + counts - d), prompt - first, 0)
        seqs = np.stack([own, starts, counts, counts - d, first == 0, snap], axis=1).astype(np.int64)
        out = StatePlan(None, host=seqs)
        if drafted:
            out.drafts_host = np.concatenate([np.arange(s + c - k, s + c) for s, c, k in zip(starts, counts, d) if k])
            kept_at = dict(zip(own[d > 0].tolist(), (np.cumsum(d) - d)[d > 0].tolist()))   # row -> its first kept node
            out.nodes = {i: (r, kept_at[r]) for i, r, _ in drafting}
        return out if batch.graph is not None else out.on(batch.input_ids.device)   # a graph reads its own

    def accept(self, model, batch, accepted: list[int]) -> None:
        """Each plan's first ``accepted[i]`` draft nodes run through its row's states in place,
        from the inputs the step kept (``StatePlan.kept``)."""
        plan: StatePlan = batch.meta.states
        if plan is None or plan.drafts is None:
            return
        runs = [(*plan.nodes[i], k, k, 0, 0) for i, k in enumerate(accepted) if k and i in plan.nodes]
        if not runs:
            return
        model.advance_states(self, plan, np.array(runs, dtype=np.int64))

    def advance(self, model, plan: StatePlan, runs: np.ndarray) -> None:
        """``accept``'s work on this process's states and layers (``model``: its Transformer; a
        tensor parallel rank's, for its heads): ``runs`` [R, 6], seqs over ``plan.kept``."""
        accept = torch.from_numpy(runs).to(self.conv.device)
        kernels = select(self.conv.device, self.conv.dtype)
        for layer in self.layers:
            model.layers[layer].linear.advance(kernels, plan.kept[layer], self.layer(layer), accept)
