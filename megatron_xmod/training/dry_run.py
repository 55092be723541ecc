"""Validate a launch without running it: megatron's full argument validation plus the plugin's own,
at the launch's world size, with no GPU and no process group.

    WORLD_SIZE=64 python -m megatron_xmod.training.dry_run [the entry point's arguments]

Takes exactly the arguments of ``python -m megatron_xmod.pretrain``, expands them the same way, runs
``megatron.training.arguments.parse_and_validate_args`` (``validate_args`` reads the world size from
``WORLD_SIZE``; this process plays rank 0 and starts nothing distributed), then
``megatron_xmod.training.preflight.validate_before_training`` (the XModConfig / MoEConfig build, sequence
length against K, the data files, the tokenizer each records (``PREFIX.tokenizer.json``) against the
run's, splits and token ids, the tokenizer files, the output directories, the ``--load`` tracker and
the checkpoint's model and learning-rate schedule), after its own check of the world size and global
batch against the parallel sizes. Prints data-parallel size, TP, PP, the global batch (sequences per step) and
the iterations; exits 2 with our message for a wrong input (file, flag, a world size or global batch
that does not split over the data-parallel replicas), 1 with megatron's when its own validation
refuses the run (and when the memory estimate exceeds ``GPU_MEM_GB``), 0 otherwise. The slurm
launchers run it before ``srun`` (and alone with ``DRY_RUN=1``) and exit with its code.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Optional


def validate(argv: list[str]):
    """megatron's parsed and validated arguments for ``argv`` (the entry point's command line)."""
    from megatron_xmod.cpu_shim import cpu_patches
    from megatron_xmod.training import patches
    from megatron_xmod.training.flags import add_arguments, expand_arguments
    from megatron_xmod.training.preflight import (
        check_batch_layout,
        check_before_megatron_setup,
        validate_before_training,
    )

    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ["RANK"] = "0"  # validation as rank 0 sees it; rank 0 writes no tensorboard/wandb
    with cpu_patches(training=True):
        expanded = expand_arguments(list(argv))
        from megatron.training.arguments import parse_and_validate_args, parse_args

        patches.no_log_writers()
        patches.checks_before_tokenizer(check_before_megatron_setup)
        saved = sys.argv
        sys.argv = [saved[0] if saved else "dry_run"] + expanded
        log = io.StringIO()  # megatron prints every argument; shown only with XMOD_DRY_RUN_VERBOSE=1
        try:
            # the world size against TP x PP and the batch, in the user's terms, before megatron's assertions
            check_batch_layout(parse_args(extra_args_provider=add_arguments), *launcher_layout())
            with contextlib.redirect_stdout(sys.stdout if os.environ.get("XMOD_DRY_RUN_VERBOSE") == "1" else log):
                args = parse_and_validate_args(extra_args_provider=add_arguments)
        except BaseException:
            sys.stdout.write("".join(line for line in log.getvalue().splitlines(True) if not line.startswith("  ")))
            raise
        finally:
            sys.argv = saved
        validate_before_training(args)
    return args


def launcher_layout() -> tuple[Optional[int], Optional[int]]:
    """(NODES, NPROC) of the slurm launcher that started this dry run (``XMOD_LAUNCH_NODES`` /
    ``XMOD_LAUNCH_NPROC``), so that messages name its knobs; (None, None) otherwise."""
    try:
        return int(os.environ["XMOD_LAUNCH_NODES"]), int(os.environ["XMOD_LAUNCH_NPROC"])
    except (KeyError, ValueError):
        return None, None


def summary(args) -> str:
    tokens = args.global_batch_size * args.seq_length
    iters = args.train_iters if args.train_iters is not None else f"{args.train_samples} samples"
    return (f"[dry-run] OK: world size {args.world_size} = data-parallel {args.data_parallel_size} x "
            f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x "
            f"CP {args.context_parallel_size}\n"
            f"[dry-run] global batch {args.global_batch_size} sequences per step ({tokens:,} tokens at L = "
            f"{args.seq_length}), micro-batch {args.micro_batch_size}, "
            f"{args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)} micro-batches per rank\n"
            f"[dry-run] iterations {iters}, layers {args.num_layers}, "
            f"model {getattr(args, 'xmod_routing_family', 'dense')}"
            + (f" + {args.num_experts} experts" if getattr(args, "num_experts", None) else "")
            + f", dropout attention {args.attention_dropout} hidden {args.hidden_dropout}")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # the entry point's flags: the dry run validates exactly those
        from megatron_xmod.training.pretrain import print_help

        print_help()
        return 0
    try:
        args = validate(argv)
    except SystemExit as exit_:  # argparse: unknown/invalid flag (its message is already printed)
        code = exit_.code if isinstance(exit_.code, int) else 1
        print(f"[dry-run] FAILED: megatron's argument parser rejected the command line (exit {code})", file=sys.stderr)
        return code or 1
    except (ValueError, FileNotFoundError) as error:  # ours (and megatron's ValueErrors): the input is wrong
        print(f"[dry-run] FAILED ({type(error).__name__}): {error}", file=sys.stderr)
        return 2
    except (AssertionError, RuntimeError, TypeError) as error:
        kind = "megatron" if isinstance(error, AssertionError) else type(error).__name__
        print(f"[dry-run] FAILED ({kind}): {error}", file=sys.stderr)
        return 1
    print(summary(args), flush=True)
    from megatron_xmod.training.log import layout_from_args, routing_segments_note

    note = routing_segments_note(args, layout_from_args(args))
    if note:
        print(f"[dry-run] routing: {note}", flush=True)
    from megatron_xmod.training.memory_estimate import check_launch_memory

    return check_launch_memory(args)  # refuses (1) above GPU_MEM_GB, default 80, before any allocation


if __name__ == "__main__":
    sys.exit(main())
