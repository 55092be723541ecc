"""Every change megatron_xmod makes to megatron-core 0.19.2's behaviour on every device, numbered, in one style.

Each patch is a wrapper of one megatron function (named with its file and line, relative to
``megatron/core`` or ``megatron/training`` of the wheel; re-check them when the pin moves), installed
through :func:`install`: once per process, marked with its number, listed by :func:`installed`.
What a patch calls back into (our log, our checks) is passed in by the caller, never imported here.
The CPU-only patches 1-11 and 21 are the CPU shim, :mod:`megatron_xmod.cpu_shim`.

- 12 :func:`skip_dataset_helper_build`: the wheel cannot rebuild its dataset helpers.
- 13 :func:`call_after_training_log`: our routing/compute log after megatron's own line.
- 14 :func:`no_log_writers` (the dry run only): argument validation that writes nothing.
- 16 :func:`validation_from_the_start` (unless ``--xmod-validation-continues``): every validation scores
  the same sequences.
- 17 :func:`checkpoint_integrity`: no save of non-finite weights, a checksum manifest after each save,
  verification before each load.
- 18 :func:`widen_pipeline_messages` (PP > 1 with sparse layers): the receive buffers hold the
  token-choice bias channels; the wrapper lives beside the message format it serves,
  :func:`megatron_xmod.pipeline.carry.widened_communicate`.
- 19 :func:`checks_before_tokenizer`: tokenizer files and output folders checked before megatron builds
  the tokenizer and the log writers.
- 20 :func:`call_after_evaluation`: the evaluation routing statistics after megatron's validation line.
- 22 :func:`capture_argument_dump`: megatron's ~850-line argument dump into a buffer (``--xmod-megatron-args``).
- 23 :func:`add_scalar_also_vs_flops`: tensorboard's ``lm loss`` curves written again against training FLOPs.
- 24 :func:`writer_survives_sigterm`: megatron's checkpoint-writer helper process ignores SIGTERM, so a
  preemption (SIGTERM to every process, ``--exit-signal-handler``) still saves.
- 25 :func:`disk_space_before_save`: free space checked against the checkpoint's size before megatron
  writes it; a save that still runs out of space names ENOSPC.
- 26 :func:`stop_on_zero_gradients` (fp16): a run whose gradients stay all-zero (loss scale underflow)
  stops with the reason.
- 27, 28 :func:`routing_state_kept_through_graph_capture`: megatron's CUDA-graph capture (local, TE) leaves
  the routing state as the training data left it.

Replaced by megatron's public extension points (numbers kept free): 15, the iteration that the
token-choice bias warm-up reads, is ``args.curr_iteration`` (training/training.py:3811), read by our
``forward_step``. Checked and kept: 18 (megatron's ``config.variable_seq_lengths`` would size the
buffers too, at the price of a shape exchange before every message); 21 (choosing the norm in the
block spec would leave Megatron-LM's ``--spec`` route, whose final norm megatron picks, on the assertion).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from collections.abc import Callable

_INSTALLED: dict[int, str] = {}


def install(number: int, owner, name: str, make_wrapper: Callable[[Callable], Callable]) -> Callable:
    """Replace ``owner.<name>`` by ``make_wrapper(original)``, once per process; returns the wrapper in
    place (the one installed earlier, when patch ``number`` is already there)."""
    current = getattr(owner, name)
    if getattr(current, "_xmod_patch", None) == number:
        return current
    wrapper = make_wrapper(current)
    wrapper._xmod_patch = number
    setattr(owner, name, wrapper)
    _INSTALLED[number] = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    return wrapper


def uninstall(number: int, owner, name: str) -> None:
    """Put megatron's own ``owner.<name>`` back where patch ``number`` is installed (for patches that
    live only for a block of work)."""
    current = getattr(owner, name)
    if getattr(current, "_xmod_patch", None) == number:
        setattr(owner, name, current.__wrapped__)
        _INSTALLED.pop(number, None)


def installed() -> dict[int, str]:
    """{patch number: the megatron attribute it replaced} of this process."""
    return dict(_INSTALLED)


def skip_dataset_helper_build() -> None:
    """12. training/initialize.py:176-178 ``_compile_dependencies`` calls
    ``megatron.core.datasets.utils.compile_helpers()``, i.e. ``make -C megatron/core/datasets``; the
    pip wheel ships the compiled helpers and no Makefile, so the build step can only fail there."""
    import megatron.core.datasets.utils as dataset_utils

    install(12, dataset_utils, "compile_helpers", lambda original: lambda: None)


def _call_after(number: int, name: str, arguments: Callable[[inspect.BoundArguments, float], tuple],
                callback: Callable) -> None:
    """Patch ``number``: ``megatron.training.training.<name>`` runs ``callback(*arguments(bound, seconds))``
    after each call (``bound``: the call's arguments with defaults applied, ``seconds``: its wall time).
    A later call only replaces the callback."""
    import megatron.training.training as training

    def make_wrapper(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            started = time.time()
            result = original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            wrapper.callback(*arguments(bound, time.time() - started))
            return result

        return wrapper

    install(number, training, name, make_wrapper).callback = callback


def call_after_training_log(callback: Callable[[int], None]) -> None:
    """13. training/training.py:2568 ``training_log(..., iteration, ...)``, called on every rank each
    iteration (training.py:3985): run ``callback(iteration)`` right after it, so our scalars go to the
    same console and tensorboard writer at the same interval."""
    _call_after(13, "training_log", lambda bound, seconds: (bound.arguments["iteration"],), callback)


def call_after_evaluation(callback: Callable[[int, bool, float, str], object]) -> None:
    """20. training/training.py:4342 ``evaluate_and_print_results`` (periodic validation, training.py:4040,
    and the evaluations after training, training.py:1483), called on every rank: run
    ``callback(iteration, write_to_tensorboard, seconds, split)`` after it, so the evaluation routing
    statistics land at the iteration of their validation (the last one included)."""
    _call_after(20, "evaluate_and_print_results",
                lambda bound, seconds: (bound.arguments["iteration"], bound.arguments["write_to_tensorboard"],
                                        seconds, split_of(bound.arguments["prefix"])), callback)


def split_of(prefix: str) -> str:
    """megatron names the held-out set only in the console prefix: ``iteration N on test set``."""
    return "test" if "test set" in str(prefix) else "validation"


def no_log_writers() -> None:
    """14. training/global_vars.py:139-141 ``set_global_variables`` creates the tensorboard, wandb and
    one-logger writers (and with them the run's folders) while megatron validates the arguments; a
    dry run must write nothing, so these three become no-ops (the tokenizer is still built)."""
    import megatron.training.global_vars as global_vars

    for name in ("_set_tensorboard_writer", "_set_wandb_writer", "_set_one_logger"):
        install(14, global_vars, name, lambda original: lambda args: None)


def validation_from_the_start() -> None:
    """16. training/training.py:4579 builds the validation loader at ``args.consumed_valid_samples``
    and ``evaluate`` (training.py:4160) continues its iterator, so each periodic validation scores
    the next ``eval_iters`` batches and a curve mixes batch difficulty with progress. Here the
    validation iterators built by ``build_train_valid_test_data_iterators`` (training.py:4601) restart
    from the first validation sample at every ``evaluate`` call: every point of a run's curve, and
    every run, is scored on the same sequences. The test iterator is untouched."""
    import megatron.training.training as training
    from megatron.core.rerun_state_machine import RerunDataIterator

    class ValidationFromTheStart(RerunDataIterator):
        def __init__(self, dataset):
            self.dataset = dataset
            super().__init__(self._fresh())

        def _fresh(self):
            return iter(training.cyclic_iter(training.build_pretraining_data_loader(self.dataset, 0)))

        def restart(self) -> None:
            self.iterable = self._fresh()
            self.advance()

    valid_datasets: list = []

    def loaders_wrapper(build_loaders):
        @functools.wraps(build_loaders)
        def build_train_valid_test_data_loaders(*args, **kwargs):
            loaders = build_loaders(*args, **kwargs)
            valid_datasets[:] = [getattr(loader, "dataset", None) for loader in (loaders[1] or [])]
            return loaders

        return build_train_valid_test_data_loaders

    def iterators_wrapper(build_iterators):
        @functools.wraps(build_iterators)
        def build_train_valid_test_data_iterators(*args, **kwargs):
            train_iterator, valid_iterators, test_iterator = build_iterators(*args, **kwargs)
            if valid_iterators is None or training.get_args().dataloader_type == "external":
                return train_iterator, valid_iterators, test_iterator
            if isinstance(valid_iterators, list):
                valid_iterators = [it if it is None or dataset is None else ValidationFromTheStart(dataset)
                                   for it, dataset in zip(valid_iterators, valid_datasets)]
            elif valid_datasets and valid_datasets[0] is not None:
                valid_iterators = ValidationFromTheStart(valid_datasets[0])
            return train_iterator, valid_iterators, test_iterator

        return build_train_valid_test_data_iterators

    def evaluate_wrapper(evaluate):
        @functools.wraps(evaluate)
        def evaluate_from_the_start(forward_step_func, data_iterator, *args, **kwargs):
            for iterator in data_iterator if isinstance(data_iterator, list) else [data_iterator]:
                if isinstance(iterator, ValidationFromTheStart):
                    iterator.restart()
            return evaluate(forward_step_func, data_iterator, *args, **kwargs)

        return evaluate_from_the_start

    if getattr(training.evaluate, "_xmod_patch", None) == 16:
        return  # one ValidationFromTheStart class and one dataset list per process
    install(16, training, "build_train_valid_test_data_loaders", loaders_wrapper)
    install(16, training, "build_train_valid_test_data_iterators", iterators_wrapper)
    install(16, training, "evaluate", evaluate_wrapper)


def checkpoint_integrity(guard) -> None:
    """17. training/training.py:138-142 import ``save_checkpoint`` / ``load_checkpoint`` from
    training/checkpointing.py (save at training.py:2181/2273/3086, load at training.py:2199). Wrap
    both names in training.py, calling ``guard`` (:mod:`megatron_xmod.training.checkpoints`):

    - save: refuse non-finite weights (every rank, before megatron writes anything); set aside a
      directory of the same iteration left by an interrupted save (megatron refuses to save into a
      non-empty one, dist_checkpointing/serialization.py:420); after megatron's
      save (tracker written), the checksum manifest. With ``--async-save`` the files are not complete
      when megatron returns, so no manifest is written (a warning says so). training.py:3871 saves on
      the NaN/rerun exit path even without ``--save`` (``os.path.join(None, ...)``: TypeError); here
      that is a message and megatron's own non-zero exit code follows.
    - load: verify the iteration the tracker (or ``--ckpt-step``) names before megatron reads it."""
    import megatron.training.training as training

    def save_wrapper(save):
        signature = inspect.signature(save)

        @functools.wraps(save)
        def save_checkpoint(*args, **kwargs):
            from megatron.training import get_args, print_rank_0

            run_args = get_args()
            bound = signature.bind(*args, **kwargs).arguments
            iteration, release = bound["iteration"], bool(bound.get("release", False))
            if run_args.save is None:
                print_rank_0(f"[xmod] no checkpoint written at iteration {iteration}: megatron asked for one on its "
                             "exit path (after a NaN/Inf or a failed result validation; see the messages above) but "
                             "the run has no --save; pass --save DIR to keep the state for a diagnostic resume")
                return None
            model = bound["model"]
            save_checkpoint.guard.check_finite_before_save(model if isinstance(model, (list, tuple)) else [model],
                                                           iteration)
            if not bound.get("non_persistent_ckpt", False):
                save_checkpoint.guard.set_aside_incomplete(run_args.save, iteration, release)
            result = save(*args, **kwargs)
            if bound.get("non_persistent_ckpt", False):
                return result
            if run_args.async_save:
                print_rank_0(f"[xmod] WARNING: --async-save: no checksum manifest for iteration {iteration}")
                return result
            from megatron_xmod.training import run_identity  # issue 27: the run's identity, before the manifest

            run_identity.write_record(run_args, run_args.save, iteration, release)
            save_checkpoint.guard.manifest_after_save(run_args.save, iteration, release)
            return result

        return save_checkpoint

    def load_wrapper(load):
        @functools.wraps(load)
        def load_checkpoint(*args, **kwargs):
            from megatron.training import get_args

            run_args = get_args()
            load_dir = getattr(run_args, kwargs.get("load_arg", "load"), None)
            if load_dir is not None and not getattr(run_args, "non_persistent_ckpt_type", None):
                load_checkpoint.guard.verify_before_load(load_dir, getattr(run_args, "ckpt_step", None))
            return load(*args, **kwargs)

        return load_checkpoint

    install(17, training, "save_checkpoint", save_wrapper).guard = guard
    install(17, training, "load_checkpoint", load_wrapper).guard = guard


def widen_pipeline_messages() -> None:
    """18. pipeline_parallel/p2p_communication.py:275 ``P2PCommunicator._communicate`` allocates its
    receive buffers with the schedule's ``tensor_shape`` = (seq, micro-batch, hidden_size)
    (schedules.py:1157 interleaved, :2116 1F1B). Models whose chunks append the token-choice bias
    channels receive ``hidden_size + channels``: :func:`megatron_xmod.pipeline.carry.widened_communicate`."""
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron_xmod.pipeline.carry import widened_communicate

    install(18, p2p_communication.P2PCommunicator, "_communicate", widened_communicate)


def checks_before_tokenizer(check: Callable) -> None:
    """19. training/global_vars.py:138 ``_build_tokenizer`` (inside ``parse_and_validate_args``) calls
    ``build_tokenizer(args)`` (global_vars.py:200), then creates the tensorboard/wandb writers: run
    ``check(args)`` first (the entry point's pre-flight checks), so a missing or bad tokenizer file, or an
    unwritable ``--save``/``--tensorboard-dir``, is named before anything is built or fetched."""
    import megatron.training.global_vars as global_vars

    def make_wrapper(build):
        @functools.wraps(build)
        def build_tokenizer(args, *rest, **kwargs):
            build_tokenizer.check(args)
            return build(args, *rest, **kwargs)

        return build_tokenizer

    install(19, global_vars, "build_tokenizer", make_wrapper).check = check


def capture_argument_dump(buffer) -> Callable[[], None]:
    """22. training/arguments.py ``_print_args`` prints megatron's ~850-line argument dump (rank 0) while
    ``parse_and_validate_args`` runs: print it into ``buffer`` instead (the entry point then keeps it where
    ``--xmod-megatron-args`` says). Returns the function that restores megatron's printing."""
    import contextlib

    import megatron.training.arguments as arguments

    def make_wrapper(original):
        @functools.wraps(original)  # sets __wrapped__, which uninstall() puts back
        def print_args(title, args):
            with contextlib.redirect_stdout(print_args.buffer):
                original(title, args)

        return print_args

    install(22, arguments, "_print_args", make_wrapper).buffer = buffer
    return functools.partial(uninstall, 22, arguments, "_print_args")


def add_scalar_also_vs_flops(writer, tags: tuple[str, ...], flops: Callable[[], float | None],
                             unit: float = 1e6) -> None:
    """23. ``writer.add_scalar`` of megatron's tensorboard writer (training/global_vars.py:153, torch's
    ``SummaryWriter``), which megatron's ``training_log`` and ``evaluate_and_print_results`` call for
    ``lm loss`` and its validation: each of ``tags`` is written again as ``<tag> vs training MFLOPs``
    at step ``flops() / unit`` (tensorboard steps are 64-bit integers), for compute-matched curves."""

    def make_wrapper(add_scalar):
        @functools.wraps(add_scalar)
        def add_scalar_and_flops(tag, value, global_step=None, *rest, **kwargs):
            add_scalar(tag, value, global_step, *rest, **kwargs)
            if tag in tags:
                total = flops()
                if total is not None:
                    add_scalar(f"{tag} vs training MFLOPs", value, int(round(total / unit)))

        return add_scalar_and_flops

    install(23, writer, "add_scalar", make_wrapper)


def writer_survives_sigterm() -> None:
    """24. core/dist_checkpointing/strategies/filesystem_async.py:53-66 ``get_write_results_queue``
    (called by ``FileSystemWriterAsync.prepare_write_data``, filesystem_async.py:200, on every save,
    synchronous ones included) starts a ``multiprocessing`` Manager server process the first time and
    keeps its queue in the module's ``_results_queue``. SLURM's preemption (``--signal=TERM@...``) and
    ``kill -TERM`` of a job's processes send SIGTERM to every process, that helper included: it dies,
    and the save that megatron's signal handler (training/training.py:3247-3259) then starts fails with
    ``BrokenPipeError``. Here the helper is started with SIGTERM ignored (and exits when the training
    process is gone, so it never outlives it); its queue, the same kind of object, one per process, is
    kept on the wrapper (megatron's ``_results_queue`` stays None, as training/async_utils.py's import
    of it always saw it)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def make_wrapper(original):
        @functools.wraps(original)
        def get_write_results_queue(mp_mode: str = "spawn"):
            if get_write_results_queue.queue is None:
                import multiprocessing.managers

                import torch.multiprocessing as mp

                manager = multiprocessing.managers.SyncManager(ctx=mp.get_context(mp_mode))
                manager.start(initializer=_ignore_sigterm_while_parent_lives)
                get_write_results_queue.queue = manager.Queue()
            return get_write_results_queue.queue

        get_write_results_queue.queue = None

        return get_write_results_queue

    install(24, filesystem_async, "get_write_results_queue", make_wrapper)


def _ignore_sigterm_while_parent_lives() -> None:
    """Patch 24's helper process: ignore SIGTERM; exit once the process that started it is gone."""
    import multiprocessing
    import multiprocessing.connection
    import os
    import signal
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="xmod-parent-watch").start()


def disk_space_before_save(guard) -> None:
    """25. training/checkpointing.py:827 ``dist_checkpointing.save(state_dict, checkpoint_name, ...)``
    (core/dist_checkpointing/serialization.py:349 ``save``, called on every rank) writes the ``iter_*``
    folder. Before it: ``guard.check_free_space(folder, bytes)`` with the size of the last complete
    checkpoint (else this save's own tensors, summed over the ranks), decided together by all ranks so
    none is left waiting in the save's collectives; after a failure, ``guard.name_disk_full`` turns a
    full disk (ENOSPC, or torch's ``inline_container.cc ... unexpected pos``) into a message naming it
    (``guard``: :mod:`megatron_xmod.training.checkpoints`)."""
    from megatron.core import dist_checkpointing

    def make_wrapper(save):
        @functools.wraps(save)
        def save_with_space(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            guard = save_with_space.guard
            folder = str(checkpoint_dir)
            previous = guard.latest_complete_size(os.path.dirname(os.path.abspath(folder)))
            needed = previous[1] if previous else _main_replica_bytes(sharded_state_dict)
            refusals = guard._gather(_refusal(guard, folder, needed, previous is not None))
            refused = next((text for text in refusals if text), None)
            if refused:
                raise guard.CheckpointError(refused)
            try:
                return save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            except Exception as error:
                named = guard.name_disk_full(error, folder)
                if named is not None:
                    raise named from error
                raise

        return save_with_space

    install(25, dist_checkpointing, "save", make_wrapper).guard = guard


def _refusal(guard, folder: str, needed: int, whole: bool):
    """This rank's refusal text (None: enough space). ``whole``: ``needed`` is a whole checkpoint's size,
    checked by rank 0 alone; else this rank's own share, summed by every rank's check."""
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if whole and rank != 0:
        return None
    try:
        guard.check_free_space(folder, needed if whole else needed * world)
    except guard.CheckpointError as error:
        return str(error)
    return None


def _main_replica_bytes(sharded_state_dict) -> int:
    """Bytes of the tensors this rank writes (main replicas only); 0 when the state cannot be read."""
    try:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

        return sum(value.data.numel() * value.data.element_size() for value in nested_values(sharded_state_dict)
                   if isinstance(value, ShardedTensor) and value.data is not None
                   and is_main_replica(value.replica_id))
    except Exception:
        return 0


def stop_on_zero_gradients(patience: int = 3) -> None:
    """26. training/training.py:2336 ``train_step`` returns the iteration's global ``grad_norm``
    (index 5, all-reduced: every rank sees the same; called at training.py:3856). With ``--fp16`` a loss
    scale so small that every gradient underflows (``--loss-scale 1e-30``) trains on with grad norm 0.0
    and exit 0, updating nothing: after ``patience`` such iterations in a row, stop (ValueError on every
    rank, the entry point's exit 2) naming the loss scale and the fix."""
    import megatron.training.training as training

    def make_wrapper(train_step):
        zeros = [0]

        @functools.wraps(train_step)
        def train_step_watched(*args, **kwargs):
            result = train_step(*args, **kwargs)
            run_args = training.get_args()
            grad_norm, skipped = result[5], result[1]
            if not getattr(run_args, "fp16", False) or skipped or grad_norm is None:
                return result
            zeros[0] = zeros[0] + 1 if float(grad_norm) == 0.0 else 0
            if zeros[0] >= patience:
                optimizer = kwargs.get("optimizer", args[3] if len(args) > 3 else None)
                try:
                    scale = float(optimizer.get_loss_scale())
                except Exception:
                    scale = getattr(run_args, "loss_scale", None)
                scale = "unknown" if scale is None else f"{scale:g}"
                raise ValueError(
                    f"fp16: the gradients were all zero for {zeros[0]} iterations in a row (grad norm 0.0 at a loss "
                    f"scale of {scale}): they underflow in fp16 and the weights do not change. Drop --loss-scale "
                    "to use dynamic loss scaling (or give --initial-loss-scale 65536 / a --loss-scale of 2**10 to "
                    "2**16), or train with --bf16")
            return result

        return train_step_watched

    install(26, training, "train_step", make_wrapper)


def routing_state_kept_through_graph_capture(kept_through: Callable) -> None:
    """27 and 28. megatron's CUDA-graph capture runs every captured layer on sample inputs (its warm-up
    iterations, then the capture itself, forward and backward): ``--cuda-graph-impl local`` in
    core/transformer/cuda_graphs.py:533 ``_CudagraphGlobalRecord.create_cudagraphs`` (27; called after
    the forward-backward of the step that recorded the layers, core/pipeline_parallel/schedules.py:862),
    ``transformer_engine`` in cuda_graphs.py:2712 ``TECudaGraphHelper.create_cudagraphs`` (28; called
    before the step, training/training.py:3792). ``kept_through(modules)`` (megatron_xmod.xmod.routing_state)
    writes the routing state of the captured layers back as it was, and :func:`_moe_metrics_kept` megatron's
    MoE metrics (load-balancing and z-losses; megatron itself keeps them only around a local capture of its
    MoETransformerLayer, which GPT's MoE layers are not, and zeroes them after a TE capture, values from
    before it included), so the first log interval's statistics and losses, and the DTop-p controller's
    activation counters, are those of the training data alone."""
    from megatron.core.transformer import cuda_graphs

    def around_local(create_cudagraphs):  # a classmethod: ``create_cudagraphs`` is bound to the class
        @functools.wraps(create_cudagraphs.__func__)
        def create_cudagraphs_keeping_routing_state(cls):
            with kept_through([entry[0].base_module for entry in cls.cudagraph_record]), _moe_metrics_kept():
                return create_cudagraphs.__func__(cls)

        create_cudagraphs_keeping_routing_state._xmod_patch = 27  # seen through the bound method
        create_cudagraphs_keeping_routing_state.__wrapped__ = classmethod(create_cudagraphs.__func__)  # uninstall()
        return classmethod(create_cudagraphs_keeping_routing_state)

    def around_te(create_cudagraphs):
        @functools.wraps(create_cudagraphs)
        def create_cudagraphs_keeping_routing_state(helper):
            with kept_through(helper.model), _moe_metrics_kept():
                return create_cudagraphs(helper)

        return create_cudagraphs_keeping_routing_state

    install(27, cuda_graphs._CudagraphGlobalRecord, "create_cudagraphs", around_local)
    install(28, cuda_graphs.TECudaGraphHelper, "create_cudagraphs", around_te)


@contextlib.contextmanager
def _moe_metrics_kept():
    """megatron's MoE metrics tracker (moe/moe_logging.py) as it was before the block, in place; a metric
    created during it goes back to zeros."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = get_moe_metrics_tracker().metrics
    saved = {name: entry.values.clone() for name, entry in metrics.items()}
    try:
        yield
    finally:
        for name, entry in metrics.items():
            before = saved.get(name)
            if before is not None and before.shape == entry.values.shape:
                entry.values.copy_(before)
            else:
                entry.values.zero_()
