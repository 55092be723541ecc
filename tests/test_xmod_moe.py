"""Depth x width: routed (MoD / X-MoD) layers whose feed-forward is megatron's MoE layer (issue 24).

Names (``<depth>+<moe>``), the accounting against a hand derivation and the built model, megatron's
MoE losses and expert-bias loads seen from a routed layer (its routed tokens only, padding excluded),
and the entry point's flags; the multi-process runs (entry point, EP2, TP2 + SP) are marked slow.
"""
import dataclasses
from fractions import Fraction

import pytest
import torch
from helpers import TINY

from megatron_xmod.accounting import count_model
from megatron_xmod.presets import BACKBONES, parse_model, split_model_name

pytestmark = pytest.mark.usefixtures("fresh_moe_tracker")

LAYOUT = "D + (S2*2 + D)"  # one routed block of two layers at K = 2 (1-based layers 2 and 3)


def _build(name, seq_len=32, **overrides):
    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone

    config = moe_config_from_backbone(TINY, name, use_cpu_initialization=True, **overrides)
    return build_moe_gpt_model(config, TINY.vocab_size, seq_len, rotary_base=TINY.rotary_base), config


def _sparse_layers(model):
    from megatron_xmod.xmod.layers import XModSparseLayer

    return [layer for layer in model.decoder.layers if isinstance(layer, XModSparseLayer)]


# --- names --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, parts", [
    ("xmod-a4k8+moe-8x64", ("xmod-a4k8", "moe-8x64")),
    ("mod + dtopp-t6", ("mod", "dtopp-t6")),
    ("D*4 + (S8*8 + D)*3+moe-8x128", ("D*4 + (S8*8 + D)*3", "moe-8x128")),  # the layout's own '+' stays
    ("moe-8x64", (None, "moe-8x64")),
    ("D*4 + (S8*8 + D)*3", ("D*4 + (S8*8 + D)*3", None)),
])
def test_split_model_name(name, parts):
    assert split_model_name(name) == parts


@pytest.mark.parametrize("name", ["+moe-8x64", "moe-8x64+moe-8x128", "xmod-a4k8+moe-8x32"])
def test_bad_combined_names(name):
    with pytest.raises(ValueError, match="model:"):
        parse_model(name, BACKBONES["936m"])


def test_combined_name_is_the_depth_models_layout_with_the_moe_models_experts():
    b = BACKBONES["936m"]
    combined = parse_model("xmod-a4k8+moe-8x64", b)
    assert combined.layout == parse_model("xmod-a4k8", b).layout
    assert combined.moe == parse_model("moe-8x64", b).moe
    assert parse_model("mod+moe-8x64", b).family == "mod"


# --- accounting ---------------------------------------------------------------------------------

