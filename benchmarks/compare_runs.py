"""Two runs of one kernel benchmark side by side: each row's time before and after, their
ratio, and the rows outside a tolerance. For a change that must not move the kernels' speed
(a refactor), both runs come from the same device session, one per checkout.

Reads the JSON that `benchmarks.attention --json` (MHA decode and prefill rows) and
`benchmarks.attention_mla --json` (MLA decode rows) write.

    python -m benchmarks.compare_runs before.json after.json [--tolerance 0.03] [--out table.md]
"""

from __future__ import annotations

import argparse
import json
import sys

# Per section of a report: the fields that name a row, in the order the table shows them.
ROW_KEYS = {
    "decode": ("batch", "context"),
    "prefill": ("case",),
    "rows": ("heads", "cache", "batch", "context", "q_len"),
}


def keyed_rows(report: dict) -> dict[tuple, float]:
    """(section, row key) -> microseconds, for every timed row of a report."""
    rows = {}
    for section, fields in ROW_KEYS.items():
        for row in report.get(section, ()):
            rows[(section, *(row[f] for f in fields))] = row["us"]
    return rows


def compare(before: dict, after: dict) -> tuple[list[tuple], list[tuple]]:
    """Rows as (key, before us, after us, after / before), and the keys only one run has."""
    old, new = keyed_rows(before), keyed_rows(after)
    both = [k for k in old if k in new]
    table = [(k, old[k], new[k], new[k] / old[k]) for k in both]
    unmatched = sorted(set(old) ^ set(new), key=str)
    return table, unmatched


def format_table(table: list[tuple], tolerance: float) -> str:
    lines = [
        "| section | row | before (us) | after (us) | after / before | within |",
        "|---|---|---:|---:|---:|---|",
    ]
    for key, old, new, ratio in table:
        within = "yes" if abs(ratio - 1) <= tolerance else "**no**"
        row = " ".join(str(part) for part in key[1:])
        lines.append(f"| {key[0]} | {row} | {old:.1f} | {new:.1f} | {ratio:.3f} | {within} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="JSON of the run before the change")
    p.add_argument("after", help="JSON of the run after it")
    p.add_argument("--tolerance", type=float, default=0.03, help="allowed |ratio - 1|")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    table, unmatched = compare(before, after)
    if not table:
        print("no row is in both runs", file=sys.stderr)
        return 2
    text = format_table(table, args.tolerance)
    outside = [t for t in table if abs(t[3] - 1) > args.tolerance]
    ratios = [t[3] for t in table]
    text += (
        f"\n\n{len(table)} rows; after / before {min(ratios):.3f}-{max(ratios):.3f}; "
        f"{len(outside)} outside +-{100 * args.tolerance:.0f}%"
    )
    if unmatched:
        text += f"; rows in one run only: {unmatched}"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
