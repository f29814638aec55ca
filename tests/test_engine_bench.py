"""The engine benchmark's own rules (benchmarks/engine.py): cases, workloads, the report."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from benchmarks.engine import parse_case, report
from benchmarks.engine_shapes import WORKLOADS, parse_workloads, shape_config, write_shape


def test_a_case_is_a_backend_and_an_optional_variant():
    assert parse_case("FLASH_ATTN") == ("FLASH_ATTN", "")
    assert parse_case("FLASH_ATTN@disabled") == ("FLASH_ATTN", "disabled")
    with pytest.raises(ValueError, match=r"'nightly'.*'@disabled', '@old'"):
        parse_case("ATOM_AITER@nightly")


def test_unknown_workloads_and_shapes_are_named_with_the_choices(tmp_path):
    assert [w.name for w in parse_workloads("thr-512, lat-1")] == ["thr-512", "lat-1"]
    with pytest.raises(ValueError, match=r"\['thr-2k'\].*thr-512"):
        parse_workloads("thr-512,thr-2k")
    with pytest.raises(ValueError, match="'llama-70b'.*llama-3.1-8b"):
        write_shape("llama-70b", tmp_path)


def _result(case: str, tok_s: float) -> dict:
    run = {
        "workload": "thr-512",
        "output_tok_s": tok_s,
        "decode_step_ms": 8.0,
        "prefill_phase_s": 1,
    }
    return {"case": case, "runs": [run], "startup_s": 60.0}


def test_ratios_are_against_the_best_vllm_backend_not_the_plugin_or_a_variant():
    table = report(
        [
            _result("ATOM_AITER", 6600.0),
            _result("FLASH_ATTN@disabled", 9000.0),  # a variant: never the "best"
            _result("FLASH_ATTN", 6000.0),
            _result("TRITON_ATTN", 5000.0),
        ]
    )
    row = next(line for line in table.splitlines() if line.startswith("| thr-512 output"))
    assert "6,600 (1.10x)" in row and "5,000 (0.83x)" in row
    assert row.rstrip().endswith("| FLASH_ATTN |")


def test_fp8_cases_run_an_fp8_cache_and_prefix_caching_is_a_flag(tmp_path):
    from benchmarks.engine import llm_kwargs

    args = Namespace(
        max_model_len=4096,
        kv_gib=1.0,
        gpu_util=0.2,
        prefix_caching=True,
        eager=False,
        capture_sizes="",
    )
    plain = llm_kwargs(args, tmp_path, "FLASHMLA")
    fp8 = llm_kwargs(args, tmp_path, *parse_case("FLASHMLA@fp8"))
    assert "kv_cache_dtype" not in plain and fp8["kv_cache_dtype"] == "fp8"
    assert plain["enable_prefix_caching"] and plain["attention_config"] == {"backend": "FLASHMLA"}


def test_again_needs_the_prefix_cache(tmp_path):
    from benchmarks.engine import main

    with pytest.raises(SystemExit, match="--again .* needs --prefix-caching"):
        main(["--shape", "tiny-llama", "--again", "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_profiled_case_must_be_a_case(tmp_path):
    from benchmarks.engine import main

    args = ["--shape", "tiny-llama", "--cases", "default", "--profile", "FLASH_ATTN"]
    with pytest.raises(SystemExit, match=r"--profile names \['FLASH_ATTN'\], not among"):
        main([*args, "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_prompts_repeat_only_where_asked():
    """A pass's prompts depend on the workload and the seed alone: the `again` pass
    resubmits the first pass's; other passes and workloads share no prefix by chance;
    a shared-prefix workload's prompts share exactly its prefix."""
    from benchmarks.engine_case import prompts

    w = WORKLOADS["lat-8"].scaled(3, 4)
    assert prompts(w, 0) == prompts(w.scaled(3, 99), 0)  # output length plays no part
    firsts = [p[0] for p in prompts(w, 0) + prompts(w, 1) + prompts(WORKLOADS["decode-2k"], 0)]
    assert len(set(firsts)) == len(firsts)
    shared = WORKLOADS["shared-8k"]
    ps = prompts(shared, 0)
    assert len(ps) == shared.requests and all(len(p) == shared.prompt_len for p in ps)
    assert all(p[: shared.shared_prefix] == ps[0][: shared.shared_prefix] for p in ps)
    assert len({p[shared.shared_prefix] for p in ps}) == shared.requests


