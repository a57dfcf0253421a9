#!/usr/bin/env python3
"""A/B timing of built wheels on one GPU: the same attention shapes, each wheel in its own
process (installed into a temporary folder, nothing else changed), rounds alternating
between the wheels so that clock drift falls on all of them alike.

  python3 tools/ab_wheels.py dist/base dist/try1 dist/try2 [--configs bf16:128:512:causal,...]
      [--op fwd|fwd_bwd] [--rounds 2] [--tokens 16384] [--json out.json] [--time-limit S]
      [--wheel-timeout S] [--ncu]

A wheel argument is a .whl file or a folder holding one; a folder may hold an env.json
whose variables its process gets (e.g. {"XLA_ATTN_SM90_BLOCKS": "132"} to time the same
wheel with the Hopper forward's walk forced). Shapes follow tools/bench.py's dense rows
(--tokens = batch x seqlen, 16 K; H x D = 2048); a config is
dtype:head_dim:seqlen[:causal][:pagedN], dtype bf16 or fp8 (e4m3 q, k, v through
flash_attn_varlen, bf16 out); seqlen `varlen` is bench.py's varlen row (VARLEN_SEQS causal
sequences of random lengths, --tokens in all, through flash_attn_varlen), `varlenN` the same
with the lengths of seed N (bench.py's --seed); `pagedN` (a seqlen that N divides; --op fwd)
reads K and V from a paged cache of N-row blocks in random order through a block table.
Prints TFLOP/s (best of the rounds)
and, per wheel, the relative error of its output (fwd_bwd: of its worst gradient of q, k
and v) against jax's own attention in f32 on one batch and two heads (the other
batches and heads do not enter their gradients), then each wheel's ratio to the first, of
the best rounds and of the medians, and each wheel's spread (its slowest round's shortfall
from its best, %: a ratio inside it is noise). A comparison tool, not a benchmark of record: tools/bench.py is (peers, ceilings, environment).

--ncu: the time is our kernels' own, at the GPU's base clock, rather than the wall time of
calls at whatever clock the GPU boosts to: a wheel's configs run in one process under
Nsight Compute (`ncu --clock-control base`, metric gpu__time_duration, our kernels only),
each config's calls followed by a marker launch that tells them apart (where that process
fails, each config in a process of its own), and ncu times NCU_CALLS calls a config; a
call's time is the sum of its kernels', and the figure the median of the calls after the
first. On the noisy H100s of
docs/benchmarks.md section (37), calls of one process read within 0.3 % of each other
this way, processes within about 2.5 %, where boosted wall-clock rounds spread 5-10 %.
ncu leaves the GPU at that base clock after it exits (an H200: 1500 MHz while idle, where
it reads 345 before ncu, and tools/bench.py after it ran at 1500 MHz throughout;
docs/benchmarks.md 2026-12-02 (55)): on a machine, run bench.py before any --ncu run.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

VARLEN_SEQS = 16  # the varlen row's sequences, as tools/bench.py's (sizes.varlen["n"])
# --ncu: calls profiled a config, the first (compile and warm-up) then dropped
NCU_CALLS = 7
# --ncu, configs batched in one process: the kernel of the marker call after each config's
# calls (a one-row reshape_and_cache_flash), which no timed op launches
MARK_KERNEL = "reshape_and_cache"
NCU_METRIC = "gpu__time_duration.sum"
# --ncu without --wheel-timeout: the bound of the one process for all configs (seconds,
# base + a config) and of each config's own process. Measured on an H200 (docs/
# benchmarks.md section (45)): a batched process took ~15 s + ~5 s a config (5 configs
# ~40 s), a config's own ~15 s. About twice that, so that a process that stalls under
# ncu (twice in that section's three A/Bs) costs a minute rather than 60 + 20 s a config.
NCU_BATCH_BOUND = (30.0, 10.0)
NCU_CONFIG_BOUND = 45.0
NCU_SECONDS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3,
               "msecond": 1e-3, "s": 1.0, "second": 1.0}
DEFAULT_CONFIGS = ("bf16:64:512:causal,bf16:64:2048,bf16:128:512,bf16:128:512:causal,"
                   "bf16:128:4096,bf16:128:16384:causal,bf16:256:4096,fp8:128:512,fp8:128:8192")

# The start of the lines a wheel's process prints as it goes (flushed), so that where it is
# killed, run_child can say how far it got.
PROGRESS = "ab_wheels progress: "

# Runs in the wheel's process: CONFIGS, OP, TOKENS, VARLEN_SEQS, CALLS, PROGRESS and TOOLS (this
# folder, for tools/bench.py's timing and FLOP count) are prepended. CALLS (--ncu): the
# process makes that many calls in all, for ncu to time, and reports each config's FLOPs
# in place of TFLOP/s.
CHILD = r'''
import json, sys
sys.path.insert(0, TOOLS)
import jax, jax.numpy as jnp
from bench import measure, varlen_flops, varlen_lengths
from xla_attn import jax as xj
res = {}
if MARK:  # a tiny cache write, whose kernel (MARK_KERNEL) ends each config's launches
    mark_cache = jnp.zeros((1, 16, 1, 16), jnp.bfloat16)
    mark_rows = jnp.ones((1, 1, 16), jnp.bfloat16)
    mark = jax.jit(lambda c: xj.reshape_and_cache_flash(mark_rows, mark_rows, c, c,
                                                        jnp.zeros((1,), jnp.int32)))
for dt, d, s, causal, page in CONFIGS:
    h = 2048 // d
    name = f"S{s}" if s > 0 else f"varlen{-s}" if s else "varlen"
    name += f" paged{page}" if page else ""
    key = f"{dt} d{d} {name} {'causal' if causal else 'full'}"
    print(f"{PROGRESS}{key}: started", flush=True)  # (run_child: where a process hung)
    # s <= 0: the varlen row (lengths of seed -s), its sequences one batch row (1, total,
    # H, D) of the packed rows
    lens = ([s] * (TOKENS // s) if s > 0
            else varlen_lengths(VARLEN_SEQS, TOKENS // VARLEN_SEQS, seed=-s))
    b, rows = (len(lens), s) if s > 0 else (1, sum(lens))
    ks = jax.random.split(jax.random.fold_in(jax.random.key(1), d * abs(s)), 3)
    # values e4m3 holds exactly, so that the bf16 and fp8 rows compute the same numbers
    q, k, v = (jax.random.normal(x, (b, rows, h, d), jnp.float32).astype(jnp.float8_e4m3fn)
               .astype(jnp.bfloat16) for x in ks)
    if dt == "fp8" or s <= 0 or page:
        cu = jnp.cumsum(jnp.asarray([0] + lens, jnp.int32))
        kind = jnp.float8_e4m3fn if dt == "fp8" else jnp.bfloat16
        # packed (and cast to e4m3) once, outside the timed function: timed with the
        # kernel, the casts of three arrays made fp8's causal S=512 read about half the
        # rate tools/bench.py measures
        args = tuple(x.reshape(b * rows, h, d).astype(kind) for x in (q, k, v))
        table = None
        if page:  # sequence i's key block j in cache block table[i, j], blocks shuffled
            table = jax.random.permutation(jax.random.key(2), b * rows // page).astype(
                jnp.int32)
            cache = lambda x: jnp.zeros_like(x).at[table].set(x)
            args = (args[0],) + tuple(cache(x.reshape(-1, page, h, d)) for x in args[1:])
            table = table.reshape(b, rows // page)
        f = lambda q, k, v: xj.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens),
                                                 causal=causal, block_table=table
                                                 ).reshape(b, rows, h, d)
    else:
        args = (q, k, v)
        f = lambda q, k, v: xj.flash_attn(q, k, v, causal=causal)
    if OP == "fwd":
        fn = jax.jit(f)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    out = jax.block_until_ready(fn(*args))
    print(f"{PROGRESS}{key}: compiled, first call made", flush=True)
    # batch row 0 (varlen: sequence 0), heads 0 and 1
    qr, kr, vr = (x[:1, :lens[0], :2].astype(jnp.float32) for x in (q, k, v))
    ref_f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="xla")
    if OP == "fwd":
        got, want = [out], [ref_f(qr, kr, vr)]
    else:
        got = [g.reshape(b, rows, h, d) for g in out]  # packed rows: as q, k, v
        want = jax.grad(lambda q, k, v: ref_f(q, k, v).sum(), argnums=(0, 1, 2))(qr, kr, vr)
    err = max(float(jnp.linalg.norm(g[:1, :lens[0], :2].astype(jnp.float32) - w)
                    / jnp.linalg.norm(w)) for g, w in zip(got, want))
    flops = varlen_flops(lens, h, d, causal, OP == "fwd_bwd")
    if CALLS:  # the first was the call above; ncu times them
        for _ in range(CALLS - 1):
            jax.block_until_ready(fn(*args))
        print(f"{PROGRESS}{key}: {CALLS} calls made", flush=True)
        if MARK:
            jax.block_until_ready(mark(mark_cache))
        value = flops
    else:
        t = measure(lambda i: fn(*args), jax.block_until_ready, budget_s=0.4,
                    max_samples=7)["s"]
        value = flops / t / 1e12
    res[key] = (value, err)
print("RESULT " + json.dumps(res))
'''


def parse_configs(text: str, tokens: int = 16384) -> list[tuple[str, int, int, bool, int]]:
    """'bf16:128:512:causal,fp8:128:8192:paged64,bf16:128:varlen' -> [("bf16", 128, 512,
    True, 0), ("fp8", 128, 8192, False, 64), ("bf16", 128, 0, True, 0)] (seqlen <= 0: the
    varlen row of seed -seqlen, causal; the last: the paged cache's block size, or 0)."""
    configs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        page = parts.pop() if len(parts) > 3 and parts[-1].startswith("paged") else ""
        if len(parts) not in (3, 4) or parts[0] not in ("bf16", "fp8") or (
                len(parts) == 4 and parts[3] != "causal"):
            raise ValueError(f"config {item!r}: expected dtype:head_dim:seqlen[:causal]"
                             "[:pagedN] (seqlen a number or varlen), dtype bf16 or fp8")
        seed = parts[2].removeprefix("varlen")
        varlen = parts[2].startswith("varlen") and (seed == "" or seed.isdigit())
        if not parts[1].isdigit() or not (parts[2].isdigit() or varlen):
            raise ValueError(f"config {item!r}: head_dim and seqlen must be numbers "
                             "(seqlen: or varlen, varlenN)")
        d, s = int(parts[1]), -int(seed or 0) if varlen else int(parts[2])
        if tokens % (s if s > 0 else VARLEN_SEQS) or 2048 % d:
            raise ValueError(f"config {item!r}: seqlen must divide {tokens} (varlen: "
                             f"{VARLEN_SEQS} must), head_dim 2048")
        block = page.removeprefix("paged")
        if page and not (block.isdigit() and int(block) > 0 and s > 0 and s % int(block) == 0):
            raise ValueError(f"config {item!r}: pagedN takes a block size N > 0 that divides "
                             "the seqlen (not varlen)")
        configs.append((parts[0], d, s, len(parts) == 4 or s <= 0, int(block or 0)))
    return configs


def wheel_file(arg: str) -> tuple[pathlib.Path, dict[str, str]]:
    """The wheel a command-line argument names, and the env.json beside it (or {})."""
    path = pathlib.Path(arg)
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        found = sorted(path.glob("*.whl"))
        if len(found) != 1:
            raise SystemExit(f"ab_wheels: {arg} holds {len(found)} wheels, expected one")
        path = found[0]
    env_file = folder / "env.json"
    return path, (json.loads(env_file.read_text()) if env_file.exists() else {})


def child_code(configs, op: str, tokens: int, calls: int = 0, mark: bool = False) -> str:
    """The program a wheel's process runs (CHILD with its inputs prepended); mark: a
    marker launch (MARK_KERNEL) after each config's calls."""
    return (f"CONFIGS = {configs!r}\nOP = {op!r}\nTOKENS = {tokens}\n"
            f"VARLEN_SEQS = {VARLEN_SEQS}\nCALLS = {calls}\nMARK = {mark!r}\n"
            f"PROGRESS = {PROGRESS!r}\n"
            f"TOOLS = {str(pathlib.Path(__file__).resolve().parent)!r}\n" + CHILD)


# A line of the child's stderr that says it crashed (printed where the Python that ncu
# profiles dies; ncu itself then stayed until the process bound killed it, 130 s for a
# round of 10 configs, in docs/benchmarks.md sections (50)-(54)): the group is given
# CRASH_GRACE_S to end by itself, then killed.
CRASH_MARK = "Segmentation fault"
CRASH_GRACE_S = 10.0
# How a process group is stopped: SIGINT first (ncu's own cleanup and exit: its output
# flushed, its hold on the GPU let go), then SIGTERM, then SIGKILL, each STOP_GRACE_S
# after the one before (SIGKILL alone gave ncu no chance to clean up).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
STOP_GRACE_S = 10.0


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Stops proc's process group: STOP_SIGNALS in turn until proc (ncu, where it profiles)
    has ended, then SIGKILL for what is left of the group (a Python stuck in a driver
    call, which no other signal ends)."""
    for sig in STOP_SIGNALS:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # (the whole group has ended)
            return
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(code: str, env: dict[str, str], label: str, timeout: float | None = None,
              prefix: tuple[str, ...] = ()) -> dict[str, tuple[float, float]]:
    """Runs child_code's program (under the command `prefix`, e.g. ncu's); its {config:
    (TFLOP/s, error)}, or {} where it failed, crashed (CRASH_MARK) or ran past `timeout`
    seconds. Then its whole process group is killed, and its last progress line
    (PROGRESS) printed: a kernel that never ends holds its process, and without a bound
    the whole comparison, forever. Where only ncu was killed (the direct child), the
    Python process it profiled could run on, and the next process under ncu, normally
    ~10 s, made no progress in 70 s (docs/benchmarks.md, 2026-11-28 (41))."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", code], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    crashed = threading.Event()

    def drain(pipe, lines: list[str], watch: bool) -> None:
        for line in pipe:
            lines.append(line)
            if watch and CRASH_MARK in line:
                crashed.set()

    readers = [threading.Thread(target=drain, args=(proc.stdout, out, False), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, err, True), daemon=True)]
    for r in readers:
        r.start()
    started = time.monotonic()
    deadline = math.inf if timeout is None else started + timeout
    crash_seen = False
    try:
        while any(r.is_alive() for r in readers):  # (both pipes' ends: communicate's wait)
            now = time.monotonic()
            if crashed.is_set() and not crash_seen:
                crash_seen = True
                deadline = min(deadline, now + CRASH_GRACE_S)
            if now >= deadline:
                break
            time.sleep(0.05)
    except BaseException:  # (e.g. ^C: the group goes with this process)
        stop_group(proc)
        raise
    if any(r.is_alive() for r in readers):
        stop_group(proc)  # (a process inside a driver call may take a while to die)
        for r in readers:
            r.join(timeout=5)
        got = [line for line in out if line.startswith(PROGRESS)]
        where = (got[-1][len(PROGRESS):].rstrip("\n") if got
                 else "before its first config started")
        what = (f"crashed ({CRASH_MARK}) and was killed after {time.monotonic() - started:.0f} s"
                if crash_seen else f"killed after {timeout:g} s (a kernel that never ends?)")
        print(f"ab_wheels: {label} {what}; its last progress: {where}\n"
              f"{''.join(err)[-2000:]}", file=sys.stderr, flush=True)
        return {}
    proc.wait()
    for line in out:
        if line.startswith("RESULT "):
            return {k: tuple(v) for k, v in json.loads(line[7:]).items()}
    print(f"ab_wheels: {label} failed\n{''.join(out)[-2000:]}{''.join(err)[-3000:]}",
          file=sys.stderr)
    return {}


