"""What a hook implementation hands the host: small, immutable descriptions.

Hooks return these rather than classes so that listing what the plugin offers
(`atom-plugin info`) never imports vLLM or a GPU library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

AttentionKind = Literal["mha", "mla"]
ATTENTION_KINDS: tuple[str, ...] = ("mha", "mla")
RUNNERS: tuple[str, ...] = ("v1", "mrv2")


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class _NamedClass:
    """A class the host registers under `name`; `class_path` is 'package.module:Name'."""

    name: str
    class_path: str
    what: ClassVar[str]  # what the class is, for error messages

    def __post_init__(self) -> None:
        module, sep, attr = self.class_path.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"{self.what} class path {self.class_path!r} must look like 'package.module:Name'"
            )


@dataclass(frozen=True)
class AttentionBackendSpec(_NamedClass):
    """An attention backend: `name` is the `--attention-backend` enum member (upper case)."""

    what = "attention backend"
    kind: AttentionKind

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.upper():
            raise ValueError(f"attention backend name {self.name!r} must be upper case")
        super().__post_init__()
        _check_choice("attention backend kind", self.kind, ATTENTION_KINDS)


@dataclass(frozen=True)
class LogitsProcessorSpec(_NamedClass):
    """A logits processor class for one of vLLM's model runners ("v1" or "mrv2")."""

    what = "logits processor"
    runner: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("logits processor runner", self.runner, RUNNERS)


@dataclass(frozen=True)
class ToolParserSpec(_NamedClass):
    """A tool parser registered with vLLM under `name` (`--tool-call-parser name`).

    `samples`: complete model outputs in the parser's format; the conformance suite
    (`atom_plugin.conformance`) parses them, cuts them short and garbles them.
    """

    what = "tool parser"
    samples: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.samples, str) or not all(isinstance(t, str) for t in self.samples):
            raise ValueError(
                f"tool parser samples must be a tuple of strings, got {self.samples!r}"
            )


@dataclass(frozen=True)
class MicroBatchRunnerSpec:
    """The two-batch-overlap runner: `factory(**kwargs)` builds one."""

    name: str
    factory: Callable[..., Any]


@dataclass(frozen=True)
class HealthProbeSpec:
    """A vendor GPU tool that `atom-plugin doctor` can run and judge.

    `smi` is the `--smi` choice that selects it; `probe` is the object that
    runs the tool and parses its output (see `atom_plugin.doctor`).
    """

    smi: str
    probe: Any
