"""Never break the host: a vLLM that lacks what the adapter reads (as vLLM 0.34 lacks
`VllmConfig.use_v2_model_runner`) still starts and serves with the plugin installed; the
plugin stands aside with one line, and only a feature the user asked for stops the start,
with a message naming the feature and the release."""

from __future__ import annotations

import pytest

from tests.engine import CONFIG_CHECK, config_errors, engine_env, generate, run_config_script
from tests.host_faults import host_faults_env
from tests.test_tbo_vllm_refusals import tbo

pytestmark = pytest.mark.vllm

NO_RUNNER_PROPERTY = (("vllm.config.vllm", "VllmConfig", "use_v2_model_runner"),)
STOOD_ASIDE = (
    "atom-plugin could not set up the Kimi-K3 channel's logits processors on vLLM 0.32.0 "
    "(AttributeError: this vLLM has the V1 model runner but its config does not say which "
    "runner the engine takes (no VllmConfig.use_v2_model_runner)) and stands aside"
)


def test_config_without_the_runner_property_starts_unless_a_feature_needs_it(tiny_llama, tmp_path):
    faults = host_faults_env(tmp_path, missing_for_adapter=NO_RUNNER_PROPERTY)
    cases = {
        "nothing asked": {},
        "atom_aiter asked": {"attention_config": {"backend": "atom_aiter"}},
        "tbo asked": tbo("prefill"),
    }
    proc = run_config_script(CONFIG_CHECK, tiny_llama, cases, **faults)
    errors = config_errors(proc)
    assert errors["nothing asked"] is None
    assert errors["atom_aiter asked"] is None  # the backend does not need the property
    tbo_error = errors["tbo asked"]
    assert tbo_error and tbo_error.startswith("RuntimeError: atom-plugin cannot provide"), tbo_error
    for part in ("two-batch overlap", "atom_plugin tbo='prefill'", "vLLM 0.32.0", "use_v2_model_"):
        assert part in tbo_error, (part, tbo_error)
    # One line per process says that the plugin stood aside, and why.
    assert proc.stderr.count(STOOD_ASIDE) + proc.stdout.count(STOOD_ASIDE) == 1, proc.stderr[-3000:]


def test_engine_serves_as_without_the_plugin_when_the_plugin_stands_aside(tiny_llama, tmp_path):
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4"]
    sampling = {"max_tokens": 12, "temperature": 0.0}
    llm = {"model": str(tiny_llama), "dtype": "float32", "max_model_len": 256}
    faults = host_faults_env(tmp_path, missing_for_adapter=NO_RUNNER_PROPERTY)
    faulty = generate(llm, prompts, sampling, env=engine_env(**faults))
    assert STOOD_ASIDE in faulty["log"]
    assert "atom-plugin logits processors" not in faulty["log"]  # none were added
    alone = generate(llm, prompts, sampling, env=engine_env(ATOM_PLUGIN_DISABLE="1"))
    assert faulty["tokens"] == alone["tokens"]


def test_platform_that_cannot_import_leaves_vllms_own_platform(tiny_llama, tmp_path):
    faults = host_faults_env(tmp_path, broken_imports=("atom_plugin.vllm.k3.enforcement",))
    proc = run_config_script(CONFIG_CHECK, tiny_llama, {"nothing asked": {}}, **faults)
    assert config_errors(proc)["nothing asked"] is None
    log = proc.stdout + proc.stderr
    assert "atom-plugin could not set up its platform and attention backends" in log, log[-3000:]
    assert "ImportError: cannot import atom_plugin.vllm.k3.enforcement" in log
