"""Megatron <-> Hugging Face: the config and the weights of one model, beside the model (torchtitan's
state-dict-adapter pattern: neither model knows about the other).

Interface (what ``xmod export-hf`` / ``xmod import-hf`` call):

- :func:`hf_config_from_megatron(config, *, vocab_size, max_position_embeddings, rotary_base,
  rotary_percent=1.0, tie_word_embeddings=False, position_embedding_type="rope", **hf_overrides)`
  -> :class:`XModHFConfig`. ``config`` is the megatron config the model was built with
  (``XModConfig`` / ``MoEConfig``, or megatron's plain ``TransformerConfig`` for a dense model; the
  training entry point's ``megatron_xmod.training.providers.config_from_args(args)`` rebuilds it
  from a checkpoint's args); the keywords are the GPTModel arguments that are not config fields
  (``args.padded_vocab_size``, ``args.max_position_embeddings``, ``args.rotary_base``,
  ``args.rotary_percent``, ``not args.untie_embeddings_and_output_weights``,
  ``args.position_embedding_type``). :func:`hf_config_from_args` does exactly that from a megatron
  args namespace. Anything the HF model cannot reproduce raises ``ValueError("field: why; fix")``.
- :func:`megatron_to_hf(state_dict, hf_config)` -> HF state dict. ``state_dict`` is the full,
  unsharded GPTModel state dict of the model (``model.state_dict()`` of a TP1/PP1 model, or the
  merged tensors of a torch_dist checkpoint). Both layer-norm namings are read: megatron's local
  modules (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) and Transformer Engine's fused
  ones (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``, which
  is also how torch_dist checkpoints name them); experts as ``SequentialMLP``
  (``experts.local_experts.<e>.linear_fc1.weight``) or TE grouped (``experts.linear_fc1.weight<e>``).
  ``_extra_state`` entries (TE/fp8 metadata, None on the local path) are skipped; any other unknown
  or missing key raises.
- :func:`hf_to_megatron(hf_state_dict, hf_config, *, layer_norm_names="local", experts="sequential")`
  -> megatron state dict, the exact inverse (tensors only, no ``_extra_state``):
  ``hf_to_megatron(megatron_to_hf(sd, c), c)`` equals ``sd`` bit for bit, key for key, for the
  naming it was read in. ``layer_norm_names="te"`` writes the fused TE names (what a torch_dist
  checkpoint and a TE-built model use), ``experts="grouped"`` the TE grouped-GEMM expert names.
- :data:`EXPORTED_FILES`: ``{file name in the exported folder: source path}`` of the package files
  copied verbatim next to config.json (modeling, configuration, cache, and the routing rules, which
  live once in :mod:`megatron_xmod.xmod.routing` and :mod:`megatron_xmod.moe.scores`).

Layouts: megatron's fused ``linear_qkv`` weight is ``[groups * (q_per_group + 2) * head_dim, hidden]``
with rows ordered per query group as (q heads of the group, k, v); the HF model keeps separate
``q_proj`` / ``k_proj`` / ``v_proj`` (head-major, as Llama). SwiGLU ``linear_fc1`` is ``[gate; up]``.
Splitting and re-joining are pure indexing, so the round trip is exact.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megatron_xmod.hf.configuration_xmod import XModHFConfig

_PACKAGE = Path(__file__).resolve().parent.parent
EXPORTED_FILES = {
    "configuration_xmod.py": _PACKAGE / "hf" / "configuration_xmod.py",
    "modeling_xmod.py": _PACKAGE / "hf" / "modeling_xmod.py",
    "cache.py": _PACKAGE / "hf" / "cache.py",
    "static_decode.py": _PACKAGE / "hf" / "static_decode.py",
    "region_attention.py": _PACKAGE / "hf" / "region_attention.py",
    "routing.py": _PACKAGE / "xmod" / "routing.py",
    "moe_scores.py": _PACKAGE / "moe" / "scores.py",
}
AUTO_MAP = {
    "AutoConfig": "configuration_xmod.XModHFConfig",
    "AutoModelForCausalLM": "modeling_xmod.XModForCausalLM",
}
LAYER_NORM_NAMES = ("local", "te")
EXPERT_NAMES = ("sequential", "grouped")


# --- config ----------------------------------------------------------------------------------------

def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(message)


def hf_config_from_megatron(
    config,
    *,
    vocab_size: int,
    max_position_embeddings: int,
    rotary_base: float = 1_000_000,
    rotary_percent: float = 1.0,
    tie_word_embeddings: bool = False,
    position_embedding_type: str = "rope",
    **hf_overrides,
) -> XModHFConfig:
    """The :class:`XModHFConfig` of the megatron model built from ``config`` (see the module docstring)."""
    c = config
    _refuse(position_embedding_type != "rope",
            f"position_embedding_type: the HF model implements RoPE only, got {position_embedding_type!r}; "
            "export a model trained with --position-embedding-type rope")
    _refuse(c.normalization != "RMSNorm",
            f"normalization: the HF model implements RMSNorm only, got {c.normalization!r}")
    checks = [  # (field, value that is supported, why)
        ("add_bias_linear", False, "linear layers with biases are not implemented; train with --disable-bias-linear"),
        ("add_qkv_bias", False, "a QKV bias is not implemented"),
        ("layernorm_zero_centered_gamma", False, "zero-centred norm weights are not implemented"),
        ("apply_residual_connection_post_layernorm", False, "post-norm residuals are not implemented"),
        ("attention_output_gate", False, "gated attention output is not implemented"),
        ("softmax_type", "vanilla", "only the plain softmax is implemented"),
        ("multi_latent_attention", False, "MLA is not implemented"),
        ("mtp_num_layers", None, "multi-token prediction heads are not exported"),
        ("rotary_scaling", False, "llama-3 RoPE scaling is not implemented"),
        ("window_size", None, "sliding-window attention is not implemented"),
        ("softmax_scale", None, "a custom attention softmax scale is not implemented (1/sqrt(head_dim) is)"),
        ("qk_l2_norm", False, "L2 QK-norm is not implemented (RMSNorm QK-norm, qk_layernorm, is)"),
        ("no_rope_freq", None, "layers without RoPE are not implemented"),
        ("experimental_attention_variant", None, "only softmax attention is implemented"),
        ("linear_attention_freq", None, "linear-attention layers are not implemented"),
        ("use_mup", False, "muP multipliers are not implemented"),
        ("glu_linear_offset", 0.0, "a GLU linear offset is not implemented"),
        ("activation_func_clamp_value", None, "activation clamping is not implemented"),
        ("heterogeneous_block_specs", False, "heterogeneous blocks are not implemented"),
    ]
    for name, supported, why in checks:
        value = getattr(c, name, supported)
        _refuse(value != supported and value is not supported, f"{name}: {why}; got {value!r}")
    gated = bool(c.gated_linear_unit)
    activation = getattr(c.activation_func, "__name__", str(c.activation_func))
    acts = {"silu": "silu", "gelu": "gelu"}
    _refuse(activation not in acts, f"activation_func: {activation!r} is not one of silu, gelu")
    heads = c.num_attention_heads
    groups = c.num_query_groups or heads
    head_dim = c.kv_channels or c.hidden_size // heads
    fields = dict(
        vocab_size=int(vocab_size),
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=head_dim,
        max_position_embeddings=int(max_position_embeddings),
        rms_norm_eps=float(c.layernorm_epsilon),
        rope_theta=rotary_base,
        rotary_percent=float(rotary_percent),
        rotary_interleaved=bool(c.rotary_interleaved),
        qk_layernorm=bool(c.qk_layernorm),
        hidden_act=acts[activation],
        gated_linear_unit=gated,
        tie_word_embeddings=bool(tie_word_embeddings),
    )
    fields.update(_routing_fields(c))
    if c.num_moe_experts is not None:
        fields.update(_moe_fields(c))
    fields.update(hf_overrides)
    return XModHFConfig(**fields)


def _routing_fields(c) -> dict:
    layout = getattr(c, "layer_layout", None)
    if layout is None:  # megatron's plain TransformerConfig: a dense model
        return dict(routing_family="dense")
    return dict(
        routing_family=layout.family if layout.num_sparse_layers else "dense",
        layer_kinds=["sparse" if layer.is_sparse else "dense" for layer in layout.layers],
        layer_sparsity_k=[layer.sparsity_k if layer.is_sparse else 1 for layer in layout.layers],
        layout=layout.notation,
        token_choice_bias_tau=float(c.xmod_token_choice_bias_tau),
        token_choice_bias_increment=float(c.xmod_token_choice_bias_increment),
        # The exported model decodes token by token: the causal threshold rule, whatever the run evaluated
        # with (top-k stays selectable per call, forward(routing_rule="topk"), for full-sequence scoring).
        routing_rule="threshold",
        routing_segments=int(getattr(c, "xmod_routing_segments", 1)),
    )


def _moe_fields(c) -> dict:
    freq = c.moe_layer_freq
    _refuse(not (freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))),
            f"moe_layer_freq: the HF model puts experts in every layer (as every megatron_xmod MoE preset), got {freq!r}")
    unsupported = [
        ("moe_shared_expert_gate", False, "a gated shared expert is not implemented"),
        ("moe_router_num_groups", None, "group-limited routing is not implemented"),
        ("moe_router_group_topk", None, "group-limited routing is not implemented"),
        ("moe_router_load_balancing_type", None, None),
        ("moe_apply_probs_on_input", False, "probabilities on the expert input are not implemented"),
        ("moe_latent_size", None, "latent MoE is not implemented"),
        ("moe_expert_capacity_factor", None,
         "the HF model is dropless (a capacity drops tokens depending on the whole batch, which no "
         "causal decoder can reproduce); export a dropless model"),
        ("moe_router_force_load_balancing", False, "benchmark-only random routing"),
        ("moe_router_force_biased", None, "benchmark-only biased routing"),
    ]
    for name, supported, why in unsupported:
        value = getattr(c, name, supported)
        if name == "moe_router_load_balancing_type":
            _refuse(value in ("sinkhorn", "quantile_balancing"),
                    f"{name}: {value!r} routes differently at inference and is not implemented; use aux_loss or none")
            continue
        _refuse(value != supported and value is not supported, f"{name}: {why}; got {value!r}")
    router_type = getattr(c, "moe_router_type", "topk")
    norm = getattr(c, "dtopp_routing_norm", "none") or "none"
    return dict(
        num_experts=c.num_moe_experts,
        moe_intermediate_size=c.moe_ffn_hidden_size,
        shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
        moe_router_type=router_type,
        moe_router_topk=c.moe_router_topk,
        moe_score_function=c.moe_router_score_function,
        moe_router_pre_softmax=bool(c.moe_router_pre_softmax),
        moe_router_topk_scaling_factor=c.moe_router_topk_scaling_factor,
        moe_expert_bias=bool(c.moe_router_enable_expert_bias),
        moe_routing_norm=norm,
        moe_routing_norm_theta=float(getattr(c, "dtopp_routing_norm_init", 1.0)),
    )


def hf_config_from_args(args, **hf_overrides) -> XModHFConfig:
    """:func:`hf_config_from_megatron` from a megatron training args namespace (e.g. the ``args`` a
    checkpoint saved): the config through the entry point's own ``config_from_args``."""
    from megatron_xmod.training.providers import config_from_args

    _refuse(getattr(args, "rotary_seq_len_interpolation_factor", None) not in (None, 1, 1.0),
            "rotary_seq_len_interpolation_factor: RoPE interpolation is not implemented")
    _refuse(bool(getattr(args, "use_rope_scaling", False)), "use_rope_scaling: llama-3 RoPE scaling is not implemented")
    return hf_config_from_megatron(
        config_from_args(args),
        vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        rotary_base=args.rotary_base,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        **hf_overrides,
    )


