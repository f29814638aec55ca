"""Markdown tables, the targets and the exit status of `benchmarks.kernels_vs_vllm`'s rows.

Targets, judged on rows whose outputs passed: MHA prefill plugin/FA3 <= 1.0;
MHA decode plugin/FA3 <= 1.0 and plugin/vLLM-Triton <= 1.0; MLA decode with a bf16 cache
plugin/FlashMLA <= 1.0 and, counted on its own line, plugin/FA3-MLA <= 1.0; with an fp8
cache at least FP8_LIMIT_SHARE of the physical limit (time <= limit / FP8_LIMIT_SHARE,
the limit the larger of the times at the matmul rate and at the copy bandwidth) and,
counted on its own line, plugin/FlashMLA-fp8 <= 1.0."""

from __future__ import annotations

from benchmarks.kernel_problems import rate

FP8_LIMIT_SHARE = 0.7

# ---------------------------------------------------------------- tables


def fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _status_cell(r: dict) -> str:
    return r.get("status", "ERROR: not run").replace("|", "/")


def _timing_cell(r: dict) -> str:
    modes = {r.get(f"{side}_timing") for side in ("plugin", "vllm", "fa3_mla", "triton")}
    modes -= {None}
    return " / ".join(sorted(modes)) or "-"


def us_cell(r: dict, side: str) -> str:
    if f"{side}_us" in r:
        return f"{r[f'{side}_us']:.1f}"
    return "error" if f"{side}_error" in r else "-"


def ratio(r: dict, side: str = "vllm") -> float | None:
    """The plugin's time over `side`'s."""
    if r.get("plugin_us") and r.get(f"{side}_us"):
        return r["plugin_us"] / r[f"{side}_us"]
    return None


# ---------------------------------------------------------------- targets


def met_ratio(r: dict, sides=("vllm",)) -> bool | None:
    """Target met when the plugin is no slower than each of `sides` (ratio <= 1.0); None
    when the row cannot be judged (outputs not ok, or a side not timed)."""
    ratios = [ratio(r, side) for side in sides]
    if r.get("status") != "ok" or None in ratios:
        return None
    return all(x <= 1.0 for x in ratios)


def met_limit(r: dict) -> bool | None:
    """Target met when the plugin's time is within the limit / FP8_LIMIT_SHARE."""
    if r.get("status") != "ok" or not r.get("plugin_us") or not r.get("limit_us"):
        return None
    return r["plugin_us"] <= r["limit_us"] / FP8_LIMIT_SHARE


def target_cell(met: bool | None) -> str:
    return {True: "met", False: "missed", None: "-"}[met]


def summary(rows, judge, label: str = "Target") -> str:
    """'<label>: N of M met' for a table's rows, naming the rows that could not be judged."""
    verdicts = [judge(r) for r in rows]
    line = f"{label}: {sum(v is True for v in verdicts)} of {len(rows)} met"
    unjudged = sum(v is None for v in verdicts)
    if unjudged:
        line += f" ({unjudged} not judged: outputs not ok or a side not timed)"
    return line + "."


def _diff_cells(r: dict) -> str:
    return f"{fmt(r.get('maxdiff'), '.2e')} | {fmt(r.get('ref_maxdiff'), '.2e')}"


def _rates(r: dict, amount: str, scale: float, anchor: float | None) -> tuple:
    """The plugin's and vLLM's rates of `r[amount]` (per second, over `scale`), and each
    as a fraction of the physical `anchor` (None where a side did not run)."""
    rates = [rate(r[amount], r.get(f"{side}_us"), scale) for side in ("plugin", "vllm")]
    return (*rates, *(x / anchor if x and anchor else None for x in rates))


def met_fa3_mla(r: dict) -> bool | None:
    return met_ratio(r, ("fa3_mla",))


def mla_table(rows, copy_gbps: float | None) -> str:
    """bf16-cache rows beside FlashMLA and FA3-MLA, with a summary line for each target
    (the target column: FlashMLA's)."""
    lines = [
        "| heads | q/req | batch | context | plugin kernel | plugin us | FlashMLA us "
        "| plugin/FlashMLA | FA3-MLA us | plugin/FA3-MLA | plugin TFLOP/s | FlashMLA TFLOP/s "
        "| plugin GB/s | FlashMLA GB/s | plugin of copy | max abs diff | vs fp32 ref | timing "
        "| target | status |",
        "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|:---|:---|:---|",
    ]
    for r in rows:
        pg, vg, frac, _ = _rates(r, "bytes", 1e9, copy_gbps)
        lines.append(
            f"| {r['heads']} | {r['q_len']} | {r['batch']} | {r['context']} | "
            f"{r.get('kernel', '-')} | {us_cell(r, 'plugin')} | {us_cell(r, 'vllm')} | "
            f"{fmt(ratio(r), '.2f')} | {us_cell(r, 'fa3_mla')} | "
            f"{fmt(ratio(r, 'fa3_mla'), '.2f')} | "
            f"{fmt(rate(r['flops'], r.get('plugin_us'), 1e12), '.0f')} | "
            f"{fmt(rate(r['flops'], r.get('vllm_us'), 1e12), '.0f')} | {fmt(pg, '.0f')} | "
            f"{fmt(vg, '.0f')} | {fmt(frac, '.1%')} | {_diff_cells(r)} | {_timing_cell(r)} | "
            f"{target_cell(met_ratio(r))} | {_status_cell(r)} |"
        )
    fa3 = summary(rows, met_fa3_mla, "Target plugin/FA3-MLA <= 1.0")
    return "\n".join(lines) + "\n\n" + summary(rows, met_ratio) + "\n\n" + fa3


