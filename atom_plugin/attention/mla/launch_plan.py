"""The Triton MLA decode's launch policy, planned once per step on the host from the
step's sizes (`mla.plan.plan_mla_decode` calls `plan_launch`): which stage-1 kernel runs
(`choose_kernel`: Gluon, packed or per-token), its tiles, warps and stages
(`default_config`, tunable through `config`), how many heads and query tokens a program
holds, the KV split count (`best_num_splits`), the Gluon kernel's schedule
(`gluon_schedule`), the merge's columns per program (`merge_block_dv`) and its split
tile (`merge_block_s`). Correctness does not depend on the split count; the rules aim at
speed, and the H200 measurements behind them are in docs/benchmarks.md as of 7b425cd
("Attention (MLA)").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from atom_plugin.attention.mla.gluon import shapes as gluon_shapes
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout, gluon_mla_problems
from atom_plugin.attention.triton_common import cdiv, device_sm_count, next_power_of_2

MAX_SPLITS = 256  # KV splits per request; stage 2 merges them MERGE_BLOCK_S at a time
MERGE_BLOCK_S = 64  # the widest merge split tile; more splits merge in a chunked loop
MERGE_MIN_BLOCK_S = 2  # the narrowest (one split never merges)
MERGE_MIN_DV = 32  # the narrowest merge program (output columns)
MERGE_CHUNKED_DV = 128  # columns per merge program: many splits, fewer rows than SMs
MIN_KEYS_PER_SPLIT = 64  # shorter splits cost more in partial results than they win


PER_TOKEN_MAX_KEYS = 8192  # requests x context up to which 16 heads run per token


def choose_kernel(
    num_heads: int,
    num_reqs: int,
    context: int,
    packed_splits: int,
    gluon: bool = False,
    max_query_len: int = 1,
) -> str:
    """The stage-1 kernel for a step: 'gluon', 'packed' or 'per_token', the fastest on
    the H200 for such steps. `gluon`: the warpgroup-MMA kernel can run the step
    (`gluon.probe`). It runs above 16 heads, and at 16 heads where its 64 query rows
    fill up (speculative tokens) or the packed plan needs more than one merge pass of
    splits (batch 1, long contexts); elsewhere at 16 heads the packed kernel is as fast
    on a 16-bit cache (on an fp8 cache `plan_launch` runs Gluon's rows16 schedule where
    this picks either, one query token a request).
    Without it: above 16 heads packing one query token per program gains nothing, so the
    packed kernel runs only where its plan needs more than MERGE_BLOCK_S splits; at 16
    heads it runs everywhere but the smallest steps (requests x context up to
    PER_TOKEN_MAX_KEYS), where the per-token kernel is faster."""
    many_splits = packed_splits > MERGE_BLOCK_S
    if gluon and (num_heads > 16 or max_query_len > 1 or many_splits):
        return "gluon"
    if num_heads > 16:
        return "packed" if many_splits else "per_token"
    return "per_token" if num_reqs * context <= PER_TOKEN_MAX_KEYS else "packed"


def default_config(
    num_heads: int, fp8_cache: bool = False, kernel: str = "packed", max_query_len: int = 1
) -> dict:
    """Launch parameters per kernel, head count, cache kind and query tokens per
    request. `BLOCK_H`: heads per program; `BLOCK_M`: query rows per program (heads x
    packed tokens of one request); `per_sm`: programs the split rule assumes run at
    once on one SM; `fp8_math`: the matmul dtype for an fp8 cache ("fp16": e4m3 widens
    in one instruction per pair; "bf16"). `tma`: load whole tiles through TMA tensor
    descriptors - True requires it, False never, None whenever the cache allows it on
    a CUDA GPU with TMA. `merge_dv`: output columns per merge program (None:
    `merge_block_dv`'s rule). The packed kernel's values are the fastest of the H200
    sweeps: at 16 heads and one query token 32-key tiles five stages deep
    (Triton pipelines a tile whose page comes from the block table (stages - 1) // 2
    tiles ahead: two here, in 93.7 KB of shared memory, so two programs still share an
    SM), fp8 through TMA widened to fp16; with speculative tokens 64-key tiles on 8
    warps, one program per SM; above 16 heads, 64 heads x 64 keys per step on 8 warps,
    fp8 through pointer loads widened to bf16. The per-token kernel's fp8 tiles always
    take pointer loads."""
    if kernel == "gluon":  # tiles, warps and stages are the kernel's own (gluon_shapes)
        return {"BLOCK_H": 64, "per_sm": 1, "merge_dv": None, "schedule": None}
    if kernel == "per_token":
        small = num_heads <= 16
        return {
            "BLOCK_H": 16 if small else 64,
            "BLOCK_N": 32 if small else 64,
            "num_warps": 4 if small else 8,
            "num_stages": 2,
            "tma": False if fp8_cache else None,
            "merge_dv": None,
        }
    if num_heads <= 16:
        wide = max_query_len > 1
        # Five stages fetch two key tiles ahead; for four query tokens (64 rows) on 64-key
        # 16-bit tiles that takes 296 KB of shared memory, past the 227 KB of a Hopper
        # SM, and four stages fetch one ahead in 222 KB.
        many_rows = max_query_len > 2 and not fp8_cache
        return {
            "BLOCK_H": 16,
            "BLOCK_M": 64,
            "BLOCK_N": 64 if wide else 32,
            "num_warps": 8 if wide else 4,
            "num_stages": 4 if many_rows else 5,
            "tma": None,
            "per_sm": 1 if wide else 2,
            "fp8_math": "fp16",
            "merge_dv": None,
        }
    return {
        "BLOCK_H": 64,
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "num_warps": 8,
        "num_stages": 2,
        "tma": False if fp8_cache else None,
        "per_sm": 1,
        "fp8_math": "bf16",
        "merge_dv": None,
    }


KERNELS = ("packed", "per_token", "gluon")


def _config(
    num_heads: int, fp8_cache: bool, kernel: str, config: dict, max_query_len: int = 1
) -> dict:
    cfg = default_config(num_heads, fp8_cache, kernel, max_query_len)
    unknown = sorted(set(config) - set(cfg))
    if unknown:
        raise ValueError(
            f"unknown {kernel} MLA decode config keys {unknown}; valid keys: "
            f"{sorted(cfg) + ['kernel']}"
        )
    cfg.update(config)
    if cfg.get("tma") not in (None, True, False):
        raise ValueError(f"tma must be None, True or False, got {cfg['tma']!r}")
    if cfg.get("fp8_math", "fp16") not in ("fp16", "bf16"):
        raise ValueError(f"fp8_math must be 'fp16' or 'bf16', got {cfg['fp8_math']!r}")
    if cfg.get("schedule") not in (None, *GLUON_SCHEDULES):
        raise ValueError(
            f"schedule must be None (the rule) or one of {GLUON_SCHEDULES}, got {cfg['schedule']!r}"
        )
    if fp8_cache and cfg.get("schedule") in SIXTEEN_BIT_SCHEDULES:
        raise ValueError(
            f"the {cfg['schedule']} schedule takes 16-bit caches only (fp8: 'lockstep')"
        )
    if not fp8_cache and cfg.get("schedule") == "rows16":
        raise ValueError("the rows16 schedule takes fp8 caches only (16-bit: 'lockstep')")
    dv = cfg["merge_dv"]
    if dv is not None and (not isinstance(dv, int) or dv < 16 or dv & (dv - 1)):
        raise ValueError(f"merge_dv must be None or a power of two >= 16, got {dv!r}")
    if kernel == "per_token" and fp8_cache and cfg["tma"] is not False:
        raise ValueError(
            f"the per_token kernel reads fp8 tiles through pointer loads only (tma={cfg['tma']})"
        )
    return cfg


def _split_kernel(config: dict | None, default: str | None) -> tuple[str | None, dict]:
    """A launch config's kernel (`default` where it names none) and its other keys."""
    rest = dict(config or {})
    kernel = rest.pop("kernel", default)
    if kernel not in (None, *KERNELS):
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel, rest


def check_config(config: dict, fp8_cache: bool, num_heads: int = 16) -> None:
    """Raises the ValueError `plan_launch` would for `config` (an unknown key, a bad
    value; the key list named), without a device or a step."""
    kernel, rest = _split_kernel(config, "packed")
    _config(num_heads, fp8_cache, kernel, rest)


# 'rows16' (`gluon.rows16`, fp8 caches, 16 query rows a program on mma.sync) is the plan's
# own choice for one query token of up to 16 heads where it can run (`rows16_problems`);
# above 16 heads or with speculative tokens it runs where a config names it.
GLUON_SCHEDULES = ("lockstep", "alternate", "scorer", "rows16")
SIXTEEN_BIT_SCHEDULES = ("alternate", "scorer")  # the warp-specialized ones: no fp8 path
ALTERNATE_MIN_TILES = 32  # 64-key tiles per program from which the alternate schedule runs
# Triton 3.8 compiles the alternate schedule with 560 bytes of spills, 69 local loads in
# one consumer warpgroup's tile loop (3.7.1: 100 bytes, none in a tile loop); on an
# H100 it ran 1.18-1.48x the lockstep schedule's time at the same split count on every
# 16-bit shape measured (docs/benchmarks.md as of 1003537, the run of 2026-12-07 at 09:03).
ALTERNATE_BEFORE_TRITON = (3, 8)


def gluon_schedule(
    named: str | None, fp8_cache: bool, num_heads: int, context: int, splits: int
) -> str:
    """The Gluon kernel's schedule: `named` if given, else 'alternate' (warp-specialized,
    warpgroups on alternate tiles) for 16-bit caches above 16 heads when each program
    scores at least ALTERNATE_MIN_TILES tiles and Triton is older than
    ALTERNATE_BEFORE_TRITON, else 'lockstep'. The alternate schedule is faster where each
    program has that many tiles to overlap, slower with fewer and at 16 heads; it takes
    16-bit caches only."""
    if named is not None:
        return named
    tiles = cdiv(context, splits * 64)
    wide = not fp8_cache and num_heads > 16
    compiles_well = _triton_version() < ALTERNATE_BEFORE_TRITON
    return "alternate" if wide and compiles_well and tiles >= ALTERNATE_MIN_TILES else "lockstep"


@dataclass(frozen=True)
class TritonMLALaunch:
    """The Triton decode's launch for one step, the same for every layer. `kernel`
    'packed': grid (head_groups, num_splits, num_reqs * token_chunks), `tokens` query
    tokens of a request per program; 'per_token': grid (head_groups, num_splits,
    tokens of the step)."""

    kernel: str
    block_h: int
    tokens: int
    token_chunks: int
    head_groups: int
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool | None
    fp8_cache: bool  # the cache kind the launch was planned for
    fp16_math: bool  # for an fp8 cache
    merge_block_dv: int  # output columns per merge program (`merge_block_dv`)
    merge_block_s: int  # splits per merge tile (`merge_block_s`)
    schedule: str = "lockstep"  # gluon: one of GLUON_SCHEDULES

    @property
    def name(self) -> str:
        """The stage-1 kernel this launch runs; the Gluon kernel with its schedule."""
        return f"gluon/{self.schedule}" if self.kernel == "gluon" else self.kernel


def plan_launch(
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    num_heads: int,
    context: int,
    device: torch.device,
    fp8_cache: bool = False,
    config: dict | None = None,
    num_splits: int | None = None,
    layout: MLAStepLayout | None = None,
) -> TritonMLALaunch:
    """Host-only launch planning from the step's sizes (no device reads): the kernel,
    heads and tokens per program, and the split count for `context` keys per request.
    `config` may name the kernel ('kernel': one of KERNELS); a config that names none
    tunes the packed kernel. `layout` (query dtype, block size, latent and rope widths)
    lets the plan pick the Gluon kernel where it can run; without it the plan keeps to
    the Triton kernels unless `config` names 'gluon'."""
    kernel, config = _split_kernel(config, "packed" if config else None)
    sms = device_sm_count(device)
    most = max(1, min(MAX_SPLITS, cdiv(context, MIN_KEYS_PER_SPLIT)))
    q_max = max(1, max_query_len)

    def packing(block_h: int, block_m: int):
        block_h = max(16, min(block_h, next_power_of_2(num_heads)))
        tokens = max(1, min(next_power_of_2(q_max), block_m // block_h))
        return block_h, tokens, cdiv(q_max, tokens), cdiv(num_heads, block_h)

    def split_count(programs: int, block_n: int, slots: int, most: int) -> int:
        if num_splits is not None:
            return num_splits
        tiles = max(1, cdiv(context, block_n))
        return best_num_splits(max(1, programs), tiles, slots, most)

    gluon, schedule = False, "lockstep"
    if kernel in (None, "gluon"):
        if layout is None:
            problems = ["the plan was given no step layout (query dtype, block size, widths)"]
        else:
            problems = gluon_mla_problems(device, layout)
        if kernel == "gluon" and problems:
            raise ValueError("the gluon MLA kernel cannot run this step: " + "; ".join(problems))
        gluon = not problems
    if kernel in (None, "packed"):
        cfg = _config(num_heads, fp8_cache, "packed", config, max_query_len)
        block_h, tokens, token_chunks, head_groups = packing(cfg["BLOCK_H"], cfg["BLOCK_M"])
        splits = split_count(
            num_reqs * token_chunks * head_groups, cfg["BLOCK_N"], sms * cfg["per_sm"], most
        )
        if kernel is None:
            kernel = choose_kernel(num_heads, num_reqs, context, splits, gluon, max_query_len)
            # One query token of up to 16 heads on an fp8 cache: the rows16 schedule, 1.1-1.5x
            # faster than the packed kernel on an H100 where either runs (docs/benchmarks.md)
            rows16 = gluon and fp8_cache and num_heads <= 16 and q_max == 1
            if kernel != "per_token" and rows16 and not rows16_problems(layout):
                kernel, config = "gluon", {"schedule": "rows16"}
    elif kernel == "gluon" and config.get("schedule") == "rows16":
        # a config named it (the rule asks above before it picks it): say why it cannot run
        problems = rows16_problems(layout)
        if problems:
            raise ValueError("the rows16 schedule cannot run this step: " + "; ".join(problems))
    if kernel == "gluon":
        cfg = _config(num_heads, fp8_cache, "gluon", config, max_query_len)
        shape = gluon_shapes.launch_shape(cfg["schedule"])
        cfg.update(
            BLOCK_N=shape.block_n,
            num_warps=shape.num_warps,
            num_stages=shape.stages,
            per_sm=shape.per_sm,
            tma=True,
        )
        block_m = shape.block_m
        block_h, tokens, token_chunks, head_groups = packing(min(cfg["BLOCK_H"], block_m), block_m)
        splits = split_count(
            num_reqs * token_chunks * head_groups, cfg["BLOCK_N"], sms * cfg["per_sm"], most
        )
        schedule = gluon_schedule(cfg["schedule"], fp8_cache, num_heads, context, splits)
    if kernel == "per_token":
        cfg = _config(num_heads, fp8_cache, "per_token", config)
        block_h = max(16, min(cfg["BLOCK_H"], next_power_of_2(num_heads)))
        tokens = token_chunks = 1
        head_groups = cdiv(num_heads, block_h)
        splits = split_count(num_tokens * head_groups, cfg["BLOCK_N"], sms, MERGE_BLOCK_S)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={splits} must lie in [1, {MAX_SPLITS}]")
    merge_dv = cfg["merge_dv"] or merge_block_dv(num_tokens * num_heads, splits, sms)
    return TritonMLALaunch(
        kernel=kernel,
        block_h=block_h,
        tokens=tokens,
        token_chunks=token_chunks,
        head_groups=head_groups,
        num_splits=splits,
        block_n=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        tma=cfg["tma"],
        fp8_cache=fp8_cache,
        fp16_math=cfg.get("fp8_math", "fp16") == "fp16",
        merge_block_dv=merge_dv,
        merge_block_s=merge_block_s(splits),
        schedule=schedule,
    )


def rows16_problems(layout: MLAStepLayout | None) -> list[str]:
    """Why the rows16 schedule cannot run steps of `layout` on this Triton (empty: it can).
    Its cache, head and token limits are the plan's (`_config`, `plan_launch`)."""
    problems = []
    if _triton_version() < (3, 7):
        problems.append(
            "it needs Triton 3.7 or newer (its shared-memory views fail to compile in 3.6); "
            f"this is Triton {'.'.join(map(str, _triton_version()))}"
        )
    if layout is not None and (layout.kv_lora_rank, layout.rope) != (512, 64):
        problems.append(
            f"it takes 512 latent and 64 rope columns, not {layout.kv_lora_rank} and {layout.rope}"
        )
    return problems


@functools.cache
def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2])


def merge_block_dv(rows: int, splits: int, sms: int, dv: int = 512) -> int:
    """Output columns per merge program for `rows` (token, head) pairs. Fewer rows than
    half the SMs: programs narrowed, down to MERGE_MIN_DV, until they fill two waves.
    Otherwise 128 columns for fewer rows than SMs merging more than one pass of splits,
    else whole rows (narrower programs are slower once the rows alone fill the SMs)."""
    if rows < sms // 2:
        parts = next_power_of_2(cdiv(2 * sms, max(1, rows)))
        return max(min(dv, MERGE_MIN_DV), dv // parts)
    return min(dv, MERGE_CHUNKED_DV) if rows < sms and splits > MERGE_BLOCK_S else dv


def merge_block_s(splits: int) -> int:
    """Splits per merge tile: the next power of two holding `splits` (at least
    MERGE_MIN_BLOCK_S), at most MERGE_BLOCK_S, above which the merge takes them
    MERGE_BLOCK_S at a time. The merge is compute-bound on its tile, so a tile wider than
    the split count costs loads, exponentials and sums of rows that hold nothing. It
    compiles once per tile; under CUDA graphs a bucket's split count is fixed at capture,
    so those compiles happen in warm-up."""
    return min(MERGE_BLOCK_S, max(MERGE_MIN_BLOCK_S, next_power_of_2(splits)))


# A program's fixed cost (query load, partial-result store, its share of the merge) in
# key tiles; fitted to the H200 split sweep (docs/benchmarks.md as of 7b425cd).
SPLIT_OVERHEAD_TILES = 3


@functools.lru_cache(maxsize=4096)
def best_num_splits(programs: int, tiles: int, slots: int, most: int = MAX_SPLITS) -> int:
    """The split count with the least waves x (tiles per split + fixed cost), fewer splits
    on ties, at most `most` (and at most `tiles`); a wave is `slots` programs (SMs x
    programs resident per SM). Counting whole waves makes a count that leaves the last
    wave mostly empty lose to one that does not."""

    def cost(splits: int) -> int:
        return cdiv(programs * splits, slots) * (cdiv(tiles, splits) + SPLIT_OVERHEAD_TILES)

    return min(range(1, max(1, min(tiles, most)) + 1), key=cost)
