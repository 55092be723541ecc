"""Entry-point flags for the MoE models and the DTop-p router.

Each ``--dtopp-*``/``--moe-router-type``/``--lm-z-loss-coeff`` dest is a :class:`MoEConfig` field
name; :func:`apply_moe_arguments` copies the ones given (None: not given) onto the config fields.
``--moe-preset`` names an MoE model (:mod:`megatron_xmod.moe.presets`) and expands into megatron's
own MoE flags (:func:`expand_moe_arguments`, before parsing, explicit flags still win) or into
config fields (:func:`apply_moe_arguments`, after parsing).

    --moe-preset moe-8x64                                  # the X-MoD 8:64 baseline
    --moe-preset moe-8x64 --moe-router-type dtopp          # same experts, DTop-p with T = 6 (= dtopp-t6)
    --moe-preset dtopp-paper-topk8                         # the DTop-p paper's Top-k baseline
    --moe-preset dtopp-paper-t8                            # the DTop-p paper's DTop-p model
    --num-experts 64 --moe-router-type dtopp --dtopp-target-experts 8 --dtopp-kp 0.1 --dtopp-ki 0.1

A preset sets the MoEConfig fields of its recipe too (router type, target, LM z-loss, routing
normalisation, ...), so ``--moe-preset X`` builds the same model as ``moe_config_from_backbone(b, X)``.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron_xmod.moe.config import ROUTER_TYPES, ROUTING_NORMS, MoEConfig
from megatron_xmod.moe.presets import MOE_MODEL_NAMES, parse_moe_model

# MoEConfig fields the flags below set; None means "not given" for every one of them.
MOE_ARG_FIELDS = ("moe_router_type", "dtopp_target_experts", "dtopp_layer_targets", "dtopp_layerwise", "dtopp_kp",
                  "dtopp_ki", "dtopp_p0", "dtopp_routing_norm", "dtopp_routing_norm_init",
                  "dtopp_dynamic_loss_coeff", "lm_z_loss_coeff")
_MEGATRON_FLAGS = {  # config field -> megatron flag
    "num_moe_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_router_load_balancing_type": "--moe-router-load-balancing-type", "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "moe_router_bias_update_rate": "--moe-router-bias-update-rate",
    "moe_router_score_function": "--moe-router-score-function",
    "moe_token_dispatcher_type": "--moe-token-dispatcher-type", "moe_router_dtype": "--moe-router-dtype",
}
# The MoEConfig fields a preset sets, by their own flag below (every dest is the field name).
_MOE_FLAGS = {field: "--" + field.replace("_", "-") for field in MOE_ARG_FIELDS}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MoEConfig)}


def _preset(name: str) -> str:
    """--moe-preset takes every MoE model name of megatron_xmod.moe.presets (slurm/xmod_train.sh
    passes its moe-* and dtopp-* models through it)."""
    try:
        return parse_moe_model(name).name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _targets(text: str) -> list[float]:
    try:
        return [float(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"dtopp_layer_targets: expected numbers separated by commas, got {text!r}") from None




def add_moe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("MoE / DTop-p", "MoE baselines and the DTop-p router (megatron_xmod.moe)")
    g.add_argument("--moe-preset", default=None, type=_preset, metavar="MODEL",
                   help=f"an MoE model ({', '.join(MOE_MODEL_NAMES)}). moe-8x64/moe-8x128: the X-MoD MoE "
                        "baselines, 6 of 64/128 routed + 2 shared experts; dtopp-paper-topk8/dtopp-paper-t8: the "
                        "DTop-p paper's Top-k baseline and DTop-p model, 64 experts, 8 active (on average), no "
                        "shared experts; d_e = FFN/8")
    # Set by expand_moe_arguments: the preset is already in the parsed flags (explicit ones after it).
    g.add_argument("--moe-preset-expanded", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--moe-router-type", dest="moe_router_type", default=None, choices=ROUTER_TYPES,
                   help="topk (megatron), dtopp (PI-controlled Top-p), topp-fixed (ablation) (default: topk, or "
                        "the --moe-preset's router)")
    g.add_argument("--dtopp-target-experts", dest="dtopp_target_experts", type=float, default=None,
                   help="T, routed experts per token on average (default: the --moe-preset's, e.g. 6 for "
                        "moe-8x64; required for --moe-router-type dtopp without a preset)")
    g.add_argument("--dtopp-layerwise", dest="dtopp_layerwise", action="store_true", default=None,
                   help="one PI controller per layer (default: off, one controller for all layers)")
    g.add_argument("--dtopp-layer-targets", dest="dtopp_layer_targets", type=_targets, default=None,
                   help="per-layer targets for --dtopp-layerwise, comma separated (default: "
                        "--dtopp-target-experts in every layer)")
    g.add_argument("--dtopp-kp", dest="dtopp_kp", type=float, default=None,
                   help=f"K_pro (default: {_DEFAULTS['dtopp_kp']}, or the --moe-preset's)")
    g.add_argument("--dtopp-ki", dest="dtopp_ki", type=float, default=None,
                   help=f"K_int (default: {_DEFAULTS['dtopp_ki']}, or the --moe-preset's)")
    g.add_argument("--dtopp-p0", dest="dtopp_p0", type=float, default=None,
                   help=f"initial threshold; the threshold of topp-fixed (default: {_DEFAULTS['dtopp_p0']}, or "
                        "the --moe-preset's)")
    g.add_argument("--dtopp-routing-norm", dest="dtopp_routing_norm", default=None, choices=ROUTING_NORMS,
                   help="DRN: learnable, fixed or none (default: the --moe-preset's, else learnable for dtopp, "
                        "fixed for topp-fixed, none for topk)")
    g.add_argument("--dtopp-routing-norm-init", dest="dtopp_routing_norm_init", type=float, default=None,
                   help=f"the DRN temperature theta: its initial value (learnable) or its value (fixed) "
                        f"(default: {_DEFAULTS['dtopp_routing_norm_init']}, or the --moe-preset's)")
    g.add_argument("--dtopp-dynamic-loss-coeff", dest="dtopp_dynamic_loss_coeff", type=float, default=None,
                   help=f"entropy loss (default: {_DEFAULTS['dtopp_dynamic_loss_coeff']}); the load-balancing "
                        "loss is megatron's --moe-aux-loss-coeff, the router z-loss --moe-z-loss-coeff")
    g.add_argument("--lm-z-loss-coeff", dest="lm_z_loss_coeff", type=float, default=None,
                   help=f"LM z-loss coefficient, DTop-p paper: 1e-4 (default: {_DEFAULTS['lm_z_loss_coeff']:g} = off, "
                        "or the --moe-preset's)")
    return parser


def _preset_fields(preset: str, ffn_hidden_size: int, router_type: str | None) -> dict:
    """megatron's and MoEConfig's fields of ``preset``, with the router ``router_type`` if given."""
    spec = parse_moe_model(preset)
    if router_type is not None and router_type != spec.router_type:
        # Same experts and recipe, another router: the preset's routed experts per token become
        # the DTop-p target (or the Top-k k).
        spec = dataclasses.replace(spec, router_type=router_type)
    return {**spec.megatron_fields(ffn_hidden_size), **spec.moe_fields()}


def expand_moe_arguments(argv: list[str], scanned: argparse.Namespace) -> list[str]:
    """Expand ``--moe-preset`` into megatron's MoE flags and the ``--dtopp-*``/``--moe-router-type``/
    ``--lm-z-loss-coeff`` flags of its recipe (placed first, so explicit flags win). ``scanned``: the
    entry point's reading of ``argv`` (``training.flags.scan_argv``), with ``moe_preset``,
    ``moe_router_type`` and ``ffn_hidden_size`` (``--xmod-backbone`` expands to it: expand that first)."""
    if scanned.moe_preset is None:
        return list(argv)
    if scanned.ffn_hidden_size is None:
        raise ValueError("ffn_hidden_size: --moe-preset derives the expert size d_e = FFN/8 from --ffn-hidden-size")
    head: list[str] = []
    for field, value in _preset_fields(scanned.moe_preset, scanned.ffn_hidden_size, scanned.moe_router_type).items():
        flag = _MEGATRON_FLAGS.get(field) or _MOE_FLAGS.get(field)
        if flag is None or value is None:
            continue  # megatron's defaults already match (dropless, no router z-loss, no pre-softmax)
        if isinstance(value, bool):
            head += [flag] if value else []
        else:
            head += [flag, str(value)]
    return head + ["--moe-preset-expanded"] + list(argv)


def apply_moe_arguments(args: argparse.Namespace, config_kwargs: dict) -> dict:
    """Put the MoE / DTop-p settings of parsed ``args`` into ``config_kwargs`` (MoEConfig field
    names) and return it. ``--moe-preset`` sets megatron's MoE fields and its recipe's MoEConfig
    fields (overriding what ``config_kwargs`` holds for them, typically megatron's defaults; it
    needs ``ffn_hidden_size`` there), then the ``--dtopp-*`` flags apply on top. Build the config
    with ``MoEConfig(**config_kwargs)`` and the model with ``build_moe_gpt_model``.

    After :func:`expand_moe_arguments` the preset is already in the parsed flags, with the explicit
    flags after it: ``config_kwargs`` (from megatron's config of ``args``) is kept as it is, so that
    an explicit ``--moe-router-topk`` or ``--moe-aux-loss-coeff`` still wins."""
    router_type = getattr(args, "moe_router_type", None)
    preset = getattr(args, "moe_preset", None)
    if preset is not None and not getattr(args, "moe_preset_expanded", False):
        if "ffn_hidden_size" not in config_kwargs:
            raise ValueError("ffn_hidden_size: --moe-preset derives the expert size d_e = FFN/8 from it")
        for field, value in _preset_fields(preset, config_kwargs["ffn_hidden_size"], router_type).items():
            config_kwargs[field] = value
    for field in MOE_ARG_FIELDS:
        value = getattr(args, field, None)
        if value is not None:
            config_kwargs[field] = value
    return config_kwargs