def test_accounting_of_xmod_a4k8_with_moe_8x64_by_hand():
    """936M backbone (h 1536, 16 heads of 128, 8 KV groups, FFN 3840, GPT-2 vocabulary): xmod-a4k8 is
    9 dense layers (prefix 4, 5 anchors) and 152 routed layers at K = 8; every layer's feed-forward is
    moe-8x64's: 64 routed experts (6 per token) + 2 shared, d_e = 3840 / 8 = 480, router 64 x h."""
    h, vocab, seq_len = 1536, 50257, 32768
    attention = h * (16 * 128 + 2 * 8 * 128) + 16 * 128 * h
    expert = 3 * h * 480
    moe_router = 64 * h
    norms = 2 * h + 2 * 128  # input and pre-MLP RMSNorm, QK-norm of one head each
    depth_router = h + 1 + 1  # the routed layer's d->1 router with bias, and varsigma
    embeddings = 2 * vocab * h + h
    layer_total = attention + moe_router + 66 * expert + norms
    active_matmul = attention + moe_router + 8 * expert  # 6 routed + 2 shared experts per token
    total = embeddings + 161 * layer_total + 152 * depth_router
    # a routed layer counts 1/8 of its activated parameters; its router scores every token
    active = embeddings + 9 * (active_matmul + norms) + 152 * (Fraction(active_matmul + norms, 8) + depth_router)
    matmul = 9 * active_matmul + 152 * (Fraction(active_matmul, 8) + h)
    attention_units = 9 + 152 * Fraction(1, 64)  # fraction routed x fraction of keys attended
    flops = 2 * matmul + 4 * seq_len * 2048 * attention_units
    dense_flops = 2 * 28 * (attention + 3 * h * 3840) + 4 * seq_len * 2048 * 28

    count = count_model(BACKBONES["936m"], "xmod-a4k8+moe-8x64", seq_len)
    assert count.total_params == total
    assert count.active_params == round(active)
    assert count.flops_per_token == pytest.approx(float(flops), rel=1e-12)
    assert count.flops_ratio_vs_dense == pytest.approx(float(flops / dense_flops), rel=1e-12)
    assert count.tokens_ratio_vs_dense == pytest.approx(float(dense_flops / flops), rel=1e-12)
    assert (count.num_layers, count.num_sparse_layers, count.activated_depth) == (161, 152, 28)
    assert count.layout.startswith("D*4 + (S8*24 + D) + (S8*32 + D)*4 | MoE 6:64+2 d_e=480")
    # What the combination adds over its parts: X-MoD's routers on top of the MoE model's activated
    # parameters (the same activated depth of MoE layers), and the depth routing's FLOP saving.
    moe = count_model(BACKBONES["936m"], "moe-8x64", seq_len)
    assert count.active_params == moe.active_params + 152 * depth_router
    assert count.flops_ratio_vs_dense < 0.52 < moe.flops_ratio_vs_dense


@pytest.mark.parametrize("name", [LAYOUT + "+moe-8x64", "mod-k2+dtopp-t2-e8"])
def test_built_model_matches_the_count(seeded, name):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_xmod.moe.router import BaselineTopKRouter, DTopPRouter

    model, config = _build(name)
    assert sum(p.numel() for p in model.parameters()) == count_model(TINY, name, 32).total_params
    router = DTopPRouter if "dtopp" in name else BaselineTopKRouter
    assert _sparse_layers(model) and config.layer_layout.num_sparse_layers == len(_sparse_layers(model))
    for layer in model.decoder.layers:  # anchors, prefix and routed layers alike
        assert isinstance(layer.mlp, MoELayer) and type(layer.mlp.router) is router


# --- megatron's MoE losses and expert bias on a routed layer --------------------------------------

@pytest.mark.parametrize("balancing, loss_name", [("aux_loss", "load_balancing_loss"),
                                                  ("seq_aux_loss", "seq_load_balancing_loss")])
