"""The entry point (``python -m megatron_xmod.pretrain``) with one fault injected, for the reliability
tests: ``reliability_faults.py FAULT [entry-point arguments]``.

- ``nan-router:N``: the router weight of sparse layer N is NaN from the start (a corrupted weight
  that training must name instead of routing garbage).
- ``kill-during-save:N``: at the save of iteration N, once megatron's distributed checkpoint wrote
  its files and before megatron's tracker names it, the largest file is cut to half its size and
  the process and its children are killed with SIGKILL (a node lost in the middle of a save).
"""
from __future__ import annotations

import os
import signal
import sys

import torch


def _nan_router(layer_number: int) -> None:
    from megatron_xmod.training import providers

    build = providers.build_model

    def build_model(*args, **kwargs):
        model = build(*args, **kwargs)
        for module in model.modules():
            if getattr(module, "layer_number", None) == layer_number and hasattr(module, "router"):
                with torch.no_grad():
                    module.router.weight.fill_(float("nan"))
        return model

    providers.build_model = build_model


def _kill_during_save(iteration: int) -> None:
    from megatron.core import dist_checkpointing

    save = dist_checkpointing.save

    def save_then_die(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if os.path.basename(os.path.normpath(str(checkpoint_dir))) == f"iter_{iteration:07d}":
            files = [os.path.join(root, name) for root, _, names in os.walk(checkpoint_dir) for name in names]
            largest = max(files, key=os.path.getsize)
            os.truncate(largest, os.path.getsize(largest) // 2)
            # the node dies: megatron's checkpoint writer processes (multiprocessing spawn) with it; alone,
            # they would outlive the training process and hold its stdout open
            import psutil

            for child in psutil.Process().children(recursive=True):
                child.kill()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die


def main() -> None:
    fault, argv = sys.argv[1], sys.argv[2:]
    kind, _, value = fault.partition(":")
    if kind == "nan-router":
        _nan_router(int(value))
    elif kind == "kill-during-save":
        _kill_during_save(int(value))
    else:
        raise SystemExit(f"fault: unknown {fault!r}")
    from megatron_xmod.training import pretrain

    sys.argv = [sys.argv[0]] + argv
    pretrain.main(argv)


if __name__ == "__main__":
    main()
