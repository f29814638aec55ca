"""The plugin inside vLLM's GPU engine (H200/H100; skipped without CUDA).

Every configuration runs a real vLLM engine in a process of its own (graphs on and
eager, Model Runner V2 and, where the release still has it, the V1 runner, prefix caching
on and off, vLLM 0.34's extensible KV cache on and off, two-batch overlap), generates
greedily with the sampled tokens' logprobs (the decode path; with prefix caching on, the
same prompts twice, the second time from cached blocks), and scores each prompt plus its
generated tokens teacher-forced (the prefill path). vLLM's own backends then score the
same sequences. Greedy tokens of random bf16 models flip on near ties, so outputs are
compared as logprobs: the plugin's distance from vLLM's reference backend
(FLASH_ATTN for MHA, TRITON_MLA for MLA) may be at most TOLERANCE_FACTOR times the
distance between that reference and vLLM's second backend on the same sequences
(TRITON_ATTN, FLASHMLA), plus LOGPROB_FLOOR. The MLA model runs twice: at 32 heads on a
bf16 cache, and at 16 heads (DeepSeek's TP8 slice) on an fp8 cache, where the plugin's
decode takes the Gluon kernel's rows16 schedule (counted, so the test sees it ran).

    python3 -m pytest -q tests/test_gpu_engine.py      # on the H200, vLLM's CUDA build
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from atom_plugin.k3.plugin import CHANNEL_PROCESSORS
from tests.engine import IN_PROCESS_ENGINE, engine_env

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

TOLERANCE_FACTOR = 3.0
LOGPROB_FLOOR = 0.05  # nats: bf16 rounding of a short, sharply peaked model
PROMPT_LENS = (5, 17, 33, 48, 64, 90, 120, 7)
MAX_TOKENS = 24
ENGINE = dict(
    dtype="bfloat16",
    max_model_len=512,
    seed=0,
    enable_prefix_caching=False,
    gpu_memory_utilization=0.05,
    kv_cache_memory_bytes=1 << 30,
    max_num_seqs=16,
)

SCORE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from benchmarks.engine_case import worker_facts

    if __name__ == "__main__":
        spec = json.loads(sys.argv[1])
        llm = LLM(**spec["llm"])
        result = {"facts": llm.collective_rpc(worker_facts)[0]}
        sequences = spec["score"]
        if spec["generate"]:
            params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=0,
                                    ignore_eos=True, detokenize=False)
            prompts = [{"prompt_token_ids": p} for p in spec["generate"]]
            for again in ("", "_again")[: 1 + spec["again"]]:
                # The second pass finds the prompts' blocks in the prefix cache.
                outs = llm.generate(prompts, params, use_tqdm=False)
                result["generated" + again] = [list(o.outputs[0].token_ids) for o in outs]
                result["sampled" + again] = [[lp[t].logprob for t, lp in
                                              zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                             for o in outs]
            sequences = [p + g for p, g in zip(spec["generate"], result["generated"])]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        result["scored"] = [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]
                            for s, o in zip(sequences, outs)]
        result["sequences"] = sequences
        # the MLA decode launches planned by now (graph captures, eager steps)
        result["mla_launches"] = llm.collective_rpc(worker_facts)[0]["mla_launches"]
        if spec.get("tbo"):
            result["tbo"] = llm.collective_rpc("atom_tbo_stats")[0]
        print("RESULT " + json.dumps(result), flush=True)
    """
)


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # "mha", "mla" or "mla16-fp8" (MODELS)
    backend: str
    runner: str = "mrv2"  # or "v1" (vLLM 0.32 and 0.33 only)
    eager: bool = False
    extra: dict = field(default_factory=dict)

    def env(self) -> dict:
        return engine_env(
            **IN_PROCESS_ENGINE,
            ATOM_PLUGIN_DISABLE=None,
            VLLM_USE_V2_MODEL_RUNNER="0" if self.runner == "v1" else None,
        )

    @property
    def prefix_caching(self) -> bool:
        return self.extra.get("enable_prefix_caching", False)

    @property
    def extensible(self) -> bool:
        """Sized from measured memory, the engine takes vLLM 0.34's extensible KV cache (its
        default on CUDA); a fixed kv_cache_memory_bytes turns it off."""
        return self.extra.get("kv_cache_memory_bytes", 0) is None


