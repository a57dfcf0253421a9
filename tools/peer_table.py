"""The table of record from one tools/bench.py JSON: ours against the faster cuDNN (torch
SDPA's or JAX's, whichever ran faster in that cell) on the dense rows, forward / fwd+bwd,
a row per head dim and mask and a column per sequence length, then the fp8 forward against
our bf16 forward and the varlen rows' ratio to their fastest peer.

  python3 tools/peer_table.py bench.json

The form docs/benchmarks.md's sections give the issue's targets in (the same-run ratios;
the absolute figures move with the GPU's clock between runs). A cell whose run lacks ours
or both cuDNN peers reads "n/a".
"""
from __future__ import annotations

import argparse
import json
import sys

CUDNN_PEERS = ("torch-cudnn", "jax-cudnn")


def value(row: dict, impl: str) -> float | None:
    """The cell's figure where it ran (status ok), else None."""
    cell = row.get("cells", {}).get(impl, {})
    return cell.get("value") if cell.get("status") == "ok" else None


def row_key(params: dict) -> tuple[int, str]:
    """A dense row's table row: (head_dim, 'full' | 'causal')."""
    return params["head_dim"], "causal" if params["causal"] else "full"


def in_table_order(table: dict) -> list:
    """A table's (row_key, cells) items by head dim, full before causal."""
    return sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1] != "full"))


def dense_ratios(rows: list[dict]) -> dict:
    """{(head_dim, 'full' | 'causal'): {seqlen: [fwd, fwd+bwd]}}: ours / the faster cuDNN
    (None where a figure is missing)."""
    table: dict = {}
    for row in rows:
        if row.get("kind") != "dense":
            continue
        p = row["params"]
        ours = value(row, "ours")
        peers = [v for v in (value(row, k) for k in CUDNN_PEERS) if v]
        ratio = ours / max(peers) if ours and peers else None
        cell = table.setdefault(row_key(p), {}).setdefault(p["seqlen"], [None, None])
        cell[1 if p["mode"] == "fwd+bwd" else 0] = ratio
    return table


def fp8_ratios(rows: list[dict]) -> dict:
    """{(head_dim, mask): {seqlen: ours-fp8 / ours}} on the dense forward rows."""
    table: dict = {}
    for row in rows:
        p = row.get("params", {})
        if row.get("kind") != "dense" or p.get("mode") != "fwd":
            continue
        ours, fp8 = value(row, "ours"), value(row, "ours-fp8")
        if ours and fp8:
            table.setdefault(row_key(p), {})[p["seqlen"]] = fp8 / ours
    return table


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(bench: dict) -> str:
    rows = bench.get("rows", [])
    dense = dense_ratios(rows)
    out = []
    if dense:
        lengths = sorted({s for cells in dense.values() for s in cells})
        out.append("| row | " + " | ".join(f"S={s}" if i == 0 else str(s)
                                           for i, s in enumerate(lengths)) + " |")
        out.append("|---|" + "---|" * len(lengths))
        for (d, mask), cells in in_table_order(dense):
            out.append(f"| d{d} {mask} | " + " | ".join(
                " / ".join(_fmt(x) for x in cells.get(s, [None, None])) for s in lengths) + " |")
    fp8 = fp8_ratios(rows)
    if fp8:
        out.append("")
        for (d, mask), cells in in_table_order(fp8):
            out.append(f"- fp8 / our bf16, d{d} {mask}: " + ", ".join(
                f"S={s} {cells[s]:.2f}" for s in sorted(cells)))
    varlen = [r for r in rows if r.get("kind") == "varlen"]
    if varlen:
        out.append("")
        for r in varlen:
            ours, best = value(r, "ours"), r.get("best_peer")
            peer = value(r, best) if best else None
            out.append(f"- varlen {r['params'].get('mode', '')}: ours "
                       + ("n/a" if ours is None else f"{ours:.0f} TFLOP/s")
                       + (f", {ours / peer:.2f}x {best} ({peer:.0f})" if ours and peer else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", help="a tools/bench.py --json file")
    args = ap.parse_args(argv)
    with open(args.bench_json) as f:
        print(markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
