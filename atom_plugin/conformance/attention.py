"""Attention backends through vLLM's backend contract and the shared batch specs.

Contract items (each a finding):
- resolves: the spec's class path imports and is a vLLM `AttentionBackend`;
- name: `get_name()` equals the spec's name, and the enum member vLLM resolves
  `--attention-backend` to loads this class;
- kind: `is_mla()` matches the spec's kind;
- dtypes, block sizes, head sizes: declared, non-empty, of the types vLLM reads;
- builder signature / impl signature: they take what vLLM passes when it makes them;
- profiling run: `forward(..., attn_metadata=None, output)` returns `output` untouched;
- per case of `cases.ATTENTION_CASES` (MHA backends): the builder builds vLLM's
  `CommonAttentionMetadata`, the impl writes the new K/V (`do_kv_cache_update` where
  `forward_includes_kv_cache_update` is False) touching only the scheduled tokens' slots
  (padding slots are -1), `forward` writes `output` in place, and the scheduled rows
  equal a dense torch reference (causal, GQA) computed from the batch itself.

MLA backends get the contract items, not the output comparison: their impls need a
whole MLA layer (vLLM's own MLA tests are the place for that). The vLLM objects (base
class, enum, impl, builder, metadata) come from `atom_plugin.vllm.conformance.attention`.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import torch

from atom_plugin.conformance.cases import ATTENTION_CASES, BatchSpec, tolerance
from atom_plugin.conformance.findings import Check, Finding, MissingDependency, checks_of, load
from atom_plugin.specs import AttentionBackendSpec

HOOK = "atom_attention_backends"
BUILDER_ARGS = ("kv_cache_spec", "layer_names", "vllm_config", "device")
# vLLM's Attention layer makes an impl with these ten, positionally.
IMPL_ARGS = (
    "num_heads",
    "head_size",
    "scale",
    "num_kv_heads",
    "alibi_slopes",
    "sliding_window",
    "kv_cache_dtype",
    "logits_soft_cap",
    "attn_type",
    "kv_sharing_target_layer_name",
)


def checks_for(module, plugin: str) -> list[Check]:
    return checks_of(
        module, plugin, HOOK, lambda spec: f"attention backend {spec.name}", check_backend
    )


def check_backend(spec: AttentionBackendSpec, label: str) -> Iterator[Finding]:
    def finding(item, ok, detail="", case="-"):
        return Finding(label, item, case, ok, detail)

    try:
        from atom_plugin.vllm.conformance import attention as host
    except ImportError as exc:
        raise MissingDependency(
            f"attention backends are checked inside vLLM, which does not import: {exc}"
        ) from exc
    try:
        backend = load(spec.class_path)
    except Exception as exc:
        yield finding("resolves", False, f"{spec.class_path}: {exc!r}")
        return
    if not host.is_backend(backend):
        yield finding("resolves", False, f"{spec.class_path} is not a vLLM AttentionBackend")
        return
    yield finding("resolves", True, spec.class_path)
    yield from _contract(host, spec, backend, finding)
    if spec.kind == "mha":
        for case in ATTENTION_CASES:
            yield from _run_case(host, backend, case, finding)


def _safe(finding, item, fn) -> Finding:
    try:
        problem = fn()
    except Exception as exc:
        return finding(item, False, f"raised {exc!r}")
    return finding(item, problem is None, problem or "")


def _contract(host, spec, backend, finding) -> Iterator[Finding]:
    def name():
        if backend.get_name() != spec.name:
            return f"get_name() is {backend.get_name()!r}, the spec's name {spec.name!r}"
        return host.enum_problem(spec.name, spec.class_path, backend)

    def kind():
        want = spec.kind == "mla"
        return None if backend.is_mla() == want else f"is_mla() is {backend.is_mla()}"

    def dtypes():
        acts, caches = backend.supported_dtypes, backend.supported_kv_cache_dtypes
        if not acts or not all(isinstance(d, torch.dtype) for d in acts):
            return f"supported_dtypes must list torch dtypes, got {acts!r}"
        if "auto" not in caches:
            return f"supported_kv_cache_dtypes must include 'auto', got {caches!r}"
        return None

    def block_sizes():
        sizes = backend.get_supported_kernel_block_sizes()
        ok = sizes and all(host.is_block_size(s) for s in sizes)
        return None if ok else f"get_supported_kernel_block_sizes() gave {sizes!r}"

    def head_sizes():
        sizes = backend.get_supported_head_sizes()
        ok = all(isinstance(s, int) and s > 0 for s in sizes)
        return None if ok else f"get_supported_head_sizes() gave {sizes!r}"

    def builder_signature():
        return _takes(backend.get_builder_cls(), BUILDER_ARGS, "builder", by_keyword=True)

    def impl_signature():
        return _takes(backend.get_impl_cls(), IMPL_ARGS, "impl", by_keyword=False)

    def profiling_run():
        heads = 4
        impl, d, block = _impl(host, backend, hq=heads, hkv=heads)
        output = torch.full((3, heads, d), 7.0)
        q = torch.randn(3, heads, d)
        kv = torch.zeros(2, heads, block, 2 * d)
        returned = impl.forward(_layer(), q, q, q, kv, None, output)
        if returned is not output and returned.data_ptr() != output.data_ptr():
            return "forward returned a new tensor for the profiling run"
        if not torch.all(output == 7.0):
            return "forward with attn_metadata=None changed output"
        return None

    items = [
        ("name", name),
        ("kind", kind),
        ("dtypes", dtypes),
        ("block sizes", block_sizes),
        ("head sizes", head_sizes),
        ("builder signature", builder_signature),
        ("impl signature", impl_signature),
    ]
    if spec.kind == "mha":  # an MLA impl's forward needs a whole MLA layer
        items.append(("profiling run", profiling_run))
    for item, fn in items:
        yield _safe(finding, item, fn)


def _takes(cls, args: tuple[str, ...], what: str, *, by_keyword: bool) -> str | None:
    """Whether `cls(...)` accepts `args` by position (and, `by_keyword`, by name too)."""
    from atom_plugin.vllm.compat.signature import CallShape, call_problems, sig_from_callable

    sig = sig_from_callable(cls.__init__, bound=True)
    problems = call_problems(sig, CallShape(len(args), ()))
    if by_keyword:
        problems += call_problems(sig, CallShape(0, args))
    if problems:
        return f"{what} {cls.__name__}{sig} cannot be made the way vLLM makes it: {problems[0]}"
    return None


def _pick_head_size(backend) -> int:
    sizes = backend.get_supported_head_sizes()
    return 64 if not sizes or 64 in sizes else min(sizes)


def _pick_block_size(host, backend) -> int:
    for size in backend.get_supported_kernel_block_sizes():
        base = host.block_base(size)
        return base if base >= 16 else 16 // base * base
    return 16


def _pick_dtype(backend) -> torch.dtype:
    return torch.float32 if torch.float32 in backend.supported_dtypes else torch.bfloat16


def _layer():
    """What an impl reads from its vLLM layer on an unquantized cache: unit scales."""
    one = torch.ones((), dtype=torch.float32)
    return types.SimpleNamespace(
        _k_scale=one, _v_scale=one, _q_scale=one, _k_scale_float=1.0, _v_scale_float=1.0
    )


def _impl(host, backend, *, hq: int, hkv: int):
    d = _pick_head_size(backend)
    impl = host.make_impl(backend, hq=hq, hkv=hkv, head_size=d)
    return impl, d, _pick_block_size(host, backend)


def dense_reference(meta, query, key_cache, value_cache) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context, read from the
    expected cache through its block table (GQA by repeating kv heads)."""
    t = meta.num_actual_tokens
    hq, d = query.shape[1:]
    out = torch.zeros(t, hq, d, dtype=torch.float32)
    block = key_cache.shape[1]
    qsl = meta.query_start_loc.tolist()
    for r in range(meta.num_reqs):
        s = int(meta.seq_lens[r])
        pos = torch.arange(s)
        blocks = meta.block_table[r, pos // block].long()
        k = key_cache[blocks, pos % block].float()
        v = value_cache[blocks, pos % block].float()
        groups = hq // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        q = query[qsl[r] : qsl[r + 1]].float()
        n_q = q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        causal = torch.arange(s)[None, :] > torch.arange(s - n_q, s)[:, None]
        scores = scores.masked_fill(causal, float("-inf"))
        out[qsl[r] : qsl[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _run_case(host, backend, case: BatchSpec, finding) -> Iterator[Finding]:
    name = case.name
    try:
        impl, d, block = _impl(host, backend, hq=case.hq, hkv=case.hkv)
        dtype = _pick_dtype(backend)
        batch = case.build(d=d, block_size=block, dtype=dtype)
        meta = batch.meta
        t, rows = meta.num_actual_tokens, batch.query.shape[0]
        slots = torch.cat([meta.slot_mapping, torch.full((rows - t,), -1, dtype=torch.int64)])
        cam = host.common_metadata(meta, slots)
        builder = host.make_builder(backend, block=block, hkv=case.hkv, head_size=d, dtype=dtype)
        built = builder.build(0, cam)
        # The expected cache: the scheduled tokens' K/V at their slots, nothing else.
        expected = batch.raw_cache.clone()
        exp_k, exp_v = expected.transpose(1, 2).split(d, dim=-1)
        for i, slot in enumerate(meta.slot_mapping.tolist()):
            exp_k[slot // block, slot % block] = batch.key[i]
            exp_v[slot // block, slot % block] = batch.value[i]
        kv_cache = batch.raw_cache
        # vLLM's Attention layer hands [tokens, heads, head_size] views, padding rows included.
        if not backend.forward_includes_kv_cache_update:
            impl.do_kv_cache_update(_layer(), batch.key, batch.value, kv_cache, slots)
        output = torch.full((rows, case.hq, d), 7.0, dtype=dtype)
        returned = impl.forward(
            _layer(), batch.query, batch.key, batch.value, kv_cache, built, output
        )
    except Exception as exc:
        yield finding("runs", False, f"raised {exc!r}", name)
        return
    yield finding("runs", True, case.notes, name)
    if rows > t or not backend.forward_includes_kv_cache_update:
        changed = (kv_cache != expected).flatten(1).any(dim=1).nonzero().flatten().tolist()
        detail = "" if not changed else f"cache blocks {changed} differ from the expected writes"
        yield finding("kv write touches only scheduled slots", not changed, detail, name)
    in_place = returned is output or returned.data_ptr() == output.data_ptr()
    yield finding("writes output in place", in_place, "" if in_place else "new tensor", name)
    want = dense_reference(meta, batch.query, exp_k, exp_v)
    got = output[:t].view(t, case.hq, d).float()
    tol = tolerance(dtype)
    close = torch.allclose(got, want, **tol)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    yield finding(
        "output equals the torch reference",
        close,
        f"max |diff| {err:.3g} (atol {tol['atol']})",
        name,
    )
