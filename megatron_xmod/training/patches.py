"""Every change megatron_xmod makes to megatron-core 0.19.2 from outside, numbered, in one place.

Each patch names the megatron line it targets (paths relative to ``megatron/core`` or
``megatron/training`` of the megatron-core 0.19.2 wheel); re-check them when the pin moves.

- 1-11, :func:`cpu_patches`: run megatron-core (and ``megatron.training.pretrain``) on a machine
  without a GPU. No-ops when ``torch.cuda.is_available()``: GPU runs never see them. The CUDA
  build of torch imports fine without a driver but every CUDA call raises, and megatron calls CUDA
  unconditionally in a handful of places. Use ``with cpu_patches(training=...):`` around the work;
  the torch-function mode of patch 3 is entered on the way in and exited on the way out.
  Patch 21 (also in this group): the local-spec norm under sequence parallelism.
- 12, :func:`skip_dataset_helper_build` (every device): the wheel cannot rebuild its dataset helpers.
- 13, :func:`call_after_training_log` (every device): our routing/compute log after megatron's own.
- 14, :func:`no_log_writers` (the dry run only): validation that writes nothing.
- 15, :func:`iteration_to_routing_state` (every device): the token-choice bias warm-up's clock.
- 16, :func:`validation_from_the_start` (every device, unless ``--xmod-validation-continues``): every
  validation scores the same sequences.
- 17, :func:`checkpoint_integrity` (every device): no save of non-finite weights, a checksum manifest
  after each save, verification before each load (:mod:`megatron_xmod.training.checkpoints`), and a
  message instead of a TypeError when megatron's exit path asks for a save without ``--save``.
- 18, :func:`widen_pipeline_messages` (every device, PP > 1 with sparse layers): pipeline messages
  carry the token-choice bias channels (:mod:`megatron_xmod.pipeline.carry`).
- 19, :func:`checks_before_tokenizer` (every device): tokenizer files and output directories checked
  before megatron builds the tokenizer (no model-hub look-up) and the log writers.
- 20, :func:`call_after_evaluation` (every device): the evaluation routing statistics after megatron's
  validation line.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

_installed = {"core": False, "training": False}


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites tensor factories' ``device="cuda"`` (or an int device) to the CPU.

    pipeline_parallel/schedules.py:749/1121/2292 ``torch.zeros([], device="cuda")``,
    training/initialize.py JIT warm-up tensors, ``tensor.cuda()`` calls in checkpointing, and
    ``tensor.type() == "torch.cuda.FloatTensor"`` checks in the optimizer and DDP buffers.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (str(device).startswith("cuda") or isinstance(device, int)):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _NullEvent:
    def __init__(self, *args, **kwargs): ...
    def record(self, *args, **kwargs): ...
    def wait(self, *args, **kwargs): ...
    def synchronize(self): ...
    def query(self): return True
    def elapsed_time(self, other): return 0.0


class _NullStream:
    """A singleton, so megatron's ``current_stream() != communication_stream`` is False."""

    _instance = None

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, *args, **kwargs): ...
    def wait_event(self, *args, **kwargs): ...
    def synchronize(self): ...
    def record_event(self, *args, **kwargs): return _NullEvent()


def _with_one_fake_device(fn):
    """training/initialize.py skips ``mpu.initialize_model_parallel`` and the model-parallel seed
    when ``torch.cuda.device_count() == 0``; report one device (and ignore set_device) meanwhile."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda *_: None)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = device_count, set_device

    return wrapper


def cpu_mode() -> bool:
    return not torch.cuda.is_available()


@contextlib.contextmanager
def cpu_patches(training: bool = True):
    """Patch megatron for CPU/gloo (``training=False``: megatron-core only) for the duration of the
    block; yields True when the patches are active (no CUDA device). The module patches stay
    installed (idempotent); the device-rewriting torch-function mode lives only inside the block."""
    if not cpu_mode():
        yield False
        return
    if not _installed["core"]:
        _install_core()
        _installed["core"] = True
    if training and not _installed["training"]:
        _install_training()
        _installed["training"] = True
    # 3. mode: hard-coded device="cuda" tensors (see _CudaDeviceToCpu).
    with _CudaDeviceToCpu():
        yield True


def _install_core() -> None:
    cuda = torch.cuda
    import megatron.core.tensor_parallel.random as tp_random

    # 1. rng: tensor_parallel/random.py:104/135 and :303 (CudaRNGStatesTracker.add/fork) read and
    #    write the CUDA generator; on CPU the tracker's states live on the CPU generator.
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    cuda.manual_seed = torch.manual_seed
    logging.getLogger(tp_random.__name__).setLevel(logging.ERROR)
    # 2. dev: utils.py:715 (GlobalMemoryBuffer) and DDP buffers allocate on current_device().
    cuda.current_device = lambda: torch.device("cpu")
    # 3. (entered by cpu_patches) _CudaDeviceToCpu.
    # 4. sync/stream: p2p_communication.py:263/419 torch.cuda.synchronize(), timers;
    #    distributed/param_and_grad_buffer.py:632/691 current_stream()/Stream() for overlapped
    #    grad reduction; training.py torch.cuda.Stream(); empty_cache in checkpointing.
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.current_stream = cuda.default_stream = lambda *args, **kwargs: _NullStream()
    cuda.Stream, cuda.Event = _NullStream, _NullEvent
    cuda.empty_cache = lambda: None
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    # 5. moe: transformer/moe token dispatchers keep alltoall split sizes as tensors that gloo's
    #    all_to_all_single rejects; megatron moves them to host only when CUDA is used.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def _to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.detach().cpu().numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    # 21. sp-norm: transformer/torch_norm.py:50 WrappedTorchNorm.__new__ asserts not
    #     config.sequence_parallel; GPU runs use TransformerEngine's TENorm, which supports it.
    _sequence_parallel_torch_norm()


class _ConfigWithoutSequenceParallel:
    """``config`` as WrappedTorchNorm reads it, with ``sequence_parallel`` False (patch 21)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return False if name == "sequence_parallel" else getattr(self._config, name)


