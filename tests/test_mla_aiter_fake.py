"""The AITER MLA calls (ATOM_PLUGIN_KERNELS=aiter) through the fake `aiter` module,
which checks AITER's documented shapes and layouts and computes from the page lists it
is handed; results must equal the torch reference. No ROCm run happens here."""

import sys
from pathlib import Path

import pytest
import torch
from mla_cases import make_mla_batch, tolerance

from atom_plugin.attention.mla import ops as mla_ops
from atom_plugin.attention.mla.reference import mla_decode_reference, write_mla_kv_reference

FAKE = Path(__file__).parent / "fake_aiter"


@pytest.fixture
def fake_aiter(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    import aiter
    import aiter.mla

    missing = [
        n
        for n in ("get_mla_metadata_info_v1", "get_mla_metadata_v1", "concat_and_cache_mla")
        if getattr(aiter, n, None) is not getattr(aiter.mla, n)
    ]
    assert not missing, f"tests/fake_aiter/aiter/__init__.py must re-export aiter.mla's {missing}"
    monkeypatch.setenv("ATOM_PLUGIN_KERNELS", "aiter")
    aiter.mla.CALLS.clear()
    return aiter.mla


REQS = [(1, 1), (1, 15), (1, 16), (1, 17), (3, 40), (2, 2)]


@pytest.mark.parametrize("block_size", [1, 16])
def test_aiter_decode_matches_reference(fake_aiter, block_size):
    b = make_mla_batch(REQS, heads=16, block_size=block_size, dtype=torch.bfloat16, pad_rows=1)
    T = b.q.shape[0]
    want = torch.zeros(T, 16, 512, dtype=torch.bfloat16)
    want_lse = mla_decode_reference(b.q, b.kv_cache, b.meta, scale=0.1, output=want)
    out = torch.zeros_like(want)
    lse = mla_ops.mla_decode(b.q, b.kv_cache, b.meta, scale=0.1, output=out)
    assert fake_aiter.CALLS == ["get_mla_metadata_info_v1", "get_mla_metadata_v1", "mla_decode_fwd"]
    torch.testing.assert_close(out, want, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))


def test_aiter_plan_page_lists(fake_aiter):
    from atom_plugin.attention.mla.aiter import build_aiter_mla_plan

    b = make_mla_batch([(1, 17), (2, 32), (1, 1)], heads=16, block_size=16, pad_rows=1)
    plan = build_aiter_mla_plan(
        b.meta, num_heads=16, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=16
    )
    assert plan.kv_indptr.tolist() == [0, 2, 4, 5, 5]
    assert plan.kv_last_page_lens.tolist() == [1, 16, 1, 0]
    table = b.meta.block_table
    want = [*table[0, :2].tolist(), *table[1, :2].tolist(), int(table[2, 0])]
    assert plan.kv_indices.tolist() == want
    assert plan.qo_indptr.tolist() == [0, 1, 3, 4, 4] and plan.max_seqlen_q == 2


def test_aiter_cache_write(fake_aiter):
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = torch.randn(6, 512, generator=gen), torch.randn(6, 1, 64, generator=gen)
    slots = torch.tensor([5, -1, 17, 0, -1, 30])
    ref = torch.zeros(3, 16, 576)
    got = torch.zeros(3, 16, 576)
    write_mla_kv_reference(kv_c, k_pe.squeeze(1), ref, slots)
    mla_ops.write_mla_kv(kv_c, k_pe, got, slots)
    assert fake_aiter.CALLS == ["concat_and_cache_mla"]
    assert torch.equal(got, ref)


def test_aiter_rejects_non_deepseek_shapes(fake_aiter):
    b = make_mla_batch([(1, 4)], heads=16, lora=64, rope=16, dtype=torch.bfloat16)
    out = torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_lora_rank=64"):
        mla_ops.mla_decode(b.q, b.kv_cache, b.meta, scale=0.1, output=out, kv_lora_rank=64)


def test_aiter_plans_once_per_step(fake_aiter):
    """The work split is planned with the step; each layer's decode only runs it."""
    from atom_plugin.attention.mla.aiter import AiterMLAPlan
    from atom_plugin.attention.mla.gluon.probe import MLAStepLayout
    from atom_plugin.attention.mla.plan import plan_mla_decode

    b = make_mla_batch(REQS, heads=16, block_size=16, dtype=torch.bfloat16)
    T = b.q.shape[0]
    layout = MLAStepLayout(torch.bfloat16, 16)
    plan = plan_mla_decode(b.meta, T, 16, kv_dtype=torch.bfloat16, layout=layout)
    assert isinstance(plan, AiterMLAPlan)
    assert fake_aiter.CALLS == ["get_mla_metadata_info_v1", "get_mla_metadata_v1"]
    out = torch.zeros(T, 16, 512, dtype=torch.bfloat16)
    for _layer in range(2):
        mla_ops.mla_decode(b.q, b.kv_cache, b.meta, plan, scale=0.1, output=out)
    assert fake_aiter.CALLS[2:] == ["mla_decode_fwd", "mla_decode_fwd"]


def test_aiter_refuses_token_kv_lens_when_planning(fake_aiter):
    from atom_plugin.attention.mla.gluon.probe import MLAStepLayout
    from atom_plugin.attention.mla.plan import plan_mla_decode

    b = make_mla_batch([(2, 9)], heads=16, block_size=16, dtype=torch.bfloat16)
    lens = torch.tensor([4, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="per-token key counts"):
        plan_mla_decode(
            b.meta,
            2,
            16,
            kv_dtype=torch.bfloat16,
            layout=MLAStepLayout(torch.bfloat16, 16),
            token_kv_lens=lens,
        )
    assert fake_aiter.CALLS == []
