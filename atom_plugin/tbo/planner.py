"""Which steps split, and where: the step planner of both of vLLM's model runners.

Per step, on every DP rank: the step's `BatchShape` (`step_shape`), the prefix-cache
veto (`atom_plugin.tbo.hazards`, searched only on a prefill step that could split), the
decision (`ForwardMode.decide`; with DP > 1 the runner's agreement over the ranks, one
all_gather in `atom_plugin.tbo.dp`) and the micro-batches, cut by
`maybe_create_ubatch_slices`, the one split rule. A dummy run takes part in the
agreement as an idle rank that keeps the step whole (`plan_idle`). The planner counts
the steps by kind (`STAT_KINDS`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from atom_plugin.tbo.graphs import BucketGraphs
from atom_plugin.tbo.mode import PREFILL, BatchShape, ForwardMode, GraphKey, TboConfig
from atom_plugin.tbo.slices import UBatchSlice, maybe_create_ubatch_slices

# "decode" and "prefill": split steps; "unsplit" otherwise; "straddled": split prefill
# steps with a request on both sides of the cut; "vetoed": steps kept whole for a request
# reading blocks written now; "replayed": split decode steps replayed from a split graph,
# "captured": the split graphs recorded.
STAT_KINDS = ("decode", "prefill", "unsplit", "straddled", "vetoed", "replayed", "captured")

Agree = Callable[[BatchShape, TboConfig, Collection[GraphKey]], ForwardMode]


def step_shape(query_lens: list[int], decode_query_len: int | None) -> BatchShape:
    """A step's shape as the runner classed it: a decode when it found every request with
    `decode_query_len` new tokens (None: not a decode), else a prefill."""
    if decode_query_len is None:
        return BatchShape(len(query_lens), sum(query_lens))
    return BatchShape.from_query_lens(query_lens, decode_query_len)


@dataclass(frozen=True)
class PlannedSplit:
    """A split step of this rank: the mode, the micro-batches and the requests scheduled."""

    mode: ForwardMode
    slices: tuple[UBatchSlice, UBatchSlice]
    num_reqs: int

    @property
    def straddles(self) -> bool:
        return self.slices[0].request_slice.stop > self.slices[1].request_slice.start

    def input_slices(self, num_input_tokens: int) -> list[slice]:
        """Model-input token ranges: the last micro-batch also runs the step's padding."""
        first, last = (s.token_slice for s in self.slices)
        return [first, slice(last.start, num_input_tokens)]


class StepPlanner:
    """Plans each step (see the module docstring) and counts the steps run.

    `agree(shape, config, graph_keys)`: this rank's mode agreed over the DP ranks (needed
    with DP > 1). `graphs`: the split decode buckets' request graphs, whose keys take part
    in the decision (`graph_keys`).
    """

    def __init__(self, config: TboConfig, dp_size: int, agree: Agree | None = None):
        if dp_size > 1 and agree is None:
            raise ValueError(f"data parallelism {dp_size} needs an agreement across the ranks")
        self.config = config
        self.dp_size = dp_size
        self._agree = agree
        self.steps: collections.Counter[str] = collections.Counter()
        self.graphs: BucketGraphs | None = None
        self.split: PlannedSplit | None = None

    def stats(self) -> dict[str, int]:
        return {k: self.steps[k] for k in STAT_KINDS}

    def graph_keys(self) -> list[GraphKey]:
        return self.graphs.keys if self.graphs is not None else []

    def end_step(self) -> None:
        self.split = None

    def plan_idle(self) -> None:
        """A dummy run: it never splits, and with DP > 1 it takes part in the agreement as
        an idle rank that keeps the step whole (vLLM runs dummy batches outside the split)."""
        self.end_step()
        if self.dp_size > 1:
            self._decide(BatchShape(0, 0, splittable=False))

    def plan(
        self,
        query_lens: list[int],
        decode_query_len: int | None,
        reads_blocks_written_now: Callable[[], bool],
    ) -> PlannedSplit | None:
        """Plan this rank's real step (its requests' new tokens in batch order, as Python
        ints; `decode_query_len` as for `step_shape`); the split, or None."""
        self.end_step()
        shape = step_shape(query_lens, decode_query_len)
        config = self.config
        # Only a step that could split is searched for readers of blocks written now.
        could_split = config.prefill and shape.num_tokens >= config.prefill_min_tokens
        if shape.kind == PREFILL and could_split and reads_blocks_written_now():
            self.steps["vetoed"] += 1
            shape = replace(shape, splittable=False)
        mode = self._decide(shape)
        if not mode.split:
            self.steps["unsplit"] += 1
            return None
        slices = maybe_create_ubatch_slices(mode, query_lens)
        self.split = PlannedSplit(mode, slices, shape.num_reqs)
        return self.split

    def count_run(self, split: PlannedSplit) -> None:
        """A split step runs: count it by kind."""
        self.steps[split.mode.kind] += 1
        if split.straddles:
            self.steps["straddled"] += 1

    def _decide(self, shape: BatchShape) -> ForwardMode:
        if self.dp_size == 1:
            return ForwardMode.decide([shape], 0, self.config, self.graph_keys())
        return self._agree(shape, self.config, self.graph_keys())
