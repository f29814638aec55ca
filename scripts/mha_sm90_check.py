"""Compile the MHA kernels for sm_90 without a GPU, as the ops launch them on an H200 (the
Triton prefill's and the decode split kernel's production configs, the Gluon prefill at
head sizes 128 and 64), and print ptxas' registers / spills and the shared memory of each
(the compile-only driver of `gluon_sm90_check`; run it with the GPU machine's Triton 3.6,
as that script says):

    /tmp/t36/bin/python scripts/mha_sm90_check.py [--ptx DIR] [--defaults]

`--ptx DIR` writes each kernel's instructions, to diff them across commits; `--defaults`
leaves the Gluon prefill out (what an older commit has). The Triton prefill's config is the
first CUDA candidate of `triton_prefill._configs`, as on the GPU.

The kernels compile as on the GPU (bf16 MMAs), not with the float32 products the launchers
pick for CPU tensors (`triton_common.dot_flags`).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from types import SimpleNamespace

import torch
from triton.runtime import driver

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from atom_plugin.attention.metadata import PagedAttentionMetadata  # noqa: E402
from atom_plugin.attention.mha import (  # noqa: E402
    gluon_prefill_launch,
    triton_decode,
    triton_prefill,
)
from atom_plugin.attention.mha.params import AttentionParams  # noqa: E402
from scripts.gluon_sm90_check import (  # noqa: E402
    SMEM_LIMIT,
    CompileOnlyDriver,
    instructions,
    ptxas_report,
)

HQ, HKV, D, BLOCK = 32, 8, 128, 16
GLUON = {"kernel": "gluon"}  # the Gluon Hopper prefill, launched directly (no Triton config)
# (name, config); None: the production config the ops pick
PREFILL_KERNELS = [("default", None), ("gluon", GLUON)]
DECODE_KERNELS = [("default", None)]


def _meta(q_len: int, seq_len: int) -> PagedAttentionMetadata:
    blocks = -(-seq_len // BLOCK)
    return PagedAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=q_len,
        max_query_len=q_len,
        max_seq_len=seq_len,
        num_decodes=1 if q_len == 1 else 0,
        num_decode_tokens=1 if q_len == 1 else 0,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=torch.zeros(1, blocks, dtype=torch.int32),
        slot_mapping=torch.zeros(q_len, dtype=torch.int64),
    )


def compile_one(decode: bool, cfg: dict | None, d: int = D):
    """Compile one kernel (config None: the production one) at head size `d` and return it."""
    raw = torch.zeros(64, HKV, BLOCK, 2 * d, dtype=torch.bfloat16)
    kc, vc = raw.transpose(1, 2).split(d, dim=-1)
    params = AttentionParams(scale=d**-0.5)
    q_len = 1 if decode else 256
    q = torch.zeros(q_len, HQ, d, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    meta = _meta(q_len, 512)
    if cfg is GLUON:
        from atom_plugin.attention.mha import gluon_prefill

        kernel = gluon_prefill.prefill_kernel
        counters = gluon_prefill_launch.work_counters(q.device)
        launch = partial(gluon_prefill_launch.gluon_prefill, first_req=0, counters=counters)
    elif decode:
        kernel = triton_decode._decode_split_kernel
        launch = partial(triton_decode.paged_decode, num_splits=2, config=cfg)
    else:
        kernel = triton_prefill._prefill_kernel
        launch = partial(triton_prefill.paged_prefill, config=cfg)
    kernel.device_caches.clear()
    launch(q, kc, vc, meta, params, out)
    *_, compiled = kernel.device_caches[0][0].values()  # the last: the one that fit
    return compiled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ptx", help="write each kernel's instructions here")
    p.add_argument("--defaults", action="store_true", help="leave the Gluon prefill out")
    args = p.parse_args(argv)
    driver.set_active(CompileOnlyDriver())
    gpu_flags = lambda query: dict(UPCAST=False, PRECISION=None)  # noqa: E731
    triton_prefill.dot_flags = triton_decode.dot_flags = gpu_flags
    # the prefill launcher picks its candidates by the tensors' device: CUDA's, as on the GPU
    configs = triton_prefill._configs
    triton_prefill._configs = lambda head_size, block_g, cuda: configs(head_size, block_g, True)
    # the Gluon prefill's grid order reads the device's SM count: an H200's
    gluon_prefill_launch._sm_count = lambda device: 132
    # and its work counter is a CUDA stream's: any int32 on the compile-only driver
    cpu_counter = SimpleNamespace(for_current_stream=lambda: torch.zeros(1, dtype=torch.int32))
    gluon_prefill_launch.work_counters = lambda device: cpu_counter
    failed = False
    for fam, cands, decode in (
        ("prefill", PREFILL_KERNELS, False),
        ("decode", DECODE_KERNELS, True),
    ):
        # the Gluon prefill's head size 64 runs three warpgroups: a kernel of its own
        pairs = [(n, c, d) for n, c in cands for d in ((D, 64) if c is GLUON else (D,))]
        for name, cfg, d in pairs:
            if args.defaults and cfg is not None:
                continue
            if d != D:
                name = f"{name} head {d}"
            try:
                compiled = compile_one(decode, cfg, d)
            except Exception as exc:  # report and go on
                failed = True
                print(f"{fam} {name}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
                continue
            smem = compiled.metadata.shared
            failed |= smem > SMEM_LIMIT
            over = " OVER THE LIMIT" if smem > SMEM_LIMIT else ""
            report = ptxas_report(compiled.asm["ptx"])
            print(f"{fam} {name}: shared {smem} B{over}; {report}")
            if args.ptx:
                os.makedirs(args.ptx, exist_ok=True)
                path = os.path.join(args.ptx, f"{fam}_{name.replace(' ', '_')}.ptx")
                with open(path, "w") as f:
                    f.write(instructions(compiled.asm["ptx"]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
