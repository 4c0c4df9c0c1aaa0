"""``group`` drafts (Seer grouped speculation): live outputs of a request's GRPO siblings.

One suffix index per group id holds every member's ``prompt[-max_match_len:] + output``,
fed live as members generate, and serves drafts to all members. A request never drafts from
its own tokens here (that is the ``self`` source's job, and counting them would make the two
sources' statistics indistinguishable): proposals exclude the occurrences in the member's own
sequence, so a member sees the counts of its siblings only.

Members that finish stay in the group index (finished siblings are the best references);
a member that ``start``s again (a resumed chunk) continues its old sequence. The group is
dropped when no member is live; ``propose`` starts unknown ones.

Indexing is lazy: each member keeps a reference to its request, and the first ``propose`` in
a group after a step's tokens (``observe_step``, once a step; or any ``observe``) catches the
index up with every member's output tokens (live or finished): one pass per group asked and
step, nothing per row that is not asked (a step launched ahead settles hundreds of rows, of
which a few draft), and groups that finish before speculation turns on are never indexed.
"""
from __future__ import annotations

from typing import Any

from tailrl.speculative.draft import Draft
from tailrl.speculative.sources.base import MatchParams, propose_from, propose_many_from, settled
from tailrl.speculative.sources.suffix_index import SuffixIndex


class _Member:
    __slots__ = ("seq_id", "inserted", "live", "req")

    def __init__(self, seq_id: int, req: Any) -> None:
        self.seq_id = seq_id         # sequence in the group index
        self.inserted = 0            # output tokens already inserted
        self.live = False
        self.req = req               # the request, read lazily for its output tokens


class _Group:
    __slots__ = ("index", "members", "live", "synced")

    def __init__(self, index: SuffixIndex) -> None:
        self.index = index
        self.members: dict[str, _Member] = {}
        self.live = 0
        self.synced = -1             # the source's step when the index last caught up (-1: since a start)


class GroupSource:
    name = "group"
    observes = False            # its observe needs no row: the speculator calls observe_step once a step

    def __init__(self, params: MatchParams | None = None) -> None:
        self.params = params or MatchParams()
        self._groups: dict[str, _Group] = {}
        self._step = 0               # steps (or observed tokens) so far: a group synced before is stale

    def __len__(self) -> int:
        return len(self._groups)

    def start(self, req: Any) -> None:
        if not req.group_id:
            return
        g = self._groups.get(req.group_id)
        if g is None:
            g = self._groups[req.group_id] = _Group(self.params.index())
        m = g.members.get(req.request_id)
        if m is not None and m.live:
            return                                    # already live
        if m is None:
            prompt = req.prompt_token_ids
            tail = list(prompt[max(0, len(prompt) - self.params.max_match_len):])
            m = g.members[req.request_id] = _Member(g.index.add(tail), req)
        m.req = req
        m.live = True
        g.live += 1
        g.synced = -1

    @staticmethod
    def _sync(g: _Group, m: _Member) -> None:
        out = m.req.output_token_ids
        n = settled(out)
        if n > m.inserted:
            g.index.extend(m.seq_id, out[m.inserted:n])
            m.inserted = n

    def _member(self, req: Any) -> tuple[_Group, _Member] | None:
        g = self._groups.get(req.group_id) if req.group_id else None
        m = g.members.get(req.request_id) if g is not None else None
        if m is None or not m.live:
            if not req.group_id:
                return None
            self.start(req)
            g = self._groups[req.group_id]
            m = g.members[req.request_id]
        return g, m

    def observe(self, req: Any, new_tokens: list[int]) -> None:
        """Some request has new tokens: every group's next ``propose`` reads its members' tokens."""
        self.observe_step()

    def observe_step(self) -> None:
        """A step's tokens are settled (the speculator's call, once a step, for all its rows)."""
        self._step += 1

    def _lookup(self, req: Any) -> tuple[SuffixIndex, int] | None:
        """The request's group index, caught up with its members' tokens, and its own sequence
        there (excluded from its drafts); None without siblings."""
        gm = self._member(req)
        if gm is None:
            return None
        g, m = gm
        if len(g.members) < 2:
            return None
        if g.synced != self._step:
            for member in g.members.values():
                self._sync(g, member)
            g.synced = self._step
        return g.index, m.seq_id

    def propose(self, req: Any, max_tokens: int, max_paths: int) -> Draft | None:
        lk = self._lookup(req)
        return None if lk is None else propose_from(lk[0], req, self.params, max_tokens, max_paths, self.name,
                                                    exclude=lk[1])

    def propose_many(self, reqs: list[Any], max_tokens: list[int], max_paths: int,
                     contexts: list[list[int]]) -> list[Draft | None]:
        return propose_many_from([self._lookup(r) for r in reqs], contexts, self.params, max_tokens, max_paths,
                                 self.name)

    def finish(self, req: Any) -> None:
        g = self._groups.get(req.group_id) if req.group_id else None
        m = g.members.get(req.request_id) if g is not None else None
        if m is None or not m.live:
            return
        m.live = False
        g.live -= 1
        if g.live == 0:
            del self._groups[req.group_id]
