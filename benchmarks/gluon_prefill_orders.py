"""The Gluon prefill's grid orders (issue 26): each case run query-block-major,
kv-head-major, and in the order `gluon_prefill_launch.prefill_grid` picks, on one Hopper
GPU, so the rule's threshold (`KV_MAJOR_WAVES`) can be set against both orders.

Each line: the work items and their rounds of one item an SM; the median time of
each order (L2 flushed before each call) and the order the rule picks; maxdiff between
the three outputs (the same kernel and inputs: 0 expected).

    PYTHONPATH=$PWD python -m benchmarks.gluon_prefill_orders [--iters 20]
"""

from __future__ import annotations

import argparse
from functools import partial

CASES = {
    "1x1K": [(1024, 1024)],
    "1x4K": [(4096, 4096)],
    "1x8K": [(8192, 8192)],
    "4x2K": [(2048, 2048)] * 4,
    "8x4K": [(4096, 4096)] * 8,
    "4x2K+6K": [(2048, 8192)] * 4,
    "8x1K+7K": [(1024, 8192)] * 8,
    "1x8K+24K": [(8192, 32768)],
}
HEADS = ((32, 8, 128), (32, 4, 128), (32, 8, 64), (64, 8, 64))
ORDERS = (("qmajor", 0), ("kvmajor", 10**6), ("rule", None))  # KV_MAJOR_WAVES of each


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="timed calls per order (median)")
    args = p.parse_args(argv)

    import torch

    from atom_plugin.attention.mha import gluon_prefill_launch as gpl
    from atom_plugin.attention.mha.params import AttentionParams
    from benchmarks import attention
    from benchmarks import kernel_problems as kp
    from benchmarks._timing import L2Flusher, time_us

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("the Gluon prefill needs a Hopper GPU (capability 9.0)")
    flush = L2Flusher()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rule = gpl.KV_MAJOR_WAVES
    counters = gpl.work_counters(torch.device("cuda"))
    for hq, hkv, d in HEADS:
        heads = kp.Heads(hq, hkv, d)
        torch.manual_seed(1)
        sizes = [(len(r), max(s for _, s in r)) for r in CASES.values()]
        pool = attention.KVPool(kp.mha_pool_tokens(sizes, ()), kp.MHA_BLOCK_SIZE, hkv=hkv, d=d)
        params = AttentionParams(scale=heads.scale)
        kc, vc = pool.key_cache, pool.value_cache
        for i, (name, reqs) in enumerate(CASES.items()):
            meta = pool.meta(reqs, seed=7 + i)
            q = kp.peaked_mha_query(meta.num_actual_tokens, heads=heads)
            grid = gpl.prefill_grid(meta.max_query_len, hkv, meta.num_reqs, d, hq // hkv, sms)
            times, outs = {}, {}
            try:
                for label, waves in ORDERS:
                    gpl.KV_MAJOR_WAVES = rule if waves is None else waves
                    out = outs[label] = torch.empty_like(q)
                    call = partial(gpl.gluon_prefill, q, kc, vc, meta, params, out, 0, counters)
                    call()
                    torch.cuda.synchronize()
                    times[label] = time_us(call, flush=flush, iters=args.iters)
            finally:
                gpl.KV_MAJOR_WAVES = rule
            diff = max(
                (o.float() - outs["qmajor"].float()).abs().max().item() for o in outs.values()
            )
            tflops = kp.prefill_flops(reqs, heads) / times["rule"] / 1e6
            picked = "kv" if grid.kv_major else "q "
            print(
                f"{str(heads):9s} {name:9s} {grid.items:6d} items {grid.items / sms:5.1f} rounds  "
                f"qmajor {times['qmajor']:8.1f}  kvmajor {times['kvmajor']:8.1f}  "
                f"rule({picked}) {times['rule']:8.1f} us ({tflops:4.0f} TF/s)  "
                f"kv/q {times['kvmajor'] / times['qmajor']:.3f}  maxdiff {diff:.4f}",
                flush=True,
            )
        del pool
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
