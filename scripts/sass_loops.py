"""The innermost loops of a compiled kernel's machine code (SASS, from Triton's bundled
`nvdisasm`), each with its instructions counted by opcode: a decode kernel's work per KV
tile, compared across variants on a machine without a GPU. On 2026-12-06 the packed MLA
kernel's tile loop at 16 heads (one token, TMA tiles), compiled by the GPU machine's
Triton 3.6, took 935 instructions with an fp8 cache against 420 with bf16; on the H100
the fp8 kernel issued twice the instructions a cycle and took the same time.
`gluon_sm90_check.py --loops` prints them for every MLA variant it compiles. A loop with
conditional blocks (a Gluon kernel's partial-tile pass, its rare rescale) also gets the
count of its straight path: every instruction but those a conditional forward branch
inside the loop can jump over.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

# an instruction: its address, predicate, opcode and modifiers (`.64x32x16.F32.BF16`)
_ADDRESS = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9]+)*)"
)
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`?\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class Loop:
    start: int  # byte offsets of its first and last (the backward branch) instruction
    end: int
    ops: Counter  # opcode (without modifiers) -> count
    straight: Counter  # the same past the blocks a conditional forward branch jumps over

    @property
    def size(self) -> int:
        return sum(self.ops.values())

    def summary(self, top: int = 8) -> str:
        most = ", ".join(f"{op} {n}" for op, n in self.ops.most_common(top))
        text = f"{self.size} instructions ({most})"
        if self.straight != self.ops:
            most = ", ".join(f"{op} {n}" for op, n in self.straight.most_common(top))
            text += f"; straight path {sum(self.straight.values())} ({most})"
        return text


def triton_tool(name: str) -> str:
    """The path of one of the CUDA tools Triton ships (ptxas, nvdisasm, cuobjdump)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)


def disassemble(cubin: bytes) -> str:
    """`nvdisasm -c` of a cubin (the Triton that compiled it ships the tool)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [triton_tool("nvdisasm"), "-c", f.name]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {res.stderr.strip()[:300]}")
    return res.stdout


def innermost_loops(sass: str, min_size: int = 16) -> list[Loop]:
    """The loops (a backward branch and its target) that hold no other loop of at least
    `min_size` instructions, in code order; shorter ones (spin-waits on a barrier) are left
    out."""
    ops: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str, bool]] = []  # (address, target, conditional)
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _ADDRESS.search(line)
        if not m:
            continue
        at = int(m.group(1), 16)
        for name in pending:
            labels[name] = at
        pending = []
        ops.append((at, m.group(3)))
        b = _BRANCH.search(line)
        if b:
            branches.append((at, b.group(1), m.group(2) is not None))
    loops = []
    for at, target, _ in branches:
        start = labels.get(target)
        if start is not None and start < at:
            counted = Counter(op for a, op in ops if start <= a <= at)
            if sum(counted.values()) >= min_size:
                skips = [
                    (a, labels[t])
                    for a, t, cond in branches
                    if cond and start <= a < labels.get(t, -1) <= at
                ]
                straight = Counter(
                    op for a, op in ops if start <= a <= at and not any(b < a < t for b, t in skips)
                )
                loops.append(Loop(start, at, counted, straight))
    return [
        outer
        for outer in loops
        if not any(
            inner is not outer and outer.start <= inner.start and inner.end <= outer.end
            for inner in loops
        )
    ]


def mma_shapes(sass: str) -> Counter:
    """The kernel's matrix instructions counted by their whole mnemonic, shape and types
    included (`HGMMA.64x64x16.F32.BF16`: a warpgroup MMA of 64 rows, 64 columns and 16
    reduction steps), where `innermost_loops` counts them by opcode alone."""
    found = map(_ADDRESS.search, sass.splitlines())
    return Counter(m[3] + m[4] for m in found if m and m[3].endswith("MMA"))
