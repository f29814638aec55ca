"""Compile the Gluon MLA kernels for sm_90 on a machine without a GPU, through the real
launcher (`gluon_launch.run_stage1`), and print each kernel's shared memory, registers and
spills as ptxas reports them. With `--ptx`, the Triton MLA kernels too.

Gluon kernels do not run in Triton's CPU interpreter, and the H200 is lent by the
half hour: this catches compile errors, shared memory past the 227 KB an SM grants and
register spills before a GPU run. It needs a Triton that vLLM runs on the GPU machine
(3.8.0 with vLLM 0.34, 3.7.1 with 0.32; the machine's own torch has 3.6, which compiles
every kernel but rows16; the project's CPU venv has a newer one whose Gluon API
differs), e.g.

    python3.11 -m venv /tmp/t38 && /tmp/t38/bin/pip install triton==3.8.0
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/t38/lib/python3.11/site-packages/zz.pth
    /tmp/t38/bin/python scripts/gluon_sm90_check.py [--ptx DIR]

`--ptx DIR` writes each compiled variant's instructions: a refactor of a kernel whose
instructions come out the same (`diff -r` of two such folders) changes nothing the GPU runs.
It also compiles the Triton MLA kernels (the cache write, stage 1 packed and per-token,
the merge) through their launcher (`mla.triton.mla_decode_triton`) for the configurations
in TRITON_CASES and writes theirs. `--triton` compiles those alone and checks their
shared memory, with any Triton that has a CUDA backend (the project's venv's: a CPU
test runs it). `--loops` also prints each variant's innermost loops, its work per KV
tile, counted by opcode, and its matrix instructions by shape (`sass_loops`).

The stand-in driver below answers the compiler's questions (device 0, target sm_90) and
launches nothing: every launch after a compile is a no-op, so a launcher runs to its end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from atom_plugin.attention.metadata import PagedAttentionMetadata  # noqa: E402
from atom_plugin.attention.mla import launch_plan  # noqa: E402
from atom_plugin.attention.mla import triton as triton_mla  # noqa: E402
from atom_plugin.attention.mla import triton_kernels as mla_triton_kernels  # noqa: E402
from atom_plugin.attention.mla.gluon import alternate as gluon_mla_alternate  # noqa: E402
from atom_plugin.attention.mla.gluon import launch as gluon_launch  # noqa: E402
from atom_plugin.attention.mla.gluon import lockstep as gluon_mla  # noqa: E402
from atom_plugin.attention.mla.gluon import rows16 as gluon_mla_rows16  # noqa: E402
from atom_plugin.attention.mla.gluon import scorer as gluon_mla_scorer  # noqa: E402
from atom_plugin.attention.mla.gluon.shapes import launch_shape  # noqa: E402
from atom_plugin.attention.mla.launch_plan import TritonMLALaunch, merge_block_s  # noqa: E402
from atom_plugin.attention.mla.plan import plan_mla_decode  # noqa: E402
from scripts.sass_loops import disassemble, innermost_loops, mma_shapes, triton_tool  # noqa: E402

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

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None

    class utils:  # what loading a compiled kernel asks
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": SMEM_LIMIT}

        @staticmethod
        def load_binary(name, kernel, shared, device):
            return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads


def ptxas_report(ptx: str) -> str:
    ptxas = triton_tool("ptxas")
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
    ("scorer", torch.bfloat16),
    ("rows16", torch.float8_e4m3fn),
)


def compile_case(schedule: str, cache_dtype: torch.dtype, block_h: int, tokens: int):
    cache = torch.zeros(8, 64, 576, dtype=cache_dtype)
    q = torch.zeros(4, 128, 576, dtype=torch.bfloat16)
    table = torch.zeros(4, 8, dtype=torch.int32)
    qsl = torch.zeros(5, dtype=torch.int32)
    kv_len = torch.zeros(4, dtype=torch.int32)
    mid_o, mid_lse = torch.zeros(4, 128, 2, 512), torch.zeros(4, 128, 2)
    fp8 = cache_dtype != torch.bfloat16
    s = launch_shape(schedule)
    launch = TritonMLALaunch(
        "gluon", block_h, tokens, 1, 2, 2, s.block_n, s.num_warps, s.stages, True, fp8, True,
        512, merge_block_s(2), schedule=schedule,
    )  # fmt: skip
    gluon_launch.run_stage1(
        q[..., :512], q[..., 512:], cache, table, qsl, 4, kv_len, mid_o, mid_lse, torch.ones(1),
        0.1, launch, 512,
    )  # fmt: skip


# (heads, query tokens per request, fp8 cache, split count, config): the launches the
# plan makes on an H200 (16 heads: 32-key tiles through TMA, with speculative tokens
# 64-key tiles; above 16 heads fp8 through pointer loads), each kernel without TMA, and
# the merge in one pass and in chunks, over narrowed columns
TRITON_CASES = (
    (16, 1, False, 2, {"kernel": "packed", "tma": True}),
    (16, 1, True, 2, {"kernel": "packed", "tma": True}),
    (16, 1, False, 2, {"kernel": "packed", "tma": False}),
    (16, 2, False, 2, {"kernel": "packed", "tma": True}),
    (16, 2, True, 2, {"kernel": "packed", "tma": True}),
    (16, 4, False, 2, {"kernel": "packed", "tma": True}),
    (16, 4, False, 2, {"kernel": "packed", "tma": False}),
    (16, 4, True, 2, {"kernel": "packed", "tma": True}),
    (128, 1, False, 2, {"kernel": "packed", "tma": True}),
    (128, 1, True, 2, {"kernel": "packed", "tma": False}),
    (16, 1, False, 2, {"kernel": "per_token", "tma": True}),
    (16, 1, True, 2, {"kernel": "per_token", "tma": False}),
    (128, 1, False, 2, {"kernel": "per_token", "tma": True}),
    (128, 1, True, 2, {"kernel": "per_token", "tma": False}),
    (16, 1, False, 72, {"kernel": "packed", "tma": True, "merge_dv": 128}),
    (16, 1, False, 72, {"kernel": "packed", "tma": True, "merge_dv": 32}),
    (128, 1, False, 1, {"kernel": "packed", "tma": True}),  # one split: the keyless fill
)


def compile_triton_case(heads: int, q_len: int, fp8: bool, splits: int, config: dict):
    """One decode step of two requests (and its cache write) through the Triton launcher."""
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.zeros(8, 64, 576, dtype=cache_dtype)
    tokens = 2 * q_len
    qsl = torch.arange(0, tokens + 1, q_len, dtype=torch.int32)
    meta = PagedAttentionMetadata(
        num_reqs=2,
        num_actual_tokens=tokens,
        max_query_len=q_len,
        max_seq_len=4096,
        num_decodes=2,
        num_decode_tokens=tokens,
        query_start_loc=qsl,
        seq_lens=torch.full((2,), 4096, dtype=torch.int32),
        block_table=torch.zeros(2, 64, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
    )
    q = torch.zeros(tokens, heads, 576, dtype=torch.bfloat16)
    out = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16)
    kv_scale = torch.ones(1) if fp8 else None
    triton_mla.write_mla_kv_triton(q[:, 0, :512], q[:, 0, 512:], cache, meta.slot_mapping, kv_scale)
    plan = plan_mla_decode(
        meta,
        tokens,
        heads,
        kernel_impl="triton",
        kv_dtype=cache_dtype,
        config=config,
        num_splits=splits,
    )
    triton_mla.mla_decode_triton(
        q, cache, meta, scale=0.1, output=out, kv_scale=kv_scale, plan=plan
    )


TRITON_KERNELS = (
    mla_triton_kernels._mla_write_kernel,
    mla_triton_kernels._mla_decode_stage1,
    mla_triton_kernels._mla_decode_per_token,
    mla_triton_kernels._mla_decode_stage2,
    mla_triton_kernels._mla_fill_keyless,
)


def variant_spec(compiled) -> str:
    """What a Triton kernel variant was specialized on: its constexprs (the arguments
    fixed to 1 or None among them) and its pointer and descriptor types."""
    src = compiled.src
    names = src.fn.arg_names
    parts = [f"{names[k[0]]}={v}" for k, v in sorted(src.constants.items())]
    parts += [f"{n}={ty}" for n, ty in src.signature.items() if ty.startswith(("*", "tensordesc"))]
    return " ".join(parts)


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
    p.add_argument(
        "--triton",
        action="store_true",
        help="the Triton MLA kernels only (TRITON_CASES), with any Triton that has a CUDA "
        "backend; exits 1 if a variant needs more shared memory than an SM grants",
    )
    p.add_argument(
        "--loops",
        action="store_true",
        help="each compiled variant's innermost loops (its machine code's instructions a "
        "KV tile, by opcode)",
    )
    args = p.parse_args(argv)
    driver.set_active(CompileOnlyDriver())
    failed = False
    if not args.triton:
        failed = check_gluon(args.ptx, args.loops)
    if args.ptx or args.triton:
        failed |= check_triton(args.ptx, args.loops)
    return 1 if failed else 0


def check_gluon(ptx: str | None, loops: bool = False) -> bool:
    """Compiles every Gluon stage-1 variant; True if one is over the shared memory limit.
    `loops`: print each variant's innermost loops."""
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version not in ((3, 6), (3, 7), (3, 8)):
        print(f"warning: Triton {triton.__version__}; vLLM runs 3.6 to 3.8", file=sys.stderr)
    rows16_problems = launch_plan.rows16_problems(None)
    for schedule, dtype in CASES:
        if schedule == "rows16" and rows16_problems:
            print(f"rows16: not compiled ({'; '.join(rows16_problems)})")
            continue
        for block_h, tokens in PACKINGS if schedule != "rows16" else ((16, 1),):
            compile_case(schedule, dtype, block_h, tokens)
    failed = False
    for name, fn in (
        ("lockstep", gluon_mla.stage1),
        ("alternate", gluon_mla_alternate.stage1),
        ("scorer", gluon_mla_scorer.stage1),
        ("rows16", gluon_mla_rows16.stage1),
    ):
        for compiled in fn.device_caches[0][0].values():
            over, shared = shared_report(compiled)
            failed |= over
            cache = compiled.src.signature["KC_DESC"].split("[")[0].split("<")[-1]
            rows = f"{constant(compiled, 'BLOCK_H')}hx{constant(compiled, 'TOKENS')}t"
            print(f"{name} {cache} {rows}: {shared}; {ptxas_report(compiled.asm['ptx'])}")
            if loops:
                print_loops(compiled)
            if ptx:
                write_ptx(ptx, f"{name}_{cache}_{rows}", compiled)
    return failed