def test_the_tp8_slice_and_a_layer_count(tmp_path):
    config = shape_config("deepseek-v3-tp8")
    assert (config["num_attention_heads"], config["q_lora_rank"]) == (16, 1536)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]  # dense MLPs
    folder = write_shape("deepseek-v2-lite", tmp_path, layers=8)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 8
    assert folder.name == "deepseek-v2-lite-8l"
    with pytest.raises(ValueError, match="layers must be >= 1, got 0"):
        shape_config("deepseek-v3-tp8", layers=0)


def _runs(case: str, rows: dict[str, float], probe: dict | None = None) -> dict:
    runs = []
    for label, tok_s in rows.items():
        name, _, again = label.partition(" ")
        run = {
            "workload": name,
            "pass": "again" if again else "new",
            "output_tok_s": tok_s,
            "decode_step_ms": 2.0,
            "prefill_phase_s": 0.5,
            "ttft_ms": 40.0,
        }
        if probe:
            run["probe"] = probe
        runs.append(run)
    return {"case": case, "runs": runs, "startup_s": 70.0}


def test_both_passes_and_fp8_ratios_against_their_own_kind():
    table = report(
        [
            _runs("ATOM_AITER_MLA", {"decode-2k": 9000.0, "decode-2k again": 13000.0}),
            _runs("FLASH_ATTN_MLA", {"decode-2k": 10000.0, "decode-2k again": 12000.0}),
            _runs("ATOM_AITER_MLA@fp8", {"decode-2k": 9900.0, "decode-2k again": 9000.0}),
            _runs("FLASHMLA@fp8", {"decode-2k": 9000.0, "decode-2k again": 10000.0}),
        ]
    )
    rows = {line.split(" |")[0]: line for line in table.splitlines() if line.startswith("| ")}
    new, again = rows["| decode-2k output tok/s"], rows["| decode-2k again output tok/s"]
    assert "9,000 (0.90x)" in new and "9,900 (1.10x)" in new
    assert "13,000 (1.08x)" in again and "9,000 (0.90x)" in again
    assert new.rstrip().endswith("| FLASH_ATTN_MLA, FLASHMLA@fp8 |")
    assert "| decode-2k again TTFT ms" in rows