# Small chunks make the graphs-on runs mix chunked prefill with decode in one step.
CHUNKED = {"max_num_batched_tokens": 64}
PREFIX = {"enable_prefix_caching": True}
# vLLM's defaults: prefix caching on and the KV cache sized from measured memory. Such an
# engine measures the GPU's memory while it starts, so these run after the others, alone.
MEASURED = {**PREFIX, "kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.1}
TBO_DECODE = {"additional_config": {"atom_plugin": {"tbo": "decode", "tbo_decode_min_requests": 4}}}
TBO_PREFILL = {
    "additional_config": {"atom_plugin": {"tbo": "prefill", "tbo_prefill_min_tokens": 32}}
}

PLUGIN = [
    Config("mha-mrv2-graphs", "mha", "ATOM_AITER", extra=CHUNKED),
    Config("mha-mrv2-eager", "mha", "ATOM_AITER", eager=True),
    Config("mha-mrv2-prefix", "mha", "ATOM_AITER", extra={**CHUNKED, **PREFIX}),
    Config("mha-v1-graphs", "mha", "ATOM_AITER", runner="v1", extra=CHUNKED),
    Config("mha-v1-eager", "mha", "ATOM_AITER", runner="v1", eager=True),
    Config("mla-mrv2-graphs", "mla", "ATOM_AITER_MLA", extra=CHUNKED),
    Config("mla-mrv2-eager", "mla", "ATOM_AITER_MLA", eager=True),
    Config("mla-mrv2-prefix", "mla", "ATOM_AITER_MLA", extra={**CHUNKED, **PREFIX}),
    Config("mla-v1-graphs", "mla", "ATOM_AITER_MLA", runner="v1", extra=CHUNKED),
    Config("mla-v1-eager", "mla", "ATOM_AITER_MLA", runner="v1", eager=True),
    Config("mla16-fp8-mrv2-graphs", "mla16-fp8", "ATOM_AITER_MLA", extra=CHUNKED),
    Config("tbo-decode-graphs", "mha", "ATOM_AITER", runner="v1", extra=TBO_DECODE),
    Config(
        "tbo-prefill-graphs", "mha", "ATOM_AITER", runner="v1", extra={**TBO_PREFILL, **CHUNKED}
    ),
    Config("mha-mrv2-measured", "mha", "ATOM_AITER", extra=MEASURED),
    Config("mla-mrv2-measured", "mla", "ATOM_AITER_MLA", extra=MEASURED),
]
# (reference, second backend) per model: the second one's distance from the reference
# is the yardstick.
REFERENCES = {
    "mha": ("FLASH_ATTN", "TRITON_ATTN"),
    "mla": ("TRITON_MLA", "FLASHMLA"),
    "mla16-fp8": ("TRITON_MLA", "FLASHMLA"),
}
# What a model's engines (the plugin's and the references') take beside ENGINE
# (at 16K positions the decode graphs are planned for contexts long enough to split many
# ways, where the plan takes rows16 rather than the per-token kernel of short contexts)
MODEL_ENGINE = {"mla16-fp8": {"kv_cache_dtype": "fp8", "max_model_len": 16384}}
# The plugin's MLA decode kernel a model's engines must have run (PLANNED_LAUNCHES)
EXPECTED_MLA_KERNEL = {"mla16-fp8": "gluon/rows16"}
EXPECTED_RUNNER = {
    "mrv2": "vllm.v1.worker.gpu.model_runner",
    "v1": "vllm.v1.worker.gpu_model_runner",
}


def _runs_here(config: Config) -> bool:
    """Whether this vLLM has the runner `config` asks for (vLLM 0.34 removed V1)."""
    from atom_plugin.vllm.compat.runners import has_v1_runner

    return config.runner != "v1" or has_v1_runner()


def _run(
    config_name: str, llm: dict, env: dict, generate, score, tbo: bool, again: bool = False
) -> dict:
    spec = {
        "llm": llm,
        "generate": generate,
        "score": score,
        "max_tokens": MAX_TOKENS,
        "tbo": tbo,
        "again": again,
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCORE, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    log = (proc.stdout + proc.stderr)[-8000:]
    raise AssertionError(f"{config_name}: engine failed (exit {proc.returncode}):\n{log}")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from scripts.tiny_llama import build_tiny_llama
    from tests.models.tiny_deepseek import build_tiny_deepseek

    mha = build_tiny_llama(tmp_path_factory.mktemp("gpu-llama"))
    # DeepSeek's own widths (vLLM's GPU MLA prefill takes qk_nope 128 / v 128) and 32 heads,
    # where the plugin's per-step plan can take the Hopper Gluon decode.
    mla = build_tiny_deepseek(
        tmp_path_factory.mktemp("gpu-deepseek"), num_heads=32, nope_dim=128, v_dim=128
    )
    mla16 = build_tiny_deepseek(
        tmp_path_factory.mktemp("gpu-deepseek16"),
        num_heads=16,
        nope_dim=128,
        v_dim=128,
        max_positions=16384,
    )
    return {"mha": str(mha), "mla": str(mla), "mla16-fp8": str(mla16)}


def _selected(session) -> list[Config]:
    """The configurations this session's tests read: those whose own test it runs, and
    every configuration of a model whose reference backends' test it runs (`-k mla` runs
    MLA engines only)."""
    names, models = set(), set()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "config" in params:
            names.add(params["config"].name)
        if "model" in params:
            models.add(params["model"])
    return [c for c in PLUGIN if c.name in names or c.model in models]


def _wait_until_alone_on_the_gpu(timeout_s: float = 600.0) -> None:
    """Waits while other processes hold GPU memory (up to `timeout_s`): an engine sized
    from measured memory counts what they allocate meanwhile as its own, and on an 80 GB
    card at a utilization of 0.1 nothing may be left for its KV cache."""
    import os
    import time

    try:
        import pynvml
    except ImportError:
        return
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        deadline = time.monotonic() + timeout_s
        while True:
            others = [
                p.pid
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid != os.getpid()
            ]
            if not others or time.monotonic() > deadline:
                break
            print(f"waiting for GPU processes {others} to end before a measured engine")
            time.sleep(10)
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture(scope="module")
def runs(models, request):
    """The selected plugin configurations, then the reference backends on the sequences
    they made."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = _prompts(500)

    def plugin_run(c: Config):
        llm = {
            **ENGINE,
            **MODEL_ENGINE.get(c.model, {}),
            "model": models[c.model],
            "attention_config": {"backend": c.backend},
            "enforce_eager": c.eager,
            **c.extra,
        }
        llm = {k: v for k, v in llm.items() if v is not None}
        tbo = "additional_config" in c.extra
        try:
            result = _run(c.name, llm, c.env(), prompts, None, tbo, again=c.prefix_caching)
            return c.name, result
        except AssertionError as failure:  # reported by this configuration's own test
            return c.name, failure

    here = [c for c in _selected(request.session) if _runs_here(c)]
    with ThreadPoolExecutor(len(here)) as pool:
        plugin = dict(pool.map(plugin_run, [c for c in here if not c.extensible]))
    for config in (c for c in here if c.extensible):  # one at a time: each measures memory
        _wait_until_alone_on_the_gpu()
        plugin.update([plugin_run(config)])

    def reference_run(item):
        model, backend = item
        sequences = [s for c in _ran(plugin, model) for s in plugin[c.name]["sequences"]]
        if not sequences:
            return (model, backend), AssertionError(f"no {model} configuration ran")
        llm = {
            **ENGINE,
            **MODEL_ENGINE.get(model, {}),
            "model": models[model],
            "attention_config": {"backend": backend},
        }
        env = engine_env(**IN_PROCESS_ENGINE, ATOM_PLUGIN_DISABLE=None)
        try:
            return (model, backend), _run(backend, llm, env, None, sequences, False)
        except AssertionError as failure:
            return (model, backend), failure

    selected_models = {c.model for c in here}
    pairs = [(m, b) for m, refs in REFERENCES.items() for b in refs if m in selected_models]
    with ThreadPoolExecutor(len(pairs)) as pool:
        reference = dict(pool.map(reference_run, pairs))
    return plugin, reference


def _ran(plugin: dict, model: str) -> list[Config]:
    """The configurations of `model` whose engine ran, in PLUGIN order."""
    return [
        c
        for c in PLUGIN
        if c.model == model and c.name in plugin and not isinstance(plugin[c.name], Exception)
    ]


def _reference_rows(plugin, reference, config: Config, backend: str) -> list[list[float]]:
    """`backend`'s scores of `config`'s sequences (the references scored the sequences of
    every configuration of one model that ran, in PLUGIN order)."""
    start = 0
    for c in _ran(plugin, config.model):
        n = len(plugin[c.name]["sequences"])
        if c == config:
            scored = reference[(config.model, backend)]
            if isinstance(scored, Exception):
                raise scored
            return scored["scored"][start : start + n]
        start += n
    raise KeyError(config.name)


def _same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    worst = 0.0
    for row_a, row_b in zip(a, b, strict=True):
        worst = max([worst, *(abs(x - y) for x, y in zip(row_a, row_b, strict=True))])
    return worst


@pytest.mark.parametrize("config", PLUGIN, ids=[c.name for c in PLUGIN])
def test_plugin_backend_matches_vllms_backend_by_logprobs(runs, config):
    if not _runs_here(config):
        pytest.skip(f"this vLLM has no {config.runner} model runner (vLLM 0.34 removed V1)")
    plugin, reference = runs
    result = plugin[config.name]
    if isinstance(result, Exception):
        raise result
    facts = result["facts"]
    assert facts["attention_backends"] == [config.backend], facts
    tbo = "additional_config" in config.extra  # TBO runs vLLM's V1 runner under the plugin's
    expected = "atom_plugin.vllm.tbo.worker_gpu" if tbo else EXPECTED_RUNNER[config.runner]
    assert facts["runner"].startswith(expected), facts
    assert facts["torch_cuda_event"] == "torch.cuda.streams.Event", facts
    assert ("NONE" in facts["cudagraph_mode"]) == config.eager, facts
    assert facts["prefix_caching"] == config.prefix_caching, facts
    if facts["extensible_kv_cache"] is not None:  # a release with the extensible KV cache
        assert facts["extensible_kv_cache"] == config.extensible, facts
    kernel = EXPECTED_MLA_KERNEL.get(config.model)
    if kernel is not None:  # the decode's launches (graph captures, eager steps) took it
        assert result["mla_launches"].get(kernel, 0) > 0, result["mla_launches"]
    ref_name, second_name = REFERENCES[config.model]
    ref = _reference_rows(plugin, reference, config, ref_name)
    second = _reference_rows(plugin, reference, config, second_name)
    yardstick = _max_diff(second, ref)
    bound = TOLERANCE_FACTOR * yardstick + LOGPROB_FLOOR
    # Prefill: the plugin's teacher-forced scores of prompt + generated tokens.
    prefill = _max_diff(result["scored"], ref)
    # Decode: the logprob of each token the plugin sampled, against the reference's
    # teacher-forced score of the same token at the same position.
    decode = _max_diff(result["sampled"], [row[-MAX_TOKENS:] for row in ref])
    print(f"{config.name}: prefill {prefill:.4f} decode {decode:.4f} "
          f"{second_name} vs {ref_name} {yardstick:.4f} bound {bound:.4f}")  # fmt: skip
    assert prefill <= bound and decode <= bound, (prefill, decode, yardstick)
    if config.prefix_caching:  # the same prompts again, their blocks from the prefix cache
        # Compared up to a row's first token that differs from the first pass (a near tie).
        pairs = zip(result["generated"], result["generated_again"], strict=True)
        same = [_same_prefix(a, b) for a, b in pairs]
        again = _max_diff(
            [row[:n] for row, n in zip(result["sampled_again"], same, strict=True)],
            [row[-MAX_TOKENS:][:n] for row, n in zip(ref, same, strict=True)],
        )
        assert sum(same) >= MAX_TOKENS * len(same) // 2, same  # most tokens repeat
        print(f"{config.name}: decode from cached prompts {again:.4f}")
        assert again <= bound, (again, yardstick)
    if "tbo" in result:
        stats = result["tbo"]
        kind = config.extra["additional_config"]["atom_plugin"]["tbo"]
        assert stats[kind] > 0, stats  # the split path ran
        if kind == "decode":
            assert stats["replayed"] > 0, stats  # and its graphs replayed


@pytest.mark.parametrize("model", sorted(REFERENCES))
def test_engine_that_asks_nothing_of_the_plugin_serves_with_it_installed(runs, model):
    """vLLM's own backends, the plugin installed: its platform and K3 processor in place,
    nothing else of it used."""
    _, reference = runs
    for backend in REFERENCES[model]:
        result = reference[(model, backend)]
        if isinstance(result, Exception):
            raise result
        facts = result["facts"]
        assert facts["platform"] == "AtomCudaPlatform", facts
        assert facts["attention_backends"] == [backend], facts
        assert facts["logits_processors"] == [CHANNEL_PROCESSORS["mrv2"]], facts


def test_k3_required_and_named_are_forced_under_model_runner_v2(tmp_path):
    """The channel's logits processor runs under Model Runner V2 on the GPU."""
    from tests.test_k3_e2e import run_k3_under_mrv2_on_gpu

    run_k3_under_mrv2_on_gpu(tmp_path, {})
