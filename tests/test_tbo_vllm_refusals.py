"""TBO with a setting it cannot serve: vLLM's own config check stops at start with the reason."""

from __future__ import annotations

import pytest

from tests.engine import CONFIG_CHECK, config_errors, run_config_script

pytestmark = pytest.mark.vllm


def tbo(mode="all", **settings):
    return {"additional_config": {"atom_plugin": {"tbo": mode, **settings}}}


CASES = {
    "unknown mode": (tbo("sometimes"), "tbo='sometimes' is not one of off, prefill, decode, all"),
    "zero threshold": (tbo(tbo_prefill_min_tokens=0), "tbo_prefill_min_tokens must be a positive"),
    "pipeline parallel": (
        {**tbo(), "pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
        "pipeline parallelism",
    ),
    "user worker": (
        {**tbo(), "worker_cls": "vllm.v1.worker.cpu_worker.CPUWorker"},
        "--worker-cls vllm.v1.worker.cpu_worker.CPUWorker was chosen",
    ),
    "unknown key": (tbo(tbo_threshold=4), "unknown atom_plugin setting(s) tbo_threshold"),
}


def test_settings_tbo_cannot_serve_are_refused_at_start(tiny_llama):
    cases = {name: extra for name, (extra, _) in CASES.items()}
    cases["tbo off"] = tbo("off")
    errors = config_errors(run_config_script(CONFIG_CHECK, tiny_llama, cases))
    assert errors["tbo off"] is None
    for name, (_, message) in CASES.items():
        assert errors[name] and message in errors[name], (name, errors[name])


def test_model_runner_v2_on_the_cpu_platform_is_refused(tiny_llama):
    """TBO runs in Model Runner V2 on GPUs; on the CPU platform it runs in the V1 runner
    (the CPU build's default, which its config leaves for MRV2 when asked)."""
    proc = run_config_script(
        CONFIG_CHECK, tiny_llama, {"mrv2": tbo("prefill")}, VLLM_USE_V2_MODEL_RUNNER="1"
    )
    error = config_errors(proc)["mrv2"]
    assert error and "tbo='prefill' cannot run" in error, error
    assert "on vLLM's cpu platform runs inside the V1 model runner" in error, error
    assert "leave VLLM_USE_V2_MODEL_RUNNER unset" in error and "=0" not in error, error
