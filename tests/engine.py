"""Run real vLLM engines in fresh subprocesses for end-to-end tests.

A fresh process per engine keeps environment variables (ATOM_PLUGIN_DISABLE,
VLLM_PLUGINS) and vLLM's process-wide state apart between runs. Inside it the engine
core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): with the core in a process
of its own the first step's batch depends on when each request reaches it, and the
near-tied logits of a random-weight model then change tokens between runs. In-process,
every run schedules the same batches, so token-for-token comparisons repeat.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from scripts.serve import vllm_env

GENERATE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        spec = json.loads(sys.argv[1])
        llm = LLM(**spec["llm"])
        params = SamplingParams(**spec["sampling"])
        outs = llm.generate(spec["prompts"], params)
        from vllm.platforms import current_platform
        result = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "platform": type(current_platform).__name__,
            "rpc": {name: llm.collective_rpc(name) for name in spec.get("rpc", [])},
            "engine_core": type(llm.llm_engine.engine_core).__name__,
        }
        print("RESULT " + json.dumps(result), flush=True)
    """
)


IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_env(**extra: str | None) -> dict[str, str]:
    """The test process's environment for a vLLM process (`scripts.serve.vllm_env`)."""
    return vllm_env(**{"TOKENIZERS_PARALLELISM": "false", **extra})


def token_engine_env(**extra: str | None) -> dict[str, str]:
    """`engine_env` with the engine core in-process, for runs whose tokens are compared."""
    return engine_env(**IN_PROCESS_ENGINE, **extra)


def generate(
    llm_kwargs: dict,
    prompts: list,
    sampling: dict,
    env: dict | None = None,
    timeout: float = 600,
    rpc: tuple[str, ...] = (),
) -> dict:
    """Greedy (or other) generation in a fresh process, its engine core in-process
    (`env` gets IN_PROCESS_ENGINE added); returns tokens, the platform class and, under
    "rpc", each worker method in `rpc` called on every worker after generating."""
    spec = json.dumps({"llm": llm_kwargs, "prompts": prompts, "sampling": sampling, "rpc": rpc})
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE, spec],
        capture_output=True,
        text=True,
        env={**(env or engine_env()), **IN_PROCESS_ENGINE},
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["log"] = proc.stdout + proc.stderr
            if result["engine_core"] != "InprocClient":
                raise AssertionError(f"the engine core ran as {result['engine_core']}")
            return result
    raise AssertionError(
        f"engine run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    )


def _case_check(build: str) -> str:
    """A script that runs `build` on each case's engine arguments (`args`: the model, a
    case's own or the one given, and the case's settings) and prints each case's error, or
    None where it went through."""
    return textwrap.dedent(
        """
        import json, sys

        if __name__ == "__main__":
            model, cases = sys.argv[1], json.loads(sys.argv[2])
            errors = {}
            for name, extra in cases.items():
                args = {"model": model, "dtype": "float32", "max_model_len": 256, **extra}
                try:
                    BUILD
                    errors[name] = None
                except Exception as e:  # what vLLM's start would raise
                    errors[name] = f"{type(e).__name__}: {e}"
            print("RESULT " + json.dumps(errors), flush=True)
        """
    ).replace("BUILD", build)


# vLLM's engine config for each case: the start's checks, the platform's included.
CONFIG_CHECK = _case_check(
    "from vllm.engine.arg_utils import EngineArgs; EngineArgs(**args).create_engine_config()"
)
# An engine for each case: the errors raised past the config, while the model's layers are
# built. Run it with IN_PROCESS_ENGINE: an engine core in a process of its own logs the
# cause and raises only "Engine core initialization failed".
START_CHECK = _case_check("from vllm import LLM; LLM(enforce_eager=True, **args)")


def config_errors(proc: subprocess.CompletedProcess) -> dict:
    """CONFIG_CHECK's or START_CHECK's answer: case -> the error it raised, or None."""
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def run_config_script(script: str, model, cases: dict, **env: str) -> subprocess.CompletedProcess:
    """`python -c script MODEL CASES_JSON` with the engine environment (plus `env`): the
    tests that build vLLM configs case by case, each in one fresh process."""
    return subprocess.run(
        [sys.executable, "-c", script, str(model), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=engine_env(**env),
        timeout=300,
    )
