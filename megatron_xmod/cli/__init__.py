"""The ``xmod`` command: every sub-command is a module of this package with ``register(subparsers)``;
the work itself lives in the feature packages, which never import this one."""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide ``register(subparsers)``; one line per feature.
COMMAND_MODULES = (
    "megatron_xmod.cli.count",
    "megatron_xmod.cli.ckpt",
    "megatron_xmod.cli.preprocess",
    "megatron_xmod.cli.scaling",
    "megatron_xmod.cli.demo",
    "megatron_xmod.cli.routing_report",
    "megatron_xmod.cli.hf",
    "megatron_xmod.cli.partition",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xmod", description="X-MoD / MoD sparse-depth routing for megatron-core")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from megatron_xmod.cpu_shim import cpu_mode
    from megatron_xmod.training.pretrain import quiet_cpu_only_warnings

    if cpu_mode():  # megatron warns about TE/Apex/CUDA at import time, as the entry point knows
        quiet_cpu_only_warnings()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as error:  # configuration errors already name the field
        print(f"xmod {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
