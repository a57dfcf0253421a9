"""tools/exp_rate.py without a GPU: its polynomial, emulated in float32 as the kernel
computes it, is 2^x to the error its docstring claims, and its rate arithmetic."""
import pathlib
import re
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import exp_rate  # noqa: E402


def _poly_exp2(x: np.ndarray) -> np.ndarray:
    """The kernel's polynomial branch in float32: clamp, shifter rounding, Horner, exponent
    add (its coefficients read from the kernel source)."""
    c3, c2, c1, c0 = (np.float32(v) for v in re.search(
        r"fmaf\(fmaf\(fmaf\(([\d.e-]+)f, f, ([\d.e-]+)f\), f, ([\d.e-]+)f\), f,\s*([\d.e-]+)f\)",
        exp_rate.SOURCE).groups())
    shifter = np.float32(12582912.0)
    x = np.clip(x.astype(np.float32), np.float32(-126), np.float32(126))
    j = (x + shifter).astype(np.float32)
    f = (x - (j - shifter)).astype(np.float32)
    p = (((c3 * f + c2) * f + c1) * f + c0).astype(np.float32)
    bits = p.view(np.int32) + (j.view(np.int32) << np.int32(23))
    return bits.astype(np.int32).view(np.float32)


def test_polynomial_is_exp2_to_its_stated_error():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-125.5, 125.5, 200_000), np.arange(-125, 126, 0.25)])
    got = _poly_exp2(x).astype(np.float64)
    want = np.exp2(x.astype(np.float32).astype(np.float64))
    assert np.all(got > 0)
    assert np.max(np.abs(got / want - 1)) < 8e-5  # 7.5e-5 fitted (docstring of poly_exp2)


def test_polynomial_clamps_instead_of_wrapping():
    big = _poly_exp2(np.array([300.0, -300.0, -np.inf, np.inf], np.float32))
    assert np.all(np.isfinite(big)) and np.all(big >= 0)
    assert big[0] > 1e37 and big[1] < 2e-38


def test_rate_is_exponentials_an_sm_a_clock():
    # 1024 threads x 2000 trips x 8 chains in 1,024,000 cycles: 16 a clock
    assert exp_rate.rate(2000 * 8, 1_024_000) == 16.0
    assert [m[2] for m in exp_rate.MODES] == [1, 2, 2, 1]
