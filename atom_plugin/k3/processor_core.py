"""The per-step core shared by the V1 and MRV2 logits processors.

It keeps each request slot's channel state on the device and applies the
channel kernel to a step's logits. Requests may carry different channels (a
named tool choice forces its tool's name, and the engine's stop ids differ per
request): all channels the server has seen share one state space
(channel_tables.py), so each slot's state is one int in one `states` tensor and
a step launches the kernel once whatever its mix of channels. A new channel
costs the layout of its own rows (numpy over its call table, which the API
server compiled) and their copy to the device; the other channels' rows are not
touched. A request whose channel is known costs a lookup.

What the host knows decides whether anything is launched: a slot is live from
the moment it gets a channel until the host learns it became UNCONSTRAINED.
A step whose slots are not live costs no launch. The V1 processor knows states
exactly (it reads committed tokens on the host anyway); the MRV2 processor
advances states on the device and learns of UNCONSTRAINED slots from an
asynchronous copy of the states one step late, which is safe because
UNCONSTRAINED is absorbing.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from atom_plugin.k3.channel_kernel import advance_states, apply_required_channel
from atom_plugin.k3.channel_tables import ChannelTables, SharedTables
from atom_plugin.k3.required_channel import START, UNCONSTRAINED, RequiredChannel

# Channels kept in the tables while no slot uses them; beyond this many, a flush drops them.
MAX_IDLE_CHANNELS = 16


class ChannelCore:
    """Per-slot channel states on `device` for up to `max_slots` requests."""

    def __init__(self, max_slots: int, device: torch.device | str, impl: str | None = None) -> None:
        if max_slots <= 0:
            raise ValueError(f"max_slots must be positive, got {max_slots}")
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.impl = impl
        # The channels in table order (each one's base there) and the tables once flushed.
        self._shared = SharedTables(self.device)
        self._index: dict[RequiredChannel, int] = {}
        self._tables: ChannelTables | None = None  # None until flushed, or with no channel
        self._stale = False  # channels registered or dropped since the tables were taken
        # Per slot, the index of its channel or -1: step-wide checks are numpy ops.
        self._slot_channel = np.full(max_slots, -1, dtype=np.int64)
        # Global states (UNCONSTRAINED for slots without a channel) and scanned output positions.
        self.states = torch.full((max_slots,), UNCONSTRAINED, dtype=torch.int32, device=self.device)
        self.scanned = torch.zeros_like(self.states)
        self._epoch = np.zeros(max_slots, dtype=np.int64)
        # The last snapshot: its host buffer, completion event (reused) and the slot epochs it saw.
        self._snapshot: torch.Tensor | None = None
        self._snapshot_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._snapshot_epochs: np.ndarray | None = None
        # Staged host writes per slot: (channel or None, local state, scanned), applied by flush().
        self._staged: dict[int, tuple[RequiredChannel | None, int, int]] = {}

    # ---- host side: who has which channel ---------------------------------
    def assign(
        self, slot: int, channel: RequiredChannel | None, state: int = START, scanned: int = 0
    ) -> None:
        """Give `slot` a channel in `state` (or none); takes effect at `flush()`."""
        self._check_slot(slot)
        self._epoch[slot] += 1
        if channel is None or state == UNCONSTRAINED:
            self._slot_channel[slot] = -1
            self._staged[slot] = (None, UNCONSTRAINED, 0)
            return
        channel._check_state(state)
        self._slot_channel[slot] = self._register(channel)
        self._staged[slot] = (channel, state, scanned)

    def channel_of(self, slot: int) -> RequiredChannel | None:
        index = int(self._slot_channel[slot])
        return None if index < 0 else self._shared.channels[index]

    def is_live(self, slots: Iterable[int] | np.ndarray) -> bool:
        """Whether any of `slots` may still be constrained (host knowledge only)."""
        return bool((self._slot_channel[np.asarray(slots, dtype=np.int64)] >= 0).any())

    @property
    def num_channels(self) -> int:
        """Channels in the shared tables (for tests and debugging)."""
        return len(self._shared.channels)

    @property
    def laid_out(self) -> int:
        """Channels whose rows this core has laid out, each once (for tests)."""
        return self._shared.laid_out

    def flush(self) -> None:
        """Write the staged assignments to the device (a few small copies, no sync)."""
        if not self._staged:
            return
        self._drop_idle_channels()
        if self._stale:
            self._tables = self._shared.tables() if self._shared.channels else None
            self._stale = False
        slots, states, scanned = [], [], []
        for slot, (channel, state, seen) in self._staged.items():
            slots.append(slot)
            states.append(
                UNCONSTRAINED
                if channel is None
                else self._shared.bases[self._index[channel]] + state
            )
            scanned.append(seen)
        self._staged.clear()
        index = self._h2d(slots)
        self.states[index] = self._h2d(states, torch.int32)
        self.scanned[index] = self._h2d(scanned, torch.int32)

    # ---- device side -------------------------------------------------------
    def advance(
        self,
        token_ids: torch.Tensor,
        total_len: torch.Tensor,
        slots_np: np.ndarray,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Fold committed tokens token_ids[s, scanned[s]:total_len[s]] into each live state.

        `slots` (the step's slots on the device, e.g. MRV2's `idx_mapping`) saves a copy:
        the Triton kernel leaves UNCONSTRAINED slots as they are. The torch reference
        loops as long as the longest span, so it gets only slots with a channel.
        """
        impl = self.impl or ("torch" if self.device.type == "cpu" else "triton")
        step = np.asarray(slots_np, dtype=np.int64)
        members = self._slot_channel[step] >= 0
        if not members.any() or self._tables is None:
            return
        if slots is None or impl == "torch":
            slots = self._h2d(step[members].tolist(), torch.int32)
        advance_states(
            self._tables, self.states, self.scanned, token_ids, total_len, slots, impl=impl
        )

    def apply(
        self,
        logits: torch.Tensor,
        slots_np: np.ndarray,
        row_slot: torch.Tensor | None = None,
        row_pos: torch.Tensor | None = None,
        row_tokens: torch.Tensor | None = None,
    ) -> int:
        """Mask `logits` in place for the step's slots; returns the number of launches (0 or 1).

        `slots_np` are the step's request slots on the host; without `row_slot`,
        logits row r belongs to slot r.
        """
        if self._tables is None:
            return 0
        return int(
            apply_required_channel(
                logits,
                self._tables,
                self.states,
                live=self.is_live(slots_np),
                row_slot=row_slot,
                row_pos=row_pos,
                row_tokens=row_tokens,
                impl=self.impl,
            )
        )

    def states_of(self, slots: Iterable[int]) -> list[int]:
        """The device states of `slots` in their channels' local numbers (syncs; for tests)."""
        out = []
        for slot in slots:
            index = int(self._slot_channel[slot])
            state = int(self.states[slot])
            out.append(
                UNCONSTRAINED if index < 0 or state < 0 else state - self._shared.bases[index]
            )
        return out

    # ---- learning of UNCONSTRAINED slots without a sync (MRV2) -------------
    def snapshot(self) -> None:
        """Start an asynchronous copy of the states to the host."""
        if self._snapshot is None:
            pin = self.device.type == "cuda"
            self._snapshot = torch.empty(self.max_slots, dtype=torch.int32, pin_memory=pin)
        self._snapshot.copy_(self.states, non_blocking=True)
        self._snapshot_epochs = self._epoch.copy()
        if self._snapshot_event is not None:
            self._snapshot_event.record()

    def retire_finished(self) -> None:
        """Forget slots that a completed snapshot shows UNCONSTRAINED (no waiting)."""
        if self._snapshot_epochs is None:
            return
        if self._snapshot_event is not None and not self._snapshot_event.query():
            return
        same_request = self._snapshot_epochs == self._epoch
        done = (self._slot_channel >= 0) & (self._snapshot.numpy() == UNCONSTRAINED) & same_request
        self._slot_channel[done] = -1
        self._snapshot_epochs = None

    # ---- helpers -----------------------------------------------------------
    def _register(self, channel: RequiredChannel) -> int:
        index = self._index.get(channel)
        if index is None:
            index = self._index[channel] = self._shared.add(channel)
            self._stale = True
        return index

    def _drop_idle_channels(self) -> None:
        """Drop channels no slot holds once there are many, renumbering the device states.

        A slot without a channel holds UNCONSTRAINED on the device, so only states of
        kept channels are renumbered (one gather on the device, no sync).
        """
        used = set(self._slot_channel[self._slot_channel >= 0].tolist())
        old_shared = self._shared
        if len(old_shared.channels) - len(used) <= MAX_IDLE_CHANNELS:
            return
        kept = sorted(used)
        self._shared = old_shared.subset(kept)
        bases = self._shared.bases
        # renumber[1 + old global state] = new global state (UNCONSTRAINED -> UNCONSTRAINED).
        renumber = np.full(1 + old_shared.num_states, UNCONSTRAINED, np.int32)
        for new, old in enumerate(kept):
            size = old_shared.channels[old].num_states
            first = 1 + old_shared.bases[old]
            renumber[first : first + size] = np.arange(bases[new], bases[new] + size)
        table = torch.from_numpy(renumber).to(self.device)
        self.states.copy_(table[self.states.long() + 1])
        moved = np.full(len(old_shared.channels), -1, dtype=np.int64)
        moved[kept] = np.arange(len(kept))
        live = self._slot_channel >= 0
        self._slot_channel[live] = moved[self._slot_channel[live]]
        self._index = {c: i for i, c in enumerate(self._shared.channels)}
        self._stale = True

    def _h2d(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.max_slots - 1}")
