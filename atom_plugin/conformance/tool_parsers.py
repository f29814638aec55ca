"""Tool parsers through vLLM's `ToolParser` contract, on their samples and on noise.

Contract items:
- resolves: the class path imports and is a vLLM `ToolParser`, built as vLLM builds it
  (`cls(tokenizer, tools)`) with a small tokenizer that has every marker of the samples
  as one token;
- never raises on truncated output: every prefix of every sample, whole and streamed;
- never raises on malformed output: samples with slices cut, repeated or swapped, and
  random text over the samples' alphabet and markers (hypothesis);
- streaming equals non-streaming: on whole samples and random text, in chunks hypothesis
  picks, the streamed content and tool calls (names, arguments) equal one
  `extract_tool_calls` of the whole text. Parsers that keep text back until the end
  (`finish_streaming`, called where the parser has it) are read after it.

Hypothesis runs derandomized (the same examples every run) and without a database.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from atom_plugin.conformance.findings import Check, Finding, MissingDependency, checks_of, load
from atom_plugin.specs import ToolParserSpec

HOOK = "atom_tool_parsers"
MARKER = re.compile(r"<\|[^|<>]{0,40}\|>|</?[A-Za-z_][A-Za-z0-9_]{0,30}>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} for the conformance suite",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    for name in ("get_weather", "get_time", "ping")
]
EXAMPLES = 60


def checks_for(module, plugin: str) -> list[Check]:
    return checks_of(module, plugin, HOOK, lambda spec: f"tool parser {spec.name}", check_parser)


def _hypothesis():
    try:
        import hypothesis
        from hypothesis import strategies
    except ImportError as exc:
        raise MissingDependency(
            "the tool-parser checks need hypothesis, which is not installed: "
            "pip install 'atom-plugin[conformance]' (or pip install hypothesis)"
        ) from exc
    return hypothesis, strategies


def markers(samples: tuple[str, ...]) -> list[str]:
    return sorted({m for text in samples for m in MARKER.findall(text)}, key=len, reverse=True)


def build_tokenizer(samples: tuple[str, ...]):
    """A fast tokenizer whose tokens are the samples' markers and single characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    marks = markers(samples)
    chars = sorted({c for text in samples for c in text} | {chr(i) for i in range(32, 127)})
    vocab = {"<unk>": 0}
    for piece in [*marks, *chars]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    alternatives = "|".join([*(re.escape(m) for m in marks), r"[\s\S]"])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(alternatives), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=marks
    )


class _Harness:
    def __init__(self, host, cls, tokenizer) -> None:
        self.host, self.cls, self.tokenizer = host, cls, tokenizer
        self.request = host.chat_request(TOOLS)

    def new(self):
        return self.host.make_parser(self.cls, self.tokenizer, TOOLS)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def whole(self, text: str) -> tuple[str, list]:
        info = self.new().extract_tool_calls(text, self.request)
        calls = [(c.function.name, _args(c.function.arguments)) for c in info.tool_calls or []]
        return info.content or "", calls

    def streamed(self, text: str, cuts: list[int]) -> tuple[str, list]:
        parser = self.new()
        content, calls = [], {}
        previous, prev_ids = "", []
        bounds = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
        deltas = []
        for a, b in zip(bounds, bounds[1:], strict=False):
            current = text[:b]
            cur_ids = prev_ids + self.ids(text[a:b])
            deltas.append(
                parser.extract_tool_calls_streaming(
                    previous,
                    current,
                    text[a:b],
                    prev_ids,
                    cur_ids,
                    cur_ids[len(prev_ids) :],
                    self.request,
                )
            )
            previous, prev_ids = current, cur_ids
        finish = getattr(parser, "finish_streaming", None)
        if callable(finish):
            deltas.append(finish())
        for delta in deltas:
            if delta is None:
                continue
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                function = call.function
                if isinstance(function, dict):
                    name, arguments = function.get("name"), function.get("arguments")
                else:
                    name, arguments = (
                        getattr(function, "name", None),
                        getattr(function, "arguments", None),
                    )
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += name or ""
                entry[1] += arguments or ""
        ordered = [(calls[i][0], _args(calls[i][1])) for i in sorted(calls)]
        return "".join(content), ordered


