"""One call of each kind of kernel the CUDA-graph benchmarks launch (graph_node_cost runs
one once, graph_launch_cost captures it many times in a graph): each builder makes its
inputs once and returns the call, repeatable eagerly or under capture, and what it runs;
`capture` records copies of a call in one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HEADS = 16  # DeepSeek-V3 / Kimi at TP8

Call = tuple[Callable[[], object], str]


def capture(call: Callable[[], object], copies: int) -> torch.cuda.CUDAGraph:
    """`copies` calls of `call` in one CUDA graph; one call first, outside the capture, so
    Triton compiles and cuBLAS picks its kernels and workspace there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(copies):
            call()
    return graph


def aten_add() -> Call:
    x = torch.zeros(64, 1024, device="cuda", dtype=torch.bfloat16)
    return lambda: x.add_(1.0), "add_ (torch)"


def cublas_mm() -> Call:
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    out = torch.empty_like(x)
    return lambda: torch.mm(x, w, out=out), "torch.mm (cuBLAS)"


def triton_add() -> Call:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.zeros(4096, device="cuda")
    return lambda: add_one[(4,)](x, x.numel(), BLOCK=1024), "add_one (Triton)"


def triton_tma() -> Call:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def copy_tile(src_desc, dst_ptr, BLOCK: tl.constexpr):
        tile = src_desc.load([0, 0])
        rows, cols = tl.arange(0, BLOCK)[:, None], tl.arange(0, BLOCK)[None, :]
        tl.store(dst_ptr + rows * BLOCK + cols, tile)

    src = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    desc = TensorDescriptor(src, [64, 64], [64, 1], [64, 64])
    return lambda: copy_tile[(1,)](desc, dst, BLOCK=64), "copy_tile (Triton, TMA descriptor)"


def _write_inputs(tokens: int = 64):
    """A cache write's rows (latent, rope part as vLLM's MLA layer hands it), a bf16
    cache of 8 blocks and the rows' slots."""
    from benchmarks.attention_mla import LORA, PAGE, ROPE

    dtype = torch.bfloat16
    kv_c = torch.randn(tokens, LORA, device="cuda").to(dtype)
    k_pe = torch.randn(tokens, 1, ROPE, device="cuda").to(dtype)
    cache = torch.zeros(8, PAGE, LORA + ROPE, device="cuda", dtype=dtype)
    return kv_c, k_pe, cache, torch.arange(tokens, device="cuda", dtype=torch.int64)


def mla_write() -> Call:
    """The plugin's MLA cache write of 64 tokens."""
    from atom_plugin.attention.mla import ops

    kv_c, k_pe, cache, slots = _write_inputs()

    def write():
        ops.write_mla_kv(kv_c, k_pe, cache, slots, kernel_impl="triton")

    return write, "write_mla_kv (Triton)"


def mla_decode(batch: int, context: int, q_len: int, kernel: str | None = None) -> Call:
    """The plugin's MLA decode at 16 heads on the step's own plan (bf16 cache); `kernel`,
    where given, must be the plan's choice."""
    from benchmarks.attention_mla import Shape

    shape = Shape(batch, context, HEADS, q_len, "bf16")
    plan, out = shape.plan(), shape.new_out()
    launch = plan.launch
    if kernel is not None and launch.kernel != kernel:
        raise SystemExit(f"the planner chose {launch.kernel!r} where {kernel!r} was asked")
    ran = f"mla_decode {launch.kernel}/{launch.schedule} splits {launch.num_splits}"
    return lambda: shape.run_new(out, plan), ran


def vllm_cache_write(kv_c, k_pe, cache, slots) -> Callable[[], object]:
    """vLLM's own MLA cache write (`concat_and_cache_mla`) of these rows; `k_pe` as the
    plugin's write takes it, [tokens, 1, rope]. Raises where vLLM's CUDA ops are absent."""
    from vllm import _custom_ops

    torch.ops._C_cache_ops.concat_and_cache_mla  # noqa: B018 (vLLM's CUDA build only)
    scale = torch.ones(1, device=cache.device)
    k_pe = k_pe.squeeze(1)

    def write():
        _custom_ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", scale)

    return write


def vllm_write() -> Call:
    """vLLM's own MLA cache write of 64 tokens."""
    return vllm_cache_write(*_write_inputs()), "concat_and_cache_mla (vLLM)"


def vllm_fa3() -> Call:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q, k, v = (torch.randn(64, HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)

    def fa3():
        flash_attn_varlen_func(q, k, v, 64, cu, 64, cu_seqlens_k=cu, causal=True, fa_version=3)

    return fa3, "flash_attn_varlen_func (FA3), 1 x 64 tokens"
