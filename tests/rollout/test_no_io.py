"""The policies must stay plain objects: importable without torch, usable by any driver."""
import subprocess
import sys


def test_policies_import_without_torch_or_the_simulator():
    code = ("import sys; import tailrl.rollout.policies, tailrl.rollout.buffer; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('tailrl.sim') "
            "or m.startswith('tailrl.engine')]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": "."}, cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stdout + out.stderr
