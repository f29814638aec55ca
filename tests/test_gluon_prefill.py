"""The Hopper Gluon MHA prefill prototype (`mha.gluon_prefill`): its input checks here
(they import no Gluon), the kernel against the torch reference and the Triton prefill on
a Hopper GPU only (`gpu`; Gluon kernels do not run in Triton's CPU interpreter)."""

import pytest
import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha import reference
from atom_plugin.attention.mha.gluon_prefill import gluon_paged_prefill, gluon_problems
from atom_plugin.attention.mha.params import AttentionParams

PAGE = 16


def make_batch(reqs, hq=32, hkv=8, d=128, dtype=torch.bfloat16, layout="flash", device="cpu"):
    """[(query_len, seq_len)] over shuffled pages of a cache whose unused slots hold NaN;
    layout 'flash' is [blocks, page, hkv, d] contiguous, 'pool' the benchmark's
    [blocks, hkv, page, 2d] split into K and V."""
    torch.manual_seed(0)
    per = [-(-s // PAGE) for _, s in reqs]
    blocks = sum(per) + 3
    if layout == "flash":
        k = torch.randn(blocks, PAGE, hkv, d, device=device).to(dtype)
        v = torch.randn(blocks, PAGE, hkv, d, device=device).to(dtype)
    else:
        raw = torch.randn(blocks, hkv, PAGE, 2 * d, device=device).to(dtype)
        k, v = raw.transpose(1, 2).split(d, dim=-1)
    perm = torch.randperm(blocks)[: sum(per)]
    table = torch.zeros(len(reqs), max(per), dtype=torch.int32)
    start = 0
    for i, ((_, s), n) in enumerate(zip(reqs, per, strict=True)):
        table[i, :n] = perm[start : start + n].int()
        last, used = int(perm[start + n - 1]), s - (n - 1) * PAGE
        k[last, used:] = float("nan")
        v[last, used:] = float("nan")
        start += n
    qsl = [0]
    for q, _ in reqs:
        qsl.append(qsl[-1] + q)
    meta = PagedAttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=qsl[-1],
        max_query_len=max(q for q, _ in reqs),
        max_seq_len=max(s for _, s in reqs),
        num_decodes=0,
        num_decode_tokens=0,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=device),
    )
    q = (torch.randn(qsl[-1], hq, d, device=device) * 0.5).to(dtype)
    return q, k, v, meta


PARAMS = AttentionParams(scale=128**-0.5)


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(params=AttentionParams(scale=0.1, sliding_window=128)), "sliding_window"),
        (dict(params=AttentionParams(scale=0.1, sinks=torch.zeros(32))), "sinks"),
        (dict(params=AttentionParams(scale=0.0)), "scale"),
        (dict(cache_dtype=torch.float8_e4m3fn), "fp8"),
        (dict(d=96), "head size 96"),
        (dict(d=256), "head size 256"),
        (dict(hq=12, hkv=8), "12 query heads over 8 kv heads"),
    ],
)
def test_unsupported_inputs_raise_naming_them(change, named):
    d = change.get("d", 128)
    q, k, v, meta = make_batch([(20, 40)], hq=change.get("hq", 32), hkv=change.get("hkv", 8), d=d)
    if "cache_dtype" in change:
        k, v = k.to(change["cache_dtype"]), v.to(change["cache_dtype"])
    with pytest.raises(ValueError, match=named):
        gluon_paged_prefill(q, k, v, meta, change.get("params", PARAMS), torch.empty_like(q))


def test_supported_inputs_have_no_problems():
    for layout in ("flash", "pool"):
        q, k, v, _ = make_batch([(20, 40)], layout=layout)
        assert gluon_problems(q, k, v, PARAMS, torch.empty_like(q)) == []


def test_strided_cache_rows_are_named():
    q, k, v, meta = make_batch([(20, 40)])
    k2 = torch.zeros(k.shape[0], PAGE, 8, 256, dtype=k.dtype)[..., ::2]
    with pytest.raises(ValueError, match="strides"):
        gluon_paged_prefill(q, k2, k2, meta, PARAMS, torch.empty_like(q))


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


CASES = [
    [(8192, 8192)],  # one long fresh prompt
    [(1, 1), (7, 7), (100, 100), (129, 129), (1000, 1000)],  # lengths off the tile
    [(64, 300), (250, 1000), (1, 77), (333, 4000)],  # chunked: new tokens over a cached prefix
]


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (compute capability 9.x)")
@pytest.mark.parametrize("reqs", CASES, ids=["fresh8k", "ragged", "chunked"])
@pytest.mark.parametrize("layout", ["flash", "pool"])
@pytest.mark.parametrize(
    "config",
    [{}, {"OVERLAP": False}, {"BLOCK_N": 64, "STAGES": 3}, {"WS": True}],
    ids=["n128-overlap", "n128-sequential", "n64-s3-overlap", "n128-warp-specialized"],
)
def test_gpu_matches_reference_and_triton(reqs, layout, config):
    from atom_plugin.attention.mha.triton_prefill import paged_prefill

    q, k, v, meta = make_batch(reqs, layout=layout, device="cuda")
    got = gluon_paged_prefill(q, k, v, meta, PARAMS, torch.zeros_like(q), config=config)
    tri = paged_prefill(q, k, v, meta, PARAMS, torch.zeros_like(q))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), tri.float(), atol=2e-2, rtol=2e-2)
    if sum(s for _, s in reqs) <= 6000:  # the reference is slow on long prompts
        want = reference.paged_attention(q, k, v, meta, PARAMS, torch.zeros_like(q))
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (compute capability 9.x)")
@pytest.mark.parametrize(
    "hq, hkv, d, dtype", [(8, 8, 128, torch.float16), (16, 2, 64, torch.bfloat16)]
)
@pytest.mark.parametrize("ws", [False, True])
def test_gpu_other_groups_heads_dtypes(hq, hkv, d, dtype, ws):
    q, k, v, meta = make_batch([(300, 500), (77, 77)], hq, hkv, d, dtype, device="cuda")
    params = AttentionParams(scale=d**-0.5)
    got = gluon_paged_prefill(q, k, v, meta, params, torch.zeros_like(q), config={"WS": ws})
    want = reference.paged_attention(q, k, v, meta, params, torch.zeros_like(q))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("config", [{"BLOCK_N": 32}, {"STAGE": 2}])
def test_bad_configs_raise(config):
    q, k, v, meta = make_batch([(20, 40)])
    with pytest.raises(ValueError, match="config"):
        gluon_paged_prefill(q, k, v, meta, PARAMS, torch.empty_like(q), config=config)
