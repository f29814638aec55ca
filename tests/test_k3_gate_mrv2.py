"""The MRV2 processor: speculative verification rows, device-side state advance.

Inputs are vLLM's own MRV2 classes (RequestState, LogitsProcRequestState,
LogitsContext) on CPU; `vllm.v1.worker.cpu.shm` is vLLM's own CPU adaptation
of MRV2 buffers. vLLM's Triton-only staged-write kernel cannot run here, so the
committed ids are written into the device tensors directly, as the runner's
post-processing does after each step. Every row is checked against the pure
Python RequiredChannel walked over the committed ids plus the row's drafts.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models.scripted_gpt2 import build_tokenizer, ids

from atom_plugin.k3.channel_for import channel_extra_args, required_channel_for
from atom_plugin.k3.required_channel import UNCONSTRAINED

pytest.importorskip("vllm")

import vllm.v1.worker.cpu.shm  # noqa: E402, F401  (vLLM's CPU buffers for MRV2)
from vllm.config import SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor.interface import (  # noqa: E402
    LogitsContext,
    LogitsProcRequestState,
)
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

from atom_plugin.vllm.k3.logits_mrv2 import AtomK3LogitsProcessorMRV2  # noqa: E402
from tests.test_k3_gate_core import expect_row  # noqa: E402

DRAFTS = 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("k3tok"))


class Batch:
    """Real MRV2 request state plus the processor under test."""

    def __init__(self, tokenizer, impl):
        self.vocab = len(tokenizer)
        self.states = RequestState(8, 64, 64, DRAFTS, self.vocab, torch.device("cpu"))
        config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_model_len=64, is_encoder_decoder=False
            )
        )
        self.proc = AtomK3LogitsProcessorMRV2(
            config, LogitsProcRequestState.from_request_state(self.states)
        )
        self.proc.core.impl = impl
        self.tokens: dict[int, list[int]] = {}

    def add(self, name, prompt, params):
        self.states.add_request(name, len(prompt), prompt, 0, 32)
        slot = self.states.req_id_to_index[name]
        self.tokens[slot] = list(prompt)
        self.commit(slot, [])
        wants = self.proc.add_request(slot, params)
        return slot, wants

    def commit(self, slot, new):
        """What the runner's post-processing leaves on the device after a step."""
        self.tokens.setdefault(slot, [])
        self.tokens[slot] += new
        all_ids = self.tokens[slot] or [0]
        self.states.all_token_ids.gpu[slot, : len(all_ids)] = torch.tensor(all_ids)
        self.states.total_len.gpu[slot] = len(self.tokens[slot])

    def step(self, drafts_by_slot, seed=0):
        """One verify step: each slot's rows are its last id then its drafts."""
        self.proc.apply_staged_writes()
        slots = list(drafts_by_slot)
        row_slot, local, inputs = [], [], []
        for slot in slots:
            for j, token in enumerate([self.tokens[slot][-1], *drafts_by_slot[slot]]):
                row_slot.append(slot)
                local.append(j)
                inputs.append(token)
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(len(row_slot), self.vocab, generator=gen)
        logits[:, 2] = float("-inf")
        logits[:, 3] = float("nan")
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(row_slot, dtype=torch.int32),
            idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.tensor(local, dtype=torch.int32),
            input_ids=torch.tensor(inputs, dtype=torch.int32),
            pos=torch.arange(len(row_slot), dtype=torch.int64),
            seq_lens_upper_bound_np=np.array([64] * len(slots), dtype=np.int32),
        )
        before = logits.clone()
        after = self.proc.apply(logits, ctx)
        return before, after, row_slot, local


def check_step(batch, channels, drafts_by_slot, prompt_lens, seed=0):
    before, after, row_slot, local = batch.step(drafts_by_slot, seed)
    for row, (slot, j) in enumerate(zip(row_slot, local, strict=True)):
        channel = channels.get(slot)
        if channel is None:
            assert torch.equal(after[row].view(torch.int32), before[row].view(torch.int32))
            continue
        output = batch.tokens[slot][prompt_lens[slot] :]
        state = channel.walk(output + drafts_by_slot[slot][:j])
        expect_row(after[row], before[row], channel, state)


