"""The Triton path of the MHA ops: decode rows through split-KV, the rest through prefill
(the Gluon kernel where the plan says the device takes it and the layer fits it)."""

from __future__ import annotations

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.gluon_prefill_launch import gluon_prefill, layer_takes_gluon_prefill
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mha.plan import TritonPlan
from atom_plugin.attention.mha.triton_decode import paged_decode
from atom_plugin.attention.mha.triton_kv import write_kv
from atom_plugin.attention.mha.triton_prefill import paged_prefill

__all__ = ["paged_attention", "write_kv"]


def paged_attention(
    query,
    key_cache,
    value_cache,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output,
    plan: TritonPlan,
):
    if meta.num_decodes:
        paged_decode(
            query, key_cache, value_cache, meta, params, output, num_splits=plan.num_splits
        )
    if not meta.num_prefills:
        return output
    counters = plan.gluon_counters
    if counters is not None and layer_takes_gluon_prefill(query, key_cache, value_cache, params):
        gluon_prefill(
            query, key_cache, value_cache, meta, params, output, meta.num_decodes, counters
        )
    else:
        paged_prefill(query, key_cache, value_cache, meta, params, output)
    return output