def mla_fp8_table(rows) -> str:
    """fp8-cache rows against the physical limit (the target column) and FlashMLA's fp8
    path (its own summary line); max abs diff is the plugin's largest against FlashMLA's
    fp8 path and FlashMLA over the cache dequantized to bf16."""
    lines = [
        "| heads | q/req | batch | context | plugin kernel | plugin us | FlashMLA fp8 us "
        "| plugin/FlashMLA fp8 | limit us | of limit | plugin TFLOP/s | plugin GB/s "
        "| max abs diff | vs fp32 ref | timing | target | status |",
        "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|:---|",
    ]
    for r in rows:
        us, lim = r.get("plugin_us"), r.get("limit_us")
        lines.append(
            f"| {r['heads']} | {r['q_len']} | {r['batch']} | {r['context']} | "
            f"{r.get('kernel', '-')} | {us_cell(r, 'plugin')} | {us_cell(r, 'vllm')} | "
            f"{fmt(ratio(r), '.2f')} | {fmt(lim, '.1f')} | "
            f"{fmt(lim / us if lim and us else None, '.1%')} | "
            f"{fmt(rate(r['flops'], us, 1e12), '.0f')} | {fmt(rate(r['bytes'], us, 1e9), '.0f')}"
            f" | {_diff_cells(r)} | {_timing_cell(r)} | {target_cell(met_limit(r))} | "
            f"{_status_cell(r)} |"
        )
    flashmla = summary(rows, met_ratio, "Target plugin/FlashMLA fp8 <= 1.0")
    return "\n".join(lines) + "\n\n" + summary(rows, met_limit) + "\n\n" + flashmla


def met_decode(r: dict) -> bool | None:
    return met_ratio(r, ("vllm", "triton"))


def mha_decode_table(rows, copy_gbps: float | None) -> str:
    """Rows beside FA3 and vLLM's Triton kernel, with the summary line; max abs diff is
    the plugin's largest against either."""
    lines = [
        "| heads | batch | context | plugin us | FA3 us | vLLM Triton us | plugin/FA3 "
        "| plugin/Triton | plugin GB/s | FA3 GB/s | plugin of copy | FA3 of copy "
        "| plugin TFLOP/s | max abs diff | vs fp32 ref | timing | target | status |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|"
        ":---|",
    ]
    for r in rows:
        pg, vg, pf, vf = _rates(r, "bytes", 1e9, copy_gbps)
        lines.append(
            f"| {r['heads']} | {r['batch']} | {r['context']} | {us_cell(r, 'plugin')} | "
            f"{us_cell(r, 'vllm')} | {us_cell(r, 'triton')} | {fmt(ratio(r), '.2f')} | "
            f"{fmt(ratio(r, 'triton'), '.2f')} | {fmt(pg, '.0f')} | {fmt(vg, '.0f')} | "
            f"{fmt(pf, '.1%')} | {fmt(vf, '.1%')} | "
            f"{fmt(rate(r['flops'], r.get('plugin_us'), 1e12), '.1f')} | {_diff_cells(r)} | "
            f"{_timing_cell(r)} | {target_cell(met_decode(r))} | {_status_cell(r)} |"
        )
    return "\n".join(lines) + "\n\n" + summary(rows, met_decode)


def prefill_table(rows, matmul_rate: float | None) -> str:
    """Rows beside FA3, with the summary line."""
    lines = [
        "| heads | case | tokens | plugin us | FA3 us | plugin/FA3 | plugin TFLOP/s "
        "| FA3 TFLOP/s | plugin of matmul | FA3 of matmul | max abs diff | vs fp32 ref "
        "| timing | target | status |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|:---|",
    ]
    for r in rows:
        pt, vt, pf, vf = _rates(r, "flops", 1e12, matmul_rate)
        lines.append(
            f"| {r['heads']} | {r['case']} | {r['tokens']} | {us_cell(r, 'plugin')} | "
            f"{us_cell(r, 'vllm')} | {fmt(ratio(r), '.2f')} | {fmt(pt, '.0f')} | "
            f"{fmt(vt, '.0f')} | {fmt(pf, '.1%')} | {fmt(vf, '.1%')} | {_diff_cells(r)} | "
            f"{_timing_cell(r)} | {target_cell(met_ratio(r))} | {_status_cell(r)} |"
        )
    return "\n".join(lines) + "\n\n" + summary(rows, met_ratio)


def anchors_table(anchors: dict) -> str:
    return "\n".join(
        [
            "| anchor | value | timing |",
            "|:---|---:|:---|",
            f"| device-to-device copy, 2 GiB (read + write) | "
            f"{fmt(anchors.get('copy_gbps'), '.0f')} GB/s | CUDA events, eager, median of 10 |",
            f"| dense bf16 matmul 8192^3 | {fmt(anchors.get('matmul_tflops'), '.0f')} TFLOP/s "
            f"| CUDA events, eager, median of 10 |",
        ]
        + [f"| {k} | error | {v} |" for k, v in anchors.get("errors", {}).items()]
    )


def exit_status(rows) -> int:
    """1 when some row FAILED its output check, else 3 when some row has an ERROR, else 0."""
    statuses = [r.get("status", "ERROR") for r in rows]
    if any(s.startswith("FAILED") for s in statuses):
        return 1
    if any(s != "ok" for s in statuses):
        return 3
    return 0
