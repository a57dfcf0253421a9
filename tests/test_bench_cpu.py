"""tools/bench.py's own selftest (no GPU, no jax or torch import): FLOP and byte
formulas, the batching timer on a fake clock, ratios (ours/best, ours against the
targets' peer, ours/ceiling), WRONG and unchecked cells, the text, markdown and JSON
reports."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_selftest():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--selftest"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "selftest ok" in run.stdout
    assert "ours/torch-flash" in run.stdout
