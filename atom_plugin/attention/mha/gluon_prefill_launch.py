"""The Gluon Hopper prefill (`gluon_prefill`): whether a device and a layer's call can take
it (`device_takes_gluon_prefill`, the step plan's half; `layer_takes_gluon_prefill`, each
layer's, logged once per layer shape; both only probe for Gluon's Hopper module, the
kernel module loads at the first launch) and its launch over the paged cache viewed as TMA
rows. The Triton path of the ops runs it where both say yes, and the Triton prefill
elsewhere.

A cache [blocks, page, kv heads, D] is read as rows of a 2-d view: key (block, offset,
head) is row block * rows_per_block + head * rows_per_head + offset, its head's values
start at column head * cols_per_head. The plugin's layout (a page per head, K and V side
by side in each row) has rows_per_head = page and cols_per_head 0; vLLM's
[blocks, page, heads, D] has rows_per_head 0 and cols_per_head D.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field

import torch

from atom_plugin.attention.kept import KeptPerCache, cache_key
from atom_plugin.attention.triton_common import LOG2E, cdiv

BLOCK_N = 128  # keys a tile holds
STAGES = 2  # K/V tiles in flight
# Work of at most this many rounds (an item each SM) runs kv-head-major: its rounds are
# few, so each should hold the longest query blocks of every kv head. More work runs
# query-block-major, so the items in flight together read one kv head's cache from L2.
KV_MAJOR_WAVES = 6
HEAD_SIZES = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheRows:
    """A cache part as TMA rows: the 2-d view and where a key's row and columns are (two
    parts laid out alike compare equal)."""

    view: torch.Tensor = field(compare=False)
    rows_per_block: int
    rows_per_head: int
    cols_per_head: int


def cache_rows(cache: torch.Tensor) -> CacheRows | str:
    """`cache` [blocks, page, kv heads, D] as TMA rows, or why it cannot be."""
    blocks, page, hkv, d = cache.shape
    s_block, s_page, s_head, s_d = cache.stride()
    if s_d != 1 or s_block % s_page:
        return f"cache strides {cache.stride()} are not rows of one 2-d view"
    if s_head % s_page == 0:
        rows_per_head, cols_per_head, width = s_head // s_page, 0, d
    elif (hkv - 1) * s_head + d <= s_page:
        rows_per_head, cols_per_head, width = 0, s_head, (hkv - 1) * s_head + d
    else:
        return f"cache strides {cache.stride()} interleave heads within a row"
    if cache.data_ptr() % 16 or (s_page * cache.element_size()) % 16:
        return "cache rows are not 16-byte aligned"
    rows_per_block = s_block // s_page
    rows = (blocks - 1) * rows_per_block + (hkv - 1) * rows_per_head + page
    view = cache.as_strided((rows, width), (s_page, 1))
    return CacheRows(view, rows_per_block, rows_per_head, cols_per_head)


def gluon_prefill_problems(query, key_cache, value_cache, params) -> list[str]:
    """Why the Gluon prefill cannot run this call; empty when it can."""
    device = _device_problem(query.device)
    problems = [device] if device else []
    if query.dtype not in DTYPES or key_cache.dtype != query.dtype:
        problems.append(f"query {query.dtype} / cache {key_cache.dtype} (takes one of {DTYPES})")
    hq, d = query.shape[1], query.shape[2]
    hkv, page = key_cache.shape[2], key_cache.shape[1]
    if d not in HEAD_SIZES:
        problems.append(f"head size {d} (takes {HEAD_SIZES})")
    group = hq // hkv
    if group & (group - 1) or 64 % group:
        problems.append(f"query heads per kv head {group} is not a power of two up to 64")
    box = min(page, BLOCK_N)
    if box < 8 or page % box or BLOCK_N % box:
        problems.append(f"block size {page} (takes 8, 16, 32, 64 or a multiple of {BLOCK_N})")
    if params.sliding_window is not None:
        problems.append("sliding window")
    if params.sinks is not None:
        problems.append("attention sinks")
    for name, cache in (("key", key_cache), ("value", value_cache)):
        rows = cache_rows(cache)
        if isinstance(rows, str):
            problems.append(f"{name} {rows}")
    return problems


def device_takes_gluon_prefill(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU and this Triton has Gluon's Hopper module: the
    device's half of the gate, which the step's plan records."""
    return _device_problem(device) is None


