"""MLA decode benchmark: the plugin's Triton MLA decode at 16, 64 and 128 heads, bf16 and
fp8 caches, one and two query tokens, against the physical limits measured in the same
run and torch SDPA over the same latent rows gathered contiguously (what a user without a
paged MLA kernel would run).

Two limits apply. The device-to-device copy bandwidth bounds the KV read; the dense
bf16 matmul rate (8192^3) bounds the arithmetic, FLOPS_PER_KEY_HEAD per key, head and
query token. A shape's limit time is the larger of bytes / copy bandwidth and FLOP /
matmul rate; "of limit" is that time over the kernel's.

Latent rows of 576 (kv_lora_rank 512 + rope 64), block size 64, shuffled block tables,
every request at the full context. "KV bytes" counts each request's rows once, at the
cache's element size (fp8: 1 byte, one per-tensor scale). Each measurement is the median
of 20 CUDA-graph replays timed with events, L2 flushed before every replay; the per-step
plan is built outside the timed region, as the metadata builder builds it once per step.
`--configs` times launch configurations of one's choosing (`launch_plan.default_config`'s
keys, and `kernel`) beside the plan's own on every row, their outputs checked against it.

    python -m benchmarks attention_mla [--heads 16,64,128] [--caches bf16,fp8] \\
        [--configs '[{"BLOCK_N": 64}, {"kernel": "gluon"}]'] [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks._report import run_facts
from benchmarks._timing import L2Flusher, copy_bandwidth_gbps, matmul_tflops, time_us

HEADS = (16, 64, 128)
BATCHES = (1, 32, 128)
CONTEXTS = (4096, 32768)
SPEC_SHAPES = ((32, 8192, 2),)  # (batch, context, query tokens per request)
CACHES = ("bf16", "fp8")
LORA, ROPE = 512, 64
PAGE = 64
FP8_SCALE = 0.37  # a non-unit per-tensor scale
FLOPS_PER_KEY_HEAD = 2 * (LORA + ROPE) + 2 * LORA  # q.k over 576, p.v over 512


def make_decode_batch(
    batch,
    context,
    heads,
    *,
    q_len=1,
    cache="bf16",
    block_size=PAGE,
    device="cuda",
    seed=0,
    shared=False,
):
    """A uniform decode batch: `batch` requests of `q_len` causal query tokens at
    `context` keys, block tables shuffled; `shared`: every request reads the same blocks
    (one context, as prefix caching shares a common prompt's). Returns (meta, q, cache,
    kv_scale)."""
    from atom_plugin.attention.metadata import PagedAttentionMetadata

    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per = -(-context // block_size)
    owners = 1 if shared else batch
    num_blocks = owners * blocks_per + 1
    perm = torch.randperm(num_blocks, generator=gen)[: owners * blocks_per]
    table = perm.view(owners, blocks_per).expand(batch, -1).to(torch.int32).contiguous()
    table = table.to(device)
    kv = torch.empty(num_blocks, block_size, LORA + ROPE, dtype=torch.bfloat16, device=device)
    kv.normal_(0, 1)
    kv_scale = None
    if cache == "fp8":
        kv_scale = torch.tensor([FP8_SCALE], device=device)
        kv = (kv.float() / FP8_SCALE).to(torch.float8_e4m3fn)
    t = batch * q_len
    meta = PagedAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=t,
        max_query_len=q_len,
        max_seq_len=context,
        num_decodes=batch if q_len == 1 else 0,
        num_decode_tokens=t if q_len == 1 else 0,
        query_start_loc=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
    )
    q = torch.randn(t, heads, LORA + ROPE, dtype=torch.bfloat16, device=device) * 0.1
    return meta, q, kv, kv_scale


class Shape:
    """One benchmark shape's inputs, shared by every kernel timed on it."""

    def __init__(self, batch, context, heads, q_len, cache, device="cuda", shared=False):
        self.batch, self.context, self.heads, self.q_len = batch, context, heads, q_len
        self.cache, self.device = cache, device
        self.meta, self.q, self.kv, self.kv_scale = make_decode_batch(
            batch, context, heads, q_len=q_len, cache=cache, device=device, shared=shared
        )
        self.scale = (128 + 64) ** -0.5
        self.kv_bytes = batch * context * (LORA + ROPE) * self.kv.element_size()
        self.flops = batch * q_len * heads * context * FLOPS_PER_KEY_HEAD

    def kv_gbps(self, us: float) -> float:
        """The KV bytes read per second, in GB/s, by a call taking `us` microseconds."""
        return self.kv_bytes / (us * 1e-6) / 1e9

    def new_out(self):
        t = self.q.shape[0]
        return torch.empty(t, self.heads, LORA, dtype=self.q.dtype, device=self.device)

    def plan(self, config=None, num_splits=None, **token_plan):
        """The step's plan as the builder makes it; `token_plan`: `out` buffers, the
        host's `query_start_loc_cpu` and the `identity` rows, as `plan_mla_decode` takes
        them."""
        from atom_plugin.attention.mla.gluon.probe import MLAStepLayout
        from atom_plugin.attention.mla.plan import plan_mla_decode

        return plan_mla_decode(
            self.meta,
            self.q.shape[0],
            self.heads,
            kernel_impl="triton",
            kv_dtype=self.kv.dtype,
            config=config,
            num_splits=num_splits,
            layout=MLAStepLayout(self.q.dtype, PAGE, LORA, ROPE),
            **token_plan,
        )

    def run_new(self, out, plan):
        from atom_plugin.attention.mla.triton import mla_decode_triton

        return mla_decode_triton(
            self.q,
            self.kv,
            self.meta,
            scale=self.scale,
            output=out,
            kv_scale=self.kv_scale,
            plan=plan,
        )

    def time_new(self, flush, config=None, num_splits=None):
        out, plan = self.new_out(), self.plan(config, num_splits)
        us = time_us(lambda: self.run_new(out, plan), flush=flush)
        return us, out, plan

    def sdpa(self):
        """SDPA over the rows gathered contiguously (gather not timed): all heads as
        one length-H query (times q_len tokens, causal) over one shared key/value head."""
        b, ctx, h, ql = self.batch, self.context, self.heads, self.q_len
        rows = self.kv[self.meta.block_table.long()].reshape(b, -1, LORA + ROPE)[:, :ctx]
        k = rows.unsqueeze(1)
        v = rows[..., :LORA].unsqueeze(1)
        qq = self.q.view(b, ql * h, LORA + ROPE).unsqueeze(1)  # [B, 1, q_len * H, 576]
        mask = None
        if ql > 1:  # query token j sees ctx - q_len + j + 1 keys
            j = torch.arange(ql, device=self.device).repeat_interleave(h)
            mask = torch.arange(ctx, device=self.device)[None, :] <= (ctx - ql + j)[:, None]
        f = torch.nn.functional.scaled_dot_product_attention
        return lambda: f(qq, k, v, attn_mask=mask, scale=self.scale)

    def time_sdpa(self, flush):
        b, ql, h = self.batch, self.q_len, self.heads
        try:
            call = self.sdpa()
            res = call()
            us = time_us(call, flush=flush)
        except Exception as exc:
            return None, None, repr(exc)[:120]
        return us, res.squeeze(1).reshape(b * ql, h, LORA), None


