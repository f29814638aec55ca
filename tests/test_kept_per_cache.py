"""Host objects kept per KV cache (`attention.kept`): the MLA decode's TMA descriptors and
its Gluon input check are made at the first launch over a layer's cache and serve every
later view of that memory."""

import pytest
import torch
from mla_cases import make_mla_batch

from atom_plugin.attention.kept import KeptPerCache, cache_key
from atom_plugin.attention.mla import cache_view


def test_the_oldest_entry_goes_past_the_limit():
    kept, made = KeptPerCache(limit=2), []

    def make(name):
        return lambda: made.append(name) or name

    assert kept.get("a", make("a")) == "a"
    assert kept.get("a", make("a again")) == "a"  # kept: not made again
    kept.get("b", make("b"))
    kept.get("c", make("c"))  # past the limit: "a" goes
    assert len(kept) == 2
    kept.get("a", make("a"))
    assert made == ["a", "b", "c", "a"]


def test_views_of_one_cache_share_a_key_and_other_memory_does_not():
    raw = torch.zeros(4, 16, 576 + 16)
    view = raw[..., 8 : 8 + 576]
    assert cache_key(view) == cache_key(raw[..., 8 : 8 + 576])
    assert cache_key(view) != cache_key(torch.zeros(4, 16, 576 + 16)[..., 8 : 8 + 576])
    assert cache_key(view) != cache_key(raw[..., :576])  # another start
    assert cache_key(view) != cache_key(view.view(torch.int32))  # another dtype


def record_calls(monkeypatch, module, name: str) -> list:
    """Patches `module.name` to note each call's arguments (and still run it)."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.fixture
def fresh_table(monkeypatch):
    table = KeptPerCache()
    monkeypatch.setattr(cache_view, "KEPT_PER_CACHE", table)
    return table


def test_triton_descriptors_made_once_per_cache(fresh_table, monkeypatch):
    pytest.importorskip("triton.tools.tensor_descriptor")
    made = record_calls(monkeypatch, cache_view, "cache_row_parts")
    b = make_mla_batch([(1, 40)], heads=16, block_size=16, dtype=torch.bfloat16)
    again = make_mla_batch([(1, 40)], heads=16, block_size=16, dtype=torch.bfloat16, seed=1)
    first = cache_view.tma_descriptors(b.kv_cache, 512, 16)
    view = b.kv_cache.as_strided(b.kv_cache.shape, b.kv_cache.stride())  # a step's new view
    assert cache_view.tma_descriptors(view, 512, 16) is first
    assert first[0].base.data_ptr() == b.kv_cache.data_ptr()
    assert cache_view.tma_descriptors(b.kv_cache, 512, 8) is not first  # another box
    assert cache_view.tma_descriptors(again.kv_cache, 512, 16) is not first
    assert len(made) == 3 and len(fresh_table) == 3


def test_gluon_descriptors_made_once_per_cache(fresh_table, monkeypatch):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from atom_plugin.attention.mla.gluon import common

    made = record_calls(monkeypatch, common, "tma_descriptor")
    b = make_mla_batch([(1, 128)], heads=16, block_size=64, dtype=torch.bfloat16)
    first = common.cache_descriptors(b.kv_cache, 512)
    assert common.cache_descriptors(b.kv_cache[:], 512) is first
    assert len(made) == 2  # latent and rope, once
    assert common.cache_descriptors(b.kv_cache, 512, 128) is not first  # other boxes
    assert len(made) == 4 and len(fresh_table) == 2


def test_gluon_input_check_runs_once_per_cache(fresh_table, monkeypatch):
    """The decode checks that a layer's query and cache fit the Gluon kernel at its first
    launch over that cache; later layer calls over the same cache reuse the answer."""
    from atom_plugin.attention.mla import triton as mla_triton

    checked = record_calls(monkeypatch, mla_triton, "tma_problems")
    monkeypatch.setattr(mla_triton, "gluon_mla_problems", lambda device, layout: [])
    b = make_mla_batch([(1, 128)], heads=16, block_size=64, dtype=torch.bfloat16)
    q = b.q[..., :512]
    for _ in range(3):
        assert mla_triton._gluon_input_problems(q, b.kv_cache[:], 512, False) == ()
    assert len(checked) == 1
    fp32 = q.float()  # another query dtype: checked again, and found not to fit
    assert "is not the query's" in " ".join(
        mla_triton._gluon_input_problems(fp32, b.kv_cache, 512, False)
    )
    assert len(checked) == 2
