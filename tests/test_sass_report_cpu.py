"""tools/sass_report.py's parsers on hand-written cuobjdump and ptxas text (the tool
itself needs NVRTC, ptxas and cuobjdump; these parts need nothing)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import sass_report as sr  # noqa: E402

SASS = """
        code for sm_90
                Function : kern_a
        /*0000*/                   LDSM.16.M88.4 R8, [R2] ;                 /* 0x000000000208783b */
        /*0010*/                   HMMA.16816.F32.BF16 R20, R4, R10, RZ ;   /* 0x0000000a0414723c */
        /*0020*/                   MUFU.EX2 R3, R3 ;                        /* 0x0000000300037308 */
        /*0030*/                   IADD3 R1, R1, 0x1, RZ ;                  /* 0x0000000101017810 */
        /*0040*/                   IADD3 R1, R1, 0x1, RZ ;                  /* 0x0000000101017810 */
        /*0050*/                   HMMA.16816.F32.BF16 R24, R8, R30, R24 ;  /* 0x0000001e0818723c */
        /*0060*/              @!P0 STL [R1], R5 ;                           /* 0x0000000501008387 */
                Function : kern_b
        /*0000*/                   HMMA.16816.F32.BF16 R20, R4, R6, RZ ;    /* 0x000000060414723c */
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;            /* 0x0000000000007b1d */
"""

PTXAS = """ptxas info    : Compiling entry function 'kern_a' for 'sm_90'
ptxas info    : Function properties for kern_a
    40 bytes stack frame, 40 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 40 bytes cumulative stack size
ptxas info    : Compiling entry function 'kern_b' for 'sm_90'
ptxas info    : Function properties for kern_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
"""


def test_kernels_and_opcodes():
    kernels = sr.kernels_of(SASS)
    assert list(kernels) == ["kern_a", "kern_b"]
    assert [sr.opcode(x) for x in kernels["kern_a"]] == [
        "LDSM", "HMMA", "MUFU", "IADD3", "IADD3", "HMMA", "STL"]
    assert [sr.opcode(x) for x in kernels["kern_b"]] == ["HMMA", "BAR"]


def test_near_hmma_counts_operands_an_ldsm_just_wrote():
    ins = sr.kernels_of(SASS)["kern_a"]
    # HMMA 1 reads R10 (LDSM's R8..R11) one instruction later; HMMA 2 reads R8 five later
    assert sr.near_hmma(ins, 6) == 2
    assert sr.near_hmma(ins, 5) == 1
    assert sr.near_hmma(ins, 1) == 0
    assert sr.near_hmma(sr.kernels_of(SASS)["kern_b"], 6) == 0  # no LDSM at all


def test_count_gmma_takes_every_wgmma_kind():
    ops = [sr.opcode(x) for x in ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;",
                                  "QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR24], RZ, !UPT ;",
                                  "HMMA.16816.F32.BF16 R20, R4, R10, RZ ;",
                                  "WARPGROUP.ARRIVE ;")]
    assert sr.count_gmma(ops) == 2


def test_local_in_gmma_span_counts_spills_between_products():
    ops = [sr.opcode(x) for x in ("STL [R1], R5 ;",                       # before: not counted
                                  "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;",
                                  "LDL R12, [R1+0x8] ;",
                                  "@!P0 STL [R1+0x4], R3 ;",
                                  "QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR24], RZ, !UPT ;",
                                  "LDL.LU R2, [R1] ;")]                   # after: not counted
    assert sr.local_in_gmma_span(ops) == 2
    assert sr.local_in_gmma_span(["LDL", "STL", "HMMA"]) == 0  # no wgmma: no span


def test_ptxas_notes_keep_warnings_and_wgmma_notes_only():
    log = ("ptxas info    : Compiling entry function 'k'\n"
           "ptxas info    : (C7517) warpgroup.wait is injected in around line 12 by compiler\n"
           "ptxas info    : Used 168 registers\n"
           "ptxas warning : Registers are spilled to local memory in function 'k'\n")
    assert sr.ptxas_notes(log) == [
        "ptxas info    : (C7517) warpgroup.wait is injected in around line 12 by compiler",
        "ptxas warning : Registers are spilled to local memory in function 'k'"]
    assert sr.ptxas_notes("ptxas info    : Used 40 registers\n") == []


def test_ptxas_info():
    assert sr.ptxas_info(PTXAS) == {"kern_a": (255, 40, 64), "kern_b": (96, 0, 0)}


def test_against_marks_same_changed_and_new_kernels():
    before = sr.kernels_of(SASS)
    # the same kernel printed with other spacing (another build's column widths) is "="
    respaced = {name: ["  ".join(x.split()) for x in ins] for name, ins in before.items()}
    assert sr.against_mark("kern_a", respaced["kern_a"], before) == "="
    changed = list(before["kern_a"])
    changed[2] = "MUFU.RCP R3, R3"
    # changed, the opcode sequence alike (MUFU either way): "~1.00"; one instruction of
    # kern_b's two left: 2 x 1 matched / 3 = "~0.67"
    assert sr.against_mark("kern_a", changed, before) == "~1.00"
    n = len(before["kern_b"])
    assert sr.against_mark("kern_b", before["kern_b"][:1], before) == f"~{2 / (n + 1):.2f}"
    assert sr.against_mark("kern_c", before["kern_b"], before) == "+"
    assert sr.against_mark("kern_a", before["kern_a"], None) == ""


# nvdisasm --print-line-info -c of a -lineinfo cubin (two kernels; addresses past 0xffff)
LISTING = """
//--------------------- .text.kern_b --------------------------
.text.kern_b:
	//## File "/src/x.cu", line 3
        /*0000*/                   NOP ;
//--------------------- .text.kern_a --------------------------
	.section	.text.kern_a,"ax",@progbits
.text.kern_a:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "{root}/kernels/common/vec.cuh", line 47
        /*fff0*/                   MUFU.EX2 R3, R3 ;
        /*10000*/              @!P0 BRA `(.L_x_9) ;
.L_x_9:
	//## File "/other/place.h", line 9
        /*10010*/                   EXIT ;
"""


def test_source_lines_follow_the_kernel_and_its_line_markers():
    listing = LISTING.replace("{root}", str(sr.bk.KERNELS.parent))
    assert sr.source_lines(listing, "kern_a") == [
        ("LDC R1, c[0x0][0x28]", "", 0),  # before the first marker
        ("MUFU.EX2 R3, R3", "kernels/common/vec.cuh", 47),  # relative to the repository
        ("@!P0 BRA `(.L_x_9)", "kernels/common/vec.cuh", 47),
        ("EXIT", "/other/place.h", 9)]
    assert sr.source_lines(listing, "kern_b") == [("NOP", "/src/x.cu", 3)]
    assert sr.source_lines(listing, "kern_c") == []
