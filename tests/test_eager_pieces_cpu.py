"""tools/eager_pieces.py on the CPU (the Host reference, tiny shapes): every piece of the
planned call and of the fwd+bwd step is timed (no figure is asserted: timings are the
tool's output, not a test's)."""
import math
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import eager_pieces  # noqa: E402

PIECES = ("forward, planned", "  its signature", "  the plan's call",
          "  its outputs' allocations", "  its workspace's allocation",
          "  the native call (checks, launch)", "fwd+bwd step", "  the forward, gradients asked",
          "  the backward's plan call", "  the backward's native call",
          "the autograd engine's floor (grad of x * 2)", "torch SDPA fwd+bwd step")


def test_every_piece_timed(monkeypatch):
    import xla_attn.torch as xt
    monkeypatch.setattr(xt, "_plans", {})
    p = eager_pieces.pieces(tokens=8, heads=2, head_dim=16, number=2)
    assert tuple(p) == PIECES
    assert all(math.isfinite(s) and s > 0 for s in p.values())
