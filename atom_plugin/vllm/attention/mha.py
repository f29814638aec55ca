"""ATOM_AITER: vLLM's paged MHA attention on the plugin's kernels.

The kernels (AITER, Triton or the torch reference: `atom_plugin.attention.select`)
live in `atom_plugin.attention`; this module only adapts vLLM's metadata and
cache tensors to them. The builder plans each step's kernel path once
(`mha.planner.plan_mha`); every layer's call runs that plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from atom_plugin.attention.dtypes import ACTIVATION_DTYPES
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha import ops
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mha.planner import plan_mha, prepare_mha_plans
from atom_plugin.attention.select import select_kernel_impl

HEAD_SIZES = [64, 128, 256]
BLOCK_SIZE_BASE = 16
# What every kernel path takes, for both backends (MHA and MLA).
SUPPORTED_DTYPES: list[torch.dtype] = list(ACTIVATION_DTYPES)
SUPPORTED_KV_CACHE_DTYPES: list[str] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]


class AtomAiterBackend(AttentionBackend):
    forward_includes_kv_cache_update = False
    supported_dtypes: ClassVar[list[torch.dtype]] = SUPPORTED_DTYPES
    supported_kv_cache_dtypes: ClassVar[list[str]] = SUPPORTED_KV_CACHE_DTYPES

    @staticmethod
    def get_name() -> str:
        return "ATOM_AITER"

    @staticmethod
    def get_impl_cls() -> type[AtomAiterImpl]:
        return AtomAiterImpl

    @staticmethod
    def get_builder_cls() -> type[AtomAiterMetadataBuilder]:
        return AtomAiterMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(BLOCK_SIZE_BASE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return HEAD_SIZES

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True


class AtomAiterMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    # Graphs hold batches whose requests all have one query length.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int = 1  # decodes first, as the metadata expects

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # The kernel path depends on the device only: chosen once, planned every step.
        device = torch.device(device)
        self.kernel_impl = select_kernel_impl(device)
        prepare_mha_plans(device, self.kernel_impl)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PagedAttentionMetadata:
        cam = common_attn_metadata
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold
        )
        num_reqs = cam.num_reqs
        meta = PagedAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            query_start_loc=cam.query_start_loc[: num_reqs + 1],
            seq_lens=cam.seq_lens[:num_reqs],
            # All rows: a graph replay cuts micro-batches at the padded bucket.
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping[: cam.num_actual_tokens],
        )
        meta.plan = plan_mha(
            meta,
            device=self.device,
            num_kv_heads=self.kv_cache_spec.num_kv_heads,
            block_size=self.kv_cache_spec.block_size,  # the kernel's block size
            impl=self.kernel_impl,
        )
        return meta

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """Capture with the longest context: the plan's launch sizes (decode splits) are
        baked into the graph and must hold for every context a replay sees."""
        max_len = self.vllm_config.model_config.max_model_len
        cam = replace(common_attn_metadata, max_seq_len=max_len)
        return self.build(common_prefix_len=0, common_attn_metadata=cam)


class AtomAiterImpl(AttentionImpl[PagedAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "logits_soft_cap": logits_soft_cap or None,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"ATOM_AITER does not support {name}={value!r}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"ATOM_AITER supports attention type {AttentionType.DECODER.value!r}, "
                f"not {attn_type!r}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self._quantized_cache = is_quantized_kv_cache(kv_cache_dtype)  # read on every layer call
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        if sinks is not None and sinks.shape[0] != num_heads:
            raise ValueError(f"sinks has {sinks.shape[0]} entries for {num_heads} query heads")
        self._params_fixed = AttentionParams(self.scale, sliding_window, sinks)
        self._write_impl: str | None = None  # chosen on the first cache write

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[blocks, kv_heads, block, 2*D] -> two [blocks, block, kv_heads, D] views."""
        if self._quantized_cache:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return key_cache, value_cache

    def _scales(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self._quantized_cache:
            return None, None
        return layer._k_scale, layer._v_scale

    def _params(self, layer) -> AttentionParams:
        """With an fp8 cache, made per call: vLLM may replace the layer's scale tensors
        after weight loading."""
        if not self._quantized_cache:
            return self._params_fixed
        k_scale, v_scale = self._scales(layer)
        return replace(self._params_fixed, k_scale=k_scale, v_scale=v_scale)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # the target layer wrote this cache
        # vLLM hands the cache update no metadata, so no plan: the path is picked once.
        if self._write_impl is None:
            self._write_impl = select_kernel_impl(key.device)
        key_cache, value_cache = self._caches(kv_cache)
        k_scale, v_scale = self._scales(layer)
        ops.write_kv(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, self._write_impl
        )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PagedAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ATOM_AITER does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._caches(kv_cache)
        ops.paged_attention(
            query[:n].view(n, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            attn_metadata,
            self._params(layer),
            output[:n].view(n, self.num_heads, self.head_size),
        )
        return output
