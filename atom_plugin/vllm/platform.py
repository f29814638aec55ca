"""Platform subclasses: route `--attention-backend atom_aiter` to the plugin's
classes, add the plugin's logits processors for the runner in use and record
whether the Kimi-K3 channel is live in this engine (`vllm.k3.enforcement`).

Every plugin step here runs through `guard.setup_step`: vLLM's own checks run first and
unguarded, a step nobody asked for stands aside when it fails on some vLLM, a step the
user asked for fails with a message naming the feature and the release."""

from __future__ import annotations

from vllm.logger import init_logger

from atom_plugin import manager
from atom_plugin.vllm.attention.refusal import backend_refusal
from atom_plugin.vllm.compat.runners import has_v1_runner, model_runner
from atom_plugin.vllm.guard import PluginRefusal, running_vllm, setup_step
from atom_plugin.vllm.k3.enforcement import (
    CHANNEL_PROCESSOR,
    ChannelDecision,
    decide,
    enforcement_line,
    processor_refusal,
    record,
)
from atom_plugin.vllm.registration import backend_for, dotted
from atom_plugin.vllm.settings import PluginSettings
from atom_plugin.vllm.tbo.setup import install_tbo

logger = init_logger("vllm.atom_plugin")

CHANNEL_STEP = "the Kimi-K3 channel's logits processors"


class AtomPlatformMixin:
    """Put first in the bases of a vLLM platform class."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is not None:
            spec = backend_for(selected_backend.name, attn_selector_config.use_mla)
            if spec is not None:
                flag = f"--attention-backend {selected_backend.name.lower()}"
                with setup_step(f"the {spec.name} attention backend", asked_by=flag):
                    return cls._checked_backend_path(spec.class_path, attn_selector_config, flag)
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def _checked_backend_path(cls, class_path: str, selector, flag: str) -> str:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        path = dotted(class_path)
        backend = resolve_obj_by_qualname(path)
        reasons = backend.validate_configuration(
            device_capability=cls.get_device_capability(), **selector._asdict()
        )
        if reasons:
            raise PluginRefusal(backend_refusal(backend, selector, reasons, flag, running_vllm()))
        logger.info_once("Using %s backend (atom-plugin).", backend.get_name())
        return path

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        chosen_worker = vllm_config.parallel_config.worker_cls  # before vLLM fills in "auto"
        super().check_and_update_config(vllm_config)
        settings = PluginSettings.from_vllm_config(vllm_config)  # a bad setting stops here
        if vllm_config.model_config is None:
            return
        if settings.tbo != "off":
            with setup_step("two-batch overlap", asked_by=f"atom_plugin tbo={settings.tbo!r}"):
                install_tbo(cls.device_type, vllm_config, settings, chosen_worker)
        if settings.v1_logits_processors and not has_v1_runner():
            logger.warning_once(
                "atom-plugin: the setting v1_logits_processors has no effect on vLLM %s, which "
                "has no V1 model runner (removed in vLLM 0.34); the K3 channel's processor runs "
                "under Model Runner V2 with no opt-in",
                running_vllm(),
            )
        with setup_step(CHANNEL_STEP):
            cls._install_channel(vllm_config)
            return
        record(
            ChannelDecision(
                off=f"atom-plugin could not set up {CHANNEL_STEP} on vLLM {running_vllm()}",
                fix="use a vLLM release atom-plugin supports (`python -m atom_plugin.vllm.compat`)",
            )
        )

    @classmethod
    def _install_channel(cls, vllm_config) -> None:
        """Add the plugin's logits processors for this engine's runner where vLLM takes
        them, and record and log what enforces K3's required and named tool choices."""
        model_config = vllm_config.model_config
        runner = model_runner(vllm_config)
        # vLLM's loaders take "module:Class" here (not the dotted enum form).
        specs = [s for s in manager.logits_processors() if s.runner == runner]
        refusal = processor_refusal(vllm_config, runner, cls)
        present = list(model_config.logits_processors or [])
        missing = [s.class_path for s in specs if s.class_path not in present]
        if refusal is None and missing:
            model_config.logits_processors = present + missing
            logger.info_once(
                "atom-plugin logits processors (%s runner): %s", runner, ", ".join(missing)
            )
        elif refusal is not None and specs:
            logger.warning_once(
                "atom-plugin logits processors are off (%s): %s",
                refusal[0],
                ", ".join(s.class_path for s in specs),
            )
        channel = [s.class_path for s in specs if s.name == CHANNEL_PROCESSOR]
        decision = decide(runner, refusal, model_config.logits_processors, channel)
        record(decision)
        log = logger.info_once if decision.live else logger.warning_once
        log(enforcement_line(decision))
