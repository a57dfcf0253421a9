"""tools/ab_wheels.py's parts that need no GPU: config parsing, wheel lookup, the table."""
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import ab_wheels as ab  # noqa: E402


def test_configs_parse():
    configs = ("bf16:128:512:causal, fp8:128:8192,bf16:64:varlen,bf16:128:varlen3,"
               "fp8:256:2048:paged64,bf16:128:512:causal:paged16")
    assert ab.parse_configs(configs) == [
        ("bf16", 128, 512, True, 0), ("fp8", 128, 8192, False, 0), ("bf16", 64, 0, True, 0),
        ("bf16", 128, -3, True, 0), ("fp8", 256, 2048, False, 64),
        ("bf16", 128, 512, True, 16)]
    assert len(ab.parse_configs(ab.DEFAULT_CONFIGS)) == 9


@pytest.mark.parametrize("bad", ["f32:128:512", "bf16:128", "bf16:128:512:full",
                                 "bf16:128:long", "bf16:128:varlen:full", "bf16:128:varlenx",
                                 "bf16:128:500", "bf16:96:512", "bf16:128:512:paged",
                                 "bf16:128:512:paged0", "bf16:128:512:paged48",
                                 "bf16:128:varlen:paged16", "bf16:128:512:paged16:causal"])
def test_bad_configs_say_what_is_expected(bad):
    with pytest.raises(ValueError, match="config"):
        ab.parse_configs(bad)