def ncu_launch_seconds(text: str) -> list[float]:
    """Each profiled launch's NCU_METRIC in seconds, in launch order, from the CSV that
    `ncu --csv --metrics NCU_METRIC` writes (its own lines before the header skipped)."""
    return [t for _, t in ncu_launches(text)]


def ncu_launches(text: str) -> list[tuple[str, float]]:
    """Each profiled launch's kernel name and NCU_METRIC in seconds, in launch order
    (ncu_launch_seconds)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting \"ID\",) in its log")
    got = []
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != NCU_METRIC:
            continue
        unit = row["Metric Unit"]
        if unit not in NCU_SECONDS:
            raise ValueError(f"ncu reported {NCU_METRIC} in {unit!r}, expected one of "
                             f"{sorted(NCU_SECONDS)}")
        got.append((int(row["ID"]), row.get("Kernel Name", ""),
                    float(row["Metric Value"].replace(",", "")) * NCU_SECONDS[unit]))
    return [(name, t) for _, name, t in sorted(got)]


def split_at_marks(launches: list[tuple[str, float]], configs: int) -> list[list[float]]:
    """The launches of a batched process (one config after another, each followed by
    a MARK_KERNEL launch) as each config's launch times; ValueError unless there are
    exactly `configs` marks, the last one last."""
    runs, run = [], []
    for name, t in launches:
        if MARK_KERNEL in name:
            runs.append(run)
            run = []
        else:
            run.append(t)
    if run or len(runs) != configs:
        raise ValueError(f"{len(runs)} marker launches ({MARK_KERNEL}) for {configs} configs"
                         f"{' and launches after the last' if run else ''}")
    return runs


def call_seconds(launches: list[float], calls: int) -> list[float]:
    """The time of each call after the first: `launches` split into `calls` runs of as
    many launches each (a call's kernels, in order), each run summed."""
    if not launches or len(launches) % calls:
        raise ValueError(f"{len(launches)} kernel launches profiled, not a multiple of the "
                         f"{calls} calls made")
    per = len(launches) // calls
    return [sum(launches[i:i + per]) for i in range(per, len(launches), per)]


def marker_env(env: dict[str, str]) -> dict[str, str]:
    """env for a process with marker launches. The marker's cache write has portable
    kernels only, so a forced family list (XLA_ATTN_FORCE_FAMILY in an env.json, e.g.
    "sm80" to time the sm80 family on Hopper) gets ",portable" after it: with "sm80"
    alone every marker failed and each config fell back to a process of its own, so that
    two wheels x 4 configs outran a 150 s bound (docs/benchmarks.md 2026-11-29 (42)).
    The compiled families outrank portable (variants.py priorities), so the timed ops
    still take the forced family wherever it has their kernel."""
    family = env.get("XLA_ATTN_FORCE_FAMILY", "")
    if not family or "portable" in family.split(","):
        return env
    return dict(env, XLA_ATTN_FORCE_FAMILY=f"{family},portable")


def ncu_command(log: str) -> tuple[str, ...]:
    """ncu timing our kernels (names starting xla_attn) at the base clock, CSV to `log`."""
    return ("ncu", "--clock-control", "base", "--metrics", NCU_METRIC, "-k", "regex:^xla_attn",
            "--csv", "--log-file", log)


def run_wheel(arg: str, configs, op: str, tokens: int, timeout: float | None = None,
              ncu: bool = False,
              config_timeout: float | None = None) -> dict[str, tuple[float, float]]:
    whl, extra_env = wheel_file(arg)
    with tempfile.TemporaryDirectory() as site:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", site, str(whl)], check=True, capture_output=True)
        env = dict(os.environ, PYTHONPATH=site, **extra_env)
        if ncu:
            return run_under_ncu(configs, op, tokens, env, arg, timeout, pathlib.Path(site),
                                 config_timeout)
        return run_child(child_code(configs, op, tokens), env, arg, timeout)


def report_ncu(label: str, got: dict, launches: list[float], res: dict) -> None:
    """One config's result from its process (got: {key: (FLOPs, error)}) and its
    launches' times into res, printed as it comes (stderr), so that a run cut short by a
    time bound keeps it; ValueError where the launches are not NCU_CALLS calls."""
    med = statistics.median(call_seconds(launches, NCU_CALLS))
    for key, (flops, err) in got.items():
        res[key] = (flops / med / 1e12, err)
        print(f"ab_wheels: {label} {key}: {med * 1e6:.1f} us a call, "
              f"{res[key][0]:.4g} TFLOP/s", file=sys.stderr, flush=True)


def run_under_ncu(configs, op: str, tokens: int, env: dict[str, str], label: str,
                  timeout: float | None, folder: pathlib.Path,
                  config_timeout: float | None = None) -> dict[str, tuple[float, float]]:
    """--ncu: {config: (TFLOP/s from the median call's kernel time, error)}, without the
    configs whose process or profile failed. All configs in one process under ncu_command
    (its log in `folder`), a marker launch after each config's calls telling their
    launches apart (split_at_marks); where that fails, each config in a process of its
    own, so that the launches profiled are its calls' (a process costs ~15 s under ncu,
    most of it starting JAX: 2026-11-28, H100)."""
    res, log = {}, folder / "ncu.csv"

    def logged() -> str:  # the CSV ncu wrote, if any
        return log.read_text() if log.exists() else ""

    # XLA's autotuning of the reference's f32 products launches hundreds of kernels, each
    # serialized by ncu: a config's process took ~55 s with it, two configs 14 s without
    # (2026-11-28, H100); our custom calls are not autotuned
    flags = f"{env.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    env = dict(env, XLA_FLAGS=flags)
    if len(configs) > 1:
        env = marker_env(env)
        log.unlink(missing_ok=True)
        # bounded (NCU_BATCH_BOUND): the first run of this form, with a bound of 60 + 20 s
        # a config times the configs, held its GPU call for 600 s and never finished
        # (docs/benchmarks.md, 2026-11-28 (40))
        got = run_child(child_code(configs, op, tokens, NCU_CALLS, mark=True), env, label,
                        timeout, ncu_command(str(log)))
        try:
            runs = split_at_marks(ncu_launches(logged()), len(configs))
            if len(got) != len(configs):
                raise ValueError(f"{len(got)} results for {len(configs)} configs")
            for (key, value), launches in zip(got.items(), runs):
                report_ncu(label, {key: value}, launches, res)
            return res
        except ValueError as e:
            print(f"ab_wheels: {label}: one process for all configs failed ({e}); a process "
                  "a config", file=sys.stderr, flush=True)
            res = {}
    for config in configs:
        log.unlink(missing_ok=True)
        got = run_child(child_code([config], op, tokens, NCU_CALLS), env, label,
                        config_timeout, ncu_command(str(log)))
        if not got:
            continue
        try:
            report_ncu(label, got, ncu_launch_seconds(logged()), res)
        except ValueError as e:
            print(f"ab_wheels: {label} {config}: {e}", file=sys.stderr, flush=True)
    return res


def table(wheels: list[str], rounds: dict[str, list[dict]]) -> str:
    """Best TFLOP/s of each wheel's rounds (error of its first round), ratios to the first
    of the best and of the medians, and each wheel's spread (slowest round below its best).
    The medians and spreads are for a noisy machine: there, an unchanged kernel's best of 3
    has moved by 3 % (docs/benchmarks.md, 2026-11-28 (36)), so a best-of ratio inside the
    spread is no evidence."""
    names = [pathlib.Path(w).name or w for w in wheels]
    lines = [f"{'config':26}" + "".join(f"{n[:16]:>20}" for n in names)
             + "   vs first (best; median) spread %"]
    keys = [k for r in rounds[wheels[0]] for k in r]
    for key in dict.fromkeys(keys):
        best, med, spread, errs = [], [], [], []
        for w in wheels:
            got = [r[key] for r in rounds[w] if key in r]
            times = [t for t, _ in got] or [float("nan")]
            best.append(max(times))
            med.append(statistics.median(times))
            spread.append(100.0 * (1.0 - min(times) / max(times)))
            errs.append(got[0][1] if got else float("nan"))
        cells = "".join(f"{t:11.4g} ({e:.0e})" for t, e in zip(best, errs))
        ratios = " ".join(f"{t / best[0]:.3f}" for t in best[1:])
        med_ratios = " ".join(f"{t / med[0]:.3f}" for t in med[1:])
        spreads = " ".join(f"{x:.1f}" for x in spread)
        lines.append(f"{key:26}{cells}  {ratios}; {med_ratios}  {spreads}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheels", nargs="+", help=".whl files or folders holding one")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--op", choices=("fwd", "fwd_bwd"), default="fwd")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of every shape")
    p.add_argument("--json", help="write every round's numbers here")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds: start no wheel's process that would likely end past them "
                   "(the longest one so far as the estimate), then print the table of the "
                   "rounds run (a timeout around the run would take the table with it)")
    p.add_argument("--wheel-timeout", type=float, default=None,
                   help="seconds: a wheel's process still running then is killed and its "
                   "round counts as failed (0: no bound; default 60 + 20 a config, several "
                   "times what a config takes on an H100, so that a kernel that never ends "
                   "costs minutes: a 600 s bound once held up a whole comparison; --ncu: "
                   "the bound of the batched process and of each config's, by default "
                   "NCU_BATCH_BOUND and NCU_CONFIG_BOUND)")
    p.add_argument("--ncu", action="store_true",
                   help="time our kernels at the GPU's base clock under Nsight Compute "
                   "(a process a config) rather than calls' wall time")
    args = p.parse_args(argv)
    if args.ncu and not shutil.which("ncu"):
        p.error("--ncu: Nsight Compute's ncu is not on PATH")
    try:
        configs = parse_configs(args.configs, args.tokens)
    except ValueError as e:
        p.error(str(e))
    if args.op == "fwd_bwd" and any(dt == "fp8" for dt, *_ in configs):
        p.error("--op fwd_bwd: the fp8 forward has no backward")
    if args.op == "fwd_bwd" and any(page for *_, page in configs):
        p.error("--op fwd_bwd: the paged forward has no backward")
    if args.wheel_timeout is not None:  # 0: no bound
        wheel_timeout = config_timeout = args.wheel_timeout or None
    elif args.ncu:
        wheel_timeout = NCU_BATCH_BOUND[0] + NCU_BATCH_BOUND[1] * len(configs)
        config_timeout = NCU_CONFIG_BOUND
    else:
        wheel_timeout, config_timeout = 60.0 + 20.0 * len(configs), None
    rounds = {w: [] for w in args.wheels}
    start, longest = time.monotonic(), 0.0
    for i, w in itertools.product(range(args.rounds), args.wheels):
        if args.time_limit and time.monotonic() - start + longest > args.time_limit:
            print(f"ab_wheels: stopped before round {i + 1} of {w}: --time-limit "
                  f"{args.time_limit:g} s", flush=True)
            break
        t0 = time.monotonic()
        rounds[w].append(run_wheel(w, configs, args.op, args.tokens, wheel_timeout, args.ncu,
                                   config_timeout))
        longest = max(longest, time.monotonic() - t0)
        # each round as it ends, so that a run cut short still leaves its numbers
        got = " ".join(f"{k}={t:.4g}" for k, (t, _) in rounds[w][-1].items())
        print(f"round {i + 1} {w}: {got}", flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rounds, indent=1))
    print(table(args.wheels, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
