"""What megatron_xmod hands to ``megatron.training.pretrain``, named in one object (in the manner of
torchtitan's ``TrainSpec``): the extra flags, the model and dataset providers, the forward step, the
callback that logs routing and compute after each of megatron's log lines, and the one that logs the
evaluation routing statistics after each validation (installed by the entry point as patches 13 and 20)."""
from __future__ import annotations

import dataclasses
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
    after_evaluation: Callable[[int, bool, float, str], object]
    log: RoutingLog


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
        after_evaluation=log.evaluation,
        log=log,
    )
