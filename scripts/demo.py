"""The demo: a tiny model served by `vllm serve --attention-backend atom_aiter`.

Builds the model locally (no download), starts the server, sends one
completion request, prints the answer and the attention backend that ran.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from scripts.serve import VllmServer
from scripts.tiny_llama import build_tiny_llama

DEMO_DIR = Path(".demo")
PROMPT = "The capital of France is"
BACKEND_LINE = re.compile(r"Using (\w+) backend \(atom-plugin\)")


def main() -> int:
    model = DEMO_DIR / "tiny-llama"
    if not (model / "config.json").exists():
        print(f"[demo] building a tiny Llama in {model} ...", flush=True)
        build_tiny_llama(model)
    server = VllmServer(
        model,
        ["--attention-backend", "atom_aiter", "--dtype", "float32", "--max-model-len", "512"],
        log_path=DEMO_DIR / "server.log",
    )
    print(f"[demo] starting: {' '.join(server.cmd)}", flush=True)
    print(f"[demo] server log: {server.log_path}; waiting for it to answer", end="", flush=True)
    started = time.monotonic()
    server.start(progress=True)
    try:
        print(f"[demo] server up after {time.monotonic() - started:.0f} s", flush=True)
        body = {"model": str(model), "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        answer = server.post("/v1/completions", body)
        text = answer["choices"][0]["text"]
        print(f"[demo] prompt:     {PROMPT!r}")
        print(f"[demo] completion: {text!r}  (random weights: the words are noise)")
        backends = sorted(set(BACKEND_LINE.findall(server.log_text())))
        if not backends:
            print("[demo] ERROR: the server log names no atom-plugin attention backend")
            return 1
        print(f"[demo] attention backend that ran: {', '.join(backends)}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