def test_wheel_folder_and_its_env(tmp_path):
    (tmp_path / "x-0.1-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "env.json").write_text(json.dumps({"XLA_ATTN_SM90_BLOCKS": "132"}))
    whl, env = ab.wheel_file(str(tmp_path))
    assert whl.name == "x-0.1-py3-none-any.whl" and env == {"XLA_ATTN_SM90_BLOCKS": "132"}
    (tmp_path / "y-0.1-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(SystemExit, match="2 wheels"):
        ab.wheel_file(str(tmp_path))


def test_table_takes_the_best_round_and_ratios_to_the_first():
    rounds = {"a": [{"bf16 d128 S512 full": (400.0, 2e-3)}, {"bf16 d128 S512 full": (410.0, 2e-3)}],
              "b": [{"bf16 d128 S512 full": (451.0, 2e-3)}, {}]}
    out = ab.table(["a", "b"], rounds).splitlines()
    assert " 410 " in out[1] and " 451 " in out[1]
    # best 451 / 410, median 451 / 405; a's rounds 2.4 % apart, b's one round none
    assert out[1].endswith("1.100; 1.114  2.4 0.0")
    assert math.isclose(451.0 / 410.0, 1.1, rel_tol=1e-3)


def test_table_medians_show_a_best_round_that_stands_alone():
    """One fast round of five (a noisy machine's high mode) makes the best-of ratio; the
    median ratio and the spread say it is noise."""
    key = "bf16 d128 S4096 causal"
    rounds = {"base": [{key: (t, 2e-3)} for t in (636.0, 590.0, 582.0, 585.0, 588.0)],
              "try": [{key: (t, 2e-3)} for t in (590.0, 589.0, 581.0, 586.0, 587.0)]}
    line = ab.table(["base", "try"], rounds).splitlines()[1]
    best, rest = line.rsplit(";", 1)
    assert best.endswith("0.928")
    med_ratio, spread_base, spread_try = rest.split()
    assert float(med_ratio) == pytest.approx(587.0 / 588.0, abs=1e-3)
    assert float(spread_base) == pytest.approx(100 * (1 - 582 / 636), abs=0.05)
    assert float(spread_try) == pytest.approx(100 * (1 - 581 / 590), abs=0.05)


@pytest.mark.parametrize("op", ["fwd", "fwd_bwd"])
def test_child_times_and_checks_the_installed_package(op):
    """The program each wheel's process runs, on the package under test (the host path
    without a GPU): a TFLOP/s figure and the error against jax's attention, small for the
    output (fwd) and for the worst of dq, dk, dv (fwd_bwd)."""
    pytest.importorskip("jax")
    configs = "bf16:64:64:causal,bf16:128:128,bf16:64:varlen,bf16:64:varlen2"
    paged = ",bf16:64:64:causal:paged16,fp8:128:128:paged32" if op == "fwd" else ""
    code = ab.child_code(ab.parse_configs(configs + paged), op, 256)
    got = ab.run_child(code, dict(os.environ), "the installed package")
    assert set(got) == {"bf16 d64 S64 causal", "bf16 d128 S128 full", "bf16 d64 varlen causal",
                         "bf16 d64 varlen2 causal"} | (
        {"bf16 d64 S64 paged16 causal", "fp8 d128 S128 paged32 full"} if paged else set())
    for tflops, err in got.values():
        assert tflops > 0 and 0 < err < 2e-2


def test_time_limit_stops_before_a_process_that_would_overrun(monkeypatch, tmp_path, capsys):
    """--time-limit: no wheel's process starts once the time spent plus the longest one so
    far passes the limit; the table then covers the rounds run (here 100 s a process on a
    fake clock: rounds 1 of both wheels and round 2 of the first fit 330 s)."""
    clock = [0.0]
    monkeypatch.setattr(ab.time, "monotonic", lambda: clock[0])

    def fake_run(w, configs, op, tokens, timeout, ncu, config_timeout):
        clock[0] += 100.0
        return {"bf16 d128 S512 full": (400.0 if w == "a" else 440.0, 2e-3)}

    monkeypatch.setattr(ab, "run_wheel", fake_run)
    out_json = tmp_path / "r.json"
    assert ab.main(["a", "b", "--rounds", "3", "--time-limit", "330", "--configs",
                    "bf16:128:512", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "stopped before round 2 of b" in out
    assert out.rstrip().endswith("1.100; 1.100  0.0 0.0")
    assert [len(r) for r in json.loads(out_json.read_text()).values()] == [2, 1]


def test_a_process_past_its_timeout_is_killed_and_its_round_fails(capsys):
    """--wheel-timeout: a wheel whose kernel never ends (its process sleeping here) is
    killed, its round reported as failed, and the comparison goes on."""
    got = ab.run_child("import time\nprint('started', flush=True)\ntime.sleep(60)",
                       dict(os.environ), "a hanging wheel", timeout=2.0)
    assert got == {}
    assert "a hanging wheel killed after 2 s" in capsys.readouterr().err


def test_a_killed_process_takes_its_children_and_says_how_far_it_got(capsys):
    """A process past its timeout is killed with every process it started (as ncu starts
    the Python it profiles), and the message names its last progress line."""
    code = ("import subprocess, sys, time\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"print({ab.PROGRESS!r} + 'bf16 d128 S512 full: started', flush=True)\n"
            "print('kid', kid.pid, file=sys.stderr, flush=True)\n"
            "time.sleep(60)")
    got = ab.run_child(code, dict(os.environ), "a hanging wheel", timeout=3.0)
    assert got == {}
    err = capsys.readouterr().err
    assert "its last progress: bf16 d128 S512 full: started" in err
    kid = int(next(line.split()[1] for line in err.splitlines() if line.startswith("kid ")))
    stat = pathlib.Path(f"/proc/{kid}/stat")
    for _ in range(50):  # gone, or a zombie where nothing reaps it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the hanging process's child outlived it")


NCU_LOG = """==PROF== Connected to process 2546 (/usr/bin/python3.12)
==PROF== Disconnected from process 2546
"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"1","2546","xla_attn_flash_fwd_sm90_bf16_d128_walk","gpu__time_duration.sum","ns","977,280"
"0","2546","xla_attn_flash_fwd_sm90_bf16_d128_walk","gpu__time_duration.sum","ns","975,136"
"0","2546","xla_attn_flash_fwd_sm90_bf16_d128_walk","sm__cycles_elapsed.max","cycle","1,234"
"2","2546","xla_attn_flash_fwd_sm90_vt_pack_f8e4m3","gpu__time_duration.sum","us","1.5"
"""


def test_ncu_log_gives_each_launch_in_order_in_seconds():
    """--ncu: ncu's CSV log (its own lines first, thousands separators, the unit beside
    each value), launches sorted by ID, other metrics left out."""
    got = ab.ncu_launch_seconds(NCU_LOG)
    assert got == pytest.approx([975136e-9, 977280e-9, 1.5e-6])
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ab.ncu_launch_seconds("==PROF== Connected\n")
    with pytest.raises(ValueError, match="'furlong'"):
        ab.ncu_launch_seconds(NCU_LOG.replace('"us"', '"furlong"'))


def test_call_seconds_sum_each_calls_kernels_and_drop_the_first():
    # 3 calls of 2 kernels each: (10 + 1), (20 + 2), (30 + 3); the first is the warm-up
    assert ab.call_seconds([10.0, 1.0, 20.0, 2.0, 30.0, 3.0], 3) == [22.0, 33.0]
    with pytest.raises(ValueError, match="5 kernel launches"):
        ab.call_seconds([1.0] * 5, 3)
    with pytest.raises(ValueError, match="0 kernel launches"):
        ab.call_seconds([], 3)


def fake_ncu(tmp_path, log_rows: str) -> dict:
    """A stand-in for ncu on PATH (the env to run under): it runs the program, notes the
    run and its XLA_FLAGS in LOG.runs, and writes log_rows as ncu's CSV log."""
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir(exist_ok=True)
    (tmp_path / "rows.csv").write_text(log_rows)
    fake.write_text("#!/bin/sh\n"
                    'while [ "$1" != "--log-file" ]; do shift; done\n'
                    'log=$2; shift 2\n"$@" || exit $?\n'
                    'echo "ran $XLA_FLAGS" >> "$log.runs"\n'
                    "{ echo '==PROF== Disconnected'\n"
                    "echo '\"ID\",\"Kernel Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"'\n"
                    f"cat {tmp_path / 'rows.csv'}\n" + '} > "$log"\n')
    fake.chmod(0o755)
    return dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")


@pytest.mark.parametrize("argv, bounds", [
    (["--ncu"], (ab.NCU_BATCH_BOUND[0] + 3 * ab.NCU_BATCH_BOUND[1], ab.NCU_CONFIG_BOUND)),
    (["--ncu", "--wheel-timeout", "75"], (75.0, 75.0)),
    (["--ncu", "--wheel-timeout", "0"], (None, None)),
    ([], (60.0 + 20.0 * 3, None))])
def test_process_bounds(monkeypatch, argv, bounds):
    """The bounds each wheel's processes get: --ncu by default the batched process's
    (base + a config) and each config's own, --wheel-timeout both (0: none); without
    --ncu, 60 + 20 s a config."""
    seen = []
    monkeypatch.setattr(ab.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(ab, "run_wheel", lambda w, configs, op, tokens, timeout, ncu,
                        config_timeout: seen.append((timeout, config_timeout)) or {})
    assert ab.main(["a", "--rounds", "1", "--configs", "bf16:64:512,bf16:128:512,bf16:128:1024",
                    *argv]) == 0
    assert seen == [bounds]


def ncu_rows(kernels: list[str]) -> str:
    """ncu CSV rows: one launch of each kernel, in order, 1 ms each."""
    return "".join(f'"{i}","{k}","{ab.NCU_METRIC}","ns","1,000,000"\n'
                   for i, k in enumerate(kernels))


@pytest.mark.parametrize("batched", [True, False])
def test_ncu_mode_times_each_config_by_its_kernels(tmp_path, capsys, batched):
    """--ncu end to end on the installed package (host path), with a stand-in for ncu
    that logs NCU_CALLS launches of 1 ms a config: each config's figure is its FLOPs over
    1 ms. Batched: one process for both configs, their launches told apart by the marker
    launch after each; where the log has no markers (the other case), a process a config
    after the batched one."""
    pytest.importorskip("jax")
    sys.path.insert(0, str(pathlib.Path(ab.__file__).parent))
    from bench import varlen_flops
    calls = ["xla_attn_k"] * ab.NCU_CALLS
    marker = [f"xla_attn_{ab.MARK_KERNEL}_flash_portable_bf16_bf16"]
    env = fake_ncu(tmp_path, ncu_rows((calls + marker) * 2 if batched else calls))
    configs = ab.parse_configs("bf16:64:64:causal,bf16:128:128", 256)
    got = ab.run_under_ncu(configs, "fwd", 256, env, "the installed package", 120.0, tmp_path,
                           120.0)
    assert set(got) == {"bf16 d64 S64 causal", "bf16 d128 S128 full"}
    assert got["bf16 d64 S64 causal"][0] == pytest.approx(
        varlen_flops([64] * 4, 32, 64, True, False) / 1e-3 / 1e12)
    assert got["bf16 d128 S128 full"][0] == pytest.approx(
        varlen_flops([128] * 2, 16, 128, False, False) / 1e-3 / 1e12)
    assert all(0 < err < 2e-2 for _, err in got.values())
    # XLA's autotuning off in each process (ncu serialises its launches)
    runs = (tmp_path / "ncu.csv.runs").read_text().splitlines()
    assert len(runs) == (1 if batched else 3)
    assert all(r.startswith("ran") and r.endswith("--xla_gpu_autotune_level=0") for r in runs)
    # each config's time as it comes, for a run a time bound cuts short
    err = capsys.readouterr().err
    assert "bf16 d64 S64 causal: 1000.0 us a call" in err
    assert "bf16 d128 S128 full: 1000.0 us a call" in err
    assert ("one process for all configs failed" in err) != batched


@pytest.mark.parametrize("family, expected", [
    ("sm80", "sm80,portable"), ("sm90,sm80", "sm90,sm80,portable"),
    ("sm80,portable", "sm80,portable"), ("", ""), (None, None)])
def test_a_forced_family_keeps_the_markers_portable_kernel(family, expected):
    env = {"PATH": "/bin"} if family is None else {"XLA_ATTN_FORCE_FAMILY": family}
    assert ab.marker_env(env).get("XLA_ATTN_FORCE_FAMILY") == expected


def test_split_at_marks_needs_a_mark_after_each_config():
    mark = f"xla_attn_{ab.MARK_KERNEL}_x"
    launches = [("a", 1.0), ("b", 2.0), (mark, 9.0), ("a", 3.0), (mark, 9.0)]
    assert ab.split_at_marks(launches, 2) == [[1.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match="2 marker launches .* for 3 configs"):
        ab.split_at_marks(launches, 3)
    with pytest.raises(ValueError, match="launches after the last"):
        ab.split_at_marks(launches + [("a", 1.0)], 2)


def test_ncu_mode_needs_ncu(monkeypatch, capsys):
    monkeypatch.setattr(ab.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        ab.main(["a", "--ncu"])
    assert "ncu is not on PATH" in capsys.readouterr().err


def test_a_process_that_crashes_is_killed_after_a_grace_not_its_bound(monkeypatch, capsys):
    """A child whose stderr says it crashed (as ncu's does where the Python it profiles
    segfaults, then stays) is killed CRASH_GRACE_S later, not at its process bound."""
    monkeypatch.setattr(ab, "CRASH_GRACE_S", 1.0)
    code = ("import sys, time\n"
            f"print({ab.PROGRESS!r} + 'bf16 d128 S512 causal: started', flush=True)\n"
            f"print({ab.CRASH_MARK!r}, file=sys.stderr, flush=True)\n"
            "time.sleep(60)")
    t0 = time.monotonic()
    got = ab.run_child(code, dict(os.environ), "a crashed wheel", timeout=50.0)
    assert got == {} and time.monotonic() - t0 < 20
    err = capsys.readouterr().err
    assert "a crashed wheel crashed (Segmentation fault)" in err
    assert "its last progress: bf16 d128 S512 causal: started" in err


def test_a_process_that_ends_by_itself_after_a_crash_line_is_read_as_usual():
    """A crash line from a child that then ends by itself is no kill: its RESULT stands."""
    code = ("import sys\n"
            f"print({ab.CRASH_MARK!r} + ' (of something else)', file=sys.stderr, flush=True)\n"
            "print('RESULT {\"bf16 d128 S512 full\": [1.0, 0.0]}', flush=True)")
    assert ab.run_child(code, dict(os.environ), "w", timeout=30.0) == {
        "bf16 d128 S512 full": (1.0, 0.0)}


@pytest.mark.parametrize("ignores, ends_on", [((), "SIGINT"), (("SIGINT",), "SIGTERM"),
                                              (("SIGINT", "SIGTERM"), "SIGKILL")])
def test_a_group_is_stopped_by_sigint_first_then_sigterm_then_sigkill(tmp_path, ignores,
                                                                      ends_on):
    """stop_group asks first (SIGINT: ncu's own cleanup and exit), and kills only a group
    that stays past each signal's grace."""
    ready = tmp_path / "ready"
    code = ("import pathlib, signal, sys, time\n"
            "for name in sys.argv[1:]:\n"
            "    signal.signal(getattr(signal, name), signal.SIG_IGN)\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, *ignores], start_new_session=True)
    while not ready.exists():
        time.sleep(0.02)
    t0 = time.monotonic()
    ab.stop_group(proc, grace=1.0)
    assert proc.returncode == -getattr(signal, ends_on)
    assert time.monotonic() - t0 < 1.0 * len(ignores) + 1.0


def test_stopping_a_group_that_has_ended_is_no_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    ab.stop_group(proc, grace=0.1)
