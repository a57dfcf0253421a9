"""tools/bench.py's own selftest (no GPU, no jax or torch import): FLOP and byte
formulas, the batching timer on a fake clock, ratios (ours/best, ours against the
targets' peer, ours/ceiling), WRONG and unchecked cells, the text, markdown and JSON
reports; and main() around the rows, with stand-ins for its runner and for nvidia-smi."""
import os
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


def test_main_records_the_gpu_state(tmp_path, monkeypatch, capsys):
    """main()'s own plumbing around the rows, with a stand-in for the runner (no jax)
    and for nvidia-smi: the GPU's state sampled through the run reaches the text report,
    the JSON and the markdown."""
    import json
    import types

    sys.path.insert(0, str(ROOT / "tools"))
    import bench

    class Runner:
        def __init__(self, args, sizes):
            self.device = types.SimpleNamespace(platform="gpu", device_kind="Fake GPU")
            self.torch, self.torch_reason = None, "no torch here"
            self.jax = types.SimpleNamespace(__version__="0")

        def ceilings(self):
            return {"copy_GBps": 1.0, "matmul_TFLOPs": 2.0, "copy_how": "-",
                    "matmul_how": "-", "nan_check": None}

        def bench_dense(self):
            return []

        def cleanup(self):
            pass

        def elapsed(self):
            return 1.0

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$*" in\n  *name,driver*) echo "Fake GPU, 580.1, 1 MiB";;\n'
                   '  *) echo "1755, 1980, 690.5, 700.0, 66, 0x0000000000000004";;\nesac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(bench, "Runner", Runner)
    js, md = tmp_path / "out.json", tmp_path / "bench.md"
    assert bench.main(["--rows", "dense", "--json", str(js), "--markdown", str(md)]) == 0
    line = ("GPU while busy (1 of 1 samples): SM clock 1755 MHz median (1755-1755, max 1980), "
            "power 690 W median (up to 690 of 700), 66 C median (up to 66); "
            "clock event reasons: software power cap 100 %")
    assert line in capsys.readouterr().out
    assert json.loads(js.read_text())["gpu_state"]["sm_mhz"]["median"] == 1755.0
    assert line + "." in md.read_text()
