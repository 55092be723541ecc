"""Layer specs for a Megatron-LM launch you already have: ``--spec megatron_xmod.spec <name>``.

Megatron-LM's ``pretrain_gpt.py`` (``gpt_builders.gpt_builder``) imports the object named by
``--spec MODULE NAME`` and hands it, uncalled, to ``GPTModel`` with megatron's plain
``TransformerConfig``; megatron's ``GPTModelBuilder`` does the same with a ``ModuleSpec``. A layer
``ModuleSpec`` is built once per layer of the local pipeline stage, so each spec here is one
:class:`LayoutSpecLayer` spec that builds, at every position of its layout, the layer the layout puts
there (megatron's own ``TransformerLayer`` or an :class:`~megatron_xmod.xmod.layers.XModSparseLayer`).
Pipeline stages therefore each build their own layers, with the routing settings carried in the
spec's params.

Named models (the X-MoD paper's 28-layer backbones, Eq.34-36): ``dense``, ``mod``, ``xmod_a4k8``,
``xmod_a3k16``; give ``--num-layers`` equal to the layout's physical layers (49, 161, 298).
Any other layout: write a module of your own with ::

    from megatron_xmod.spec import layout_spec
    my_model = layout_spec("D*4 + (S8*8 + D)*4", family="xmod", token_choice_bias_tau=0.5)

and launch with ``--spec my_module my_model``. With megatron's MoE flags (``--num-experts`` ...; the
X-MoD paper's 8:64 baseline is listed in docs/moe.md) every layer of the layout, routed ones included,
gets megatron's MoE layer with :class:`~megatron_xmod.moe.router.BaselineTopKRouter` (a routed layer
runs it on its routed tokens); the DTop-p router needs our entry point. Megatron swallows an ImportError of ``--spec``'s
module and then trains its default dense model: check a launch beforehand with ::

    python -m megatron_xmod.spec my_module my_model --num-layers 16

(imports the spec as megatron does but lets errors through, prints its layout, exits 2 when
``--num-layers`` disagrees or when a pipeline stage would start inside a sparse block; give it the
launch's whole argument list after the name, the pipeline-split flags are read from it), and in the
run, the ``[xmod] --spec built layers`` line each stage prints, or the parameter count against
``xmod count``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import sys
from typing import ClassVar, Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from megatron_xmod.xmod.layout import NAMED_LAYOUTS, Layout, parse_layout
from megatron_xmod.xmod.routing import SparseLayerRouting
from megatron_xmod.xmod.routing_state import RoutingState

# SparseLayerRouting's fields that every sparse layer of a layout shares (the others come from the layout).
_PER_LAYER_FIELDS = ("family", "sparsity_k", "block", "index_in_block")
SHARED_ROUTING_FIELDS = tuple(f.name for f in dataclasses.fields(SparseLayerRouting) if f.name not in _PER_LAYER_FIELDS)


@dataclasses.dataclass(frozen=True)
class LayoutSpecParams:
    """The data a :class:`LayoutSpecLayer` spec carries: the layout, its family, and the
    :class:`~megatron_xmod.xmod.routing.SparseLayerRouting` settings its sparse layers share (``routing``:
    (field, value) pairs; their per-layer K and block position come from the layout)."""

    layout: str
    family: str = "xmod"
    routing: tuple[tuple[str, object], ...] = ()

    def parsed(self) -> Layout:
        # Every layer of a stage asks; parse the (up to ~300-layer) layout once per spec.
        return _parse_layout_cached(self.layout, self.family)

    def routing_at(self, position: int) -> SparseLayerRouting:
        """The spec params of the sparse layer at 0-based layout ``position``."""
        return SparseLayerRouting.at(self.parsed().layers[position], self.family, **dict(self.routing))

    @property
    def token_choice_bias_tau(self) -> float:
        return dict(self.routing).get("token_choice_bias_tau", _ROUTING_DEFAULTS["token_choice_bias_tau"])


_ROUTING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SparseLayerRouting)}


@functools.lru_cache(maxsize=64)
def _parse_layout_cached(layout: str, family: str) -> Layout:
    return parse_layout(layout, family)


@dataclasses.dataclass
class _CoreAttentionSlot:
    core_attention: Optional[type] = None


@dataclasses.dataclass
class _SelfAttentionSlot:
    submodules: _CoreAttentionSlot = dataclasses.field(default_factory=_CoreAttentionSlot)


@dataclasses.dataclass
class LayoutSubmodules:
    """A layout spec's ``submodules``: the layers' real submodules depend on the config (TE or local)
    and are chosen while building. megatron's ``GPTModelBuilder`` writes
    ``spec.submodules.self_attention.submodules.core_attention`` for ``--attention-backend local``
    (training/models/gpt.py:298 in megatron-core 0.19.2); that choice is kept here and every layer of
    the layout is then built with it."""

    self_attention: _SelfAttentionSlot = dataclasses.field(default_factory=_SelfAttentionSlot)


def _layer_submodules(config, submodules):
    from megatron_xmod.xmod.block import get_layer_submodules, resolve_use_transformer_engine

    if submodules is not None and not isinstance(submodules, LayoutSubmodules):
        return submodules
    built = get_layer_submodules(config, resolve_use_transformer_engine(config, None))
    if config.num_moe_experts is not None:  # megatron's MoE flags: its TopKRouter with the guards routed layers need
        from megatron_xmod.moe.model import with_moe_router
        from megatron_xmod.moe.router import BaselineTopKRouter

        # A routed batch may end in padding rows (sequence parallelism's), which megatron 0.19's own expert-bias
        # count cannot mask; BaselineTopKRouter is TopKRouter bit for bit otherwise (megatron_xmod.moe.router).
        built = with_moe_router(built, BaselineTopKRouter)
    core_attention = None if submodules is None else submodules.self_attention.submodules.core_attention
    if core_attention is None:
        return built
    attention = built.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention))
    return dataclasses.replace(built, self_attention=attention)


@dataclasses.dataclass
class SpecChunkBuild:
    """The model chunk being built from a layout spec. megatron builds a chunk's layers in order, from
    local layer 1, handing each the same process-group collection (``pg_collection``; without one, the
    same config); the build travels on that object from the chunk's first layer to its last, where it
    is removed: nothing outlives the build, and two models built from one spec get two states."""

    ATTRIBUTE: ClassVar[str] = "_xmod_spec_chunk_build"

    state: RoutingState
    vp_stage: Optional[int]
    next_layer: int
    last_layer: int

    @classmethod
    def step(cls, anchor, layer_number: int, vp_stage: Optional[int], last_layer: int) -> SpecChunkBuild:
        """The build that local layer ``layer_number`` belongs to (started at layer 1)."""
        if layer_number == 1:
            setattr(anchor, cls.ATTRIBUTE, cls(RoutingState(), vp_stage, 1, last_layer))
        build = getattr(anchor, cls.ATTRIBUTE, None)
        if build is None or build.next_layer != layer_number or build.vp_stage != vp_stage:
            raise RuntimeError(f"LayoutSpecLayer: layer {layer_number} of a model chunk was built out of order; "
                               "megatron builds a chunk's layers in order from local layer 1")
        build.next_layer += 1
        if layer_number == last_layer:
            delattr(anchor, cls.ATTRIBUTE)
        return build


class LayoutSpecLayer(TransformerLayer):
    """Builds the layer its layout puts at this position (a subclass of ``TransformerLayer`` only so
    that megatron's block accepts the spec; instances are megatron's or our own layer classes). The
    sparse layers of one model chunk share one :class:`RoutingState` (:class:`SpecChunkBuild`)."""

    def __new__(cls, config, submodules=None, layer_number: int = 1, *, xmod: LayoutSpecParams, **kwargs):
        from megatron_xmod.xmod.layers import XModSparseLayer

        layout = xmod.parsed()
        if config.num_layers != layout.num_layers:
            raise ValueError(f"num_layers: {config.num_layers} does not match the --spec layout {layout.notation!r}, "
                             f"which has {layout.num_layers} physical layers; set --num-layers {layout.num_layers}")
        if layout.num_sparse_layers and not config.hetereogenous_dist_checkpoint:
            # Sparse layers carry router/gate parameters that dense layers lack, so megatron's
            # distributed checkpoint cannot stack "layers.*" into one tensor per name: save them
            # layer by layer (what XModConfig sets; megatron's plain config has no flag for it).
            config.hetereogenous_dist_checkpoint = True
        vp_stage, pg_collection = kwargs.get("vp_stage"), kwargs.get("pg_collection")
        pp_rank = None if pg_collection is None else pg_collection.pp.rank()
        position = layer_number - 1 + get_transformer_layer_offset(config, vp_stage, pp_rank)
        submodules = _layer_submodules(config, submodules)
        if layer_number == 1:
            check_chunk_start(xmod, position)
        last_layer = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        build = SpecChunkBuild.step(config if pg_collection is None else pg_collection, layer_number, vp_stage,
                                    last_layer)
        if layer_number == last_layer:
            first = position + 2 - layer_number
            routed = sum(layer.is_sparse for layer in layout.layers[first - 1 : position + 1])
            # one write: every stage prints this line, and under PYTHONUNBUFFERED print()'s text and
            # newline are two writes that another process's line can fall between
            sys.stdout.write(f"[xmod] --spec built layers {first}-{position + 1} of {layout.num_layers} "
                             f"({routed} routed, {layout.family}): {layout.notation}\n")
            sys.stdout.flush()
        if not layout.layers[position].is_sparse:
            return TransformerLayer(config, submodules, layer_number, **kwargs)
        layer = XModSparseLayer(config, submodules, layer_number, routing=xmod.routing_at(position), **kwargs)
        layer.routing_state = build.state
        return layer


def check_chunk_start(xmod: LayoutSpecParams, position: int) -> None:
    """A model chunk starting inside a sparse block would silently restart the token-choice bias at 0:
    our entry point carries it across stages in the pipeline's activations (its GPT model chunks, see
    :mod:`megatron_xmod.pipeline.carry`), but the spec route only builds layers, and Megatron-LM's
    pipeline sends hidden states alone."""
    layers = xmod.parsed().layers
    layer = layers[position]
    if not (layer.is_sparse and layer.index_in_block > 0 and xmod.family == "xmod" and xmod.token_choice_bias_tau > 0):
        return
    first = position - layer.index_in_block  # 0-based, the block's first and last sparse layers
    last = max(i for i, other in enumerate(layers) if other.is_sparse and other.block == layer.block)
    raise ValueError(
        f"pipeline_model_parallel_layout: a pipeline stage starts at layer {position + 1}, inside the sparse block "
        f"of layers {first + 1}-{last + 1}, and the --spec route cannot carry the token-choice bias across a stage "
        f"boundary (Megatron-LM's pipeline sends hidden states only); put the boundary before layer {first + 1} or "
        f"after layer {last + 1} with --pipeline-model-parallel-layout, set "
        f"token_choice_bias_tau=0 in the spec, or train with python -m megatron_xmod.pretrain, which carries it")


def layout_spec(layout: str, family: str = "xmod", **routing) -> ModuleSpec:
    """A ``--spec`` object for any layout; ``routing``: any of :data:`SHARED_ROUTING_FIELDS`
    (token_choice_bias_tau, token_choice_bias_increment, router_bce_coeff, gate_scale_init,
    gate_scale_learnable, token_choice_bias_tau_warmup; the ``--xmod-*`` defaults otherwise)."""
    unknown = sorted(set(routing) - set(SHARED_ROUTING_FIELDS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a routing setting of a layout spec; use {', '.join(SHARED_ROUTING_FIELDS)}")
    params = LayoutSpecParams(layout, family, tuple(sorted(routing.items())))
    parsed = params.parsed()  # a bad layout fails at import, naming the field
    first_sparse = next((i for i, layer in enumerate(parsed.layers) if layer.is_sparse), None)
    if first_sparse is not None:
        params.routing_at(first_sparse)  # and so does a bad setting
    return ModuleSpec(module=LayoutSpecLayer, params={"xmod": params}, submodules=LayoutSubmodules())


dense = layout_spec(NAMED_LAYOUTS["dense"][1], family="dense")
mod = layout_spec(NAMED_LAYOUTS["mod"][1], family="mod")
xmod_a4k8 = layout_spec(NAMED_LAYOUTS["xmod-a4k8"][1])
xmod_a3k16 = layout_spec(NAMED_LAYOUTS["xmod-a3k16"][1])


def resolve(module: str, name: str) -> ModuleSpec:
    """The object ``--spec MODULE NAME`` names, imported as megatron's ``import_module`` does, but an
    ImportError (which megatron logs and then builds its default dense model) propagates here."""
    from megatron_xmod import spec as this  # the importable module, also when run as __main__

    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        raise AttributeError(f"--spec: module {module!r} has no {name!r}")
    if not (isinstance(obj, ModuleSpec) and obj.module is this.LayoutSpecLayer):
        raise TypeError(f"--spec: {module}.{name} is not a megatron_xmod layout spec (make it with "
                        "megatron_xmod.spec.layout_spec(...))")
    return obj


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """The flags of a launch that decide where megatron's pipeline chunks start."""

    pipeline_model_parallel_size: int = 1
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    pipeline_model_parallel_layout: Optional[str] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def pipelined(self) -> bool:
        return self.pipeline_model_parallel_size > 1 or bool(self.pipeline_model_parallel_layout)