# --- weights ---------------------------------------------------------------------------------------

def _qkv_sizes(cfg: XModHFConfig) -> tuple[int, int, int]:
    return cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim


def split_qkv(qkv: torch.Tensor, cfg: XModHFConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's per-group interleaved ``linear_qkv`` weight -> (q, k, v) weights, head-major."""
    groups, q_per_group, d = _qkv_sizes(cfg)
    expected = groups * (q_per_group + 2) * d
    if qkv.shape[0] != expected:
        raise ValueError(f"linear_qkv: expected {expected} rows for {groups} groups x ({q_per_group} q + k + v) "
                         f"x head_dim {d}, got {tuple(qkv.shape)}; check num_key_value_heads/head_dim")
    per_group = qkv.reshape(groups, (q_per_group + 2) * d, -1)
    q, k, v = torch.split(per_group, [q_per_group * d, d, d], dim=1)
    return q.reshape(groups * q_per_group * d, -1), k.reshape(groups * d, -1), v.reshape(groups * d, -1)


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: XModHFConfig) -> torch.Tensor:
    groups, q_per_group, d = _qkv_sizes(cfg)
    hidden = q.shape[-1]
    per_group = torch.cat([q.reshape(groups, q_per_group * d, hidden), k.reshape(groups, d, hidden),
                           v.reshape(groups, d, hidden)], dim=1)
    return per_group.reshape(groups * (q_per_group + 2) * d, hidden)


