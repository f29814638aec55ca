"""MLA decode benchmark: the plugin's Triton MLA decode against the physical limits
measured in the same run and against torch SDPA over the same latent rows gathered
contiguously (what a user without a paged MLA kernel would run).

Two limits apply. The device-to-device copy bandwidth bounds the KV read. The dense
bf16 matmul rate (8192^3) bounds the arithmetic: with 128 heads sharing each latent
row, a decode does FLOPS_PER_KEY_HEAD * 128 = 278,528 FLOP per 1,152-byte row (242
FLOP/byte), so the kernel can read KV no faster than matmul rate / 242 - on an H200
about as fast as the copy bandwidth allows, which is why the "roofline" column caps
"of copy BW".

DeepSeek shapes: 128 heads, latent rows of 576 (kv_lora_rank 512 + rope 64), bf16,
block size 64, shuffled block tables. "KV bytes" counts the latent rows read once per
request; each measurement is one CUDA-graph replay timed with events, with L2 flushed
before every replay.

    python -m benchmarks.attention_mla [--json out.json] [--markdown out.md] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks._timing import L2Flusher, copy_bandwidth_gbps, matmul_tflops, time_us

BATCHES = (1, 32, 128)
CONTEXTS = (4096, 32768)
HEADS = 128
LORA, ROPE = 512, 64
TARGET = 0.75  # the target: MLA decode at >= 75% of copy bandwidth

# Alternatives to triton_mla.default_config (merged over it), timed on SWEEP_SHAPES. The
# default loads whole tiles through TMA on this cache; {"tma": False} is the pointer-load
# kernel it replaced. Earlier sweeps and their findings are in docs/benchmarks.md.
SWEEP_CONFIGS = [
    {"tma": False},
    {"num_warps": 16},
    {"num_stages": 3},
    {"BLOCK_N": 32},
    {"BLOCK_N": 32, "num_stages": 3},
    {"BLOCK_H": 32, "num_warps": 4},
    {"BLOCK_H": 128, "BLOCK_N": 32, "num_warps": 16},
]
SWEEP_SHAPES = ((1, 32768), (32, 32768), (128, 4096))
FLOPS_PER_KEY_HEAD = 2 * (LORA + ROPE) + 2 * LORA  # q.k over 576, p.v over 512
BF16_BYTES = 2
FLOP_PER_KV_BYTE = HEADS * FLOPS_PER_KEY_HEAD / ((LORA + ROPE) * BF16_BYTES)


def roofline_frac_copy(copy_gbps: float, matmul_rate: float) -> float:
    """The fastest KV read a decode can reach, as a fraction of the copy bandwidth: the
    lesser of the copy bandwidth and the matmul rate over the FLOP each byte needs."""
    compute_bound_gbps = matmul_rate * 1e12 / FLOP_PER_KV_BYTE / 1e9
    return min(1.0, compute_bound_gbps / copy_gbps)


def make_decode_batch(
    batch, context, *, block_size=64, dtype=torch.bfloat16, device="cuda", seed=0
):
    from atom_plugin.backends.metadata import PagedAttentionMetadata

    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per = -(-context // block_size)
    num_blocks = batch * blocks_per + 1
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per]
    table = perm.view(batch, blocks_per).to(torch.int32).to(device)
    cache = torch.empty(num_blocks, block_size, LORA + ROPE, dtype=dtype, device=device)
    cache.normal_(0, 1)
    meta = PagedAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=context,
        num_decodes=batch,
        num_decode_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
    )
    q = torch.randn(batch, HEADS, LORA + ROPE, dtype=dtype, device=device) * 0.1
    return meta, q, cache


def run_mla_benchmarks(
    batches=BATCHES,
    contexts=CONTEXTS,
    *,
    copy_gbps: float | None = None,
    matmul_rate: float | None = None,
    flush: L2Flusher | None = None,
    config: dict | None = None,
    with_sdpa: bool = True,
    device="cuda",
) -> list[dict]:
    """One row per (batch, context): Triton MLA decode and torch SDPA timings, KV GB/s,
    the fraction of the copy bandwidth and the TFLOP/s as a fraction of the matmul rate
    (both limits measured here unless the caller measured them already)."""
    copy_gbps = copy_gbps or copy_bandwidth_gbps(device)
    matmul_rate = matmul_rate or matmul_tflops(device)
    flush = flush or L2Flusher(device)
    rows = []
    for batch in batches:
        for context in contexts:
            rows.append(_bench_shape(batch, context, config, with_sdpa, flush, copy_gbps, device))
            torch.cuda.empty_cache()
    for row in rows:
        row["copy_gbps"], row["matmul_tflops"] = copy_gbps, matmul_rate
        row["frac_matmul"] = row["tflops"] / matmul_rate
        row["roofline_frac_copy"] = roofline_frac_copy(copy_gbps, matmul_rate)
    return rows


def _bench_shape(
    batch, context, config, with_sdpa, flush, copy_gbps, device, num_splits=None
) -> dict:
    from atom_plugin.backends.mla_plan import mla_token_plan
    from atom_plugin.backends.triton_mla import mla_decode_triton

    meta, q, cache = make_decode_batch(batch, context, device=device)
    plan = mla_token_plan(meta, batch)  # built once per step by the metadata builder
    out = torch.empty(batch, HEADS, LORA, dtype=q.dtype, device=device)
    scale = (128 + 64) ** -0.5
    kv_bytes = batch * context * (LORA + ROPE) * cache.element_size()
    us = time_us(
        lambda: mla_decode_triton(
            q,
            cache,
            meta,
            scale=scale,
            output=out,
            config=config,
            token_plan=plan,
            num_splits=num_splits,
        ),
        flush=flush,
    )
    swept = config or num_splits
    row = {
        "batch": batch,
        "context": context,
        "heads": HEADS,
        "config": config,
        "num_splits": num_splits,
        "maxdiff_vs_default": _diff_vs_default(out, q, cache, meta, scale, plan) if swept else 0.0,
        "us": us,
        "kv_gbps": kv_bytes / (us * 1e-6) / 1e9,
        "tflops": batch * HEADS * context * FLOPS_PER_KEY_HEAD / (us * 1e-6) / 1e12,
    }
    row["frac_copy"] = row["kv_gbps"] / copy_gbps
    if with_sdpa:
        row.update(_sdpa_row(meta, q, cache, scale, kv_bytes, flush, out))
    return row


def _diff_vs_default(out, q, cache, meta, scale, plan) -> float:
    """Max abs difference between `out` (a swept configuration's) and the default's."""
    from atom_plugin.backends.triton_mla import mla_decode_triton

    ref = torch.empty_like(out)
    mla_decode_triton(q, cache, meta, scale=scale, output=ref, token_plan=plan)
    return (out.float() - ref.float()).abs().max().item()


def _sdpa_row(meta, q, cache, scale, kv_bytes, flush, triton_out) -> dict:
    """torch SDPA over the same rows gathered contiguously (gather not timed), checked
    against the Triton kernel's output `triton_out` of the same inputs."""
    b, ctx = q.shape[0], meta.max_seq_len
    rows = cache[meta.block_table.long()].reshape(b, -1, LORA + ROPE)[:, :ctx]
    # All heads share the latent rows, so the heads ride as a length-H query over one
    # "head" of keys: no per-head copies of K and V.
    k = rows.unsqueeze(1)  # [B, 1, ctx, 576]
    v = rows[..., :LORA].unsqueeze(1)  # [B, 1, ctx, 512]
    qq = q.unsqueeze(1)  # [B, 1, H, 576]
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        res = f(qq, k, v, scale=scale)
        err = (res.squeeze(1).float() - triton_out.float()).abs().max().item()
        us = time_us(lambda: f(qq, k, v, scale=scale), flush=flush)
    except Exception as exc:
        return {"sdpa_us": None, "sdpa_error": repr(exc)[:120]}
    return {
        "sdpa_us": us,
        "sdpa_kv_gbps": kv_bytes / (us * 1e-6) / 1e9,
        "sdpa_vs_triton_maxdiff": err,
    }


def sweep(copy_gbps, flush, shapes=SWEEP_SHAPES, configs=SWEEP_CONFIGS, device="cuda") -> list:
    results = []
    for cfg in configs:
        for batch, context in shapes:
            try:
                row = _bench_shape(batch, context, cfg, False, flush, copy_gbps, device)
            except Exception as exc:
                results.append({"config": cfg, "error": repr(exc)[:200]})
                break
            results.append(row)
            torch.cuda.empty_cache()
    return results


SPLITS = (1, 2, 3, 4, 6, 8, 16, 32, 64)  # KV splits per request timed by --split-sweep


def split_sweep(copy_gbps, flush, device="cuda") -> list:
    """Every shape of the main table at each of SPLITS, the default configuration otherwise;
    the split count the default rule picks is printed beside."""
    results = []
    for batch in BATCHES:
        for context in CONTEXTS:
            for splits in SPLITS:
                results.append(
                    _bench_shape(batch, context, None, False, flush, copy_gbps, device, splits)
                )
            torch.cuda.empty_cache()
    return results


def format_table(rows: list[dict]) -> str:
    lines = [
        "| batch | context | Triton MLA us | KV GB/s | of copy BW | roofline | target 75% "
        "| TFLOP/s | of matmul rate | SDPA us | SDPA KV GB/s |",
        "|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sdpa_us = f"{r['sdpa_us']:.1f}" if r.get("sdpa_us") else "n/a"
        sdpa_bw = f"{r['sdpa_kv_gbps']:.0f}" if r.get("sdpa_us") else "n/a"
        met = "met" if r["frac_copy"] >= TARGET else "missed"
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['us']:.1f} | {r['kv_gbps']:.0f} | "
            f"{100 * r['frac_copy']:.1f}% | {100 * r['roofline_frac_copy']:.1f}% | {met} | "
            f"{r['tflops']:.0f} | {100 * r['frac_matmul']:.1f}% | {sdpa_us} | {sdpa_bw} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--markdown", help="write the table as markdown here")
    p.add_argument("--sweep", action="store_true", help="time every SWEEP_CONFIGS entry too")
    p.add_argument("--split-sweep", action="store_true", help="time each shape at SPLITS too")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    result = {"device": device_name}
    copy_gbps, matmul_rate, flush = copy_bandwidth_gbps(), matmul_tflops(), L2Flusher()
    if args.sweep:
        result["sweep"] = sweep(copy_gbps, flush)
        for r in result["sweep"]:
            if "error" in r:
                print(f"{r['config']}: {r['error']}")
            else:
                print(
                    f"{r['config']} B={r['batch']} ctx={r['context']}: {r['us']:.1f} us "
                    f"{r['kv_gbps']:.0f} GB/s {100 * r['frac_copy']:.1f}% {r['tflops']:.0f} TFLOP/s"
                    f" (max diff vs default {r['maxdiff_vs_default']:.1e})"
                )
    if args.split_sweep:
        from atom_plugin.backends.triton_mla import decode_num_splits

        result["split_sweep"] = split_sweep(copy_gbps, flush)
        for r in result["split_sweep"]:
            default = decode_num_splits(r["batch"], HEADS, r["context"], torch.device("cuda"))
            print(
                f"B={r['batch']} ctx={r['context']} splits={r['num_splits']} (rule: {default}): "
                f"{r['us']:.1f} us {100 * r['frac_copy']:.1f}% "
                f"(max diff vs default {r['maxdiff_vs_default']:.1e})"
            )
    rows = run_mla_benchmarks(copy_gbps=copy_gbps, matmul_rate=matmul_rate, flush=flush)
    result["rows"] = rows
    table = format_table(rows)
    print(
        f"device: {device_name}; copy bandwidth {copy_gbps:.0f} GB/s (read+write); dense bf16 "
        f"matmul {matmul_rate:.0f} TFLOP/s; {FLOP_PER_KV_BYTE:.0f} FLOP per KV byte, so the "
        f"roofline is {100 * roofline_frac_copy(copy_gbps, matmul_rate):.1f}% of copy bandwidth"
    )
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
