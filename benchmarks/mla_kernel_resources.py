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

from benchmarks.attention_mla import Shape

CONFIGS = ({"tma": True}, {"tma": False}, {"tma": True, "BLOCK_N": 32})
SHAPES = ((16, 32, 4096, "bf16"), (16, 32, 4096, "fp8"), (128, 128, 4096, "bf16"))


def compiled_kernels(jit_fn) -> list:
    """The compiled kernels in a Triton JIT function's per-device caches."""
    found = []
    for entry in jit_fn.device_caches.values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "n_regs")]
    return found


def main() -> int:
    from atom_plugin.attention.mla import triton_kernels as mla_triton_kernels

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    for heads, batch, context, cache in SHAPES:
        shape = Shape(batch, context, heads, 1, cache)
        out = shape.new_out()
        for config in CONFIGS:
            for kernel in ("packed", "per_token"):
                if cache == "fp8" and kernel == "per_token" and config.get("tma"):
                    continue  # the per-token kernel reads fp8 through pointer loads only
                shape.run_new(out, shape.plan({**config, "kernel": kernel}))
    torch.cuda.synchronize()
    print("kernel | loads | regs | spills | shared bytes | warps | stages")
    for name in ("_mla_decode_stage1", "_mla_decode_per_token", "_mla_decode_stage2"):
        kernels = compiled_kernels(getattr(mla_triton_kernels, name))
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
