"""Entry-point flags for the MoE models and the DTop-p router.

Each ``--dtopp-*``/``--moe-router-type``/``--lm-z-loss-coeff`` dest is a :class:`MoEConfig` field,
so megatron's ``core_transformer_config_from_args(args, MoEConfig)`` maps them unchanged.
``--moe-preset`` names an MoE model (:mod:`megatron_xmod.moe.presets`) and expands into megatron's
own MoE flags (:func:`expand_moe_arguments`, before parsing, explicit flags still win) or into
config fields (:func:`apply_moe_arguments`, after parsing).

    --moe-preset moe-8x64                                  # the X-MoD 8:64 baseline
    --moe-preset moe-8x64 --moe-router-type dtopp          # same experts, DTop-p with T = 6
    --num-experts 64 --moe-router-type dtopp --dtopp-target-experts 8 --dtopp-kp 0.1 --dtopp-ki 0.1
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron_xmod.moe.config import ROUTER_TYPES, ROUTING_NORMS, MoEConfig
from megatron_xmod.moe.presets import parse_moe_model

PRESETS = ("moe-8x64", "moe-8x128")
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
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MoEConfig)}


def _targets(text: str) -> list[float]:
    try:
        return [float(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"dtopp_layer_targets: expected numbers separated by commas, got {text!r}")


def add_moe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("MoE / DTop-p", "MoE baselines and the DTop-p router (megatron_xmod.moe)")
    g.add_argument("--moe-preset", default=None, choices=PRESETS,
                   help="X-MoD MoE baseline: 6 of 64/128 routed + 2 shared experts, d_e = FFN/8")
    g.add_argument("--moe-router-type", dest="moe_router_type", default=None, choices=ROUTER_TYPES,
                   help="topk (megatron), dtopp (PI-controlled Top-p), topp-fixed (ablation); default topk")
    g.add_argument("--dtopp-target-experts", dest="dtopp_target_experts", type=float, default=None,
                   help="T, routed experts per token on average (default with a preset: its 6)")
    g.add_argument("--dtopp-layerwise", dest="dtopp_layerwise", action="store_true", default=None,
                   help="one PI controller per layer")
    g.add_argument("--dtopp-layer-targets", dest="dtopp_layer_targets", type=_targets, default=None,
                   help="per-layer targets for --dtopp-layerwise, comma separated")
    g.add_argument("--dtopp-kp", dest="dtopp_kp", type=float, default=None, help=f"K_pro (default {_DEFAULTS['dtopp_kp']})")
    g.add_argument("--dtopp-ki", dest="dtopp_ki", type=float, default=None, help=f"K_int (default {_DEFAULTS['dtopp_ki']})")
    g.add_argument("--dtopp-p0", dest="dtopp_p0", type=float, default=None,
                   help=f"initial threshold; the threshold of topp-fixed (default {_DEFAULTS['dtopp_p0']})")
    g.add_argument("--dtopp-routing-norm", dest="dtopp_routing_norm", default=None, choices=ROUTING_NORMS,
                   help="DRN: learnable (dtopp default), fixed (topp-fixed default) or none")
    g.add_argument("--dtopp-routing-norm-init", dest="dtopp_routing_norm_init", type=float, default=None)
    g.add_argument("--dtopp-dynamic-loss-coeff", dest="dtopp_dynamic_loss_coeff", type=float, default=None,
                   help=f"entropy loss (default {_DEFAULTS['dtopp_dynamic_loss_coeff']}); the load-balancing "
                        "loss is megatron's --moe-aux-loss-coeff, the router z-loss --moe-z-loss-coeff")
    g.add_argument("--lm-z-loss-coeff", dest="lm_z_loss_coeff", type=float, default=None,
                   help="LM z-loss coefficient (DTop-p paper: 1e-4)")
    return parser


def _last_value(argv: list[str], flag: str):
    value = None
    for i, item in enumerate(argv):
        if item == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value


def _preset_fields(preset: str, ffn_hidden_size: int, router_type: str | None) -> dict:
    spec = parse_moe_model(preset)
    if router_type in ("dtopp", "topp-fixed"):
        # Same experts, Top-p router: the preset's 6 routed experts become the default target.
        spec = dataclasses.replace(spec, router_type=router_type)
    return spec.megatron_fields(ffn_hidden_size)


def expand_moe_arguments(argv: list[str]) -> list[str]:
    """Expand ``--moe-preset`` into megatron's MoE flags (placed first, so explicit flags win).
    Needs ``--ffn-hidden-size`` (``--xmod-backbone`` expands to it: expand that first)."""
    preset = _last_value(argv, "--moe-preset")
    if preset is None:
        return list(argv)
    ffn = _last_value(argv, "--ffn-hidden-size")
    if ffn is None:
        raise ValueError("ffn_hidden_size: --moe-preset derives the expert size d_e = FFN/8 from --ffn-hidden-size")
    head: list[str] = []
    for field, value in _preset_fields(preset, int(ffn), _last_value(argv, "--moe-router-type")).items():
        flag = _MEGATRON_FLAGS.get(field)
        if flag is None or value is None:
            continue  # megatron's defaults already match (dropless, no z-loss)
        if isinstance(value, bool):
            head += [flag] if value else []
        else:
            head += [flag, str(value)]
    return head + list(argv)


def apply_moe_arguments(args: argparse.Namespace, config_kwargs: dict) -> dict:
    """Put the MoE / DTop-p settings of parsed ``args`` into ``config_kwargs`` (MoEConfig field
    names) and return it. ``--moe-preset`` sets megatron's MoE fields (overriding what
    ``config_kwargs`` holds for them, typically megatron's defaults; it needs ``ffn_hidden_size``
    there), then the ``--dtopp-*`` flags apply on top. Build the config with
    ``MoEConfig(**config_kwargs)`` and the model with ``build_moe_gpt_model``."""
    router_type = getattr(args, "moe_router_type", None)
    preset = getattr(args, "moe_preset", None)
    if preset is not None:
        if "ffn_hidden_size" not in config_kwargs:
            raise ValueError("ffn_hidden_size: --moe-preset derives the expert size d_e = FFN/8 from it")
        for field, value in _preset_fields(preset, config_kwargs["ffn_hidden_size"], router_type).items():
            config_kwargs[field] = value
        if router_type == "dtopp" and getattr(args, "dtopp_target_experts", None) is None:
            config_kwargs.setdefault("dtopp_target_experts", float(parse_moe_model(preset).active_routed))
    for field in MOE_ARG_FIELDS:
        value = getattr(args, field, None)
        if value is not None:
            config_kwargs[field] = value
    return config_kwargs