def _maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def target_of(heads: int, batch: int, context: int, q_len: int) -> str | None:
    """The kernel's target for a one-token shape, as a short label; None where none."""
    if q_len != 1:
        return None
    if heads == 16 and batch >= 32:
        return "85% copy"
    if heads == 16 and batch == 1 and context >= 32768:
        return "50% copy"
    if heads == 64 and batch >= 32:
        return "70% limit"
    if heads == 128 and batch >= 32:
        return "550 TFLOP/s"
    return None


def target_met(row: dict) -> bool | None:
    t = row["target"]
    if t is None:
        return None
    if t.endswith("copy"):
        return row["frac_copy"] >= int(t.split("%")[0]) / 100
    if t.endswith("limit"):
        return row["frac_limit"] >= 0.70
    return row["tflops"] >= 550


def bench_shape(shape, flush, copy_gbps, matmul_rate, with_sdpa=True, configs=()) -> dict:
    us, out, plan = shape.time_new(flush)
    limit_us = max(shape.kv_bytes / (copy_gbps * 1e3), shape.flops / (matmul_rate * 1e6))
    row = {
        "heads": shape.heads,
        "cache": shape.cache,
        "batch": shape.batch,
        "context": shape.context,
        "q_len": shape.q_len,
        "kernel": plan.launch.name,
        "num_splits": plan.launch.num_splits,
        "merge_block_s": plan.launch.merge_block_s,
        "tokens_per_program": plan.launch.tokens,
        "us": us,
        "kv_gbps": shape.kv_gbps(us),
        "tflops": shape.flops / (us * 1e-6) / 1e12,
        "limit_us": limit_us,
        "frac_limit": limit_us / us,
        "target": target_of(shape.heads, shape.batch, shape.context, shape.q_len),
    }
    row["frac_copy"] = row["kv_gbps"] / copy_gbps
    row["frac_matmul"] = row["tflops"] / matmul_rate
    row["met"] = target_met(row)
    row["configs"] = [_time_config(shape, flush, config, out) for config in configs]
    if with_sdpa and shape.cache == "bf16":
        row["sdpa_us"], sdpa_out, err = shape.time_sdpa(flush)
        if err:
            row["sdpa_error"] = err
        else:
            row["maxdiff_vs_sdpa"] = _maxdiff(out, sdpa_out)
    return row


