"""`atom-plugin doctor` end to end: stand-in vendor tools on PATH, saved tables,
exit codes, --json, GitHub Actions annotations, and third-party probes.

The stand-ins (tests/smi_fixtures/bin) print the saved tables of the host named
by SMI_STANDIN_HOST, or fail / hang when SMI_STANDIN_MODE says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atom_plugin import cli, manager
from atom_plugin.doctor.check import check_host, check_saved
from atom_plugin.doctor.command import github_annotation
from atom_plugin.doctor.readings import GpuReading
from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import HealthProbeSpec

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "smi_fixtures"
BIN = FIXTURES / "bin"
HOSTS = FIXTURES / "hosts"
# Only the stand-ins: a real vendor tool installed on the test machine must not be found.
STANDIN_PATH = str(BIN)
NA_POWER_UID = "0x1b9e9c9ca24c3014"  # GPU 5 of hosts/mi355x_na_power
OUR_ENV = ("GITHUB_ACTIONS", "SMI_STANDIN_HOST", "SMI_STANDIN_MODE", "SMI_STANDIN_PIDS")


def doctor(*args: str, host: str | None = None, path: str = STANDIN_PATH, **env: str):
    """Run the real console entry, `python -m atom_plugin doctor ...`, in a child process."""
    child_env = {k: v for k, v in os.environ.items() if k not in OUR_ENV}
    child_env.update(PATH=path, PYTHONPATH=str(ROOT), **env)
    if host is not None:
        child_env["SMI_STANDIN_HOST"] = str(HOSTS / host)
    return subprocess.run(
        [sys.executable, "-m", "atom_plugin", "doctor", *args],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def standins(monkeypatch):
    """For in-process runs: the stand-ins on PATH; returns a setter for the host."""
    for name in OUR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", STANDIN_PATH)
    return lambda host: monkeypatch.setenv("SMI_STANDIN_HOST", str(HOSTS / host))


def only_on_path(tmp_path: Path, *tools: str) -> str:
    """A PATH where, of the vendor tools, only `tools` (stand-ins) are installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in (*tools, "standin-modes.sh"):
        shutil.copy2(BIN / name, bin_dir / name)
    return str(bin_dir)


def saved_table(tmp_path: Path, host: str, *files: str) -> str:
    path = tmp_path / f"{host}.txt"
    path.write_text("\n".join((HOSTS / host / f).read_text() for f in files))
    return str(path)


# --- exit codes through the console entry --------------------------------------


