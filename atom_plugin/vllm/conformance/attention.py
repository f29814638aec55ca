"""What the attention checks ask of vLLM: its backend base class and enum, and a backend's
impl, builder and `CommonAttentionMetadata` made the way vLLM's Attention layer makes them."""

from __future__ import annotations

import functools

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec

from atom_plugin.vllm.registration import dotted


def is_backend(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, AttentionBackend)


def enum_problem(name: str, class_path: str, backend) -> str | None:
    """Why the enum member vLLM resolves `--attention-backend name` to does not load
    `backend` (registering `class_path` under `name` first if vLLM lacks it), or None."""
    if name not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(name, dotted(class_path))
    member = AttentionBackendEnum[name]
    if member.get_class() is not backend:
        return f"AttentionBackendEnum[{name}] loads {member.value}, not this class"
    return None


def is_block_size(size) -> bool:
    """A kernel block size as vLLM reads it: a positive int or a `MultipleOf`."""
    return isinstance(size, MultipleOf) or (isinstance(size, int) and size > 0)


def block_base(size) -> int:
    return size.base if isinstance(size, MultipleOf) else size


def make_impl(backend, *, hq: int, hkv: int, head_size: int):
    """The backend's impl of a decoder layer, made with the ten positional arguments
    vLLM's Attention layer passes (unquantized cache, no ALiBi, window or soft cap)."""
    d = head_size
    return backend.get_impl_cls()(
        hq, d, d**-0.5, hkv, None, None, "auto", None, AttentionType.DECODER, None
    )


def make_builder(backend, *, block: int, hkv: int, head_size: int, dtype: torch.dtype):
    """The backend's metadata builder for one full-attention layer on CPU."""
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=head_size, dtype=dtype)
    return backend.get_builder_cls()(spec, ["layer.0"], _default_config(), torch.device("cpu"))


@functools.cache
def _default_config() -> VllmConfig:
    """vLLM's default config (no model), as vLLM's own builder tests use; made once."""
    return VllmConfig()


def common_metadata(meta, slots: torch.Tensor) -> CommonAttentionMetadata:
    """vLLM's `CommonAttentionMetadata` for a `PagedAttentionMetadata` batch, with `slots`
    (padding rows included) as its slot mapping."""
    return CommonAttentionMetadata(
        query_start_loc=meta.query_start_loc,
        query_start_loc_cpu=meta.query_start_loc.clone(),
        seq_lens=meta.seq_lens,
        num_reqs=meta.num_reqs,
        num_actual_tokens=meta.num_actual_tokens,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        block_table_tensor=meta.block_table,
        slot_mapping=slots,
    )
