"""scripts/sass_loops.py: the innermost loops of a kernel's SASS, counted by opcode; on a
hand-written listing, and on the packed MLA kernel compiled for sm_90 without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.sass_loops import innermost_loops, mma_shapes

# An outer loop (.L_x_0 .. 0x0090) around an inner one (.L_x_1 .. 0x0070), then a two-
# instruction spin-wait: nvdisasm -c's layout, predicates and modifiers included.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS.U8 R2, [R3] ;
.L_x_1:
        /*0020*/                   LDS.U8 R4, [R3+0x1] ;
        /*0030*/                   F2FP.F16.E4M3.UNPACK_B R5, R4 ;
        /*0040*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0050*/                   HMMA.16816.F32 R8, R12, R18, R8 ;
        /*0060*/               @P0 IADD3 R3, R3, 0x2, RZ ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   IMAD R6, R6, 0x2, RZ ;
        /*0090*/              @!P1 BRA `(.L_x_0) ;
.L_x_2:
        /*00a0*/                   SYNCS.PHASECHK.TRANS64 P2, [UR4], R0 ;
        /*00b0*/              @!P2 BRA `(.L_x_2) ;
        /*00c0*/                   EXIT ;
"""


# A tile loop with a conditional block (a partial tile's pass) and a rescale that a
# conditional branch skips: the straight path leaves both out, the whole count keeps them.
BRANCHY = """
.L_x_0:
        /*0000*/                   LDS.128 R4, [R3] ;
        /*0010*/               @P1 BRA `(.L_x_1) ;
        /*0020*/                   STS.128 [R3], RZ ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0040*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0050*/              @!P0 BRA `(.L_x_2) ;
        /*0060*/                   FMUL R8, R8, R20 ;
.L_x_2:
        /*0070*/                   F2FP.F16.E4M3.UNPACK_B R5, R4 ;
        /*0080*/              @!P2 BRA `(.L_x_0) ;
"""


def test_straight_path_leaves_out_conditional_blocks():
    (loop,) = innermost_loops(BRANCHY, min_size=2)
    assert loop.size == 9 and loop.ops["STS"] == 1 and loop.ops["FMUL"] == 1
    assert sum(loop.straight.values()) == 6
    assert "STS" not in loop.straight and "FMUL" not in loop.straight and "BAR" not in loop.straight
    assert loop.summary().startswith("9 instructions") and "straight path 6" in loop.summary()


def test_innermost_loops_keep_the_inner_loop_and_count_opcodes():
    loops = innermost_loops(LISTING, min_size=2)
    inner = loops[0]
    assert (inner.start, inner.end) == (0x20, 0x70)
    assert inner.ops == {"LDS": 1, "F2FP": 1, "HMMA": 2, "IADD3": 1, "BRA": 1}
    assert inner.summary(top=2) == "6 instructions (HMMA 2, LDS 1)"
    # the spin-wait is a loop too; the outer loop holds the inner one and is left out
    assert [(x.start, x.end) for x in loops] == [(0x20, 0x70), (0xA0, 0xB0)]
    assert [(x.start, x.end) for x in innermost_loops(LISTING, min_size=3)] == [(0x20, 0x70)]


# Warpgroup MMAs as nvdisasm -c writes them: 32-key scores over a query chunk, a predicated
# one, and a 256-column product; an HMMA and instructions whose names hold "MMA" elsewhere.
WARPGROUP = """
        /*0100*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0110*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0120*/               @P0 HGMMA.64x32x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0130*/                   WARPGROUP.ARRIVE ;
        /*0140*/                   HGMMA.64x256x16.F32.BF16 R40, R8, gdesc[UR16], R40 ;
        /*0150*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0160*/                   MOV R1, c[0x0][0x28] ;
"""


def test_mma_shapes_count_each_shape_apart():
    assert mma_shapes(WARPGROUP) == {
        "HGMMA.64x32x16.F32.BF16": 3,
        "HGMMA.64x256x16.F32.BF16": 1,
        "HMMA.16816.F32": 1,
    }
    assert mma_shapes(BRANCHY) == {"HMMA.16816.F32": 1}


def test_the_fp8_tile_loop_widens_and_multiplies():
    """The packed MLA kernel at 16 heads with an fp8 cache (one token, TMA tiles), compiled
    for sm_90 by the venv's Triton through gluon_sm90_check's compile-only driver: its
    loops over key tiles carry the tensor-core MMAs and the fp8 widening."""
    root = Path(__file__).parents[1]
    code = (
        "from triton.runtime import driver\n"
        "from scripts.gluon_sm90_check import CompileOnlyDriver, compile_triton_case\n"
        "from scripts.sass_loops import disassemble, innermost_loops\n"
        "from atom_plugin.attention.mla import triton_kernels as K\n"
        "driver.set_active(CompileOnlyDriver())\n"
        "compile_triton_case(16, 1, True, 2, {'kernel': 'packed', 'tma': True})\n"
        "for k in K._mla_decode_stage1.device_caches[0][0].values():\n"
        "    for loop in innermost_loops(disassemble(k.asm['cubin'])):\n"
        "        print(sorted(loop.ops.items()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    loops = [dict(eval(line)) for line in proc.stdout.splitlines() if line.startswith("[")]
    tiles = [ops for ops in loops if ops.get("HMMA")]
    assert tiles, proc.stdout
    assert all(ops.get("F2FP") for ops in tiles)
