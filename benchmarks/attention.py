"""Attention benchmark: the plugin's Triton MHA kernels against the physical limits.

MHA decode (batch {1,8,32,128,256} x context {1K,4K,16K,64K}, 32 query heads,
8 KV heads, head size 128, bf16): microseconds, KV bytes read per second and
that rate as a fraction of the device-to-device copy bandwidth (read + write)
measured in the same run; torch SDPA over the same KV gathered contiguously is
the second reference (the query heads of a KV head ride in SDPA's query-length
dimension, so no KV is repeated). Prefill of 8K tokens (one fresh request, and
4 chunks of 2K new tokens over 6K cached each) as a fraction of the dense bf16
matmul rate measured in the same run, with SDPA on the fresh request.
MLA decode comes from benchmarks/attention_mla.py (`--no-mla` leaves it out).

The cache is vLLM's layout ([blocks, Hkv, block_size, 2*D] split into K/V
views) with shuffled block tables; each call is one CUDA-graph replay timed
with events after an L2 flush.

    python -m benchmarks attention [--out table.md] [--json rows.json] [--no-mla]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks import attention_mla
from benchmarks._report import run_facts
from benchmarks._timing import L2Flusher, copy_bandwidth_gbps, matmul_tflops, time_us

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (1024, 4096, 16384, 65536)
HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SCALE = D**-0.5
PREFILL_CASES = {
    "8K fresh (1 x 8192)": [(8192, 8192)],
    "8K chunked (4 x 2048 over 6144)": [(2048, 8192)] * 4,
}
GIB = 1 << 30
SDPA_MARGIN = 2 * GIB


def _target(batch: int, context: int) -> float | None:
    """The decode kernel's target as a fraction of copy bandwidth, where one applies."""
    if batch >= 32 and context >= 4096:
        return 0.85
    if batch == 1 and context == 65536:
        return 0.60
    return None


