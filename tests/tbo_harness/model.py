"""A small MoE-style transformer to prove two-batch overlap on (a test harness, not an engine).

Each layer: paged attention through the plugin's ops (`write_kv`,
`paged_attention`), then a mixture of experts whose tokens travel through a
communication step - dispatch (all-gather of hidden states and gates) and
combine (all-reduce of the expert outputs, each rank keeping its own rows).
Experts are sharded across the ranks of the comm group; on one device a
stand-in of configurable duration on the comm stream takes the place of the
collectives (`LocalComm`), for a job of one rank or for one rank of several.

The layer launches few, large kernels, as an engine's fused layer does: one QKV
GEMM, an RMSNorm kernel, and the rank's experts as one up and one down GEMM
(dense-masked: every token goes through every expert, weighted by gates that are
zero outside its top-2). A chain of many tiny launches would measure launch
latency, not the overlap.

Routing is hashed from the token id (top-2 of the experts) with gate weights
from a learned router, so outputs are continuous in the inputs and TBO-on vs
TBO-off comparisons need no luck with near ties.

Where a micro-batch hands over to the other (`overlap`, see `OVERLAP_SCHEDULES`):
- "per_comm": after each communication step, two segments per layer (attention,
  experts). Per layer the compute stream runs attention 0, attention 1, experts 0,
  experts 1: dispatch 0 hides behind attention 1, but dispatch 1 and combine 0
  have only the short expert GEMMs to hide behind.
- "staged": three segments per layer, the attention cut in two by KV-head halves
  (an engine's TBO cuts its layers into such stages), and micro-batch
  1 starts one segment late. The compute stream then runs
      attn-a 0, attn-b 0, attn-a 1, experts 0, attn-b 1, attn-a' 0, experts 1, ...
  and every dispatch and combine has half an attention of the other micro-batch
  to hide behind: dispatch 0 behind attn-a 1, combine 0 behind attn-b 1, dispatch
  1 behind attn-a' 0, combine 1 behind attn-b' 0. The comm stream carries
  dispatch 0, combine 0, dispatch 1, combine 1, so no collective waits behind the
  other micro-batch's. Each half attention is issued in a `take_turn` block, so on
  two compute streams the half attentions keep that order too, one after the
  other, while the micro-batches' other kernels run beside them (on one stream
  the order holds anyway). It needs an even number of KV heads.
An expert GEMM can rarely share the GPU with the other micro-batch's attention
(the attention's programs stay resident for the whole kernel), which is why the
schedule interleaves whole kernels rather than relying on concurrent streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.ops import paged_attention, write_kv
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.tbo import (
    current_ubatch,
    record_stream_use,
    switch_to_comm,
    take_turn,
    yield_and_switch_to_compute,
    yield_to_other,
)

OVERLAP_SCHEDULES = ("per_comm", "staged")


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 97
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    experts: int = 4
    ffn: int = 48
    block_size: int = 4
    dtype: torch.dtype = torch.float32


# The GPU tests' shape: compiled Triton attention needs head_dim >= 16 (tl.dot's K).
GPU_CONFIG = ModelConfig(hidden=64, heads=8, kv_heads=2, head_dim=32, block_size=16, ffn=96)


class OneRankComm:
    """One rank of a `world`-rank expert-parallel job, run alone on one device.

    Dispatch returns `world` copies of the rank's rows (the other ranks' tokens,
    stood in by its own) and combine keeps the rank's rows, so the rank's experts
    - `experts / world` of them - see as many tokens as with real collectives.
    `stand_in(rows)` takes the transfer's place on the comm stream, once per call
    with the rank's own rows; here it moves nothing, which makes this class one
    rank's compute alone (a benchmark reference).
    """

    def __init__(self, world: int = 1, rank: int = 0):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.world, self.rank = world, rank

    def stand_in(self, rows: torch.Tensor) -> None:
        pass

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        self.stand_in(x)
        return x.repeat(self.world, 1) if self.world > 1 else x

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        rows = y.shape[0] // self.world
        mine = y[self.rank * rows : (self.rank + 1) * rows]
        self.stand_in(mine)
        return mine


class LocalComm(OneRankComm):
    """`OneRankComm` whose transfer is a kernel of configurable duration (CUDA only when > 0).

    Each call issues `torch.cuda._sleep` on the current stream - the comm stream
    inside a micro-batch - for `cycles_per_token` GPU cycles per token row of
    the rank, standing in for an all-to-all whose time grows with the tokens it
    moves (two micro-batches sleep as long as one unsplit batch). The attribute
    may be changed between steps (not between a graph's capture and its
    replays: the duration is baked in).
    """

    def __init__(self, cycles_per_token: float = 0.0, world: int = 1):
        super().__init__(world)
        if cycles_per_token < 0:
            raise ValueError(f"cycles_per_token must be >= 0, got {cycles_per_token}")
        self.cycles_per_token = cycles_per_token

    def stand_in(self, rows: torch.Tensor) -> None:
        cycles = int(self.cycles_per_token * rows.shape[0])
        if cycles:
            if rows.device.type != "cuda":
                raise ValueError("the stand-in comm kernel needs a CUDA device")
            torch.cuda._sleep(cycles)


class CopyComm(OneRankComm):
    """`OneRankComm` whose transfer is a device-to-host copy on the comm stream,
    `bytes_per_token` per token row of the rank: a transfer the copy engine carries
    over PCIe, taking no SM from the compute (as a NIC's RDMA reads of GPU memory do),
    unlike `LocalComm`'s kernel. CUDA only; change `bytes_per_token` only between
    captures, as `LocalComm`'s duration."""

    def __init__(self, max_bytes: int, bytes_per_token: int = 0, world: int = 1):
        super().__init__(world)
        self.bytes_per_token = bytes_per_token
        self._src = torch.empty(max_bytes, dtype=torch.uint8, device="cuda")
        self._dst = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)

    def stand_in(self, rows: torch.Tensor) -> None:
        n = self.bytes_per_token * rows.shape[0]
        if n > self._src.numel():
            raise ValueError(f"{n} bytes exceed the stand-in's buffer of {self._src.numel()}")
        if n:
            self._dst[:n].copy_(self._src[:n], non_blocking=True)


class GroupComm:
    """A real collective per step over `group` (gloo on CPU, NCCL on GPUs)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        dist.all_reduce(y, group=self.group)
        rows = y.shape[0] // self.world
        return y[self.rank * rows : (self.rank + 1) * rows]


class KVCaches:
    """Per-layer paged KV caches in vLLM's layout: views of [blocks, kv_heads, block, 2*D]."""

    def __init__(self, raw: list[torch.Tensor], head_dim: int):
        self.raw = raw
        self.head_dim = head_dim
        self.layers = [tuple(r.transpose(1, 2).split(head_dim, dim=-1)) for r in raw]

    @classmethod
    def random(cls, cfg: ModelConfig, num_blocks: int, device, seed: int) -> KVCaches:
        """Caches filled with random 'history' (block 0 is the null block, left zero)."""
        device = torch.device(device)
        g = torch.Generator(device=device).manual_seed(seed)
        shape = (num_blocks, cfg.kv_heads, cfg.block_size, 2 * cfg.head_dim)
        raw = []
        for _ in range(cfg.layers):
            r = torch.randn(shape, generator=g, device=device).to(cfg.dtype)
            r[0] = 0
            raw.append(r)
        return cls(raw, cfg.head_dim)

    def clone(self) -> KVCaches:
        return KVCaches([r.clone() for r in self.raw], self.head_dim)


class TboTestModel:
    """Forward over one token batch: `forward(input_ids, meta, caches)` -> hidden [P, hidden].

    `input_ids` may be longer than `meta.num_actual_tokens` (padding tokens:
    their outputs are garbage, they never touch the cache or other tokens).
    `overlap` is read at each forward (a captured graph keeps the schedule it
    was captured with); outside a runner it changes nothing.
    """

    def __init__(
        self, cfg: ModelConfig, device, comm=None, seed: int = 0, overlap: str = "per_comm"
    ):
        self.cfg = cfg
        self.overlap = overlap
        self.device = torch.device(device)
        self.comm = comm or LocalComm()
        if cfg.experts % self.comm.world:
            raise ValueError(f"{cfg.experts} experts do not shard over {self.comm.world} ranks")
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(*shape, scale=None):
            scale = scale if scale is not None else shape[-2] ** -0.5
            return (torch.randn(shape, generator=g) * scale).to(self.device, cfg.dtype)

        h, hq, hkv, d = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.embed = w(cfg.vocab, h, scale=1.0)
        self.layers = []
        per_rank = cfg.experts // self.comm.world
        mine = slice(self.comm.rank * per_rank, (self.comm.rank + 1) * per_rank)
        for _ in range(cfg.layers):
            wq, wk, wv = w(h, hq * d), w(h, hkv * d), w(h, hkv * d)
            layer = dict(
                wqkv=torch.cat([wq, wk, wv], dim=1),  # one projection GEMM, as engines fuse it
                wo=w(hq * d, h),
                router=w(h, cfg.experts),
            )
            w1, w2 = w(cfg.experts, h, cfg.ffn)[mine], w(cfg.experts, cfg.ffn, h)[mine]
            # This rank's experts side by side: one up and one down GEMM for all of them
            layer["w_up"] = w1.permute(1, 0, 2).reshape(h, per_rank * cfg.ffn).contiguous()
            layer["w_down"] = w2.reshape(per_rank * cfg.ffn, h).contiguous()
            layer["experts"] = mine
            self.layers.append(layer)
        self.params = AttentionParams(scale=d**-0.5)

    @property
    def overlap(self) -> str:
        return self._overlap

    @overlap.setter
    def overlap(self, schedule: str) -> None:
        if schedule not in OVERLAP_SCHEDULES:
            raise ValueError(f"overlap={schedule!r} is not one of {OVERLAP_SCHEDULES}")
        if schedule == "staged" and self.cfg.kv_heads % 2:
            raise ValueError(
                f"overlap='staged' cuts the attention by KV-head halves; "
                f"kv_heads={self.cfg.kv_heads} is odd"
            )
        self._overlap = schedule

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], eps=1e-6)

    def _routes(self, ids: torch.Tensor) -> torch.Tensor:
        """Each token's two experts in every layer, [P, layers, 2], hashed from its id once
        per forward (a real router picks them per layer with one fused top-k kernel)."""
        e = self.cfg.experts
        first = (ids[:, None] * 7 + torch.arange(self.cfg.layers, device=ids.device)) % e
        second = (first + 1 + (ids % (e - 1))[:, None]) % e
        return torch.stack([first, second], dim=-1)

    def _gates(self, h: torch.Tensor, chosen: torch.Tensor, router: torch.Tensor):
        weights = torch.softmax(torch.gather(h @ router, 1, chosen), dim=-1)
        return torch.zeros(h.shape[0], self.cfg.experts, device=h.device, dtype=h.dtype).scatter(
            1, chosen, weights
        )

    def _experts(self, layer: dict, tokens: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """sum over this rank's experts e of gate_e * silu(x W1_e) W2_e, computed for every
        token (dense-masked) as one up and one down GEMM, as a fused-MoE kernel would launch."""
        p, ffn = tokens.shape[0], self.cfg.ffn
        up = F.silu(tokens @ layer["w_up"]).view(p, -1, ffn)
        up = up * gates[:, layer["experts"], None]
        return up.view(p, -1) @ layer["w_down"]

    def forward(
        self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, caches: KVCaches
    ) -> torch.Tensor:
        cfg = self.cfg
        p = input_ids.shape[0]
        hq_d, hkv_d = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        x = self.embed[input_ids]
        routes = self._routes(input_ids)
        ubatch = current_ubatch()
        staged = self.overlap == "staged" and ubatch is not None
        if staged and ubatch.id == 1:
            yield_to_other()  # start one segment late
        for i, layer in enumerate(self.layers):
            h = self._norm(x)
            q, k, v = (h @ layer["wqkv"]).split([hq_d, hkv_d, hkv_d], dim=-1)
            q = q.view(p, cfg.heads, cfg.head_dim)
            k = k.view(p, cfg.kv_heads, cfg.head_dim)
            v = v.view(p, cfg.kv_heads, cfg.head_dim)
            key_cache, value_cache = caches.layers[i]
            write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
            o = torch.zeros_like(q)
            if staged:
                self._attention_in_two_stages(q, key_cache, value_cache, meta, o)
            else:
                paged_attention(q, key_cache, value_cache, meta, self.params, o)
            x = x + o.view(p, -1) @ layer["wo"]

            h = self._norm(x)
            payload = torch.cat([h, self._gates(h, routes[:, i], layer["router"])], dim=-1)
            gathered = self._communicate(self.comm.dispatch, payload)
            tokens, gates = gathered[:, : cfg.hidden], gathered[:, cfg.hidden :]
            y = self._experts(layer, tokens, gates)
            x = x + self._communicate(self.comm.combine, y)
        return x

    def _attention_in_two_stages(self, q, key_cache, value_cache, meta, o) -> None:
        """Attention over the first half of the KV heads (and their query heads), a hand-over,
        then the second half: the same result as one call, in two kernels."""
        hq, hkv = self.cfg.heads // 2, self.cfg.kv_heads // 2
        halves = [(slice(0, hq), slice(0, hkv)), (slice(hq, None), slice(hkv, None))]
        for stage, (heads, kv_heads) in enumerate(halves):
            if stage:
                yield_to_other()
            kc, vc = key_cache[:, :, kv_heads], value_cache[:, :, kv_heads]
            with take_turn():
                paged_attention(q[:, heads], kc, vc, meta, self.params, o[:, heads])

    @staticmethod
    def _communicate(op, x: torch.Tensor) -> torch.Tensor:
        """Run `op` on the comm stream; the other micro-batch issues its next segment
        before this one continues on the compute stream."""
        switch_to_comm()
        record_stream_use(x)
        out = op(x)
        yield_and_switch_to_compute()
        record_stream_use(out)
        return out
