"""benchmarks/kernel_profile.py without a GPU or ncu: the errors for a bad shape name, a
missing ncu and missing counter permissions, and the ncu command line (the CSV parsing and
the tables: tests/test_ncu_tables.py)."""

import sys

import pytest

from benchmarks import kernel_profile as kprof


def test_unknown_shape_lists_the_valid_ones(capsys):
    for argv in (["--run", "mla-h999"], ["--shapes", "prefill-1x8k,nope"]):
        with pytest.raises(SystemExit) as info:
            kprof.parse_args(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "unknown shape" in err and all(name in err for name in kprof.SHAPES)
    assert kprof.parse_args(["--shapes", "prefill-1x8k"]).shapes == ["prefill-1x8k"]


def test_missing_ncu_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    empty = tmp_path / "bin"
    empty.mkdir()
    nowhere = str(tmp_path / "cuda" / "bin" / "ncu")
    with pytest.raises(kprof.ProfileError) as info:
        kprof.find_ncu(None, path=str(empty), fallbacks=(nowhere,))
    msg = str(info.value)
    assert str(empty) in msg and nowhere in msg and "--ncu" in msg
    with pytest.raises(kprof.ProfileError, match="--ncu /no/such/ncu"):
        kprof.find_ncu("/no/such/ncu")
    fake = empty / "ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert kprof.find_ncu(None, path=str(empty), fallbacks=()) == str(fake)


def test_main_without_ncu_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kprof, "NCU_FALLBACKS", ())
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert kprof.main(["--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ncu (Nsight Compute) not found") and len(err[-1]) < 400


def test_permission_error_is_ncus_own_line():
    out = (
        "==PROF== Connected to process 7\n"
        "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
        "Performance Counters on the target device 0. For instructions on enabling "
        "permissions and to get more information see https://developer.nvidia.com/ERR_NVGPUCTRPERM\n"
        "==PROF== Disconnected from process 7\n"
    )
    line = kprof.permission_line(out)
    assert line.startswith("no permission to read the GPU's performance counters: ERR_NVGPUCTRPERM")
    assert "https://developer.nvidia.com/ERR_NVGPUCTRPERM" in line and "\n" not in line
    assert kprof.permission_line("==PROF== Disconnected\n") is None


def test_profile_command_filters_to_the_profiled_range():
    cmd = kprof.profile_command("/x/ncu", "prefill-1x8k", "/o/prefill-1x8k", ["m.ratio"], "none")
    text = " ".join(cmd)
    assert "--profile-from-start off" in text and "--metrics m.ratio" in text
    assert all(f"--section {s}" in text for s in kprof.SECTIONS)
    assert cmd[-5:] == [sys.executable, "-m", "benchmarks.kernel_profile", "--run", "prefill-1x8k"]
