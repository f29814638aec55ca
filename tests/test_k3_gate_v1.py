"""The K3 channel on vLLM's V1 logits-processor interface (`AtomK3LogitsProcessorV1`): in a
batch of every tool-call format only the K3 rows change, and rows follow vLLM's moves,
swaps, removals and async placeholders. Model Runner V2's: test_k3_gate_mrv2.py."""

import pytest
import torch
from models.scripted_gpt2 import build_tokenizer, ids

from atom_plugin.k3.channel_for import EXTRA_ARGS_KEY, channel_extra_args, required_channel_for
from atom_plugin.k3.required_channel import START, UNCONSTRAINED
from atom_plugin.k3.token_classes import classes_for_tokenizer

vllm = pytest.importorskip("vllm")

from k3_requests import build_requests_by_format, calls_channel, registered_formats  # noqa: E402
from vllm.config import SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from atom_plugin.vllm.k3.logits_v1 import AtomK3LogitsProcessorV1  # noqa: E402

# The parser serves the channel only where the platform recorded it live for the engine.
pytestmark = pytest.mark.usefixtures("k3_channel_live")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("k3tok"))


@pytest.fixture(scope="module")
def requests_by_format(tokenizer):
    return build_requests_by_format(registered_formats(), tokenizer)


def v1_processor(max_num_seqs=128, tokenizer=None):
    """The V1 processor; with `tokenizer`, its token classes come from it (no model here)."""
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_model_len=128, is_encoder_decoder=False
        )
    )
    proc = AtomK3LogitsProcessorV1(config, torch.device("cpu"), False)
    if tokenizer is not None:
        proc.classes = lambda: classes_for_tokenizer(tokenizer)
    return proc


def noisy_logits(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[:, 5] = float("-inf")
    logits[:, 7] = float("nan")
    return logits


def test_v1_every_format_batch_only_k3_rows_change(requests_by_format, tokenizer):
    keys = sorted(requests_by_format)
    k3_rows = {
        keys.index(("atom_kimi_k3", "required")): calls_channel(tokenizer),
        keys.index(("atom_kimi_k3", "named")): calls_channel(tokenizer, name="get_weather"),
        # auto: nothing until the script writes <|open|>tools<|sep|>, then its call is held.
        keys.index(("atom_kimi_k3", "auto")): calls_channel(tokenizer).as_optional(),
    }
    outputs = [[] for _ in keys]
    proc = v1_processor(max_num_seqs=len(keys), tokenizer=tokenizer)
    proc.update_state(
        BatchUpdate(
            batch_size=len(keys),
            removed=[],
            added=[(i, requests_by_format[k], [1, 2], outputs[i]) for i, k in enumerate(keys)],
            moved=[],
        )
    )
    vocab = len(tokenizer)
    # The K3 rows write text, then try to close the message right after the trigger.
    script = ids(tokenizer, "Sure", *channel_pieces_after())
    states = dict.fromkeys(k3_rows, START)
    for step, token in enumerate([None, *script]):
        if token is not None:
            for out in outputs:
                out.append(token)
            states = {row: k3_rows[row].step(state, token) for row, state in states.items()}
        proc.update_state(None)
        before = noisy_logits(len(keys), vocab, step)
        after = proc.apply(before.clone())
        for row in range(len(keys)):
            if row not in k3_rows:
                assert torch.equal(after[row].view(torch.int32), before[row].view(torch.int32))
        for row, state in states.items():
            check_row(after[row], before[row], k3_rows[row], state)
    assert all(state == UNCONSTRAINED for state in states.values())


def channel_pieces_after():
    """The trigger, the opening, then a whole call of get_weather (no argument)."""
    opening = ["<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="']
    call = ["get_weather", '"', ' index="', "0", '"', "<|sep|>", "<|close|>", "call", "<|sep|>"]
    close = ["<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]
    return ["<|close|>", "response", "<|sep|>", *opening, *call, *close]


def check_row(after, before, channel, state):
    """The row as the channel's own definition says it must be."""
    forced = None if state == UNCONSTRAINED else channel.forced_token(state)
    if forced is not None:
        assert torch.isfinite(after[forced])
        others = torch.cat([after[:forced], after[forced + 1 :]])
        assert torch.all(others == float("-inf"))
        return
    if state != UNCONSTRAINED and channel.is_masked(state):
        allowed = channel.calls.allowed_ids(channel.call_state(state), len(after))
        allowed = [t for t in allowed if t not in channel.end_ids]
        expect = torch.full_like(before, float("-inf"))
        expect[allowed] = before[allowed]
        assert torch.equal(after.view(torch.int32), expect.view(torch.int32))
        return
    banned = sorted(channel.banned_tokens(state))
    expect = before.clone()
    expect[banned] = float("-inf")
    assert torch.equal(after.view(torch.int32), expect.view(torch.int32))


def test_v1_moves_swaps_removals_and_async_placeholders(tokenizer):
    channel = required_channel_for(tokenizer)
    args = channel_extra_args(channel)
    req = SamplingParams(max_tokens=8, extra_args=args)
    plain = SamplingParams(max_tokens=8)
    close, resp, sep = ids(tokenizer, "<|close|>", "response", "<|sep|>")
    out_a, out_b, out_c = [close, resp], [], [close, resp, -1]  # c: async placeholder
    proc = v1_processor()
    proc.update_state(
        BatchUpdate(3, [], [(0, req, [1], out_a), (1, plain, [1], out_b), (2, req, [1], out_c)], [])
    )
    proc.update_state(BatchUpdate(3, [], [], [(0, 2, MoveDirectionality.SWAP)]))
    # Row 2 now holds a's request, row 0 c's; the runner repairs c's placeholder.
    out_c[-1] = sep
    vocab = len(tokenizer)
    before = noisy_logits(3, vocab, 0)
    after = proc.apply(before.clone())
    state_ac = channel.walk([close, resp])
    check_row(after[2], before[2], channel, state_ac)  # a: waiting right before <|sep|>
    check_row(after[0], before[0], channel, channel.walk([close, resp, sep]))  # c: forced
    assert torch.equal(after[1].view(torch.int32), before[1].view(torch.int32))
    # A one-way move of row 0 onto row 1, then row 2 removed: only row 1 is constrained.
    proc.update_state(BatchUpdate(2, [2], [], [(0, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    before = noisy_logits(2, vocab, 1)
    after = proc.apply(before.clone())
    assert torch.equal(after[0].view(torch.int32), before[0].view(torch.int32))
    check_row(after[1], before[1], channel, channel.walk([close, resp, sep]))


def test_v1_engine_stop_ids_are_banned_while_waiting(tokenizer):
    channel = required_channel_for(tokenizer)
    params = SamplingParams(
        max_tokens=8, stop_token_ids=[4], extra_args=channel_extra_args(channel)
    )
    proc = v1_processor()
    proc.update_state(BatchUpdate(1, [], [(0, params, [1], [])], []))
    before = noisy_logits(1, len(tokenizer), 3)
    after = proc.apply(before.clone())
    assert after[0, 4] == float("-inf") and after[0, tokenizer.eos_token_id] == float("-inf")
    check_row(after[0], before[0], channel.ending_on([4]), START)


def test_v1_validate_params_names_the_bad_value():
    with pytest.raises(ValueError, match="atom_required_channel"):
        AtomK3LogitsProcessorV1.validate_params(
            SamplingParams(extra_args={EXTRA_ARGS_KEY: "[1, 2]"})
        )
    AtomK3LogitsProcessorV1.validate_params(SamplingParams())
    assert v1_processor().is_argmax_invariant() is False
