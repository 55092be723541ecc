"""The entry point (``python -m megatron_xmod.pretrain``) with one fault injected, for the reliability
tests: ``reliability_faults.py FAULT [entry-point arguments]``.

- ``nan-router:N``: the router weight of sparse layer N is NaN from the start (a corrupted weight
  that training must name instead of routing garbage).
"""
from __future__ import annotations

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


def main() -> None:
    fault, argv = sys.argv[1], sys.argv[2:]
    kind, _, value = fault.partition(":")
    if kind == "nan-router":
        _nan_router(int(value))
    else:
        raise SystemExit(f"fault: unknown {fault!r}")
    from megatron_xmod import pretrain

    sys.argv = [sys.argv[0]] + argv
    pretrain.main(argv)


if __name__ == "__main__":
    main()