def _args(text):
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _show(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_parser(spec: ToolParserSpec, label: str) -> Iterator[Finding]:
    hypothesis, st = _hypothesis()

    def finding(item, ok, detail="", case="-"):
        return Finding(label, item, case, ok, detail)

    try:
        from atom_plugin.vllm.conformance import tool_parsers as host

        cls = load(spec.class_path)
        if not host.is_tool_parser(cls):
            yield finding("resolves", False, f"{spec.class_path} is not a vLLM ToolParser")
            return
        harness = _Harness(host, cls, build_tokenizer(spec.samples))
        harness.new()
    except Exception as exc:
        yield finding("resolves", False, f"{spec.class_path}: {exc!r}")
        return
    yield finding("resolves", True, spec.class_path)
    if not spec.samples:
        yield finding("samples", False, "the spec ships no samples (ToolParserSpec.samples)")
    yield from _truncated(harness, spec.samples, finding)
    yield from _properties(harness, spec.samples, finding, hypothesis, st)


def _truncated(harness, samples, finding) -> Iterator[Finding]:
    for i, sample in enumerate(samples):
        failure = None
        for cut in range(len(sample) + 1):
            case = f"sample {i} cut at {cut} of {len(sample)} chars: {_show(sample[:cut])}"
            prefix, cuts = sample[:cut], list(range(0, cut, 5))
            for mode, run, args in (
                ("non-streaming", harness.whole, (prefix,)),
                ("streaming", harness.streamed, (prefix, cuts)),
            ):
                try:
                    run(*args)
                except Exception as exc:
                    failure = (mode, case, exc)
                    break
            if failure:
                break
        if failure:
            mode, case, exc = failure
            yield finding(f"never raises on truncated output ({mode})", False, repr(exc), case)
        else:
            yield finding(
                "never raises on truncated output",
                True,
                f"{len(sample) + 1} prefixes",
                f"sample {i}",
            )


def _properties(harness, samples, finding, hypothesis, st) -> Iterator[Finding]:
    alphabet = st.sampled_from(markers(samples) or ["<"]) | st.characters(
        codec="utf-8", exclude_categories=("Cs",)
    )
    random_text = st.lists(alphabet, max_size=40).map("".join)
    pool = list(samples) or [""]

    @st.composite
    def garbled(draw):
        text = draw(st.sampled_from(pool))
        for _ in range(draw(st.integers(1, 3))):
            n = len(text)
            a = draw(st.integers(0, n))
            b = draw(st.integers(a, min(n, a + 12)))
            how = draw(st.sampled_from(("cut", "repeat", "swap", "insert")))
            if how == "cut":
                text = text[:a] + text[b:]
            elif how == "repeat":
                text = text[:b] + text[a:b] + text[b:]
            elif how == "swap":
                text = text[a:b] + text[:a] + text[b:]
            else:
                text = text[:a] + draw(random_text) + text[a:]
        return text

    def chunks(text_strategy):
        return text_strategy.flatmap(
            lambda t: st.tuples(st.just(t), st.lists(st.integers(0, max(len(t), 1)), max_size=12))
        )

    settings = hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )

    def never_raises(text, cuts):
        for mode, run in (
            ("non-streaming", lambda: harness.whole(text)),
            ("streaming", lambda: harness.streamed(text, cuts)),
        ):
            try:
                run()
            except Exception as exc:
                raise _Failed(f"{mode} raised {exc!r}", text, cuts) from exc

    def agrees(text, cuts):
        try:
            whole, streamed = harness.whole(text), harness.streamed(text, cuts)
        except Exception as exc:
            raise _Failed(f"raised {exc!r}", text, cuts) from exc
        if whole != streamed:
            raise _Failed(f"streamed {streamed!r} but whole {whole!r}", text, cuts)

    properties = (
        ("never raises on malformed output", "garbled samples", chunks(garbled()), never_raises),
        ("never raises on malformed output", "random text", chunks(random_text), never_raises),
        ("streaming equals non-streaming", "whole samples", chunks(st.sampled_from(pool)), agrees),
        ("streaming equals non-streaming", "random text", chunks(random_text), agrees),
    )

    def runner(strategy, prop):
        @settings
        @hypothesis.given(strategy)
        def run(example):
            prop(*example)

        return run

    for item, case, strategy, prop in properties:
        try:
            runner(strategy, prop)()
        except _Failed as failed:
            detail = f"{failed.args[0]}; chunk cuts {failed.cuts}"
            yield finding(item, False, detail, f"{case}: {_show(failed.text, 160)}")
        except Exception as exc:
            yield finding(item, False, repr(exc), case)
        else:
            yield finding(item, True, f"{EXAMPLES} examples", case)


class _Failed(AssertionError):
    def __init__(self, message: str, text: str, cuts: list[int]) -> None:
        super().__init__(message)
        self.text, self.cuts = text, cuts