def _time_config(shape, flush, config: dict, reference) -> dict:
    """One chosen launch configuration on `shape`: its time, what ran and how far its
    output is from the plan's own; an error where the configuration cannot run here.
    A config's "num_splits" fixes the split count (`split_count_apart`)."""
    launch_config, num_splits = split_count_apart(config)
    try:
        us, out, plan = shape.time_new(flush, launch_config, num_splits)
    except Exception as exc:  # a chosen config may not run here: Gluon's limits, shared memory
        return {"config": config, "error": f"{type(exc).__name__}: {exc}"[:200]}
    launch = plan.launch
    return {
        "config": config,
        "us": us,
        "kernel": launch.name,
        "num_splits": launch.num_splits,
        "maxdiff": _maxdiff(reference, out),
    }


def split_count_apart(config: dict) -> tuple[dict | None, int | None]:
    """A --configs entry as the plan takes it: its launch config (None where it names only
    a split count: the plan's own kernel) and its "num_splits" (None: the plan's)."""
    launch_config = {k: v for k, v in config.items() if k != "num_splits"}
    return launch_config or None, config.get("num_splits")


def parse_configs(text: str, caches) -> list[dict]:
    """`--configs`: a JSON list of launch configurations, each checked as the plan would
    check it for every cache asked (a "num_splits" key: an int in [1, MAX_SPLITS], the
    split count the plan is given); a ValueError names what is wrong."""
    from atom_plugin.attention.mla.launch_plan import MAX_SPLITS, check_config

    try:
        configs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--configs {text!r} is not JSON ({exc})") from None
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError(
            f'--configs {text!r}: give a JSON list of objects, e.g. [{{"BLOCK_N": 64}}]'
        )
    for config in configs:
        launch_config, splits = split_count_apart(config)
        if splits is not None and (type(splits) is not int or not 1 <= splits <= MAX_SPLITS):
            raise ValueError(
                f"--configs: {json.dumps(config)}: num_splits={splits!r} must be an int in "
                f"[1, {MAX_SPLITS}]"
            )
        for cache in caches if launch_config else ():
            try:
                check_config(launch_config, fp8_cache=cache == "fp8")
            except ValueError as exc:
                raise ValueError(
                    f"--configs: {json.dumps(config)} ({cache} cache): {exc}"
                ) from None
    return configs


def run_mla_benchmarks(
    heads=HEADS,
    batches=BATCHES,
    contexts=CONTEXTS,
    caches=CACHES,
    spec_shapes=SPEC_SHAPES,
    *,
    copy_gbps: float | None = None,
    matmul_rate: float | None = None,
    flush: L2Flusher | None = None,
    with_sdpa: bool = True,
    device="cuda",
    configs=(),
    shared: bool = False,
) -> list[dict]:
    """One row per (heads, cache, batch, context, query tokens); both limits measured
    here unless the caller measured them already. `shared`: every request of a shape
    reads the same blocks (a shared prefix; the KV bytes counted are still per request)."""
    copy_gbps = copy_gbps or copy_bandwidth_gbps(device)
    matmul_rate = matmul_rate or matmul_tflops(device)
    flush = flush or L2Flusher(device)
    shapes = [(b, c, 1) for b in batches for c in contexts] + list(spec_shapes)
    rows = []
    for h in heads:
        for cache in caches:
            for b, c, ql in shapes:
                shape = Shape(b, c, h, ql, cache, device, shared=shared)
                rows.append(bench_shape(shape, flush, copy_gbps, matmul_rate, with_sdpa, configs))
                print(_row_line(rows[-1]), flush=True)
                del shape
                torch.cuda.empty_cache()
    for row in rows:
        row["copy_gbps"], row["matmul_tflops"] = copy_gbps, matmul_rate
    return rows