IMPLS = ["torch", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
def test_drafts_that_follow_and_that_break_the_channel(tokenizer, impl):
    channel = required_channel_for(tokenizer)
    t = dict(
        zip(
            ["close", "resp", "sep", "open", "tools", "sure", "hi", "eom"],
            ids(
                tokenizer,
                "<|close|>",
                "response",
                "<|sep|>",
                "<|open|>",
                "tools",
                "Sure",
                "Hi",
                "<|end_of_msg|>",
            ),
            strict=True,
        )
    )
    batch = Batch(tokenizer, impl)
    # The prompt's earlier turn ends with the trigger: it must not count.
    prompt = [t["hi"], t["close"], t["resp"], t["sep"], t["open"]]
    k3, wants = batch.add("k3", prompt, SamplingParams(extra_args=channel_extra_args(channel)))
    assert wants
    plain, wants_plain = batch.add("plain", prompt, SamplingParams())
    assert not wants_plain
    stop = SamplingParams(stop_token_ids=[t["hi"]], extra_args=channel_extra_args(channel))
    stopped, _ = batch.add("stop", prompt, stop)
    channels = {k3: channel, stopped: channel.ending_on([t["hi"]])}
    lens = {k3: len(prompt), stopped: len(prompt), plain: len(prompt)}
    batch.commit(k3, [t["sure"], t["close"], t["resp"]])
    batch.commit(stopped, [t["sure"]])
    # k3's drafts follow the channel (<|sep|> then the forced ids); stop's break it.
    drafts = {
        k3: [t["sep"], t["open"], t["tools"]],
        plain: [t["eom"], t["hi"], t["sep"]],
        stopped: [t["close"], t["eom"], t["sep"]],
    }
    check_step(batch, channels, drafts, lens)
    # The verifier accepted k3's first two drafts plus a bonus; stop's first only.
    batch.commit(k3, [t["sep"], t["open"], t["tools"]])
    batch.commit(stopped, [t["close"]])
    drafts = {k3: [t["sep"], t["open"]], plain: [t["sure"]], stopped: [t["resp"], t["sep"]]}
    check_step(batch, channels, drafts, lens, seed=1)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_steps_match_the_state_machine(tokenizer, data):
    channel = required_channel_for(tokenizer)
    vocab_words = ["<|close|>", "response", "<|sep|>", "<|open|>", "tools", "call", "Sure"]
    pool = ids(tokenizer, *vocab_words)
    batch = Batch(tokenizer, "torch")
    prompt = ids(tokenizer, "Hi", "<|close|>", "response", "<|sep|>")
    slot, _ = batch.add("r", prompt, SamplingParams(extra_args=channel_extra_args(channel)))
    for step in range(data.draw(st.integers(1, 6))):
        drafts = data.draw(st.lists(st.sampled_from(pool), max_size=DRAFTS))
        check_step(batch, {slot: channel}, {slot: drafts}, {slot: len(prompt)}, seed=step)
        accepted = data.draw(st.integers(0, len(drafts)))
        batch.commit(slot, drafts[:accepted] + [data.draw(st.sampled_from(pool))])


def test_open_channel_is_forgotten_and_then_costs_no_launch(tokenizer):
    channel = required_channel_for(tokenizer)
    batch = Batch(tokenizer, "torch")
    prompt = ids(tokenizer, "Hi")
    slot, _ = batch.add("r", prompt, SamplingParams(extra_args=channel_extra_args(channel)))
    output = ids(tokenizer, "Sure", "<|close|>", "response", "<|sep|>", *channel_opening())
    batch.commit(slot, output)
    assert channel.walk(output) == UNCONSTRAINED
    batch.proc.apply_staged_writes()
    assert batch.proc.core.is_live([slot])
    for _ in range(2):
        before, after, *_ = batch.step({slot: []})
        assert torch.equal(after.view(torch.int32), before.view(torch.int32))
    # Learned from the previous step's state snapshot, without a sync.
    assert not batch.proc.core.is_live([slot])
    # The slot is reused by a new request: it is constrained again from START.
    batch.states.remove_request("r")
    again, _ = batch.add("again", prompt, SamplingParams(extra_args=channel_extra_args(channel)))
    batch.proc.apply_staged_writes()
    assert again == slot and batch.proc.core.is_live([slot])
    check_step(batch, {slot: channel}, {slot: []}, {slot: len(prompt)})


def channel_opening():
    return ["<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="']


def named_channel_of(tokenizer, *name_pieces):
    channel = required_channel_for(tokenizer)
    return channel.extended(ids(tokenizer, *name_pieces, '"'))


@pytest.mark.parametrize("impl", IMPLS)
def test_named_required_and_plain_rows_share_one_launch(tokenizer, impl, monkeypatch):
    import atom_plugin.k3.processor_core as core_module

    launched = []

    def counting(*args, **kwargs):
        launched.append(core_module_apply(*args, **kwargs))
        return launched[-1]

    core_module_apply = core_module.apply_required_channel
    monkeypatch.setattr(core_module, "apply_required_channel", counting)
    channel = required_channel_for(tokenizer)
    weather = named_channel_of(tokenizer, "get_weather")
    longer = named_channel_of(tokenizer, "get_weather", "city")  # shares the first name id
    own_ids = named_channel_of(tokenizer, "tools", "response")  # the channel's own ids
    t = dict(zip(["close", "resp", "sep", "open", "tools", "sure", "weather", "eom", "city"],
                 ids(tokenizer, "<|close|>", "response", "<|sep|>", "<|open|>", "tools", "Sure",
                     "get_weather", "<|end_of_msg|>", "city"), strict=True))  # fmt: skip
    batch = Batch(tokenizer, impl)
    prompt = ids(tokenizer, "Hi", "<|close|>", "response", "<|sep|>")
    channels, lens = {}, {}
    for name, chan in (("req", channel), ("w", weather), ("wc", longer), ("own", own_ids)):
        slot, wants = batch.add(name, prompt, SamplingParams(extra_args=channel_extra_args(chan)))
        assert wants
        channels[slot], lens[slot] = chan, len(prompt)
    plain, _ = batch.add("plain", prompt, SamplingParams())
    lens[plain] = len(prompt)
    slots = list(channels)
    # req waits; w opened the tools channel itself; wc and own are at the trigger.
    batch.commit(slots[0], [t["sure"]])
    batch.commit(slots[1], [t["sure"], t["open"], t["tools"], t["sep"]])
    batch.commit(slots[2], [t["close"], t["resp"], t["sep"]])
    batch.commit(slots[3], [t["close"], t["resp"], t["sep"], *ids(tokenizer, *channel_opening())])
    drafts = {
        slots[0]: [t["close"], t["resp"], t["sep"]],
        slots[1]: [t["open"], t["eom"], t["weather"]],  # breaks where `call` is forced
        slots[2]: [t["open"], t["tools"], t["sep"]],
        slots[3]: [t["tools"], t["resp"], t["eom"]],  # the name, then the end where `"` is
        plain: [t["eom"]],
    }
    check_step(batch, channels, drafts, lens)
    assert launched == [True]
    # The verifier accepted what followed each channel; another step, again one launch.
    batch.commit(slots[0], [t["close"], t["resp"], t["sep"], t["open"]])
    batch.commit(slots[1], [t["open"]])
    batch.commit(slots[2], [t["open"], t["tools"], t["sep"], t["open"]])
    batch.commit(slots[3], [t["tools"], t["resp"], ids(tokenizer, '"')[0]])
    drafts = {s: [t["city"], t["eom"]] for s in [*slots, plain]}
    check_step(batch, channels, drafts, lens, seed=1)
    assert launched == [True, True]


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
A_CALL = [
    "Sure", "<|close|>", "response", "<|sep|>", *channel_opening(),
    "get_weather", '"', ' index="', "0", '"', "<|sep|>",
    "<|open|>", "argument", ' key="', "city", '"', ' type="', "string", '"', "<|sep|>",
    "Paris", "<|close|>", "argument", "<|sep|>", "<|close|>", "call", "<|sep|>",
    "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>",
]  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_a_channel_with_calls_masks_every_call_row(tokenizer, impl):
    from atom_plugin.k3.call_automaton import CallAutomaton
    from atom_plugin.k3.schema import call_spec_for
    from atom_plugin.k3.token_classes import classes_for_tokenizer

    classes = classes_for_tokenizer(tokenizer)
    spec = call_spec_for(tokenizer, WEATHER, parallel=False)
    channel = required_channel_for(tokenizer).with_calls(CallAutomaton(spec, classes))
    batch = Batch(tokenizer, impl)
    asked = []
    batch.proc.classes = lambda: asked.append(1) or classes  # no model here: the tokenizer's
    prompt = ids(tokenizer, "Hi")
    extra = channel_extra_args(required_channel_for(tokenizer), channel.calls)
    params = SamplingParams(extra_args=extra)
    slot, wants = batch.add("r", prompt, params)
    assert wants and asked == [1]
    plain, _ = batch.add("plain", prompt, SamplingParams())
    # Each step commits the call's next id; the drafts follow it, or write a key the
    # schema does not have, a second call, or the end where the call must go on.
    bad = ids(tokenizer, "Paris", "<|open|>", "<|end_of_msg|>")
    call = ids(tokenizer, *A_CALL)
    for i, token in enumerate(call):
        drafts = call[i : i + DRAFTS] if i % 2 else [bad[i % 3], *call[i + 1 : i + 2]]
        check_step(batch, {slot: channel}, {slot: drafts, plain: []}, {slot: 1, plain: 1}, i)
        batch.commit(slot, [token])
        batch.commit(plain, [token])
    assert channel.walk(call) == UNCONSTRAINED
