"""Pre-train Dense / MoD / X-MoD / MoE GPT models on megatron's own training loop.

    python -m megatron_xmod.pretrain [any megatron-LM argument] [--xmod-* arguments]   # one process
    torchrun --nproc_per_node=8 -m megatron_xmod.pretrain ...
    python -m megatron_xmod.pretrain --help                                             # every flag

Modelled on Megatron-LM's ``pretrain_gpt.py``: ``megatron.training.pretrain`` with the hooks of
:mod:`megatron_xmod.training.hooks`, plus the ``--xmod-*`` argument group. Every standard megatron
argument keeps working. ``--xmod-backbone`` expands a Table 4 preset (or a backbone JSON file) into
megatron's own architecture flags (placed before the user's flags, so explicit flags still win).

Started without a launcher (no torchrun/SLURM variables), it runs one process on a free local port.
Before training, rank 0 prints one summary block (:func:`~megatron_xmod.training.log.startup_summary`).
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import socket
import sys
import warnings
from typing import Optional

from megatron_xmod import cpu_shim
from megatron_xmod.training import patches

PROG = "python -m megatron_xmod.pretrain"
# Any of these means a launcher (torchrun / torch.distributed.run, or srun with several tasks) set the run up.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
# Warnings a CPU-only machine always gets and can do nothing about (TE/Apex/CUDA are GPU libraries).
CPU_ONLY_WARNINGS = (r".*Transformer Engine and Apex are not installed.*", r".*Apex is not installed.*",
                     r".*transformer-engine>=.*", r".*TransformerEngine.*", r".*CUDA.*not available.*",
                     r".*No CUDA runtime.*", r".*torch\.cuda.*", r".*no accelerator is found.*")


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if cpu_shim.cpu_mode():  # before anything imports megatron, which warns at import time
        quiet_cpu_only_warnings()
    if "-h" in argv or "--help" in argv:
        print_help()
        return
    from megatron_xmod.training.flags import expand_arguments

    with cpu_shim.cpu_patches(training=True):
        _pretrain(expand_arguments(argv))


def _pretrain(argv: list[str]) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_xmod.training import checkpoints, save_lock
    from megatron_xmod.training.hooks import xmod_train_hooks
    from megatron_xmod.training.log import startup_summary
    from megatron_xmod.training.preflight import check_before_megatron_setup, validate_before_training
    from megatron_xmod.xmod.routing_state import kept_through

    sys.argv = [sys.argv[0]] + argv
    hooks = xmod_train_hooks()
    patches.skip_dataset_helper_build()

    def before_megatron_setup(args) -> None:
        check_before_megatron_setup(args)
        save_lock.take_for_run(args)  # rank 0: one writer per --save, before anything is built

    patches.checks_before_tokenizer(before_megatron_setup)
    patches.writer_survives_sigterm()
    dump = io.StringIO()
    restore_argument_dump = patches.capture_argument_dump(dump)
    try:
        args = parse_and_validate_args(extra_args_provider=hooks.extra_args_provider)
    finally:
        restore_argument_dump()
    validate_before_training(args)
    where = keep_argument_dump(args, dump.getvalue())
    if args.rank == 0:
        print(startup_summary(args, argument_dump=where), flush=True)
    patches.call_after_training_log(hooks.after_training_log)
    patches.call_after_evaluation(hooks.after_evaluation)
    if not args.xmod_validation_continues:
        patches.validation_from_the_start()
    patches.checkpoint_integrity(checkpoints)
    patches.disk_space_before_save(checkpoints)
    patches.stop_on_zero_gradients()
    patches.routing_state_kept_through_graph_capture(kept_through)
    config_container = pretrain_cfg_container_from_args(args, None)
    single_process_defaults()  # as late as possible: the free port is taken by the time megatron binds it
    pretrain(config_container, hooks.datasets_provider, ModelType.encoder_or_decoder, hooks.forward_step,
             model_provider=hooks.model_provider)


# ----------------------------------------------------------------------------- --help
class DefaultsOnceHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)", only where it says something: not after a help that states its
    default itself (ours, and megatron's "Defaults to ..."), not for None (derived or unset), and not
    for on/off switches, whose argparse default is the opposite of the switch (--xmod-fixed-gate-scale
    stores False into gate_scale_learnable: "(default: True)" would read as "fixed by default")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """megatron's full parser plus the plugin's groups, as the entry point parses them."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_xmod.training.flags import add_arguments

    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=DefaultsOnceHelpFormatter,
        description="Megatron-LM's pretrain_gpt.py with Dense / MoD / X-MoD / MoE (DTop-p) models. Our groups "
                    "'X-MoD' and 'MoE' are listed first; every megatron flag follows.")
    add_arguments(parser)
    add_megatron_arguments(parser)
    _escape_broken_help(parser)
    return parser


def _escape_broken_help(parser: argparse.ArgumentParser) -> None:
    """argparse %-formats every help string; a few of megatron 0.19's contain a bare ``%`` (e.g.
    ``--moe-paged-stash-buffer-size-factor-cuda``), which makes ``--help`` crash. Escape those only."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or "%" not in action.help:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


def print_help() -> None:
    with cpu_shim.cpu_patches(training=False):
        build_parser().print_help()


# ----------------------------------------------------------------------------- one process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_defaults(environ=os.environ) -> bool:
    """Without a launcher, megatron's ``init_process_group`` stops on ``MASTER_ADDR expected``; set
    the variables of a one-process run (a MASTER_ADDR/MASTER_PORT already exported is kept, else
    127.0.0.1 and a free port). Returns True when it did."""
    slurm_tasks = environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS")
    if any(name in environ for name in LAUNCHER_VARIABLES) or (slurm_tasks and slurm_tasks != "1"):
        return False
    environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in environ:
        environ["MASTER_PORT"] = str(free_port())
    print(f"[xmod] no launcher found (torchrun/SLURM): one process on {environ['MASTER_ADDR']}:"
          f"{environ['MASTER_PORT']}; use torchrun --nproc_per_node=N for more", flush=True)
    return True


def quiet_cpu_only_warnings() -> None:
    """The TE/Apex/CUDA fall-back notices every CPU run prints (~25 lines before iteration 1)."""
    for pattern in CPU_ONLY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------- megatron's argument dump
def keep_argument_dump(args, dump: str) -> str:
    """megatron's argument dump (caught by patch 22). console: print it as megatron does; file: ``megatron_arguments.txt`` in --save (else
    --tensorboard-dir); auto: console with a GPU (cluster logs keep it), file on CPU. Returns where."""
    if not dump:
        return "not printed (rank > 0)"
    mode = args.xmod_megatron_args
    if mode == "auto":
        mode = "file" if cpu_shim.cpu_mode() else "console"
    if mode == "console":
        print(dump, end="", flush=True)
        return "printed above"
    folder = args.save or args.tensorboard_dir
    if not folder:
        return "not kept (no --save or --tensorboard-dir; --xmod-megatron-args console prints it)"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "megatron_arguments.txt")
    with open(path, "w") as f:
        f.write(dump)
    return path


def run() -> None:
    """``python -m megatron_xmod.pretrain``: :func:`main`, with a configuration error as one line and exit 2."""
    try:
        main()
    except (ValueError, FileNotFoundError) as error:
        print(f"megatron_xmod.pretrain: error: {error}", file=sys.stderr)
        if len(sys.argv) == 1:
            print(f"every flag: {PROG} --help; a first run: docs/first_run.md", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
