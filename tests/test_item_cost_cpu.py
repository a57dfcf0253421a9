"""tools/item_cost.py: the fit of an item's start and end from rates at several lengths."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import item_cost as ic  # noqa: E402

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def rates(r: float, x: float, lengths=LENGTHS) -> list[tuple[float, float]]:
    return [(s / 128, r * (s / 128) / (s / 128 + x)) for s in lengths]


@pytest.mark.parametrize("r,x", [(593.0, 2.33), (504.0, 0.59), (700.0, 0.0), (300.0, 7.5)])
def test_fit_recovers_the_model_it_was_made_from(r, x):
    got_r, got_x, miss = ic.fit(rates(r, x))
    assert got_r == pytest.approx(r, rel=1e-3)
    assert got_x == pytest.approx(x, abs=2e-3)
    assert miss < 1e-3


def test_fit_reports_its_worst_miss():
    points = rates(600.0, 2.0)
    points[0] = (points[0][0], points[0][1] * 1.1)  # one length 10 % off the model
    assert ic.fit(points)[2] > 0.02


def bench_row(d, s, causal, mode, cells):
    return {"kind": "dense", "params": {"head_dim": d, "seqlen": s, "causal": causal,
                                        "mode": mode},
            "cells": {name: {"role": role, "status": "ok", "value": value}
                      for name, (role, value) in cells.items()}}


def test_bench_rows_fit_each_implementation_and_compare_tiles(tmp_path, capsys):
    rows = []
    for (n, ours), (_, peer) in zip(rates(593.0, 2.33), rates(504.0, 0.59)):
        s = int(n * 128)
        rows.append(bench_row(128, s, False, "fwd", {"torch-cudnn": ("peer", peer),
                                                     "ours": ("ours", ours)}))
        rows.append(bench_row(128, s, True, "fwd", {"ours": ("ours", 1.0)}))  # causal: out
        if s <= 1024:  # two lengths: too few to fit
            rows.append(bench_row(128, s, False, "fwd+bwd", {"ours": ("ours", 2.0)}))
    rows.append({"kind": "varlen", "params": {}, "cells": {}})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    groups = ic.series_from_bench(json.loads(path.read_text()), "fwd")
    assert list(groups) == ["d128/fwd"] and list(groups["d128/fwd"]) == ["ours", "torch-cudnn"]
    assert ic.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    ours, peer = (line.split() for line in out[1:3])
    assert ours[1] == "ours" and float(ours[4]) == pytest.approx(2.33, abs=0.01)
    assert peer[1] == "torch-cudnn" and float(peer[4]) == pytest.approx(0.59, abs=0.01)
    # cuDNN's 0.59 of its own tiles, which run 593 / 504 times ours: 0.69 of ours
    assert float(peer[5]) == pytest.approx(0.59 * 593 / 504, abs=0.01)
    assert ic.main([str(path), "--mode", "fwd+bwd"]) == 1
    assert "no group" in capsys.readouterr().out


def test_ab_wheels_json_takes_each_wheels_best_round(tmp_path, capsys):
    first = {f"bf16 d128 S{int(n * 128)} full": [rate, 2e-3] for n, rate in rates(593.0, 2.33)}
    slow = {k: [v[0] * 0.9, v[1]] for k, v in first.items()}
    first["bf16 d128 S512 causal"] = [100.0, 2e-3]  # causal: left out
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"dist/base": [slow, first], "dist/try": [first]}))
    groups = ic.series_from_ab(json.loads(path.read_text()))
    assert list(groups) == ["bf16/d128"]
    assert sorted(groups["bf16/d128"]["dist/base"]) == sorted(rates(593.0, 2.33))
    assert ic.main([str(path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