class KVPool:
    """One vLLM-layout bf16 cache big enough for the largest shape, shared by all rows;
    `hkv` KV heads of head size `d`."""

    def __init__(self, tokens: int, block_size: int, device="cuda", hkv: int = HKV, d: int = D):
        self.block_size, self.hkv, self.d = block_size, hkv, d
        self.num_blocks = -(-tokens // block_size)
        self.raw = torch.empty(self.num_blocks, hkv, block_size, 2 * d, dtype=DTYPE, device=device)
        self.raw.normal_(0, 1)
        self.key_cache, self.value_cache = self.raw.transpose(1, 2).split(d, dim=-1)

    def meta(self, reqs, seed=0):
        """Metadata for [(query_len, seq_len)] over shuffled, non-contiguous blocks."""
        from atom_plugin.attention.metadata import PagedAttentionMetadata

        device = self.raw.device
        per = [-(-s // self.block_size) for _, s in reqs]
        gen = torch.Generator(device=device).manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=gen, device=device)[: sum(per)]
        table = torch.zeros(len(reqs), max(per), dtype=torch.int32, device=device)
        start = 0
        for i, n in enumerate(per):
            table[i, :n] = perm[start : start + n].to(torch.int32)
            start += n
        qsl = [0]
        for q, _ in reqs:
            qsl.append(qsl[-1] + q)
        decodes = len(reqs) if all(q == 1 for q, _ in reqs) else 0
        return PagedAttentionMetadata(
            num_reqs=len(reqs),
            num_actual_tokens=qsl[-1],
            max_query_len=max(q for q, _ in reqs),
            max_seq_len=max(s for _, s in reqs),
            num_decodes=decodes,
            num_decode_tokens=decodes,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=device),
            block_table=table,
            slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=device),
        )

    def gather(self, meta, i_lo, i_hi, seq_len):
        """Requests [i_lo, i_hi) as contiguous K, V [n, Hkv, seq_len, D]."""
        n = i_hi - i_lo
        k = torch.empty(n, self.hkv, seq_len, self.d, dtype=DTYPE, device=self.raw.device)
        v = torch.empty_like(k)
        blocks = -(-seq_len // self.block_size)
        for a in range(0, n, 8):
            b = min(n, a + 8)
            rows = meta.block_table[i_lo + a : i_lo + b, :blocks].long()
            kk = self.key_cache[rows].flatten(1, 2)[:, :seq_len]  # [m, S, Hkv, D]
            vv = self.value_cache[rows].flatten(1, 2)[:, :seq_len]
            k[a:b] = kk.transpose(1, 2)
            v[a:b] = vv.transpose(1, 2)
        return k, v


def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def bench_decode(pool, batch, context, flush, copy_gbps, config=None, with_sdpa=True) -> dict:
    from atom_plugin.attention.mha.params import AttentionParams
    from atom_plugin.attention.mha.planner import plan_for_caches
    from atom_plugin.attention.mha.triton_decode import paged_decode

    meta = pool.meta([(1, context)] * batch, seed=batch * 7 + context)
    splits = plan_for_caches(meta, pool.key_cache, "triton").num_splits
    params = AttentionParams(scale=SCALE)
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    caches = (pool.key_cache, pool.value_cache)

    def run():
        paged_decode(q, *caches, meta, params, out, num_splits=splits, config=config)

    us = time_us(run, flush=flush)
    kv_bytes = batch * context * HKV * D * 2 * 2
    row = {
        "batch": batch,
        "context": context,
        "splits": splits,
        "us": us,
        "kv_gbps": kv_bytes / (us * 1e-6) / 1e9,
        "target": _target(batch, context),
    }
    row["frac_copy"] = row["kv_gbps"] / copy_gbps
    if with_sdpa:
        row.update(_sdpa_decode(pool, meta, q, out, kv_bytes, flush))
        torch.cuda.empty_cache()  # drop the gathered copy before the next shape
    return row


def _sdpa_decode(pool, meta, q, out, kv_bytes, flush) -> dict:
    batch, context = meta.num_reqs, meta.max_seq_len
    if kv_bytes + SDPA_MARGIN > _free_bytes():
        return {"sdpa_note": f"skipped: the gathered copy needs {kv_bytes / GIB:.0f} GiB more"}
    k, v = pool.gather(meta, 0, batch, context)
    qs = q.view(batch, HKV, HQ // HKV, D)  # a KV head's query heads as query rows
    res = {}

    def sdpa():
        res["o"] = F.scaled_dot_product_attention(qs, k, v, scale=SCALE)

    us = time_us(sdpa, flush=flush)
    diff = (res["o"].reshape(batch, HQ, D).float() - out.float()).abs().max().item()
    return {"sdpa_us": us, "sdpa_kv_gbps": kv_bytes / (us * 1e-6) / 1e9, "maxdiff": diff}


def bench_prefill(pool, name, reqs, flush, mm_tflops, config=None, with_sdpa=True) -> dict:
    from atom_plugin.attention.mha.params import AttentionParams
    from atom_plugin.attention.mha.triton_prefill import paged_prefill

    meta = pool.meta(reqs, seed=len(reqs))
    t = meta.num_actual_tokens
    params = AttentionParams(scale=SCALE)
    q = torch.randn(t, HQ, D, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    caches = (pool.key_cache, pool.value_cache)

    def run():
        paged_prefill(q, *caches, meta, params, out, config=config)

    us = time_us(run, flush=flush)
    # causal: query j of a request with context s and q_len new tokens sees s - q_len + j + 1 keys
    pairs = sum(ql * (s - ql) + ql * (ql + 1) // 2 for ql, s in reqs)
    flops = 4 * HQ * D * pairs
    row = {"case": name, "tokens": t, "us": us, "tflops": flops / (us * 1e-6) / 1e12}
    row["frac_matmul"] = row["tflops"] / mm_tflops
    if with_sdpa:
        row.update(_sdpa_prefill(pool, meta, reqs, q, out, flops, flush))
    return row


def _sdpa_prefill(pool, meta, reqs, q, out, flops, flush) -> dict:
    if len(reqs) != 1 or reqs[0][0] != reqs[0][1]:
        return {"sdpa_note": "n/a (fresh prefill only)"}
    s = reqs[0][1]
    k, v = pool.gather(meta, 0, 1, s)
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]
    res = {}

    def sdpa():
        res["o"] = F.scaled_dot_product_attention(
            qs, k, v, is_causal=True, scale=SCALE, enable_gqa=True
        )

    try:
        us = time_us(sdpa, flush=flush)
    except Exception as exc:
        return {"sdpa_note": f"SDPA failed: {exc!r:.80}"}
    diff = (res["o"][0].transpose(0, 1).float() - out.float()).abs().max().item()
    return {"sdpa_us": us, "sdpa_tflops": flops / (us * 1e-6) / 1e12, "maxdiff": diff}


def decode_table(rows) -> str:
    lines = [
        "| batch | context | splits | Triton us | KV GB/s | of copy BW | target | SDPA us "
        "| SDPA KV GB/s | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|:---|---:|---:|---:|",
    ]
    for r in rows:
        tgt = "-"
        if r["target"] is not None:
            ok = "met" if r["frac_copy"] >= r["target"] else "MISSED"
            tgt = f"{100 * r['target']:.0f}%: {ok}"
        if "sdpa_us" in r:
            sd = f"{r['sdpa_us']:.1f} | {r['sdpa_kv_gbps']:.0f} | {r['maxdiff']:.2e}"
        else:
            sd = f"{r.get('sdpa_note', 'n/a')} | | "
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['splits']} | {r['us']:.1f} | "
            f"{r['kv_gbps']:.0f} | {100 * r['frac_copy']:.1f}% | {tgt} | {sd} |"
        )
    return "\n".join(lines)


def prefill_table(rows) -> str:
    lines = [
        "| case | tokens | Triton us | TFLOP/s | of matmul rate | target 50% | SDPA us "
        "| SDPA TFLOP/s | max abs diff |",
        "|:---|---:|---:|---:|---:|:---|---:|---:|---:|",
    ]
    for r in rows:
        ok = "met" if r["frac_matmul"] >= 0.5 else "MISSED"
        if "sdpa_us" in r:
            sd = f"{r['sdpa_us']:.1f} | {r['sdpa_tflops']:.0f} | {r['maxdiff']:.2e}"
        else:
            sd = f"{r.get('sdpa_note', 'n/a')} | | "
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['us']:.1f} | {r['tflops']:.0f} | "
            f"{100 * r['frac_matmul']:.1f}% | {ok} | {sd} |"
        )
    return "\n".join(lines)


