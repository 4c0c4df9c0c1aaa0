"""``python -m tailrl.cli`` runs the same command line as the ``tailrl`` console script
(benchmarks/serve_load.py starts its server that way)."""
import subprocess
import sys


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "tailrl.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: tailrl COMMAND" in out.stdout and "serve" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tailrl.cli", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr
