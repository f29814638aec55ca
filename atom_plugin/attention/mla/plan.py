"""MLA decode planning, once per step on the host: which kernel path runs the step
(`select_kernel_impl`, asked here and nowhere on the per-layer decode path) and that path's
typed plan, which every layer's decode reads: per query token its request and visible
cached rows (`mla_token_plan`), plus the Triton kernels' launch, or AITER's page lists
and work split. `mla.ops.mla_decode` dispatches on the plan's type. Nothing here reads
the GPU back, except AITER's planning (its page count is data-dependent).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from atom_plugin.attention.dtypes import FP8_DTYPES
from atom_plugin.attention.mla.aiter import AiterMLAPlan, build_aiter_mla_plan
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout, gluon_mla_problems
from atom_plugin.attention.select import KERNEL_IMPLS, select_kernel_impl

if TYPE_CHECKING:  # launch_plan imports Triton, which the torch and AITER paths lack
    from atom_plugin.attention.mla.launch_plan import TritonMLALaunch


# The keys a token past every request does not see: more than any context holds, so its
# visible count clamps to 0 whatever row it reads.
_NO_KEYS = 1 << 30


def host_token_rows(query_start_loc: np.ndarray, num_tokens: int) -> np.ndarray:
    """The token plan's host half, from the step's query offsets (known on the host):
    `[3, num_tokens]` int32 rows of each query token's request (-1: none), the request
    row whose seq_len it reads (0 for none) and how many of those keys it does not see
    (the request's later query tokens; `_NO_KEYS` for none)."""
    qsl = query_start_loc.astype(np.int64)
    rows = np.empty((3, num_tokens), dtype=np.int32)
    rows[0], rows[1], rows[2] = -1, 0, _NO_KEYS
    start, end = int(qsl[0]), min(int(qsl[-1]), num_tokens)
    if end > start:
        q_lens = np.diff(qsl)
        req = np.repeat(np.arange(len(q_lens)), q_lens)[: end - start]
        rows[0, start:end] = rows[1, start:end] = req
        rows[2, start:end] = qsl[req + 1] - np.arange(start, end) - 1
    return rows


def _token_plan_from_host(meta, num_tokens, query_start_loc_cpu, out):
    """Five device ops where the device-side search takes some thirty (each a kernel
    launch with its host cost): the request rows and unseen-key counts come from the
    host's query offsets in one copy, and only the gather of seq_lens and the
    subtraction run where seq_lens lives (under async scheduling its values are the
    device's)."""
    device = meta.seq_lens.device
    host = torch.from_numpy(
        host_token_rows(query_start_loc_cpu[: meta.num_reqs + 1].numpy(), num_tokens)
    )
    if device.type != "cpu":
        host = host.pin_memory()  # the caching host allocator keeps it until the copy ran
    rows = host.to(device, non_blocking=True)
    seen = meta.seq_lens.index_select(0, rows[1])
    if out is None:
        req, kv_len = rows[0], torch.empty_like(seen)
    else:
        req, kv_len = out[0][:num_tokens], out[1][:num_tokens]
        req.copy_(rows[0])
    torch.sub(seen, rows[2], out=kv_len)
    return req, kv_len.clamp_(min=0)


def _uniform_decode_views(meta, num_tokens, identity):
    """A uniform decode's token plan as views, no device op: request t is token t (a
    slice of the persistent `identity`) and it sees all of its seq_len keys (vLLM's
    seq_lens itself). Both stay at fixed addresses from step to step, as a captured CUDA
    graph needs: vLLM writes each step's seq_lens into the same persistent buffer, which
    the MHA backend's decode graphs read as well. Every decode step plans, and each
    launch would be host time on it (the 16-head steps are paced by the host,
    docs/benchmarks.md)."""
    if identity.shape[0] < num_tokens:
        raise ValueError(
            f"the identity rows hold {identity.shape[0]} tokens, the step has {num_tokens}"
        )
    return identity[:num_tokens], meta.seq_lens[:num_tokens]


def mla_token_plan(
    meta,
    num_tokens: int,
    token_kv_lens: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    identity: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token: its request row (-1: not covered by any request) and how many
    cached keys it sees (int32, on the metadata's device, no host sync).

    Token t of request r (qsl[r] <= t < qsl[r+1]) is query j = t - qsl[r] of q_len, at
    position seq_len - q_len + j, so it sees seq_len - q_len + j + 1 keys. Rows with
    seq_len 0 are inert and see none. `token_kv_lens` replaces the visible counts (decode
    context parallelism, where the cache holds only this rank's share of each context).
    `out`: persistent buffers the plan is written into (their first `num_tokens`
    entries are returned). `query_start_loc_cpu`: the host's copy of the query offsets;
    with it a step that is not a uniform decode plans from the host
    (`host_token_rows`). `identity`: a persistent int32 0, 1, 2, ... at least
    `num_tokens` long; with it a uniform decode step runs no device op at all
    (`_uniform_decode_views`).
    """
    if out is not None and out[0].shape[0] < num_tokens:
        raise ValueError(f"plan buffers hold {out[0].shape[0]} tokens, the step has {num_tokens}")
    if token_kv_lens is None and meta.max_query_len <= 1 and num_tokens == meta.num_reqs:
        # A uniform decode step (query_start_loc is 0, 1, ..., n): token t is request t's
        # only query and sees all of its seq_len keys. With the identity rows no op at
        # all, else two instead of some forty small ones (each a kernel launch and its
        # host cost on every decode step); with buffers, written straight into them.
        if identity is not None:
            return _uniform_decode_views(meta, num_tokens, identity)
        if out is None:
            req = torch.arange(num_tokens, device=meta.query_start_loc.device, dtype=torch.int32)
            return req, meta.seq_lens[:num_tokens].to(torch.int32)
        req, kv_len = out[0][:num_tokens], out[1][:num_tokens]
        torch.arange(num_tokens, out=req)
        kv_len.copy_(meta.seq_lens[:num_tokens])
        return req, kv_len
    if query_start_loc_cpu is not None and token_kv_lens is None:
        return _token_plan_from_host(meta, num_tokens, query_start_loc_cpu, out)
    qsl = meta.query_start_loc[: meta.num_reqs + 1]
    t = torch.arange(num_tokens, device=qsl.device, dtype=qsl.dtype)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    covered = (req < meta.num_reqs) & (t >= qsl[0])
    req = req.clamp(max=max(meta.num_reqs - 1, 0))
    if token_kv_lens is not None:
        if token_kv_lens.shape[0] < num_tokens:
            raise ValueError(
                f"token_kv_lens has {token_kv_lens.shape[0]} entries for {num_tokens} query tokens"
            )
        kv_len = token_kv_lens[:num_tokens].to(torch.int32)
    else:
        seq = meta.seq_lens[: meta.num_reqs].to(torch.int64)
        q_start = qsl[req].to(torch.int64)
        q_len = qsl[req + 1].to(torch.int64) - q_start
        kv_len = seq[req] - q_len + (t.to(torch.int64) - q_start) + 1
        kv_len = torch.where(seq[req] > 0, kv_len, torch.zeros_like(kv_len))
    kv_len = torch.where(covered, kv_len.clamp(min=0), torch.zeros_like(kv_len)).to(torch.int32)
    req = torch.where(covered, req, torch.full_like(req, -1)).to(torch.int32)
    if out is None:
        return req, kv_len
    out[0][:num_tokens].copy_(req)
    out[1][:num_tokens].copy_(kv_len)
    return out[0][:num_tokens], out[1][:num_tokens]


@dataclass(frozen=True)
class TorchMLAPlan:
    """The torch reference's plan: per query token its request row (-1: none) and how
    many cached rows it sees (`mla_token_plan`)."""

    token_req: torch.Tensor
    token_kv_len: torch.Tensor


# Launches planned in this process, by kernel name (`TritonMLALaunch.name`). A decode step
# that a CUDA graph replays runs the launch planned at its capture, so under graphs this
# counts captures and eager steps: what the engine tests read to see which kernel ran.
PLANNED_LAUNCHES: Counter[str] = Counter()


@dataclass(frozen=True)
class TritonMLAPlan:
    """The Triton path's plan: the token plan and the step's launch (stage-1 kernel,
    packing, split count, tiles), the same for every layer. The launch is planned at its
    first read (`make_launch`, host integers only): a decode step that a FULL CUDA graph
    replays runs the launch the graph captured, and its own is never read, nor planned."""

    token_req: torch.Tensor
    token_kv_len: torch.Tensor
    make_launch: Callable[[], TritonMLALaunch] = field(repr=False, compare=False)

    @functools.cached_property
    def launch(self) -> TritonMLALaunch:
        launch = self.make_launch()
        PLANNED_LAUNCHES[launch.name] += 1
        return launch

    @property
    def planned_launch(self) -> TritonMLALaunch | None:
        """The launch if something has read it, else None (planning nothing)."""
        return self.__dict__.get("launch")


MLAPlan = TorchMLAPlan | TritonMLAPlan | AiterMLAPlan


def takes_prefill_rows(kernel_impl: str, device: torch.device, layout: MLAStepLayout) -> bool:
    """Whether the decode path `kernel_impl` runs rows of many new tokens (a prefix-cache
    hit's remainder) on `device`: the torch reference does; Triton where the Gluon kernel
    runs this layout (`launch_plan.choose_kernel` gives Gluon every step with rows of more
    than one token; the packed Triton kernel's run of such rows at 16 heads on a 16-bit
    cache has not passed on a GPU yet, docs/mla.md); AITER's decode was checked on
    speculative rows only."""
    if kernel_impl == "torch":
        return True
    return kernel_impl == "triton" and not gluon_mla_problems(device, layout)


def plan_mla_decode(
    meta,
    num_tokens: int,
    num_heads: int,
    *,
    kernel_impl: str | None = None,
    kv_dtype: torch.dtype | None = None,
    layout: MLAStepLayout | None = None,
    token_kv_lens: torch.Tensor | None = None,
    context: int | None = None,
    config: dict | None = None,
    num_splits: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    identity: torch.Tensor | None = None,
) -> MLAPlan:
    """Choose the step's kernel path (`kernel_impl`, else `select_kernel_impl` for the
    metadata's device) and plan it. `kv_dtype` is the cache's and `layout` the query
    dtype and cache block size and widths: AITER needs both, the Triton launch differs
    for fp8 and chooses the Gluon kernel only with a layout. `token_kv_lens` replaces
    the visible row counts (decode context parallelism; AITER takes none). `context`
    is the key count the split rule plans for (default `meta.max_seq_len`; a CUDA-graph
    capture passes the longest context the graph may replay); `config` and
    `num_splits` tune the Triton launch. `out` holds persistent buffers the token plan
    is copied into, so a captured graph reads each step's plan at the same addresses;
    `query_start_loc_cpu` lets the token plan work from the host and `identity` lets a
    uniform decode's plan be views (`mla_token_plan`)."""
    impl = kernel_impl or select_kernel_impl(meta.query_start_loc.device)
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"kernel_impl must be one of {KERNEL_IMPLS}, got {impl!r}")
    if impl == "aiter":
        return _plan_aiter(meta, num_heads, kv_dtype, layout, token_kv_lens)
    req, kv_len = mla_token_plan(
        meta, num_tokens, token_kv_lens, out, query_start_loc_cpu, identity
    )
    if impl == "torch":
        return TorchMLAPlan(req, kv_len)
    # imported here: Triton is optional (not installed on every platform)
    from atom_plugin.attention.mla.launch_plan import plan_launch

    make_launch = functools.partial(
        plan_launch,
        meta.num_reqs,
        num_tokens,
        meta.max_query_len,
        num_heads,
        meta.max_seq_len if context is None else context,
        meta.query_start_loc.device,
        fp8_cache=kv_dtype in FP8_DTYPES,
        config=config,
        num_splits=num_splits,
        layout=layout,
    )
    plan = TritonMLAPlan(req, kv_len, make_launch)
    if config is not None or num_splits is not None:
        plan.launch  # noqa: B018 - a caller's own choices are checked here, not at a layer
    return plan


def _plan_aiter(meta, num_heads, kv_dtype, layout, token_kv_lens) -> AiterMLAPlan:
    if token_kv_lens is not None:
        raise NotImplementedError(
            "the AITER MLA path takes no per-token key counts (decode context parallelism "
            "with multi-token queries); use ATOM_PLUGIN_KERNELS=triton"
        )
    if layout is None or kv_dtype is None:
        raise ValueError("the AITER plan needs the step's layout and the cache's dtype")
    return build_aiter_mla_plan(
        meta,
        num_heads=num_heads,
        q_dtype=layout.q_dtype,
        kv_dtype=kv_dtype,
        page_size=layout.block_size,
    )
