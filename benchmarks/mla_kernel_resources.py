"""Registers, spills and shared memory of the compiled MLA decode kernels (a diagnostic).

Runs the Triton MLA decode once per launch configuration on the benchmark's
DeepSeek shapes, then prints what the compiler reported for each compiled
stage-1 and stage-2 kernel: registers per thread, spilled registers, shared
memory, warps and stages. Register pressure is what limits the 64-head tile
(docs/benchmarks.md, "Attention (MLA)").

    python -m benchmarks.mla_kernel_resources
"""

from __future__ import annotations

import sys

import torch

from benchmarks.attention_mla import HEADS, LORA, make_decode_batch

CONFIGS = ({"tma": True}, {"tma": False}, {"tma": True, "BLOCK_N": 32})
SHAPES = ((32, 4096), (128, 4096))


def compiled_kernels(jit_fn) -> list:
    """The compiled kernels in a Triton JIT function's per-device caches."""
    found = []
    for entry in jit_fn.device_caches.values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "n_regs")]
    return found


def main() -> int:
    from atom_plugin.backends import triton_mla
    from atom_plugin.backends.mla_plan import mla_token_plan

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    for batch, context in SHAPES:
        meta, q, cache = make_decode_batch(batch, context)
        plan = mla_token_plan(meta, batch)
        out = torch.empty(batch, HEADS, LORA, dtype=q.dtype, device="cuda")
        for config in CONFIGS:
            triton_mla.mla_decode_triton(
                q, cache, meta, scale=0.07, output=out, token_plan=plan, config=config
            )
    torch.cuda.synchronize()
    print("kernel | loads | regs | spills | shared bytes | warps | stages")
    for name in ("_mla_decode_stage1", "_mla_decode_stage2"):
        kernels = compiled_kernels(getattr(triton_mla, name))
        if not kernels:
            print(f"{name}: no compiled kernels found (Triton's cache layout changed?)")
            return 1
        for k in kernels:
            md = k.metadata
            loads = "TMA" if "tensordesc" in str(k.src.signature) else "pointers"
            print(
                f"{name} | {loads} | {k.n_regs} | {k.n_spills} | {md.shared} | "
                f"{md.num_warps} | {md.num_stages}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