def test_healthy_mi355x_host_exits_0():
    result = doctor(host="mi355x_healthy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "healthy: all 8 GPUs report temperature and power" in result.stdout


def test_one_gpu_with_na_power_exits_1_naming_it_and_annotating_github():
    result = doctor(host="mi355x_na_power", GITHUB_ACTIONS="true")
    assert result.returncode == 1
    gpu_lines = [line for line in result.stdout.splitlines() if line.startswith("  GPU ")]
    assert len(gpu_lines) == 1
    assert "GPU 5" in gpu_lines[0] and NA_POWER_UID in gpu_lines[0] and "power N/A" in gpu_lines[0]
    annotations = [line for line in result.stdout.splitlines() if line.startswith("::error")]
    assert annotations == [
        "::error title=Unhealthy GPU host::1 of 8 GPUs report N/A: "
        f"GPU 5 (unique ID {NA_POWER_UID}): N/A power"
    ]


def test_edge_temperature_host_with_na_everywhere(standins, capsys):
    standins("edge_na_temp")
    assert cli.main(["doctor"]) == 1
    gpu_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  GPU ")]
    assert [line.split()[1] for line in gpu_lines] == [str(i) for i in range(8)]
    assert all("temperature N/A" in line for line in gpu_lines)
    assert [line.split()[1] for line in gpu_lines if "power N/A" in line] == ["2", "6"]
    assert all("unique ID 0x" in line for line in gpu_lines)


def test_no_tool_on_path_exits_1(tmp_path):
    result = doctor(path=str(tmp_path))
    assert result.returncode == 1
    assert "no GPU tool on PATH (looked for rocm-smi, amd-smi, nvidia-smi)" in result.stdout


def test_failing_tool_exits_1():
    result = doctor(host="mi355x_healthy", SMI_STANDIN_MODE="fail")
    assert result.returncode == 1
    assert "`rocm-smi` failed with exit status 1: rocm-smi: error:" in result.stdout


def test_tool_that_cannot_start_is_unhealthy(tmp_path, monkeypatch):
    broken = tmp_path / "rocm-smi"
    broken.write_text("#!/no/such/interpreter\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    verdict = check_host()
    assert not verdict.healthy
    assert verdict.reason.startswith("`rocm-smi` could not be started: ")


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead


def test_hanging_tool_is_killed_with_its_children(tmp_path):
    pids_file = tmp_path / "pids"
    result = doctor(
        "--timeout",
        "1",
        host="mi355x_healthy",
        SMI_STANDIN_MODE="hang",
        SMI_STANDIN_PIDS=str(pids_file),
    )
    assert result.returncode == 1
    assert "`rocm-smi` did not finish within 1 s; killed" in result.stdout
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2  # the tool and the child it started
    give_up = time.monotonic() + 30  # SIGKILL lands asynchronously; not a speed check
    while any(_running(p) for p in pids) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not any(_running(p) for p in pids)


def test_tool_without_gpu_rows(standins, capsys):
    standins("no_rows")
    assert cli.main(["doctor"]) == 1
    assert "rocm-smi printed no GPU rows" in capsys.readouterr().out


@pytest.mark.parametrize(("host", "code"), [("h200_healthy", 0), ("h200_broken", 1)])
def test_nvidia_smi_csv(standins, tmp_path, monkeypatch, capsys, host, code):
    standins(host)
    monkeypatch.setenv("PATH", only_on_path(tmp_path, "nvidia-smi"))  # `auto` finds it alone
    assert cli.main(["doctor"]) == code
    if code:
        out = capsys.readouterr().out
        assert "GPU 2 (unique ID GPU-98b9abdd-5124-f425-bcd0-289cc09071f7): N/A power" in out
        assert "GPU 7 (unique ID GPU-ce3d15c9-6460-9e92-a92b-25fc6f92ee40)" in out


def test_unknown_smi_choice_exits_2_naming_the_valid_ones():
    result = doctor("--smi", "intel", host="mi355x_healthy")
    assert result.returncode == 2
    assert "--smi 'intel' is not one of auto, rocm, amd, nvidia" in result.stderr


# --- choosing the tool (in process) ----------------------------------------------


def test_auto_prefers_rocm_smi_when_several_tools_are_installed(standins):
    standins("mi355x_na_power")
    verdict = check_host()
    assert verdict.tool == "rocm" and verdict.unhealthy_gpus[0].unique_id == NA_POWER_UID


@pytest.mark.parametrize(("host", "code"), [("mi355x_healthy", 0), ("mi355x_na_power", 1)])
def test_amd_smi(standins, capsys, host, code):
    standins(host)
    assert cli.main(["doctor", "--smi", "amd"]) == code
    if code:
        assert "GPU 5  unique ID 1bff75a3-0000-1000-809e-9c9ca24c3014" in capsys.readouterr().out


def test_explicit_tool_missing_from_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", only_on_path(tmp_path, "rocm-smi"))
    verdict = check_host("nvidia")
    assert not verdict.healthy and verdict.reason == "no GPU tool on PATH (looked for nvidia-smi)"


# --- saved tables ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "files", "tool", "code"),
    [
        ("mi355x_healthy", ("rocm-smi.txt", "rocm-smi-showuniqueid.txt"), "rocm", 0),
        ("mi355x_na_power", ("rocm-smi.txt", "rocm-smi-showuniqueid.txt"), "rocm", 1),
        ("edge_na_temp", ("rocm-smi.txt",), "rocm", 1),
        ("no_rows", ("rocm-smi.txt",), "rocm", 1),
        ("mi355x_na_power", ("amd-smi-monitor.txt", "amd-smi-list.txt"), "amd", 1),
        ("h200_healthy", ("nvidia-smi-query.csv",), "nvidia", 0),
        ("h200_broken", ("nvidia-smi-query.csv",), "nvidia", 1),
    ],
)
def test_saved_table_format_is_detected(tmp_path, capsys, host, files, tool, code):
    path = saved_table(tmp_path, host, *files)
    assert cli.main(["doctor", "--smi-output", path, "--json"]) == code
    assert json.loads(capsys.readouterr().out)["tool"] == tool


def test_saved_ci_log(capsys):
    log = FIXTURES / "saved" / "github_actions_rocm_na_power.log"
    assert cli.main(["doctor", "--smi-output", str(log)]) == 1
    assert f"GPU 5  unique ID {NA_POWER_UID}" in capsys.readouterr().out


def test_saved_output_of_no_known_tool_is_unhealthy(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text("/bin/sh: 1: rocm-smi: not found\n")
    verdict = check_saved(path.read_text())
    assert not verdict.healthy
    assert verdict.reason == (
        "no GPU rows: the saved output is not a table from any of rocm, amd, nvidia"
    )


def test_saved_table_read_as_another_tool_has_no_rows(tmp_path):
    path = saved_table(tmp_path, "h200_healthy", "nvidia-smi-query.csv")
    verdict = check_saved(Path(path).read_text(), "rocm")
    assert not verdict.healthy and verdict.reason == "rocm-smi printed no GPU rows"


# --- usage errors exit 2 ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "0"], "'0' must be a positive, finite number of seconds"),
        (["--timeout", "-5"], "'-5' must be a positive, finite number of seconds"),
        (["--timeout", "nan"], "'nan' must be a positive, finite number of seconds"),
        (["--timeout", "inf"], "'inf' must be a positive, finite number of seconds"),
        (["--timeout", "soon"], "'soon' is not a number of seconds"),
        (["--smi-output", "/no/such/table.txt"], "cannot read --smi-output '/no/such/table.txt'"),
        (["--smi", "ROCM"], "--smi 'ROCM' is not one of auto, rocm, amd, nvidia"),
    ],
)
def test_usage_errors(standins, capsys, args, message):
    standins("mi355x_healthy")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_timeout_with_saved_output_is_a_usage_error(tmp_path, capsys):
    path = saved_table(tmp_path, "mi355x_healthy", "rocm-smi.txt")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", "--smi-output", path, "--timeout", "5"])
    assert exit_.value.code == 2
    assert (
        "--timeout limits a tool run; it has no effect with --smi-output" in capsys.readouterr().err
    )


