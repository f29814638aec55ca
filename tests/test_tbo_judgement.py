"""TBO says at start what it will do: one line per condition under which it splits
nothing or only adds cost, and `atom-plugin info --engine-args` prints the same."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from atom_plugin.tbo.judgement import EngineLimits, tbo_judgement
from atom_plugin.tbo.mode import TboConfig
from tests.engine import engine_env, run_config_script

YIELDING = EngineLimits(8192, 256, expert_parallel=True, all2all_backend="deepep_low_latency")


def test_no_condition_against_reachable_thresholds_with_a_yielding_all2all():
    config = TboConfig.for_mode("all", decode_min_requests=192, prefill_min_tokens=4096)
    assert tbo_judgement(config, YIELDING) == []


@pytest.mark.parametrize(
    ("ep", "backend", "where"),
    [(False, "allgather_reducescatter", "no --enable-expert-parallel"),
     (True, "allgather_reducescatter", "--all2all-backend allgather_reducescatter")],
)  # fmt: skip
def test_no_all2all_to_overlap_names_the_settings_that_yield(ep, backend, where):
    limits = EngineLimits(8192, 256, expert_parallel=ep, all2all_backend=backend)
    [line] = tbo_judgement(TboConfig.for_mode("decode"), limits)
    assert line.startswith(f"no all-to-all to overlap ({where}): split steps run one")
    assert "--enable-expert-parallel and --all2all-backend deepep_high_throughput|" in line


def test_unreachable_thresholds_say_which_kind_never_splits():
    config = TboConfig.for_mode("all", decode_min_requests=192, prefill_min_tokens=12288)
    lines = tbo_judgement(config, EngineLimits(8192, 128, True, "deepep_high_throughput"))
    assert lines == [
        "decode steps never split: tbo_decode_min_requests=192 is above the largest decode "
        "step this engine schedules (128 requests: --max-num-seqs 128, --max-num-batched-tokens "
        "8192); lower tbo_decode_min_requests to at most 128 or raise --max-num-seqs",
        "prefill steps never split: tbo_prefill_min_tokens=12288 is above "
        "--max-num-batched-tokens 8192, the most new tokens of one step; lower "
        "tbo_prefill_min_tokens to at most 8192 or raise --max-num-batched-tokens to 12288 "
        "or more",
    ]
    # Only the kinds the mode splits are judged; a threshold at the limit is reachable.
    assert tbo_judgement(TboConfig.for_mode("decode", prefill_min_tokens=12288), YIELDING) == []
    prefill = TboConfig.for_mode("prefill", prefill_min_tokens=8192, decode_min_requests=512)
    assert tbo_judgement(prefill, YIELDING) == []


CHECK = textwrap.dedent(
    """
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    if __name__ == "__main__":
        model, cases = sys.argv[1], json.loads(sys.argv[2])
        for name, extra in cases.items():
            print("CASE " + name, flush=True)
            args = {"model": model, "dtype": "float32", "max_model_len": 256, **extra}
            EngineArgs(**args).create_engine_config(UsageContext.OPENAI_API_SERVER)
        print("CASE END", flush=True)
    """
)


def logged_by_case(output: str) -> dict[str, list[str]]:
    """The plugin's TBO lines that vLLM logged (its log goes to stdout) under each case."""
    logged, case = {}, None
    for line in output.splitlines():
        if line.startswith("CASE "):
            case = line[len("CASE ") :]
            logged[case] = []
        elif "atom-plugin: two-batch overlap" in line and case is not None:
            logged[case].append(line[line.index("atom-plugin: two-batch overlap") :])
    return logged


def tbo(mode, **settings):
    return {"additional_config": {"atom_plugin": {"tbo": mode, **settings}}}


NO_ALL2ALL = "no all-to-all to overlap (no --enable-expert-parallel)"
CASES = {
    # The README's example with every default: vllm serve on this machine batches at most
    # max_num_batched_tokens new tokens a step, below the default threshold of 12288.
    "prefill, defaults": (tbo("prefill"), [NO_ALL2ALL, "prefill steps never split"]),
    "decode, 64 seqs": (
        {**tbo("decode"), "max_num_seqs": 64},
        [NO_ALL2ALL, "decode steps never split: tbo_decode_min_requests=192 is above"],
    ),
    "all, reachable": (
        {**tbo("all", tbo_decode_min_requests=32, tbo_prefill_min_tokens=1024),
         "max_num_seqs": 64, "max_num_batched_tokens": 2048},
        [NO_ALL2ALL],
    ),
}  # fmt: skip


@pytest.mark.vllm
def test_each_start_up_judgement_is_logged_and_info_prints_the_same(tiny_llama):
    cases = {name: extra for name, (extra, _) in CASES.items()}
    proc = run_config_script(CHECK, tiny_llama, cases)
    logged = logged_by_case(proc.stdout)
    assert "END" in logged, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, (extra, wanted) in CASES.items():
        head, *conditions = logged[name]
        assert head.startswith("atom-plugin: two-batch overlap "), (name, head)
        mode = extra["additional_config"]["atom_plugin"]["tbo"]
        assert {c.split(": ", 2)[1] for c in conditions} == {f"two-batch overlap {mode}"}, name
        assert len(conditions) == len(wanted), (name, conditions)
        for condition, start in zip(conditions, wanted, strict=True):
            assert condition.split(": ", 2)[2].startswith(start), (name, condition)
    default_tokens = logged["prefill, defaults"][2].split("--max-num-batched-tokens ")[1]
    assert int(default_tokens.split(",")[0]) < 12288
    # The same judgement from the command line, for the README's example.
    settings = json.dumps(CASES["prefill, defaults"][0]["additional_config"])
    info = subprocess.run(
        [sys.executable, "-m", "atom_plugin.cli", "info", "--engine-args",
         f"--model {tiny_llama} --dtype float32 --max-model-len 256 "
         f"--additional-config '{settings}'"],
        capture_output=True, text=True, env=engine_env(), timeout=300,
    )  # fmt: skip
    assert info.returncode == 0, info.stderr[-3000:]
    out = info.stdout.splitlines()
    at = out.index("two-batch overlap with these engine arguments: prefill (prefill steps of >= "
                   "12288 tokens split)")  # fmt: skip
    assert out[at + 1 : at + 3] == [
        "  " + c.split(": ", 2)[2] for c in logged["prefill, defaults"][1:]
    ]