def _mla_section(copy_gbps, matmul_rate, flush) -> str:
    try:
        rows = attention_mla.run_mla_benchmarks(
            (128,), caches=("bf16",), copy_gbps=copy_gbps, matmul_rate=matmul_rate, flush=flush
        )
    except Exception as exc:  # keep the MHA report when the MLA run fails
        return f"MLA decode: benchmarks/attention_mla.py failed: {exc!r:.200}\n"
    return (
        "MLA decode (from benchmarks/attention_mla.py, same copy bandwidth and matmul rate):\n\n"
        + attention_mla.format_table(rows)
        + "\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--decode-config", type=json.loads, default=None, help="JSON kernel config")
    p.add_argument("--prefill-config", type=json.loads, default=None, help="JSON kernel config")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=BATCHES)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=CONTEXTS)
    p.add_argument("--no-mla", action="store_true", help="skip the MLA section")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    facts = run_facts()
    copy_gbps = copy_bandwidth_gbps()
    mm = matmul_tflops()
    flush = L2Flusher()
    tokens = max(max(args.batches) * max(args.contexts), 8192 * 4)
    pool = KVPool(tokens + args.block_size * max(args.batches), args.block_size)
    print(f"# {facts}; copy {copy_gbps:.0f} GB/s (read+write); bf16 matmul {mm:.0f} TFLOP/s")
    print(f"# KV pool {pool.raw.numel() * 2 / GIB:.1f} GiB, block size {args.block_size}")
    report = {"run": facts, "copy_gbps": copy_gbps, "matmul_tflops": mm}
    prefill_config = report["prefill_config"] = args.prefill_config
    decode_rows = []
    for batch in args.batches:
        for context in args.contexts:
            r = bench_decode(pool, batch, context, flush, copy_gbps, args.decode_config)
            decode_rows.append(r)
            print(decode_table([r]).splitlines()[-1], flush=True)
    prefill_rows = [
        bench_prefill(pool, name, reqs, flush, mm, prefill_config)
        for name, reqs in PREFILL_CASES.items()
    ]
    report["decode"], report["prefill"] = decode_rows, prefill_rows
    del pool
    torch.cuda.empty_cache()
    mla = "" if args.no_mla else _mla_section(copy_gbps, mm, flush)
    text = (
        f"{facts}; KV block size {args.block_size}\n"
        f"Copy bandwidth (device-to-device, read+write): {copy_gbps:.0f} GB/s; "
        f"dense bf16 matmul (8192^3): {mm:.0f} TFLOP/s\n\n"
        f"MHA decode ({HQ} query heads, {HKV} KV heads, head size {D}, bf16):\n\n"
        f"{decode_table(decode_rows)}\n\n"
        f"Prefill ({HQ}/{HKV} heads, head size {D}, bf16, causal; kernel config "
        f"{prefill_config or 'default'}):\n\n"
        f"{prefill_table(prefill_rows)}\n\n{mla}"
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
