"""The README's code examples run as written. Each example is the fenced code block right
after an HTML comment `<!-- example: NAME -->` in README.md; a test per NAME extracts it
with `readme_example(NAME)`, executes it in a fresh namespace and checks what it made."""

import pathlib
import re

import jax
import numpy as np
import pytest

from xla_attn.testing import reference as ref

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->\s*\n```(\w*)\n(.*?)\n```", re.S)


def readme_examples() -> dict[str, tuple[str, str]]:
    """{name: (language, code)} of every marked example."""
    found = {}
    for name, language, code in _EXAMPLE.findall(README.read_text()):
        assert name not in found, f"README.md has two examples named {name!r}"
        found[name] = (language, code)
    return found


def readme_example(name: str) -> str:
    examples = readme_examples()
    assert name in examples, f"no '<!-- example: {name} -->' before a code block in README.md"
    return examples[name][1]


def run_example(name: str) -> dict:
    namespace = {"__name__": f"readme_{name.replace('-', '_')}"}
    exec(compile(readme_example(name), f"README.md:{name}", "exec"), namespace)
    return namespace


def test_examples_are_python():
    assert readme_examples(), "README.md has no marked examples"
    for name, (language, _) in readme_examples().items():
        assert language == "python", f"example {name!r} is fenced as {language!r}"


def test_jax_sharding_example():
    """Runs on the default backend's devices: the 4 fake CPU devices (conftest), or
    the GPUs of a multi-GPU machine. The heads stay split, the numbers and the gradient
    are right, the shard_map variant agrees."""
    if len(jax.devices()) < 2:
        pytest.skip("the example needs several devices")
    ns = run_example("jax-sharding")
    q, kv, out, cu_q, cu_k = (np.asarray(ns[n]) for n in ("q", "kv", "out", "cu_q", "cu_k"))
    assert ns["out"].addressable_shards[0].data.shape == (96, 8, 64)
    text = ns["attn"].lower(ns["q"], ns["kv"], ns["kv"]).compile().as_text()
    assert not re.search(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(", text)
    want, _ = ref.flash_attn_varlen_ref(q, kv, kv, cu_q, cu_k, None, causal=True)
    ref.assert_attention_close(out, want, "float32")

    dout = np.ones_like(q)
    dq, _, _ = ref.flash_attn_varlen_bwd_ref(dout, q, kv, kv, cu_q, cu_k, None, causal=True)
    assert ref.rel_error(np.asarray(ns["grads"]), dq) < ref.BOUNDS["float32"]
    assert ns["grads"].addressable_shards[0].data.shape == (96, 8, 64)

    same = jax.jit(lambda q, k, v: ns["same"](q, k, v, ns["cu_q"], ns["cu_k"], 56, 78,
                                              causal=True))
    ref.assert_bits_equal(np.asarray(same(ns["q"], ns["kv"], ns["kv"])), out)
