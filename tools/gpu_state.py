#!/usr/bin/env python3
"""The GPU's SM clock, power and temperature, sampled by nvidia-smi while a benchmark runs,
so that a run whose figures all read low can be told from a slower kernel.

  with gpu_state.Sampler() as sampler:
      ...                              # the benchmark
  summary = sampler.summary()          # {"busy_samples", "sm_mhz", "reasons", ...}
  print(gpu_state.summary_line(summary))

Why: two H200 runs of tools/bench.py a few hours apart (docs/benchmarks.md, 2026-11-29 (51)
and (52)) read ours and JAX cuDNN 17-19 % apart in absolute TFLOP/s with the same kernels,
while the matmul ceiling moved 1 %; neither run said at what clock the GPU had run.

Samples where nvidia-smi reports the GPU idle (clock event reason 0x1) are counted but left
out of the clock, power and temperature figures: between a benchmark's cells (compiles,
reference checks) the clock drops and would read as slowdown.
"""

from __future__ import annotations

import statistics
import subprocess
import threading

FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")
# The reasons' field name since driver 535; the older name is tried where it is refused.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
IDLE = 0x1
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "software power cap",
           0x8: "hardware slowdown", 0x10: "sync boost", 0x20: "software thermal slowdown",
           0x40: "hardware thermal slowdown", 0x80: "hardware power brake",
           0x100: "display clocks"}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse(line: str) -> dict | None:
    """One line of `nvidia-smi --query-gpu=FIELDS,REASON --format=csv,noheader,nounits`:
    {sm_mhz, max_sm_mhz, power_w, power_limit_w, temp_c, reasons (int bit mask)}, or None
    where the line has not those six fields."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS) + 1:
        return None
    values = [_number(p) for p in parts[:-1]]
    try:
        reasons = int(parts[-1], 16)
    except ValueError:
        reasons = 0
    return dict(zip(("sm_mhz", "max_sm_mhz", "power_w", "power_limit_w", "temp_c"), values),
                reasons=reasons)


def query(reason_field: str, run=subprocess.run) -> list[dict] | None:
    """One sample of every GPU nvidia-smi lists, or None where the query failed."""
    try:
        r = run(["nvidia-smi", "--query-gpu=" + ",".join(FIELDS + (reason_field,)),
                 "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    samples = [parse(line) for line in r.stdout.strip().splitlines()]
    return [s for s in samples if s] or None


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: list[dict]) -> dict:
    """The samples of one GPU (the first nvidia-smi lists) summed up: how many, how many
    busy (not idle), the busy samples' SM clock, power and temperature (median, min, max),
    and each clock event reason's share of the busy samples."""
    busy = [s for s in samples if not s["reasons"] & IDLE]
    reasons = {}
    for bit, name in REASONS.items():
        if bit != IDLE and busy:
            share = sum(1 for s in busy if s["reasons"] & bit) / len(busy)
            if share:
                reasons[name] = share
    last = samples[-1] if samples else {}
    sm = _spread([s["sm_mhz"] for s in busy])
    top = last.get("max_sm_mhz")
    # One clock below the maximum in every busy sample with no reason given: a clock set
    # from outside, e.g. left by `ncu --clock-control base` (docs/benchmarks.md
    # 2026-12-02 (55): 1500 MHz throughout, max 1980, after ncu had run on the machine).
    locked = (sm["median"] if sm and top and len(busy) >= 3 and sm["min"] == sm["max"] < top
              and not reasons else None)
    return {"samples": len(samples), "busy_samples": len(busy),
            "sm_mhz": sm, "max_sm_mhz": top, "locked_sm_mhz": locked,
            "power_w": _spread([s["power_w"] for s in busy]),
            "power_limit_w": last.get("power_limit_w"),
            "temp_c": _spread([s["temp_c"] for s in busy]),
            "reasons": reasons}


def summary_line(summary: dict | None) -> str:
    """The summary in one line, e.g. "GPU while busy (118 of 130 samples): SM clock 1980 MHz
    median (1755-1980, max 1980), power 612 W median (up to 699 of 700), 61 C median (up to
    66); clock event reasons: software power cap 12 %"."""
    if not summary or not summary.get("samples"):
        return "GPU state: not sampled (nvidia-smi unavailable)"
    head = f"GPU while busy ({summary['busy_samples']} of {summary['samples']} samples)"
    if not summary["busy_samples"]:
        return head + ": none busy"
    parts = []
    sm = summary["sm_mhz"]
    if sm:
        top = summary.get("max_sm_mhz")
        parts.append(f"SM clock {sm['median']:.0f} MHz median ({sm['min']:.0f}-{sm['max']:.0f}"
                     + (f", max {top:.0f})" if top else ")"))
    pw = summary["power_w"]
    if pw:
        limit = summary.get("power_limit_w")
        parts.append(f"power {pw['median']:.0f} W median (up to {pw['max']:.0f}"
                     + (f" of {limit:.0f})" if limit else ")"))
    tc = summary["temp_c"]
    if tc:
        parts.append(f"{tc['median']:.0f} C median (up to {tc['max']:.0f})")
    reasons = ", ".join(f"{name} {100 * share:.0f} %"
                        for name, share in summary["reasons"].items())
    locked = summary.get("locked_sm_mhz")
    return (head + ": " + ", ".join(parts) +
            f"; clock event reasons: {reasons or 'none'}" +
            (f"; CLOCK LOCKED at {locked:.0f} MHz (set from outside, e.g. left by ncu's "
             "--clock-control base: not this GPU's normal state)" if locked else ""))


class Sampler:
    """Samples the first GPU every `interval` seconds (2: a benchmark's 100-200 s give 50-100
    samples, and nvidia-smi, a process of its own, runs seldom beside the timed calls) on a
    thread of its own, from start()
    (or entering the `with`) to stop(); summary() sums up what it saw. Where nvidia-smi is
    missing or refuses both reason fields, it samples nothing and says so."""

    def __init__(self, interval: float = 2.0, run=subprocess.run):
        self.interval = interval
        self._run = run
        self._samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._field: str | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            got = query(self._field, self._run)
            if got:
                self._samples.append(got[0])

    def start(self) -> Sampler:
        for field in REASON_FIELDS:
            first = query(field, self._run)
            if first:
                self._field = field
                self._samples.append(first[0])
                self._thread = threading.Thread(target=self._loop, daemon=True)
                self._thread.start()
                break
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)

    def summary(self) -> dict | None:
        return summarize(list(self._samples)) if self._samples else None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
