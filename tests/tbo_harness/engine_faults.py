"""The faults `fault_plugin` puts into an engine, patched onto the plugin's vLLM runner.

`install` is the test-only vLLM general plugin: vLLM calls it in every process it
starts, before any model runner is built, and may call it more than once (each
patch sets the same function again).
"""

from __future__ import annotations

import json
from dataclasses import replace
from importlib.metadata import distribution

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.vllm.tbo import model_runner as tbo_model_runner
from atom_plugin.vllm.tbo.model_runner import TboModelRunnerMixin

from .fault_plugin import DIST, FAULTS
from .rerun_graphs import split_decode_rerun_graphs

_build_attention_metadata = TboModelRunnerMixin._build_attention_metadata


def install() -> None:
    """Install the faults named in the plugin's `faults.json`."""
    faults = json.loads(distribution(DIST).read_text(FAULTS))
    if faults["miscut"]:
        TboModelRunnerMixin._build_attention_metadata = _build_miscut_attention_metadata
    if faults["rerun_graphs"]:
        tbo_model_runner.split_decode_graphs = split_decode_rerun_graphs(faults["rerun_graphs"])


def _build_miscut_attention_metadata(self, *args, **kwargs):
    """The runner's metadata, with micro-batch 1's cut one request off the slices."""
    attn_metadata, spec_common = _build_attention_metadata(self, *args, **kwargs)
    if self.tbo_planner.split is not None:  # a split step: one metadata dict per micro-batch
        attn_metadata[1] = {k: miscut(v) for k, v in attn_metadata[1].items()}
    return attn_metadata, spec_common


def miscut(meta):
    """Each decode of the plugin's MHA metadata takes its neighbour's context
    (silently, as in ATOM's bug: every shape check still holds)."""
    if not isinstance(meta, PagedAttentionMetadata) or meta.num_reqs < 2:
        return meta
    if meta.num_decodes != meta.num_reqs:
        return meta
    return replace(meta, seq_lens=meta.seq_lens.roll(1, 0), block_table=meta.block_table.roll(1, 0))
