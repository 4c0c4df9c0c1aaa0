import json

import pytest

from tailrl.sim.cli import main


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_simulate_prints_a_table_plots_and_a_json_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = main(["--workload", "qwen2vl-72b", "--requests", "320", "--instances", "2",
               "--policies", "static,context,oracle", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "makespan_s" in out
    fig = last_json(out)
    assert fig["requests"] == 320 and fig["baseline"] == "static"
    assert list(fig["policies"]) == ["static", "context", "oracle"]
    for name, f in fig["policies"].items():
        for key in ("makespan_s", "throughput_tok_s", "tail_s", "idle_frac", "preemptions", "migrated_gb",
                    "speedup_vs_static", "tail_vs_static", "cpu_s"):
            assert key in f, (name, key)
    assert fig["policies"]["static"]["speedup_vs_static"] == 1.0
    for p in fig["plots"]:
        assert (tmp_path / p.split("/")[-1]).stat().st_size > 10_000


def test_simulate_reads_a_trace(tmp_path, capsys):
    rows = [dict(epoch=e, prompt_id=p, prompt_len=20, max_tokens=400, response_len=40 + 37 * ((p * 7 + e + k) % 9))
            for e in (0, 1) for p in range(6) for k in range(4)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    rc = main(["--workload", str(path), "--instances", "2", "--policies", "static,history", "--no-plots",
               "--max-num-seqs", "4", "--kv-capacity", "100000"])
    fig = last_json(capsys.readouterr().out)
    assert rc == 0 and fig["requests"] == 24 and fig["plots"] == []


def test_bad_arguments_return_2(capsys):
    assert main(["--policies", "fifo", "--no-plots"]) == 2
    assert main(["--workload", "nope", "--no-plots"]) == 2
    assert main(["--requests", "100", "--no-plots"]) == 2      # not a multiple of 16
