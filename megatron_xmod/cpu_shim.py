"""The CPU shim: megatron-core 0.19.2 (and ``megatron.training.pretrain``) on a machine without a GPU.

Patches 1-11, 21, 27-31, each naming the megatron line it targets (paths relative to ``megatron/core`` or
``megatron/training`` of the wheel; re-check them when the pin moves). Nothing here runs where
``torch.cuda.is_available()``: GPU runs never see these patches. The CUDA build of torch imports fine
without a driver, but every CUDA call raises, and megatron calls CUDA unconditionally in a handful of
places. Use ``with cpu_patches(training=...):`` around the work; the torch-function mode of patch 3 is
entered on the way in and left on the way out, the module patches stay installed (once per process).

Every other change megatron_xmod makes to megatron's behaviour, on every device, is numbered in
:mod:`megatron_xmod.training.patches`.

Patch 28 is the one that acts when this module is imported (on CPU): import it before megatron, as the
entry points do.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

_installed = {"core": False, "training": False}


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites tensor factories' ``device="cuda"`` (or an int device) to the CPU.

    pipeline_parallel/schedules.py:749/1121/2292 ``torch.zeros([], device="cuda")``,
    training/initialize.py JIT warm-up tensors, ``tensor.cuda()`` calls in checkpointing, and
    ``tensor.type() == "torch.cuda.FloatTensor"`` checks in the optimizer and DDP buffers; and
    ``pin_memory=True`` (pinning needs a CUDA device): models/common/embeddings/rope_utils.py:62
    ``get_pos_emb_on_this_cp_rank``, the RoPE slice of each context-parallel rank.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (str(device).startswith("cuda") or isinstance(device, int)):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
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


def _compile_functions_on_first_call() -> None:
    """Patch 28. compile-at-import: megatron decorates functions with ``torch.compile`` when its modules
    are imported (core/jit.py:21 ``jit_fuser``, transformer/moe/router.py:918, and the fusions that use
    ``jit_fuser``). Building each wrapper imports TorchDynamo and TorchInductor: ~4 s of every process's
    start-up on a 2-core CPU, where megatron's compiled fusions are off (training/flags.py
    CPU_COMPILED_FUSIONS) and Dynamo is disabled for the run (patch 11), so nothing is ever compiled. Here
    ``torch.compile`` of a function returns a wrapper that calls the real ``torch.compile`` when the
    function is first called, with the same arguments; modules (and anything not a plain callable) go to
    the real one at once. Installed on import of this module, on CPU only."""
    real = torch.compile
    if getattr(real, "_xmod_first_call", False):
        return

    @functools.wraps(real)
    def compile_on_first_call(model=None, **kwargs):
        if model is None:  # @torch.compile(...) with arguments
            return lambda fn: compile_on_first_call(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return call

    compile_on_first_call._xmod_first_call = True
    torch.compile = compile_on_first_call


if cpu_mode():
    _compile_functions_on_first_call()


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
    # 27. dp-one: distributed/param_and_grad_buffer.py:712 (start_grad_sync) reduce-scatters every
    #     gradient bucket and :515 (start_param_sync) all-gathers the parameters over the data-parallel
    #     group even when it has one rank. Gloo runs that as a copy of the whole buffer (a 127M-parameter
    #     model: ~0.5 GB per step, the X-MoD models 5-10x Dense's), which a single-rank bench then times
    #     as part of the step. With one rank both are the identity.
    _single_rank_buffer_collectives()
    # 21. sp-norm: transformer/torch_norm.py:50 WrappedTorchNorm.__new__ asserts not
    #     config.sequence_parallel; GPU runs use TransformerEngine's TENorm, which supports it.
    _sequence_parallel_torch_norm()
    # 29. cpu-adam: without Apex/TE, optimizer/__init__.py:557 builds torch's Adam/AdamW with its default
    #     implementation, which for CPU tensors is a Python loop over the parameters: 0.69 s a step at 236M
    #     parameters in 2,700 tensors on 2 cores (an A3K16 model's shape), where torch's fused CPU kernel
    #     (the same update, one vectorised pass per tensor) takes 0.16 s.
    _fused_cpu_adam()
    # 30. cpu-clip: without Apex/TE, optimizer/clip_grads.py:45 takes utils.py:1325/1337's fallbacks for the
    #     gradient norm and the clip, a Python loop per tensor (the norm also reads every tensor's norm back
    #     with float()): ~0.17 s a step over an A3K16 model's 3,250 gradient tensors on 2 cores. torch's
    #     foreach kernels compute the same norm and scale.
    _foreach_clip_grads()
    # 31. layer-mode: the mode of patch 3 costs every torch call made from Python ~1.4 us on this CPU (torch
    #     pops and re-pushes the mode around each call), ~5% of a routed layer's forward + backward at
    #     cpu-256 (~120 such calls a layer), which a GPU run never pays. Megatron's TransformerBlock.forward
    #     (transformer/transformer_block.py) runs with the mode set aside: its layers allocate on
    #     current_device() (patch 2), but for the causal masks of the local attention's softmax
    #     (transformer/utils.py:39/44 device="cuda", called from fusions/fused_softmax.py), which run under
    #     the mode. (The other device="cuda" sites of transformer/ and fusions/ are GPU-only features:
    #     CUDA graphs, HybridEP, paged stash, fused permutation.)
    _block_forward_without_device_mode()


def _block_forward_without_device_mode() -> None:
    """Patch 31: megatron's ``TransformerBlock.forward`` runs with :class:`_CudaDeviceToCpu` set aside
    when it is the innermost torch-function mode (any other mode, e.g. a test's, stays in force)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    forward = TransformerBlock.forward
    if getattr(forward, "_xmod_without_device_mode", False):
        return

    @functools.wraps(forward)
    def forward_without_device_mode(self, *args, **kwargs):
        if not isinstance(torch.overrides._get_current_function_mode(), _CudaDeviceToCpu):
            return forward(self, *args, **kwargs)
        with torch.overrides._pop_mode_temporarily():
            return forward(self, *args, **kwargs)

    forward_without_device_mode._xmod_without_device_mode = True
    TransformerBlock.forward = forward_without_device_mode

    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        under_mode = _under_device_mode(getattr(transformer_utils, name))
        setattr(transformer_utils, name, under_mode)
        setattr(fused_softmax, name, under_mode)


def _under_device_mode(fn):
    """``fn`` called with :class:`_CudaDeviceToCpu` in force (its device="cuda" tensors made on the CPU)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _CudaDeviceToCpu():
            return fn(*args, **kwargs)

    return call


def _fused_cpu_adam() -> None:
    """Patch 29: every torch Adam/AdamW that megatron builds on CPU parameters steps with ``fused=True``."""
    import megatron.core.optimizer as optimizer

    build = optimizer._get_megatron_optimizer_based_on_param_groups
    if getattr(build, "_xmod_fused_cpu_adam", False):
        return

    @functools.wraps(build)
    def build_fused(*args, **kwargs):
        result = build(*args, **kwargs)
        pending = [result]
        while pending:  # a MegatronOptimizer wraps a torch optimizer; a ChainedOptimizer several of them
            item = pending.pop()
            pending += list(getattr(item, "chained_optimizers", None) or [])
            inner = getattr(item, "optimizer", None)
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                fuse_cpu_adam(inner)
        return result

    build_fused._xmod_fused_cpu_adam = True
    optimizer._get_megatron_optimizer_based_on_param_groups = build_fused


def _foreach_clip_grads() -> None:
    """Patch 30: megatron's fallback gradient norm and scale, as torch foreach ops."""
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [torch.stack(torch._foreach_norm(tensors)) for tensors in tensor_lists if tensors]
        total = torch.linalg.vector_norm(torch.cat(norms)) if norms else torch.zeros(())
        return total.float().reshape(1), None

    def scale(chunk_size, noop_flag, tensor_lists, factor):
        sources, destinations = tensor_lists
        if all(s is d for s, d in zip(sources, destinations)):
            torch._foreach_mul_(destinations, factor)
        else:
            torch._foreach_copy_(destinations, torch._foreach_mul(sources, factor))

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    if clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = scale


def fuse_cpu_adam(adam: torch.optim.Optimizer) -> bool:
    """Switch a torch Adam/AdamW whose parameters are all floating-point CPU tensors to the fused kernel
    (torch reads ``fused`` from the parameter group at every step); False, unchanged, otherwise."""
    params = [p for group in adam.param_groups for p in group["params"]]
    if not params or any(p.device.type != "cpu" or not p.is_floating_point() for p in params):
        return False
    if any(group.get("capturable") or group.get("differentiable") for group in adam.param_groups):
        return False
    for group in adam.param_groups:
        group["fused"], group["foreach"] = True, False
    adam.defaults.update(fused=True, foreach=False)
    adam._step_supports_amp_scaling = True  # as torch's constructor sets it for fused=True
    return True


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

    @functools.wraps(original)
    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        norm = original(cls, _ConfigWithoutSequenceParallel(config), *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = __new__


def _single_rank_buffer_collectives() -> None:
    """Patch 27: the grad reduce-scatter and parameter all-gather of megatron's DDP buffers, synchronous
    and over a one-rank group, become the copy they are (none when output and input share memory, as
    megatron's shard of the whole buffer does). Asynchronous calls (--overlap-grad-reduce) keep the
    collective: the coalescing manager waits on the work they return."""
    import megatron.core.distributed.param_and_grad_buffer as buffers

    def one_rank(collective):
        @functools.wraps(collective)
        def call(output, input, *args, group=None, async_op=False, **kwargs):
            if async_op or torch.distributed.get_world_size(group) != 1:
                return collective(output, input, *args, group=group, async_op=async_op, **kwargs)
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view_as(output))
            return None

        return call

    buffers.dist_reduce_scatter_func = one_rank(buffers.dist_reduce_scatter_func)
    buffers.dist_all_gather_func = one_rank(buffers.dist_all_gather_func)


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
    #     initialization uses next, so TP=1 and TP=2 would start from different weights. It also
    #     compiles bias-GeLU/SwiGLU and bias-dropout-add (Inductor) whatever the fusion flags say: with
    #     all three off (--xmod-cpu) nothing would call what it compiles, so it is skipped, and
    #     torch.compile is turned off for the run (megatron decorates a few more functions with it at
    #     import, e.g. the MoE router's expert bias; they then run eagerly).
    warmup = training.set_jit_fusion_options

    @functools.wraps(warmup)
    def set_jit_fusion_options(*args, **kwargs):
        from megatron.training import get_args

        parsed = get_args()
        if not (parsed.bias_gelu_fusion or parsed.bias_swiglu_fusion or parsed.bias_dropout_fusion):
            import torch._dynamo

            torch._dynamo.config.disable = True
            return None
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
