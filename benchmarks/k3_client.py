"""Streamed chat requests against a `vllm serve` API, with each chunk's arrival time.

`stream_chat(client, body)` sends one streamed Chat Completions request (usage reported
with every chunk) and returns a `Streamed`: when it was sent, when each chunk with new
output arrived and how many output tokens it had by then, the content, the tool calls
(assembled from their deltas) and the finish reason, or the error the server answered.
`serve_env(plugin_on)` is the environment the K3 benchmarks start `vllm serve` with.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Streamed:
    sent: float
    times: list[float] = field(default_factory=list)  # chunks that carried new output
    tokens: list[int] = field(default_factory=list)  # output tokens by each of those chunks
    content: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: str | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.tokens[-1] if self.tokens else 0

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def gaps(self) -> list[float]:
        """Seconds between consecutive chunks of output."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    def tool_calls(self) -> list[tuple[str, str]]:
        """(name, arguments JSON) of each call, in order."""
        return [(c.get("name", ""), c.get("arguments", "")) for _, c in sorted(self.calls.items())]


async def stream_chat(client: Any, body: dict[str, Any], on_chunk=None) -> Streamed:
    """One streamed request through `client` (an `openai.AsyncOpenAI`); `on_chunk(streamed)`
    is called after each chunk with new output."""
    import openai

    known = {"model", "messages", "tools", "tool_choice", "max_tokens", "temperature",
             "parallel_tool_calls", "logit_bias", "seed"}  # fmt: skip
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    out = Streamed(sent=time.perf_counter())
    try:
        stream = await client.chat.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=extra or None,
        )
        async for chunk in stream:
            now = time.perf_counter()
            usage = getattr(chunk, "usage", None)
            tokens = usage.completion_tokens if usage is not None else out.output_tokens
            for choice in chunk.choices:
                delta = choice.delta
                out.content += delta.content or ""
                for call in delta.tool_calls or []:
                    into = out.calls.setdefault(call.index, {})
                    if call.function is not None:
                        for key in ("name", "arguments"):
                            into[key] = into.get(key, "") + (getattr(call.function, key) or "")
                out.finish = choice.finish_reason or out.finish
            if tokens > out.output_tokens:
                out.times.append(now)
                out.tokens.append(tokens)
                if on_chunk is not None:
                    on_chunk(out)
    except openai.APIError as err:
        out.error = f"{type(err).__name__}: {getattr(err, 'message', err)}"
    return out


def serve_env(plugin_on: bool) -> dict[str, str | None]:
    """A K3 benchmark server's environment (None unsets): the plugin on with its channel
    (ATOM_K3_STRUCTURAL_TAG unset), or disabled so that vLLM's own kimi_k3 serves."""
    return {
        "ATOM_PLUGIN_DISABLE": None if plugin_on else "1",
        "ATOM_K3_STRUCTURAL_TAG": None,
        "TOKENIZERS_PARALLELISM": "false",
    }


def parsed_arguments(arguments: str) -> Any:
    """A call's arguments as JSON, or None when they do not parse."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return None


def scrape(base_url: str) -> dict[str, float]:
    """The server's Prometheus metrics (`/metrics`), summed over label sets but `le`:
    `name`, `name_sum`, `name_count` and `name_bucket|le` -> value."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if match is None:
            continue
        name, labels, value = match.groups()
        le = re.search(r'le="([^"]+)"', labels or "")
        key = f"{name}|{le.group(1)}" if le else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def histogram(before: dict[str, float], after: dict[str, float], name: str):
    """(mean, p50, p90) of what histogram `name` recorded between two scrapes (p50 and p90
    are the upper bounds of their buckets), None without observations."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if count <= 0:
        return None
    mean = (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count
    prefix = f"{name}_bucket|"
    bounds = sorted(
        (float(key[len(prefix) :]), after[key] - before.get(key, 0.0))
        for key in after
        if key.startswith(prefix)
    )

    def quantile(q: float) -> float:
        return next((bound for bound, seen in bounds if seen >= q * count), float("inf"))

    return mean, quantile(0.5), quantile(0.9)
