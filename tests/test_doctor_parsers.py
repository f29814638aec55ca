"""The vendor-table parsers and the N/A rule of `atom-plugin doctor`.

Fixed cases read the stand-in tables in tests/smi_fixtures; property tests
render tables the way each tool lays them out and check that the verdict
flags exactly the GPUs with a missing temperature or power.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.doctor.amd_smi import AmdSmiProbe
from atom_plugin.doctor.check import judge
from atom_plugin.doctor.columns import columns_of, left_aligned_cells, right_aligned_cells
from atom_plugin.doctor.nvidia_smi import NvidiaSmiProbe
from atom_plugin.doctor.probe import Probe, TableError
from atom_plugin.doctor.readings import GpuReading, reading
from atom_plugin.doctor.rocm_smi import RocmSmiProbe

HOSTS = Path(__file__).parent / "smi_fixtures" / "hosts"
SAVED = Path(__file__).parent / "smi_fixtures" / "saved"


def host_text(host: str, *files: str) -> str:
    return "\n".join((HOSTS / host / name).read_text(encoding="utf-8") for name in files)


ROCM_FILES = ("rocm-smi.txt", "rocm-smi-showuniqueid.txt")
AMD_FILES = ("amd-smi-monitor.txt", "amd-smi-list.txt")
NVIDIA_FILES = ("nvidia-smi-query.csv",)


# --- the N/A rule on one cell -------------------------------------------------


@pytest.mark.parametrize(
    "raw", ["N/A", "[N/A]", "", "   ", "[Not Supported]", "[Unknown Error]", "[GPU is lost]"]
)
def test_cells_without_a_reading(raw):
    assert reading(raw) is None


@pytest.mark.parametrize(
    ("raw", "value"),
    [("45.0°C", 45.0), ("236.0W", 236.0), ("45 °C", 45.0), ("72.83 W", 72.83), ("36.0c", 36.0)],
)
def test_cells_with_a_reading(raw, value):
    assert reading(raw) == value


def test_a_gpu_is_unhealthy_for_either_missing_reading():
    assert GpuReading(0, "x", "40.0°C", "200.0W").problems == []
    assert GpuReading(0, "x", "N/A", "200.0W").problems == ["N/A temperature"]
    assert GpuReading(0, "x", "40.0°C", "[N/A]").problems == ["N/A power"]
    assert GpuReading(0, "x", "", "").problems == ["N/A temperature", "N/A power"]


# --- rocm-smi -------------------------------------------------------------------


def test_rocm_healthy_mi355x_host():
    gpus = RocmSmiProbe().parse(host_text("mi355x_healthy", *ROCM_FILES))
    assert [g.index for g in gpus] == list(range(8))
    assert all(g.healthy for g in gpus)
    assert {g.temperature_sensor for g in gpus} == {"junction"}
    assert gpus[0].temperature == "45.0°C" and gpus[0].power == "236.0W"
    assert gpus[0].unique_id == "0x346cfa4fb4faa2c1"
    assert gpus[7].unique_id == "0xba37ea3cc79f9fb8"
    verdict = judge(gpus, "rocm")
    assert verdict.healthy and "8 GPUs" in verdict.reason


def test_rocm_one_gpu_with_na_power():
    verdict = judge(RocmSmiProbe().parse(host_text("mi355x_na_power", *ROCM_FILES)), "rocm")
    assert not verdict.healthy
    assert [(g.index, g.unique_id, g.problems) for g in verdict.unhealthy_gpus] == [
        (5, "0x1b9e9c9ca24c3014", ["N/A power"])
    ]
    assert "GPU 5 (unique ID 0x1b9e9c9ca24c3014)" in verdict.reason


def test_rocm_edge_temperature_host_with_na_everywhere():
    gpus = RocmSmiProbe().parse(host_text("edge_na_temp", *ROCM_FILES))
    assert {g.temperature_sensor for g in gpus} == {"edge"}
    verdict = judge(gpus, "rocm")
    assert [g.index for g in verdict.unhealthy_gpus] == list(range(8))
    no_power = [g.index for g in gpus if "N/A power" in g.problems]
    assert no_power == [2, 6]


def test_rocm_table_without_rows():
    text = host_text("no_rows", *ROCM_FILES)
    assert RocmSmiProbe().recognises(text)
    assert RocmSmiProbe().parse(text) == []
    verdict = judge([], "rocm", "rocm-smi")
    assert not verdict.healthy and verdict.reason == "rocm-smi printed no GPU rows"


def test_rocm_table_in_a_timestamped_ci_log():
    gpus = RocmSmiProbe().parse((SAVED / "github_actions_rocm_na_power.log").read_text())
    assert len(gpus) == 8
    assert [(g.index, g.unique_id) for g in gpus if not g.healthy] == [(5, "0x1b9e9c9ca24c3014")]


def test_rocm_needs_temperature_and_power_columns_to_see_a_table():
    text = "Device  Node  Temp    Power\n0       1     40.0°C  100.0W\n"
    assert [(g.temperature, g.power) for g in RocmSmiProbe().parse(text)] == [("40.0°C", "100.0W")]
    assert RocmSmiProbe().parse(text.replace("Power", "Volts")) == []


# --- amd-smi --------------------------------------------------------------------


def test_amd_smi_healthy_and_na_power():
    healthy = AmdSmiProbe().parse(host_text("mi355x_healthy", *AMD_FILES))
    assert [g.index for g in healthy] == list(range(8)) and all(g.healthy for g in healthy)
    assert healthy[0].temperature == "45 °C" and healthy[0].power == "236 W"
    assert healthy[0].unique_id == "34ff75a3-0000-1000-806c-fa4fb4faa2c1"
    broken = judge(AmdSmiProbe().parse(host_text("mi355x_na_power", *AMD_FILES)), "amd")
    assert [(g.index, g.problems) for g in broken.unhealthy_gpus] == [(5, ["N/A power"])]


def test_amd_smi_table_without_temperature_is_an_error():
    # `amd-smi monitor -p` alone: the table is there, but it cannot be judged.
    with pytest.raises(TableError, match="GPU temperature"):
        AmdSmiProbe().parse("GPU  POWER\n  0  126 W\n")


def test_amd_smi_older_titles_and_extra_columns():
    # The layout printed by amd-smi 24.x (`GPU_TEMP`, no XCP column), with more metrics.
    text = (
        "GPU  POWER  GPU_TEMP  MEM_TEMP  GFX_UTIL  GFX_CLOCK  MEM_UTIL  MEM_CLOCK\n"
        "  0  126 W     40 °C     32 °C       1 %    182 MHz       0 %    900 MHz\n"
        "  1    N/A     41 °C     33 °C       0 %    120 MHz       0 %    900 MHz\n"
    )
    gpus = AmdSmiProbe().parse(text)
    assert [(g.index, g.temperature, g.power) for g in gpus] == [
        (0, "40 °C", "126 W"),
        (1, "41 °C", "N/A"),
    ]


# --- nvidia-smi -----------------------------------------------------------------


def test_nvidia_healthy_and_broken_csv():
    healthy = NvidiaSmiProbe().parse(host_text("h200_healthy", *NVIDIA_FILES))
    assert len(healthy) == 8 and all(g.healthy for g in healthy)
    assert healthy[0].unique_id.startswith("GPU-")
    broken = judge(NvidiaSmiProbe().parse(host_text("h200_broken", *NVIDIA_FILES)), "nvidia")
    assert [(g.index, g.problems) for g in broken.unhealthy_gpus] == [
        (2, ["N/A power"]),
        (7, ["N/A temperature", "N/A power"]),
    ]


# --- format detection -------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "files", "probe"),
    [
        ("mi355x_healthy", ROCM_FILES, RocmSmiProbe),
        ("mi355x_healthy", AMD_FILES, AmdSmiProbe),
        ("h200_healthy", NVIDIA_FILES, NvidiaSmiProbe),
    ],
)
def test_each_probe_recognises_only_its_own_table(host, files, probe):
    text = host_text(host, *files)
    for candidate in (RocmSmiProbe, AmdSmiProbe, NvidiaSmiProbe):
        assert candidate().recognises(text) == (candidate is probe)


def test_builtin_probes_fill_the_probe_contract():
    for probe in (RocmSmiProbe(), AmdSmiProbe(), NvidiaSmiProbe()):
        assert isinstance(probe, Probe)
        for argv in probe.commands("/opt/bin/" + probe.executables[0]):
            assert argv[0] == "/opt/bin/" + probe.executables[0]


# --- column cutting -------------------------------------------------------------


def test_cells_follow_title_positions_not_whitespace():
    header = "Device  IDs              Temp    Power"
    row = "0       0x74b5,   21947           191.0W"
    assert left_aligned_cells(row, columns_of(header)) == ["0", "0x74b5,   21947", "", "191.0W"]
    header = "GPU  POWER   GPU_T"
    assert right_aligned_cells(" 12  201 W     N/A", columns_of(header)) == ["12", "201 W", "N/A"]


# --- property tests: rendered tables, the N/A rule --------------------------------

MISSING = st.sampled_from(["N/A", "[N/A]", ""])


def _cell(value: float | None, missing: str, unit: str) -> str:
    return missing if value is None else f"{value:.1f}{unit}"


gpu_readings = st.lists(
    st.tuples(
        st.one_of(st.none(), st.floats(5, 110)),
        st.one_of(st.none(), st.floats(0, 1500)),
        MISSING,
    ),
    min_size=1,
    max_size=16,
)
prefixes = st.sampled_from(["", "2026-03-14T08:21:07.1314870Z "])


def _left_aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "".join(cell.ljust(w) + "  " for cell, w in zip(row, widths, strict=True)) for row in rows
    ]


def _rocm_table(readings, layout: str, sensor: str, prefix: str) -> str:
    """A concise table as rocm-smi lays one out (three releases' title rows)."""
    if layout == "rocm7":
        titles = ["Device", "Node", "IDs", "Temp", "Power", "Partitions", "SCLK", "PwrCap"]
        subs = ["", "", "(DID,     GUID)", f"({sensor})", "(Socket)", "(Mem, Compute, ID)", "", ""]
    elif layout == "rocm6.0":
        titles = ["Device", "[Model : Revision]", "Temp", "Power", "Partitions", "SCLK", "PwrCap"]
        subs = ["", "Name (20 chars)", f"({sensor})", "(Avg)", "(Mem, Compute)", "", ""]
    else:
        titles = ["GPU", f"Temp ({sensor})", "AvgPwr", "SCLK", "PwrCap"]
        subs = None
    rows = []
    for i, (temp, power, missing) in enumerate(readings):
        t, p = _cell(temp, missing, "°C"), _cell(power, missing, "W")
        if layout == "rocm7":
            ids = f"0x74a1,   {1000 + i}"
            rows.append([str(i), str(i + 2), ids, t, p, "NPS1, SPX, 0", "131Mhz", "750.0W"])
        elif layout == "rocm6.0":
            rows.append([str(i), "[0x74a1 : 0x00]", t, p, "NPS1, SPX", "131Mhz", "750.0W"])
        else:
            rows.append([str(i), t, p, "800Mhz", "250.0W"])
    table = [titles] + ([subs] if subs else []) + rows
    lines = _left_aligned(table)
    rule = "=" * len(lines[0])
    head, body = lines[: 2 if subs else 1], lines[2 if subs else 1 :]
    if layout == "rocm6.0":  # a product-name line under each GPU
        body = [x for line in body for x in (line, " " * 8 + "AMD Instinct MI300X")]
    out = [" ROCm System Management Interface ".center(len(rule), "=")] + head
    out += ([rule] if subs else []) + body + [rule, " End of ROCm SMI Log ".center(len(rule), "=")]
    return "\n".join(prefix + line for line in out) + "\n"


def _expected_bad(readings) -> list[int]:
    return [i for i, (temp, power, _) in enumerate(readings) if temp is None or power is None]


@settings(max_examples=150, deadline=None)
@given(
    readings=gpu_readings,
    layout=st.sampled_from(["rocm7", "rocm6.0", "rocm5"]),
    sensor=st.sampled_from(["Junction", "Edge"]),
    prefix=prefixes,
)
def test_rocm_na_rule_over_rendered_tables(readings, layout, sensor, prefix):
    text = _rocm_table(readings, layout, sensor, prefix)
    assert RocmSmiProbe().recognises(text)
    gpus = RocmSmiProbe().parse(text)
    assert [g.index for g in gpus] == list(range(len(readings)))
    verdict = judge(gpus, "rocm")
    assert [g.index for g in verdict.unhealthy_gpus] == _expected_bad(readings)
    assert verdict.healthy == (not _expected_bad(readings))
    for gpu, (temp, power, _) in zip(gpus, readings, strict=True):
        if temp is not None:
            assert gpu.temperature_c == pytest.approx(round(temp, 1))
        if power is not None:
            assert gpu.power_w == pytest.approx(round(power, 1))


@settings(max_examples=100, deadline=None)
@given(readings=gpu_readings, xcp=st.booleans(), prefix=prefixes)
def test_amd_smi_na_rule_over_rendered_tables(readings, xcp, prefix):
    titles = ["GPU", *(["XCP"] if xcp else []), "POWER", "GPU_T", "MEM_T", "GFX_CLK"]
    xcp_cell = ["0"] if xcp else []
    rows = [
        [str(i), *xcp_cell, _amd_cell(p, "W", m), _amd_cell(t, "°C", m), "40 °C", "132 MHz"]
        for i, (t, p, m) in enumerate(readings)
    ]
    widths = [max(len(r[c]) for r in [titles, *rows]) + 2 for c in range(len(titles))]
    lines = [
        "".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
        for row in [titles, *rows]
    ]
    text = "\n".join(prefix + line for line in lines) + "\n"
    gpus = AmdSmiProbe().parse(text)
    assert [g.index for g in gpus] == list(range(len(readings)))
    assert [g.index for g in judge(gpus, "amd").unhealthy_gpus] == _expected_bad(readings)


def _amd_cell(value: float | None, unit: str, missing: str) -> str:
    return ("N/A" if missing else "") if value is None else f"{round(value)} {unit}"


@settings(max_examples=100, deadline=None)
@given(
    readings=gpu_readings,
    marks=st.sampled_from(["[N/A]", "[Not Supported]", "[Unknown Error]", "N/A"]),
)
def test_nvidia_na_rule_over_rendered_csv(readings, marks):
    lines = ["index, uuid, temperature.gpu, power.draw [W]"]
    for i, (temp, power, _) in enumerate(readings):
        t = marks if temp is None else str(round(temp))
        p = marks if power is None else f"{power:.2f} W"
        lines.append(f"{i}, GPU-{i:08x}-0000-0000-0000-000000000000, {t}, {p}")
    gpus = NvidiaSmiProbe().parse("\n".join(lines) + "\n")
    assert [g.index for g in judge(gpus, "nvidia").unhealthy_gpus] == _expected_bad(readings)
