"""The per-step core shared by the V1 and MRV2 logits processors.

It keeps each request slot's channel state on the device and applies the
channel kernel to a step's logits. Requests may carry different channels (the
engine's stop ids differ per request): each distinct channel is a group with
its own tables and its own `states` tensor, in which slots outside the group
are UNCONSTRAINED, so one launch per group leaves every other row untouched.
Usually there is one group.

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
from dataclasses import dataclass

import numpy as np
import torch

from atom_plugin.parsers.channel_kernel import advance_states, apply_required_channel
from atom_plugin.parsers.channel_tables import ChannelTables, compile_channel
from atom_plugin.parsers.required_channel import START, UNCONSTRAINED, RequiredChannel

MAX_IDLE_GROUPS = 16


@dataclass
class _Group:
    gid: int  # this group's number in ChannelCore._gid
    tables: ChannelTables
    states: torch.Tensor  # [max_slots] int32; UNCONSTRAINED outside the group
    scanned: torch.Tensor  # [max_slots] int32; output positions folded into states
    snapshot: torch.Tensor | None = None  # host buffer of the asynchronous copy (MRV2)


class ChannelCore:
    """Per-slot channel states on `device` for up to `max_slots` requests."""

    def __init__(self, max_slots: int, device: torch.device | str, impl: str | None = None) -> None:
        if max_slots <= 0:
            raise ValueError(f"max_slots must be positive, got {max_slots}")
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.impl = impl
        self._groups: dict[RequiredChannel, _Group] = {}
        self._by_gid: dict[int, _Group] = {}
        # Per slot, the gid of its group or -1: step-wide checks are numpy ops.
        self._gid = np.full(max_slots, -1, dtype=np.int64)
        self._next_gid = 0
        self._epoch = np.zeros(max_slots, dtype=np.int64)
        # The last snapshot's completion event (reused) and the slot epochs it saw.
        self._snapshot_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._snapshot_epochs: np.ndarray | None = None
        # Staged host writes: (channel, slot, state, scanned), applied by flush().
        self._staged: list[tuple[RequiredChannel, int, int, int]] = []

    # ---- host side: who has which channel ---------------------------------
    def assign(
        self, slot: int, channel: RequiredChannel | None, state: int = START, scanned: int = 0
    ) -> None:
        """Give `slot` a channel in `state` (or none); takes effect at `flush()`."""
        self._check_slot(slot)
        old = self.channel_of(slot)
        self._epoch[slot] += 1
        if old is not None:
            self._staged.append((old, slot, UNCONSTRAINED, 0))
        if channel is None or state == UNCONSTRAINED:
            self._gid[slot] = -1
            return
        if channel not in self._groups:
            self._new_group(channel)
        self._gid[slot] = self._groups[channel].gid
        self._staged.append((channel, slot, state, scanned))

    def channel_of(self, slot: int) -> RequiredChannel | None:
        gid = int(self._gid[slot])
        return None if gid < 0 else self._by_gid[gid].tables.channel

    def is_live(self, slots: Iterable[int] | np.ndarray) -> bool:
        """Whether any of `slots` may still be constrained (host knowledge only)."""
        return bool((self._gid[np.asarray(slots, dtype=np.int64)] >= 0).any())

    def flush(self) -> None:
        """Write the staged assignments to the device (a few small copies, no sync)."""
        if not self._staged:
            return
        by_group: dict[RequiredChannel, dict[int, tuple[int, int]]] = {}
        for channel, slot, state, scanned in self._staged:
            by_group.setdefault(channel, {})[slot] = (state, scanned)
        self._staged.clear()
        for channel, writes in by_group.items():
            group = self._groups[channel]
            slots = self._h2d(list(writes))
            values = list(writes.values())
            group.states[slots] = self._h2d([s for s, _ in values], torch.int32)
            group.scanned[slots] = self._h2d([n for _, n in values], torch.int32)
        self._drop_empty_groups()

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
        the Triton kernel leaves slots outside a group as they are (UNCONSTRAINED). The
        torch reference loops as long as the longest span, so it gets only members.
        """
        impl = self.impl or ("torch" if self.device.type == "cpu" else "triton")
        step_gids = self._gid[np.asarray(slots_np, dtype=np.int64)]
        for group in self._groups.values():
            in_group = step_gids == group.gid
            if not in_group.any():
                continue
            if slots is None or impl == "torch":
                members = np.asarray(slots_np, dtype=np.int64)[in_group]
                group_slots = self._h2d(members.tolist(), torch.int32)
            else:
                group_slots = slots
            advance_states(
                group.tables,
                group.states,
                group.scanned,
                token_ids,
                total_len,
                group_slots,
                impl=impl,
            )

    def apply(
        self,
        logits: torch.Tensor,
        slots_np: np.ndarray,
        row_slot: torch.Tensor | None = None,
        row_pos: torch.Tensor | None = None,
        row_tokens: torch.Tensor | None = None,
    ) -> int:
        """Mask `logits` in place for the step's slots; returns the number of launches.

        `slots_np` are the step's request slots on the host; without `row_slot`,
        logits row r belongs to slot r.
        """
        launches = 0
        step_gids = self._gid[np.asarray(slots_np, dtype=np.int64)]
        for group in self._groups.values():
            if not (step_gids == group.gid).any():
                continue
            launches += apply_required_channel(
                logits,
                group.tables,
                group.states,
                live=True,
                row_slot=row_slot,
                row_pos=row_pos,
                row_tokens=row_tokens,
                impl=self.impl,
            )
        return launches

    def states_of(self, slots: Iterable[int]) -> list[int]:
        """The device states of `slots` (syncs; for tests and debugging)."""
        out = []
        for slot in slots:
            gid = int(self._gid[slot])
            out.append(UNCONSTRAINED if gid < 0 else int(self._by_gid[gid].states[slot]))
        return out

    # ---- learning of UNCONSTRAINED slots without a sync (MRV2) -------------
    def snapshot(self) -> None:
        """Start an asynchronous copy of every group's states to the host."""
        for group in self._groups.values():
            if group.snapshot is None:
                pin = self.device.type == "cuda"
                group.snapshot = torch.empty(self.max_slots, dtype=torch.int32, pin_memory=pin)
            group.snapshot.copy_(group.states, non_blocking=True)
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
        for group in self._groups.values():
            if group.snapshot is None:  # made after the snapshot
                continue
            done = (
                (self._gid == group.gid) & (group.snapshot.numpy() == UNCONSTRAINED) & same_request
            )
            self._gid[done] = -1
        self._snapshot_epochs = None

    # ---- helpers -----------------------------------------------------------
    def _new_group(self, channel: RequiredChannel) -> None:
        full = torch.full((self.max_slots,), UNCONSTRAINED, dtype=torch.int32, device=self.device)
        group = _Group(
            self._next_gid, compile_channel(channel, self.device), full, torch.zeros_like(full)
        )
        self._next_gid += 1
        self._groups[channel] = self._by_gid[group.gid] = group

    def _drop_empty_groups(self) -> None:
        # Groups (and their tables) are kept for reuse unless there are many.
        if len(self._groups) <= MAX_IDLE_GROUPS:
            return
        used = set(self._gid[self._gid >= 0].tolist())
        staged = {channel for channel, *_ in self._staged}
        for channel, group in list(self._groups.items()):
            if group.gid not in used and channel not in staged:
                del self._groups[channel], self._by_gid[group.gid]

    def _h2d(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.max_slots - 1}")
