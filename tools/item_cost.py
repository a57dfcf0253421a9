#!/usr/bin/env python3
"""What an attention item costs beside its tiles, fitted from rates measured at several
sequence lengths of the same shape family.

  python3 tools/item_cost.py RESULT.json [--mode fwd|fwd+bwd]

On the dense full rows (every query sees all S keys, the tokens per call fixed), an
item of a block's rows runs n = S / 128 tiles of 128 keys, so a kernel whose item costs
its tiles plus a fixed start and end runs at

    rate(S) = R * n / (n + x)

R: the rate of an endless item (the tile loop's own), x: the item's start and end in
tiles' worth of that kernel's time. The fit is least squares over the lengths present
(at least 3). x is also given in the first implementation's tiles (x * R_first / R),
so that implementations with tiles of different speeds compare. A model, not a
measurement: docs/benchmarks.md, 2026-11-29 (49) has its fit to our d128 forward (x =
2.33, within 0.3 % at S = 512..8192).

RESULT.json: tools/bench.py --json (its dense full rows; every implementation of a row,
by head dim and mode; "ours" first) or tools/ab_wheels.py --json (each wheel's
"<dtype> d<D> S<S> full" configs, best of its rounds; the first wheel first).
"""
from __future__ import annotations

import argparse
import json
import re

TILE_KEYS = 128
AB_CONFIG = re.compile(r"^(\w+) d(\d+) S(\d+) full$")


def fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(R, x, worst relative miss) of rate = R n / (n + x) over (n, rate) points: x on a
    0.01 grid over [0, 50], then a 0.0001 grid around the best; R in closed form for
    each x."""
    def scored(x: float) -> tuple[float, float, float]:
        f = [n / (n + x) for n, _ in points]
        r = sum(fi * rate for fi, (_, rate) in zip(f, points)) / sum(fi * fi for fi in f)
        return sum((r * fi - rate) ** 2 for fi, (_, rate) in zip(f, points)), r, x

    _, _, x0 = min(scored(k * 1e-2) for k in range(5001))
    _, r, x = min(scored(max(0.0, x0 + k * 1e-4)) for k in range(-100, 101))
    miss = max(abs(r * n / (n + x) - rate) / rate for n, rate in points)
    return r, x, miss


def series_from_bench(result: dict, mode: str) -> dict[str, dict[str, list]]:
    """{"d128 fwd": {impl: [(n, TFLOP/s), ...]}} from tools/bench.py's dense full rows."""
    groups: dict[str, dict[str, list]] = {}
    for row in result["rows"]:
        p = row.get("params", {})
        if row["kind"] != "dense" or p.get("causal") or p.get("mode") != mode:
            continue
        group = groups.setdefault(f"d{p['head_dim']}/{mode}", {"ours": []})
        for name, cell in row["cells"].items():
            if cell.get("status") == "ok" and cell.get("value") and cell["role"] != "ceiling":
                group.setdefault(name, []).append((p["seqlen"] / TILE_KEYS, cell["value"]))
    return groups


def series_from_ab(result: dict) -> dict[str, dict[str, list]]:
    """The same from tools/ab_wheels.py --json: {wheel: [{config: [TFLOP/s, error]}]}."""
    groups: dict[str, dict[str, list]] = {}
    for wheel, rounds in result.items():
        best: dict[str, float] = {}
        for rnd in rounds:
            for config, (rate, _) in rnd.items():
                best[config] = max(best.get(config, 0.0), rate)
        for config, rate in best.items():
            m = AB_CONFIG.match(config)
            if m:
                group = groups.setdefault(f"{m[1]}/d{m[2]}", {})
                group.setdefault(wheel, []).append((int(m[3]) / TILE_KEYS, rate))
    return groups


def report(groups: dict[str, dict[str, list]]) -> list[str]:
    lines = [f"{'group':12} {'implementation':22} {'lengths':>7} {'R':>8} {'x':>6} "
             f"{'x, first tiles':>14} {'miss %':>7}"]
    for name, impls in groups.items():
        first_r = None
        for impl, points in impls.items():
            if len({n for n, _ in points}) < 3:
                continue
            r, x, miss = fit(sorted(points))
            first_r = first_r or r
            lines.append(f"{name:12} {impl:22} {len(points):7} {r:8.1f} {x:6.2f} "
                         f"{x * first_r / r:14.2f} {100 * miss:7.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="tools/bench.py or tools/ab_wheels.py --json output")
    p.add_argument("--mode", default="fwd", choices=("fwd", "fwd+bwd"),
                   help="bench.py rows: forward or forward + backward")
    args = p.parse_args(argv)
    with open(args.result, encoding="utf-8") as f:
        result = json.load(f)
    is_bench = isinstance(result, dict) and "rows" in result
    groups = series_from_bench(result, args.mode) if is_bench else series_from_ab(result)
    lines = report(groups)
    if len(lines) == 1:
        print("no group with 3 or more lengths of dense full rows")
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
