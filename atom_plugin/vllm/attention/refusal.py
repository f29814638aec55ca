"""What a user reads when the attention backend they named cannot run a model's layers:
each of vLLM's reasons (`AttentionBackend.validate_configuration`, terse strings such as
"head_size not supported") given with the layer's value and what the backend takes."""

from __future__ import annotations


def backend_refusal(backend, selector, reasons: list[str], flag: str, release: str) -> str:
    """The error for `backend` refusing the layer `selector` (vLLM's
    AttentionSelectorConfig) for `reasons`; `flag` is the user's option that chose it."""
    details = "; ".join(_detail(backend, selector, reason) for reason in reasons)
    return (
        f"{flag}: {backend.get_name()} cannot run this model's attention on vLLM {release}: "
        f"{details}. Without {flag} vLLM chooses one of its own backends"
    )


def _detail(backend, selector, reason: str) -> str:
    if reason == "head_size not supported":
        what = "head size (kv_lora_rank + qk_rope_head_dim)" if selector.use_mla else "head size"
        sizes = ", ".join(map(str, backend.get_supported_head_sizes()))
        return f"{what} {selector.head_size}; it takes {sizes}"
    if reason == "dtype not supported":
        dtypes = ", ".join(_dtype_name(d) for d in backend.supported_dtypes)
        return f"dtype {_dtype_name(selector.dtype)}; it takes {dtypes}"
    if reason == "kv_cache_dtype not supported":
        kinds = ", ".join(backend.supported_kv_cache_dtypes)
        return f"KV cache dtype {selector.kv_cache_dtype}; it takes {kinds}"
    if reason == "block_size not supported":
        sizes = ", ".join(_block_size(s) for s in backend.get_supported_kernel_block_sizes())
        return f"block size {selector.block_size}; it takes {sizes}"
    if reason == "sparse not supported":
        return (
            "sparse MLA (the layers of DeepSeek-V3.2 and other models whose indexer picks "
            "the keys); it runs dense MLA only"
        )
    return reason


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _block_size(size) -> str:
    base = getattr(size, "base", None)  # vLLM's MultipleOf
    return f"any multiple of {base}" if base is not None else str(size)
