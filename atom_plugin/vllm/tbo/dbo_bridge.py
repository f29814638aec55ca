"""vLLM's micro-batch yield points (`vllm.v1.worker.ubatching.dbo_*`) served by the plugin's runner.

vLLM's fused-MoE kernels and all-to-all layers call `dbo_yield()`,
`dbo_yield_and_switch_from_compute_to_comm()`, `dbo_current_ubatch_id()`, ...
Those look the calling thread up in `ubatching`'s two tables and apply vLLM's
`UBatchContext` methods to what they find. While a micro-batch runs on the
plugin's `MicroBatchRunner`, `registered(ctx)` puts a `VllmUBatchView` of the
plugin's context there. The methods' primitive steps (the CPU hand-off, stream
changes, events) then act on the plugin's context, so control passes through
the plugin's runner and vLLM's layers overlap without knowing whose runner it is.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from vllm import forward_context as vllm_forward_context
from vllm.utils.torch_utils import current_stream
from vllm.v1.worker import ubatching

from atom_plugin.tbo.judgement import YIELDING_ALL2ALL_BACKENDS
from atom_plugin.tbo.runner import COMM, COMPUTE, NUM_UBATCHES, UBatchContext


def model_yields(parallel_config) -> bool:
    """Whether vLLM's MoE layers will call `dbo_*` yield points under this config."""
    return (
        parallel_config.enable_expert_parallel
        and parallel_config.all2all_backend in YIELDING_ALL2ALL_BACKENDS
    )


class VllmUBatchView:
    """What vLLM's `UBatchContext` methods need, backed by the plugin's `UBatchContext`.

    vLLM's methods call `_cpu_yield`, `update_stream`, `_signal_*_done` and
    `_wait_*_done` on the object they are given; on CPU both streams are the
    thread's stream placeholder, so vLLM's stream assertions hold.
    """

    def __init__(self, ctx: UBatchContext):
        self._ctx = ctx
        self.id = ctx.id
        self.recv_hook = None
        self._cuda = ctx.compute_stream is not None
        if self._cuda:
            self.compute_stream, self.comm_stream = ctx.compute_stream, ctx.comm_stream
        else:
            self.compute_stream = self.comm_stream = current_stream()
        self.current_stream = self.compute_stream
        self._marks = {COMPUTE: None, COMM: None}

    def _name(self, stream) -> str:
        return COMM if self._cuda and stream is self.comm_stream else COMPUTE

    def _cpu_yield(self) -> None:
        self._ctx.yield_to_other()  # the runner's on_resume swaps the forward context back

    def update_stream(self, stream) -> None:
        self.current_stream = stream
        self._ctx.stream = self._name(stream)
        if self._cuda:
            torch.cuda.set_stream(stream)

    def _signal(self, name: str) -> None:
        if self._cuda:
            event = self._ctx._events[name]
            event.record(self._ctx._stream(name))
            self._marks[name] = event

    def _wait(self, waiting: str, on: str) -> None:
        if self._cuda and self._marks[on] is not None:
            self._ctx._stream(waiting).wait_event(self._marks[on])

    def _signal_compute_done(self) -> None:
        self._signal(COMPUTE)

    def _signal_comm_done(self) -> None:
        self._signal(COMM)

    def _wait_compute_done(self) -> None:
        self._wait(COMM, on=COMPUTE)

    def _wait_comm_done(self) -> None:
        self._wait(COMPUTE, on=COMM)


class _NotStarted:
    """The table slot of a micro-batch that has not started: holds a receive hook for it."""

    recv_hook = None


@contextlib.contextmanager
def registered(ctx: UBatchContext):
    """Make vLLM's `dbo_*` functions see this thread as micro-batch `ctx.id`.

    Only where `model_yields`: registered threads also get their own workspace
    slot (`dbo_current_ubatch_id()`), which the worker sizes for two.
    """
    tid = threading.get_ident()
    view = VllmUBatchView(ctx)
    ubatching._NUM_UBATCHES = NUM_UBATCHES
    missing = NUM_UBATCHES - len(ubatching._CURRENT_CONTEXTS)
    ubatching._CURRENT_CONTEXTS.extend([None] * max(0, missing))
    slots = ubatching._CURRENT_CONTEXTS
    if isinstance(slots[ctx.id], _NotStarted):
        view.recv_hook = slots[ctx.id].recv_hook
    slots[ctx.id] = view
    if slots[1 - ctx.id] is None:
        slots[1 - ctx.id] = _NotStarted()  # dbo_register_recv_hook may name it already
    ubatching._THREAD_ID_TO_CONTEXT[tid] = ctx.id
    try:
        yield view
        # As vLLM's own micro-batch does on exit: a receive the other one registered runs now.
        ubatching.UBatchContext.maybe_run_recv_hook(view)
    finally:
        ubatching._THREAD_ID_TO_CONTEXT.pop(tid, None)
        ubatching._CURRENT_CONTEXTS[ctx.id] = None


def install_forward_context(ctx: UBatchContext) -> None:
    """`MicroBatchRunner.run(on_resume=...)`: the micro-batch's vLLM forward context goes live."""
    vllm_forward_context._forward_context = ctx.forward_context
