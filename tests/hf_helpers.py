"""Tiny megatron models of every family and their HF twins, for tests/test_hf_modeling.py.

(Reconstructed by the HF-io engineer after overwriting the original by mistake; same names:
KINDS, SEQ, build_megatron, hf_twin, megatron_logits.)
"""
import torch
from helpers import TINY

from megatron_xmod.presets import split_model_name

SEQ = 64
# kind -> (layout or MoE model name, config overrides)
KINDS = {
    "dense": ("D*4", {}),
    "dense-interleaved-rope": ("D*2", dict(rotary_interleaved=True, qk_layernorm=False)),
    "mod": ("D + (S4 + D)*2 + D", {"xmod_routing_family": "mod"}),
    "xmod": ("D + (S4*2 + D)*2 + D", {"xmod_routing_family": "xmod"}),
    # top-k per segment (--xmod-routing-segments): the export's routing_segments, read by routing_rule="topk"
    "xmod-segments": ("D + (S4*2 + D)*2 + D", {"xmod_routing_family": "xmod", "xmod_routing_segments": 4}),
    "moe": ("moe-8x64", {"num_moe_experts": 8, "moe_router_topk": 2}),
    "dtopp": ("dtopp-t2-e8", {}),
    # routed layers whose feed-forward is the MoE layer (issue 24), dense anchors and prefix MoE too
    "xmod-moe": ("D + (S4*2 + D)*2 + D+moe-8x64", {"xmod_routing_family": "xmod", "num_moe_experts": 8,
                                                    "moe_router_topk": 2}),
    "mod-dtopp": ("D + (S4 + D)*2 + D+dtopp-t2-e8", {"xmod_routing_family": "mod"}),
}


def build_megatron(kind: str):
    """A TP1 megatron model of ``kind`` with non-trivial routing state, and its config."""
    from megatron_xmod.model import build_gpt_model, config_from_backbone, sparse_layers

    layout, overrides = KINDS[kind]
    if split_model_name(layout)[1] is not None:  # experts
        from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone

        config = moe_config_from_backbone(TINY, layout, use_cpu_initialization=True, **overrides)
        model = build_moe_gpt_model(config, TINY.vocab_size, SEQ, rotary_base=TINY.rotary_base)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # routing state a trained model would have: not the initial values
            for module in model.modules():
                if hasattr(module, "expert_bias") and torch.is_tensor(module.expert_bias):
                    module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=g) * 0.3)
                if hasattr(module, "dtopp_threshold"):
                    module.dtopp_threshold.fill_(0.62)
                if getattr(module, "drn_scale", None) is not None:
                    module.drn_scale.fill_(1.7)
            for layer in sparse_layers(model):
                layer.router.weight.mul_(20.0)
    else:
        config = config_from_backbone(TINY, layout, use_cpu_initialization=True, **overrides)
        model = build_gpt_model(config, TINY.vocab_size, SEQ, rotary_base=TINY.rotary_base)
        with torch.no_grad():
            for layer in sparse_layers(model):  # content-decided routing, not near-zero router logits
                layer.router.weight.mul_(20.0)
    return model.eval(), config


def hf_twin(model, config):
    """The HF model with the megatron model's weights (through the adapter)."""
    from megatron_xmod.hf import XModForCausalLM
    from megatron_xmod.hf.state_dict_adapter import hf_config_from_megatron, megatron_to_hf

    hf_config = hf_config_from_megatron(config, vocab_size=TINY.vocab_size, max_position_embeddings=SEQ,
                                        rotary_base=TINY.rotary_base)
    hf = XModForCausalLM(hf_config)
    hf.load_state_dict(megatron_to_hf(model.state_dict(), hf_config), strict=True)
    return hf.float().eval()


def megatron_logits(model, tokens):
    model.eval()
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return model(tokens, positions, None).float()


def left_padded(prompts, pad: int):
    """(batch [n, width], attention mask) of 1-D token tensors ``prompts``, padded on the left with ``pad``."""
    width = max(len(p) for p in prompts)
    batch = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, p in enumerate(prompts):
        batch[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return batch, mask
