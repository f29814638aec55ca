"""The Kimi-K3 required channel as a logits processor for vLLM's Model Runner V2.

MRV2 keeps each request's committed ids on the device (`all_token_ids`,
`total_len`), so states advance there with no host sync; under speculative
decoding each verification row is constrained as if the drafts before it were
accepted (the drafts are `ctx.input_ids` at local positions >= 1). MRV2 copies
the logits before its processors run and takes raw logprobs from the copy it
was given, so the mask never reaches reported logprobs.

The vLLM import is the import-light interface module: the front end loads this
class too, to run `validate_params`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

from atom_plugin.k3.channel_for import channel_args, request_channel
from atom_plugin.k3.required_channel import START
from atom_plugin.vllm.k3.token_classes import EngineTokenClasses

if TYPE_CHECKING:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsContext,
        LogitsProcRequestState,
    )


class AtomK3LogitsProcessorMRV2(LogitsProcessor):
    def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
        from atom_plugin.k3.processor_core import ChannelCore

        self.req_states = req_states
        self.core = ChannelCore(req_states.max_num_reqs, req_states.device)
        self._added: dict[int, object] = {}
        # The token classes start building on a thread here; a channel with calls waits
        # for them only if it comes before they are done.
        self.classes = EngineTokenClasses(vllm_config)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        channel_args(sampling_params.extra_args)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        channel = request_channel(sampling_params, self.classes)
        self._added[req_idx] = channel
        return channel is not None

    def apply_staged_writes(self) -> None:
        prompt_len = self.req_states.prompt_len.np
        for slot, channel in self._added.items():
            # Scanning starts at the output: the prompt holds earlier turns' triggers.
            self.core.assign(slot, channel, START, scanned=int(prompt_len[slot]))
        self._added.clear()
        self.core.flush()

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        self.core.retire_finished()
        slots = ctx.idx_mapping_np
        if not self.core.is_live(slots):
            return logits
        self.core.advance(
            self.req_states.all_token_ids.gpu,
            self.req_states.total_len.gpu,
            slots,
            ctx.idx_mapping,
        )
        spec = logits.shape[0] != len(slots)
        self.core.apply(
            logits,
            slots,
            row_slot=ctx.expanded_idx_mapping,
            row_pos=ctx.expanded_local_pos if spec else None,
            row_tokens=ctx.input_ids if spec else None,
        )
        self.core.snapshot()
        return logits
