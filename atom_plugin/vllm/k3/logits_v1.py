"""The Kimi-K3 required channel as a logits processor for vLLM's V1 model runner.

Requests ask for it through `SamplingParams.extra_args` (see
`atom_plugin.k3.channel_for`); every other row is left bit for bit. The
V1 runner hands processors each request's output list, repaired with the
last sampled ids just before sampling, so states advance on the host from
tokens it already has and reach the device with the step's other small
copies. V1 never passes speculative verification rows to custom processors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from atom_plugin.k3.channel_for import channel_args, request_channel
from atom_plugin.k3.processor_core import ChannelCore
from atom_plugin.k3.required_channel import START, UNCONSTRAINED, RequiredChannel
from atom_plugin.vllm.k3.token_classes import EngineTokenClasses

# Imported only where vLLM has its V1 model runner (0.32, 0.33); compat checks it there.
ONLY_WITH_RUNNER = "v1"


@dataclass
class _Row:
    channel: RequiredChannel
    output: list[int]  # the runner's live output list for the request
    seen: int = 0
    state: int = START


class AtomK3LogitsProcessorV1(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.core = ChannelCore(vllm_config.scheduler_config.max_num_seqs, device)
        self._rows: dict[int, _Row] = {}
        # The token classes start building on a thread here; a channel with calls waits
        # for them only if it comes before they are done.
        self.classes = EngineTokenClasses(vllm_config)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        channel_args(sampling_params.extra_args)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._set(index, None)
        for index, params, _prompt, output in batch_update.added:
            channel = request_channel(params, self.classes)
            self._set(index, None if channel is None else _Row(channel, output))
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.get(a), self._rows.get(b)
            self._set(b, row_a)
            self._set(a, row_b if direction == MoveDirectionality.SWAP else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        for index, row in list(self._rows.items()):
            self._catch_up(index, row)
        self.core.flush()
        if self._rows:
            self.core.apply(logits, np.fromiter(self._rows, dtype=np.int64))
        return logits

    def _set(self, index: int, row: _Row | None) -> None:
        if row is None:
            self._rows.pop(index, None)
            self.core.assign(index, None)
            return
        self._rows[index] = row
        self._catch_up(index, row, force=True)

    def _catch_up(self, index: int, row: _Row, force: bool = False) -> None:
        """Step the row through its newly committed ids (up to any async placeholder).

        The device state is written only when it changed (or the row is new to
        `index`): most ids leave a waiting state where it was, so most steps copy nothing.
        """
        old = row.state
        for token in row.output[row.seen :]:
            if token < 0:
                break
            row.state = row.channel.step(row.state, token)
            row.seen += 1
        if row.state == UNCONSTRAINED:
            self._rows.pop(index, None)
            self.core.assign(index, None)
        elif force or row.state != old:
            self.core.assign(index, row.channel, row.state)
