"""Nsight Compute's CSV pages read into kernels, and one markdown table a profiled shape.

`ncu --csv --page details` gives each launch's section metrics, `--page raw` the
per-reason warp-stall ratios and tensor-pipe activity; `assign_sides` splits the launches
at the marker kernel the profiling driver launches between the plugin's calls and the
anchor's (`benchmarks.kernel_profile`).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: the boundary between the two sides
STALL_RE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
TENSOR_RE = re.compile(r"^sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_active$")
NOT_STALLS = ("selected", "not_selected")  # issuing, or eligible and passed over


@dataclass
class Kernel:
    id: str
    name: str
    block: str = ""
    grid: str = ""
    metrics: dict = field(default_factory=dict)  # name -> [(unit, text value), ...]
    raw: dict = field(default_factory=dict)  # raw page: metric name -> (unit, text value)
    side: str = ""


def _csv_rows(text: str) -> list[dict]:
    """Rows of ncu CSV output as dicts, from the header line ("ID",...) on; lines
    before it (==PROF== and the application's output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return []
    body = [line for line in lines[start:] if not line.startswith("==")]  # ==PROF== etc.
    return list(csv.DictReader(io.StringIO("\n".join(body))))


def number(text) -> float | None:
    """'1,234.56' -> 1234.56; None for '', 'n/a' and the like."""
    if text is None:
        return None
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def parse_details(text: str) -> list[Kernel]:
    """`ncu --csv --page details` output -> kernels in launch order (by ID)."""
    kernels: dict[str, Kernel] = {}
    for row in _csv_rows(text):
        kid = (row.get("ID") or "").strip()
        if not kid.isdigit():  # a stray line of the application's output
            continue
        k = kernels.get(kid)
        if k is None:
            k = kernels[kid] = Kernel(kid, row.get("Kernel Name", ""))
            k.block, k.grid = row.get("Block Size") or "", row.get("Grid Size") or ""
        metric = row.get("Metric Name")
        if metric:  # a name may recur in two sections (Memory Throughput: % and byte/s)
            value = (row.get("Metric Unit") or "", row.get("Metric Value"))
            k.metrics.setdefault(metric, []).append(value)
    return sorted(kernels.values(), key=lambda k: int(number(k.id) or 0))


def merge_raw(kernels: list[Kernel], text: str) -> None:
    """Attach `ncu --csv --page raw` columns (one row per kernel after a units row)."""
    rows = _csv_rows(text)
    if not rows:
        return
    units = rows[0] if not rows[0].get("ID") else {}
    by_id = {k.id: k for k in kernels}
    for row in rows:
        k = by_id.get(row.get("ID") or "")
        if k is None:
            continue
        for col, value in row.items():
            if col and "__" in col:
                k.raw[col] = (units.get(col, ""), value)


_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "n": 1e-9, "u": 1e-6, "m": 1e-3}
_UNIT_ALIASES = {"ns": "nsecond", "us": "usecond", "ms": "msecond", "s": "second"}
_UNIT_ALIASES.update({"B": "byte", "KB": "Kbyte", "MB": "Mbyte"})


def in_unit(value: tuple | None, base: str, want: float = 1.0) -> float | None:
    """A (unit, text) metric in multiples of `want` `base`s: ('usecond', '12.5') with
    base 'second', want 1e-6 -> 12.5. Units as ncu writes them ('nsecond', 'Kbyte',
    'byte/block'); a unit whose base differs gives None."""
    if value is None:
        return None
    unit, text = value
    unit = (unit or "").split("/")[0].strip()
    unit = _UNIT_ALIASES.get(unit, unit)
    num = number(text)
    if num is None or not unit.endswith(base):
        return None
    prefix = unit[: -len(base)]
    if prefix not in _SCALE:
        return None
    return num * _SCALE[prefix] / want


def metric(k: Kernel, *names, unit: str | None = None) -> tuple | None:
    """(unit, text) of the first of `names` the kernel has (details page, then raw page);
    with `unit`, only a details entry in that unit counts (a name may recur in two
    sections in different units)."""
    for n in names:
        values = [v for v in k.metrics.get(n, ()) if unit is None or v[0] == unit]
        if values:
            return values[0]
        if n in k.raw:
            return k.raw[n]
    return None


def value(k: Kernel, *names, unit: str | None = None) -> float | None:
    got = metric(k, *names, unit=unit)
    return number(got[1]) if got else None


def pct(k: Kernel, *names) -> float | None:
    return value(k, *names, unit="%")


