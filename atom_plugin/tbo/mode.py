"""How one step runs: eager or graph replay, split into micro-batches or not.

`ForwardMode.decide` is a pure function of every data-parallel rank's batch
shape (see `atom_plugin.tbo.dp` for the one collective that gathers them), so
all ranks reach the same decision: all split or none does, and every rank pads
its micro-batches to the same token counts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from atom_plugin.tbo.split import (
    MIN_SPLIT_TOKENS,
    Range,
    decode_bucket_splits,
    decode_ubatch_ranges,
    prefill_ubatch_token_ranges,
)

IDLE, DECODE, PREFILL = "idle", "decode", "prefill"
MIXED = "mixed"  # ranks disagree on the kind of step: nobody splits, nobody replays
# The user-facing TBO setting (ATOM's --enable-tbo values): which steps may split.
TBO_MODES: tuple[str, ...] = ("off", "prefill", "decode", "all")
MIN_DECODE_SPLIT_REQUESTS = 3  # decode_bucket_splits: a bucket of <= 2 never splits


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class TboConfig:
    """Which steps may split, and the smallest of each kind that does.

    `decode_min_requests`: the smallest decode batch (requests; the bucket on a
    replay) that splits; `prefill_min_tokens`: the smallest prefill batch.
    """

    decode: bool = True
    prefill: bool = True
    prefill_min_tokens: int = MIN_SPLIT_TOKENS
    decode_min_requests: int = MIN_DECODE_SPLIT_REQUESTS

    def __post_init__(self) -> None:
        _check_int("prefill_min_tokens", self.prefill_min_tokens, MIN_SPLIT_TOKENS)
        _check_int("decode_min_requests", self.decode_min_requests, MIN_DECODE_SPLIT_REQUESTS)

    @classmethod
    def for_mode(cls, mode: str, **thresholds: int) -> TboConfig | None:
        """The config for a `TBO_MODES` setting (None for "off")."""
        if mode not in TBO_MODES:
            raise ValueError(f"TBO mode {mode!r} is not one of {', '.join(TBO_MODES)}")
        if mode == "off":
            return None
        return cls(
            decode=mode in ("decode", "all"), prefill=mode in ("prefill", "all"), **thresholds
        )

    def decode_splits(self, num_reqs: int) -> bool:
        """Whether a decode batch (or bucket) of `num_reqs` requests splits under this config."""
        return decode_bucket_splits(num_reqs) and num_reqs >= self.decode_min_requests


@dataclass(frozen=True)
class GraphKey:
    """A request graph: `bucket` decode requests of `query_len` tokens each."""

    bucket: int
    query_len: int

    def __post_init__(self) -> None:
        _check_int("bucket", self.bucket, 1)
        _check_int("query_len", self.query_len, 1)


@dataclass(frozen=True)
class BatchShape:
    """What one rank scheduled this step.

    `decode_query_len` is the common query length when every request is a
    decode (1, or 1 + speculative tokens); None for prefill or mixed batches.
    `splittable` False vetoes the split for every rank (e.g. a request reads
    blocks another request of this step is writing: `atom_plugin.tbo.hazards`).
    """

    num_reqs: int
    num_tokens: int
    decode_query_len: int | None = None
    splittable: bool = True

    def __post_init__(self) -> None:
        _check_int("num_reqs", self.num_reqs, 0)
        _check_int("num_tokens", self.num_tokens, 0)
        if self.decode_query_len is not None:
            _check_int("decode_query_len", self.decode_query_len, 1)
            if self.num_tokens != self.num_reqs * self.decode_query_len:
                raise ValueError(
                    f"a decode batch of {self.num_reqs} requests x {self.decode_query_len} "
                    f"tokens cannot hold num_tokens={self.num_tokens}"
                )
        if (self.num_reqs == 0) != (self.num_tokens == 0):
            raise ValueError(f"num_reqs={self.num_reqs} and num_tokens={self.num_tokens} disagree")
        if self.num_tokens < self.num_reqs:
            raise ValueError(f"{self.num_reqs} requests need at least as many tokens")

    @classmethod
    def from_query_lens(cls, query_lens: Sequence[int], decode_query_len: int = 1) -> BatchShape:
        """A decode batch when every request has `decode_query_len` new tokens, else prefill."""
        lens = list(query_lens)
        is_decode = bool(lens) and all(q == decode_query_len for q in lens)
        return cls(len(lens), sum(lens), decode_query_len if is_decode else None)

    @property
    def kind(self) -> str:
        if self.num_reqs == 0:
            return IDLE
        return DECODE if self.decode_query_len is not None else PREFILL


def _global_kind(shapes: Sequence[BatchShape]) -> tuple[str, int | None]:
    kinds = {s.kind for s in shapes} - {IDLE}
    if not kinds:
        return IDLE, None
    if kinds == {DECODE}:
        qlens = {s.decode_query_len for s in shapes if s.kind == DECODE}
        if len(qlens) == 1:
            return DECODE, qlens.pop()
        return MIXED, None
    if kinds == {PREFILL}:
        return PREFILL, None
    return MIXED, None


@dataclass(frozen=True)
class ForwardMode:
    """One rank's plan for one step (derived identically on every DP rank).

    - `replay`: the step replays the request graph `graph_key` (decode only).
    - `split`: the step runs as two micro-batches.
    - `bucket`: requests the batch is padded to on a replay.
    - `ubatch_split_bs`: where decode micro-batches are cut - the bucket on a
      replay, this rank's scheduled requests on an eager split. The slices and
      so every backend's micro-batch metadata are cut at this same number.
    - `ubatch_num_tokens`: the agreed (padded) tokens of each micro-batch.
    - `num_padded_tokens`: tokens this rank runs (sum of the micro-batches when split).
    """

    kind: str
    replay: bool
    split: bool
    bucket: int | None
    query_len: int | None
    ubatch_split_bs: int | None
    ubatch_num_tokens: tuple[int, int] | None
    num_padded_tokens: int

    @property
    def graph_key(self) -> GraphKey | None:
        return GraphKey(self.bucket, self.query_len) if self.replay else None

    @classmethod
    def decide(
        cls,
        shapes: Sequence[BatchShape],
        rank: int,
        config: TboConfig,
        graph_keys: Collection[GraphKey] = (),
    ) -> ForwardMode:
        """Plan rank `rank`'s step from all ranks' `shapes` (one entry per DP rank).

        `graph_keys` are the captured request graphs (`plan_request_graphs`).
        """
        if not shapes:
            raise ValueError("shapes must hold one BatchShape per data-parallel rank, got none")
        if not 0 <= rank < len(shapes):
            raise ValueError(f"rank {rank} is not in [0, {len(shapes)})")
        kind, qlen = _global_kind(shapes)
        if not all(s.splittable for s in shapes):
            config = replace(config, decode=False, prefill=False)
        if kind == DECODE:
            return cls._decide_decode(shapes, shapes[rank], qlen, config, graph_keys)
        if (
            kind == PREFILL
            and config.prefill
            and all(s.num_tokens >= config.prefill_min_tokens for s in shapes)
        ):
            counts = _agreed_counts(prefill_ubatch_token_ranges(s.num_tokens) for s in shapes)
            return cls(PREFILL, False, True, None, None, None, counts, sum(counts))
        max_tokens = max(s.num_tokens for s in shapes)
        return cls(kind, False, False, None, None, None, None, max_tokens)

    @classmethod
    def _decide_decode(cls, shapes, mine, qlen, config, graph_keys) -> ForwardMode:
        max_reqs = max(s.num_reqs for s in shapes)
        buckets = sorted(k.bucket for k in graph_keys if k.query_len == qlen)
        bucket = next((b for b in buckets if b >= max_reqs), None)
        if bucket is not None:
            if replay_splits(GraphKey(bucket, qlen), config):
                counts = _agreed_counts([decode_ubatch_ranges(bucket, qlen).tokens])
                return cls(DECODE, True, True, bucket, qlen, bucket, counts, bucket * qlen)
            return cls(DECODE, True, False, bucket, qlen, None, None, bucket * qlen)
        if _decode_may_split(qlen, config) and all(
            config.decode_splits(s.num_reqs) for s in shapes
        ):
            counts = _agreed_counts(decode_ubatch_ranges(s.num_reqs, qlen).tokens for s in shapes)
            return cls(DECODE, False, True, None, qlen, mine.num_reqs, counts, sum(counts))
        return cls(DECODE, False, False, None, qlen, None, None, max_reqs * qlen)


def _agreed_counts(token_ranges: Iterable[tuple[Range, Range]]) -> tuple[int, int]:
    """Each micro-batch's largest token count over the ranks' own splits: all ranks pad to it."""
    first, second = (max(b - a for a, b in ubatch) for ubatch in zip(*token_ranges, strict=True))
    return first, second


def _decode_may_split(query_len: int, config: TboConfig) -> bool:
    # Per-micro-batch decode metadata is cut by request at one token each.
    return config.decode and query_len == 1


def replay_splits(key: GraphKey, config: TboConfig) -> bool:
    """Whether the request graph `key` is recorded (and replayed) as two micro-batches."""
    return _decode_may_split(key.query_len, config) and config.decode_splits(key.bucket)


def plan_request_graphs(
    buckets: Sequence[int], query_len: int, config: TboConfig
) -> list[tuple[GraphKey, bool]]:
    """Every decode bucket gets one graph, recorded split exactly when a replay of it splits."""
    keys = [GraphKey(b, query_len) for b in sorted(set(buckets))]
    return [(key, replay_splits(key, config)) for key in keys]
