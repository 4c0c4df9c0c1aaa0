"""One engine admits the longest expected requests first, from the history store (engine/admission.py),
without changing any output."""
from tailrl import LLM, SamplingParams
from tailrl.engine.admission import by_history
from tailrl.engine.request import Request
from tailrl.speculative.history import HistoryStore


def _req(i: int, pid: str, max_tokens: int = 100, **kw) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=max_tokens), seed_key=i, prompt_id=pid, **kw)


def test_longest_history_first_unknown_prompts_treated_as_long_set_priorities_kept():
    store = HistoryStore()
    store.record("short", [[5] * 3, [5] * 7])
    store.record("long", [[5] * 40, [5] * 250])            # longer than max_tokens: 100
    reqs = [_req(0, "short"), _req(1, "long"), _req(2, "new"), _req(3, "short", priority=500.0),
            _req(4, "long"), _req(5, ""), _req(6, "short", priority=50.0)]
    got = by_history(reqs, store)
    assert [r.request_id for r in got] == ["r3", "r1", "r2", "r4", "r5", "r6", "r0"]
    # the estimates order the queue only: nothing becomes critical (speculative/critical.py)
    assert [(r.priority, r.length_prior) for r in reqs] == [(0.0, ())] * 3 + [(500.0, ())] + [(0.0, ())] * 2 + \
        [(50.0, ())]


def test_without_any_history_arrival_order():
    reqs = [_req(i, f"p{i}") for i in range(4)]
    assert by_history(reqs, HistoryStore()) == reqs


def test_an_engine_admits_the_prompt_that_ran_longest_first_and_outputs_do_not_change(ckpt_dir):
    path = ckpt_dir("qwen2")
    prompts, pids = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], ["a", "b", "c"]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    fifo = LLM(path, max_num_seqs=2).generate(prompts, sp, prompt_ids=pids)
    llm = LLM(path, max_num_seqs=2)
    for pid, n in zip(pids, (4, 11, 2)):
        llm.history.record(pid, [[9] * n])
    first: list[str] = []
    step = llm.engine.step

    def spy():
        if not first:
            first.extend(r.prompt_id for r in llm.engine.scheduler.running)
        return step()
    llm.engine.step = spy
    got = llm.generate(prompts, sp, prompt_ids=pids)
    assert first[0] == "b" and "c" not in first    # (b's sibling waits for its prefill: a takes the row)
    assert [[(c.token_ids, c.logprobs) for c in o.outputs] for o in got] == \
           [[(c.token_ids, c.logprobs) for c in o.outputs] for o in fifo]
