"""A deterministic "model" for end-to-end tests: GPT-2 that follows a script.

One layer, every weight zero except the LayerNorm weights (= 1), `wpe[p, p] =
10` and an untied `lm_head[script[p], p] = 1`. The residual stream at position
`p` is then `10 * e_p`, so the logits at `p` peak at `script[p]` whatever the
tokens were: the model writes `script[p]` after position `p`. Tokens that the
sampler forces overwrite the script at their positions only.

The tokenizer is word-level: a fixed list of text pieces (so ids stay readable)
plus the four K3 control tokens as special tokens, decoded by concatenation.
The chat template writes the K3 prompt format, tools included.
"""

from __future__ import annotations

import re
from pathlib import Path

CONTROL_TOKENS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
EOS = "<|end_of_msg|>"
UNK = "[UNK]"

# Every text piece the tests use; any other text encodes as [UNK]. No piece may be a
# proper prefix of another that the K3 markers need unless the rest is a piece too:
# xgrammar lets a structural tag take such a prefix token ("tool" of "tools") and then
# finds no token to go on with.
PIECES = [
    UNK,
    "system",
    "user",
    "assistant",
    "message",
    "response",
    "think",
    "tools",
    "call",
    "argument",
    "tool_declare",
    " role=",
    ' tool="',
    ' index="',
    ' key="',
    ' type="',
    '"',
    "=",
    "string",
    "number",
    "get_weather",
    "city",
    "Paris",
    "Sure",
    "Hi",
    "0",
    "1",
    " ",
    "\n",
    "get_time",
    "days",
]

# K3's prompt format: tools are declared first (by name, so the prompt's length
# does not depend on how a server serialises their schemas), each message is
# `<|open|>message role="R"<|sep|>` ..., and the assistant turn is left open
# inside its response channel.
CHAT_TEMPLATE = (
    "{%- if tools %}<|open|>tool_declare<|sep|>"
    "{%- for t in tools %}{{ (t.function or t)['name'] }}{%- endfor %}"
    "<|close|>tool_declare<|sep|>{%- endif %}"
    "{%- for m in messages %}<|open|>message role=\"{{ m['role'] }}\"<|sep|>"
    "<|open|>response<|sep|>{{ m['content'] }}<|close|>response<|sep|>"
    "<|close|>message<|sep|>{%- endfor %}"
    '{%- if add_generation_prompt %}<|open|>message role="assistant"<|sep|>'
    "<|open|>response<|sep|>{%- endif %}"
)


def build_tokenizer(path: str | Path):
    """A word-level fast tokenizer saved under `path`; returns the loaded tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {piece: i for i, piece in enumerate(PIECES)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    alternatives = "|".join(re.escape(p) for p in sorted(PIECES[1:], key=len, reverse=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(alternatives), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK,
        eos_token=EOS,
        additional_special_tokens=[t for t in CONTROL_TOKENS if t != EOS],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def ids(tokenizer, *pieces: str) -> list[int]:
    """The ids of pieces that are each one token (control tokens or vocabulary words)."""
    out = tokenizer.convert_tokens_to_ids(list(pieces))
    unknown = [
        p for p, i in zip(pieces, out, strict=True) if i == tokenizer.unk_token_id and p != UNK
    ]
    if unknown:
        raise ValueError(f"pieces {unknown} are not tokens of the scripted tokenizer")
    return out


def build_model(
    path: str | Path, script: list[int], vocab_size: int, eos_id: int, positions: int = 128
):
    """Save a GPT-2 under `path` that writes `script[p]` after position `p`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if len(script) > positions:
        raise ValueError(f"script of {len(script)} ids is longer than positions={positions}")
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=positions,
        n_embd=positions,
        n_layer=1,
        n_head=1,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.zero_()
            if ("ln_" in name) and name.endswith("weight"):
                param.fill_(1.0)
        wpe = model.transformer.wpe.weight
        for p in range(positions):
            wpe[p, p] = 10.0
        for p, token in enumerate(script):
            model.lm_head.weight[token, p] = 1.0
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def build_scripted_dir(path: str | Path, script_after_prompt, prompt_messages, tools=None):
    """Tokenizer + model under `path` whose output (after this prompt) is the script.

    `script_after_prompt` is a list of pieces: the i-th output token is the i-th
    piece. Returns (tokenizer, prompt_ids).
    """
    path = Path(path)
    tokenizer = build_tokenizer(path)
    text = tokenizer.apply_chat_template(
        prompt_messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    fill = ids(tokenizer, "Hi")[0]
    script = [fill] * (len(prompt_ids) - 1) + ids(tokenizer, *script_after_prompt)
    positions = max(128, len(script) + 8)
    build_model(path, script, len(tokenizer), tokenizer.eos_token_id, positions)
    return tokenizer, prompt_ids
