"""``xmod ckpt verify DIR [--iteration N] [--all] [--rewrite]``: check a megatron checkpoint directory
against the checksum manifests that training writes after each save
(:mod:`megatron_xmod.training.checkpoints`).

Exit codes: 0 every checked iteration matches its manifest; 1 a file differs, is missing or an
iteration has no manifest; 2 the directory, tracker or manifest itself is unusable.
"""
from __future__ import annotations

import os
import sys
import time

from megatron_xmod.training import checkpoints


def register(subparsers) -> None:
    ckpt = subparsers.add_parser("ckpt", help="checkpoint tools: verify a checkpoint against its checksum manifest")
    commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    verify = commands.add_parser(
        "verify", help="check the files of a checkpoint against the manifest written after the save",
        description="Checks the iteration that latest_checkpointed_iteration.txt names (or --iteration N, or --all): "
                    "every file's size and checksum against checksums_iter_NNNNNNN.json. Exit 0 when all match, 1 "
                    "when a file differs or a manifest is missing, 2 when the directory or tracker is unusable.")
    verify.add_argument("directory", metavar="DIR", help="the --save/--load directory (holds iter_* and the tracker)")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, default=None, help="check iteration N instead of the tracked one")
    which.add_argument("--all", action="store_true", help="check every iter_* directory")
    verify.add_argument("--rewrite", action="store_true",
                        help="write a new manifest from the files as they are now (only for files you trust, e.g. "
                             "restored from a copy, or a checkpoint saved without megatron_xmod)")
    verify.set_defaults(func=run_verify)


def run_verify(args) -> int:
    directory = args.directory
    if not os.path.isdir(directory):
        raise ValueError(f"DIR: {directory} is not a directory; pass the run's --save directory")
    if args.all:
        targets = [(i, False) for i in checkpoints.iterations_found(directory)]
        if not targets:
            raise ValueError(f"DIR: {directory} holds no iter_* checkpoint")
    elif args.iteration is not None:
        targets = [(args.iteration, False)]
    else:
        tracked = checkpoints.read_tracker(directory)
        if tracked is None:
            raise ValueError(f"DIR: {directory} holds no checkpoint (no {checkpoints.TRACKER}, no iter_* directory)")
        targets = [tracked]
    failed = False
    for iteration, release in targets:
        name = checkpoints.iteration_dir_name(iteration, release)
        if not os.path.isdir(os.path.join(directory, name)):
            print(f"{name}: FAILED: {os.path.join(directory, name)} does not exist")
            failed = True
            continue
        if args.rewrite:
            iteration_dir = os.path.join(directory, name)
            algorithm = checkpoints.checksum_algorithm()
            entries = checkpoints.checksum_share(iteration_dir, checkpoints.checkpoint_files(iteration_dir), algorithm)
            path = checkpoints.write_manifest(directory, iteration, entries, algorithm, release)
            print(f"{name}: manifest rewritten from the files as they are: {path}")
            continue
        start = time.perf_counter()
        manifest, problems = checkpoints.verify_iteration(directory, iteration, release)
        seconds = time.perf_counter() - start
        if manifest is None:
            print(f"{name}: FAILED: no manifest {checkpoints.manifest_path(directory, iteration, release)} (saved "
                  "without megatron_xmod, or the run stopped between megatron's tracker and the manifest); "
                  f"--rewrite records the files as they are now")
            failed = True
        elif problems:
            print(f"{name}: FAILED")
            for problem in problems:
                print(f"  {problem}")
            failed = True
        else:
            size = sum(entry["size"] for entry in manifest["files"].values())
            print(f"{name}: OK ({len(manifest['files'])} files, {size / 2**20:.1f} MiB, {manifest['algorithm']}, "
                  f"{seconds:.2f} s)")
    return 1 if failed else 0


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="xmod")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ckpt", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as error:
        print(f"xmod ckpt: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