def test_rounds_pass_over_every_workload_and_the_table_takes_each_rows_median_pass():
    from benchmarks.engine_case import measured_passes

    spec = {"workloads": ["lat-1", "decode-2k"], "repeats": 3, "again": True}
    assert measured_passes(spec) == [
        (w, rep, kind) for rep in range(3) for w in spec["workloads"] for kind in ("new", "again")
    ]
    assert measured_passes({**spec, "repeats": 1, "again": False}) == [
        ("lat-1", 0, "new"),
        ("decode-2k", 0, "new"),
    ]

    def rounds(case, tok_s, clocks):
        result = _runs(case, {})
        for t, mhz in zip(tok_s, clocks, strict=True):
            run = _runs(case, {"decode-2k": t})["runs"][0]
            result["runs"].append({**run, "decode_step_ms": 1e5 / t, "clocks": mhz})
        return result

    clock = {"sm_mhz_median": 1980, "sm_mhz_min": 1590, "samples": 9, "slowdowns": []}
    table = report(
        [
            # one slow spell in the plugin's rounds, one fast one in vLLM's: the medians rank
            rounds("ATOM_AITER_MLA", [11000.0, 7000.0, 10800.0], [None, clock, None]),
            rounds("FLASH_ATTN_MLA", [10000.0, 15000.0, 9800.0, 10200.0], [None] * 4),
        ]
    )
    rows = {line.split(" |")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert "10,800 (1.08x)" in rows["| decode-2k output tok/s"]  # against 10,000, not 15,000
    spread = rows["| decode-2k output tok/s, slowest-fastest pass (passes)"]
    assert "7,000-11,000 (3)" in spread and "9,800-15,000 (4)" in spread
    # the other rows are the median pass's own: its step time, no clock samples
    assert "| decode-2k decode step ms (median) | 9.26 | 10.00 |" in table
    # and every pass's step, in the order they ran
    each = "| decode-2k decode step ms, each pass in turn | 9.09, 14.29, 9.26 | "
    assert each + "10.00, 6.67, 10.20, 9.80 | |" in table
    assert "SM clock" not in table
    single = report([_runs("ATOM_AITER_MLA", {"decode-2k": 9000.0})])
    assert "slowest-fastest" not in single and "each pass" not in single


def test_each_pass_shows_the_hosts_pace_beside_its_step():
    """The fixed Python work's time at each pass's start and end, in the order the passes
    ran, under the step row: a slow pass on a slow host reads as such."""

    def passes(case, steps, paces, cpus=None):
        result = _runs(case, {})
        for i, (ms, pace) in enumerate(zip(steps, paces, strict=True)):
            run = _runs(case, {"lat-1": 1e3 / ms})["runs"][0]
            host = {"busy_cores": 1.2, "own_cores": 1.0, "cpus": 16, "steal_cores": 0.0}
            host["pace_us"] = pace
            if cpus:  # results written before the CPU was recorded have no pace_cpu
                host["pace_cpu"] = cpus[i]
            result["runs"].append({**run, "decode_step_ms": ms, "host": host})
        return result

    table = report(
        [
            passes("ATOM_AITER_MLA", [2.4, 3.1], [(201.0, 204.4), (300.2, 296.0)]),
            passes(
                "FLASH_ATTN_MLA", [3.0, 2.5], [(290.0, 310.0), (199.9, 200.0)], [(3, 5), (0, 0)]
            ),
        ]
    )
    assert "| lat-1 decode step ms, each pass in turn | 2.40, 3.10 | 3.00, 2.50 | |" in table
    pace = "| lat-1 host's fixed Python work us (start/end, @CPU it ran on), each pass in turn | "
    assert pace + "201/204, 300/296 | 290@3/310@5, 200@0/200@0 | |" in table
    no_pace = report([_runs("ATOM_AITER_MLA", {"lat-1": 400.0}), _runs("X", {"lat-1": 1.0})])
    assert "fixed Python work" not in no_pace


def test_the_host_load_row_shows_busy_cores_and_the_engines_share():
    result = _runs("ATOM_AITER_MLA", {"lat-1": 500.0})
    result["runs"][0]["host"] = {"busy_cores": 5.04, "own_cores": 1.46, "cpus": 16}
    result["host_cpu"] = "AMD EPYC 9454 48-Core Processor, 16 cores"
    table = report([result, _runs("FLASH_ATTN_MLA", {"lat-1": 480.0})])
    assert "| lat-1 host busy cores (this engine's) of all | 5.0 (1.5) of 16 | - | |" in table
    result["runs"][0]["host"]["steal_cores"] = 0.84
    stolen = report([result])
    busy = "| lat-1 host busy cores (this engine's) of all | "
    assert busy + "5.0 (1.5) of 16, 0.8 stolen | |" in stolen
    assert "| host CPU | AMD EPYC 9454 48-Core Processor, 16 cores | - | |" in table


def test_the_probe_rows_say_what_bounds_a_step():
    decode = {
        "steps": 500,
        "host_ms": 1.9,
        "gpu_ms": 1.2,
        "build_us": 80.0,
        "host_bound_steps": 480,
        "syncs_exec": 0,
        "syncs_build": 0,
        "syncs_sample": 0,
        "tokens": 32000,
        "decode_path_tokens": 32000,
        "plans": {"gluon/lockstep splits 8 tokens 1x1": 500},
    }
    table = report([_runs("ATOM_AITER_MLA", {"lat-1": 500.0}, {"decode": decode})])
    assert "| lat-1 decode host_ms | 1.900 |" in table
    assert "| lat-1 decode host_bound_steps | 480 |" in table
    assert "| lat-1 decode tokens on the decode path | 32000/32000 |" in table
    assert "gluon/lockstep splits 8 tokens 1x1 x500" in table


def test_kernels_only_the_plugin_ran_are_listed():
    def prof(names):
        record = _profile(dict.fromkeys(names, 40.0))
        del record["kernels_complete"]  # a record that kept only its longest kernels
        return record

    plugin = {**_runs("ATOM_AITER_MLA", {}), "profiles": [prof(["gemm", "_mla_stage2", "cat"])]}
    vllm = {**_runs("FLASH_ATTN_MLA", {}), "profiles": [prof(["gemm", "flash_fwd"])]}
    table = report([plugin, vllm])
    only = table[table.index("Kernels only the plugin ran") :]
    assert "`_mla_stage2`" in only and "`cat`" in only and "`gemm`" not in only
    # records that kept only their longest kernels get no time split
    assert "by kernel" not in table


def _profile(kernels: dict[str, float]) -> dict:
    """A complete profile record of a decode pass: kernel name -> us a step."""
    return {
        "workload": "decode-2k",
        "phase": "decode",
        "steps": 8,
        "wall_ms_per_step": 3.2,
        "gpu_busy_ms_per_step": 3.1,
        "kernels_per_step": 100.0,
        "h2d_copies_per_step": 2.0,
        "kernels": [
            {"name": n, "calls_per_step": 4.0, "us_per_step": us, "mean_us": us / 4}
            for n, us in sorted(kernels.items(), key=lambda kv: -kv[1])
        ],
        "kernels_complete": True,
        "host": {},
    }


def test_the_time_split_sums_each_side_and_names_the_largest_shared_differences():
    ours = _profile({"gemm": 380.0, "stage1": 360.0, "write_kv": 30.0, "norm": 20.0})
    theirs = _profile({"gemm": 381.0, "fa3": 292.0, "combine": 62.0, "concat": 10.0, "norm": 20.0})
    plugin = {**_runs("ATOM_AITER_MLA", {}), "profiles": [ours]}
    vllm = {**_runs("FLASH_ATTN_MLA", {}), "profiles": [theirs]}
    table = report([plugin, vllm])
    split = table[table.index("by kernel") :]
    row = next(line for line in split.splitlines() if line.startswith("| ATOM_AITER_MLA"))
    assert row == (
        "| ATOM_AITER_MLA | FLASH_ATTN_MLA | decode-2k decode | 390.0 us (2 kernels) "
        "| 364.0 us (3 kernels) | -1.0 us (2 kernels) | `gemm` -1.0 |"
    )


def test_a_profile_table_lists_the_longest_kernels_and_sums_the_rest():
    from benchmarks.engine_profiles import REPORT_KERNELS, profile_report

    prof = _profile({f"k{i:02d}": 100.0 - i for i in range(REPORT_KERNELS + 3)})
    table = profile_report("ATOM_AITER_MLA", prof)
    assert f"`k{REPORT_KERNELS - 1:02d}`" in table and f"`k{REPORT_KERNELS:02d}`" not in table
    rest = [100.0 - i for i in range(REPORT_KERNELS, REPORT_KERNELS + 3)]
    assert f"| 3 other kernels | 12.0 | {sum(rest):.1f} | |" in table


def test_a_profile_title_names_the_requests_its_steps_ran():
    from benchmarks.engine_profiles import profile_report

    prof = _profile({"gemm": 10.0})
    assert "(decode, 8 steps)**" in profile_report("X", prof)  # older records: not recorded
    prof["requests_per_step"] = [64, 64]
    assert "(decode, 8 steps, 64 requests a step)**" in profile_report("X", prof)
    prof["requests_per_step"] = [24, 64]
    assert "(decode, 8 steps, 24-64 requests a step)**" in profile_report("X", prof)


def test_profile_entries_name_the_pass_and_phase():
    from benchmarks.engine_probe import parse_profile_entry

    assert parse_profile_entry("lat-1") == ("lat-1", False, "decode")
    assert parse_profile_entry("decode-2k@again") == ("decode-2k", True, "prefill")
    assert parse_profile_entry("decode-2k@again:decode") == ("decode-2k", True, "decode")
    with pytest.raises(ValueError, match="'@twice' is not '@again'"):
        parse_profile_entry("lat-1@twice")
    with pytest.raises(ValueError, match="phase 'warmup' is not decode or prefill"):
        parse_profile_entry("lat-1:warmup")


def _run_engine_bench(*args: str):
    """`python -m benchmarks.engine` on vLLM's CPU build with the tiny Llama shape, small
    and eager; returns the finished process (its exit checked)."""
    import subprocess
    import sys

    from tests.engine import engine_env

    small = ("--shape", "tiny-llama", "--kv-gib", "0.25", "--max-model-len", "2048", "--eager")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", *small, *args],
        capture_output=True,
        text=True,
        env=engine_env(ATOM_PLUGIN_DISABLE=None),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.vllm
def test_a_wave_runs_on_vllms_cpu_build_and_the_disabled_variant_has_no_plugin(tmp_path):
    """The whole harness on the CPU build: a wave of two engines, one with the plugin off."""
    out = tmp_path / "out"
    proc = _run_engine_bench(
        *("--cases", "default,default@disabled", "--workloads", "lat-1,lat-8"),
        *("--wave", "2", "--repeats", "1", "--out-dir", str(out)),
        # the prefix cache, the same prompts again, the step probe, both profile phases
        *("--prefix-caching", "--again", "--probe", "--profile", "default"),
        *("--profile-workloads", "lat-1,lat-1@again"),
    )
    assert "| lat-1 output tok/s |" in proc.stdout and "| lat-1 TTFT ms |" in proc.stdout
    results = {json.loads(p.read_text())["case"]: p for p in out.glob("*.json")}
    assert set(results) == {"default", "default@disabled"}
    for path in results.values():
        result = json.loads(path.read_text())
        new, again = [r for r in result["runs"] if r["workload"] == "lat-1"]
        assert (new["pass"], again["pass"]) == ("new", "again")
        assert new["steps"] >= new["output_len"] and result["cold"]["workload"] == "lat-1"
        # each workload warmed at its own concurrency, and on the same prompts again
        warm = [(r["workload"], r["requests"], r["pass"]) for r in result["warm"]]
        sizes = (("lat-1", 1), ("lat-8", 8))
        assert warm == [(w, n, kind) for w, n in sizes for kind in ("new", "again")]
        # every model step recorded: one prefill, the rest decodes
        assert new["probe"]["prefill"]["steps"] >= 1
        assert new["probe"]["decode"]["steps"] >= new["output_len"] - 2
    profiles = json.loads(results["default"].read_text())["profiles"]
    assert [(p["workload"], p["phase"]) for p in profiles] == [
        ("lat-1", "decode"),
        ("lat-1@again", "prefill"),
    ]
    assert all(p["steps"] >= 1 for p in profiles)  # no kernels on the CPU build
    assert (out / "default-lat-1-decode.json.gz").exists()
    assert "| lat-1 again output tok/s |" in proc.stdout
    assert "| lat-1 decode host_ms |" in proc.stdout
    # the cases measured pass by pass in turn, the order rotating each round, never two
    # passes at once, and each stayed up until the other had measured
    by_case = {r["case"]: r for r in (json.loads(p.read_text()) for p in results.values())}
    one, other = by_case["default"], by_case["default@disabled"]
    assert one["turns"] == [1, 2, 1, 2, 1, 2]  # set-up, four passes, the profiles
    assert other["turns"] == [2, 1, 2, 1, 2, 1]
    timed = sorted((run["at"], r["case"]) for r in (one, other) for run in r["runs"])
    assert all(a[0][1] <= b[0][0] for a, b in zip(timed, timed[1:], strict=False))
    rounds = [["default@disabled", "default"], ["default", "default@disabled"]] * 2
    assert [case for _, case in timed] == [c for pair in rounds for c in pair]
    for a, b in ((one, other), (other, one)):
        assert a["left_at"] >= b["measured_until"]
    row = next(line for line in proc.stdout.splitlines() if "| turn in each round |" in line)
    assert " 1,2,1,2,1,2 |" in row and " 2,1,2,1,2,1 |" in row
    ran = next(line for line in proc.stdout.splitlines() if line.startswith("| ran |"))
    assert ran.count(", core in process") == 2
    # The plugin's platform logs what it installed in the plugin's case only.
    assert "atom-plugin logits processors" in (out / "default.log").read_text()
    assert "atom-plugin" not in (out / "default-disabled.log").read_text()


@pytest.mark.vllm
def test_an_engine_core_in_a_process_of_its_own_is_measured_and_probed(tmp_path):
    """--engine-process: the engine core runs where vLLM serves it, outside the measuring
    process, and the probe still records every model step there. --cpus pins the case and,
    through it, the engine core's process."""
    import os

    cpu = max(os.sched_getaffinity(0))
    out = tmp_path / "out"
    proc = _run_engine_bench(
        *("--cases", "default", "--workloads", "lat-1", "--wave", "1"),
        *("--probe", "--engine-process", "--out-dir", str(out), "--cpus", str(cpu)),
    )
    result = json.loads((out / "default.json").read_text())
    assert result["engine"]["pid"] != result["measuring_pid"]
    assert result["cpus"] == result["engine"]["cpus"] == [cpu]
    assert set(result["runs"][0]["host"]["pace_cpu"]) == {cpu}
    (run,) = result["runs"]
    assert run["probe"]["decode"]["steps"] >= run["output_len"] - 2
    assert run["decode_step_ms"] > 0
    ran = next(line for line in proc.stdout.splitlines() if line.startswith("| ran |"))
    assert f", core in its own process, CPUs {cpu}" in ran


def test_the_engine_process_mode_takes_no_profile_and_pickles_its_rpc(tmp_path, monkeypatch):
    from benchmarks.engine import case_env, main

    with pytest.raises(SystemExit, match="drop one of them"):
        main(["--engine-process", "--profile", "FLASH_ATTN", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--cpus: CPU list '4096': CPUs \[4096\] are not"):
        main(["--cpus", "4096", "--out-dir", str(tmp_path)])
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    own = case_env("", None, engine_process=True)
    assert own["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert own["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    inside = case_env("", None)
    assert inside["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in inside


def test_cases_skip_flashinfers_sampler_build_unless_told(monkeypatch):
    """Greedy passes never reach the top-k/top-p sampler, whose JIT build cost each fresh
    engine about 97 s of its start; a caller's own setting stands."""
    from benchmarks.engine import case_env

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    assert case_env("", None)["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert case_env("disabled", None)["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
