#!/usr/bin/env python3
"""What the GPU runs for one jitted attention call, issued back to back as tools/bench.py
times it: every kernel and memset of --calls calls, read from JAX's profiler (CUPTI),
summed per name, the calls' period against the time the GPU was busy, and the idle
gaps between consecutive activities by the pair of names around them.

  python3 tools/call_timeline.py --impl ours --seqlen 512 --head-dim 128 [--causal]
      [--varlen] [--op fwd|fwd_bwd] [--calls 50] [--chain 1] [--json out.json]

Shapes follow tools/bench.py's dense rows (16 K tokens, H x D = 2048, bf16). impl ours
is xla_attn.jax.flash_attn, jax-cudnn jax.nn.dot_product_attention(implementation=
"cudnn"). --varlen takes bench.py's varlen row instead (16 causal sequences of its
lengths, --seed; 16 heads of --head-dim, packed): ours flash_attn_varlen, jax-cudnn the
packed form (q_offsets / kv_offsets). The period is the span from the first activity of
the traced calls to the end of the last, over --calls; busy is the summed activity durations over --calls; what is
left (period - busy) is the GPU idle between activities: launch gaps and host time the
queue did not hide (activities overlapping on several streams would count twice in busy;
these calls run on one). The profiler's own host cost lengthens the traced period, so the
calls are also timed without it first: wall time a call over --calls back to back, and
the host's share (until the last call was enqueued). --chain N makes one call N
attentions in a row, each one's output the next one's query (N layers of one compiled
graph), so that JAX's dispatch is paid once for N. A measuring tool, not a benchmark of
record.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time


def gpu_activities(xspace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every activity on a GPU plane of the trace under
    xspace_dir (the *.xplane.pb that jax.profiler.trace wrote there)."""
    from jax.profiler import ProfileData

    files = sorted(pathlib.Path(xspace_dir).rglob("*.xplane.pb"))
    if not files:
        raise RuntimeError(f"no *.xplane.pb under {xspace_dir}: the profiler wrote no trace")
    events = []
    for plane in ProfileData.from_file(str(files[-1])).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # per-stream lines carry the activities; XLA's per-op and per-module lines
            # repeat them under other names
            if not line.name.startswith("Stream"):
                continue
            events += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
    return events


def per_call(groups: dict[str, list[int]], calls: int) -> list[tuple[str, float, float]]:
    """(name, count a call, median us) of each group of durations (ns), most time first."""
    rows = ((n, len(ds) / calls, statistics.median(ds) / 1e3) for n, ds in groups.items())
    return sorted(rows, key=lambda x: -x[1] * x[2])


def summarize(events: list[tuple[str, int, int]], calls: int) -> dict:
    """Per call: the period, the busy time, the idle rest, and each activity name's count
    and median duration (names shortened to 80 characters)."""
    if not events or calls <= 0:
        raise ValueError("summarize: no GPU activity recorded (or calls <= 0)")
    start = min(s for _, s, _ in events)
    end = max(s + d for _, s, d in events)
    period = (end - start) / calls
    busy = sum(d for *_, d in events) / calls
    by_name: dict[str, list[int]] = {}
    for name, _, dur in events:
        by_name.setdefault(name[:80], []).append(dur)
    kinds = per_call(by_name, calls)
    # the idle time by where it falls: each gap from an activity's end to the next one's
    # start, keyed by the two names (a launch gap inside a call, or the one between calls)
    ordered = sorted(events, key=lambda e: e[1])
    by_pair: dict[str, list[int]] = {}
    for (a, sa, da), (b, sb, _) in zip(ordered, ordered[1:]):
        by_pair.setdefault(f"{a[:38]} -> {b[:38]}", []).append(max(sb - sa - da, 0))
    gaps = per_call(by_pair, calls)
    return {"period_us": period / 1e3, "busy_us": busy / 1e3, "idle_us": (period - busy) / 1e3,
            "activities": [{"name": n, "per_call": c, "median_us": m} for n, c, m in kinds],
            "gaps": [{"between": n, "per_call": c, "median_us": m} for n, c, m in gaps]}


def report(summary: dict) -> str:
    lines = [f"period {summary['period_us']:.1f} us a call: busy {summary['busy_us']:.1f}, "
             f"idle {summary['idle_us']:.1f}"]
    for a in summary["activities"]:
        lines.append(f"  {a['per_call']:5.2f} x {a['median_us']:8.2f} us  {a['name']}")
    lines.append("idle gaps:")
    for g in summary["gaps"]:
        lines.append(f"  {g['per_call']:5.2f} x {g['median_us']:8.2f} us  {g['between']}")
    return "\n".join(lines)


