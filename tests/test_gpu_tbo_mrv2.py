"""Two-batch overlap on Model Runner V2 inside vLLM's GPU engine (H200; skipped without CUDA).

`tbo: decode`, `prefill` and `all`, CUDA graphs on and `--enforce-eager`, on an MHA
MoE model (tiny Mixtral, `ATOM_AITER`) and an MLA MoE model (tiny DeepSeek-V2 with
MoE layers, `ATOM_AITER_MLA`), prefix caching on. Every configuration runs a real
engine in a process of its own (as tests/test_gpu_engine.py does), generates greedily
with the sampled tokens' logprobs and scores its sequences teacher-forced; then the
plugin with TBO off and vLLM's two reference backends score the same sequences. TBO
on must equal TBO off within tests/test_gpu_engine.py's bound: TOLERANCE_FACTOR times
the distance between vLLM's two backends, plus LOGPROB_FLOOR. Each engine reports the
steps it split (`collective_rpc("atom_tbo_stats")`): every mode's kind of split ran,
split decode graphs were recorded and replayed with graphs on (never eagerly), and
the prompts that share a prefix in the first step kept that step whole (`vetoed`).

    python3 -m pytest -q tests/test_gpu_tbo_mrv2.py      # on the H200, vLLM's CUDA build
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from tests.engine import IN_PROCESS_ENGINE, engine_env
from tests.test_gpu_engine import ENGINE as GPU_ENGINE
from tests.test_gpu_engine import (
    LOGPROB_FLOOR,
    MAX_TOKENS,
    PROMPT_LENS,
    REFERENCES,
    TOLERANCE_FACTOR,
    _max_diff,
    _run,
)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

ENGINE = {
    **GPU_ENGINE,
    "enable_prefix_caching": True,
    # chunked prefill cuts prompts across steps, so prefill steps mix with decodes and a
    # request straddles the micro-batches' cut
    "max_num_batched_tokens": 256,
}
BACKENDS = {"mha": "ATOM_AITER", "mla": "ATOM_AITER_MLA"}
THRESHOLDS = {"tbo_decode_min_requests": 4, "tbo_prefill_min_tokens": 32}
MODES = ("decode", "prefill", "all")
SHARED_PREFIX = 128  # two 64-token blocks (MLA) or eight 16-token ones: hits in step one


@dataclass(frozen=True)
class TboConfig:
    model: str  # "mha" or "mla"
    mode: str  # a `tbo` value
    eager: bool

    @property
    def name(self) -> str:
        return f"{self.model}-{self.mode}-{'eager' if self.eager else 'graphs'}"

    def llm(self, models: dict) -> dict:
        return {
            **ENGINE,
            "model": models[self.model],
            "attention_config": {"backend": BACKENDS[self.model]},
            "enforce_eager": self.eager,
            "additional_config": {"atom_plugin": {"tbo": self.mode, **THRESHOLDS}},
        }


CONFIGS = [TboConfig(m, mode, eager) for m in BACKENDS for mode in MODES for eager in (False, True)]


def _prompts(vocab: int) -> list[list[int]]:
    """Three prompts sharing a prefix, first (one step admits all three: the second and
    third hit blocks the first is still computing), then test_gpu_engine's lengths."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(SHARED_PREFIX)]
    shared = [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (8, 5, 11)]
    return shared + [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.models.tiny_deepseek import build_tiny_deepseek
    from tests.models.tiny_moe import build_tiny_moe

    mha = build_tiny_moe(tmp_path_factory.mktemp("gpu-moe"))
    # DeepSeek's widths (vLLM's GPU MLA prefill takes qk_nope 128 / v 128), MoE from layer 1
    mla = build_tiny_deepseek(
        tmp_path_factory.mktemp("gpu-deepseek-moe"),
        num_heads=32,
        nope_dim=128,
        v_dim=128,
        moe_from_layer=1,
    )
    return {"mha": str(mha), "mla": str(mla)}


def _attempt(name, llm, generate, score, tbo):
    env = engine_env(**IN_PROCESS_ENGINE, ATOM_PLUGIN_DISABLE=None)
    try:
        return _run(name, llm, env, generate, score, tbo)
    except AssertionError as failure:  # reported by the configuration's own test
        return failure


@pytest.fixture(scope="module")
def runs(models):
    """`runs(model)`: every TBO configuration of `model`, then the plugin with TBO off and
    vLLM's two reference backends scoring the sequences those configurations made. Each
    model's engines start only when one of its tests asks (a `-k` selection of one model
    runs that model's engines alone)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    done: dict[str, tuple[dict, dict]] = {}

    def run_model(model: str) -> tuple[dict, dict]:
        if model in done:
            return done[model]
        prompts = _prompts(500)
        configs = [c for c in CONFIGS if c.model == model]

        def generate(c):
            return _attempt(c.name, c.llm(models), prompts, None, True)

        with ThreadPoolExecutor(len(configs)) as pool:
            tbo = dict(zip((c.name for c in configs), pool.map(generate, configs), strict=True))
        ran = [c for c in configs if not isinstance(tbo[c.name], Exception)]
        sequences = [s for c in ran for s in tbo[c.name]["sequences"]]

        def score(scorer):
            if not sequences:
                return scorer, AssertionError(f"no {model} TBO configuration ran")
            backend = BACKENDS[model] if scorer == "tbo-off" else scorer
            llm = {**ENGINE, "model": models[model], "attention_config": {"backend": backend}}
            return scorer, _attempt(f"{model}-{scorer}", llm, None, sequences, False)

        scorers = ("tbo-off", *REFERENCES[model])  # TBO off: the plugin's backend, graphs on
        with ThreadPoolExecutor(len(scorers)) as pool:
            done[model] = tbo, dict(pool.map(score, scorers))
        return done[model]

    return run_model


def _rows(runs, config: TboConfig, scorer: str) -> list[list[float]]:
    """`scorer`'s teacher-forced scores of `config`'s sequences."""
    tbo, scored = runs(config.model)
    result = scored[scorer]
    if isinstance(result, Exception):
        raise result
    start = 0
    for c in CONFIGS:
        if c.model != config.model or isinstance(tbo[c.name], Exception):
            continue
        n = len(tbo[c.name]["sequences"])
        if c == config:
            return result["scored"][start : start + n]
        start += n
    raise KeyError(config.name)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_tbo_on_mrv2_equals_tbo_off_and_splits(runs, config):
    result = runs(config.model)[0][config.name]
    if isinstance(result, Exception):
        raise result
    facts = result["facts"]
    assert facts["attention_backends"] == [BACKENDS[config.model]], facts
    assert facts["runner"] == "atom_plugin.vllm.tbo.mrv2_runner.AtomTboMRV2ModelRunner", facts
    assert ("NONE" in facts["cudagraph_mode"]) == config.eager, facts
    off = _rows(runs, config, "tbo-off")
    ref_name, second_name = REFERENCES[config.model]
    yardstick = _max_diff(_rows(runs, config, second_name), _rows(runs, config, ref_name))
    bound = TOLERANCE_FACTOR * yardstick + LOGPROB_FLOOR
    prefill = _max_diff(result["scored"], off)  # TBO's teacher-forced scores
    decode = _max_diff(result["sampled"], [row[-MAX_TOKENS:] for row in off])  # sampled
    stats = result["tbo"]
    print(f"{config.name}: prefill {prefill:.4f} decode {decode:.4f} bound {bound:.4f} {stats}")
    assert prefill <= bound and decode <= bound, (prefill, decode, yardstick)
    if config.mode in ("decode", "all"):
        assert stats["decode"] > 0, stats
    if config.mode in ("prefill", "all"):
        assert stats["prefill"] > 0 and stats["straddled"] > 0, stats
        assert stats["vetoed"] > 0, stats  # the shared-prefix step stayed whole
    if config.mode == "prefill":
        assert stats["decode"] == 0, stats
    if config.mode == "decode":
        assert stats["prefill"] == 0, stats
    if config.mode != "prefill" and not config.eager:
        assert stats["captured"] > 0 and stats["replayed"] > stats["captured"], stats
    else:
        assert stats["captured"] == stats["replayed"] == 0, stats


def test_k3_channel_beside_tbo_under_model_runner_v2(tmp_path):
    """The K3 channel's logits processor forces required and named calls in an engine whose
    decode steps split (eagerly: the scripted model's backend is vLLM's own)."""
    from tests.test_k3_e2e import run_k3_under_mrv2_on_gpu

    tbo = {"atom_plugin": {"tbo": "all", "tbo_decode_min_requests": 3}}
    result = run_k3_under_mrv2_on_gpu(tmp_path, tbo)
    [stats] = result["tbo"]
    assert stats["decode"] > 0, stats  # the three requests' decode steps split
