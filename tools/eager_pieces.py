#!/usr/bin/env python3
"""Where an eager `xla_attn.torch` call's host time goes on this machine, piece by piece:
the dense flash call planned (its signature, the plan's call, that call's output
allocations and workspace, the native call alone: checks and launch), then the same
call's fwd+bwd step with gradients asked (the forward with gradients, the backward's
plan call, its native call alone, the step) beside the autograd engine's floor (the grad
of a trivial op) and torch SDPA's step on the same tensors. Each figure is the best of 5
runs of --number calls back to back (the GPU work is tiny: the host's time), in us.
CUDA where there is a GPU, else the CPU (the Host reference; keep the shapes tiny).

  python3 tools/eager_pieces.py [--tokens 256] [--heads 16] [--head-dim 128] [--number 500]

A measuring tool, not a benchmark of record (docs/benchmarks.md 2026-12-03 (60), Next).
"""
from __future__ import annotations

import argparse
import json
import timeit


def pieces(tokens: int = 256, heads: int = 16, head_dim: int = 128, number: int = 500) -> dict:
    """{piece: seconds a call} (see the module's docstring)."""
    import torch

    import xla_attn.torch as xt

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def best(fn) -> float:
        fn()
        sync()
        t = min(timeit.repeat(fn, number=number, repeat=5)) / number
        sync()
        return t

    q = torch.randn(1, tokens, heads, head_dim, dtype=dtype, device=dev)
    qg = q.clone().requires_grad_()
    ones = torch.ones_like(q)
    out = {}
    with torch.no_grad():
        out["forward, planned"] = best(lambda: xt.flash_attn(q, q, q, causal=True))
    values = (None, True, (-1, -1), 0.0, False)
    sig = xt._signature("flash_attn", (q, q, q, None), values)
    out["  its signature"] = best(lambda: xt._signature("flash_attn", (q, q, q, None), values))
    plan = xt._plans[sig]
    cu = xt._dense_offsets(1, tokens, dev)
    flat = q.reshape(tokens, heads, head_dim)
    fwd = (flat, flat, flat, cu, cu) + (None,) * 6
    out["  the plan's call"] = best(lambda: plan(dev, fwd))
    out["  its outputs' allocations"] = best(
        lambda: [torch.empty(s, dtype=t, device=dev) for s, t in plan.outputs])
    out["  its workspace's allocation"] = best(
        lambda: torch.empty(plan.workspace_bytes or 1, dtype=torch.uint8, device=dev))
    o, lse = plan(dev, fwd)
    out["  the native call (checks, launch)"] = best(_native(plan, fwd, (o, lse), dev))

    def step():
        return torch.autograd.grad(xt.flash_attn(qg, qg, qg, causal=True), (qg,), ones)
    out["fwd+bwd step"] = best(step)
    out["  the forward, gradients asked"] = best(lambda: xt.flash_attn(qg, qg, qg, causal=True))
    back = xt._plans[xt._signature("flash_attn", (qg, qg, qg, None), values)].backward
    bwd = (flat, flat, flat, flat, o, lse, cu, cu, None, None, None)
    out["  the backward's plan call"] = best(lambda: back(dev, bwd))
    grads = [torch.empty(s, dtype=t, device=dev) for s, t in back.outputs]
    out["  the backward's native call"] = best(_native(back, bwd, grads, dev))
    x = torch.randn(8, device=dev, requires_grad=True)
    out["the autograd engine's floor (grad of x * 2)"] = best(
        lambda: torch.autograd.grad(x * 2, (x,), torch.ones_like(x)))
    qs = qg.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out["torch SDPA fwd+bwd step"] = best(
        lambda: torch.autograd.grad(sdpa(qs, qs, qs, is_causal=True), (qg,),
                                    ones.transpose(1, 2)))
    return out


def _native(plan, tensors, outputs, dev):
    """A call of the plan's native function alone on fixed addresses and workspace."""
    import torch

    import xla_attn.torch as xt
    from xla_attn import _capi

    p = type(plan.params).from_buffer_copy(plan.params)
    for name, x in zip(plan.fields, (*tensors, *outputs)):
        if x is not None:
            setattr(p, name, x.data_ptr())
    if dev.type == "cpu":
        return lambda: plan.run(p, _capi.HOST)
    workspace = torch.empty(plan.workspace_bytes or 1, dtype=torch.uint8, device=dev)
    p.workspace, p.workspace_bytes = workspace.data_ptr(), plan.workspace_bytes
    stream = xt._current_stream(dev)
    return lambda: (workspace, plan.run(p, _capi.CUDA, stream))


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--tokens", type=int, default=256)
    a.add_argument("--heads", type=int, default=16)
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--number", type=int, default=500, help="calls a run (5 runs, the best)")
    a.add_argument("--json", help="write the figures (seconds) here")
    args = a.parse_args()
    result = pieces(args.tokens, args.heads, args.head_dim, args.number)
    for name, s in result.items():
        print(f"{name:46s} {s * 1e6:9.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
