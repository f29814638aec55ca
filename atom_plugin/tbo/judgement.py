"""What two-batch overlap will do in an engine, said before it runs.

Each line names one condition under which TBO on does nothing useful there: its
micro-batches have no communication to overlap, or a kind of step it is set to split
can never reach its threshold. The engine logs these lines at start and `atom-plugin
info --engine-args ...` prints them for a set of engine arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom_plugin.tbo.mode import TboConfig

# vLLM 0.32's all-to-all backends whose prepare/finalize hand over at dbo_* yield
# points (`supports_async()`), with expert parallelism; the others assert that no
# micro-batch is registered, and their steps run one micro-batch after the other.
YIELDING_ALL2ALL_BACKENDS = ("deepep_high_throughput", "deepep_low_latency", "deepep_v2", "nixl_ep")


@dataclass(frozen=True)
class EngineLimits:
    """What bounds a step in the engine, and whether its layers yield to the other micro-batch."""

    max_num_batched_tokens: int  # new tokens in one step
    max_num_seqs: int  # requests in one step
    expert_parallel: bool
    all2all_backend: str

    @property
    def layers_yield(self) -> bool:
        return self.expert_parallel and self.all2all_backend in YIELDING_ALL2ALL_BACKENDS


def tbo_judgement(config: TboConfig, limits: EngineLimits) -> list[str]:
    """One line per condition under which the engine's TBO splits nothing or only adds cost."""
    lines = []
    if not limits.layers_yield:
        where = (
            f"--all2all-backend {limits.all2all_backend}"
            if limits.expert_parallel
            else "no --enable-expert-parallel"
        )
        lines.append(
            f"no all-to-all to overlap ({where}): split steps run one micro-batch after the "
            "other and only add host cost; vLLM's MoE layers hand over between micro-batches "
            "only with --enable-expert-parallel and --all2all-backend "
            + "|".join(YIELDING_ALL2ALL_BACKENDS)
        )
    largest_decode = min(limits.max_num_seqs, limits.max_num_batched_tokens)
    if config.decode and config.decode_min_requests > largest_decode:
        lines.append(
            f"decode steps never split: tbo_decode_min_requests={config.decode_min_requests} "
            f"is above the largest decode step this engine schedules ({largest_decode} requests: "
            f"--max-num-seqs {limits.max_num_seqs}, --max-num-batched-tokens "
            f"{limits.max_num_batched_tokens}); lower tbo_decode_min_requests to at most "
            f"{largest_decode} or raise --max-num-seqs"
        )
    if config.prefill and config.prefill_min_tokens > limits.max_num_batched_tokens:
        lines.append(
            f"prefill steps never split: tbo_prefill_min_tokens={config.prefill_min_tokens} is "
            f"above --max-num-batched-tokens {limits.max_num_batched_tokens}, the most new "
            f"tokens of one step; lower tbo_prefill_min_tokens to at most "
            f"{limits.max_num_batched_tokens} or raise --max-num-batched-tokens to "
            f"{config.prefill_min_tokens} or more"
        )
    return lines
