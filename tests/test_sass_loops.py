"""scripts/sass_loops.py's parsing of cuobjdump SASS (no toolkit needed): the innermost loop
around a wgmma, its instructions by opcode, and how alike two builds order them."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "sass_loops.py")
_spec = importlib.util.spec_from_file_location("sass_loops", _PATH)
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)


def _sass(lines):
    """cuobjdump's layout: address comment, instruction, encoding comment, blank lines between."""
    return "\n".join(f"        /*{a:04x}*/                   {t} ;   /* 0x000 */\n" for a, t in lines)


FUNCTION = _sass([
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "IMAD R1, R0, 0x4, RZ"),           # an outer loop's body starts here
    (0x20, "@!P0 IMAD.WIDE R2, R1, 0x2, R4"),  # the inner loop: 0x20-0x60
    (0x30, "WARPGROUP.ARRIVE"),
    (0x40, "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24"),
    (0x50, "MUFU.EX2 R5, R6"),
    (0x60, "@!P1 BRA 0x20"),
    (0x70, "IADD3 R7, R7, 0x1, RZ"),
    (0x80, "@P2 BRA 0x10"),                   # the outer loop, around the inner one
    (0x90, "LOP3.LUT R8, R8, 0x3, RZ, 0xc0, !PT"),  # a loop without a wgmma: 0x90-0xa0
    (0xa0, "@P3 BRA 0x90"),
    (0xb0, "EXIT"),
])


def test_innermost_loop_around_the_wgmma():
    instructions = sass_loops.parse(FUNCTION)
    assert len(instructions) == 12
    assert sass_loops.main_loop(instructions) == (0x20, 0x60)
    assert sass_loops.loop_counts(FUNCTION) == {"IMAD": 1, "WARPGROUP": 1, "HGMMA": 1, "MUFU": 1, "BRA": 1}


def test_no_loop_around_a_wgmma():
    assert sass_loops.loop_counts(_sass([(0x0, "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24"),
                                         (0x10, "@P3 BRA 0x10"), (0x20, "EXIT")])) is None


def test_opcode_and_functions():
    assert sass_loops.opcode("@!UP0 IMAD.WIDE.U32 R2, R3, 0x4, RZ") == "IMAD"
    assert sass_loops.opcode("F2FP.BF16.F32.PACK_AB R1, R2, R3") == "F2FP"
    dump = "header\n\t\tFunction : _Z1fv\n" + FUNCTION + "\n\t\tFunction : _Z1gv\n" + _sass([(0, "EXIT")])
    assert list(sass_loops.functions(dump)) == ["_Z1fv", "_Z1gv"]


def test_loop_order_against_another_build():
    ops = sass_loops.loop_opcodes(FUNCTION)
    assert ops == ["IMAD", "WARPGROUP", "HGMMA", "MUFU", "BRA"]
    # the same instructions, the exponent moved before the product: 4 of 5 in order
    moved = _sass([(0x00, "@!P0 IMAD.WIDE R2, R1, 0x2, R4"), (0x10, "WARPGROUP.ARRIVE"), (0x20, "MUFU.EX2 R5, R6"),
                   (0x30, "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24"), (0x40, "@!P1 BRA 0x0")])
    theirs = sass_loops.loop_opcodes(moved)
    assert sorted(theirs) == sorted(ops)
    assert sass_loops.order_likeness(ops, ops) == 1.0
    assert sass_loops.order_likeness(ops, theirs) == 0.8