def chunk_starts(num_layers: int, split: PipelineSplit) -> list[int]:
    """0-based first layer of every model chunk, in model order, as megatron places them: the chunks
    of ``--pipeline-model-parallel-layout`` (megatron's parser; the string lists chunks in model
    order), else megatron's own offsets (``get_transformer_layer_offset``) for a config with the
    launch's split, which also applies megatron's checks of it."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.pipeline_parallel_layer_layout import LayerType, PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp, vpp = split.pipeline_model_parallel_size, split.num_virtual_stages_per_pipeline_rank
    if split.pipeline_model_parallel_layout:
        layout = split.pipeline_model_parallel_layout
        if vpp or split.num_layers_per_virtual_pipeline_stage:
            raise ValueError("pipeline_model_parallel_layout: the layout sets the virtual stages itself; drop "
                             "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage")
        unknown = sorted(set(layout) - set("EtmL|*(),0123456789 "))
        if unknown:
            raise ValueError(f"pipeline_model_parallel_layout: unknown letter(s) {', '.join(map(repr, unknown))} in "
                             f"{layout!r}; use E (embedding), t (transformer layer), m (MTP), L (loss), | between "
                             "stages and *N")
        chunks = PipelineParallelLayerLayout.parse_str_to_list(layout)
        sizes = [sum(kind == LayerType.decoder for kind in chunk) for chunk in chunks]
        if sum(sizes) != num_layers or len(chunks) % pp:
            raise ValueError(f"pipeline_model_parallel_layout: {layout!r} has {len(chunks)} stages of {sum(sizes)} "
                             f"transformer layers ('t'); give a multiple of --pipeline-model-parallel-size {pp} "
                             f"stages with {num_layers} 't' in all")
        return [sum(sizes[:i]) for i, size in enumerate(sizes) if size]
    if split.num_layers_per_virtual_pipeline_stage:
        vpp = num_layers // pp // split.num_layers_per_virtual_pipeline_stage
    try:  # megatron's checks of the split are assertions, in the config and in the layer count
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
            num_layers_in_first_pipeline_stage=split.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=split.decoder_last_pipeline_num_layers,
            account_for_embedding_in_pipeline_split=split.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split=split.account_for_loss_in_pipeline_split)
        stages = [None] if config.virtual_pipeline_model_parallel_size is None else range(vpp)
        return [get_transformer_layer_offset(config, stage, rank) for stage in stages for rank in range(pp)
                if get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)]
    except (AssertionError, ValueError) as error:
        raise ValueError(f"pipeline_model_parallel_size: megatron refuses this split of {num_layers} layers ({error}); "
                         "give --pipeline-model-parallel-layout (xmod partition --block-aligned prints one)") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_xmod.spec", allow_abbrev=False,
        description="Check a --spec MODULE NAME before launching Megatron-LM with it. Give the launch's whole "
                    "argument list after MODULE NAME: --num-layers and the pipeline-split flags are checked, the "
                    "rest is ignored (the last occurrence of a flag wins, as in megatron).")
    parser.add_argument("module")
    parser.add_argument("name")
    parser.add_argument("--num-layers", type=int, default=None, help="the launch's --num-layers, checked against the layout")
    for field in dataclasses.fields(PipelineSplit):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=str if field.name.endswith("layout") else int, default=field.default)
    args, _ = parser.parse_known_args(argv)
    split = PipelineSplit(**{field.name: getattr(args, field.name) for field in dataclasses.fields(PipelineSplit)})
    try:
        params = resolve(args.module, args.name).params["xmod"]
        layout = params.parsed()
    except (ImportError, AttributeError, TypeError) as error:
        print(f"megatron_xmod.spec: error: {error}", file=sys.stderr)
        return 2
    print(f"--spec {args.module} {args.name}: {layout.family}, {layout.num_layers} layers "
          f"({layout.num_sparse_layers} routed): {layout.notation}")
    if args.num_layers is not None and args.num_layers != layout.num_layers:
        print(f"megatron_xmod.spec: error: num_layers: {args.num_layers} does not match the --spec layout, which has "
              f"{layout.num_layers} physical layers; set --num-layers {layout.num_layers}", file=sys.stderr)
        return 2
    if split.pipelined:
        try:
            starts = chunk_starts(layout.num_layers, split)
            for start in starts:
                check_chunk_start(params, start)
        except ValueError as error:
            print(f"megatron_xmod.spec: error: {error}", file=sys.stderr)
            return 2
        print(f"pipeline chunks start at layers {', '.join(str(start + 1) for start in starts)}: "
              "none inside a sparse block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
