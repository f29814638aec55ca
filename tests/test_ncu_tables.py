"""benchmarks/ncu_tables.py without a GPU or ncu: the `--csv --page details` parser, the
raw-page merge, units, the split into sides at the marker, and the table."""

import csv
import io

import pytest

from benchmarks import ncu_tables as ncu

COLUMNS = [
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
    "Section Name",
    "Metric Name",
    "Metric Unit",
    "Metric Value",
]

FA3_NAME = (
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
    "flash::CollectiveMainloopFwdSm90<2, cute::tuple<int, int, int>, bf16>>>>"
    "(T1::Params)"
)
SPIN = "at::cuda::<unnamed>::spin_kernel(long)"

# (id, kernel, block, grid, section, metric, unit, value)
SAMPLE = [
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "GPU Speed Of Light Throughput",
        "Duration",
        "nsecond",
        "1,234,560",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "GPU Speed Of Light Throughput",
        "Compute (SM) Throughput",
        "%",
        "61.25",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "GPU Speed Of Light Throughput",
        "Memory Throughput",
        "%",
        "22.5",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "GPU Speed Of Light Throughput",
        "DRAM Throughput",
        "%",
        "3.1",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "GPU Speed Of Light Throughput",
        "L1/TEX Cache Throughput",
        "%",
        "71.3",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Memory Workload Analysis",
        "Memory Throughput",
        "byte/second",
        "1,234,567,890,123",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Occupancy",
        "Achieved Occupancy",
        "%",
        "12.40",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Occupancy",
        "Theoretical Occupancy",
        "%",
        "12.5",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Launch Statistics",
        "Registers Per Thread",
        "register/thread",
        "255",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Launch Statistics",
        "Dynamic Shared Memory Per Block",
        "byte/block",
        "98,304",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Launch Statistics",
        "Static Shared Memory Per Block",
        "byte/block",
        "0",
    ),
    (
        "0",
        "_paged_attn_prefill",
        "(128, 1, 1)",
        "(64, 32, 1)",
        "Warp State Statistics",
        "Warp Cycles Per Issued Instruction",
        "cycle",
        "21.4",
    ),
    (
        "1",
        SPIN,
        "(1, 1, 1)",
        "(1, 1, 1)",
        "GPU Speed Of Light Throughput",
        "Duration",
        "nsecond",
        "1,024",
    ),
    (
        "2",
        FA3_NAME,
        "(384, 1, 1)",
        "(132, 1, 1)",
        "GPU Speed Of Light Throughput",
        "Duration",
        "usecond",
        "834.2",
    ),
    (
        "2",
        FA3_NAME,
        "(384, 1, 1)",
        "(132, 1, 1)",
        "GPU Speed Of Light Throughput",
        "Compute (SM) Throughput",
        "%",
        "80.0",
    ),
    (
        "2",
        FA3_NAME,
        "(384, 1, 1)",
        "(132, 1, 1)",
        "Launch Statistics",
        "Dynamic Shared Memory Per Block",
        "Kbyte/block",
        "200.7",
    ),
    (
        "2",
        FA3_NAME,
        "(384, 1, 1)",
        "(132, 1, 1)",
        "Launch Statistics",
        "Registers Per Thread",
        "register/thread",
        "168",
    ),
]


def details_csv(rows=SAMPLE) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(COLUMNS)
    for kid, name, block, grid, section, metric, unit, value in rows:
        w.writerow(
            [
                kid,
                "4242",
                "python3",
                "h200",
                name,
                "1",
                "7",
                block,
                grid,
                "0",
                "9.0",
                section,
                metric,
                unit,
                value,
            ]
        )
    # ncu and the application print around the CSV when they share stdout
    return "==PROF== Connected to process 4242\n" + buf.getvalue() + "==PROF== Disconnected\n"


def raw_csv() -> str:
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    metrics = [stall.format(r) for r in ("long_scoreboard", "barrier", "wait", "selected")]
    tensor = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    head = ["ID", "Kernel Name", *metrics, tensor]
    units = ["", "", "", "", "", "", "%"]
    rows = [["0", "_paged_attn_prefill", "2.5", "9.75", "1,003.0", "40.0", "55.5"]]
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for r in (head, units, *rows):
        w.writerow(r)
    return buf.getvalue()