def _merge(r: dict) -> str:
    """The merge's split tile (`launch_plan.merge_block_s`); none at one split."""
    return (
        f" (merge BLOCK_S {r['merge_block_s']})"
        if r.get("num_splits", 1) > 1 and "merge_block_s" in r
        else ""
    )


def _row_line(r: dict) -> str:
    return (
        f"H={r['heads']} {r['cache']} B={r['batch']} ctx={r['context']} q={r['q_len']}: "
        f"{r['us']:.1f} us, {100 * r['frac_copy']:.1f}% copy, {r['tflops']:.0f} TFLOP/s, "
        f"{100 * r['frac_limit']:.1f}% limit, {r['kernel']} x {r['num_splits']} splits"
        f"{_merge(r)}"
    )


def format_table(rows: list[dict]) -> str:
    n = max((len(r.get("configs", ())) for r in rows), default=0)
    extra = "".join(f" config {k + 1} us |" for k in range(n))
    lines = [
        "| heads | cache | batch | context | q | kernel | us | KV GB/s "
        "| of copy BW | TFLOP/s | of matmul | of limit | SDPA us | target | met |" + extra,
        "|---:|:---|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|:---|:---|"
        + "---:|" * n,
    ]
    for r in rows:
        sdpa = f"{r['sdpa_us']:.1f}" if r.get("sdpa_us") else "n/a"
        met = {None: "", True: "met", False: "missed"}[r["met"]]
        cells = "".join(f" {_config_cell(c, r['us'])} |" for c in r.get("configs", ()))
        lines.append(
            f"| {r['heads']} | {r['cache']} | {r['batch']} | {r['context']} | {r['q_len']} | "
            f"{r['kernel']} | {r['us']:.1f} | {r['kv_gbps']:.0f} | "
            f"{100 * r['frac_copy']:.1f}% | {r['tflops']:.0f} | {100 * r['frac_matmul']:.1f}% | "
            f"{100 * r['frac_limit']:.1f}% | "
            f"{sdpa} | {r['target'] or ''} | {met} |" + cells
        )
    configs = next((r["configs"] for r in rows if r.get("configs")), [])
    if configs:
        lines.append("")
        lines += [f"config {k + 1}: `{json.dumps(c['config'])}`" for k, c in enumerate(configs)]
    return "\n".join(lines)


def _config_cell(c: dict, plan_us: float) -> str:
    """A chosen configuration's time and its ratio to the plan's (below 1: faster)."""
    if "error" in c:
        return "cannot run"
    return f"{c['us']:.1f} ({c['us'] / plan_us:.2f}x, {c['kernel']} x {c['num_splits']})"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--markdown", help="write the table as markdown here")
    p.add_argument("--heads", default=",".join(map(str, HEADS)), help="comma-separated")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated")
    p.add_argument("--caches", default=",".join(CACHES), help="comma-separated: bf16, fp8")
    p.add_argument("--no-spec", action="store_true", help="leave out the SPEC_SHAPES rows")
    p.add_argument(
        "--shared",
        action="store_true",
        help="every request of a shape reads the same blocks (a shared prefix, as prefix "
        "caching shares a prompt's)",
    )
    p.add_argument(
        "--configs",
        default="[]",
        help="JSON list of launch configurations timed beside the plan's own on every row",
    )
    args = p.parse_args(argv)
    bad = sorted(set(args.caches.split(",")) - set(CACHES))
    if bad:
        p.error(f"unknown caches {bad}; choose from {', '.join(CACHES)}")
    try:
        configs = parse_configs(args.configs, args.caches.split(","))
    except ValueError as exc:
        p.error(str(exc))
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    facts = run_facts()
    copy_gbps, matmul_rate, flush = copy_bandwidth_gbps(), matmul_tflops(), L2Flusher()
    header = (
        f"{facts}; copy bandwidth {copy_gbps:.0f} GB/s (read+write); dense bf16 matmul "
        f"{matmul_rate:.0f} TFLOP/s"
        + ("; every request reads one shared context's blocks" if args.shared else "")
    )
    print(header, flush=True)
    result = {"run": facts, "copy_gbps": copy_gbps, "matmul_tflops": matmul_rate}
    rows = run_mla_benchmarks(
        _ints(args.heads),
        _ints(args.batches),
        _ints(args.contexts),
        tuple(args.caches.split(",")),
        () if args.no_spec else SPEC_SHAPES,
        copy_gbps=copy_gbps,
        matmul_rate=matmul_rate,
        flush=flush,
        configs=configs,
        shared=args.shared,
    )
    result["rows"] = rows
    table = format_table(rows)
    print(header)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