# --- --json ------------------------------------------------------------------------------


def test_json_shape(standins, capsys):
    standins("mi355x_na_power")
    assert cli.main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"verdict", "reason", "tool", "gpus"}
    assert report["verdict"] == "unhealthy" and report["tool"] == "rocm"
    assert report["reason"].startswith("1 of 8 GPUs report N/A: GPU 5")
    assert [gpu["index"] for gpu in report["gpus"]] == list(range(8))
    gpu5 = report["gpus"][5]
    assert gpu5 == {
        "index": 5,
        "unique_id": NA_POWER_UID,
        "temperature": "45.0°C",
        "temperature_c": 45.0,
        "temperature_sensor": "junction",
        "power": "N/A",
        "power_w": None,
        "healthy": False,
        "problems": ["N/A power"],
    }
    assert all(gpu["healthy"] for gpu in report["gpus"] if gpu["index"] != 5)


def test_json_when_the_tool_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "unhealthy" and report["tool"] is None and report["gpus"] == []


# --- GitHub Actions -----------------------------------------------------------------------


def test_no_annotation_when_healthy_or_outside_actions(standins, capsys, monkeypatch):
    standins("mi355x_healthy")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert cli.main(["doctor"]) == 0
    assert "::error" not in capsys.readouterr().out
    standins("mi355x_na_power")
    monkeypatch.delenv("GITHUB_ACTIONS")
    assert cli.main(["doctor"]) == 1
    assert "::error" not in capsys.readouterr().out


