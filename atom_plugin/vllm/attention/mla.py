"""ATOM_AITER_MLA: vLLM's MLA machinery with the plugin's decode and cache-write ops.

vLLM's `MLAAttention` layer drives everything: it writes the latent cache through
`do_kv_cache_update`, runs prefill itself (the common impl's `forward_mha` with the
platform's MLA prefill backend: flash-attn on CUDA, AITER on ROCm, dense SDPA on CPU)
and hands decode tokens, already absorbed to `[B, H, 576]`, to `forward_mqa`. This
backend supplies the decode (`mla.ops.mla_decode`: AITER, Triton or the torch
reference, whichever path the builder's per-step plan belongs to) and the cache write
(`mla.ops.write_mla_kv`, on the path the impl resolves at its first write).

Decode rows may carry several query tokens (speculative verification, and prefill rows
of up to `PREFILL_ROWS_ON_DECODE` new tokens: any mix of lengths,
`QueryLenSupport.VARLEN`); they are causal. Under decode context parallelism the cache
holds this rank's share of each context; single-token rows see all of it
(`dcp_local_seq_lens`), multi-token rows see the local rows whose global position is at
most their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
    get_mla_dims,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    max_decode_query_len,
)
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.aiter import unit_scale
from atom_plugin.attention.mla import ops as mla_ops
from atom_plugin.attention.mla.checks import dequantized_query
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout, gluon_mla_problems
from atom_plugin.attention.mla.plan import (
    MLAPlan,
    mla_token_plan,
    plan_mla_decode,
    takes_prefill_rows,
)
from atom_plugin.attention.select import select_kernel_impl
from atom_plugin.vllm.attention.mha import SUPPORTED_DTYPES, SUPPORTED_KV_CACHE_DTYPES

logger = init_logger("vllm.atom_plugin")

# The longest prefill row (new tokens of one request) vLLM's MLA layer hands this
# backend's decode rather than its MHA prefill: a prefix-cache hit's remainder, a chunked
# prefill's tail, a short prompt. The MHA prefill up-projects every cached context row
# (kv_b_proj: 512 -> heads x 256, 131,072 multiply-adds a row and head) and runs two
# attention calls and a merge; the decode reads each latent row as it is and scores a
# query token against it in 1,088 multiply-adds a head, against the prefill's 320
# (DeepSeek's widths). The two cost the same near 170 new tokens a row at any head
# count; 128 stays below that (vLLM's FLASHMLA takes 128, FLASH_ATTN_MLA 512). Only where
# the decode's kernel takes such rows (`plan.takes_prefill_rows`).
PREFILL_ROWS_ON_DECODE = 128


def prefill_rows_on_decode(kernel_impl: str, device, layout: MLAStepLayout) -> int:
    """The builder's `reorder_batch_threshold`: PREFILL_ROWS_ON_DECODE where the step's
    kernel takes prefill rows, else 1 (vLLM's MHA prefill takes them)."""
    if takes_prefill_rows(kernel_impl, torch.device(device), layout):
        return PREFILL_ROWS_ON_DECODE
    return 1


@dataclass
class AtomMLADecodeMetadata(MLACommonDecodeMetadata):
    paged: PagedAttentionMetadata | None = None  # the decode rows in the plugin's form
    plan: MLAPlan | None = None  # plan_mla_decode's, once a step, for every layer


def dcp_token_kv_lens(
    paged: PagedAttentionMetadata,
    global_seq_lens: torch.Tensor,
    num_tokens: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> torch.Tensor:
    """How many of this rank's cached rows each query token sees: the local rows whose
    global position is at most the token's (causal over the global context)."""
    global_meta = replace(paged, seq_lens=global_seq_lens.to(torch.int32))
    _, visible = mla_token_plan(global_meta, num_tokens)
    return get_dcp_local_seq_lens(visible, dcp_size, dcp_rank, interleave).to(torch.int32)


class MLADecodePlanner:
    """The builder's work on a step's decode rows, from the device tensors and host
    integers vLLM's builder hands it: the rows in the plugin's form and their plan, made
    once a step for every layer, its token tables in persistent buffers (a captured CUDA
    graph reads each step's plan at the addresses it was captured with; under TBO each
    micro-batch's builder has a planner, and buffers, of its own), a uniform decode's as
    views of the planner's identity rows and of vLLM's seq_lens. Nothing here reads the
    device back: under async scheduling a read would stall the host until the GPU has
    finished the step before."""

    def __init__(
        self,
        *,
        kernel_impl: str,
        num_heads: int,
        kv_dtype: torch.dtype,
        layout: MLAStepLayout,
        max_tokens: int,
        device: torch.device | str,
        decode_query_len: int = 1,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
    ) -> None:
        self.kernel_impl = kernel_impl
        self.num_heads = num_heads  # the query heads the kernel sees (all DCP ranks')
        self.kv_dtype = kv_dtype
        self.layout = layout  # what the kernel choice needs beyond the step's sizes
        self.decode_query_len = decode_query_len  # a decode row's tokens (1 + drafts)
        self.dcp_world_size, self.dcp_rank = dcp_world_size, dcp_rank
        self.dcp_interleave = dcp_interleave
        self.buffers = tuple(
            torch.zeros(max_tokens, dtype=torch.int32, device=device) for _ in range(2)
        )
        # 0, 1, 2, ...: a uniform decode step's request rows, written once (no launch a step)
        self.identity = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self._prefill_rows_seen = False

    def decode_metadata(
        self,
        *,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        query_start_loc: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens: torch.Tensor | None = None,
        context: int | None = None,
        query_start_loc_cpu: torch.Tensor | None = None,
    ) -> AtomMLADecodeMetadata:
        """`context`: the key count the split rule plans for (None: `max_seq_len`; a
        CUDA-graph capture passes the longest context the graph may replay).
        `query_start_loc_cpu`: vLLM's host copy of the offsets, for a step that is not a
        uniform decode (prefill or speculative rows): its token plan comes from the host."""
        num_rows = seq_lens.shape[0]
        single = max_query_len <= 1
        if max_query_len > self.decode_query_len and not self._prefill_rows_seen:
            self._prefill_rows_seen = True
            logger.info(
                "ATOM_AITER_MLA: prefill rows of up to %d new tokens run on the decode "
                "kernel (this step: up to %d)",
                PREFILL_ROWS_ON_DECODE,
                max_query_len,
            )
        paged = PagedAttentionMetadata(
            num_reqs=num_rows,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decodes=num_rows if single else 0,
            num_decode_tokens=num_tokens if single else 0,
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_table=block_table.to(torch.int32),
            slot_mapping=slot_mapping[:num_tokens].to(torch.int64),
        )
        token_kv_lens = None
        if dcp_tot_seq_lens is not None and max_query_len > 1:
            token_kv_lens = dcp_token_kv_lens(
                paged,
                dcp_tot_seq_lens,
                num_tokens,
                self.dcp_world_size,
                self.dcp_rank,
                self.dcp_interleave,
            )
        plan = plan_mla_decode(
            paged,
            num_tokens,
            self.num_heads,
            kernel_impl=self.kernel_impl,
            kv_dtype=self.kv_dtype,
            layout=self.layout,
            token_kv_lens=token_kv_lens,
            context=context,
            out=self.buffers,
            query_start_loc_cpu=query_start_loc_cpu,
            # vLLM's seq_lens in another dtype is a fresh tensor (a new address) each step
            identity=self.identity if seq_lens.dtype == torch.int32 else None,
        )
        return AtomMLADecodeMetadata(
            block_table=paged.block_table,
            seq_lens=paged.seq_lens,
            dcp_tot_seq_lens=dcp_tot_seq_lens,
            paged=paged,
            plan=plan,
        )


class AtomAiterMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        kernel_impl = select_kernel_impl(torch.device(device))
        mla_dims = get_mla_dims(vllm_config.model_config)
        layout = MLAStepLayout(
            vllm_config.model_config.dtype,
            kv_cache_spec.block_size,
            mla_dims.kv_lora_rank,
            mla_dims.qk_rope_head_dim,
        )
        # read by vLLM's builder as it starts (speculative rows may raise it further)
        self.reorder_batch_threshold = prefill_rows_on_decode(kernel_impl, device, layout)
        super().__init__(
            kv_cache_spec, layer_names, vllm_config, device, supports_dcp_with_varlen=True
        )
        dcp_rank = 0
        if self.dcp_world_size > 1:
            from vllm.distributed.parallel_state import get_dcp_group

            dcp_rank = get_dcp_group().rank_in_group
        cache_dtype = vllm_config.cache_config.cache_dtype
        self.planner = MLADecodePlanner(
            kernel_impl=kernel_impl,
            num_heads=self.num_heads * self.dcp_world_size,
            kv_dtype=(
                current_platform.fp8_dtype()
                if cache_dtype.startswith("fp8")
                else kv_cache_spec.dtype
            ),
            layout=layout,
            max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            device=device,
            decode_query_len=max_decode_query_len(vllm_config),
            dcp_world_size=self.dcp_world_size,
            dcp_rank=dcp_rank,
            dcp_interleave=self.cp_kv_cache_interleave_size,
        )
        self._slot_mapping: torch.Tensor | None = None
        # The key count the split rule plans for while a CUDA graph is captured (its
        # dummy batch has context 1, but the graph replays any context).
        self._capture_context: int | None = None

    def build_for_cudagraph_capture(self, common_attn_metadata):
        self._capture_context = self.model_config.max_model_len
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capture_context = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self._slot_mapping = common_attn_metadata.slot_mapping
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def _build_decode(
        self,
        block_table_tensor,
        seq_lens_device,
        max_seq_len,
        query_start_loc_cpu,
        query_start_loc_device,
        num_decode_tokens,
        max_query_len,
        dcp_tot_seq_lens_device,
    ) -> AtomMLADecodeMetadata:
        return self.planner.decode_metadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            max_seq_len=int(max_seq_len),
            query_start_loc=query_start_loc_device,
            slot_mapping=self._slot_mapping,
            num_tokens=num_decode_tokens,
            max_query_len=max_query_len,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            context=self._capture_context,
            query_start_loc_cpu=query_start_loc_cpu,
        )


class AtomAiterMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap,
        attn_type,
        kv_sharing_target_layer_name,
        **mla_args,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        given = [name for name, value in unsupported.items() if value]
        if given:
            raise NotImplementedError(f"ATOM_AITER_MLA does not support {', '.join(given)}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"ATOM_AITER_MLA supports decoder self-attention only, got attn_type={attn_type!r}"
            )
        # An fp8 cache is dequantized inside the decode kernels; queries stay in the
        # model dtype, which vLLM makes torch's default while it builds the layers.
        self.supports_quant_query_input = False
        self._query_dtype = torch.get_default_dtype()
        self._fp8_cache = kv_cache_dtype.startswith("fp8")
        self._write_impl: str | None = None  # the cache write's kernel path, once known

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        decode = attn_metadata.decode
        assert isinstance(decode, AtomMLADecodeMetadata), "built by AtomAiterMLAMetadataBuilder"
        # The query's latent and rope parts go to the decode apart (the Triton path reads
        # each through its own strides), and the decode writes every output row: no
        # concatenation and no fill kernel a layer.
        q = self._in_model_dtype(q, layer)
        latent = q[0] if isinstance(q, tuple) else q
        out = latent.new_empty(latent.shape[0], latent.shape[1], self.kv_lora_rank)
        lse = mla_ops.mla_decode(
            q,
            kv_c_and_k_pe_cache,
            decode.paged,
            decode.plan,
            scale=self.scale,
            output=out,
            kv_lora_rank=self.kv_lora_rank,
            kv_scale=layer._k_scale if self._fp8_cache else None,
        )
        return out, lse

    def _in_model_dtype(self, q, layer: AttentionLayer):
        """The query as the decode takes it: as given, or scaled back from the fp8 a layer
        quantized it to whatever supports_quant_query_input says (vLLM 0.34's Kimi-K3
        layer on ROCm with AITER's MLA on and an fp8 cache)."""
        if not is_fp8((q[0] if isinstance(q, tuple) else q).dtype):
            return q
        logger.info_once(
            "ATOM_AITER_MLA: this model's MLA layer hands the decode fp8 queries; they "
            "are dequantized with the layer's q_scale to %s",
            self._query_dtype,
        )
        return dequantized_query(q, layer._q_scale, self._query_dtype)

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """`skip_scale` (vLLM 0.33+): true when an fp8 cache's scale is exactly 1 (vLLM
        passes it so its cache kernel can skip the scaling); the rows are then written
        with a unit scale."""
        if kv_cache.numel() == 0:
            return
        scale = None
        if kv_cache_dtype.startswith("fp8"):
            kv_cache = kv_cache.view(current_platform.fp8_dtype())
            scale = unit_scale(kv_cache.device) if skip_scale else k_scale
        if self._write_impl is None:  # chosen once, for the device of this layer's cache
            self._write_impl = select_kernel_impl(kv_cache.device)
        mla_ops.write_mla_kv(
            kv_c_normed,
            k_pe,
            kv_cache,
            slot_mapping.flatten(),
            scale=scale,
            kernel_impl=self._write_impl,
        )


class AtomAiterMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = SUPPORTED_DTYPES
    supported_kv_cache_dtypes: ClassVar[list[str]] = SUPPORTED_KV_CACHE_DTYPES

    @staticmethod
    def get_name() -> str:
        return "ATOM_AITER_MLA"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]  # DeepSeek latent rows: kv_lora_rank 512 + rope 64

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The block size vLLM takes when none is given: at least 64 where the Hopper
        warpgroup-MMA decode can run (it reads 64-key tiles; smaller pages keep the
        Triton kernels), vLLM's default elsewhere."""
        if not gluon_mla_problems():
            return -(-default_block_size // 64) * 64  # the default rounded up to 64s
        return super().get_preferred_block_size(default_block_size)

    @staticmethod
    def get_impl_cls() -> type[AtomAiterMLAImpl]:
        return AtomAiterMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AtomAiterMLAMetadataBuilder]:
        return AtomAiterMLAMetadataBuilder
