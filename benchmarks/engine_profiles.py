"""The engine benchmark's profile tables (`--profile`): each profiled pass's kernels a step,
and where the plugin's GPU time a step differs from each vLLM backend's in the same pass.

A profile's record (`engine_probe.reduce_trace`) keeps every kernel the pass ran, with
`kernels_complete` set; records written before that kept the 25 longest, so the time split
below skips them (a kernel missing from one such list may have run below its cut).
"""

from __future__ import annotations

REPORT_KERNELS = 25  # kernels a profile's table lists, the longest first; the rest summed
LARGEST_DIFFERENCES = 4  # kernels both cases ran, named in the split by |difference|


def _batch(requests: list[int] | None) -> str:
    """The profiled steps' requests, as the report's title names them."""
    if not requests:
        return ""
    low, high = requests
    return f", {low} requests a step" if low == high else f", {low}-{high} requests a step"


def profile_report(case: str, prof: dict) -> str:
    """One profiled pass: its step figures and its longest kernels a step."""
    lines = [
        f"\n**{case}, profiled {prof['workload']} ({prof['phase']}, {prof['steps']} steps"
        f"{_batch(prof.get('requests_per_step'))})**: "
        f"wall {prof['wall_ms_per_step']:.3f} ms a step, GPU busy "
        f"{prof['gpu_busy_ms_per_step']:.3f} ms, {prof['kernels_per_step']:.0f} kernels, "
        f"{prof['h2d_copies_per_step']:.1f} host-to-device copies a step "
        f"({prof.get('h2d_copies_in_build_per_step', 0):.1f} from the metadata builders, "
        f"which made {prof.get('syncs_in_build_per_step', 0):.1f} sync calls a step)"
        + (
            f"; inside CUDA graphs {prof['graph_gap_us_median']:.2f} us between kernels "
            f"(median), {prof['graph_gaps_us_per_step']:.0f} us idle a step"
            if prof.get("graph_gap_us_median") is not None
            else ""
        )
        + (f"; trace {prof['trace']}" if prof.get("trace") else ""),
        "",
        "| kernel | calls a step | us a step | mean us |",
        "|---|---|---|---|",
    ]
    kernels = prof["kernels"]
    for k in kernels[:REPORT_KERNELS]:
        lines.append(
            f"| `{k['name']}` | {k['calls_per_step']:.1f} | {k['us_per_step']:.1f} | "
            f"{k['mean_us']:.1f} |"
        )
    rest = kernels[REPORT_KERNELS:]
    if rest:
        lines.append(
            f"| {len(rest)} other kernels | {sum(k['calls_per_step'] for k in rest):.1f} | "
            f"{sum(k['us_per_step'] for k in rest):.1f} | |"
        )
    for name, h in prof["host"].items():
        lines.append(f"| host `{name}` | {h['per_step']:.1f} | | {h['mean_us']:.1f} |")
    return "\n".join(lines) + "\n"


def kernel_differences(results: list[dict], plugin_cases: set[str]) -> str:
    """Per profiled pass (workload and phase): the kernels a plugin case ran that no vLLM
    case ran, then (`time_split`) its GPU time a step against each vLLM case's."""
    by_pass: dict[tuple[str, str], dict[str, dict]] = {}
    for r in results:
        for prof in r.get("profiles") or []:
            if "kernels" in prof:
                by_pass.setdefault((prof["workload"], prof["phase"]), {})[r["case"]] = prof
    only, split = [], []
    for (workload, phase), profs in by_pass.items():
        ours = {case: prof for case, prof in profs.items() if case in plugin_cases}
        theirs = {case: prof for case, prof in profs.items() if case not in plugin_cases}
        if not theirs:
            continue
        names = {k["name"] for prof in theirs.values() for k in prof["kernels"]}
        for case, prof in ours.items():
            only += [
                f"| {case} | {workload} {phase} | `{k['name']}` | "
                f"{k['calls_per_step']:.1f} | {k['us_per_step']:.1f} |"
                for k in prof["kernels"]
                if k["name"] not in names
            ]
            for other, their_prof in theirs.items():
                row = time_split(prof, their_prof)
                if row is not None:
                    split.append(f"| {case} | {other} | {workload} {phase} | {row} |")
    out = ""
    if only:
        out += "\n**Kernels only the plugin ran** (of the kernels each profile kept)\n\n"
        out += "| case | pass | kernel | calls a step | us a step |\n|---|---|---|---|---|\n"
        out += "\n".join(only) + "\n"
    if split:
        out += (
            "\n**The plugin's GPU time a step against each vLLM backend's, by kernel** "
            "(kernel time summed, overlaps counted twice)\n\n"
            "| case | against | pass | kernels only the plugin ran | kernels only it ran "
            "| kernels both ran: difference | the largest differences there |\n"
            "|---|---|---|---|---|---|---|\n"
        )
        out += "\n".join(split) + "\n"
    return out


def time_split(ours: dict, theirs: dict) -> str | None:
    """Table cells splitting two profiles' kernel time a step: ours only, theirs only,
    and the difference (ours - theirs) over the kernels both ran, with the largest
    differences named. None where a record kept only its longest kernels."""
    if not (ours.get("kernels_complete") and theirs.get("kernels_complete")):
        return None
    mine = {k["name"]: k["us_per_step"] for k in ours["kernels"]}
    other = {k["name"]: k["us_per_step"] for k in theirs["kernels"]}
    shared = mine.keys() & other.keys()
    diffs = sorted(((mine[n] - other[n], n) for n in shared), key=lambda d: -abs(d[0]))

    def alone(times: dict[str, float]) -> str:
        names = times.keys() - shared
        return f"{sum(times[n] for n in names):.1f} us ({len(names)} kernels)"

    largest = ", ".join(f"`{n}` {d:+.1f}" for d, n in diffs[:LARGEST_DIFFERENCES] if d)
    return (
        f"{alone(mine)} | {alone(other)} | {sum(d for d, _ in diffs):+.1f} us "
        f"({len(shared)} kernels) | {largest or '-'}"
    )
