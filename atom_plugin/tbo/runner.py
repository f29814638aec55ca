"""The micro-batch runner: two persistent worker threads that take turns.

Each micro-batch runs the model on its own worker thread. Exactly one worker
runs at a time; a worker hands control to the other at `yield_to_other` (a
CPU hand-off). On a GPU the workers issue onto a compute stream (the caller's
current stream, so a CUDA-graph capture records them) and a communication
stream forked from it; `switch_to_comm` / `switch_to_compute` order the two
with per-micro-batch events. While micro-batch 0's collective runs on the comm
stream, micro-batch 1 issues its compute, and the GPU overlaps the two.

With `compute_streams=2` micro-batch 1 computes on a stream of its own, also
forked from the caller's: the two micro-batches' kernels then depend on each
other only through the shared comm stream, so short, latency-bound kernels of
one run beside the other's instead of after them. The collectives stay on the
one comm stream, in the same order on every rank. Kernels issued in `take_turn`
blocks form one more chain across the two compute streams, in issue order.

Model code calls the module-level functions (`yield_to_other`,
`switch_to_comm`, ...); outside a runner they do nothing, so the same model
runs unsplit. Micro-batch 0 always starts first and the two alternate, so
micro-batch 0 reaches each yield point before micro-batch 1 does.

A failure in one micro-batch wakes the other, which stops at its next yield
point; the caller gets `MicroBatchFailed`. A micro-batch that does not finish
within `timeout_s` raises `TimeoutError` in the caller.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

NUM_UBATCHES = 2
COMPUTE, COMM, TURN = "compute", "comm", "turn"
COMPUTE_STREAM_CHOICES = (1, 2)

_current = threading.local()


class MicroBatchFailed(RuntimeError):
    """A micro-batch raised; `ubatch` names it and `__cause__` is the original error."""

    def __init__(self, ubatch: int, error: BaseException):
        super().__init__(f"TBO micro-batch {ubatch} failed: {type(error).__name__}: {error}")
        self.ubatch = ubatch


class _Aborted(BaseException):
    """Raised inside a micro-batch whose sibling failed, to unwind it (past `except Exception`)."""


class _Step:
    """The hand-off state of one `run` call; `chain_turns`: the micro-batches compute on
    two streams, so `take_turn` blocks need an event to keep their order."""

    def __init__(self, chain_turns: bool, on_resume: Callable | None = None) -> None:
        self.batons = [threading.Event() for _ in range(NUM_UBATCHES)]
        self.done = [threading.Event() for _ in range(NUM_UBATCHES)]
        self.finished = [False] * NUM_UBATCHES
        self.results: list[Any] = [None] * NUM_UBATCHES
        self.errors: list[tuple[int, BaseException]] = []
        self.abort = threading.Event()
        self.lock = threading.Lock()
        self.chain_turns = chain_turns
        self.turn_event: Any = None  # end of the last `take_turn` block issued, either micro-batch
        self.on_resume = on_resume  # called with the context each time a micro-batch gets control

    def fail(self, ubatch: int, error: BaseException) -> None:
        with self.lock:
            self.errors.append((ubatch, error))
        self.abort.set()
        for b in self.batons:
            b.set()


class UBatchContext:
    """What model code running in one micro-batch sees (`current_ubatch()`)."""

    def __init__(self, ubatch_id, step, forward_context, compute_stream, comm_stream, events):
        self.id = ubatch_id
        self.forward_context = forward_context
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.stream = COMPUTE  # which of the two streams this micro-batch issues onto now
        self._step = step
        self._events = events  # {COMPUTE: Event, COMM: Event, TURN: Event} or None on CPU

    def _other(self) -> int:
        return 1 - self.id

    def _stream(self, name: str):
        return self.compute_stream if name == COMPUTE else self.comm_stream

    def _wait_baton(self) -> None:
        step = self._step
        step.batons[self.id].wait()
        step.batons[self.id].clear()
        if step.abort.is_set():
            raise _Aborted
        if step.on_resume is not None:
            step.on_resume(self)

    def yield_to_other(self) -> None:
        """Let the other micro-batch run until it yields back (no-op once it has finished)."""
        step = self._step
        if step.abort.is_set():
            raise _Aborted
        if step.finished[self._other()]:
            return
        step.batons[self._other()].set()
        self._wait_baton()

    @contextlib.contextmanager
    def take_turn(self):
        """Kernels issued inside run on the GPU after those issued inside the previous
        `take_turn` block of either micro-batch: one chain across the two, in issue order.

        On two compute streams the micro-batches' kernels otherwise run side by
        side wherever their dependencies allow; a block keeps, say, the two
        attentions apart, so each micro-batch's other kernels and collectives run
        beside the other's attention instead of both attentions sharing the GPU.
        On one compute stream the order holds anyway and this does nothing.
        """
        step = self._step
        if not step.chain_turns:
            yield
            return
        stream = self._stream(self.stream)
        if step.turn_event is not None:
            stream.wait_event(step.turn_event)
        yield
        step.turn_event = self._events[TURN]
        step.turn_event.record(stream)

    def _record(self) -> Any:
        """Mark the work issued so far on this micro-batch's current stream."""
        if self._events is None:
            return None
        event = self._events[self.stream]
        event.record(self._stream(self.stream))
        return event

    def _enter(self, name: str, event: Any) -> None:
        self.stream = name
        if event is not None:
            target = self._stream(name)
            target.wait_event(event)
            torch.cuda.set_stream(target)

    def _switch(self, name: str, yield_first: bool) -> None:
        if self.stream == name:
            if yield_first:
                self.yield_to_other()
            return
        event = self._record()
        if yield_first:
            self.yield_to_other()
        self._enter(name, event)

    def switch_to_comm(self) -> None:
        """Issue from now on onto the comm stream, after this micro-batch's compute so far."""
        self._switch(COMM, yield_first=False)

    def switch_to_compute(self) -> None:
        """Issue from now on onto the compute stream, after this micro-batch's comm so far."""
        self._switch(COMPUTE, yield_first=False)

    def yield_and_switch_to_comm(self) -> None:
        """Mark this micro-batch's compute, yield, then continue on the comm stream after it."""
        self._switch(COMM, yield_first=True)

    def yield_and_switch_to_compute(self) -> None:
        """Mark this micro-batch's comm, yield, then continue on the compute stream after it.

        The event is recorded before the hand-off, so the compute stream waits
        only for this micro-batch's collectives, not the other's issued since.
        """
        self._switch(COMPUTE, yield_first=True)


