"""Pieces shared by the Triton kernels (MHA and MLA)."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # below this, partial-result traffic costs more than the split wins
# Programs of the MHA split-KV decode one SM holds at once, until a launch has shown the
# device's own figure (`triton_decode.programs_per_sm`): the H200's with Triton 3.6
DECODE_PROGRAMS_PER_SM = 3
# Decode programs an SM needs in flight to keep DRAM busy: a wave with fewer takes as long
# as one with this many (the H200 sweeps with 3 and 5 programs an SM, docs/benchmarks.md
# at 7b425cd)
SATURATING_PROGRAMS_PER_SM = 3
SPLIT_COST_TOLERANCE = 1.05
REGISTERS_PER_SM = 65536  # every NVIDIA GPU since Maxwell


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launch code: triton.cdiv is a constexpr function whose every
    host call costs microseconds, on a path taken once per layer per step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2, at plain-int cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def split_cap(max_seq_len: int) -> int:
    """The most KV splits a decode row of `max_seq_len` keys takes: MIN_TOKENS_PER_SPLIT
    keys a split at least, MAX_SPLITS at most, 1 always."""
    return max(1, min(MAX_SPLITS, cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)))


@functools.lru_cache(maxsize=4096)  # planned every step: a few tens of microseconds a miss
def choose_num_splits(
    num_rows: int,
    num_head_groups: int,
    max_seq_len: int,
    num_sms: int,
    programs_per_sm: int = DECODE_PROGRAMS_PER_SM,
) -> int:
    """KV splits per row of the split-KV decode: the fewest whose estimated time is within
    SPLIT_COST_TOLERANCE of the least; each split >= MIN_TOKENS_PER_SPLIT keys, at most
    MAX_SPLITS.

    Its rows x head groups x splits programs run in waves of programs_per_sm x num_sms,
    and a wave takes time in proportion to its programs an SM, but never less than
    SATURATING_PROGRAMS_PER_SM's: so a thin last wave costs nearly a full one, and
    splitting further once every SM holds enough programs only adds partial results. No
    split once the unsplit programs fill a wave: over several waves programs no longer
    start together, and a partial last wave costs less than this estimate says.
    """
    programs = max(1, num_rows * num_head_groups)
    cap = split_cap(max_seq_len)
    slots = programs_per_sm * num_sms
    if programs >= slots:
        return 1
    floor = min(SATURATING_PROGRAMS_PER_SM, programs_per_sm)
    cost = []
    for splits in range(1, cap + 1):
        full, rest = divmod(programs * splits, slots)
        waves = full * programs_per_sm
        if rest:
            waves += max(rest / num_sms, floor)
        cost.append(waves / (programs * splits))  # the time over the whole work
    least = min(cost)
    return next(s for s, c in enumerate(cost, 1) if c <= least * SPLIT_COST_TOLERANCE)


def occupancy(
    n_regs: int, shared: int, num_warps: int, max_threads: int, shared_per_sm: int
) -> int:
    """Programs of one compiled kernel an NVIDIA SM holds at once: the least that its
    threads, registers (allocated 256 a warp) and shared memory (1 KB reserved a program)
    allow; at least 1."""
    by_threads = max_threads // (32 * num_warps)
    by_registers = REGISTERS_PER_SM // (cdiv(n_regs * 32, 256) * 256 * num_warps)
    by_shared = shared_per_sm // (shared + 1024)
    return max(1, min(by_threads, by_registers, by_shared))


def device_sm_count(device: torch.device) -> int:
    """Multiprocessor count of a GPU; a small fixed count elsewhere (interpreter runs)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    """Read once per device: the decode wrappers ask on every layer's call."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_has_tma(device: torch.device) -> bool:
    """Whether a CUDA GPU has TMA tensor descriptors (compute capability 9.0+, not ROCm)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_has_tma(index)


@functools.cache
def _cuda_has_tma(index: int) -> bool:
    """Read once per device: the MLA decode asks on every layer's call."""
    return not torch.version.hip and torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def mm(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b in float32; UPCAST computes in float32 (the CPU interpreter's bf16 dot is wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def mm_acc(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, accumulating inside the MMA."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


def check_config_keys(cfg: dict, valid: tuple) -> None:
    """Raise ValueError naming the keys of a kernel config that are not in `valid`."""
    unknown = set(cfg) - set(valid)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; valid keys: {list(valid)}")


def dot_flags(query: torch.Tensor) -> dict:
    """Constexprs for `mm`: exact float32 products for float32 inputs and on the interpreter."""
    return dict(
        UPCAST=query.device.type == "cpu",
        PRECISION="ieee" if query.dtype == torch.float32 else None,  # None: the backend default
    )


@triton.jit
def fold_sinks(sink_ptrs, mask, m, l_sum, acc):
    """(l_sum, acc) with each row's attention sink folded in: the sink (natural-log units,
    any float dtype, read as float32) adds exp(sink) to the softmax denominator and no
    value. `m` is the rows' running max in log2 units; rows without keys stay at zero."""
    sink = tl.load(sink_ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    sink = sink * 1.4426950408889634
    m_fin = tl.maximum(m, sink)
    m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    alpha = tl.exp2(m - m_fin)
    return l_sum * alpha + tl.exp2(sink - m_fin), acc * alpha[:, None]


@triton.jit
def _pow2(e):
    """2**e for int32 e in the normal float32 range, built from the exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(x, limit, MIN_EXP: tl.constexpr, NEG_ZERO: tl.constexpr):
    """x saturated to +-limit and rounded to nearest-even on the e4m3 grid, as float32.

    The later cast to fp8 is then exact. Done by hand because the Triton CPU
    interpreter's float32 -> fp8 cast drops the carry when rounding up to the
    next power of two (7.8 -> 4.0); on GPUs it matches the hardware conversion.
    """
    bits = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), limit)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP) - 3  # 3 mantissa bits
    r = a * _pow2(-e)
    f = tl.floor(r)
    frac = r - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    up = (frac > 0.5) | ((frac == 0.5) & (odd == 1.0))
    y = tl.where(up, f + 1.0, f) * _pow2(e)
    if NEG_ZERO:  # e4m3fn has -0 and the cast keeps a zero's sign; e4m3fnuz has no -0
        return tl.where(bits < 0, -y, y)
    return tl.where((bits < 0) & (y > 0), -y, y)


def e4m3_min_exponent(dtype: torch.dtype) -> int:
    """Smallest normal exponent of an fp8 e4m3 format (-6 for e4m3fn, -7 for e4m3fnuz)."""
    return round(math.log2(torch.finfo(dtype).tiny))
