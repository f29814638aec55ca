"""Per-step metadata of a paged attention call, shared by every kernel path.

The builder fills it from vLLM's common metadata; the kernels (AITER, Triton,
torch reference) read it the same way. Tensors live on the compute device and
are never read back to the host by the Triton and AITER paths, so the
host-side integers (`num_reqs`, `max_seq_len`, ...) carry what launches need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atom_plugin.attention.mha.plan import MHAPlan


@dataclass
class PagedAttentionMetadata:
    """One step's batch: decodes first (query_len 1), then prefills/extends.

    `seq_lens[i]` counts request i's whole context including this step's new
    tokens; its queries are the last `query_len` positions. A row with
    seq_len 0 is inert (CUDA-graph padding): its outputs are zeros.
    `max_seq_len` may be an upper bound (it sizes launches, never masks).
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]; negative = skip
    # The MHA kernel path's plan of this batch (`mha.planner.plan_mha`), made by the builder
    # once per step. None: `mha.ops` plans each call itself (callers without a builder).
    # A copy cut from this batch must carry a plan made for the copy, or None.
    plan: MHAPlan | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "num_reqs",
            "num_actual_tokens",
            "max_query_len",
            "max_seq_len",
            "num_decodes",
            "num_decode_tokens",
        ):
            _check_count(name, getattr(self, name))
        if self.num_decodes > self.num_reqs:
            raise ValueError(f"num_decodes={self.num_decodes} exceeds num_reqs={self.num_reqs}")
        if self.num_decode_tokens > self.num_actual_tokens:
            raise ValueError(
                f"num_decode_tokens={self.num_decode_tokens} exceeds "
                f"num_actual_tokens={self.num_actual_tokens}"
            )
        _check_tensor("query_start_loc", self.query_start_loc, torch.int32, 1)
        _check_tensor("seq_lens", self.seq_lens, torch.int32, 1)
        _check_tensor("block_table", self.block_table, torch.int32, 2)
        _check_tensor("slot_mapping", self.slot_mapping, torch.int64, 1)
        if self.query_start_loc.shape[0] < self.num_reqs + 1:
            raise ValueError(
                f"query_start_loc has {self.query_start_loc.shape[0]} entries; "
                f"num_reqs={self.num_reqs} needs {self.num_reqs + 1}"
            )
        for name in ("seq_lens", "block_table"):
            rows = getattr(self, name).shape[0]
            if rows < self.num_reqs:
                raise ValueError(
                    f"{name} has {rows} rows; num_reqs={self.num_reqs} needs that many"
                )

    @property
    def num_prefills(self) -> int:
        """Requests after the decodes (prefills and chunked-prefill extends)."""
        return self.num_reqs - self.num_decodes


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _check_tensor(name: str, t: object, dtype: torch.dtype, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-d {dtype} tensor, got {t.dim()}-d {t.dtype}")