class _Reader:
    """Pops megatron keys, accepting alternative names; reports what is missing or left over."""

    def __init__(self, state_dict: dict):
        self.entries = {k: v for k, v in state_dict.items() if not k.endswith("._extra_state")}

    def pop(self, *names: str, required: bool = True) -> Optional[torch.Tensor]:
        for name in names:
            if name in self.entries:
                return self.entries.pop(name)
        if required:
            raise ValueError(f"state_dict: missing {' or '.join(names)}; is hf_config the config of this model?")
        return None

    def finish(self) -> None:
        if self.entries:
            keys = sorted(self.entries)
            raise ValueError(f"state_dict: {len(keys)} entries the HF model has no place for, e.g. {keys[:5]}; "
                             "is hf_config the config of this model?")


def _mlp_to_hf(weight1: torch.Tensor, weight2: torch.Tensor, prefix: str, cfg: XModHFConfig, out: dict) -> None:
    if cfg.gated_linear_unit:
        gate, up = torch.chunk(weight1, 2, dim=0)
        out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate.clone(), up.clone()
    else:
        out[prefix + "up_proj.weight"] = weight1
    out[prefix + "down_proj.weight"] = weight2


def _mlp_from_hf(hf: dict, prefix: str, cfg: XModHFConfig) -> tuple[torch.Tensor, torch.Tensor]:
    up = hf[prefix + "up_proj.weight"]
    fc1 = torch.cat([hf[prefix + "gate_proj.weight"], up], dim=0) if cfg.gated_linear_unit else up
    return fc1, hf[prefix + "down_proj.weight"]


