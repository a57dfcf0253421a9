"""tools/peer_table.py without a GPU: the table of record from a bench.py JSON, the faster
cuDNN taken cell by cell, missing figures as n/a."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

import peer_table  # noqa: E402


def ok(v):
    return {"status": "ok", "value": v}


def dense(d, s, causal, mode, **cells):
    return {"kind": "dense", "params": {"head_dim": d, "seqlen": s, "causal": causal,
                                        "mode": mode},
            "cells": {k.replace("_", "-"): (ok(v) if v is not None else {"status": "error"})
                      for k, v in cells.items()}}


ROWS = [
    dense(64, 512, False, "fwd", ours=300.0, torch_cudnn=400.0, jax_cudnn=250.0,
          ours_fp8=330.0),
    dense(64, 512, False, "fwd+bwd", ours=200.0, torch_cudnn=150.0, jax_cudnn=250.0),
    dense(64, 1024, False, "fwd", ours=360.0, torch_cudnn=None, jax_cudnn=300.0),
    dense(64, 512, True, "fwd", ours=None, torch_cudnn=200.0, jax_cudnn=100.0),
    {"kind": "varlen", "params": {"mode": "fwd"}, "best_peer": "jax-cudnn-packed",
     "cells": {"ours": ok(450.0), "jax-cudnn-packed": ok(360.0)}},
]


def test_ratios_take_the_faster_cudnn_in_each_cell():
    t = peer_table.dense_ratios(ROWS)
    assert t[(64, "full")][512] == [300.0 / 400.0, 200.0 / 250.0]
    assert t[(64, "full")][1024] == [360.0 / 300.0, None]  # (the torch peer failed)
    assert t[(64, "causal")][512] == [None, None]  # (ours failed)
    assert peer_table.fp8_ratios(ROWS) == {(64, "full"): {512: 1.1}}


def test_markdown_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": ROWS}))
    assert peer_table.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| row | S=512 | 1024 |"
    assert lines[2] == "| d64 full | 0.75 / 0.80 | 1.20 / n/a |"
    assert lines[3] == "| d64 causal | n/a / n/a | n/a / n/a |"
    assert "- fp8 / our bf16, d64 full: S=512 1.10" in lines
    assert "- varlen fwd: ours 450 TFLOP/s, 1.25x jax-cudnn-packed (360)" in lines
