"""The README's torch_xla example (the code block after `<!-- example: torch-xla -->`)
runs as written, on torch_xla's CPU device. Skipped where torch_xla is not installed."""

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
    exec(compile(example(), f"{README}:torch-xla", "exec"), {})
    assert capsys.readouterr().out.strip() == "torch.Size([12, 8, 64])"
