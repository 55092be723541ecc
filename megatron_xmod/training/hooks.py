"""What megatron_xmod hands to ``megatron.training.pretrain``, named in one object (in the manner of
torchtitan's ``TrainSpec``): the extra flags, the model and dataset providers, the forward step, the
callback that logs routing and compute after each of megatron's log lines, and the one that logs the
evaluation routing statistics after each validation."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable

from megatron_xmod.training import flags, providers, step
from megatron_xmod.training.log import RoutingLog


@dataclasses.dataclass
class TrainHooks:
    extra_args_provider: Callable
    model_provider: Callable
    datasets_provider: Callable
    forward_step: Callable
    after_training_log: Callable[[int], None]
    log: RoutingLog

    def install_evaluation_log(self) -> None:
        call_after_evaluation(self.log.evaluation)


def xmod_train_hooks() -> TrainHooks:
    """Hooks for one run: the model provider hands every chunk it builds to the run's log."""
    log = RoutingLog()

    def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        from megatron.training import get_args

        args = get_args()
        model = providers.build_model(args, pre_process=pre_process, post_process=post_process,
                                      vp_stage=vp_stage, pg_collection=pg_collection)
        log.model_chunks.append(model)
        log.setup(args)
        return model

    return TrainHooks(
        extra_args_provider=flags.add_arguments,
        model_provider=model_provider,
        datasets_provider=providers.train_valid_test_datasets_provider,
        forward_step=step.forward_step,
        after_training_log=log,
        log=log,
    )


def call_after_evaluation(callback: Callable[..., object]) -> None:
    """training/training.py:4342 ``evaluate_and_print_results`` (periodic validation, training.py:4040,
    and the validation after training, training.py:1483), called on every rank: run
    ``callback(iteration, write_to_tensorboard, seconds, split)`` after it, so the evaluation routing
    statistics land at the iteration of their validation (the last one included). Installed once per
    process; a later call only replaces the callback. (A wrapper of megatron like those of
    :mod:`megatron_xmod.training.patches`, kept beside its callback.)"""
    import megatron.training.training as training

    original = training.evaluate_and_print_results
    if getattr(original, "_xmod_callback", None) is not None:
        original._xmod_callback = callback
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate_and_print_results(*args, **kwargs):
        started = time.time()
        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        evaluate_and_print_results._xmod_callback(bound.arguments["iteration"], bound.arguments["write_to_tensorboard"],
                                                  time.time() - started, split_of(bound.arguments["prefix"]))
        return result

    evaluate_and_print_results._xmod_callback = callback
    training.evaluate_and_print_results = evaluate_and_print_results


def split_of(prefix: str) -> str:
    """megatron names the held-out set only in the console prefix: ``iteration N on test set``."""
    return "test" if "test set" in str(prefix) else "validation"
