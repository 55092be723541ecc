"""One compiled region per transformer layer (``--xmod-compile-layers``; issue 28, "one compiled region ...
is a fair way to get there").

A routed layer at L/K tokens spends most of its time around its matmuls, not in them: ~360 eager ops
forward and backward (RMSNorms, RoPE, SwiGLU, residual adds, the gather and the gated scatter), each a
dispatch and a pass over memory. ``torch.compile(dynamic=False)`` traces a layer's compute once and
Inductor fuses those ops, forward and backward, as megatron's ``jit_fuser`` does for its few fused ops:

- a routed layer: :func:`~megatron_xmod.xmod.layers.plain_routed_rows` (attention and MLP on the gathered
  routed rows, the gated update of those rows) under the top-k rule; the router, the routing step (whose
  statistics and bias hand-over write the routing state's buffers), the router loss, and the gather and
  the in-place add of the rows into the block's residual stream (``XModSparseLayer._routed_update_in_place``:
  a compiled region's output can be written in place only by copying it whole) stay eager, as does the
  threshold rule of evaluation (its widths are data-dependent);
- a dense layer: megatron's ``TransformerLayer.forward`` when called without packed sequences or an
  inference context.

The compiled functions are module-level, so the layers of one kind and shape share one compiled graph
(Dynamo caches per code object and guards on shapes and modes, not on which layer it is): a 298-layer
A3K16 model compiles a dense graph and a routed graph for training, and again for evaluation.
``compile_layers`` returns the layers it wired; what the compiled graphs are is in Dynamo's counters.
CPU: Inductor writes its kernels to a cache keyed by the CPU's vector width and the torch version unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise (a cache written on a CPU of another vector width can hand
back wrong kernels; docs/reliability.md).
"""
from __future__ import annotations

import os

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_xmod.xmod.config import check_compile_compatibility
from megatron_xmod.xmod.layers import XModSparseLayer, plain_routed_rows

_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")


def _dense_forward(layer: TransformerLayer, hidden_states, attention_mask, rotary_pos_emb):
    return TransformerLayer.forward(layer, hidden_states, attention_mask=attention_mask,
                                    rotary_pos_emb=rotary_pos_emb)


class CompiledDenseForward:
    """A dense layer's ``forward``: the compiled graph for a plain call (hidden states, attention mask,
    RoPE), megatron's own forward for anything else (packed sequences, an inference context, ...)."""

    def __init__(self, layer: TransformerLayer, compiled):
        self.layer, self.compiled = layer, compiled

    def __call__(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **kwargs):
        if all(value is None for value in kwargs.values()):
            # contiguous: the first layer's input is the embedding's transposed view, whose strides would
            # otherwise compile a graph of its own
            return self.compiled(self.layer, hidden_states.contiguous(), attention_mask, rotary_pos_emb)
        return TransformerLayer.forward(self.layer, hidden_states, attention_mask=attention_mask,
                                        rotary_pos_emb=rotary_pos_emb, **kwargs)


def inductor_cache_dir() -> str:
    """Where Inductor's kernels go on this machine unless TORCHINDUCTOR_CACHE_DIR is set."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    version = torch.__version__.split("+")[0]
    return os.path.join(os.path.expanduser("~"), ".cache", "megatron_xmod", "inductor", f"torch{version}-{capability}")


def compile_layers(model: torch.nn.Module) -> dict:
    """Wire every transformer layer of ``model`` (a megatron GPT model or chunk built from an
    ``XModConfig`` with ``xmod_compile_layers``) to its compiled region. Returns ``{"dense": n, "routed": m}``,
    the layers wired. Compilation happens on the first call of each kind."""
    import torch._dynamo

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for config in {id(layer.config): layer.config for layer in layers}.values():  # the layers share one, usually
        check_compile_compatibility(config)
    engine = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith(_TE_MODULES)})
    if engine:
        raise ValueError(f"transformer_impl: --xmod-compile-layers traces megatron's local modules; this model has "
                         f"TransformerEngine's ({', '.join(engine)}), which break the graph; use --transformer-impl "
                         "local, or drop --xmod-compile-layers")
    # A CPU run of megatron switches Dynamo off when its own fusions are off (cpu_shim patch 11); the user asked for it.
    torch._dynamo.config.disable = False
    if next(model.parameters()).device.type == "cpu":
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    _constant_tp_group_lookup()
    # fullgraph: a graph break is an error at the first step, not a silent split into slower pieces
    routed_update = torch.compile(plain_routed_rows, dynamic=False, fullgraph=True)
    dense_forward = torch.compile(_dense_forward, dynamic=False, fullgraph=True)
    wired = {"dense": 0, "routed": 0}
    for layer in layers:
        if isinstance(layer, XModSparseLayer):
            layer.compiled_update = routed_update
            wired["routed"] += 1
        else:
            layer.forward = CompiledDenseForward(layer, dense_forward)
            wired["dense"] += 1
    return wired


def _constant_tp_group_lookup() -> None:
    """megatron's RowParallelLinear passes ``tp_group=None`` to its linear function, whose group lookup warns
    (a deprecation nag) on every call: Dynamo cannot trace ``warnings.warn``, and would break the region
    there. The lookup's answer is fixed for the run (the TP group), so Dynamo may call it once while tracing
    and keep the result: ``assume_constant_result`` marks the function itself, nothing of megatron's changes."""
    import megatron.core.tensor_parallel.layers as tensor_parallel_layers
    import torch._dynamo

    torch._dynamo.assume_constant_result(tensor_parallel_layers.get_tensor_model_parallel_group_if_none)
