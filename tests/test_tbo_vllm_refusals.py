"""TBO with a setting it cannot serve: vLLM's own config check stops at start with the reason."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.engine import run_config_script

pytestmark = pytest.mark.vllm

CHECK = textwrap.dedent(
    """
    import json, sys
    from vllm.engine.arg_utils import EngineArgs

    if __name__ == "__main__":
        model, cases = sys.argv[1], json.loads(sys.argv[2])
        errors = {}
        for name, extra in cases.items():
            args = {"model": model, "dtype": "float32", "max_model_len": 256, **extra}
            try:
                EngineArgs(**args).create_engine_config()
                errors[name] = None
            except Exception as e:  # what vLLM's start would raise
                errors[name] = f"{type(e).__name__}: {e}"
        print("RESULT " + json.dumps(errors), flush=True)
    """
)


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
    proc = run_config_script(CHECK, tiny_llama, cases)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = json.loads(line[len("RESULT ") :])
    assert errors["tbo off"] is None
    for name, (_, message) in CASES.items():
        assert errors[name] and message in errors[name], (name, errors[name])


def test_model_runner_v2_is_refused_with_the_setting_that_works(tiny_llama):
    # The CPU build's config takes Model Runner V2 when asked for it (its GPU default).
    proc = run_config_script(
        CHECK, tiny_llama, {"mrv2": tbo("prefill")}, VLLM_USE_V2_MODEL_RUNNER="1"
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = json.loads(line[len("RESULT ") :])["mrv2"]
    assert error and "tbo='prefill' cannot run" in error and "Model Runner V2" in error, error
    assert "setting VLLM_USE_V2_MODEL_RUNNER to 0" in error
    assert '"v1_logits_processors": true' in error
