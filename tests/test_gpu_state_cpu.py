"""tools/gpu_state.py without a GPU: nvidia-smi's lines parsed, idle samples kept out of
the figures, the older reason field taken where the newer is refused, and a machine
without nvidia-smi sampled as nothing."""

import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

import gpu_state  # noqa: E402

BUSY = "1980, 1980, 650.50, 700.00, 61, 0x0000000000000000"
CAPPED = "1755, 1980, 699.10, 700.00, 66, 0x0000000000000004"
IDLE = "345, 1980, 90.00, 700.00, 40, 0x0000000000000001"


def test_parse():
    s = gpu_state.parse(CAPPED)
    assert s == {"sm_mhz": 1755.0, "max_sm_mhz": 1980.0, "power_w": 699.1,
                 "power_limit_w": 700.0, "temp_c": 66.0, "reasons": 0x4}
    na = gpu_state.parse("1980, 1980, [N/A], [N/A], 50, 0x0")
    assert na["power_w"] is None and na["sm_mhz"] == 1980.0 and na["reasons"] == 0
    assert gpu_state.parse("1980, 1980, 650") is None
    assert gpu_state.parse("") is None


def test_summary_leaves_idle_samples_out():
    samples = [gpu_state.parse(x) for x in (IDLE, BUSY, BUSY, CAPPED, IDLE)]
    s = gpu_state.summarize(samples)
    assert s["samples"] == 5 and s["busy_samples"] == 3
    assert s["sm_mhz"] == {"median": 1980.0, "min": 1755.0, "max": 1980.0}
    assert s["power_w"]["max"] == 699.1 and s["power_limit_w"] == 700.0
    assert s["temp_c"]["median"] == 61.0
    assert s["reasons"] == {"software power cap": 1 / 3}  # idle is not a reason here
    line = gpu_state.summary_line(s)
    assert line.startswith("GPU while busy (3 of 5 samples): SM clock 1980 MHz median "
                           "(1755-1980, max 1980)")
    assert "power 650 W median (up to 699 of 700), 61 C median (up to 66)" in line
    assert line.endswith("clock event reasons: software power cap 33 %")


def test_summary_line_without_samples():
    assert "not sampled" in gpu_state.summary_line(None)
    idle = gpu_state.summarize([gpu_state.parse(IDLE)])
    assert gpu_state.summary_line(idle).endswith("none busy")
    busy = gpu_state.summarize([gpu_state.parse(BUSY)])
    assert gpu_state.summary_line(busy).endswith("clock event reasons: none")


class FakeSmi:
    """nvidia-smi that refuses the newer reason field (an older driver) and then answers
    with the lines given, the last one repeated."""

    def __init__(self, lines):
        self.lines, self.calls = list(lines), []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if "clocks_event_reasons.active" in cmd[1]:
            return subprocess.CompletedProcess(cmd, 2, "", "Field is not a valid field")
        line = self.lines.pop(0) if len(self.lines) > 1 else self.lines[0]
        return subprocess.CompletedProcess(cmd, 0, line + "\n", "")


def test_sampler_falls_back_to_the_older_field_and_samples_until_stopped():
    smi = FakeSmi([IDLE, BUSY, CAPPED])
    with gpu_state.Sampler(interval=0.01, run=smi) as sampler:
        time.sleep(0.2)
    s = sampler.summary()
    assert s["samples"] >= 3 and s["busy_samples"] == s["samples"] - 1
    assert "software power cap" in s["reasons"]
    assert all("clocks_throttle_reasons.active" in c[1] for c in smi.calls[1:])
    n = s["samples"]
    time.sleep(0.05)
    assert sampler.summary()["samples"] == n, "sampling must end at stop()"


def test_sampler_without_nvidia_smi():
    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")
    with gpu_state.Sampler(interval=0.01, run=missing) as sampler:
        pass
    assert sampler.summary() is None
    assert "not sampled" in gpu_state.summary_line(sampler.summary())


LOCKED = "1500, 1980, 230.00, 700.00, 47, 0x0000000000000000"


def test_a_clock_held_below_its_maximum_without_a_reason_reads_as_locked():
    """Every busy sample at one clock below the maximum, no reason given (what ncu's
    --clock-control base left behind): flagged, since the run is not the GPU's normal
    state; a GPU at its maximum throughout, or held down by a reason, is not."""
    s = gpu_state.summarize([gpu_state.parse(x) for x in (IDLE, LOCKED, LOCKED, LOCKED)])
    assert s["locked_sm_mhz"] == 1500.0
    assert "CLOCK LOCKED at 1500 MHz" in gpu_state.summary_line(s)
    for lines in ((BUSY,) * 3, (CAPPED,) * 3, (LOCKED, LOCKED), (LOCKED, LOCKED, BUSY)):
        s = gpu_state.summarize([gpu_state.parse(x) for x in lines])
        assert s["locked_sm_mhz"] is None
        assert "LOCKED" not in gpu_state.summary_line(s)