def _sequence_parallel_torch_norm() -> None:
    """21. transformer/torch_norm.py:50 ``WrappedTorchNorm.__new__`` asserts ``not
    config.sequence_parallel``, so the local spec (every CPU run) cannot use sequence parallelism.
    A norm is elementwise along the sequence, so on a sequence shard torch's LayerNorm/RMSNorm is
    right as is; only its weight gradients are partial sums over this rank's tokens. As
    TransformerEngine's TENorm does, the norm's parameters are tagged ``sequence_parallel = True``,
    and megatron's finalize_model_grads all-reduces them across the TP group
    (distributed/finalize_model_grads.py ``_allreduce_non_tensor_model_parallel_grads``). megatron's
    other assertions (zero-centred gamma, persist / memory-efficient layer norm) still apply. The
    class is patched in place, since the layer specs hold it (models/gpt/gpt_layer_specs.py:75
    ``LNImpl = WrappedTorchNorm``); without sequence parallelism nothing changes."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_xmod_sequence_parallel", False):
        return

    @functools.wraps(original)
    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        norm = original(cls, _ConfigWithoutSequenceParallel(config), *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm

    __new__._xmod_sequence_parallel = True
    WrappedTorchNorm.__new__ = __new__


def _install_training() -> None:
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    # 6. training/initialize.py:66 asserts CUDA unless allow_no_cuda=True, which pretrain() never passes.
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    # 7. initialize._initialize_distributed / _set_random_seed gate on device_count() > 0.
    initialize._initialize_distributed = _with_one_fake_device(initialize._initialize_distributed)
    initialize._set_random_seed = _with_one_fake_device(initialize._set_random_seed)
    # 8. (not CPU-specific: patch 12) _compile_dependencies runs `make -C megatron/core/datasets`.
    # 9. arguments.py:1414 get_device_arch_version() queries cuda:0 properties when TP/CP > 1,
    #    and arguments.py:1437 wants CUDA_DEVICE_MAX_CONNECTIONS=1.
    arguments.get_device_arch_version = lambda: 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # 11. training.py:1117 set_jit_fusion_options -> initialize.py:508-547 warms the fused kernels up
    #     with torch.rand(..., device="cuda") in sizes that depend on the TP size. On a GPU that draws
    #     from the CUDA generator; here it would draw from the CPU generator that --use-cpu-
    #     initialization uses next, so TP=1 and TP=2 would start from different weights.
    warmup = training.set_jit_fusion_options

    @functools.wraps(warmup)
    def set_jit_fusion_options(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return warmup(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    training.set_jit_fusion_options = set_jit_fusion_options
    # 10. Distributed optimizer without Apex/TE falls back to torch AdamW, whose state is empty
    #     before the first step: distrib_optimizer.py:839 `assert len(steps) == 1` on save, and
    #     distrib_optimizer.py:1225 copies into a view of a leaf that requires grad on load.
    from megatron.core.optimizer import distrib_optimizer

    original_state_dict = distrib_optimizer.DistributedOptimizer.state_dict

    def state_dict(self):
        if not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return original_state_dict(self)

    distrib_optimizer.DistributedOptimizer.state_dict = state_dict
    setter = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states
    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = torch.no_grad()(setter)


def skip_dataset_helper_build() -> None:
    """12. training/initialize.py:176-178 ``_compile_dependencies`` calls
    ``megatron.core.datasets.utils.compile_helpers()``, i.e. ``make -C megatron/core/datasets``; the
    pip wheel ships the compiled helpers and no Makefile, so the build step can only fail there."""
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def _call_after(name: str, arguments: Callable[[inspect.BoundArguments, float], tuple], callback: Callable) -> None:
    """Wrap ``megatron.training.training.<name>`` once per process so that ``callback(*arguments(bound,
    seconds))`` runs after each call (``bound``: the call's arguments with defaults applied, ``seconds``:
    its wall time). A later install only replaces the callback."""
    import megatron.training.training as training

    original = getattr(training, name)
    if getattr(original, "_xmod_callback", None) is not None:
        original._xmod_callback = callback
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.time()
        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        wrapper._xmod_callback(*arguments(bound, time.time() - started))
        return result

    wrapper._xmod_callback = callback
    setattr(training, name, wrapper)


def call_after_training_log(callback: Callable[[int], None]) -> None:
    """13. training/training.py:2568 ``training_log(..., iteration, ...)``, called on every rank each
    iteration (training.py:3985): run ``callback(iteration)`` right after it, so our scalars go to the
    same console and tensorboard writer at the same interval."""
    _call_after("training_log", lambda bound, seconds: (bound.arguments["iteration"],), callback)


def call_after_evaluation(callback: Callable[[int, bool, float, str], object]) -> None:
    """20. training/training.py:4342 ``evaluate_and_print_results`` (periodic validation, training.py:4040,
    and the evaluations after training, training.py:1483), called on every rank: run
    ``callback(iteration, write_to_tensorboard, seconds, split)`` after it, so the evaluation routing
    statistics land at the iteration of their validation (the last one included)."""
    _call_after("evaluate_and_print_results",
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
        setattr(global_vars, name, lambda args: None)


def iteration_to_routing_state() -> None:
    """15. training/training.py:3856 ``train_step(..., iteration=iteration, ...)``: before each step,
    hand the iteration to the routing states of the model chunks (``RoutingState.iteration``), which
    the token-choice bias warm-up reads (``--xmod-token-choice-bias-tau-warmup``). A resumed run gets
    the right value too, since megatron passes the restored iteration. Installed once per process."""
    import megatron.training.training as training

    original = training.train_step
    if getattr(original, "_xmod_iteration", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        from megatron_xmod.xmod.routing_state import routing_states

        bound = signature.bind(*args, **kwargs).arguments
        iteration = bound.get("iteration")
        if iteration is None:
            from megatron.training import get_args

            iteration = get_args().curr_iteration
        for state in routing_states(bound["model"]):
            state.iteration = int(iteration)
        return original(*args, **kwargs)

    train_step._xmod_iteration = True
    training.train_step = train_step


def validation_from_the_start() -> None:
    """16. training/training.py:4579 builds the validation loader at ``args.consumed_valid_samples``
    and ``evaluate`` (training.py:4160) continues its iterator, so each periodic validation scores
    the next ``eval_iters`` batches and a curve mixes batch difficulty with progress. Here the
    validation iterators built by ``build_train_valid_test_data_iterators`` (training.py:4601) restart
    from the first validation sample at every ``evaluate`` call: every point of a run's curve, and
    every run, is scored on the same sequences. The test iterator is untouched. Installed once."""
    import megatron.training.training as training
    from megatron.core.rerun_state_machine import RerunDataIterator

    if getattr(training.evaluate, "_xmod_from_the_start", False):
        return

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
    build_loaders, build_iterators, evaluate = (training.build_train_valid_test_data_loaders,
                                                training.build_train_valid_test_data_iterators, training.evaluate)

    @functools.wraps(build_loaders)
    def build_train_valid_test_data_loaders(*args, **kwargs):
        loaders = build_loaders(*args, **kwargs)
        valid_datasets[:] = [getattr(loader, "dataset", None) for loader in (loaders[1] or [])]
        return loaders

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

    @functools.wraps(evaluate)
    def evaluate_from_the_start(forward_step_func, data_iterator, *args, **kwargs):
        for iterator in data_iterator if isinstance(data_iterator, list) else [data_iterator]:
            if isinstance(iterator, ValidationFromTheStart):
                iterator.restart()
        return evaluate(forward_step_func, data_iterator, *args, **kwargs)

    evaluate_from_the_start._xmod_from_the_start = True
    training.build_train_valid_test_data_loaders = build_train_valid_test_data_loaders
    training.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators
    training.evaluate = evaluate_from_the_start


def checkpoint_integrity() -> None:
    """17. training/training.py:138-142 import ``save_checkpoint`` / ``load_checkpoint`` from
    training/checkpointing.py (save at training.py:2181/2273/3086, load at training.py:2199). Wrap
    both names in training.py (see :mod:`megatron_xmod.training.checkpoints`):

    - save: refuse non-finite weights (every rank, before megatron writes anything); set aside a
      directory of the same iteration left by an interrupted save (megatron refuses to save into a
      non-empty one, dist_checkpointing/serialization.py:420); after megatron's
      save (tracker written), the checksum manifest. With ``--async-save`` the files are not complete
      when megatron returns, so no manifest is written (a warning says so). training.py:3871 saves on
      the NaN/rerun exit path even without ``--save`` (``os.path.join(None, ...)``: TypeError); here
      that is a message and megatron's own non-zero exit code follows.
    - load: verify the iteration the tracker (or ``--ckpt-step``) names before megatron reads it.
    Installed once per process."""
    import megatron.training.training as training

    from megatron_xmod.training import checkpoints

    if getattr(training.save_checkpoint, "_xmod_integrity", False):
        return
    save, load = training.save_checkpoint, training.load_checkpoint
    save_signature = inspect.signature(save)

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        from megatron.training import get_args, print_rank_0

        run_args = get_args()
        bound = save_signature.bind(*args, **kwargs).arguments
        iteration, release = bound["iteration"], bool(bound.get("release", False))
        if run_args.save is None:
            print_rank_0(f"[xmod] no checkpoint written at iteration {iteration}: megatron asked for one on its exit "
                         "path (after a NaN/Inf or a failed result validation; see the messages above) but the run "
                         "has no --save; pass --save DIR to keep the state for a diagnostic resume")
            return None
        model = bound["model"]
        checkpoints.check_finite_before_save(model if isinstance(model, (list, tuple)) else [model], iteration)
        if not bound.get("non_persistent_ckpt", False):
            checkpoints.set_aside_incomplete(run_args.save, iteration, release)
        result = save(*args, **kwargs)
        if bound.get("non_persistent_ckpt", False):
            return result
        if run_args.async_save:
            print_rank_0(f"[xmod] WARNING: --async-save: no checksum manifest for iteration {iteration}")
            return result
        checkpoints.manifest_after_save(run_args.save, iteration, release)
        return result

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        from megatron.training import get_args

        run_args = get_args()
        load_arg = kwargs.get("load_arg", "load")
        load_dir = getattr(run_args, load_arg, None)
        if load_dir is not None and not getattr(run_args, "non_persistent_ckpt_type", None):
            checkpoints.verify_before_load(load_dir, getattr(run_args, "ckpt_step", None))
        return load(*args, **kwargs)

    save_checkpoint._xmod_integrity = True
    training.save_checkpoint, training.load_checkpoint = save_checkpoint, load_checkpoint


def widen_pipeline_messages() -> None:
    """18. pipeline_parallel/p2p_communication.py:275 ``P2PCommunicator._communicate`` allocates its
    receive buffers with the schedule's ``tensor_shape`` = (seq, micro-batch, hidden_size)
    (schedules.py:1157 interleaved, :2116 1F1B). Models whose chunks append the token-choice bias
    channels (:mod:`megatron_xmod.pipeline.carry`) receive ``hidden_size + channels``; the count comes
    from the model config the communicator holds. Installed once per process; other models unchanged."""
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron_xmod.pipeline.carry import carry_channels

    original = p2p_communication.P2PCommunicator._communicate
    if getattr(original, "_xmod_widened", False):
        return

    @functools.wraps(original)
    def _communicate(self, *, tensor_shape, **kwargs):
        extra = carry_channels(self.config)
        if extra and tensor_shape is not None and len(tensor_shape) == 3 and tensor_shape[-1] == self.config.hidden_size:
            tensor_shape = (*tensor_shape[:-1], tensor_shape[-1] + extra)
        return original(self, tensor_shape=tensor_shape, **kwargs)

    _communicate._xmod_widened = True
    p2p_communication.P2PCommunicator._communicate = _communicate


def checks_before_tokenizer() -> None:
    """19. training/global_vars.py:138 ``_build_tokenizer`` (inside ``parse_and_validate_args``) calls
    ``build_tokenizer(args)`` (global_vars.py:200), then creates the tensorboard/wandb writers: run
    :func:`megatron_xmod.training.preflight.check_before_megatron_setup` first, so a missing or bad
    tokenizer file, or an unwritable ``--save``/``--tensorboard-dir``, is named before anything is
    built or fetched. Installed once per process."""
    import megatron.training.global_vars as global_vars

    from megatron_xmod.training.preflight import check_before_megatron_setup

    build = global_vars.build_tokenizer
    if getattr(build, "_xmod_checked", False):
        return

    @functools.wraps(build)
    def build_tokenizer(args, *rest, **kwargs):
        check_before_megatron_setup(args)
        return build(args, *rest, **kwargs)

    build_tokenizer._xmod_checked = True
    global_vars.build_tokenizer = build_tokenizer