def constant(compiled, arg: str):
    """A compiled variant's value of its constexpr argument `arg`."""
    return compiled.src.constants[(compiled.src.fn.arg_names.index(arg),)]


def check_triton(ptx: str | None, loops: bool = False) -> bool:
    """Compiles the Triton MLA kernels for TRITON_CASES; True if a variant is over the
    shared memory limit. `loops`: print each variant's innermost loops."""
    for case in TRITON_CASES:
        try:
            compile_triton_case(*case)
        except OutOfResources:
            pass  # compiled, then refused at launch: reported below from its metadata
    failed = False
    for fn in TRITON_KERNELS:
        for compiled in fn.device_caches[0][0].values():
            spec = variant_spec(compiled)
            name = f"{fn.__name__.lstrip('_')}_{hashlib.sha1(spec.encode()).hexdigest()[:10]}"
            over, shared = shared_report(compiled)
            failed |= over
            print(f"{name}: {shared}; {spec}")
            if loops:
                print_loops(compiled)
            if ptx:
                write_ptx(ptx, name, compiled, spec)
    return failed


def print_loops(compiled) -> None:
    """A compiled variant's innermost loops, counted by opcode, and its matrix
    instructions by shape (`sass_loops`)."""
    sass = disassemble(compiled.asm["cubin"])
    for loop in innermost_loops(sass):
        print(f"  loop at {loop.start:#06x}: {loop.summary()}")
    shapes = ", ".join(f"{op} {n}" for op, n in sorted(mma_shapes(sass).items()))
    print(f"  matrix instructions: {shapes or 'none'}")


def shared_report(compiled) -> tuple[bool, str]:
    """Whether a compiled variant takes more shared memory than an SM grants, and its
    shared memory as printed."""
    smem = compiled.metadata.shared
    over = smem > SMEM_LIMIT
    return over, f"shared {smem} B" + (" OVER THE LIMIT" if over else "")


def write_ptx(folder: str, name: str, compiled, spec: str | None = None) -> None:
    """The variant's instructions into `folder`/`name`.ptx, after its spec if given."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.ptx"), "w") as f:
        if spec:
            f.write(f"// {spec}\n")
        f.write(instructions(compiled.asm["ptx"]))


if __name__ == "__main__":
    raise SystemExit(main())