def test_annotation_goes_to_stderr_with_json(standins, capsys, monkeypatch):
    standins("no_rows")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert cli.main(["doctor", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["reason"] == "rocm-smi printed no GPU rows"
    assert captured.err.strip() == "::error title=Unhealthy GPU host::rocm-smi printed no GPU rows"


def test_annotation_message_is_escaped():
    assert github_annotation("50%\r\nbad") == "::error title=Unhealthy GPU host::50%25%0D%0Abad"


# --- third-party probes ----------------------------------------------------------------------


class FakeSmiProbe:
    """Another vendor's tool: `fake-smi --all` prints `index serial temp power` rows."""

    executables = ("fake-smi",)

    def commands(self, executable):
        return [[executable, "--all"]]

    def recognises(self, text):
        return text.startswith("FAKE-SMI")

    def parse(self, text):
        rows = [line.split() for line in text.splitlines()[1:] if line.strip()]
        return [GpuReading(int(i), serial, temp, power) for i, serial, temp, power in rows]


class FakeVendorPlugin:
    @hookimpl
    def atom_health_probes(self):
        return [HealthProbeSpec(smi="fake", probe=FakeSmiProbe())]


FAKE_OUTPUT = "FAKE-SMI\n0 SN-A 41C 300W\n1 SN-B N/A 280W\n"


@pytest.fixture
def fake_vendor():
    pm = manager.get_plugin_manager()
    pm.register(FakeVendorPlugin(), name="fake-vendor")
    yield
    pm.unregister(name="fake-vendor")


def _install_fake_smi(tmp_path: Path, output: str) -> str:
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    tool = bin_dir / "fake-smi"
    tool.write_text(f'#!/bin/sh\n[ "$1" = --all ] || exit 64\nprintf "%s" "{output}"\n')
    tool.chmod(0o755)
    return str(bin_dir)


def test_third_party_probe_runs_from_path(fake_vendor, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", _install_fake_smi(tmp_path, FAKE_OUTPUT))
    assert cli.main(["doctor", "--smi", "fake"]) == 1
    out = capsys.readouterr().out
    assert "GPU 1  unique ID SN-B  temperature N/A  power 280W" in out
    assert cli.main(["doctor"]) == 1  # `auto` finds it too: it is the only tool on PATH


def test_third_party_probe_reads_saved_output_and_joins_the_choices(fake_vendor, tmp_path, capsys):
    saved = tmp_path / "fake.txt"
    saved.write_text(FAKE_OUTPUT.replace("N/A", "39C"))
    assert cli.main(["doctor", "--smi-output", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tool"] == "fake"
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--smi", "intel"])
    assert "is not one of auto, fake, rocm, amd, nvidia" in capsys.readouterr().err


def test_third_party_probe_on_a_fresh_plugin_manager(tmp_path, monkeypatch):
    pm = manager.new_plugin_manager(load_entry_points=False)
    pm.register(FakeVendorPlugin())
    monkeypatch.setenv("PATH", _install_fake_smi(tmp_path, FAKE_OUTPUT))
    verdict = check_host("fake", pm=pm)
    assert [(g.index, g.unique_id) for g in verdict.unhealthy_gpus] == [(1, "SN-B")]
    assert "fake" not in [spec.smi for spec in manager.health_probes()]  # global one untouched


def test_a_probe_missing_part_of_the_contract_is_refused():
    class Incomplete:
        executables = ("half-smi",)

    class Plugin:
        @hookimpl
        def atom_health_probes(self):
            return [HealthProbeSpec(smi="half", probe=Incomplete())]

    pm = manager.new_plugin_manager(load_entry_points=False)
    pm.register(Plugin())
    with pytest.raises(TypeError, match="health probe 'half'"):
        check_host("half", pm=pm)
