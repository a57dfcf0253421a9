"""tools/build_kernels.py's ptxas step on a stand-in ptxas (the real one comes with the
CUDA wheels): a kernel whose wgmma ptxas serialized fails the build."""
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import build_kernels as bk  # noqa: E402

SERIALIZED = ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions "
              "are serialized due to program dependence on compiler-inserted WG.DP in divergent "
              "path in the function 'k'\n")


def _fake_ptxas(monkeypatch, stderr, returncode=0):
    def run(args, **kwargs):
        pathlib.Path(args[args.index("-o") + 1]).write_bytes(b"cubin")
        return subprocess.CompletedProcess(args, returncode, "", stderr)
    monkeypatch.setattr(bk.subprocess, "run", run)


def test_clean_assembly_returns_the_cubin(monkeypatch):
    _fake_ptxas(monkeypatch, "")
    assert bk.ptxas_cubin("ptxas", b".version 8.0", "90a") == b"cubin"


def test_serialized_wgmma_fails_the_build(monkeypatch, capsys):
    _fake_ptxas(monkeypatch, SERIALIZED)
    with pytest.raises(RuntimeError, match="wgmma serialized"):
        bk.ptxas_cubin("ptxas", b".version 8.0", "90a")
    assert "C7518" in capsys.readouterr().err  # ptxas' own words are shown


def test_ptxas_error_is_raised(monkeypatch):
    _fake_ptxas(monkeypatch, "ptxas fatal   : Unresolved extern function 'f'\n", returncode=255)
    with pytest.raises(subprocess.CalledProcessError):
        bk.ptxas_cubin("ptxas", b".version 8.0", "90a")
