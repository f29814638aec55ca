"""Two-batch overlap inside a real vLLM engine (the CPU build): TBO on equals TBO off.

Each engine runs in-process in a fresh subprocess (`tests.engine.generate`), so
every run of the same config sees the same batches. 13 prompts
of different lengths and a 32-token step budget give decode steps of odd
request counts and chunked-prefill steps that mix a prefill chunk with decodes
and cut through a request. Each run reports the steps that split
(`atom_tbo_stats` on every worker), and a mode whose steps never split fails.
"""

from __future__ import annotations

import pytest

from tests.engine import engine_env, generate

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Two-batch overlap hides communication behind computation",
    " ".join(str(i) for i in range(40)),
    *[f"word {i} " * (i % 5 + 1) for i in range(9)],
]
GREEDY = {"max_tokens": 10, "temperature": 0.0}
SPLITS_EVERYWHERE = {"tbo_decode_min_requests": 3, "tbo_prefill_min_tokens": 2}

# model fixture, attention backend, block size, extra LLM arguments
MODELS = {
    "llama-atom": ("tiny_llama", "atom_aiter", 32, {}),
    "llama-vllm-cpu": ("tiny_llama", None, 32, {}),
    "moe-atom": ("tiny_moe", "atom_aiter", 32, {}),
    # vLLM-cpu's rotary op is batch-dependent on MLA shapes (docs/mla.md): native rope.
    "mla-atom": (
        "tiny_deepseek",
        "atom_aiter",
        16,
        {"compilation_config": {"custom_ops": ["none"]}},
    ),
}


def llm_kwargs(model, backend, block_size, extra, tbo: str | None) -> dict:
    kwargs = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "block_size": block_size,
        "max_num_batched_tokens": 32,
        "enable_chunked_prefill": True,
        **extra,
    }
    if backend:
        kwargs["attention_config"] = {"backend": backend}
    if tbo:
        kwargs["additional_config"] = {"atom_plugin": {"tbo": tbo, **SPLITS_EVERYWHERE}}
    return kwargs


def run_tbo(
    request, name: str, tbo: str | None, env: dict | None = None, prompts=PROMPTS, **overrides
) -> dict:
    """One engine run of model `name` (`MODELS`) with `tbo` (None: TBO off)."""
    fixture, backend, block_size, extra = MODELS[name]
    model = request.getfixturevalue(fixture)
    kwargs = {**llm_kwargs(model, backend, block_size, extra, tbo), **overrides}
    return generate(kwargs, prompts, GREEDY, env=env, rpc=("atom_tbo_stats",) if tbo else ())


@pytest.fixture(scope="session")
def tbo_off_tokens():
    """`tbo_off_tokens(request, name)`: model `name`'s tokens with TBO off, one run each."""
    runs: dict[str, list] = {}

    def tokens(request, name: str) -> list:
        if name not in runs:
            runs[name] = run_tbo(request, name, None)["tokens"]
        return runs[name]

    return tokens


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tbo", ["prefill", "decode", "all"])
def test_tbo_on_equals_off(request, tbo_off_tokens, name, tbo):
    run = run_tbo(request, name, tbo)
    [stats] = run["rpc"]["atom_tbo_stats"]
    print(f"TBO steps, {name}, tbo={tbo}: {stats}")  # shown with pytest -rP
    assert f"two-batch overlap {tbo}" in run["log"]
    assert run["tokens"] == tbo_off_tokens(request, name)
    splits = {"prefill": {"prefill"}, "decode": {"decode"}, "all": {"prefill", "decode"}}[tbo]
    for kind in ("prefill", "decode"):
        assert (stats[kind] > 0) == (kind in splits), stats
    assert (stats["straddled"] > 0) == ("prefill" in splits), stats


def test_metadata_cut_apart_from_the_slices_is_caught(request, tbo_off_tokens, engine_faults):
    """ATOM's bug: one backend's micro-batch metadata cut one request off the slices."""
    run = run_tbo(request, "llama-atom", "decode", env=engine_env(**engine_faults(miscut=True)))
    [stats] = run["rpc"]["atom_tbo_stats"]
    assert stats["decode"] > 0
    assert run["tokens"] != tbo_off_tokens(request, "llama-atom")


def test_prefix_cache_reader_of_blocks_written_now_keeps_the_step_whole(request):
    """Three prompts with one 70-token prefix in one step: the second and third hit the
    first's two full blocks, which that step is still computing, so no rank splits it."""
    prefix = " ".join(str(i) for i in range(70))
    prompts = [prefix, prefix + " a", prefix + " b c"]

    def run(tbo):
        return run_tbo(
            request,
            "llama-atom",
            tbo,
            prompts=prompts,
            max_num_batched_tokens=256,
            enable_prefix_caching=True,
        )

    on = run("all")
    [stats] = on["rpc"]["atom_tbo_stats"]
    assert stats["vetoed"] > 0 and stats["prefill"] == 0, stats
    assert stats["decode"] > 0, stats
    assert on["tokens"] == run(None)["tokens"]


@pytest.fixture(scope="module")
def graph_buckets(engine_faults):
    """The CPU build records no CUDA graphs: the split request graphs of buckets 4, 8 and
    16 run on `RerunGraphs`, whose replay re-runs the recorded step on what it captured."""
    return engine_env(**engine_faults(rerun_graphs=[4, 8, 16]))


@pytest.mark.parametrize("name", ["llama-atom", "mla-atom"])
def test_split_decode_graph_replays_equal_tbo_off(request, tbo_off_tokens, graph_buckets, name):
    """Decode steps pad to a bucket and replay its split graph, recorded on the bucket's
    first step; later steps with other request counts reuse what it captured."""
    run = run_tbo(request, name, "decode", env=graph_buckets)
    [stats] = run["rpc"]["atom_tbo_stats"]
    print(f"TBO steps, {name}, split graphs: {stats}")
    assert "split decode buckets [4, 8, 16] replay split request graphs" in run["log"]
    assert stats["captured"] >= 1, stats
    assert stats["replayed"] > stats["captured"], stats  # and replayed after its first step
    assert run["tokens"] == tbo_off_tokens(request, name)


def test_split_decode_graphs_need_the_plugins_backends(request, tbo_off_tokens, graph_buckets):
    """With vLLM's own CPU backend the split decode steps stay eager, and the log says why."""
    run = run_tbo(request, "llama-vllm-cpu", "decode", env=graph_buckets)
    [stats] = run["rpc"]["atom_tbo_stats"]
    assert "split decode steps run eagerly: attention backend CPU_ATTN" in run["log"]
    assert stats["replayed"] == 0 and stats["decode"] > 0, stats
    assert run["tokens"] == tbo_off_tokens(request, "llama-vllm-cpu")