def current_ubatch() -> UBatchContext | None:
    """The micro-batch this thread runs, or None outside a runner."""
    return getattr(_current, "ctx", None)


def forward_context(default: Any = None) -> Any:
    """The running micro-batch's forward context, or `default` outside a runner."""
    ctx = current_ubatch()
    return default if ctx is None else ctx.forward_context


def _call(name: str) -> None:
    ctx = current_ubatch()
    if ctx is not None:
        getattr(ctx, name)()


def yield_to_other() -> None:
    _call("yield_to_other")


def switch_to_comm() -> None:
    _call("switch_to_comm")


def switch_to_compute() -> None:
    _call("switch_to_compute")


def yield_and_switch_to_comm() -> None:
    _call("yield_and_switch_to_comm")


def yield_and_switch_to_compute() -> None:
    _call("yield_and_switch_to_compute")


def take_turn() -> contextlib.AbstractContextManager:
    """See `UBatchContext.take_turn`; outside a runner it does nothing."""
    ctx = current_ubatch()
    return contextlib.nullcontext() if ctx is None else ctx.take_turn()


def record_stream_use(*tensors: torch.Tensor) -> None:
    """Tell the caching allocator that the current stream reads `tensors`.

    A tensor made on one stream and read on the other must not be reused by
    the allocator before that read ran; call this on the reading stream.
    """
    ctx = current_ubatch()
    if ctx is None or ctx._events is None:
        return
    stream = ctx._stream(ctx.stream)
    for t in tensors:
        t.record_stream(stream)


