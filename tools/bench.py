#!/usr/bin/env python3
"""Benchmarks of xla_attn's ops beside the peers present on the same GPU, in one run.

  python3 tools/bench.py [--quick] [--json out.json] [--plot out.png]
                         [--markdown docs/benchmarks.md] [--rows dense,varlen,decode,cache]

Rows (bf16 unless stated; "ours" is xla_attn.jax under jax.jit):
  dense   flash_attn, (B, S, H, D) layout, causal and full, S 512..16384 with B = 16384 // S
          (16k tokens), head_dim 64/128/256 with H = 2048 // head_dim; fwd and fwd+bwd.
          Peers: torch SDPA forced to FLASH_ATTENTION and to CUDNN_ATTENTION ((B, H, S, D)),
          jax.nn.dot_product_attention(implementation="cudnn") ((B, S, H, D)). --ours-torch
          adds xla_attn.torch.flash_attn in eager mode (ours-torch), the torch peers' framework.
  varlen  flash_attn_varlen, 16 causal sequences of random lengths (mean 1024, fixed seed),
          16 heads, head_dim 128; fwd and fwd+bwd. Peers: torch.nn.attention.varlen, JAX cuDNN
          packed (offsets form) and padded (seq lengths), torch SDPA FLASH on a padded batch.
  decode  paged_attention, one query token per sequence, 32 query / 8 kv heads, head_dim
          128, block size 16 and 64, blocks in random order; bf16 and fp8 e4m3 caches (scalar
          k_scale/v_scale); ours with max_query_len=1, which a serving loop knows. B=64 at
          L=512/4096/32768 and B=1 at L=4096 (latency). Peers on a contiguous cache: torch
          SDPA (enable_gqa) CUDNN and FLASH, torch varlen over the paged cache where it takes
          a block_table, JAX cuDNN with GQA.
  cache   reshape_and_cache_flash, 64k tokens x 8 kv heads x 128 (auto and fp8_e4m3),
          against cache.at[slots].set(...) with and without unique_indices, and the copy
          rate of a device copy moving the same bytes (the ceiling).
Ceilings, once per run: device-to-device copy GB/s (bytes read + written) and bf16
8192^3 matmul TFLOP/s.

Units and conventions: attention in TFLOP/s with 4*B*S^2*H*D FLOPs for a forward (half for
causal; varlen sums over sequences; padded peers are credited the varlen FLOPs, not their
padded work), fwd+bwd = 3.5 x fwd (flash-attn's convention). decode in GB/s of K and V bytes
attended (B*L*Hkv*D*2*itemsize) and tokens/s (B / time). cache in GB/s of new K/V read plus
cache rows written. "ours/best" = time of the fastest peer / our time (> 1: we are faster);
"ours/<peer>" = the same against the peer an issue's target names (TARGET_PEERS).

Timing: wall clock around device syncs (jax.block_until_ready / torch.cuda.synchronize),
after a warm-up call (compile, plan building) and an estimate call; cells time batches
of back-to-back calls (>= 25 ms per batch), slow ones (3 calls over the budget) 1-3
single calls; the median of the
samples, each cell at most --cell-budget seconds of measured time. Inputs are fresh random
normals (never zeros); where a cell's data fits in L2 (decode at small B*L) the calls rotate
over several input sets. Correctness guard: before timing ours, its first output (and
gradients) is compared with the fastest peer's, ||ours - peer|| / ||peer|| < 2e-2, else the
cell is WRONG and shows no number. Any failure (import, unsupported shape, OOM) leaves its
cell n/a with the reason printed once; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import gpu_state  # beside this file (tools/)

KINDS = ("dense", "varlen", "decode", "cache")
KIND_ALIASES = {"cache_write": "cache", "paged": "decode", "attention": "dense"}
RUN_ORDER = ("cache", "decode", "varlen", "dense")  # cheap rows first under --time-limit
UNIT_SCALE = {"TFLOP/s": 1e12, "GB/s": 1e9, "tok/s": 1.0, "us": 1e-6}
TOLERANCE = 2e-2  # bf16 relative error, ||a - b|| / ||b||
# Our fp8 flash forward rounds P to e4m3 for P V (xla_attn.testing.reference.FP8_P_BOUND
# says why), so its check against the bf16 peers, on the same numbers, allows more.
FP8_TOLERANCE = 5e-2
# Rows whose fp8 and 16-bit implementations both run: (fp8, 16-bit) cells, whose time
# ratio gets a column of its own (the issues' "fp8 >= 1.5x / 1.8x bf16" targets).
FP8_PAIRS = {"dense": ("ours-fp8", "ours"), "decode": ("ours-fp8", "ours-bf16")}
FWD_BWD_FACTOR = 3.5  # flash-attn convention: bwd = 2.5 x fwd FLOPs
ASSUMED_L2_BYTES = 50 * 2**20  # H100; replaced by torch's device properties when present
ROLE_ORDER = {"ours": 0, "peer": 1, "ceiling": 2}
# The peer an issue's target names, per row kind: its own ratio column beside ours/best
# (FA2 for the dense rows, torch varlen for varlen, torch cuDNN for decode).
TARGET_PEERS = {"dense": "torch-flash", "varlen": "torch-varlen", "decode": "torch-cudnn"}

LEGEND = {
    "ours": "xla_attn.jax under jax.jit",
    "ours-torch": "xla_attn.torch.flash_attn in torch eager mode (--ours-torch)",
    "ours-fp8 (dense)": "xla_attn.jax.flash_attn_varlen on float8_e4m3fn q, k, v (bf16 out), "
                        "forward rows",
    "ours-bf16": "xla_attn.jax.paged_attention, bf16 paged cache, max_query_len=1",
    "ours-fp8": "xla_attn.jax.paged_attention, float8_e4m3fn paged cache, scalar k/v scales, "
                "max_query_len=1",
    "torch-flash": "torch SDPA, sdpa_kernel(SDPBackend.FLASH_ATTENTION)",
    "torch-cudnn": "torch SDPA, sdpa_kernel(SDPBackend.CUDNN_ATTENTION)",
    "jax-cudnn": 'jax.nn.dot_product_attention(implementation="cudnn")',
    "torch-varlen": "torch.nn.attention.varlen.varlen_attn (packed)",
    "jax-cudnn-packed": "JAX cuDNN attention, packed sequences (q/kv offsets form)",
    "jax-cudnn-padded": "JAX cuDNN attention, padded batch with query/kv seq lengths",
    "torch-flash-padded": "torch SDPA FLASH on a right-padded batch (causal keeps valid rows exact)",
    "torch-varlen-paged": "torch varlen_attn over the same paged cache (block_table, seqused_k)",
    "jax-at-set": "jax: cache.reshape(-1, Hk, D).at[slots].set(new) (donated)",
    "jax-at-set-unique": "the same with unique_indices=True",
    "copy": "device copy moving the same bytes (x + 1 over half the bytes, read + write)",
}


# ------------------------------------------------------------------ sizes
class Sizes:
    """What each row kind runs: full (default), quick, or smoke (tiny, CPU-capable)."""

    def __init__(self, mode: str):
        self.mode = mode
        if mode == "smoke":
            self.tokens, self.hd = 256, 128  # dense: B*S tokens, H*D features
            self.dense_seqs, self.dense_dims = (64, 128), (32, 64)
            self.varlen = dict(n=4, mean=32, heads=4, head_dim=32)
            self.decode = [(4, 64, 16), (1, 128, 16)]  # (B, L, block size)
            self.decode_heads = (8, 2, 32)  # Hq, Hkv, D
            self.cache_tokens = 256
            self.copy_bytes, self.matmul_n = 4 * 2**20, 256
            return
        self.tokens, self.hd = 16384, 2048
        if mode == "quick":
            self.dense_seqs, self.dense_dims = (1024, 4096, 16384), (128,)
            self.decode = [(64, 4096, 16), (64, 32768, 64), (1, 4096, 16)]
        else:
            self.dense_seqs = (512, 1024, 2048, 4096, 8192, 16384)
            self.dense_dims = (64, 128, 256)
            self.decode = [(64, 512, 16), (64, 4096, 16), (64, 4096, 64), (64, 32768, 16),
                           (64, 32768, 64), (1, 4096, 16)]
        self.varlen = dict(n=16, mean=1024, heads=16, head_dim=128)
        self.decode_heads = (32, 8, 128)
        self.cache_tokens = 65536
        self.copy_bytes, self.matmul_n = 2**30, 8192

    def dense_configs(self) -> list[dict]:
        return [dict(head_dim=d, heads=self.hd // d, seqlen=s, batch=self.tokens // s)
                for d in self.dense_dims for s in self.dense_seqs]


# ------------------------------------------------------------------ work counting
def dense_flops(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool,
                backward: bool) -> float:
    """4*B*S^2*H*D for a forward pass, halved for causal; fwd+bwd is 3.5 x fwd."""
    f = 4.0 * batch * seqlen * seqlen * heads * head_dim
    if causal:
        f /= 2
    return f * FWD_BWD_FACTOR if backward else f


def varlen_flops(lengths, heads: int, head_dim: int, causal: bool, backward: bool) -> float:
    return sum(dense_flops(1, int(s), heads, head_dim, causal, backward) for s in lengths)


def decode_kv_bytes(batch: int, context: int, heads_k: int, head_dim: int,
                    itemsize: int) -> int:
    """Bytes of K and V attended by one decode step of the whole batch."""
    return 2 * batch * context * heads_k * head_dim * itemsize


def cache_write_bytes(tokens: int, heads_k: int, head_dim: int, src_itemsize: int,
                      cache_itemsize: int) -> int:
    """New K and V read once, the written cache rows written once."""
    return 2 * tokens * heads_k * head_dim * (src_itemsize + cache_itemsize)


def varlen_lengths(n: int = 16, mean: int = 1024, seed: int = 0) -> list[int]:
    """n random lengths in about [0.1, 1.9] x mean, summing to exactly n * mean."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w = rng.uniform(0.1, 1.9, n)
    lengths = np.maximum(1, np.round(w / w.sum() * n * mean)).astype(int)
    lengths[int(np.argmax(lengths))] += n * mean - int(lengths.sum())
    return [int(x) for x in lengths]


