"""`atom-plugin` command line: `info`, `doctor` and `conformance`."""

from __future__ import annotations

import argparse
import sys

from atom_plugin import __version__


def _info(args: argparse.Namespace) -> int:
    from atom_plugin.vllm.compat import SUPPORTED_VLLM

    print(f"atom-plugin {__version__}")
    print(f"supported vLLM releases: {SUPPORTED_VLLM} (`atom-plugin info --support`: where)")
    if args.support:
        from atom_plugin.vllm.compat.support import matrix_markdown

        print(matrix_markdown())
        return 0
    from atom_plugin import manager
    from atom_plugin.attention.mla.gluon.probe import gluon_mla_problems
    from atom_plugin.platform import aiter_available, detect_platform, triton_available

    yes_no = {True: "yes", False: "no"}
    print(f"platform: {detect_platform()}")
    print(f"aiter available: {yes_no[aiter_available()]}")
    print(f"triton available: {yes_no[triton_available()]}")
    gluon = "; ".join(gluon_mla_problems())
    print(f"hopper MLA decode (Gluon): {f'no ({gluon})' if gluon else 'yes'}")
    pm = manager.get_plugin_manager()
    print("hook implementations:")
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0]):
        hooks = sorted(_hooks_of(pm, plugin))
        print(f"  {name}: {', '.join(hooks) or '(no hooks)'}")
    print("attention backends:")
    for spec in manager.attention_backends(pm):
        print(f"  {spec.name} ({spec.kind}) -> {spec.class_path}")
    print("logits processors:")
    for spec in manager.logits_processors(pm):
        print(f"  {spec.name} [{spec.runner}] -> {spec.class_path}")
    print("tool parsers:")
    for spec in manager.tool_parsers(pm):
        print(f"  {spec.name} -> {spec.class_path}")
    runner = manager.microbatch_runner(pm)
    print(f"micro-batch runner: {runner.name if runner else '(none)'}")
    print(_tbo_setting_line())
    if args.engine_args is not None:
        _print_tbo_judgement(args.engine_args)
    print("health probes:")
    for spec in manager.health_probes(pm):
        print(f"  {spec.smi}")
    return 0


def _print_tbo_judgement(engine_args: str) -> None:
    import shlex

    from atom_plugin.vllm.tbo.setup import judgement_for_engine_args

    head, *conditions = judgement_for_engine_args(shlex.split(engine_args))
    print(f"two-batch overlap with these engine arguments: {head}")
    for line in conditions:
        print(f"  {line}")


def _tbo_setting_line() -> str:
    from atom_plugin.tbo.mode import TBO_MODES
    from atom_plugin.vllm.settings import PluginSettings

    d = PluginSettings()
    return (
        "two-batch overlap: --additional-config "
        f'\'{{"atom_plugin": {{"tbo": "{"|".join(TBO_MODES)}"}}}}\' (default {d.tbo}; '
        f"tbo_decode_min_requests={d.tbo_decode_min_requests}, "
        f"tbo_prefill_min_tokens={d.tbo_prefill_min_tokens})"
    )


def _hooks_of(pm, plugin) -> list[str]:
    return [caller.name for caller in pm.get_hookcallers(plugin) or []]


def build_parser() -> argparse.ArgumentParser:
    from atom_plugin.conformance import command as conformance_command
    from atom_plugin.doctor import command as doctor_command

    parser = argparse.ArgumentParser(prog="atom-plugin", description=__doc__)
    parser.add_argument("--version", action="version", version=f"atom-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,doctor,conformance}")
    sub.required = True
    info = sub.add_parser("info", help="version, platform and every registered hook")
    info.add_argument(
        "--engine-args",
        metavar="ARGS",
        help="vLLM engine arguments, one string (--model M --additional-config ...): "
        "also print what two-batch overlap will do in such an engine (needs vLLM)",
    )
    info.add_argument(
        "--support",
        action="store_true",
        help="print only the support matrix: each vLLM release x capability x where it ran",
    )
    info.set_defaults(func=_info)
    doctor = sub.add_parser("doctor", help="GPU host health check (run before a server or CI)")
    doctor_command.configure(doctor)
    doctor.set_defaults(func=doctor_command.run)
    conformance = sub.add_parser(
        "conformance", help="run every registered hook implementation through its contract"
    )
    conformance_command.configure(conformance)
    conformance.set_defaults(func=conformance_command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 via argparse
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
