"""The PNG of tools/bench.py --plot: one panel per row kind, each implementation a line
over the row's configurations (log scale), ours solid, peers dashed, ceilings dotted;
WRONG cells are never drawn as numbers (a red x on the axis marks them)."""

from __future__ import annotations

import math

KIND_TITLES = {"dense": "dense attention", "varlen": "varlen attention",
               "decode": "decode (paged attention): K+V bytes attended",
               "cache": "reshape_and_cache_flash"}
KIND_ORDER = ("dense", "varlen", "decode", "cache")
STYLE = {"ours": dict(linestyle="-", linewidth=2.0, marker="o"),
         "peer": dict(linestyle="--", linewidth=1.0, marker="s", markersize=4),
         "ceiling": dict(linestyle=":", linewidth=1.0, marker="^", markersize=4)}


def _value(cell):
    if not cell or cell.get("status") not in ("ok", "unchecked"):
        return math.nan
    v = cell.get("value")
    return v if isinstance(v, (int, float)) and v and math.isfinite(v) and v > 0 else math.nan


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("rows", [])
    kinds = [k for k in KIND_ORDER if any(r["kind"] == k for r in rows)]
    if not kinds:
        raise ValueError("no rows to plot")
    widest = max(sum(r["kind"] == k for r in rows) for k in kinds)
    fig, axes = plt.subplots(len(kinds), 1, squeeze=False,
                             figsize=(max(9.0, 0.28 * widest + 3), 4.2 * len(kinds)))
    ceilings = result.get("ceilings", {})
    for ax, kind in zip(axes[:, 0], kinds):
        krows = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r.get("sort", []))
        xs = list(range(len(krows)))
        names: dict = {}
        for r in krows:
            for n, c in r["cells"].items():
                names.setdefault(n, c["role"])
        order = sorted(names, key=lambda n: {"ours": 0, "peer": 1, "ceiling": 2}[names[n]])
        for n in order:
            ys = [_value(r["cells"].get(n)) for r in krows]
            if all(math.isnan(y) for y in ys):
                continue
            ax.plot(xs, ys, label=n, **STYLE[names[n]])
        for x, r in zip(xs, krows):
            for n, c in r["cells"].items():
                if c.get("status") == "WRONG":
                    ax.plot([x], [0.02], marker="x", color="red", markersize=9,
                            transform=ax.get_xaxis_transform(), clip_on=False)
                    ax.annotate(f"{n} WRONG", (x, 0.04), xycoords=("data", "axes fraction"),
                                rotation=90, fontsize=6, color="red", va="bottom", ha="center")
        unit = krows[0]["unit"]
        if kind in ("dense", "varlen") and ceilings.get("matmul_TFLOPs"):
            ax.axhline(ceilings["matmul_TFLOPs"], color="gray", linewidth=0.8, linestyle="-.",
                       label="bf16 matmul ceiling")
        if kind == "decode" and ceilings.get("copy_GBps"):
            ax.axhline(ceilings["copy_GBps"], color="gray", linewidth=0.8, linestyle="-.",
                       label="device copy ceiling")
        ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.set_title(KIND_TITLES.get(kind, kind), fontsize=10)
        ax.set_xticks(xs)
        ax.set_xticklabels([r["label"] for r in krows], rotation=90 if len(xs) > 4 else 0,
                           fontsize=6 if len(xs) > 12 else 8)
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    env = result.get("env", {})
    fig.suptitle(f"xla_attn benchmarks — {env.get('gpu', '?')}, {env.get('date', '')}",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)
