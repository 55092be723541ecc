"""The ``xmod`` command. Each feature module registers its own sub-command via ``register(subparsers)``."""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide ``register(subparsers)``; one line per feature.
COMMAND_MODULES = (
    "megatron_xmod.count_cli",
    "megatron_xmod.ckpt_cli",
    "megatron_xmod.data.preprocess",
    "megatron_xmod.scaling.cli",
    "megatron_xmod.demo",
    "megatron_xmod.diagnostics.cli",
    "megatron_xmod.hf.cli",
    "megatron_xmod.pipeline.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xmod", description="X-MoD / MoD sparse-depth routing for megatron-core")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from megatron_xmod.pretrain import quiet_cpu_only_warnings
    from megatron_xmod.training import patches

    if patches.cpu_mode():  # megatron warns about TE/Apex/CUDA at import time, as the entry point knows
        quiet_cpu_only_warnings()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as error:  # configuration errors already name the field
        print(f"xmod {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