def rotation_sets(set_bytes: int, l2_bytes: int, max_sets: int = 8) -> int:
    """Input sets to rotate over so repeated calls do not just re-read L2: 1 when one set
    is over 3x L2, else enough sets to exceed 3x L2 (at least 2, at most max_sets)."""
    if set_bytes >= 3 * l2_bytes:
        return 1
    return max(2, min(max_sets, math.ceil(3 * l2_bytes / max(set_bytes, 1))))


# ------------------------------------------------------------------ timing
def measure(fn, sync, budget_s: float, max_samples: int, on_first=None,
            min_batch_s: float = 25e-3, clock=time.perf_counter) -> dict:
    """Time fn(i) (call i; fn rotates its inputs on i). A warm-up call first, whose output
    goes to on_first(out) (a correctness check: returning {"ok": False, ...} stops there,
    with no time); then an estimate call; then either 1-3 single calls (slow cells) or
    batches of back-to-back calls lasting >= min_batch_s each, so the measured time stays
    within budget_s. Returns seconds per call (median of samples) and the details.

    min_batch_s is 25 ms so that a sync's latency is spread over several calls even for
    multi-millisecond cells: a jitted JAX call followed by block_until_ready took
    ~300 us longer than the same call back to back (3.22 vs 2.91 ms, decode at
    L=32768 on an H100), a cost torch's synchronize mostly does not have; at 2 ms,
    such cells were timed one call per sync and JAX rows carried it."""
    t0 = clock()
    out = fn(0)
    sync(out)
    first_s = clock() - t0
    check = on_first(out) if on_first is not None else None
    del out
    if check is not None and check.get("ok") is False:
        return {"s": None, "first_s": first_s, "check": check, "samples": [], "inner": 0}
    t0 = clock()
    sync(fn(1))
    est = max(clock() - t0, 1e-9)
    i, inner, samples = 2, 1, [est]
    if 3 * est >= budget_s:
        while len(samples) < 3 and (len(samples) + 1) * est <= budget_s:
            t0 = clock()
            sync(fn(i))
            samples.append(clock() - t0)
            i += 1
    else:
        inner = max(1, min(1000, math.ceil(min_batch_s / est)))
        count = max(3, min(max_samples, int(budget_s / (inner * est))))
        samples = []
        for _ in range(count):
            t0 = clock()
            for _ in range(inner):
                out = fn(i)
                i += 1
            sync(out)
            samples.append((clock() - t0) / inner)
            del out
    return {"s": statistics.median(samples), "first_s": first_s, "check": check,
            "samples": samples, "inner": inner}


# ------------------------------------------------------------------ rows and cells
def new_row(kind: str, label: str, params: dict, unit: str, work: float,
            sort: tuple = ()) -> dict:
    return {"kind": kind, "label": label, "params": params, "unit": unit, "work": work,
            "sort": list(sort), "cells": {}}


def finalize_row(row: dict) -> dict:
    """Rates from times, the fastest peer, ours/best (time ratio) and ours/ceiling."""
    scale = UNIT_SCALE[row["unit"]]
    for cell in row["cells"].values():
        s = cell.get("s")
        if cell.get("status") in ("ok", "unchecked") and s:
            cell["value"] = cell.get("work", row["work"]) / s / scale
            if "items" in cell:
                cell["tok/s"] = cell["items"] / s
            cell["us"] = s * 1e6
    ok = lambda c: c.get("status") == "ok" and c.get("s")  # noqa: E731
    peers = {n: c for n, c in row["cells"].items() if c["role"] == "peer" and ok(c)}
    best = min(peers, key=lambda n: peers[n]["s"]) if peers else None
    row["best_peer"] = best
    target = TARGET_PEERS.get(row["kind"])
    row["ratio"], row["of_ceiling"], row["vs_target"] = {}, {}, {}
    ceilings = {n: c for n, c in row["cells"].items() if c["role"] == "ceiling" and ok(c)}
    for name, cell in row["cells"].items():
        if cell["role"] != "ours":
            continue
        good = cell.get("status") in ("ok", "unchecked") and cell.get("s")
        # only a checked result gets a ratio: a fast wrong (or unverified) kernel never wins
        checked = cell.get("status") == "ok" and cell.get("s")
        row["ratio"][name] = peers[best]["s"] / cell["s"] if (checked and best) else None
        if target in peers:
            row["vs_target"][name] = peers[target]["s"] / cell["s"] if checked else None
        for cname, ccell in ceilings.items():
            row["of_ceiling"][f"{name}/{cname}"] = ccell["s"] / cell["s"] if good else None
    fp8, wide = FP8_PAIRS.get(row["kind"], (None, None))
    if fp8 in row["cells"] and wide in row["cells"]:
        a, b = row["cells"][fp8], row["cells"][wide]
        row["fp8_speedup"] = (b["s"] / a["s"] if ok(a) and ok(b) else None)
    return row


def fmt_value(x, unit: str = "") -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    if unit == "tok/s":
        for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if x >= div:
                return f"{x / div:.3g}{suffix}"
        return f"{x:.3g}"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_ratio(x) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.3f}x"


def cell_text(cell: dict | None, metric: str, unit: str) -> str:
    if cell is None:
        return ""
    status = cell.get("status")
    if status == "WRONG":
        return "WRONG"
    if status == "skipped":
        return "skip"
    if status not in ("ok", "unchecked"):
        return "n/a"
    text = fmt_value(cell.get(metric), unit)
    return text + "?" if status == "unchecked" else text


def build_table(rows: list[dict], metric: str = "value") -> tuple[list[str], list[list[str]]]:
    """Headers and text cells: config, each implementation, ours/best per ours, best peer,
    and ours/ceiling where a row has a ceiling cell."""
    names: dict[str, str] = {}
    for row in rows:
        for name, cell in row["cells"].items():
            names.setdefault(name, cell["role"])
    order = sorted(names, key=lambda n: ROLE_ORDER.get(names[n], 9))
    ours = [n for n in order if names[n] == "ours"]
    ceil = [n for n in order if names[n] == "ceiling"]
    target = TARGET_PEERS.get(rows[0]["kind"]) if rows else None
    target = target if target in names else None
    headers = ["config"] + order + [f"{o}/best" for o in ours] + ["best peer"]
    headers += [f"{o}/{target}" for o in ours] if target else []
    headers += [f"{o}/{c}" for o in ours for c in ceil]
    pair = FP8_PAIRS.get(rows[0]["kind"]) if rows else None
    speedup = any("fp8_speedup" in row for row in rows)
    headers += [f"{pair[0]}/{pair[1]}"] if speedup else []
    unit = "tok/s" if metric == "tok/s" else rows[0]["unit"] if rows else ""
    lines = []
    for row in sorted(rows, key=lambda r: r.get("sort", [])):
        line = [row["label"]] + [cell_text(row["cells"].get(n), metric, unit) for n in order]
        for o in ours:
            cell = row["cells"].get(o, {})
            if cell.get("status") == "WRONG":
                line.append("WRONG")
            else:
                line.append(fmt_ratio(row.get("ratio", {}).get(o)))
        line.append(row.get("best_peer") or "none")
        if target:
            line += [fmt_ratio(row.get("vs_target", {}).get(o)) for o in ours]
        for o in ours:
            for c in ceil:
                line.append(fmt_ratio(row.get("of_ceiling", {}).get(f"{o}/{c}")))
        if speedup:
            line.append(fmt_ratio(row.get("fp8_speedup")) if "fp8_speedup" in row else "")
        lines.append(line)
    return headers, lines


def tables_for(rows: list[dict], kind: str) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = [r for r in rows if r["kind"] == kind]
    if not rows:
        return []
    unit = rows[0]["unit"]
    if kind == "decode":
        return [("decode: GB/s of K+V attended", *build_table(rows, "value")),
                ("decode: tokens/s (B / step time)", *build_table(rows, "tok/s"))]
    titles = {"dense": "dense attention", "varlen": "varlen attention",
              "cache": "reshape_and_cache_flash"}
    return [(f"{titles.get(kind, kind)}: {unit}", *build_table(rows, "value"))]


