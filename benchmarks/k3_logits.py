"""Kimi-K3 required-channel logits kernel at the K3 vocabulary (163,840), fp32 logits.

fp32 because that is the dtype vLLM samples from (both runners upcast logits
before logits processors). For every case it measures, in the same run:
- ours: the one Triton launch of `apply_required_channel` (device time from a
  CUDA graph of back-to-back launches, and eager wall time per call, which
  includes Python launch overhead), and the number of kernels it launched
  (torch profiler);
- xgrammar: `apply_token_bitmask_inplace` (its Triton kernel, the one vLLM's
  grammar path uses on CUDA) with a bitmask of the same vocabulary giving the
  same mask, bitmask already on the device (vLLM also copies it there each
  step and fills it on the CPU; neither is counted);
- physical references: an empty kernel launch, a fill of the forced rows' bytes
  (the least any forced-row mask must write) and a device-to-device copy of
  the step's logits bytes;
- ATOM's MI355X figures from the original change, quoted (not measured here).

A second table (same run) is the schema-constrained calls: a mixed batch of 256 rows
(required rows inside the arguments of four different schemas, named rows, forced-prefix
rows, waiting rows and free rows, benchmarks/k3_calls.py) on a synthetic BPE-like vocabulary
of the K3 size (benchmarks/k3_vocab.py; the K3 tokenizer cannot be downloaded): our one launch
against xgrammar's `apply_token_bitmask_inplace` with a bitmask giving the same mask, and
xgrammar's host-side bitmask fill for vLLM's own kimi_k3 structural tag at the same positions
(when xgrammar and vLLM import); and the one-off build of the vocabulary's token classes on
the host CPU.

Usage: python benchmarks/k3_logits.py [--out FILE] [--xgrammar-wheel WHEEL] [--calls-only]
`--xgrammar-wheel` loads xgrammar's Triton kernel file straight from a wheel
when `import xgrammar` fails (it needs only torch and triton).
`--smoke` runs every code path on the CPU under TRITON_INTERPRET=1 at a small
vocabulary; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

VOCAB = 163_840
SMOKE_VOCAB = 640
SMOKE_CALLS_VOCAB = 4096  # the synthetic vocabulary's smallest size

# ATOM's figures on an MI355X, from the notes: (before, after) in microseconds.
ATOM_MI355X = {
    "waiting": "5-7 (no forced row)",
    "forced1": "58 -> 4",
    "verify1": "400 -> 15",
    "verify64": "482 -> 52",
}
TARGETS = {
    "none": "0 launches",
    "waiting256": "<= 5 us",
    "forced1": "<= 4 us",
    "verify1": "<= 10 us",
    "verify64": "<= 30 us",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--xgrammar-wheel", help="an xgrammar wheel to take the kernel from")
    parser.add_argument("--graph-calls", type=int, default=20, help="launches per CUDA graph")
    parser.add_argument("--replays", type=int, default=50, help="graph replays per trial")
    parser.add_argument("--trials", type=int, default=5, help="trials; the median is reported")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreted, tiny vocabulary")
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="only the calls table's host-side figures (token classes, xgrammar's fill) at "
        "the K3 vocabulary size, on the CPU",
    )
    parser.add_argument(
        "--calls-only", action="store_true", help="only the schema-constrained calls table"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time the kernel over BLOCK x PROGRAMS choices"
    )
    return parser.parse_args(argv)


ARGS = parse_args(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from atom_plugin.k3 import START, UNCONSTRAINED, RequiredChannel, compile_channel  # noqa: E402
from atom_plugin.k3.channel_kernel import (  # noqa: E402
    BLOCK,
    PROGRAMS,
    advance_states,
    apply_channel_triton,
    apply_required_channel,
)
from benchmarks.call_timing import device_time_us, eager_time_us, launches  # noqa: E402
from benchmarks.xgrammar_mask import load_xgrammar, pack_bitmask  # noqa: E402


@triton.jit
def _empty_kernel(ptr):
    pass


@dataclass
class Case:
    key: str
    name: str
    rows: int
    forced_rows: int
    ours: Callable[[], object]
    xgrammar: Callable[[], object] | None
    physical: list[tuple[str, Callable[[], object]]] = field(default_factory=list)
    atom: str = "-"
    target: str = "-"
    # (logits, tables, states, row_slot, row_pos, row_tokens) for the block/programs sweep.
    kernel_args: tuple | None = None


def k3_channel(vocab: int) -> RequiredChannel:
    """A channel with K3's shape; control ids at the top of the vocabulary as in K3."""
    top = vocab - 256
    open_, close, sep, eom, eos = top + 2, top + 3, top + 4, top + 5, top + 1
    text = min(2000, vocab // 4)  # ordinary BPE ids for the tag names
    response, tools, call, tool_attr, quote = range(text, text + 5)
    return RequiredChannel(
        (close, response, sep), (open_, tools, sep, open_, call, tool_attr, quote), 3, [eom, eos]
    )


def bitmask(vocab: int, rows: list[tuple[str, object]], device) -> torch.Tensor:
    """xgrammar's int32 bitmask: per row ("all", None), ("ban", ids) or ("only", id)."""
    allowed = np.ones((len(rows), vocab), dtype=bool)
    for r, (kind, ids) in enumerate(rows):
        if kind == "only":
            allowed[r] = False
            allowed[r, ids] = True
        elif kind == "ban":
            allowed[r, list(ids)] = False
    return pack_bitmask(allowed, device)


def build_cases(vocab: int, device, xgr) -> list[Case]:
    channel = k3_channel(vocab)
    tables = compile_channel(channel, device)
    forced0 = channel.num_waiting  # just after `after`: forces opening[0]
    end_ids = sorted(channel.end_ids)
    cases: list[Case] = []

    def logits(rows: int) -> torch.Tensor:
        return torch.randn(rows, vocab, device=device, dtype=torch.float32)

    def xgr_case(x: torch.Tensor, rows: list[tuple[str, object]]):
        if xgr is None:
            return None
        mask = bitmask(vocab, rows, device)
        return lambda: xgr(x, mask)

    def fill(x: torch.Tensor, n: int):
        return (f"fill {n} row(s) ({n * vocab * 4 / 1e6:.2f} MB)", lambda: x[:n].fill_(0.0))

    def copy(x: torch.Tensor):
        dst = torch.empty_like(x)
        return (f"d2d copy of step logits ({x.numel() * 4 / 1e6:.2f} MB)", lambda: dst.copy_(x))

    empty_arg = torch.empty(1, device=device)
    empty = ("empty kernel launch", lambda: _empty_kernel[(1,)](empty_arg))

    x = logits(64)
    dead = torch.full((64,), -1, dtype=torch.int32, device=device)
    cases.append(
        Case(
            "none",
            "no channel row, batch 64",
            64,
            0,
            lambda x=x: apply_required_channel(x, tables, dead, live=False, impl="triton"),
            None,
            [empty],
            "-",
            TARGETS["none"],
        )
    )

    def ours(x, states, row_slot=None, row_pos=None, row_tokens=None):
        def call():
            apply_required_channel(
                x,
                tables,
                states,
                live=True,
                row_slot=row_slot,
                row_pos=row_pos,
                row_tokens=row_tokens,
                impl="triton",
            )

        return call, (x, tables, states, row_slot, row_pos, row_tokens)

    for batch in (1, 64, 256):
        x = logits(batch)
        states = torch.full((batch,), START, dtype=torch.int32, device=device)
        call, kernel_args = ours(x, states)
        cases.append(
            Case(
                f"waiting{batch}",
                f"channel rows, none forced, batch {batch}",
                batch,
                0,
                call,
                xgr_case(x, [("ban", end_ids)] * batch),
                [empty, copy(x)],
                ATOM_MI355X["waiting"],
                TARGETS.get(f"waiting{batch}", "-"),
                kernel_args,
            )
        )
    x = logits(256)
    states = torch.full((256,), UNCONSTRAINED, dtype=torch.int32, device=device)
    call, kernel_args = ours(x, states)
    cases.append(
        Case(
            "open256",
            "channel rows all past their opening (host not told), batch 256",
            256,
            0,
            call,
            None,
            [empty],
            kernel_args=kernel_args,
        )
    )
    x = logits(1)
    states = torch.full((1,), forced0, dtype=torch.int32, device=device)
    call, kernel_args = ours(x, states)
    cases.append(
        Case(
            "forced1",
            "one forced row, batch 1",
            1,
            1,
            call,
            xgr_case(x, [("only", channel.opening[0])]),
            [empty, fill(x, 1)],
            ATOM_MI355X["forced1"],
            TARGETS["forced1"],
            kernel_args,
        )
    )
    drafts = list(channel.opening)  # drafts that follow the channel: rows 0..6 forced
    for batch, forced_requests, key in ((1, 1, "verify1"), (64, 64, "verify64"), (64, 1, "")):
        rows = batch * 8
        x = logits(rows)
        slot_states = torch.full((batch,), START, dtype=torch.int32, device=device)
        slot_states[:forced_requests] = forced0
        row_slot = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(8)
        row_pos = torch.arange(8, device=device, dtype=torch.int32).repeat(batch)
        row_tokens = torch.tensor([0, *drafts], dtype=torch.int32, device=device).repeat(batch)
        per_request_forced = [("only", t) for t in channel.opening] + [("all", None)]
        per_request_waiting = [("ban", end_ids)] * 8
        masks = per_request_forced * forced_requests + per_request_waiting * (
            batch - forced_requests
        )
        what = "every request" if forced_requests == batch else "one request"
        call, kernel_args = ours(x, slot_states, row_slot, row_pos, row_tokens)
        cases.append(
            Case(
                key or "verify64one",
                f"verify step, 7 drafts, batch {batch} ({rows} rows), 7 forced rows in {what}",
                rows,
                7 * forced_requests,
                call,
                xgr_case(x, masks),
                [empty, fill(x, 7 * forced_requests), copy(x)],
                ATOM_MI355X.get(key, "-"),
                TARGETS.get(key, "-"),
                kernel_args,
            )
        )
    cases.append(mixed_case(vocab, device, channel, end_ids, xgr_case, fill, copy, empty))
    for batch in (1, 64, 256):
        history = torch.randint(0, 1000, (batch, 4096), dtype=torch.int32, device=device)
        states = torch.full((batch,), START, dtype=torch.int32, device=device)
        scanned = torch.full((batch,), 100, dtype=torch.int32, device=device)
        total = torch.full((batch,), 101, dtype=torch.int32, device=device)
        slots = torch.arange(batch, dtype=torch.int32, device=device)

        def advance(states=states, scanned=scanned, total=total, history=history, slots=slots):
            scanned.fill_(100)  # each call folds one committed token again
            advance_states(tables, states, scanned, history, total, slots)

        cases.append(
            Case(
                f"advance{batch}",
                f"state advance, 1 committed token/request, batch {batch} (+1 fill launch)",
                batch,
                0,
                advance,
                None,
                [empty],
            )
        )
    return cases


MIXED_BATCH = 256
NAMED_EVERY = 4  # rows 0, 4, 8, ...: named requests; rows 1, 5, ...: required; the rest free


def mixed_case(vocab, device, channel, end_ids, xgr_case, fill, copy, empty) -> Case:
    """Batch 256 through the processors' core: 64 named requests (64 different names of
    1-4 ids, each forcing its name's first id), 64 required requests waiting, 128 rows
    without a channel. One launch whatever the mix; xgrammar gets the same masks."""
    from atom_plugin.k3.processor_core import ChannelCore

    text = min(2000, vocab // 4) + 16  # ordinary ids for the names, past the tag names
    core = ChannelCore(MIXED_BATCH, device, impl="triton")
    masks: list[tuple[str, object]] = []
    forced_rows = 0
    for slot in range(MIXED_BATCH):
        if slot % NAMED_EVERY == 0:
            n = slot // NAMED_EVERY
            name = [text + n, *range(text + 100, text + 100 + n % 4)]  # 1..4 ids
            named = channel.extended([*name, channel.opening[-1]])
            core.assign(slot, named, named.num_waiting + len(channel.opening))
            masks.append(("only", name[0]))
            forced_rows += 1
        elif slot % NAMED_EVERY == 1:
            core.assign(slot, channel, START)
            masks.append(("ban", end_ids))
        else:
            masks.append(("all", None))
    core.flush()
    slots = torch.arange(MIXED_BATCH).numpy()
    x = torch.randn(MIXED_BATCH, vocab, device=device, dtype=torch.float32)
    return Case(
        "mixed256",
        f"mixed batch {MIXED_BATCH}: {forced_rows} named requests (one forced row each, "
        f"{forced_rows} names), {forced_rows} required waiting, {MIXED_BATCH - 2 * forced_rows} "
        f"without a channel; {core.num_channels} channels, through ChannelCore.apply",
        MIXED_BATCH,
        forced_rows,
        lambda: core.apply(x, slots),
        xgr_case(x, masks),
        [empty, fill(x, forced_rows), copy(x)],
        "- (named not covered)",
        "1 launch",
    )


def run(args: argparse.Namespace) -> str:
    if args.host_only:
        return "\n".join(host_table(args)) + "\n"
    if args.smoke:
        device, vocab = torch.device("cpu"), SMOKE_VOCAB
        args.replays = args.trials = 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke for a CPU run of the code paths)")
        device, vocab = torch.device("cuda"), VOCAB
    xgr, xgr_from = load_xgrammar(args.xgrammar_wheel)

    def timed(fn):
        if device.type == "cuda":
            return f"{device_time_us(fn, args):.2f}", f"{eager_time_us(fn, args, device):.2f}"
        return "-", f"{eager_time_us(fn, args, device):.0f}"

    lines = [
        f"Device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (smoke)'}; "
        f"torch {torch.__version__}, triton {triton.__version__}; fp32 logits.",
        f"xgrammar: {xgr_from if xgr else 'not available (' + xgr_from + ')'}.",
        "Times in us per call: 'dev' = device time per launch from a CUDA graph of "
        f"{args.graph_calls} back-to-back calls; 'eager' = wall time per eager call "
        f"(median of {args.trials} trials).",
    ]
    if not args.calls_only:
        lines += channel_table(args, device, vocab, xgr, timed)
    lines += calls_table(args, device, xgr, timed)
    return "\n".join(lines) + "\n"


def channel_table(args, device, vocab, xgr, timed) -> list[str]:
    lines = [
        "",
        f"Required and named channels, vocabulary {vocab}. ATOM figures are theirs, on an MI355X.",
        "",
        "| case | rows | forced rows | our launches | ours dev | ours eager | "
        "xgrammar dev | xgrammar eager | physical reference (dev us) | ATOM MI355X | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = build_cases(vocab, device, xgr)
    for case in cases:
        n_launches = launches(case.ours, device)
        if case.key == "none":
            ours_dev, ours_eager = "-", f"{eager_time_us(case.ours, args, device):.2f}"
        else:
            ours_dev, ours_eager = timed(case.ours)
        if case.xgrammar is not None:
            xgr_dev, xgr_eager = timed(case.xgrammar)
        elif case.key.startswith(("waiting", "forced", "verify", "mixed")):
            xgr_dev = xgr_eager = "not available"
        else:
            xgr_dev = xgr_eager = "-"
        physical = "; ".join(f"{what}: {timed(fn)[0]}" for what, fn in case.physical)
        lines.append(
            f"| {case.name} | {case.rows} | {case.forced_rows} | {n_launches} | {ours_dev} | "
            f"{ours_eager} | {xgr_dev} | {xgr_eager} | {physical} | {case.atom} | {case.target} |"
        )
    if args.sweep:
        lines += sweep_table(cases, args, device)
    return lines


def host_table(args) -> list[str]:
    """The calls batch's host-side costs at the K3 vocabulary size, on the CPU."""
    from benchmarks.k3_calls import CallsBatch, XgrammarFill, class_build_seconds
    from benchmarks.k3_vocab import SyntheticK3Tokenizer

    tokenizer = SyntheticK3Tokenizer(VOCAB)
    build_s, num_classes = class_build_seconds(tokenizer, VOCAB)
    batch = CallsBatch(tokenizer, torch.device("cpu"))
    fill = XgrammarFill(batch)
    fill_us = eager_time_us(fill.fill, args, torch.device("cpu"))
    return [
        f"Host CPU only; torch {torch.__version__}; synthetic BPE-like vocabulary of {VOCAB} "
        "ids (benchmarks/k3_vocab.py, not the K3 tokenizer).",
        f"Batch {MIXED_BATCH}: {batch.describe()}.",
        "",
        "| host-side cost | value |",
        "|---|---|",
        f"| token classes (`classes_for_tokenizer`, once per engine) | {build_s:.2f} s, "
        f"{num_classes} classes |",
        f"| xgrammar compile of vLLM's kimi_k3 tags (required + one forced per tool) | "
        f"{fill.compile_seconds:.2f} s |",
        f"| xgrammar `fill_next_token_bitmask`, {fill.rows} rows, per step (median of "
        f"{args.trials} x {args.replays * 4} steps) | {fill_us:.0f} us "
        f"({fill_us / fill.rows:.1f} us/row) |",
    ]


def calls_table(args, device, xgr, timed) -> list[str]:
    """The mixed batch with calls against xgrammar, and the token-class build."""
    from benchmarks.k3_calls import CallsBatch, XgrammarFill, class_build_seconds
    from benchmarks.k3_vocab import SyntheticK3Tokenizer

    vocab = SMOKE_CALLS_VOCAB if args.smoke else VOCAB
    t0 = time.perf_counter()
    tokenizer = SyntheticK3Tokenizer(vocab)
    made_s = time.perf_counter() - t0
    build_s, num_classes = class_build_seconds(tokenizer, vocab)
    batch = CallsBatch(tokenizer, device)
    x = torch.randn(MIXED_BATCH, vocab, device=device, dtype=torch.float32)
    ours = lambda: batch.apply(x)  # noqa: E731
    core_launches = ours()
    if core_launches != 1:
        raise SystemExit(f"the calls batch took {core_launches} launches, expected 1")
    allowed = torch.from_numpy(batch.allowed(vocab)).to(device)
    if not torch.equal(torch.isfinite(x), allowed):
        raise SystemExit("the kernel's mask differs from the state machine's for the calls batch")
    xgr_dev = xgr_eager = "not available"
    if xgr is not None:
        mask = batch.bitmask(vocab, device)
        y = torch.randn(MIXED_BATCH, vocab, device=device, dtype=torch.float32)
        xgr(y, mask)
        if not torch.equal(torch.isfinite(y), allowed):
            raise SystemExit("xgrammar's bitmask does not give the same mask as ours")
        xgr_dev, xgr_eager = timed(lambda: xgr(x, mask))
    try:
        fill = XgrammarFill(batch)
    except Exception as err:  # xgrammar or vLLM missing or broken: say so rather than guess
        fill_cell, compile_note = f"not available ({type(err).__name__}: {err})", ""
    else:
        fill_us = eager_time_us(fill.fill, args, torch.device("cpu"))
        fill_cell = f"{fill_us:.0f} ({fill.rows} rows, {fill_us / fill.rows:.1f}/row)"
        compile_note = (
            f" xgrammar compiled vLLM's kimi_k3 tags (required + one forced per tool) in "
            f"{fill.compile_seconds:.2f} s."
        )
    ours_dev, ours_eager = timed(ours)
    empty_arg = torch.empty(1, device=device)
    dst = torch.empty_like(x)
    physical = (
        f"empty kernel launch: {timed(lambda: _empty_kernel[(1,)](empty_arg))[0]}; "
        f"d2d copy of step logits ({x.numel() * 4 / 1e6:.2f} MB): {timed(lambda: dst.copy_(x))[0]}"
    )
    return [
        "",
        f"Schema-constrained calls: synthetic BPE-like vocabulary of {vocab} ids "
        "(benchmarks/k3_vocab.py, not the K3 tokenizer, which cannot be downloaded); "
        f"batch {MIXED_BATCH}: {batch.describe()}.",
        "xgrammar apply: `apply_token_bitmask_inplace` with a bitmask giving the same mask "
        "as ours (checked), already on the device; its host-to-device copy is not counted. "
        "xgrammar host fill: one `GrammarMatcher` per constrained row, compiled from vLLM's "
        "own kimi_k3 structural tag for the same tools (required; named as vLLM's forced) and "
        "advanced through the same ids, `fill_next_token_bitmask` for every such row once, "
        "serially on one host thread (wall us per step on this host's CPU; its masks are "
        "vLLM's, looser than ours). Ours needs no host work per step beyond the launch."
        + compile_note,
        "",
        "| case | rows | forced rows | our launches (core / profiler) | ours dev | ours eager "
        "| xgrammar apply dev | xgrammar apply eager | xgrammar host fill per step (us) "
        "| physical reference (dev us) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| mixed batch {MIXED_BATCH} with calls, through ChannelCore.apply | {MIXED_BATCH} | "
        f"{batch.forced_rows} | {core_launches} / {launches(ours, device)} | {ours_dev} | "
        f"{ours_eager} | {xgr_dev} | {xgr_eager} | {fill_cell} | {physical} |",
        "",
        f"Token classes, built once per engine on its first request with calls: "
        f"`classes_for_tokenizer` over the synthetic vocabulary of {vocab} ids (decode each "
        f"id, sort into classes): {build_s:.2f} s on the host CPU, {num_classes} classes "
        f"(making the synthetic vocabulary itself, {made_s:.2f} s, is not counted).",
    ]


SWEEP_BLOCKS = (1024, 2048, 4096, 8192)
SWEEP_PROGRAMS = (256, 1024, 4096)


def sweep_table(cases: list[Case], args: argparse.Namespace, device) -> list[str]:
    """Device us of the kernel alone for each (BLOCK, PROGRAMS); defaults are starred."""
    head = [
        f"{b}/{p}{'*' if (b, p) == (BLOCK, PROGRAMS) else ''}"
        for b in SWEEP_BLOCKS
        for p in SWEEP_PROGRAMS
    ]
    lines = [
        "",
        "Kernel alone, device us per launch, by BLOCK/PROGRAMS (* = the defaults):",
        "",
        "| case | " + " | ".join(head) + " |",
        "|---|" + "---|" * len(head),
    ]
    for case in cases:
        if case.kernel_args is None:
            continue
        cells = []
        for block in SWEEP_BLOCKS:
            for programs in SWEEP_PROGRAMS:

                def call(block=block, programs=programs, kernel_args=case.kernel_args):
                    apply_channel_triton(*kernel_args, block=block, programs=programs)

                cells.append(timed_dev(call, args, device))
        lines.append(f"| {case.name} | " + " | ".join(cells) + " |")
    return lines


def timed_dev(fn, args, device) -> str:
    if device.type != "cuda":
        fn()
        return "-"
    return f"{device_time_us(fn, args):.2f}"


def main() -> None:
    table = run(ARGS)
    print(table)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