def test_moe_aux_loss_of_a_routed_layer_is_megatrons_on_its_routed_tokens(seeded, balancing, loss_name):
    """The load-balancing loss a routed layer's MoE records equals megatron's own TopKRouter (same
    weights and expert bias) on the routed subsequence alone (L / K tokens per sequence), and not on
    the layer's whole input; its expert-bias loads count the routed tokens only."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    seq_len, batch = 32, 2
    model, config = _build(LAYOUT + "+moe-8x64", seq_len, moe_router_load_balancing_type=balancing)
    layer = _sparse_layers(model)[0]
    seen = {}

    def keep(name):
        def hook(module, args, kwargs):  # megatron's block calls its layers with keyword arguments
            seen[name] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    layer.register_forward_pre_hook(keep("x"), with_kwargs=True)
    layer.mlp.register_forward_pre_hook(keep("routed"), with_kwargs=True)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq_len))
    model(tokens, torch.arange(seq_len).expand(batch, seq_len), None, labels=tokens).mean().backward()
    recorded = get_moe_metrics_tracker().metrics[loss_name].values[layer.layer_number - 1].clone()
    assert seen["routed"].shape == (seq_len // 2, batch, TINY.hidden_size)  # only the routed L/K tokens
    assert layer.mlp.router.local_tokens_per_expert.sum() == 6 * (seq_len // 2) * batch
    dense = model.decoder.layers[0]
    assert dense.mlp.router.local_tokens_per_expert.sum() == 6 * seq_len * batch

    def megatrons_loss(hidden):
        destroy_moe_metrics_tracker()
        reference = TopKRouter(config, pg_collection=get_default_pg_collection())
        reference.load_state_dict(layer.mlp.router.state_dict())
        reference.set_layer_number(layer.layer_number)
        reference.train()
        reference(hidden)
        return get_moe_metrics_tracker().metrics[loss_name].values[layer.layer_number - 1]

    torch.testing.assert_close(recorded, megatrons_loss(seen["routed"]), rtol=1e-6, atol=0)
    normed_whole = layer.pre_mlp_layernorm(seen["x"])  # the same router on the whole sequence: another loss
    assert not torch.allclose(recorded, megatrons_loss(normed_whole), rtol=1e-3, atol=0)


def test_padding_rows_of_a_routed_batch_are_left_out_of_the_moe_losses(seeded):
    """A routed batch with padding rows at its end (sequence parallelism's, the threshold rule's): the
    MoE load-balancing loss, the expert-bias loads and the real rows' output are those of the real rows
    alone."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker

    model, _ = _build(LAYOUT + "+moe-8x64")
    layer = _sparse_layers(model)[0]
    real = torch.randn(6, 2, TINY.hidden_size)
    padded = torch.cat([real, torch.randn(3, 2, TINY.hidden_size)])
    padding = torch.zeros(9, 2, dtype=torch.bool)
    padding[6:] = True
    results = []
    for x, mask in ((real, None), (padded, padding)):
        destroy_moe_metrics_tracker()
        layer.mlp.router.local_tokens_per_expert.zero_()
        attention, mlp = layer._attention_and_mlp(x, None, None, mask)
        results.append((mlp[:6], layer.mlp.router.local_tokens_per_expert.clone(),
                        get_moe_metrics_tracker().metrics["load_balancing_loss"].values.clone()))
    (out_real, loads_real, loss_real), (out_padded, loads_padded, loss_padded) = results
    torch.testing.assert_close(out_padded, out_real, rtol=1e-5, atol=1e-6)
    assert torch.equal(loads_padded, loads_real) and loads_real.sum() == 6 * 12
    torch.testing.assert_close(loss_padded, loss_real, rtol=1e-6, atol=0)


def test_dtopp_controller_counts_routed_tokens_only(seeded):
    model, _ = _build("mod-k2+dtopp-t2-e8")
    tokens = torch.randint(0, TINY.vocab_size, (2, 32))
    model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).mean().backward()
    counts = {layer.layer_number: layer.mlp.router.dtopp_token_count.item() for layer in model.decoder.layers}
    sparse = {layer.layer_number for layer in _sparse_layers(model)}
    assert {n: c for n, c in counts.items() if n in sparse} == {n: 32.0 for n in sparse}  # 16 of 32 tokens x 2
    assert {n: c for n, c in counts.items() if n not in sparse} == {n: 64.0 for n in counts if n not in sparse}


# --- flags --------------------------------------------------------------------------------------

def test_entry_point_flags_expand_a_combined_name():
    from megatron_xmod.training.flags import expand_arguments

    argv = expand_arguments(["--xmod-backbone", "936m", "--xmod-model", "xmod-a4k8+moe-8x64"])
    layout = parse_model("xmod-a4k8", BACKBONES["936m"]).layout
    assert argv[argv.index("--xmod-layout") + 1] == layout.notation
    assert argv[argv.index("--num-layers") + 1] == "161"
    assert argv[argv.index("--num-experts") + 1] == "64" and argv[argv.index("--moe-router-topk") + 1] == "6"
    assert argv[argv.index("--moe-ffn-hidden-size") + 1] == "480"
    with pytest.raises(ValueError, match="xmod_model: .* disagrees with --moe-preset"):
        expand_arguments(["--xmod-backbone", "936m", "--xmod-model", "xmod-a4k8+moe-8x64", "--moe-preset", "moe-8x128"])


def test_moe_layer_freq_other_than_one_is_refused_in_a_routed_layout():
    from megatron_xmod.moe.model import moe_config_from_backbone

    with pytest.raises(ValueError, match="moe_layer_freq: "):
        moe_config_from_backbone(dataclasses.replace(TINY), LAYOUT + "+moe-8x64", moe_layer_freq=2,
                                 use_cpu_initialization=True)