def test_details_parser_groups_metrics_by_launch_in_order():
    kernels = ncu.parse_details(details_csv())
    assert [k.id for k in kernels] == ["0", "1", "2"]
    k0 = kernels[0]
    assert k0.name == "_paged_attn_prefill"
    assert (k0.block, k0.grid) == ("(128, 1, 1)", "(64, 32, 1)")
    assert ncu.in_unit(ncu.metric(k0, "Duration"), "second", 1e-6) == pytest.approx(1234.56)
    # the name recurs in two sections: the percentage is the one read as a throughput
    assert ncu.pct(k0, "Memory Throughput") == 22.5
    only_rate = ncu.Kernel("9", "k", metrics={"Memory Throughput": [("byte/second", "5")]})
    assert ncu.pct(only_rate, "Memory Throughput") is None  # a rate is not a percentage
    assert ncu.value(k0, "Memory Throughput", unit="byte/second") == 1234567890123.0
    assert ncu.in_unit(ncu.metric(kernels[2], "Duration"), "second", 1e-6) == 834.2


def test_units_and_numbers():
    assert ncu.number("1,234.56") == 1234.56
    assert ncu.number("n/a") is None
    assert ncu.in_unit(("Kbyte/block", "200.7"), "byte") == pytest.approx(200700)
    assert ncu.in_unit(("msecond", "1.5"), "second", 1e-6) == pytest.approx(1500)
    assert ncu.in_unit(("cycle", "3"), "second") is None
    assert ncu.in_unit(("us", "7"), "second", 1e-6) == pytest.approx(7)


def test_sides_split_at_the_marker_and_names_shorten():
    kernels = ncu.assign_sides(ncu.parse_details(details_csv()), "FA3")
    assert [(k.id, k.side) for k in kernels] == [("0", "plugin"), ("2", "FA3")]
    assert ncu.short_name(FA3_NAME).startswith("flash::FlashAttnFwdSm90<")
    assert ncu.short_name(SPIN) == "at::cuda::<unnamed>::spin_kernel"
    no_marker = ncu.assign_sides(ncu.parse_details(details_csv(SAMPLE[:3])), "FA3")
    assert [k.side for k in no_marker] == ["?"]


def test_table_has_one_column_per_kernel_and_the_side_totals():
    kernels = ncu.parse_details(details_csv())
    ncu.merge_raw(kernels, raw_csv())
    text = ncu.markdown_table("prefill-1x8k: a prefill", "FA3", ncu.assign_sides(kernels, "FA3"))
    assert text.startswith("### prefill-1x8k: a prefill\n")
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| |"))
    assert header.count("|") == 4  # row label + 2 kernels
    assert "plugin: _paged_attn_prefill" in header and "FA3: flash::FlashAttnFwdSm90" in header

    def row(label):
        return [c.strip() for c in next(x for x in lines if x.startswith(f"| {label}")).split("|")]

    assert row("duration (us)")[2:4] == ["1234.6", "834.2"]
    assert row("SM throughput %")[2:4] == ["61.2", "80.0"]
    assert row("memory throughput %")[2:4] == ["22.5", "n/a"]
    assert row("L1/shared throughput %")[2:4] == ["71.3", "n/a"]
    assert row("achieved / theoretical")[2] == "12.4 / 12.5"
    assert row("registers / thread")[2:4] == ["255", "168"]
    assert row("shared memory / block (KiB)")[2:4] == ["96.0", "196.0"]
    assert row("block; grid")[2] == "(128, 1, 1); (64, 32, 1)"
    # wait, then barrier: 'selected' (issuing) is not a stall
    assert row("top warp stalls")[2] == "wait 1003.0, barrier 9.8 (of 21.4)"
    assert row("top warp stalls")[3] == "n/a"
    assert row("tensor pipe %")[2:4] == ["55.5", "n/a"]
    assert "plugin 1234.6 us, FA3 834.2 us; plugin / FA3 = 1.48" in text