@functools.cache
def _device_problem(device: torch.device) -> str | None:
    """Why `device` cannot run the Gluon prefill (None: it can); asked once per device."""
    if device.type != "cuda" or torch.version.hip or not torch.cuda.is_available():
        return f"device {device} is not an NVIDIA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"capability {capability} is not Hopper's (9, 0)"
    if not _has_gluon_hopper():
        return "this Triton has no Gluon Hopper module"
    return None


# a layer's call facts -> whether the Gluon kernel takes them (logged once each)
_LAYER_FITS: dict[tuple, bool] = {}


def layer_takes_gluon_prefill(query, key_cache, value_cache, params) -> bool:
    """`gluon_prefill_problems` of a layer's call, decided once per set of facts it reads
    (device, dtypes, head counts and sizes, cache layout, window and sinks) and logged
    then, with the reasons where the Triton prefill runs instead."""
    key = (
        query.device,
        query.dtype,
        key_cache.dtype,
        tuple(query.shape[1:]),
        tuple(key_cache.shape[1:]),
        key_cache.stride(),
        value_cache.stride(),
        key_cache.data_ptr() % 16 == 0,
        params.sliding_window is None,
        params.sinks is None,
    )
    fits = _LAYER_FITS.get(key)
    if fits is None:
        problems = gluon_prefill_problems(query, key_cache, value_cache, params)
        fits = _LAYER_FITS[key] = not problems
        shape = (
            f"{query.shape[1]} q / {key_cache.shape[2]} kv heads, head {query.shape[2]}, "
            f"block {key_cache.shape[1]}, {key_cache.dtype}"
        )
        if fits:
            log.info("MHA prefill: the Gluon Hopper kernel (%s)", shape)
        else:
            log.info(
                "MHA prefill: the Triton kernel (%s); the Gluon Hopper kernel does not take %s",
                shape,
                "; ".join(problems),
            )
    return fits


def _has_gluon_hopper() -> bool:
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError:
        return False
    return True


def gluon_prefill(
    query, key_cache, value_cache, meta, params, output, first_req: int, counters: WorkCounters
):
    """Causal attention for rows [first_req, num_reqs) through the Gluon kernel, its items
    drawn from `counters` (the plan's); the caller has checked `gluon_prefill_problems`
    (scale > 0 as every prefill path)."""
    from atom_plugin.attention.mha import gluon_prefill as kernels

    num = meta.num_reqs - first_req
    if num <= 0 or meta.max_query_len == 0:
        return output
    hq, d = query.shape[1], query.shape[2]
    page, hkv = key_cache.shape[1], key_cache.shape[2]
    group = hq // hkv
    box = min(page, BLOCK_N)
    caches = cache_descriptors(key_cache, value_cache, box)
    rows = caches.rows
    grid = prefill_grid(meta.max_query_len, hkv, num, d, group, _sm_count(query.device))
    kernels.prefill_kernel[(grid.programs,)](
        query,
        output,
        caches.key,
        caches.value,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        params.scale * LOG2E,
        first_req,
        counters.for_current_stream(),
        grid.items,
        grid.qblocks,
        hkv,
        int(grid.kv_major),
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        meta.block_table.stride(0),
        rows.rows_per_block,
        rows.rows_per_head,
        rows.cols_per_head,
        GROUP=group,
        D=d,
        BLOCK_N=BLOCK_N,
        STAGES=STAGES,
        PAGE=page,
        BOX=box,
        NWG=grid.warpgroups,
        num_warps=4,
    )
    return output


@dataclass(frozen=True)
class CacheDescriptors:
    """A layer's K and V caches as the kernel reads them: their rows (laid out alike) and a
    TMA descriptor each."""

    rows: CacheRows
    key: object
    value: object


_KEPT = KeptPerCache()  # each layer's pair of caches, by box


def cache_descriptors(key_cache, value_cache, box: int) -> CacheDescriptors:
    """The caches' descriptors for boxes of `box` rows, made at the first launch over them
    and kept (`attention.kept`)."""
    key = (cache_key(key_cache), cache_key(value_cache), box)
    return _KEPT.get(key, lambda: _make_descriptors(key_cache, value_cache, box))


