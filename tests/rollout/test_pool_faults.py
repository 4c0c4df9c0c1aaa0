"""Local worker processes: outputs identical to one engine, also when an instance is killed
mid-rollout (its requests continue elsewhere from the tokens they had); a clear error only
when no instance is left."""
import logging
import os
import signal

import pytest
from pool_utils import PROMPTS, SEEDED, KillAt, assert_same, lengths, pool_ckpt

from tailrl import LLM
from tailrl.programs import describe_exit

log = logging.getLogger(__name__)


def test_killed_process_loses_nothing(ckpt_dir, caplog):
    path = pool_ckpt(ckpt_dir)
    ref = LLM(path, dtype="float64").generate(PROMPTS, SEEDED)
    total = sum(map(sum, lengths(ref)))
    llm = LLM(path, dtype="float64", instances=2, scheduler="context",
              pool={"chunk_tokens": 8, "threads_per_instance": 1, "steps_per_call": 2})
    try:
        assert all(h.pid != os.getpid() for h in llm.pool.instances)     # real worker processes
        assert_same(llm.generate(PROMPTS, SEEDED), ref)
        clean = llm.last_metrics["timing_s/gen"]
        assert llm.last_metrics["pool/faults"] == 0 and llm.last_metrics["pool/migrations"] >= 0

        kill = KillAt(llm.pool.instances[1], total, 0.3)
        llm.pool.on_progress = kill
        assert_same(llm.generate(PROMPTS, SEEDED), ref)
        m = llm.last_metrics
        assert kill.killed_at is not None and m["pool/faults"] == 1 and m["pool/instances_alive"] == 1
        assert m["pool/recomputes"] > 0                 # its requests restarted from their tokens
        # the dead process is collected before its status is read: the signal is named
        pid = llm.pool.instances[1].pid
        assert f"instance 1 (pid {pid}) died: killed by SIGKILL" in caplog.text
        log.warning("fault makespan: %.2f s with instance 1 killed at %d/%d tokens vs %.2f s clean "
                    "(%d requests recomputed, %d tokens)", m["timing_s/gen"], kill.killed_at, total, clean,
                    m["pool/recomputes"], m["pool/recomputed_tokens"])

        llm.pool.on_progress = None                      # the survivor carries on alone
        assert_same(llm.generate(PROMPTS, SEEDED), ref)

        os.kill(llm.pool.instances[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="every instance.*instance 0 .*killed by SIGKILL"):
            llm.generate(PROMPTS, SEEDED)
    finally:
        llm.close()


def test_exit_status_in_words():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(1) == "exited with code 1"
    assert "still running" in describe_exit(None)
