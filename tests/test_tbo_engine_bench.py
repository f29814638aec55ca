"""benchmarks/tbo_engine.py's settings: a value it cannot measure is refused with the value
and the valid range (the engine runs only on a GPU: `scripts/gpu_engine.sh tbo-bench`)."""

from __future__ import annotations

import pytest

from benchmarks.tbo_engine import build_parser, check_args, llm_kwargs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cases", "off,sometimes"], "--cases 'off,sometimes': choose from off, decode"),
        (["--layers", "1"], "--layers 1: at least 2"),
        (["--decode-batches", "16,64"], "--decode-batches 16,64: within 32-256"),
        (["--prefill-tokens", "4096,32768"], "--prefill-tokens 4096,32768: within 4096-16384"),
        (["--decode-steps", "1"], "--decode-steps must be >= 2"),
    ],
)
def test_settings_it_cannot_measure_are_refused(argv, message):
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit, match=message):
        check_args(args)


def test_every_measured_step_of_a_mode_splits_and_off_sets_nothing(tmp_path):
    args = build_parser().parse_args([])
    check_args(args)
    off = llm_kwargs(args, tmp_path, "off")
    decode = llm_kwargs(args, tmp_path, "decode")
    assert "additional_config" not in off
    settings = decode["additional_config"]["atom_plugin"]
    assert settings["tbo"] == "decode"
    assert settings["tbo_decode_min_requests"] <= min(args.batches)
    assert settings["tbo_prefill_min_tokens"] <= min(args.tokens)
    # one prefill step holds the longest prompt and the largest batch's prompts
    assert decode["max_num_batched_tokens"] >= max(args.tokens)
    assert decode["max_num_seqs"] == max(args.batches)