def dense_call(impl: str, causal: bool):
    """fwd(q, k, v) on (B, S, H, D) inputs: ours or JAX's cuDNN attention."""
    import jax

    if impl == "ours":
        from xla_attn import jax as xj

        def fwd(q, k, v):
            return xj.flash_attn(q, k, v, causal=causal)
    else:
        def fwd(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                implementation="cudnn")
    return fwd


def varlen_call(impl: str, head_dim: int, seed: int = 0):
    """(fwd(q, k, v), inputs) on tools/bench.py's varlen row: its 16 causal sequences of
    random lengths (mean 1024, `seed`), packed, 16 heads of head_dim, bf16 normals."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import varlen_lengths

    lengths = varlen_lengths(16, 1024, seed)
    cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = tuple(jax.random.normal(x, (int(cu_np[-1]), 16, head_dim), jnp.bfloat16)
                   for x in keys)
    cu, longest = jnp.asarray(cu_np), max(lengths)
    if impl == "ours":
        from xla_attn import jax as xj

        def fwd(q, k, v):
            return xj.flash_attn_varlen(q, k, v, cu, cu, longest, longest, causal=True)
    else:
        # JAX's cuDNN module (private; jax.nn.dot_product_attention takes no offsets in
        # jax 0.11), as bench.py's jax-cudnn-packed falls back to
        from jax._src.cudnn import fused_attention_stablehlo as fa

        seqlen, offsets = jnp.asarray(np.asarray(lengths, np.int32)[None]), cu[None]

        def fwd(q, k, v):
            return fa.dot_product_attention(
                q[None], k[None], v[None], q_seqlen=seqlen, kv_seqlen=seqlen,
                q_offsets=offsets, kv_offsets=offsets, scale=head_dim ** -0.5,
                mask_type=fa.MaskType.PADDING_CAUSAL)[0]
    return fwd, inputs


def build(impl: str, op: str, seqlen: int, head_dim: int, causal: bool, chain: int = 1,
          varlen: bool = False, seed: int = 0):
    import jax

    from profile_op import dense_inputs, jit_call

    if varlen:
        fwd, inputs = varlen_call(impl, head_dim, seed)
    else:
        fwd = dense_call(impl, causal)
        inputs = dense_inputs(seqlen, head_dim, jax.random.split(jax.random.key(0), 3))

    def layers(q, k, v):
        for _ in range(chain):
            q = fwd(q, k, v)
        return q
    return jit_call(op, layers), inputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("ours", "jax-cudnn"), default="ours")
    p.add_argument("--op", choices=("fwd", "fwd_bwd"), default="fwd")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--varlen", action="store_true",
                   help="bench.py's varlen row (causal; --seqlen and --causal unused)")
    p.add_argument("--seed", type=int, default=0, help="--varlen: bench.py's length seed")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--chain", type=int, default=1, help="attentions a call (layers)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)

    if args.calls < 1 or args.chain < 1:
        p.error("--calls and --chain must be >= 1")
    import jax

    fn, inputs = build(args.impl, args.op, args.seqlen, args.head_dim, args.causal, args.chain,
                       args.varlen, args.seed)
    for _ in range(3):  # compile, plans, allocator warm
        jax.block_until_ready(fn(*inputs))
    # each call's output dropped as the next is issued, as tools/bench.py's loop does:
    # holding all of them made the allocator grow the pool every call (1.1 ms of host
    # time a call at 64 MB outputs)
    t0 = time.perf_counter()
    for _ in range(args.calls):
        out = fn(*inputs)
    host = time.perf_counter() - t0
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    del out
    untraced = {"wall_us": wall / args.calls * 1e6, "host_us": host / args.calls * 1e6}
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.calls):
                out = fn(*inputs)
            jax.block_until_ready(out)
        summary = summarize(gpu_activities(d), args.calls)
    summary["config"] = vars(args)
    summary["untraced"] = untraced
    shape = (f"varlen (seed {args.seed})" if args.varlen
             else f"S={args.seqlen}{' causal' if args.causal else ''}")
    print(f"{args.impl} {args.op} d{args.head_dim} {shape} chain {args.chain}: untraced "
          f"{untraced['wall_us']:.1f} us a call (host {untraced['host_us']:.1f}); traced "
          + report(summary))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