def router_buffers(cfg: XModHFConfig) -> list[str]:
    """The MoE router state besides its weight: megatron's expert bias (Top-k), the DTop-p threshold
    and controller integral (Top-p; the threshold is the one the controller reached), theta_l (DRN)."""
    if not cfg.is_moe:
        return []
    if cfg.moe_router_type == "topk":
        return ["expert_bias"] if cfg.moe_expert_bias else []
    return ["dtopp_threshold", "dtopp_integral"] + (["drn_scale"] if cfg.moe_routing_norm == "learnable" else [])


def megatron_to_hf(state_dict: dict[str, torch.Tensor], hf_config: XModHFConfig) -> dict[str, torch.Tensor]:
    cfg = hf_config
    src = _Reader(state_dict)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": src.pop("embedding.word_embeddings.weight")}
    for i in range(cfg.num_hidden_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = src.pop(m + "input_layernorm.weight",
                                                   m + "self_attention.linear_qkv.layer_norm_weight")
        q, k, v = split_qkv(src.pop(m + "self_attention.linear_qkv.weight"), cfg)
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q.clone(), k.clone()
        out[h + "self_attn.v_proj.weight"] = v.clone()
        out[h + "self_attn.o_proj.weight"] = src.pop(m + "self_attention.linear_proj.weight")
        if cfg.qk_layernorm:
            out[h + "self_attn.q_norm.weight"] = src.pop(m + "self_attention.q_layernorm.weight")
            out[h + "self_attn.k_norm.weight"] = src.pop(m + "self_attention.k_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = src.pop(m + "pre_mlp_layernorm.weight",
                                                            m + "mlp.linear_fc1.layer_norm_weight")
        if cfg.is_sparse(i):
            out[h + "router.weight"] = src.pop(m + "router.weight")
            out[h + "router.bias"] = src.pop(m + "router.bias")
            if cfg.routing_family == "xmod":
                out[h + "gate_scale"] = src.pop(m + "gate_scale")
        if not cfg.is_moe:
            _mlp_to_hf(src.pop(m + "mlp.linear_fc1.weight"), src.pop(m + "mlp.linear_fc2.weight"), h + "mlp.", cfg, out)
            continue
        out[h + "mlp.router.weight"] = src.pop(m + "mlp.router.weight")
        for name in router_buffers(cfg):
            out[h + f"mlp.router.{name}"] = src.pop(m + f"mlp.router.{name}")
        for e in range(cfg.num_experts):
            fc1 = src.pop(m + f"mlp.experts.local_experts.{e}.linear_fc1.weight", m + f"mlp.experts.linear_fc1.weight{e}")
            fc2 = src.pop(m + f"mlp.experts.local_experts.{e}.linear_fc2.weight", m + f"mlp.experts.linear_fc2.weight{e}")
            _mlp_to_hf(fc1, fc2, h + f"mlp.experts.{e}.", cfg, out)
        if cfg.shared_expert_intermediate_size:
            _mlp_to_hf(src.pop(m + "mlp.shared_experts.linear_fc1.weight"),
                       src.pop(m + "mlp.shared_experts.linear_fc2.weight"), h + "mlp.shared_experts.", cfg, out)
    out["model.norm.weight"] = src.pop("decoder.final_layernorm.weight")
    output = src.pop("output_layer.weight", required=not cfg.tie_word_embeddings)
    if output is not None and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = output
    elif output is not None and not torch.equal(output, out["model.embed_tokens.weight"]):
        raise ValueError("tie_word_embeddings: the config ties the output layer to the embedding, but the state "
                         "dict has a different output_layer.weight; set tie_word_embeddings=False")
    src.finish()
    _check_model_keys(cfg, out)
    return out


def hf_to_megatron(hf_state_dict: dict[str, torch.Tensor], hf_config: XModHFConfig, *,
                   layer_norm_names: str = "local", experts: str = "sequential") -> dict[str, torch.Tensor]:
    if layer_norm_names not in LAYER_NORM_NAMES:
        raise ValueError(f"layer_norm_names: {layer_norm_names!r} is not one of {', '.join(LAYER_NORM_NAMES)}")
    if experts not in EXPERT_NAMES:
        raise ValueError(f"experts: {experts!r} is not one of {', '.join(EXPERT_NAMES)}")
    cfg, hf = hf_config, hf_state_dict
    _check_model_keys(cfg, hf)
    te = layer_norm_names == "te"
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(cfg.num_hidden_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        if cfg.is_sparse(i) and cfg.routing_family == "xmod":
            out[m + "gate_scale"] = hf[h + "gate_scale"]
        input_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        out[m + input_norm] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "self_attention.linear_qkv.weight"] = join_qkv(
            hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"], cfg)
        if cfg.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        # TE fuses the pre-MLP norm into linear_fc1 only in dense MLPs; an MoE layer keeps its own norm.
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te and not cfg.is_moe else "pre_mlp_layernorm.weight"
        out[m + mlp_norm] = hf[h + "post_attention_layernorm.weight"]
        if not cfg.is_moe:
            out[m + "mlp.linear_fc1.weight"], out[m + "mlp.linear_fc2.weight"] = _mlp_from_hf(hf, h + "mlp.", cfg)
        else:
            out[m + "mlp.router.weight"] = hf[h + "mlp.router.weight"]
            for name in router_buffers(cfg):
                out[m + f"mlp.router.{name}"] = hf[h + f"mlp.router.{name}"]
            for e in range(cfg.num_experts):
                fc1, fc2 = _mlp_from_hf(hf, h + f"mlp.experts.{e}.", cfg)
                if experts == "grouped":
                    out[m + f"mlp.experts.linear_fc1.weight{e}"], out[m + f"mlp.experts.linear_fc2.weight{e}"] = fc1, fc2
                else:
                    out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                    out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
            if cfg.shared_expert_intermediate_size:
                fc1, fc2 = _mlp_from_hf(hf, h + "mlp.shared_experts.", cfg)
                out[m + "mlp.shared_experts.linear_fc1.weight"], out[m + "mlp.shared_experts.linear_fc2.weight"] = fc1, fc2
        if cfg.is_sparse(i):
            out[m + "router.weight"], out[m + "router.bias"] = hf[h + "router.weight"], hf[h + "router.bias"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _check_model_keys(cfg: XModHFConfig, hf: dict) -> None:
    """The HF keys must be exactly those of the HF model of ``cfg``."""
    expected = set(expected_hf_keys(cfg))
    present = set(hf)
    if cfg.tie_word_embeddings:  # a tied model's state_dict() lists the shared weight under both names
        present.discard("lm_head.weight")
    missing = sorted(expected - present)
    unexpected = sorted(present - expected)
    if missing or unexpected:
        raise ValueError(f"hf_state_dict: does not match the config (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}); was it written for this config?")


def expected_hf_keys(cfg: XModHFConfig) -> list[str]:
    """The state-dict names of the HF model of ``cfg`` (parameters and persistent buffers)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        keys.append("lm_head.weight")
    mlp = (["gate_proj.weight"] if cfg.gated_linear_unit else []) + ["up_proj.weight", "down_proj.weight"]
    for i in range(cfg.num_hidden_layers):
        h = f"model.layers.{i}."
        keys += [h + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")]
        if cfg.qk_layernorm:
            keys += [h + "self_attn.q_norm.weight", h + "self_attn.k_norm.weight"]
        if cfg.is_sparse(i):
            keys += [h + "router.weight", h + "router.bias"] + ([h + "gate_scale"] if cfg.routing_family == "xmod" else [])
        if not cfg.is_moe:
            keys += [h + "mlp." + n for n in mlp]
            continue
        keys += [h + "mlp.router.weight"] + [h + f"mlp.router.{name}" for name in router_buffers(cfg)]
        keys += [h + f"mlp.experts.{e}." + n for e in range(cfg.num_experts) for n in mlp]
        if cfg.shared_expert_intermediate_size:
            keys += [h + "mlp.shared_experts." + n for n in mlp]
    return keys
