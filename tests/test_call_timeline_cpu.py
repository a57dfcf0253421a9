"""tools/call_timeline.py's summary of GPU activities (the profiling needs a GPU; the
arithmetic on the activities it reads does not)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import call_timeline  # noqa: E402

# two calls: a memset, a 3 us fusion and a 100 us kernel each, 2 us apart
EVENTS = [("Memset", 0, 1_000), ("fusion", 2_000, 3_000), ("attn_kernel", 6_000, 100_000),
          ("Memset", 110_000, 1_000), ("fusion", 112_000, 5_000),
          ("attn_kernel", 118_000, 102_000)]


def test_period_busy_idle_and_names():
    s = call_timeline.summarize(EVENTS, calls=2)
    assert s["period_us"] == pytest.approx(110.0)  # 0 .. 220 us over 2 calls
    assert s["busy_us"] == pytest.approx(106.0)  # (1 + 3 + 100 + 1 + 5 + 102) / 2
    assert s["idle_us"] == pytest.approx(4.0)
    names = [a["name"] for a in s["activities"]]
    assert names == ["attn_kernel", "fusion", "Memset"]  # by time a call
    kernel = s["activities"][0]
    assert kernel["per_call"] == 1.0 and kernel["median_us"] == pytest.approx(101.0)
    gaps = {g["between"]: g for g in s["gaps"]}
    assert set(gaps) == {"Memset -> fusion", "fusion -> attn_kernel", "attn_kernel -> Memset"}
    assert gaps["Memset -> fusion"]["median_us"] == pytest.approx(1.0)  # 1 and 1 us
    assert gaps["fusion -> attn_kernel"]["median_us"] == pytest.approx(1.0)  # 1 and 1 us
    between = gaps["attn_kernel -> Memset"]  # once over two calls: 4 us
    assert between["per_call"] == 0.5 and between["median_us"] == pytest.approx(4.0)
    text = call_timeline.report(s)
    assert "idle gaps:" in text
    assert text.splitlines()[0] == "period 110.0 us a call: busy 106.0, idle 4.0"
    assert "attn_kernel" in text.splitlines()[1]


def test_empty_or_missing_trace_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no GPU activity"):
        call_timeline.summarize([], calls=3)
    with pytest.raises(RuntimeError, match="no \\*.xplane.pb"):
        call_timeline.gpu_activities(str(tmp_path))


def test_varlen_inputs_are_the_bench_rows():
    """--varlen packs bench.py's varlen lengths (16 sequences, 16 K tokens at seed 0) into
    random inputs; --calls 0 is refused with the flag as without it."""
    import bench
    import numpy as np

    fwd, (q, k, v) = call_timeline.varlen_call("ours", 64, seed=0)
    assert q.shape == (sum(bench.varlen_lengths(16, 1024, 0)), 16, 64) == k.shape == v.shape
    assert float(np.abs(np.asarray(q[:64], np.float32)).max()) > 0  # random, never zeros
    with pytest.raises(SystemExit):
        call_timeline.main(["--calls", "0", "--varlen"])