class MicroBatchRunner:
    """Runs a function as two overlapped micro-batches on persistent worker threads.

    `run(fn, forward_contexts)` calls `fn(ctx)` on worker i with micro-batch
    i's context and returns the two results in order. On CUDA the runner's
    compute stream is the caller's current stream at `run` (so a graph capture
    on that stream records both micro-batches) and its comm stream is joined
    back into it before `run` returns.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        timeout_s: float = 600.0,
        compute_streams: int = 1,
    ):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device} is not supported; choose cpu or cuda")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if type(compute_streams) is not int or compute_streams not in COMPUTE_STREAM_CHOICES:
            raise ValueError(
                f"compute_streams={compute_streams!r} is not one of {COMPUTE_STREAM_CHOICES}"
            )
        self.timeout_s = float(timeout_s)
        self.compute_streams = compute_streams
        self._cuda = self.device.type == "cuda"
        self._ubatch1_stream = None  # micro-batch 1's own compute stream (compute_streams=2)
        if self._cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.comm_stream = torch.cuda.Stream(self.device)
            if compute_streams == 2:
                self._ubatch1_stream = torch.cuda.Stream(self.device)
            self._events = [
                {name: torch.cuda.Event() for name in (COMPUTE, COMM, TURN)}
                for _ in range(NUM_UBATCHES)
            ]
        else:
            self.comm_stream = None
            self._events = [None] * NUM_UBATCHES
        self._broken: str | None = None
        self._closed = False
        self._jobs: list[queue.Queue] = [queue.Queue() for _ in range(NUM_UBATCHES)]
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), name=f"tbo-ubatch-{i}", daemon=True)
            for i in range(NUM_UBATCHES)
        ]
        for t in self._threads:
            t.start()

    def __enter__(self) -> MicroBatchRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker threads (waits for them unless a micro-batch hangs)."""
        if self._closed:
            return
        self._closed = True
        for q in self._jobs:
            q.put(None)
        if self._broken is None:
            for t in self._threads:
                t.join(timeout=self.timeout_s)

    def _worker(self, ubatch: int) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs[ubatch].get()
            if job is None:
                return
            step, fn, ctx, grad, inference = job
            _current.ctx = ctx
            try:
                ctx._wait_baton()
                with contextlib.ExitStack() as stack:
                    stack.enter_context(torch.inference_mode(inference))
                    stack.enter_context(torch.set_grad_enabled(grad))
                    if self._cuda:
                        stack.enter_context(torch.cuda.stream(ctx.compute_stream))
                    step.results[ubatch] = fn(ctx)
                    ctx._switch(COMPUTE, yield_first=False)  # end on the compute stream
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                step.fail(ubatch, e)
            finally:
                _current.ctx = None
                step.finished[ubatch] = True
                step.batons[1 - ubatch].set()
                step.done[ubatch].set()

    def run(
        self,
        fn: Callable[[UBatchContext], Any],
        forward_contexts: Sequence[Any],
        on_resume: Callable[[UBatchContext], None] | None = None,
    ) -> list[Any]:
        """Run `fn` once per micro-batch (0 first, then alternating at yield points).

        `on_resume(ctx)` runs on the micro-batch's thread each time it gets
        control (at its start and after every yield): a host that keeps
        per-micro-batch state in globals (vLLM's forward context) swaps it in there.
        """
        if self._closed:
            raise RuntimeError("the micro-batch runner is closed")
        if self._broken is not None:
            raise RuntimeError(f"the micro-batch runner is unusable: {self._broken}")
        if current_ubatch() is not None or threading.current_thread() in self._threads:
            raise RuntimeError("MicroBatchRunner.run cannot be nested inside a micro-batch")
        if len(forward_contexts) != NUM_UBATCHES:
            raise ValueError(
                f"need {NUM_UBATCHES} forward contexts (one per micro-batch), "
                f"got {len(forward_contexts)}"
            )
        step = _Step(chain_turns=self._ubatch1_stream is not None, on_resume=on_resume)
        compute = torch.cuda.current_stream(self.device) if self._cuda else None
        forked = [s for s in (self.comm_stream, self._ubatch1_stream) if s is not None]
        for s in forked:
            s.wait_stream(compute)  # fork: each sees everything issued so far
        compute_of = [compute, self._ubatch1_stream or compute]
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        for i in range(NUM_UBATCHES):
            ctx = UBatchContext(
                i, step, forward_contexts[i], compute_of[i], self.comm_stream, self._events[i]
            )
            self._jobs[i].put((step, fn, ctx, grad, inference))
        step.batons[0].set()
        deadline = time.monotonic() + self.timeout_s
        for i in range(NUM_UBATCHES):
            if not step.done[i].wait(max(0.0, deadline - time.monotonic())):
                step.fail(i, TimeoutError(f"micro-batch {i} did not finish in {self.timeout_s}s"))
                if not all(d.wait(1.0) for d in step.done):
                    self._broken = f"micro-batch {i} hung past {self.timeout_s}s"
                raise TimeoutError(f"TBO micro-batch {i} did not finish within {self.timeout_s}s")
        for s in forked:
            compute.wait_stream(s)  # join before returning
        if step.errors:
            ubatch, error = step.errors[0]
            raise MicroBatchFailed(ubatch, error) from error
        return list(step.results)
