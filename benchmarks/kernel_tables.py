"""Markdown tables and the exit status of `benchmarks.kernels_vs_vllm`'s rows."""

from __future__ import annotations

from benchmarks.kernel_problems import rate

# ---------------------------------------------------------------- tables


def fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _status_cell(r: dict) -> str:
    return r.get("status", "ERROR: not run").replace("|", "/")


def _timing_cell(r: dict) -> str:
    modes = {r.get("plugin_timing"), r.get("vllm_timing")} - {None}
    return " / ".join(sorted(modes)) or "-"


def us_cell(r: dict, side: str) -> str:
    if f"{side}_us" in r:
        return f"{r[f'{side}_us']:.1f}"
    return "error" if f"{side}_error" in r else "-"


def ratio(r: dict) -> float | None:
    if r.get("plugin_us") and r.get("vllm_us"):
        return r["plugin_us"] / r["vllm_us"]
    return None


def _diff_cells(r: dict) -> str:
    return f"{fmt(r.get('maxdiff'), '.2e')} | {fmt(r.get('ref_maxdiff'), '.2e')}"


def _rates(r: dict, amount: str, scale: float, anchor: float | None) -> tuple:
    """The plugin's and vLLM's rates of `r[amount]` (per second, over `scale`), and each
    as a fraction of the physical `anchor` (None where a side did not run)."""
    rates = [rate(r[amount], r.get(f"{side}_us"), scale) for side in ("plugin", "vllm")]
    return (*rates, *(x / anchor if x and anchor else None for x in rates))


def mla_table(rows, copy_gbps: float | None) -> str:
    lines = [
        "| heads | q/req | batch | context | plugin kernel | plugin us | FlashMLA us "
        "| plugin/FlashMLA | plugin TFLOP/s | FlashMLA TFLOP/s | plugin GB/s | FlashMLA GB/s "
        "| plugin of copy | max abs diff | vs fp32 ref | timing | status |",
        "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in rows:
        pg, vg, frac, _ = _rates(r, "bytes", 1e9, copy_gbps)
        lines.append(
            f"| {r['heads']} | {r['q_len']} | {r['batch']} | {r['context']} | "
            f"{r.get('kernel', '-')} | {us_cell(r, 'plugin')} | {us_cell(r, 'vllm')} | "
            f"{fmt(ratio(r), '.2f')} | {fmt(rate(r['flops'], r.get('plugin_us'), 1e12), '.0f')}"
            f" | {fmt(rate(r['flops'], r.get('vllm_us'), 1e12), '.0f')} | {fmt(pg, '.0f')} | "
            f"{fmt(vg, '.0f')} | {fmt(frac, '.1%')} | {_diff_cells(r)} | {_timing_cell(r)} | "
            f"{_status_cell(r)} |"
        )
    return "\n".join(lines)


def mha_decode_table(rows, copy_gbps: float | None) -> str:
    lines = [
        "| batch | context | plugin us | FA3 us | plugin/FA3 | plugin GB/s | FA3 GB/s "
        "| plugin of copy | FA3 of copy | plugin TFLOP/s | FA3 TFLOP/s | max abs diff "
        "| vs fp32 ref | timing | status |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in rows:
        pg, vg, pf, vf = _rates(r, "bytes", 1e9, copy_gbps)
        lines.append(
            f"| {r['batch']} | {r['context']} | {us_cell(r, 'plugin')} | {us_cell(r, 'vllm')}"
            f" | {fmt(ratio(r), '.2f')} | {fmt(pg, '.0f')} | {fmt(vg, '.0f')} | "
            f"{fmt(pf, '.1%')} | {fmt(vf, '.1%')} | "
            f"{fmt(rate(r['flops'], r.get('plugin_us'), 1e12), '.1f')} | "
            f"{fmt(rate(r['flops'], r.get('vllm_us'), 1e12), '.1f')} | {_diff_cells(r)} | "
            f"{_timing_cell(r)} | {_status_cell(r)} |"
        )
    return "\n".join(lines)


def prefill_table(rows, matmul_rate: float | None) -> str:
    lines = [
        "| case | tokens | plugin us | FA3 us | plugin/FA3 | plugin TFLOP/s | FA3 TFLOP/s "
        "| plugin of matmul | FA3 of matmul | max abs diff | vs fp32 ref | timing | status |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in rows:
        pt, vt, pf, vf = _rates(r, "flops", 1e12, matmul_rate)
        lines.append(
            f"| {r['case']} | {r['tokens']} | {us_cell(r, 'plugin')} | {us_cell(r, 'vllm')} | "
            f"{fmt(ratio(r), '.2f')} | {fmt(pt, '.0f')} | {fmt(vt, '.0f')} | "
            f"{fmt(pf, '.1%')} | {fmt(vf, '.1%')} | {_diff_cells(r)} | {_timing_cell(r)} | "
            f"{_status_cell(r)} |"
        )
    return "\n".join(lines)


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