def assign_sides(kernels: list[Kernel], anchor: str) -> list[Kernel]:
    """Label the kernels before the marker 'plugin', after it `anchor`; the marker is
    dropped. Without a marker every kernel is labelled '?'."""
    at = next((i for i, k in enumerate(kernels) if MARKER in k.name), None)
    if at is None:
        for k in kernels:
            k.side = "?"
        return kernels
    for i, k in enumerate(kernels):
        k.side = "plugin" if i < at else anchor
    return [k for i, k in enumerate(kernels) if i != at]


def short_name(name: str, n: int = 44) -> str:
    """A readable kernel name: no 'void ', no parameter list, generic template wrappers
    (cutlass::device_kernel<...>, enable_sm90_or_later<...>) unwrapped, at most n chars."""
    s = name.strip().removeprefix("void ").strip()
    if s.endswith(")"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i].strip()
                break
    while True:
        m = re.match(r"^([\w:]+)<(.*)>$", s)
        if not m or not re.search(r"(device_kernel|enable_sm\d+_or_later)$", m.group(1)):
            break
        s = m.group(2).strip()
    s = s.replace("|", "/")
    return s if len(s) <= n else s[: n - 1] + "…"


def stalls(k: Kernel, top: int = 2) -> str:
    """The `top` warp-stall reasons, in cycles per issued instruction."""
    found = []
    details = {n: vals[0] for n, vals in k.metrics.items()}
    for source in (k.raw, details):
        for name, got in source.items():
            m = STALL_RE.match(name)
            reason = m.group(1) if m else None
            if reason is None and name.startswith("Stall "):  # a section's own labels
                reason = name[6:].strip().lower().replace(" ", "_")
            v = number(got[1])
            if reason and v is not None and reason not in NOT_STALLS:
                found.append((v, reason))
        if found:
            break
    if not found:
        return "n/a"
    found.sort(reverse=True)
    return ", ".join(f"{r} {v:.1f}" for v, r in found[:top])


def tensor_pipe(k: Kernel) -> float | None:
    vals = [number(v[1]) for n, v in k.raw.items() if TENSOR_RE.match(n)]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _f(v, spec=".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def column(k: Kernel) -> dict:
    """The table's quantities for one kernel."""
    dur = in_unit(metric(k, "Duration", "gpu__time_duration.sum"), "second", 1e-6)
    smem = [
        in_unit(metric(k, n), "byte")
        for n in ("Static Shared Memory Per Block", "Dynamic Shared Memory Per Block")
    ]
    known = [s for s in smem if s is not None]
    smem_kib = sum(known) / 1024 if known else None
    occ, theo = pct(k, "Achieved Occupancy"), pct(k, "Theoretical Occupancy")
    cpi = value(k, "Warp Cycles Per Issued Instruction")
    regs = value(k, "Registers Per Thread")
    block = k.block or _f(value(k, "Block Size"), ".0f")
    grid = k.grid or _f(value(k, "Grid Size"), ".0f")
    stall = stalls(k)
    if cpi is not None:
        stall += f" (of {cpi:.1f})"
    return {
        "duration (us)": dur,
        "SM throughput %": pct(k, "Compute (SM) Throughput", "SM Throughput"),
        "memory throughput %": pct(k, "Memory Throughput"),
        "DRAM throughput %": pct(k, "DRAM Throughput"),
        # shared-memory loads go through L1/TEX: a kernel bound by them shows it here
        "L1/shared throughput %": pct(k, "L1/TEX Cache Throughput"),
        "achieved / theoretical occupancy %": f"{_f(occ)} / {_f(theo)}",
        "registers / thread": _f(regs, ".0f"),
        "shared memory / block (KiB)": smem_kib,
        "block; grid": f"{block}; {grid}",
        "top warp stalls (cycles per issue)": stall,
        "tensor pipe %": tensor_pipe(k),
    }


def markdown_table(heading: str, anchor: str, kernels: list[Kernel]) -> str:
    """One shape's table under `heading`, kernels as columns, then each side's summed
    duration and the plugin's over the `anchor` side's."""
    head = f"### {heading}\n\n"
    if not kernels:
        return head + "No kernels were profiled.\n"
    cols = [column(k) for k in kernels]
    names = [f"{k.side}: {short_name(k.name)}" for k in kernels]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in cols[0]:
        cells = [c[key] if isinstance(c[key], str) else _f(c[key]) for c in cols]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    totals = {}
    for k, c in zip(kernels, cols, strict=True):
        if c["duration (us)"] is not None:
            totals[k.side] = totals.get(k.side, 0.0) + c["duration (us)"]
    summary = ", ".join(f"{side} {us:.1f} us" for side, us in totals.items())
    plugin, other = totals.get("plugin"), totals.get(anchor)
    if plugin and other:
        summary += f"; plugin / {anchor} = {plugin / other:.2f}"
    return head + "\n".join(lines) + f"\n\nKernel time per side (sum): {summary}.\n"
