"""The README's torch_xla example (the code block after `<!-- example: torch-xla -->`)
runs as written, on torch_xla's CPU device, and computes what the torch CPU frontend
computes. Skipped where torch_xla is not installed."""

import os
import pathlib
import re

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- example: torch-xla -->"


def example() -> str:
    text = README.read_text()
    assert text.count(MARKER) == 1, f"README.md must hold exactly one {MARKER}"
    found = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    assert found, f"a ```python block must follow {MARKER}"
    return found.group(1)


def test_torch_xla_example_runs(capsys):
    import torch
    from xla_attn import torch as xt

    ns = {}
    exec(compile(example(), f"{README}:torch-xla", "exec"), ns)
    assert capsys.readouterr().out.strip() == "torch.Size([12, 8, 64])"
    # The same step on CPU tensors through the torch frontend: the caches the example
    # wrote in place, and its result (the compiled step again: the same cache write).
    q, k, v, slots, cu, lens, table = (ns[n].cpu() for n in
                                       ("q", "k", "v", "slots", "cu", "lens", "table"))
    key_cache, value_cache = torch.zeros(8, 16, 2, 64), torch.zeros(8, 16, 2, 64)
    xt.reshape_and_cache_flash(k, v, key_cache, value_cache, slots)
    assert torch.equal(ns["key_cache"].cpu(), key_cache)
    assert torch.equal(ns["value_cache"].cpu(), value_cache)
    out = xt.flash_attn_varlen(q, k, v, cu, cu, 7, 7, causal=True)
    expected = xt.paged_attention(out, key_cache, value_cache, lens, table, cu, 0.125)
    got = ns["step"](ns["q"], ns["k"], ns["v"], ns["key_cache"], ns["value_cache"])
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)
