"""tools/ncu_ops.py on a hand-written Nsight Compute source-page export (the tool reads
CSV only; profiling needs a GPU, this needs nothing)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import ncu_ops  # noqa: E402

EXPORT = '''"Kernel Name","kern_x",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed"
"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT","5","4","5","1,024"
"0x20","@!P0  BRA 0x7f00","30","20","30","2,048"
"0x30","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR39+0x38030], R2","60","50","60","512"
"0x38","@!P0  BRA 0x7f10","40","40","40","512"
"0x40","MUFU.EX2 R3, R3","3","2","3","4,096"
"0x50","MUFU.EX2 R4, R4","2","1","2","4,096"
"0x60","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR24+0x38050], R9","0","0","0","0"
"0x68","@!P2  BRA 0x7f20","7","7","7","8"
"0x70","@P3   FADD R8, R8, R21","0","0","0","1,000"
'''


def test_sums_by_opcode_and_waits(tmp_path):
    path = tmp_path / "rep.csv"
    path.write_text(EXPORT)
    prof = ncu_ops.read(str(path))
    assert prof.kernel == "kern_x"
    assert prof.executed == {"HGMMA": 1024, "BRA": 2568, "SYNCS": 512, "MUFU": 8192, "FADD": 1000}
    assert prof.stalls["MUFU"] == 5 and prof.stalls["SYNCS"] == 60 and prof.stalls["BRA"] == 77
    # the first wait's retry branch (@!P0 after TRYWAIT P0) counts as that wait; the
    # second's branch tests another predicate and does not
    assert prof.waits == {"UR39+0x38030": 100, "UR24+0x38050": 0}
    lines = ncu_ops.report(prof, top=2, waits=1).splitlines()
    assert lines[0] == "kern_x: 1.33e+04 instructions executed, 147 stall samples"
    assert [line.split()[0] for line in lines[1:3]] == ["MUFU", "BRA"]
    # classes by stall samples: branches 77, barriers 60, tensor cores 5, exponentials 5
    classes = [line.split("]")[0].strip(" [") for line in lines[3:-1]]
    assert classes[:2] == ["branches, EXIT", "barriers"]
    assert set(classes) == {"branches, EXIT", "barriers", "tensor cores (HGMMA, DEPBAR)",
                            "exponentials (MUFU)", "FP32 and packing"}
    mufu = next(line for line in lines if "[exponentials (MUFU)]" in line)
    assert "61.6 % executed" in mufu and "stalls   3.4 %" in mufu  # 8192 / 13296, 5 / 147
    assert lines[-1].startswith("  wait [UR39+0x38030]") and "68.0 %" in lines[-1]


@pytest.mark.parametrize("sass, op", [("@!P0  BRA 0x1", "BRA"), ("@UP0  UIADD3 UR8, UR4", "UIADD3"),
                                      ("@PT FFMA R1, R2, R3, R4", "FFMA"),
                                      ("WARPGROUP.DEPBAR.LE gsb0, 0x0", "WARPGROUP")])
def test_opcode(sass, op):
    assert ncu_ops.opcode(sass) == op


def test_rejects_other_exports(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Kernel Name","Metric Name"\n"0","k","Duration"\n')
    with pytest.raises(ValueError, match="no 'Address' header"):
        ncu_ops.read(str(path))
    path.write_text('"Address","Source","# Samples"\n"0x10","NOP","1"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        ncu_ops.read(str(path))


def test_line_report_sums_by_source_line():
    # (SASS, executed, stall samples) in address order, and where a -lineinfo build puts each
    prof = ncu_ops.Profile(kernel="k", rows=[
        ("MUFU.EX2 R3, R3", 100, 30), ("IADD3 R1, R1, 0x1, RZ", 300, 5),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 10, 40),
        ("@!P0  BRA 0x7f10", 10, 20), ("UIADD3 UR4, UR4, 0x8, URZ", 580, 5)])
    lines = [(sass, path, line) for (sass, _, _), (path, line) in zip(prof.rows, [
        ("vec.cuh", 47), ("walk.cuh", 56), ("tma.cuh", 62), ("tma.cuh", 62), ("walk.cuh", 56)])]
    text = ncu_ops.line_report(prof, lines, top=2).splitlines()
    # stalls: tma.cuh:62 60 of 100, vec.cuh:47 30, walk.cuh:56 10 (not in the top 2)
    assert text[1].split() == ["60.0", "%", "stalls", "2.0", "%", "executed", "tma.cuh:62"]
    assert text[2].split() == ["30.0", "%", "stalls", "10.0", "%", "executed", "vec.cuh:47"]
    # integer / uniform instructions: walk.cuh:56's IADD3 and UIADD3, 880 of 1000
    assert text[3].endswith("the 2 with the most integer, uniform, moves executed")
    assert text[4].split() == ["88.0", "%", "executed", "10.0", "%", "stalls", "walk.cuh:56"]
    assert len(text) == 5  # no other line ran an integer instruction


def test_line_report_refuses_other_code(tmp_path):
    path = tmp_path / "rep.csv"
    path.write_text(EXPORT)
    prof = ncu_ops.read(str(path))
    lines = [("NOP", "k.cuh", 1)] + [(sass, "k.cuh", 1) for sass, _, _ in prof.rows[1:]]
    with pytest.raises(ValueError, match="1 of 9 instructions differ"):
        ncu_ops.line_report(prof, lines, top=2)


def test_lines_needs_a_module_of_the_build(tmp_path, capsys):
    path = tmp_path / "rep.csv"
    path.write_text(EXPORT)
    with pytest.raises(SystemExit):
        ncu_ops.main([str(path), "--lines", "no_such_module"])
    assert "--lines: module must be one of" in capsys.readouterr().err


def test_ops_report_sums_chosen_opcodes_by_line():
    prof = ncu_ops.Profile(kernel="k", rows=[
        ("LDS R1, [R2]", 400, 3), ("IMAD R4, R1, R5, RZ", 100, 1), ("LDS R6, [R2+0x8]", 250, 2),
        ("FADD R7, R7, R8", 900, 1), ("LDS.128 R8, [R3]", 50, 0)])
    lines = [(sass, path, line) for (sass, _, _), (path, line) in zip(prof.rows, [
        ("walk.cuh", 10), ("walk.cuh", 10), ("walk.cuh", 12), ("vec.cuh", 5), ("walk.cuh", 10)])]
    text = ncu_ops.ops_report(prof, lines, ["LDS", "IMAD"], top=3).splitlines()
    assert text[0] == "k: the 3 (opcode, source line) pairs of LDS, IMAD by instructions executed"
    # LDS at walk.cuh:10 is 400 + 50 (LDS.128 is LDS); FADD is not asked for
    assert [t.split() for t in text[1:]] == [["LDS", "450", "walk.cuh:10"],
                                             ["LDS", "250", "walk.cuh:12"],
                                             ["IMAD", "100", "walk.cuh:10"]]
    other = [(sass, "x.cuh", 1) for sass, _, _ in prof.rows[:-1]] + [("NOP", "x.cuh", 2)]
    with pytest.raises(ValueError, match="not the profiled kernel's"):
        ncu_ops.ops_report(prof, other, ["LDS"], top=3)


def test_per_report_puts_files_side_by_side(tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(EXPORT)
    # the same kernel with twice the FADDs and one MUFU line less
    b.write_text(EXPORT.replace('"1,000"', '"2,000"').replace(
        '"0x50","MUFU.EX2 R4, R4","2","1","2","4,096"\n', ""))
    lines = ncu_ops.per_report([ncu_ops.read(str(a)), ncu_ops.read(str(b))], "MUFU",
                               top=2).splitlines()
    assert lines[0].startswith("instructions executed per MUFU: #1 kern_x, #2 kern_x")
    assert lines[1].split() == ["opcode", "#1", "#2"]
    # all: 13296 / 8192 and 10200 / 4096; then MUFU, BRA by their shares of each total
    assert lines[2].split() == ["all", "1.62", "2.49"]
    assert lines[3].split() == ["MUFU", "1.00", "1.00"]
    assert lines[4].split() == ["BRA", "0.31", "0.63"]
    with pytest.raises(ValueError, match="executed no LDS"):
        ncu_ops.per_report([ncu_ops.read(str(a))], "LDS", top=2)
    with pytest.raises(SystemExit):
        ncu_ops.main([str(a), "--per", "LDS"])
    assert "--per: kern_x executed no LDS" in capsys.readouterr().err


def test_by_count_groups(tmp_path):
    """--by-count: instructions that ran equally often form a group (the two MUFU, 4,096
    times each; the try-wait and its retry branch, 512 each), ordered by stall samples."""
    path = tmp_path / "rep.csv"
    path.write_text(EXPORT)
    lines = ncu_ops.count_report(ncu_ops.read(str(path)), top=3).splitlines()
    assert lines[0].startswith("kern_x: instructions by times executed, the 3 groups")
    # 512: 60 + 40 of 147 samples, 2 x 512 of 13,296 executed; then 2,048 (30); then
    # 8 (7 samples) ahead of 1,024 and 4,096 (5 each)
    assert lines[1].split() == ["512", "times:", "2", "instructions", "(#2..#3)", "stalls",
                                "68.0", "%", "executed", "7.7", "%"]
    assert lines[2].split()[:5] == ["2,048", "times:", "1", "instructions", "(#1..#1)"]
    assert lines[3].split()[:5] == ["8", "times:", "1", "instructions", "(#7..#7)"]
    assert len(lines) == 4
    assert "--by-count" in ncu_ops.__doc__