def render_text(headers: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in
                     enumerate(zip(headers, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for line in lines:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                             enumerate(zip(line, widths))))
    return "\n".join(out)


def render_markdown(headers: list[str], lines: list[list[str]]) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(esc(h) for h in headers) + " |",
           "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
    out += ["| " + " | ".join(esc(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def legend_lines(rows: list[dict]) -> list[str]:
    """Each implementation's legend, a row kind's own ("name (kind)") before the shared."""
    names = []
    for row in rows:
        for name in row["cells"]:
            if name not in names:
                names.append(name)
    kind = rows[0]["kind"] if rows else ""
    text = {n: LEGEND.get(f"{n} ({kind})", LEGEND.get(n)) for n in names}
    return [f"{n}: {text[n]}" for n in names if text[n]]


def conventions(result: dict) -> list[str]:
    return [
        "attention FLOPs: 4*B*S^2*H*D per forward, halved for causal, summed per sequence "
        "for varlen (padded peers credited the varlen FLOPs); fwd+bwd = 3.5 x fwd "
        "(flash-attn convention)",
        "decode: GB/s of K and V bytes attended (B*L*Hkv*D*2*itemsize; fp8 counts 1 byte), "
        "tokens/s = B / step time; ours get max_query_len=1, as a serving loop knows its "
        "decode batch (the decode kernel alone is launched); cache: new K/V read + cache rows "
        "written",
        "ours/best = fastest peer's time / our time (>1: ours faster); ours/<peer> = the "
        "same against the peer the targets name (dense: torch-flash = FA2, varlen: "
        "torch-varlen, decode: torch-cudnn); ours-fp8/ours (ours-fp8/ours-bf16) = the "
        "16-bit time / the fp8 time on the same numbers; WRONG = our output "
        "differs from the fastest peer's by >= 2e-2 relative (5e-2 for the dense fp8 "
        "forward, which rounds P to e4m3; no number shown); "
        "n/a = unavailable or failed (reason in the JSON); '?' = no reference to check against",
        f"timing: median of samples after warm-up, wall clock around device syncs, at most "
        f"{result.get('args', {}).get('cell_budget', '?')} s measured per cell",
    ]


def text_report(result: dict) -> str:
    out = []
    rows = result["rows"]
    for kind in KINDS:
        kind_rows = [r for r in rows if r["kind"] == kind]
        for title, headers, lines in tables_for(rows, kind):
            out += ["", f"== {title}", render_text(headers, lines)]
        if kind_rows:
            out += ["   " + line for line in legend_lines(kind_rows)]
    out.append("")
    out += ["note: " + line for line in conventions(result)]
    return "\n".join(out)


def env_line(result: dict) -> str:
    env = result.get("env", {})
    keys = ("gpu", "driver", "jax", "jaxlib", "torch", "cudnn_torch", "xla_attn")
    return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k))


def ceiling_line(result: dict) -> str:
    c = result.get("ceilings", {})
    copy = fmt_value(c.get("copy_GBps"))
    mm = fmt_value(c.get("matmul_TFLOPs"))
    return (f"ceilings: device copy {copy} GB/s (read + write; {c.get('copy_how', 'n/a')}), "
            f"bf16 matmul {mm} TFLOP/s ({c.get('matmul_how', 'n/a')})")


def markdown_section(result: dict) -> str:
    env = result.get("env", {})
    mode = result.get("args", {}).get("mode", "full")
    out = [f"## {env.get('date', '?')} — {env.get('gpu', '?')} ({mode} run)", "",
           f"Command: `{env.get('command', 'python3 tools/bench.py')}`", "",
           f"Environment: {env_line(result)}.", "", ceiling_line(result) + ".", ""]
    if "gpu_state" in result:
        out += [gpu_state.summary_line(result["gpu_state"]) + ".", ""]
    for kind in KINDS:
        kind_rows = [r for r in result["rows"] if r["kind"] == kind]
        for title, headers, lines in tables_for(result["rows"], kind):
            out += [f"### {title}", "", render_markdown(headers, lines), ""]
        if kind_rows:
            out += [f"- {line}" for line in legend_lines(kind_rows)] + [""]
    out += ["Notes:", ""] + [f"- {line}" for line in conventions(result)] + [""]
    failures = failure_summary(result["rows"])
    if failures:
        out += ["Unavailable cells (first reason per implementation):", ""]
        out += [f"- {name}: {reason}" for name, reason in failures.items()] + [""]
    return "\n".join(out)


def failure_summary(rows: list[dict]) -> dict:
    reasons = {}
    for row in rows:
        for name, cell in row["cells"].items():
            if cell.get("status") in ("n/a", "WRONG", "unchecked") and cell.get("reason"):
                reasons.setdefault(name, cell["reason"])
    return reasons


def append_markdown(path: str, result: dict) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fresh = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", encoding="utf-8") as f:
        if fresh:
            f.write("# Benchmarks\n\nSections appended by `tools/bench.py --markdown`.\n")
        f.write("\n" + markdown_section(result))


def json_safe(x):
    """Non-finite floats become None (strict JSON); tuples become lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def write_json(path: str, result: dict) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(result), f, indent=1, allow_nan=False)


def write_plot(path: str, result: dict) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_plot

    bench_plot.plot(result, path)


def short_reason(exc: BaseException, caught=()) -> str:
    text = str(exc).strip().splitlines()
    first = next((t.strip() for t in text if t.strip()), "")
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    extra = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    if extra:
        reason += " [warnings: " + " | ".join(dict.fromkeys(extra))[:300] + "]"
    return reason[:500]


# ------------------------------------------------------------------ implementations
class Impl:
    """One column of a row: build() -> fn(i) (compile, plans, inputs; untimed), then
    fn(i) runs call i; canon(out) -> tuple of jax arrays in our layout, for the check."""

    def __init__(self, name, framework, build, canon, ctx=None, work=None, items=None,
                 tolerance=TOLERANCE):
        self.name, self.framework, self.build, self.canon = name, framework, build, canon
        self.ctx, self.work, self.items, self.tolerance = ctx, work, items, tolerance


class Runner:
    def __init__(self, args, sizes: Sizes):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share with torch
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import jax
        import jax.numpy as jnp
        import numpy as np

        self.jax, self.jnp, self.np = jax, jnp, np
        self.sizes, self.args = sizes, args
        self.smoke = sizes.mode == "smoke"
        self.budget = args.cell_budget
        self.max_samples = args.repeats
        self.t0 = time.perf_counter()
        self.seen: set = set()
        self.key = jax.random.PRNGKey(args.seed)
        self.counter = 0
        self.device = jax.devices()[0]
        import xla_attn.jax as xj  # ours: no fallback, a failure here ends the run

        self.xj = xj
        self.torch, self.torch_reason = self._import_torch()
        self.tdev = "cpu" if self.smoke and self.device.platform == "cpu" else "cuda"
        self.l2 = ASSUMED_L2_BYTES
        if self.torch is not None and self.tdev == "cuda":
            props = self.torch.cuda.get_device_properties(0)
            self.l2 = int(getattr(props, "L2_cache_size", 0) or ASSUMED_L2_BYTES)

    # --- plumbing
    def _import_torch(self):
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as e:  # ImportError, or a broken install
            return None, f"torch unavailable: {short_reason(e)}"
        if not self.smoke and not torch.cuda.is_available():
            return None, "torch unavailable: torch.cuda.is_available() is False"
        return torch, None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self) -> bool:
        return bool(self.args.time_limit) and self.elapsed() > self.args.time_limit

    def note(self, name: str, reason: str) -> None:
        key = (name, reason[:120])
        if key not in self.seen:
            self.seen.add(key)
            print(f"    [n/a] {name}: {reason}", flush=True)

    def randn(self, shape, dtype="bfloat16"):
        self.counter += 1
        key = self.jax.random.fold_in(self.key, self.counter)
        return self.jax.random.normal(key, tuple(shape), self.jnp.dtype(dtype))

    def sync_jax(self, out):
        self.jax.block_until_ready(out)

    def sync_torch(self, out):
        if self.tdev == "cuda":
            self.torch.cuda.synchronize()

    def to_torch(self, x):
        """A jax array as a torch tensor on torch's device (DLPack, else through the host)."""
        torch, np = self.torch, self.np
        x = self.jax.block_until_ready(x)
        if self.tdev == "cuda":
            try:
                return torch.from_dlpack(x)
            except Exception:
                pass
        a = np.asarray(x)
        if a.dtype.name == "bfloat16":
            t = torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a.copy())
        return t.to(self.tdev)

    def to_jax(self, t):
        """A torch tensor (or jax array) as a jax array (DLPack, else float32 via host)."""
        torch = self.torch
        if torch is None or not isinstance(t, torch.Tensor):
            return t
        t = t.detach().contiguous()
        if t.device.type == "cuda":
            torch.cuda.synchronize()
            try:
                return self.jax.dlpack.from_dlpack(t)
            except Exception:
                pass
        return self.jnp.asarray(t.float().cpu().numpy())

    def rel_err(self, a, b) -> float:
        jnp = self.jnp
        a, b = self.to_jax(a), self.to_jax(b)
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
        a = jnp.asarray(a, jnp.float32).ravel()
        b = jnp.asarray(b, jnp.float32).ravel()
        e = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        return e if math.isfinite(e) else float("inf")

    def compare(self, ours: tuple, ref: tuple) -> float:
        if len(ours) != len(ref):
            raise ValueError(f"{len(ours)} outputs vs {len(ref)} in the reference")
        return max(self.rel_err(o, r) for o, r in zip(ours, ref))

    def jax_build(self, fn, arg_sets, donate=()):
        """AOT-compiled jax function over rotating argument sets."""
        def build():
            compiled = self.jax.jit(fn, donate_argnums=donate).lower(*arg_sets[0]).compile()
            n = len(arg_sets)
            return lambda i: compiled(*arg_sets[i % n])
        return build

    def torch_ctx(self, backend_name: str):
        def ctx():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            return sdpa_kernel(getattr(SDPBackend, backend_name))
        return ctx

    # --- one cell
    def run_cell(self, row: dict, impl: Impl, role: str, on_first=None) -> dict:
        cell = {"role": role, "status": "n/a", "framework": impl.framework}
        if impl.work is not None:
            cell["work"] = impl.work
        if impl.items is not None:
            cell["items"] = impl.items
        row["cells"][impl.name] = cell
        if self.out_of_time():
            cell.update(status="skipped", reason="--time-limit reached")
            return cell
        if impl.framework == "torch" and self.torch is None:
            cell["reason"] = self.torch_reason
            self.note(impl.name, cell["reason"])
            return cell
        sync = self.sync_torch if impl.framework == "torch" else self.sync_jax
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with (impl.ctx() if impl.ctx else contextlib.nullcontext()):
                    t0 = time.perf_counter()
                    fn = impl.build()
                    cell["setup_s"] = time.perf_counter() - t0
                    res = measure(fn, sync, self.budget, self.max_samples, on_first=on_first)
                    del fn
        except Exception as e:  # unsupported shape/backend, OOM, compile failure...
            cell["reason"] = short_reason(e, caught or ())
            self.note(impl.name, cell["reason"])
            self.cleanup()
            return cell
        cell.update(first_s=res["first_s"], samples=res["samples"], inner=res["inner"])
        check = res.get("check")
        if check is not None:
            cell["check"] = check
        if res["s"] is None:  # the check failed: no time
            cell["status"] = "WRONG"
            cell["reason"] = (f"relative error {check.get('err', float('nan')):.3g} vs "
                              f"{check.get('ref')} (tolerance {impl.tolerance})")
            print(f"    [WRONG] {impl.name} {row['label']}: {cell['reason']}", flush=True)
            return cell
        cell["s"] = res["s"]
        if check is not None and check.get("ok") is None:
            cell["status"] = "unchecked"
            cell["reason"] = check.get("reason", "no reference")
            self.note(impl.name, "unchecked: " + cell["reason"])
        else:
            cell["status"] = "ok"
        return cell

    def cleanup(self):
        gc.collect()
        if self.torch is not None and self.tdev == "cuda":
            try:
                self.torch.cuda.empty_cache()
            except Exception:
                pass

    # --- one row: peers first (their first outputs kept), then ours, checked
    def run_row(self, row: dict, peers: list, ours: list, fallback=None) -> dict:
        refs: dict = {}

        def keep(impl):
            def on_first(out):
                try:
                    refs[impl.name] = impl.canon(out)
                except Exception as e:
                    self.note(impl.name, f"no reference output: {short_reason(e)}")
                return None
            return on_first

        for impl in peers:
            self.run_cell(row, impl, "peer", keep(impl))
        cells = row["cells"]
        ranked = sorted((n for n in refs if cells[n]["status"] == "ok"),
                        key=lambda n: cells[n]["s"])
        fb: dict = {}

        def check(impl):
            def on_first(out):
                try:
                    mine = impl.canon(out)
                    if ranked:
                        err_vs = {n: self.compare(mine, refs[n]) for n in ranked}
                        ref = ranked[0]
                    else:
                        if "ref" not in fb:
                            fb["ref"] = fallback() if fallback else None
                        if fb["ref"] is None:
                            return {"ok": None, "reason": "no peer ran and no fallback"}
                        err_vs = {"xla-reference": self.compare(mine, fb["ref"])}
                        ref = "xla-reference"
                    err = err_vs[ref]
                    return {"ok": err < impl.tolerance, "ref": ref, "err": err, "err_vs": err_vs}
                except Exception as e:
                    return {"ok": None, "reason": f"check failed: {short_reason(e)}"}
            return on_first

        for impl in ours:
            self.run_cell(row, impl, "ours", check(impl))
        refs.clear()
        fb.clear()
        finalize_row(row)
        print("  " + row_summary(row), flush=True)
        return row

    # --- ceilings
    def ceilings(self) -> dict:
        jax, jnp = self.jax, self.jnp
        out = {}
        nbytes, n = self.sizes.copy_bytes, self.sizes.matmul_n
        torch = self.torch
        budget = max(self.budget, 0.3)
        if torch is not None:
            try:
                x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=self.tdev)
                y = torch.empty_like(x)
                m = measure(lambda i: y.copy_(x), self.sync_torch, budget, 20)
                out.update(copy_GBps=2 * nbytes / m["s"] / 1e9,
                           copy_how=f"torch copy_ of {nbytes / 2**30:.3g} GiB")
                del x, y
            except Exception as e:
                out["copy_error"] = short_reason(e)
            try:
                a = torch.randn(n, n, dtype=torch.bfloat16, device=self.tdev)
                b = torch.randn(n, n, dtype=torch.bfloat16, device=self.tdev)
                m = measure(lambda i: torch.matmul(a, b), self.sync_torch, budget, 20)
                out.update(matmul_TFLOPs=2 * n**3 / m["s"] / 1e12,
                           matmul_how=f"torch.matmul bf16 {n}^3")
                del a, b
            except Exception as e:
                out["matmul_error"] = short_reason(e)
            self.cleanup()
        if "copy_GBps" not in out:
            try:
                x = self.randn((nbytes // 2,))
                f = jax.jit(lambda x: x + jnp.bfloat16(1))
                m = measure(lambda i: f(x), self.sync_jax, budget, 20)
                out.update(copy_GBps=2 * nbytes / m["s"] / 1e9,
                           copy_how=f"jax x + 1 over {nbytes / 2**30:.3g} GiB")
            except Exception as e:
                out["copy_error"] = short_reason(e)
        if "matmul_TFLOPs" not in out:
            try:
                a, b = self.randn((n, n)), self.randn((n, n))
                f = jax.jit(jnp.matmul)
                m = measure(lambda i: f(a, b), self.sync_jax, budget, 20)
                out.update(matmul_TFLOPs=2 * n**3 / m["s"] / 1e12,
                           matmul_how=f"jnp.matmul bf16 {n}^3")
            except Exception as e:
                out["matmul_error"] = short_reason(e)
        return out

    # ------------------------------------------------------------------ dense
    def bench_dense(self) -> list[dict]:
        jax, jnp, xj = self.jax, self.jnp, self.xj
        rows = []
        for cfg in self.sizes.dense_configs():
            if self.out_of_time():
                print("  --time-limit reached: remaining dense configurations not run")
                break
            b, s, h, d = cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["head_dim"]
            try:
                # q, k, v on the e4m3 grid (as bf16), so that the fp8 cells see the same
                # numbers as every bf16 one
                q, k, v = (self.randn((b, s, h, d)).astype(jnp.float8_e4m3fn)
                           for _ in range(3))
                q8, k8, v8 = (x.reshape(b * s, h, d) for x in (q, k, v))
                q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
                do = self.randn((b, s, h, d))
                cu = jnp.arange(0, b * s + 1, s, dtype=jnp.int32)
                jax.block_until_ready((q, k, v, do, q8, k8, v8, cu))
            except Exception as e:
                self.note("inputs", f"dense {cfg}: {short_reason(e)}")
                continue
            tt: dict = {}

            def torch_inputs(q=q, k=k, v=v, do=do, tt=tt):
                if "x" not in tt:  # (B, H, S, D) contiguous, shared by both torch peers
                    tt["x"] = tuple(self.to_torch(x).transpose(1, 2).contiguous()
                                    for x in (q, k, v, do))
                return tt["x"]

            for causal in (False, True):
                for bwd in (False, True):
                    mode = "fwd+bwd" if bwd else "fwd"
                    label = f"d={d} H={h} {'causal' if causal else 'full'} S={s} B={b} {mode}"
                    row = new_row("dense", label, dict(cfg, causal=causal, mode=mode),
                                  "TFLOP/s", dense_flops(b, s, h, d, causal, bwd),
                                  sort=(d, causal, bwd, s))
                    peers = [self._torch_sdpa("torch-flash", "FLASH_ATTENTION", torch_inputs,
                                              causal, bwd),
                             self._torch_sdpa("torch-cudnn", "CUDNN_ATTENTION", torch_inputs,
                                              causal, bwd),
                             self._jax_attn("jax-cudnn", self._jax_cudnn(causal), (q, k, v, do),
                                            bwd)]
                    ours = [self._jax_attn("ours", lambda q, k, v, c=causal: xj.flash_attn(
                        q, k, v, causal=c), (q, k, v, do), bwd)]
                    if self.args.ours_torch:
                        ours.append(self._ours_torch((q, k, v, do), causal, bwd))
                    if not bwd:
                        ours.append(Impl(
                            "ours-fp8", "jax", self.jax_build(
                                lambda q, k, v, cu, c=causal, bs=(b, s, h, d): (
                                    xj.flash_attn_varlen(q, k, v, cu, cu, bs[1], bs[1],
                                                         causal=c).reshape(bs),),
                                [(q8, k8, v8, cu)]), tuple, tolerance=FP8_TOLERANCE))
                    fallback = self._xla_reference(causal, (q, k, v, do), bwd)
                    rows.append(self.run_row(row, peers, ours, fallback))
            del q, k, v, do, tt, q8, k8, v8
            self.cleanup()
        return rows

    def _ours_torch(self, args, causal, bwd):
        """xla_attn.torch.flash_attn in eager mode on (B, S, H, D) torch tensors (ours'
        layout: no transposes), timed as the torch peers are."""
        def build():
            torch = self.torch
            import xla_attn.torch as xt
            q, k, v, do = (self.to_torch(x) for x in args)
            if bwd:
                q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

            def fn(i):
                if not bwd:
                    with torch.no_grad():
                        return (xt.flash_attn(q, k, v, causal=causal),)
                out = xt.flash_attn(q, k, v, causal=causal)
                return (out,) + torch.autograd.grad(out, (q, k, v), do)
            return fn
        return Impl("ours-torch", "torch", build,
                    lambda outs: tuple(self.to_jax(x) for x in outs))

    def _jax_cudnn(self, causal):
        jax = self.jax
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn")

    @staticmethod
    def _fwd(attn):
        return lambda q, k, v, do: (attn(q, k, v),)

    def _fwd_bwd(self, attn):
        jax = self.jax

        def f(q, k, v, do):
            out, pull = jax.vjp(attn, q, k, v)
            return (out,) + tuple(pull(do))
        return f

    def _jax_attn(self, name, attn, args, bwd, canon=tuple):
        fn = self._fwd_bwd(attn) if bwd else self._fwd(attn)
        return Impl(name, "jax", self.jax_build(fn, [args]), canon)

    def _xla_reference(self, causal, args, bwd):
        def fallback():
            attn = lambda q, k, v: self.jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, is_causal=causal, implementation="xla")
            fn = self._fwd_bwd(attn) if bwd else self._fwd(attn)
            try:
                return tuple(self.jax.jit(fn)(*args))
            except Exception as e:
                self.note("xla-reference", short_reason(e))
                return None
        return fallback

    def _torch_sdpa(self, name, backend, inputs, causal, bwd, gqa=False, canon=None):
        """torch SDPA on (B, H, S, D) tensors from inputs() (a tuple, or a list of tuples to
        rotate over); canon maps its outputs back to our layout."""
        def build():
            torch = self.torch
            F = torch.nn.functional
            sets = inputs()
            sets = sets if isinstance(sets, list) else [sets]
            kw = dict(is_causal=causal)
            if gqa:
                kw["enable_gqa"] = True
            if bwd:
                sets = [tuple(x.detach().requires_grad_() for x in st[:3]) + (st[3],)
                        for st in sets]
            n = len(sets)

            def fn(i):
                q, k, v, do = sets[i % n]
                if not bwd:
                    with torch.no_grad():
                        return (F.scaled_dot_product_attention(q, k, v, **kw),)
                out = F.scaled_dot_product_attention(q, k, v, **kw)
                return (out,) + torch.autograd.grad(out, (q, k, v), do)
            return fn

        if canon is None:
            canon = lambda outs: tuple(self.to_jax(x.transpose(1, 2)) for x in outs)  # noqa
        return Impl(name, "torch", build, canon, ctx=self.torch_ctx(backend))

    # ------------------------------------------------------------------ varlen
    def bench_varlen(self) -> list[dict]:
        jax, jnp, np, xj = self.jax, self.jnp, self.np, self.xj
        p = self.sizes.varlen
        n, h, d = p["n"], p["heads"], p["head_dim"]
        lengths = varlen_lengths(n, p["mean"], self.args.seed)
        total, maxlen = sum(lengths), max(lengths)
        cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        pad_np = np.concatenate([b * maxlen + np.arange(s) for b, s in enumerate(lengths)])
        cu, pad_idx = jnp.asarray(cu_np), jnp.asarray(pad_np.astype(np.int32))
        lens = jnp.asarray(np.asarray(lengths, np.int32))
        q, k, v, do = (self.randn((total, h, d)) for _ in range(4))

        def padded(x):  # (n, maxlen, H, D), zero rows past each length
            z = jnp.zeros((n * maxlen, h, d), x.dtype).at[pad_idx].set(x)
            return z.reshape(n, maxlen, h, d)

        def unpad(x):
            return jnp.take(jnp.asarray(x).reshape(n * maxlen, h, d), pad_idx, axis=0)

        qp, kp, vp, dop = (padded(x) for x in (q, k, v, do))
        tt: dict = {}

        def torch_packed():
            if "packed" not in tt:
                tt["packed"] = tuple(self.to_torch(x) for x in (q, k, v, do))
            return tt["packed"]

        def torch_padded():
            if "padded" not in tt:
                tt["padded"] = tuple(self.to_torch(x).transpose(1, 2).contiguous()
                                     for x in (qp, kp, vp, dop))
            return tt["padded"]

        rows = []
        for bwd in (False, True):
            mode = "fwd+bwd" if bwd else "fwd"
            label = f"{n} seqs mean {p['mean']} (T={total}, max {maxlen}) H={h} d={d} causal {mode}"
            row = new_row("varlen", label, dict(lengths=lengths, heads=h, head_dim=d,
                                                causal=True, mode=mode),
                          "TFLOP/s", varlen_flops(lengths, h, d, True, bwd), sort=(bwd,))
            unpad_all = lambda outs: tuple(unpad(self.to_jax(x)) for x in outs)  # noqa: E731
            peers = [
                self._torch_varlen(torch_packed, cu_np, maxlen, bwd),
                self._jax_cudnn_packed((q, k, v, do), lengths, cu_np, bwd),
                self._jax_attn("jax-cudnn-padded", lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens,
                    implementation="cudnn"), (qp, kp, vp, dop), bwd, canon=unpad_all),
                self._torch_sdpa("torch-flash-padded", "FLASH_ATTENTION", torch_padded, True,
                                 bwd, canon=lambda outs: tuple(
                                     unpad(self.to_jax(x.transpose(1, 2))) for x in outs)),
            ]
            ours = [self._jax_attn("ours", lambda q, k, v: xj.flash_attn_varlen(
                q, k, v, cu, cu, maxlen, maxlen, causal=True), (q, k, v, do), bwd)]

            def fallback(bwd=bwd):
                attn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
                    q, k, v, is_causal=True, query_seq_lengths=lens,
                    key_value_seq_lengths=lens, implementation="xla")
                fn = self._fwd_bwd(attn) if bwd else self._fwd(attn)
                try:
                    return unpad_all(jax.jit(fn)(qp, kp, vp, dop))
                except Exception as e:
                    self.note("xla-reference", short_reason(e))
                    return None
            rows.append(self.run_row(row, peers, ours, fallback))
        tt.clear()
        self.cleanup()
        return rows

    def _torch_varlen(self, inputs, cu_np, maxlen, bwd):
        def build():
            torch = self.torch
            import importlib
            mod = importlib.import_module("torch.nn.attention.varlen")
            if not hasattr(mod, "varlen_attn"):
                raise RuntimeError("torch.nn.attention.varlen has no varlen_attn")
            attn = mod.varlen_attn
            params = inspect.signature(attn).parameters
            names = list(params)[:7]
            if names[:3] != ["query", "key", "value"] or len(names) < 7:
                raise RuntimeError(f"unexpected signature varlen_attn{inspect.signature(attn)}")
            if "is_causal" in params:
                kw = dict(is_causal=True)
            elif "window_size" in params:
                kw = dict(window_size=(-1, 0))
            else:
                raise RuntimeError(f"no causal option in varlen_attn{inspect.signature(attn)}")
            cu_t = torch.tensor(cu_np, dtype=torch.int32, device=self.tdev)
            q, k, v, do = inputs()
            if bwd:
                q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

            def fn(i):
                if not bwd:
                    with torch.no_grad():
                        return (attn(q, k, v, cu_t, cu_t, maxlen, maxlen, **kw),)
                out = attn(q, k, v, cu_t, cu_t, maxlen, maxlen, **kw)
                return (out,) + torch.autograd.grad(out, (q, k, v), do)
            return fn

        return Impl("torch-varlen", "torch", build,
                    lambda outs: tuple(self.to_jax(x) for x in outs))

    def _jax_cudnn_packed(self, args, lengths, cu_np, bwd):
        """JAX cuDNN over packed sequences: jax.nn.dot_product_attention if it takes
        q_offsets/kv_offsets, else jax's cuDNN module (private, same kernel)."""
        jax, jnp, np = self.jax, self.jnp, self.np
        seqlen = jnp.asarray(np.asarray(lengths, np.int32)[None])  # (1, M)
        offsets = jnp.asarray(cu_np[None])  # (1, M + 1)
        scale = 1.0 / math.sqrt(args[0].shape[-1])
        candidates = []
        public = inspect.signature(jax.nn.dot_product_attention).parameters
        if "q_offsets" in public and "kv_offsets" in public:
            candidates.append(("jax.nn.dot_product_attention", lambda q, k, v:
                               jax.nn.dot_product_attention(
                                   q, k, v, is_causal=True, query_seq_lengths=seqlen,
                                   key_value_seq_lengths=seqlen, q_offsets=offsets,
                                   kv_offsets=offsets, implementation="cudnn")))
        try:
            from jax._src.cudnn import fused_attention_stablehlo as fa
            if "q_offsets" in inspect.signature(fa.dot_product_attention).parameters:
                candidates.append(("jax._src.cudnn (private)", lambda q, k, v:
                                   fa.dot_product_attention(
                                       q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen,
                                       q_offsets=offsets, kv_offsets=offsets, scale=scale,
                                       mask_type=fa.MaskType.PADDING_CAUSAL)))
        except Exception:
            pass
        packed = tuple(x[None] for x in args)

        def build():
            if not candidates:
                raise RuntimeError("this jax has no packed (q_offsets) cuDNN attention")
            errors = []
            for api, attn in candidates:
                fn = self._fwd_bwd(attn) if bwd else self._fwd(attn)
                try:
                    return self.jax_build(fn, [packed])()
                except Exception as e:
                    errors.append(f"{api}: {short_reason(e)}")
            raise RuntimeError("; ".join(errors))

        return Impl("jax-cudnn-packed", "jax", build, lambda outs: tuple(x[0] for x in outs))

    # ------------------------------------------------------------------ decode
    def bench_decode(self) -> list[dict]:
        rows = []
        for batch, context, block_size in self.sizes.decode:
            if self.out_of_time():
                print("  --time-limit reached: remaining decode configurations not run")
                break
            try:
                rows.append(self._decode_row(batch, context, block_size))
            except Exception as e:  # input generation (OOM...)
                self.note("decode", f"B={batch} L={context} bs={block_size}: {short_reason(e)}")
            self.cleanup()
        return rows

    def _decode_inputs(self, batch, context, hq, hk, d, bs, kv_scale, seed):
        jnp, np = self.jnp, self.np
        nb = batch * context // bs
        rng = np.random.default_rng(seed)
        perm = rng.permutation(nb)  # logical block i lives in physical block perm[i]
        inv = jnp.asarray(np.argsort(perm).astype(np.int32))

        def kv():
            # values that fp8 e4m3 holds exactly (times a power-of-two scale): the bf16 and
            # fp8 caches hold the same numbers, so one reference checks both
            x8 = (self.randn((batch, context, hk, d)) * (1.0 / kv_scale)).astype(
                jnp.float8_e4m3fn)
            dense = x8.astype(jnp.bfloat16) * jnp.bfloat16(kv_scale)
            blocks8 = x8.reshape(nb, bs, hk, d)
            del x8
            pool = jnp.take(dense.reshape(nb, bs, hk, d), inv, axis=0)
            pool8 = jnp.take(blocks8, inv, axis=0)
            return dense, pool, pool8

        kd, kpool, kpool8 = kv()
        vd, vpool, vpool8 = kv()
        return dict(q=self.randn((batch, hq, d)), k=kd, v=vd, kpool=kpool, vpool=vpool,
                    kpool8=kpool8, vpool8=vpool8,
                    bt=jnp.asarray(perm.reshape(batch, context // bs).astype(np.int32)),
                    seq_lens=jnp.full((batch,), context, jnp.int32),
                    qsl=jnp.arange(batch + 1, dtype=jnp.int32))

    def _decode_row(self, batch, context, bs) -> dict:
        jax, jnp, xj = self.jax, self.jnp, self.xj
        hq, hk, d = self.sizes.decode_heads
        kv_scale = 0.25
        scale = 1.0 / math.sqrt(d)
        nsets = rotation_sets(decode_kv_bytes(batch, context, hk, d, 2), self.l2)
        sets = [self._decode_inputs(batch, context, hq, hk, d, bs, kv_scale,
                                    self.args.seed + 1000 * i + context) for i in range(nsets)]
        jax.block_until_ready(sets)
        label = f"B={batch} L={context} bs={bs} Hq={hq} Hkv={hk} d={d}"
        row = new_row("decode", label, dict(batch=batch, context=context, heads=hq, heads_k=hk,
                                            head_dim=d, block_size=bs, input_sets=nsets),
                      "GB/s", decode_kv_bytes(batch, context, hk, d, 2), sort=(batch == 1,
                                                                               batch, context, bs))
        tt: dict = {}

        def torch_dense():
            if "dense" not in tt:
                # (B, Hq, 1, D) queries, (B, Hkv, L, D) contiguous caches; no dout
                tt["dense"] = [tuple(self.to_torch(x).contiguous() for x in (
                    st["q"].reshape(batch, hq, 1, d), st["k"].transpose(0, 2, 1, 3),
                    st["v"].transpose(0, 2, 1, 3))) + (None,) for st in sets]
            return tt["dense"]

        sdpa_canon = lambda outs: (self.to_jax(outs[0]).reshape(batch, hq, d),)  # noqa: E731
        peers = [
            self._torch_sdpa("torch-cudnn", "CUDNN_ATTENTION", torch_dense, False, False,
                             gqa=True, canon=sdpa_canon),
            self._torch_sdpa("torch-flash", "FLASH_ATTENTION", torch_dense, False, False,
                             gqa=True, canon=sdpa_canon),
            self._torch_varlen_paged(sets, batch, context),
            Impl("jax-cudnn", "jax", self.jax_build(
                lambda q, k, v: (jax.nn.dot_product_attention(
                    q.reshape(batch, 1, hq, d), k, v, implementation="cudnn"),),
                [(st["q"], st["k"], st["v"]) for st in sets]),
                lambda outs: (outs[0].reshape(batch, hq, d),)),
        ]
        for impl in peers:
            impl.items = batch
        kvs = jnp.float32(kv_scale)
        ours = [
            Impl("ours-bf16", "jax", self.jax_build(
                lambda q, kc, vc, sl, bt, qsl: (xj.paged_attention(q, kc, vc, sl, bt, qsl,
                                                                   scale, max_query_len=1),),
                [(st["q"], st["kpool"], st["vpool"], st["seq_lens"], st["bt"], st["qsl"])
                 for st in sets]), tuple, items=batch),
            Impl("ours-fp8", "jax", self.jax_build(
                lambda q, kc, vc, sl, bt, qsl, ks: (xj.paged_attention(
                    q, kc, vc, sl, bt, qsl, scale, k_scale=ks, v_scale=ks, max_query_len=1),),
                [(st["q"], st["kpool8"], st["vpool8"], st["seq_lens"], st["bt"], st["qsl"], kvs)
                 for st in sets]), tuple, items=batch,
                work=decode_kv_bytes(batch, context, hk, d, 1)),
        ]

        def fallback():
            st = sets[0]
            try:
                out = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q.reshape(batch, 1, hq, d), k, v, implementation="xla"))(
                    st["q"], st["k"], st["v"])
                return (out.reshape(batch, hq, d),)
            except Exception as e:
                self.note("xla-reference", short_reason(e))
                return None
        row = self.run_row(row, peers, ours, fallback)
        tt.clear()
        sets.clear()
        return row

    def _torch_varlen_paged(self, sets, batch, context):
        """torch varlen_attn over the very paged cache, where it takes a block_table."""
        def build():
            torch = self.torch
            import importlib
            attn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
            params = inspect.signature(attn).parameters
            if "block_table" not in params or "seqused_k" not in params:
                raise RuntimeError("this torch's varlen_attn takes no block_table")
            kw = dict(enable_gqa=True) if "enable_gqa" in params else {}
            dev = self.tdev
            cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            cu_k = cu_q * context
            used = torch.full((batch,), context, dtype=torch.int32, device=dev)
            tsets = [(self.to_torch(st["q"]), self.to_torch(st["kpool"]),
                      self.to_torch(st["vpool"]), self.to_torch(st["bt"])) for st in sets]
            n = len(tsets)

            def fn(i):
                q, kc, vc, bt = tsets[i % n]
                with torch.no_grad():
                    return (attn(q, kc, vc, cu_q, cu_k, 1, context, seqused_k=used,
                                 block_table=bt, **kw),)
            return fn

        return Impl("torch-varlen-paged", "torch", build,
                    lambda outs: (self.to_jax(outs[0]),), items=batch)

    # ------------------------------------------------------------------ cache write
    def bench_cache(self) -> list[dict]:
        """reshape_and_cache_flash against what JAX users write today (.at[].set, with and
        without unique_indices) and the copy rate of the same bytes."""
        jax, jnp, np, xj = self.jax, self.jnp, self.np, self.xj
        tokens = self.sizes.cache_tokens
        heads_k, dim, block_size = 8, 128, 16
        num_blocks = 2 * tokens // block_size  # cache twice the new tokens: a realistic scatter
        rng = np.random.default_rng(self.args.seed)
        rows = []
        for src, fmt, cache_dtype in (("bfloat16", "auto", jnp.bfloat16),
                                      ("bfloat16", "fp8_e4m3", jnp.float8_e4m3fn)):
            try:
                key = self.randn((tokens, heads_k, dim), src)
                value = self.randn((tokens, heads_k, dim), src)
                slots = jnp.asarray(rng.permutation(num_blocks * block_size)[:tokens],
                                    jnp.int32)
                shape = (num_blocks, block_size, heads_k, dim)
                kc = self.randn(shape).astype(cache_dtype)
                vc = self.randn(shape).astype(cache_dtype)
                jax.block_until_ready((key, value, kc, vc))
            except Exception as e:
                self.note("cache", short_reason(e))
                continue
            scale = jnp.float32(0.5)
            moved = cache_write_bytes(tokens, heads_k, dim, jnp.dtype(src).itemsize,
                                      jnp.dtype(cache_dtype).itemsize)
            dtype_text = f"{src}->{jnp.dtype(cache_dtype).name}"
            row = new_row("cache", f"{tokens} tok x {heads_k} x {dim} {dtype_text}",
                          dict(tokens=tokens, heads_k=heads_k, head_dim=dim,
                               kv_cache_dtype=fmt, dtype=dtype_text), "GB/s", moved,
                          sort=(fmt,))

            def encode(x, sc, fmt=fmt, cache_dtype=cache_dtype):
                if fmt == "auto":
                    return x.astype(cache_dtype)
                return (x.astype(jnp.float32) / sc).astype(cache_dtype)

            def stateful(f, kc=kc, vc=vc):
                """Thread the donated caches through the calls (donation consumes them)."""
                def build():
                    state = {"kc": jnp.copy(kc), "vc": jnp.copy(vc)}

                    def step(i):
                        state["kc"], state["vc"] = f(state["kc"], state["vc"])
                        return state["kc"], state["vc"]
                    return step
                return build

            peers = []
            for unique in (False, True):
                at_set = jax.jit(lambda kc, vc, k, v, s, sc, u=unique, enc=encode, shape=shape: (
                    kc.reshape(-1, heads_k, dim).at[s].set(enc(k, sc), unique_indices=u)
                    .reshape(shape),
                    vc.reshape(-1, heads_k, dim).at[s].set(enc(v, sc), unique_indices=u)
                    .reshape(shape)),
                    donate_argnums=(0, 1))
                peers.append(Impl("jax-at-set-unique" if unique else "jax-at-set", "jax",
                                  stateful(lambda kc, vc, f=at_set: f(kc, vc, key, value, slots,
                                                                      scale)), None))
            ours_fn = jax.jit(lambda k, v, kc, vc, s, sc, fmt=fmt: xj.reshape_and_cache_flash(
                k, v, kc, vc, s, kv_cache_dtype=fmt, k_scale=sc, v_scale=sc),
                donate_argnums=(2, 3))
            ours = Impl("ours", "jax", stateful(lambda kc, vc: ours_fn(key, value, kc, vc, slots,
                                                                       scale)), None)
            big = self.randn((moved // 4,), "float16")  # moved/2 bytes read, moved/2 written
            copy_fn = jax.jit(lambda x: x + jnp.float16(1))
            copy = Impl("copy", "jax", lambda: (lambda i: copy_fn(big)), None)

            def check(out, key=key, value=value, slots=slots, encode=encode):
                try:
                    errs = []
                    for cache, new in zip(out, (key, value)):
                        got = jnp.take(cache.reshape(-1, heads_k, dim), slots, axis=0)
                        errs.append(self.rel_err(got, encode(new, scale)))
                    err = max(errs)
                    return {"ok": err < TOLERANCE, "ref": "jnp encode", "err": err}
                except Exception as e:
                    return {"ok": None, "reason": f"check failed: {short_reason(e)}"}

            for impl in peers:
                self.run_cell(row, impl, "peer")
            self.run_cell(row, ours, "ours", check)
            self.run_cell(row, copy, "ceiling")
            finalize_row(row)
            print("  " + row_summary(row), flush=True)
            rows.append(row)
            key = value = kc = vc = big = None  # free before the next format
            self.cleanup()
        return rows


def row_summary(row: dict) -> str:
    parts = []
    for name, cell in sorted(row["cells"].items(), key=lambda kv: ROLE_ORDER[kv[1]["role"]]):
        parts.append(f"{name} {cell_text(cell, 'value', row['unit'])}")
    ratios = ", ".join(f"{o}/best {fmt_ratio(r)}" for o, r in row.get("ratio", {}).items())
    return f"{row['kind']} {row['label']} [{row['unit']}]: " + " | ".join(parts) + \
        (f" || {ratios}" if ratios else "")


# ------------------------------------------------------------------ environment
def environment(runner) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "host": platform.node(),
           "command": "python3 " + " ".join(sys.argv)}
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            name, driver, mem = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")]
            env.update(gpu=name, driver=driver, gpu_memory=mem)
    except Exception as e:
        env["nvidia_smi"] = short_reason(e)
    jax = runner.jax
    env["jax"] = jax.__version__
    try:
        import jaxlib
        env["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    env["jax_device"] = f"{runner.device.device_kind} ({runner.device.platform})"
    env.setdefault("gpu", runner.device.device_kind)
    try:
        import xla_attn
        env["xla_attn"] = getattr(xla_attn, "__version__", "?")
        from xla_attn import _native
        info = _native.build_info()
        if isinstance(info, dict):
            env["xla_attn_build"] = {
                k: ([m.get("name") for m in v if isinstance(m, dict)] if k == "modules" else v)
                for k, v in info.items() if k != "variants"}
        else:
            env["xla_attn_build"] = str(info)
    except Exception as e:
        env.setdefault("xla_attn_build", short_reason(e))
    torch = runner.torch
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = getattr(torch.version, "cuda", None)
        try:
            env["cudnn_torch"] = torch.backends.cudnn.version()
        except Exception:
            pass
        if runner.tdev == "cuda":
            props = torch.cuda.get_device_properties(0)
            env["sm_count"] = props.multi_processor_count
            env["l2_bytes"] = runner.l2
    else:
        env["torch"] = runner.torch_reason
    return env


# ------------------------------------------------------------------ main
def parse_rows(text: str) -> list[str]:
    kinds = []
    for part in text.split(","):
        part = KIND_ALIASES.get(part.strip(), part.strip())
        if not part:
            continue
        if part not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown row kind {part!r}; choose from "
                                             f"{','.join(KINDS)}")
        kinds.append(part)
    return kinds


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="S in 1024/4096/16384, head_dim 128 only, no L=32768 (under 90 s)")
    p.add_argument("--rows", type=parse_rows, default=list(KINDS),
                   help="comma-separated row kinds: dense,varlen,decode,cache (default: all)")
    p.add_argument("--json", help="write every number and the environment to this file")
    p.add_argument("--plot", help="write a PNG (matplotlib, Agg), one panel per row kind")
    p.add_argument("--markdown", help="append a dated section with the tables to this file")
    p.add_argument("--cell-budget", type=float, default=None,
                   help="seconds of measured time per cell (default 0.2, --quick 0.1)")
    p.add_argument("--repeats", type=int, default=15,
                   help="most timed samples per cell (default 15)")
    p.add_argument("--time-limit", type=float, default=0,
                   help="after this many seconds skip the remaining cells (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seqlens", type=lambda t: tuple(int(x) for x in t.split(",")),
                   help="dense rows at these S only (comma-separated, e.g. 512,1024)")
    p.add_argument("--ours-torch", action="store_true",
                   help="dense rows: also xla_attn.torch in eager mode (cell ours-torch), "
                        "beside torch's SDPA in the same framework")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, any jax platform (CPU too): exercises the plumbing only")
    p.add_argument("--selftest", action="store_true",
                   help="check FLOP counting, timing logic, tables, markdown, JSON (and the "
                        "plot where matplotlib is installed) on fake rows; needs no GPU")
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    if args.selftest:
        return selftest()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.cell_budget is None:
        args.cell_budget = 0.2 if mode == "full" else 0.1
    sizes = Sizes(mode)
    if args.seqlens:
        sizes.dense_seqs = args.seqlens
    try:
        runner = Runner(args, sizes)
    except Exception as e:
        print(f"cannot start: {short_reason(e)}", file=sys.stderr)
        return 2
    if runner.device.platform != "gpu" and not args.smoke:
        print(f"jax's default device is {runner.device} ({runner.device.platform}), not a GPU: "
              "nothing to benchmark (use --smoke to exercise the plumbing on CPU)",
              file=sys.stderr)
        return 2
    result = {"schema": "xla_attn.bench/2",
              "args": {"mode": mode, "rows": args.rows, "cell_budget": args.cell_budget,
                       "repeats": args.repeats, "seed": args.seed,
                       "time_limit": args.time_limit, "seqlens": args.seqlens,
                       "ours_torch": args.ours_torch},
              "conventions": {"fwd_bwd_factor": FWD_BWD_FACTOR, "causal_factor": 0.5,
                              "tolerance": TOLERANCE,
                              "ratio": "fastest peer time / our time"},
              "rows": [], "elapsed_s": {}}
    result["env"] = environment(runner)
    print(f"{env_line(result)}; mode {mode}", flush=True)
    # the GPU's clock, power and temperature through the run (gpu_state.py says why)
    sampler = gpu_state.Sampler().start()
    if runner.torch is None:
        print(f"  {runner.torch_reason}: torch peers n/a", flush=True)
    t0 = time.perf_counter()
    result["ceilings"] = runner.ceilings()
    result["elapsed_s"]["ceilings"] = time.perf_counter() - t0
    print(ceiling_line(result), flush=True)
    status = 0
    try:
        for kind in RUN_ORDER:
            if kind not in args.rows:
                continue
            print(f"-- {kind}", flush=True)
            t0 = time.perf_counter()
            try:
                result["rows"] += getattr(runner, f"bench_{kind}")()
            except Exception as e:  # a bug in one kind must not lose the others
                print(f"  {kind} failed: {short_reason(e)}", flush=True)
                result.setdefault("errors", {})[kind] = short_reason(e)
                status = 1
            runner.cleanup()
            result["elapsed_s"][kind] = time.perf_counter() - t0
    finally:
        sampler.stop()
        result["gpu_state"] = sampler.summary()
        result["elapsed_s"]["total"] = runner.elapsed()
        print(text_report(result))
        print(f"\n{ceiling_line(result)}\n{gpu_state.summary_line(result['gpu_state'])}"
              "\nelapsed: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in result["elapsed_s"].items()), flush=True)
        for flag, writer in (("json", write_json), ("markdown", append_markdown),
                             ("plot", write_plot)):
            path = getattr(args, flag)
            if path:
                try:
                    writer(path, result)
                    print(f"wrote {path}")
                except Exception as e:
                    print(f"could not write {flag} {path}: {short_reason(e)}", file=sys.stderr)
                    status = 1
    return status


# ------------------------------------------------------------------ selftest (no GPU)
def fake_result() -> dict:
    """Rows of every kind with ok, n/a, WRONG, unchecked and skipped cells."""
    def cell(role, s=None, status="ok", **kw):
        c = {"role": role, "status": status, **kw}
        if s is not None:
            c["s"] = s
        return c

    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for bwd in (False, True):
                w = dense_flops(16, 1024, 2048 // d, d, causal, bwd)
                mode = "fwd+bwd" if bwd else "fwd"
                r = new_row("dense", f"d={d} {'causal' if causal else 'full'} S=1024 {mode}", {},
                            "TFLOP/s", w, sort=(d, causal, bwd, 1024))
                r["cells"] = {
                    "torch-flash": cell("peer", w / 400e12),
                    "torch-cudnn": cell("peer", w / 500e12) if d == 128 else
                    cell("peer", status="n/a", reason="RuntimeError: No available kernel"),
                    "jax-cudnn": cell("peer", w / 450e12),
                    "ours": cell("ours", w / 20e12) if not (d == 64 and bwd) else
                    cell("ours", status="WRONG", reason="relative error 0.5 vs torch-cudnn"),
                }
                rows.append(finalize_row(r))
    lengths = varlen_lengths(16, 1024, 0)
    w = varlen_flops(lengths, 16, 128, True, False)
    r = new_row("varlen", "16 seqs fwd", {}, "TFLOP/s", w)
    r["cells"] = {"torch-varlen": cell("peer", w / 300e12),
                  "jax-cudnn-packed": cell("peer", status="n/a", reason="no offsets"),
                  "ours": cell("ours", w / 15e12)}
    rows.append(finalize_row(r))
    for b, ctx in ((64, 512), (1, 4096)):
        w = decode_kv_bytes(b, ctx, 8, 128, 2)
        r = new_row("decode", f"B={b} L={ctx}", {}, "GB/s", w, sort=(b == 1, b, ctx))
        r["cells"] = {"torch-cudnn": cell("peer", w / 2.5e12, items=b),
                      "ours-bf16": cell("ours", w / 1e12, items=b),
                      "ours-fp8": cell("ours", w / 2 / 1.2e12, items=b, work=w / 2),
                      "jax-cudnn": cell("peer", status="skipped", reason="--time-limit")}
        if b == 1:
            r["cells"]["ours-fp8"] = cell("ours", 1e-5, status="unchecked", items=b,
                                          work=w / 2, reason="no reference")
        rows.append(finalize_row(r))
    w = cache_write_bytes(65536, 8, 128, 2, 2)
    r = new_row("cache", "64k tok", {}, "GB/s", w)
    r["cells"] = {"jax-at-set": cell("peer", w / 0.5e12), "ours": cell("ours", w / 2.4e12),
                  "copy": cell("ceiling", w / 3e12)}
    rows.append(finalize_row(r))
    return {"schema": "xla_attn.bench/2", "rows": rows,
            "args": {"mode": "selftest", "cell_budget": 0.2},
            "env": {"date": "2026-01-01 00:00 UTC", "gpu": "Fake GPU", "driver": "0",
                    "jax": "0", "torch": "0", "xla_attn": "0", "command": "selftest"},
            "ceilings": {"copy_GBps": 3000.0, "copy_how": "fake", "matmul_TFLOPs": 790.0,
                         "matmul_how": "fake", "nan_check": float("nan")},
            "elapsed_s": {"total": 1.0}}


def selftest() -> int:
    import tempfile

    assert dense_flops(1, 1024, 16, 128, False, False) == 4 * 1024**2 * 16 * 128
    assert dense_flops(1, 1024, 16, 128, True, False) == 2 * 1024**2 * 16 * 128
    assert dense_flops(2, 512, 8, 64, True, True) == 3.5 * 2 * 512**2 * 8 * 64 * 2
    lengths = varlen_lengths(16, 1024, 0)
    assert len(lengths) == 16 and sum(lengths) == 16384 and min(lengths) >= 1, lengths
    assert lengths == varlen_lengths(16, 1024, 0), "lengths must be reproducible"
    assert varlen_flops([3, 5], 2, 4, False, False) == 4 * (9 + 25) * 2 * 4
    assert decode_kv_bytes(64, 4096, 8, 128, 2) == 2 * 64 * 4096 * 8 * 128 * 2
    assert cache_write_bytes(10, 2, 4, 2, 1) == 2 * 10 * 2 * 4 * 3
    assert rotation_sets(16 * 2**20, 50 * 2**20) == 8
    assert rotation_sets(1 << 30, 50 * 2**20) == 1
    assert rotation_sets(60 * 2**20, 50 * 2**20) == 3
    for kinds, want in (("dense,cache_write", ["dense", "cache"]), ("decode", ["decode"])):
        assert parse_rows(kinds) == want
    try:
        parse_rows("bogus")
        raise AssertionError("bogus row kind accepted")
    except argparse.ArgumentTypeError:
        pass

    # timing logic on a fake clock: a slow call gets 1-3 samples, a fast one batches
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731

    def fake(cost):
        def fn(i):
            now[0] += cost
            return i
        return fn
    calls = []
    m = measure(fake(0.3), lambda o: calls.append(o), 0.2, 15, clock=clock)
    assert m["samples"] == [0.3] and m["inner"] == 1 and abs(m["s"] - 0.3) < 1e-12, m
    m = measure(fake(0.05), lambda o: None, 0.2, 15, clock=clock)
    assert len(m["samples"]) == 3 and m["inner"] == 1, m  # 3 x 0.05 <= 0.2 < 4 x 0.05
    m = measure(fake(1e-5), lambda o: None, 0.2, 15, clock=clock)
    assert m["inner"] == 1000 and len(m["samples"]) == 15 and abs(m["s"] - 1e-5) < 1e-9, m
    m = measure(fake(1e-3), lambda o: None, 0.2, 15, clock=clock,
                on_first=lambda out: {"ok": False, "err": 1.0})
    assert m["s"] is None and m["check"]["ok"] is False, m
    seen = []
    measure(fake(1e-3), lambda o: None, 0.01, 15, clock=clock, on_first=lambda o: seen.append(o))
    assert seen == [0], "on_first must get the warm-up (first) output"

    result = fake_result()
    rows = result["rows"]
    wrong = [r for r in rows if r["kind"] == "dense" and r["cells"]["ours"]["status"] == "WRONG"]
    assert wrong and all(r["ratio"]["ours"] is None for r in wrong)
    d128 = next(r for r in rows if r["label"] == "d=128 full S=1024 fwd")
    assert d128["best_peer"] == "torch-cudnn" and abs(d128["ratio"]["ours"] - 20 / 500) < 1e-9
    assert abs(d128["cells"]["ours"]["value"] - 20.0) < 1e-6
    dec = next(r for r in rows if r["label"] == "B=64 L=512")
    assert abs(dec["cells"]["ours-fp8"]["value"] - 1200.0) < 1e-6  # fp8 bytes: half
    assert abs(dec["cells"]["ours-bf16"]["tok/s"] - 64 / (dec["work"] / 1e12)) < 1e-3
    cache = next(r for r in rows if r["kind"] == "cache")
    assert abs(cache["of_ceiling"]["ours/copy"] - 2.4 / 3) < 1e-9
    report = text_report(result)
    for needle in ("WRONG", "n/a", "skip", "?", "0.040x", "ours/best", "tokens/s", "ours/copy"):
        assert needle in report, needle
    assert abs(d128["vs_target"]["ours"] - 20 / 400) < 1e-9  # against torch-flash (FA2)
    headers, lines = build_table([r for r in rows if r["kind"] == "dense"])
    assert headers[:2] == ["config", "ours"] and all(len(x) == len(headers) for x in lines)
    col = headers.index("ours/torch-flash")
    assert "0.050x" in [x[col] for x in lines] and "WRONG" not in [x[col] for x in lines]
    assert lines[0][0].startswith("d=64 full") and "WRONG" in [x[1] for x in lines]
    print(report)
    result["gpu_state"] = gpu_state.summarize(
        [gpu_state.parse("1755, 1980, 650.0, 700.0, 61, 0x4")])
    with tempfile.TemporaryDirectory() as tmp:
        md = os.path.join(tmp, "docs", "benchmarks.md")
        append_markdown(md, result)
        append_markdown(md, result)
        text = open(md, encoding="utf-8").read()
        assert text.count("# Benchmarks") == 1 and text.count("## 2026-01-01") == 2
        assert text.count("GPU while busy (1 of 1 samples): SM clock 1755 MHz") == 2
        assert "| config |" in text and "|:---|---:|" in text and "WRONG" in text
        js = os.path.join(tmp, "out.json")
        write_json(js, result)
        back = json.load(open(js, encoding="utf-8"))
        assert back["ceilings"]["nan_check"] is None and len(back["rows"]) == len(rows)
        assert back["gpu_state"]["reasons"] == {"software power cap": 1.0}
        try:
            import matplotlib
        except ImportError:
            matplotlib = None
        if matplotlib is None:
            print("selftest: matplotlib not installed here: plot not exercised")
        else:
            png = os.path.join(tmp, "plot.png")
            write_plot(png, result)
            assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
            print("selftest: plot written")
    heavy = [m for m in ("jax", "torch") if m in sys.modules]
    assert not heavy, f"selftest imported {heavy}"
    print("selftest ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
