"""Compile the Gluon MLA kernels for sm_90 on a machine without a GPU, through the real
launcher (`gluon_mla.run_stage1`), and print each kernel's shared memory, registers and
spills as ptxas reports them.

Gluon kernels do not run in Triton's CPU interpreter, and the H200 is lent by the
half hour: this catches compile errors, shared memory past the 227 KB an SM grants and
register spills before a GPU run. It needs the Triton the GPU machine has (3.6; the
project's CPU venv has a newer one whose Gluon API differs), e.g.

    python3.11 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/t36/lib/python3.11/site-packages/zz.pth
    /tmp/t36/bin/python scripts/gluon_sm90_check.py [--ptx DIR]

`--ptx DIR` writes each compiled variant's instructions: a refactor of a kernel whose
instructions come out the same (`diff -r` of two such folders) changes nothing the GPU runs.

The stand-in driver below answers the compiler's questions (device 0, target sm_90);
the launch that follows a compile fails without a GPU, which is expected.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from atom_plugin.backends import gluon_mla, gluon_mla_alternate  # noqa: E402
from atom_plugin.backends.triton_mla import TritonMLALaunch  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one CTA may take on an H100 / H200


class CompileOnlyDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def ptxas_report(ptx: str) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run(
        [ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(f.name)
    keep = ("registers", "spill", "error")
    return "; ".join(
        line.split(":", 1)[-1].strip()
        for line in out.stderr.splitlines()
        if any(k in line for k in keep)
    )


PACKINGS = ((64, 1), (32, 2), (16, 4))  # (heads, query tokens) a program's 64 rows hold
CASES = (
    ("lockstep", torch.bfloat16),
    ("lockstep", torch.float8_e4m3fn),
    ("alternate", torch.bfloat16),
)


def compile_case(schedule: str, cache_dtype: torch.dtype, block_h: int, tokens: int):
    cache = torch.zeros(8, 64, 576, dtype=cache_dtype)
    q = torch.zeros(4, 128, 576, dtype=torch.bfloat16)
    table = torch.zeros(4, 8, dtype=torch.int32)
    qsl = torch.zeros(5, dtype=torch.int32)
    kv_len = torch.zeros(4, dtype=torch.int32)
    mid_o, mid_lse = torch.zeros(4, 128, 2, 512), torch.zeros(4, 128, 2)
    fp8 = cache_dtype != torch.bfloat16
    launch = TritonMLALaunch(
        "gluon", block_h, tokens, 1, 2, 2, 64, 8, 2, True, fp8, True, 512, schedule=schedule
    )
    try:
        gluon_mla.run_stage1(
            q, cache, table, qsl, 4, kv_len, mid_o, mid_lse, torch.ones(1), 0.1, launch, 512
        )
    except AttributeError as exc:  # the launch, after the compile
        if "launcher" not in str(exc):
            raise


def instructions(ptx: str) -> str:
    """The PTX without what only source positions change: `.loc` / `.file` lines, the
    DWARF data (from its first `.b8` directive) and the `$L__tmp` labels only that data
    refers to."""
    code = re.split(r"^\s*\.b8 ", ptx, maxsplit=1, flags=re.M)[0]
    drop = re.compile(r"\s*\.(loc|file)\b|\$L__tmp\d+:$")
    return "\n".join(line for line in code.splitlines() if not drop.match(line))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--ptx",
        help="write each variant's instructions here (`instructions`), to diff a refactor's",
    )
    args = p.parse_args(argv)
    if triton.__version__.split(".")[:2] != ["3", "6"]:
        print(f"warning: Triton {triton.__version__}; the GPU machine runs 3.6", file=sys.stderr)
    driver.set_active(CompileOnlyDriver())
    for schedule, dtype in CASES:
        for block_h, tokens in PACKINGS:
            compile_case(schedule, dtype, block_h, tokens)
    failed = False
    for name, fn in (
        ("lockstep", gluon_mla._kernel()),
        ("alternate", gluon_mla_alternate.kernel()),
    ):
        for compiled in fn.device_caches[0][0].values():
            smem = compiled.metadata.shared
            failed |= smem > SMEM_LIMIT
            over = " OVER THE LIMIT" if smem > SMEM_LIMIT else ""
            cache = compiled.src.signature["KC_DESC"].split("[")[0].split("<")[-1]
            rows = f"{compiled.src.constants[(compiled.src.fn.arg_names.index('BLOCK_H'),)]}h"
            rows += f"x{compiled.src.constants[(compiled.src.fn.arg_names.index('TOKENS'),)]}t"
            print(
                f"{name} {cache} {rows}: shared {smem} B{over}; {ptxas_report(compiled.asm['ptx'])}"
            )
            if args.ptx:
                os.makedirs(args.ptx, exist_ok=True)
                with open(os.path.join(args.ptx, f"{name}_{cache}_{rows}.ptx"), "w") as f:
                    f.write(instructions(compiled.asm["ptx"]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