def _make_descriptors(key_cache, value_cache, box: int) -> CacheDescriptors:
    from atom_plugin.attention.gluon_common import tma_descriptor
    from atom_plugin.attention.mha.gluon_prefill import COLS

    k_rows, v_rows = cache_rows(key_cache), cache_rows(value_cache)
    if k_rows != v_rows:
        raise ValueError("key and value caches are laid out differently")
    k_desc, v_desc = (
        tma_descriptor(r.view, list(r.view.shape), list(r.view.stride()), [box, COLS.value])
        for r in (k_rows, v_rows)
    )
    return CacheDescriptors(k_rows, k_desc, v_desc)


@dataclass(frozen=True)
class PrefillGrid:
    """The launch of one prefill: `programs` persistent programs over `items` work items
    (query block, kv head, request), `qblocks` query blocks a request, in kv-head-major
    order when `kv_major`, else query-block-major."""

    programs: int
    items: int
    qblocks: int
    kv_major: bool
    warpgroups: int


def prefill_grid(
    max_query_len: int, hkv: int, num_reqs: int, d: int, group: int, sm_count: int
) -> PrefillGrid:
    """Three consumer warpgroups at head size 64, whose products are half as long, so a
    third warpgroup's softmax hides behind them; two at 128. A work item holds 64 query
    rows a warpgroup (tokens x the group's heads); one program an SM takes them in turn."""
    warpgroups = 3 if d == 64 else 2
    qblocks = cdiv(max_query_len, 64 * warpgroups // group)
    items = qblocks * hkv * num_reqs
    kv_major = items <= KV_MAJOR_WAVES * sm_count
    return PrefillGrid(min(items, sm_count), items, qblocks, kv_major, warpgroups)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


STREAM_SLOTS = 256  # streams a device's counters serve: torch's stream pools, and more
SLOT_INTS = 8  # a slot's int32s: a 32-byte sector of its own, 16-byte aligned as Triton assumes


class WorkCounters:
    """The Gluon prefill's work counters on one device: an int32 a CUDA stream, each zero
    between launches (the program that draws a launch's last ticket stores it back:
    `gluon_prefill._next_item`), so neither a launch nor a CUDA graph's replay of one needs
    a memset. Launches on two streams may run at once (two-batch overlap's micro-batches,
    each on a stream of its own): each stream takes a slot of its own, in a sector of its
    own, and every slot is aligned alike, so one compiled kernel serves them all.

    Made before any graph capture (`work_counters`, called by the metadata builder as it
    starts): a buffer made under capture would be zeroed only by that graph's replays,
    and other launches would read whatever the memory held. A capture then takes its
    stream's slot, a view of memory that is already zero."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the Gluon prefill's work counters are made during a CUDA graph capture; "
                "make them before it (work_counters(device), as the metadata builder does)"
            )
        self._counters = torch.zeros(STREAM_SLOTS, SLOT_INTS, dtype=torch.int32, device=device)
        self._views: dict[int, torch.Tensor] = {}  # cuda stream handle -> its slot's counter
        self._lock = threading.Lock()  # two-batch overlap's micro-batches run on two threads

    def for_current_stream(self) -> torch.Tensor:
        """The current stream's counter, a one-element view (made at the stream's first
        launch; every later one, a layer's, only looks it up)."""
        stream = torch.cuda.current_stream(self._counters.device).cuda_stream
        view = self._views.get(stream)
        if view is None:
            with self._lock:
                view = self._views.get(stream)
                if view is None:
                    view = self._views[stream] = self._new_slot()
        return view

    def _new_slot(self) -> torch.Tensor:
        slot = len(self._views)
        if slot == len(self._counters):
            raise RuntimeError(
                f"the Gluon prefill ran on more than {len(self._counters)} CUDA streams; "
                "each needs a work counter of its own (STREAM_SLOTS)"
            )
        return self._counters[slot, :1]


def work_counters(device: torch.device) -> WorkCounters:
    """The device's work counters, made at the first call (which must not be under a graph
    capture); "cuda" and "cuda:<current>" name the same device."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _work_counters(device)


@functools.cache
def _work_counters(device: torch.device) -> WorkCounters:
    return WorkCounters(device)
