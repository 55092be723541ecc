"""MoE baselines (8:64 / 8:128), DTop-p models and the DTop-p paper's own presets: the X-MoD
paper's Table 6 accounting, the megatron model they build, the Top-k baseline router, the
entry-point flags and the LM z-loss."""
import argparse
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from helpers import TINY

from megatron_xmod.accounting import count_model
from megatron_xmod.moe.presets import parse_moe_model
from megatron_xmod.presets import BACKBONES, Backbone

pytestmark = pytest.mark.usefixtures("fresh_moe_tracker")

# X-MoD paper, Table 6, MoE rows: (backbone, model, d_e, printed N, printed FLOPs/token at L = 32768).
TABLE6_MOE = [
    ("556m", "moe-8x64", 384, "2.46B", "8.4e9"), ("556m", "moe-8x128", 384, "4.58B", "8.4e9"),
    ("936m", "moe-8x64", 480, "4.51B", "9.0e9"), ("936m", "moe-8x128", 480, "8.48B", "9.0e9"),
    ("1.65b", "moe-8x64", 768, "9.28B", "1.0e10"), ("1.65b", "moe-8x128", 768, "17.16B", "1.0e10"),
]
# Printed values that do not follow from the paper's own configuration (Table 4 backbone, 6:128+2
# experts of d_e = 768, 28 layers): 28 x (12.58M attention + 0.26M router + 130 x 4.72M experts)
# + 0.21B embeddings = 17.74B. 17.16B would need ~124 experts per layer.
DISCREPANCIES = {("1.65b", "moe-8x128"): "17.74B"}


def _printed(value, printed):
    decimals = len(printed[:-1].split(".")[1])
    return f"{value / 1e9:.{decimals}f}B"


def _two_significant(value):
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


@pytest.mark.parametrize("backbone, model, d_e, printed_n, printed_flops", TABLE6_MOE)
def test_table6_moe_row(backbone, model, d_e, printed_n, printed_flops):
    b = BACKBONES[backbone]
    assert parse_moe_model(model).expert_ffn_size(b.ffn_hidden_size) == d_e
    count = count_model(b, model, 32768)
    assert _two_significant(count.flops_per_token) == printed_flops
    assert round(count.flops_ratio_vs_dense, 2) == 1.00  # Table 1: MoE phi/phi_D = 1.00
    expected = DISCREPANCIES.get((backbone, model), printed_n)
    assert _printed(count.total_params, expected) == expected
    if (backbone, model) in DISCREPANCIES:
        assert _printed(count.total_params, printed_n) != printed_n, "discrepancy resolved? update the table"


def test_dtopp_at_the_baseline_target_costs_the_baseline_flops():
    b = BACKBONES["936m"]
    baseline, dtopp = count_model(b, "moe-8x64", 32768), count_model(b, "dtopp-t6", 32768)
    assert dtopp.flops_per_token == baseline.flops_per_token
    assert dtopp.total_params == baseline.total_params + 28  # theta_l, one per layer
    more = count_model(b, "dtopp-t8", 32768)
    assert more.flops_per_token - baseline.flops_per_token == pytest.approx(28 * 2 * 2 * 3 * 1536 * 480)
    assert count_model(b, "dtopp-t6-e128", 32768).total_params == count_model(b, "moe-8x128", 32768).total_params + 28


def test_cli_counts_moe_models():
    out = subprocess.run([sys.executable, "-m", "megatron_xmod.cli", "count", "--backbone", "936m", "--model", "moe-8x128",
                          "--model", "dtopp-t6", "--json"], capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert {"total_params", "active_params", "flops_per_token", "flops_ratio_vs_dense", "num_layers"} <= set(rows[0])
    assert f"{rows[0]['total_params'] / 1e9:.2f}" == "8.48" and rows[0]["num_layers"] == 28
    assert rows[1]["model"] == "dtopp-t6"


@pytest.mark.parametrize("name", ["moe-8x32", "dtopp-t0.5", "dtopp-t70", "topp-p1.5", "moe-9x9"])
def test_bad_model_names(name):
    with pytest.raises(ValueError, match="model:"):
        parse_moe_model(name)


@pytest.mark.parametrize("name", ["moe-8x64", "dtopp-t2-e8"])
def test_built_model_uses_megatron_moe_and_matches_the_count(seeded, name):
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import BaselineTopKRouter, DTopPRouter, dtopp_finalize_model_grads

    config = moe_config_from_backbone(TINY, name, use_cpu_initialization=True)
    model = build_moe_gpt_model(config, TINY.vocab_size, 32, rotary_base=TINY.rotary_base)
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp.shared_experts, SharedExpertMLP)
    assert config.moe_shared_expert_intermediate_size == 2 * config.moe_ffn_hidden_size == 2 * TINY.ffn_hidden_size // 8
    assert config.moe_expert_capacity_factor is None  # dropless
    if name.startswith("moe"):
        assert type(mlp.router) is BaselineTopKRouter and mlp.router.expert_bias is not None
        assert config.moe_router_topk == 6 and config.moe_aux_loss_coeff > 0 and config.moe_z_loss_coeff is None
    else:
        assert isinstance(mlp.router, DTopPRouter) and config.finalize_model_grads_func is dtopp_finalize_model_grads
    built = sum(p.numel() for p in model.parameters())
    assert built == count_model(TINY, name, 32).total_params
    tokens = torch.randint(0, TINY.vocab_size, (2, 32))
    loss = model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).mean()
    loss.backward()
    assert torch.isfinite(loss)


def test_training_run_drives_active_experts_to_target(seeded):
    """A tiny MoE GPT (2 layers, 8 experts, T = 2) trained on English text: the global DTop-p
    controller brings the mean routed experts per token from ~1 to 2 while the router learns."""
    from helpers import english_bytes

    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import dtopp_routers, update_dtopp_controllers

    backbone = dataclasses.replace(TINY, num_layers=2)
    config = moe_config_from_backbone(backbone, "dtopp-t2-e8", use_cpu_initialization=True, dtopp_kp=0.5,
                                      dtopp_ki=0.5, moe_shared_expert_intermediate_size=None)
    model = build_moe_gpt_model(config, backbone.vocab_size, 32, rotary_base=backbone.rotary_base)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, g = english_bytes(), torch.Generator().manual_seed(0)
    routers = dtopp_routers(model)
    curve = []
    for _step in range(200):
        starts = torch.randint(0, len(data) - 33, (8,), generator=g)
        batch = torch.stack([data[s:s + 33] for s in starts])
        loss = model(batch[:, :-1], torch.arange(32).expand(8, 32), None, labels=batch[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        active = sum(r.dtopp_active_sum.item() for r in routers) / sum(r.dtopp_token_count.item() for r in routers)
        update_dtopp_controllers(model)  # once per global batch, after the gradient step
        curve.append((round(active, 3), round(routers[0].dtopp_threshold.item(), 3), round(loss.item(), 3)))
    print("training run (active experts, threshold, loss) every 10 steps:", curve[::10])
    print("mean active experts per 25 steps:", [round(sum(a for a, _, _ in curve[i:i + 25]) / 25, 3)
                                               for i in range(0, len(curve), 25)])
    assert curve[0][0] < 1.5
    tail = sum(a for a, _, _ in curve[-100:]) / 100
    assert abs(tail - 2) <= 0.02 * 2, tail
    assert curve[-1][2] < curve[0][2]


def test_arguments_expand_and_apply():
    from megatron_xmod.moe.args import add_moe_arguments, apply_moe_arguments, expand_moe_arguments
    from megatron_xmod.training.flags import scan_argv

    parser = add_moe_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--moe-preset", "moe-8x64", "--moe-router-type", "dtopp", "--dtopp-kp", "0.2",
                              "--dtopp-layerwise", "--lm-z-loss-coeff", "1e-4"])
    kwargs = apply_moe_arguments(args, {"ffn_hidden_size": 3072, "moe_router_topk": 2})
    assert kwargs["num_moe_experts"] == 64 and kwargs["moe_ffn_hidden_size"] == 384
    assert kwargs["moe_router_type"] == "dtopp" and kwargs["dtopp_target_experts"] == 6.0
    assert kwargs["dtopp_kp"] == 0.2 and kwargs["dtopp_layerwise"] is True and "dtopp_ki" not in kwargs
    assert kwargs["moe_router_score_function"] == "softmax" and kwargs["moe_token_dispatcher_type"] == "allgather"
    baseline = apply_moe_arguments(parser.parse_args(["--moe-preset", "moe-8x128"]), {"ffn_hidden_size": 6144})
    assert baseline["moe_router_enable_expert_bias"] and baseline["moe_router_topk"] == 6
    argv = ["--ffn-hidden-size", "3840", "--moe-preset", "moe-8x64", "--moe-router-topk", "4"]
    argv = expand_moe_arguments(argv, scan_argv(argv))
    assert argv[argv.index("--num-experts") + 1] == "64" and argv[argv.index("--moe-ffn-hidden-size") + 1] == "480"
    assert "--moe-router-enable-expert-bias" in argv and argv[-2:] == ["--moe-router-topk", "4"]  # explicit wins
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        expand_moe_arguments(["--moe-preset", "moe-8x64"], scan_argv(["--moe-preset", "moe-8x64"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-router-type", "topp"])


def test_arguments_map_onto_the_config_by_name(seeded):
    from megatron_xmod.moe.args import MOE_ARG_FIELDS
    from megatron_xmod.moe.config import MoEConfig

    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    assert set(MOE_ARG_FIELDS) <= fields


def test_lm_z_loss_matches_plain_torch(seeded):
    from megatron_xmod.moe.losses import lm_cross_entropy_and_z_loss

    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    ce, z = lm_cross_entropy_and_z_loss(logits, labels)
    torch.testing.assert_close(z, torch.logsumexp(logits.float(), -1) ** 2)
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits.float().reshape(-1, 11), labels.reshape(-1),
                                                                     reduction="none").reshape(2, 5))
    z.sum().backward()
    assert logits.grad is not None


def test_megatron_schedule_updates_the_controller_once_per_global_batch(seeded):
    """Through megatron's own DDP and forward-backward schedule (4 micro-batches), the installed
    finalize function advances the controller exactly once per global batch, from the activation
    of all its micro-batches."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import dtopp_routers
    from megatron_xmod.xmod.routing_state import report

    config = moe_config_from_backbone(TINY, "dtopp-t2-e8", use_cpu_initialization=True)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                    build_moe_gpt_model(config, TINY.vocab_size, 16, rotary_base=TINY.rotary_base))
    routers = dtopp_routers(model)

    def forward_step(data, model):
        tokens = next(data)
        output = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
        return output, lambda out: (out.mean(), {"lm loss": out.mean().detach()})

    integral = 0.0
    for _step in range(2):
        model.zero_grad_buffer()
        get_forward_backward_func()(forward_step_func=forward_step, model=[model], num_microbatches=4,
                                    data_iterator=iter([torch.randint(0, TINY.vocab_size, (2, 16)) for _ in range(4)]),
                                    seq_length=16, micro_batch_size=2, forward_only=False)
        active = report(model)["dtopp_active_experts"]  # equal-sized micro-batches: the batch mean
        integral += (2 - active) / 8
        assert routers[0].dtopp_integral.item() == pytest.approx(integral, abs=1e-6)
        expected = min(max(0.25 + 0.1 * (2 - active) / 8 + 0.1 * integral, 0), 1)
        assert [r.dtopp_threshold.item() for r in routers] == pytest.approx([expected] * len(routers), abs=1e-6)
        assert all(r.dtopp_token_count.item() == 0 for r in routers)


def test_controller_state_survives_megatron_dist_checkpoint(seeded, tmp_path):
    """Save and load through megatron's distributed checkpointing (torch_dist): every layer's
    threshold and integral come back bit for bit."""
    from megatron.core import dist_checkpointing

    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import dtopp_routers

    config = moe_config_from_backbone(TINY, "dtopp-t2-e8", use_cpu_initialization=True, dtopp_layerwise=True)
    saved = build_moe_gpt_model(config, TINY.vocab_size, 16, rotary_base=TINY.rotary_base)
    for i, router in enumerate(dtopp_routers(saved)):
        router.dtopp_threshold.fill_(0.1 + 0.123456789 * i)
        router.dtopp_integral.fill_(-0.5 + i / 7)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    loaded = build_moe_gpt_model(config, TINY.vocab_size, 16, rotary_base=TINY.rotary_base)
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path)))
    for a, b in zip(dtopp_routers(saved), dtopp_routers(loaded)):
        assert torch.equal(a.dtopp_threshold, b.dtopp_threshold) and torch.equal(a.dtopp_integral, b.dtopp_integral)
        assert torch.equal(a.drn_scale, b.drn_scale)
    assert dtopp_routers(loaded)[3].dtopp_threshold.item() == pytest.approx(0.1 + 3 * 0.123456789)


# --- the DTop-p paper's own presets ------------------------------------------------------------

# The DTop-p paper's Table 1 models, as Table 4 style backbones: MoE-1.3B-6.9B-64E8A (its main
# model) and MoE-2.4B-13.6B-64E8A; Table 5: vocabulary 50,432, QK-norm, SwiGLU.
DTOPP_PAPER_MODELS = [
    (Backbone("dtopp-1.3b", 2048, 128, 16, 16, 8192, num_layers=16, vocab_size=50432), "6.9B", "1.3B"),
    (Backbone("dtopp-2.4b", 2048, 64, 32, 32, 8192, num_layers=32, vocab_size=50432), "13.6B", "2.4B"),
]


@pytest.mark.parametrize("backbone, total, active", DTOPP_PAPER_MODELS)
def test_dtopp_paper_presets_count_the_papers_models(backbone, total, active):
    """64 experts of d_e = FFN/8, 8 active, no shared expert: the parameter counts of the DTop-p
    paper's Table 1 (2 shared experts would add 0.2B / 0.4B to both)."""
    for name in ("dtopp-paper-topk8", "dtopp-paper-t8"):
        count = count_model(backbone, name, 2048)
        assert f"{count.total_params / 1e9:.1f}B" == total and f"{count.active_params / 1e9:.1f}B" == active
        assert round(count.flops_ratio_vs_dense, 2) == 1.00  # 8 experts of FFN/8 cost the dense FFN
    theta = backbone.num_layers  # DTop-p's theta_l, one per layer; "Global 1.0" of Top-k is no parameter
    assert (count_model(backbone, "dtopp-paper-t8", 2048).total_params
            == count_model(backbone, "dtopp-paper-topk8", 2048).total_params + theta)


def test_dtopp_paper_presets_follow_the_papers_table6(seeded):
    from megatron_xmod.moe.model import moe_config_from_backbone

    topk = moe_config_from_backbone(TINY, "dtopp-paper-topk8", use_cpu_initialization=True)
    dtopp = moe_config_from_backbone(TINY, "dtopp-paper-t8", use_cpu_initialization=True)
    for config in (topk, dtopp):
        assert config.num_moe_experts == 64 and config.moe_ffn_hidden_size == TINY.ffn_hidden_size // 8
        assert config.moe_shared_expert_intermediate_size is None  # no shared experts
        assert config.lm_z_loss_coeff == 1e-4 and config.moe_z_loss_coeff is None  # LM z-loss on, router z-loss off
        assert config.moe_aux_loss_coeff == 1e-4 and config.moe_router_load_balancing_type == "aux_loss"
        assert config.moe_router_score_function == "softmax" and not config.moe_router_enable_expert_bias
    assert topk.moe_router_type == "topk" and topk.moe_router_topk == 8 and not topk.moe_router_pre_softmax
    assert topk.dtopp_routing_norm == "fixed" and topk.dtopp_routing_norm_init == 1.0  # "Global 1.0"
    assert dtopp.moe_router_type == "dtopp" and dtopp.dtopp_target_experts == 8
    assert dtopp.dtopp_routing_norm == "learnable" and dtopp.dtopp_dynamic_loss_coeff == 1e-3
    assert (dtopp.dtopp_kp, dtopp.dtopp_ki, dtopp.dtopp_p0) == (0.1, 0.1, 0.25)
    # The X-MoD recipe keeps its 2 shared experts and has the LM z-loss on DTop-p only.
    xmod_topk = moe_config_from_backbone(TINY, "moe-8x64", use_cpu_initialization=True)
    xmod_dtopp = moe_config_from_backbone(TINY, "dtopp-t6", use_cpu_initialization=True)
    assert xmod_topk.lm_z_loss_coeff == 0 and xmod_dtopp.lm_z_loss_coeff == 1e-4
    assert xmod_dtopp.moe_shared_expert_intermediate_size == 2 * xmod_dtopp.moe_ffn_hidden_size


@pytest.mark.parametrize("name", ["dtopp-paper-topk8", "dtopp-paper-t8"])
def test_dtopp_paper_model_builds_and_trains(seeded, name):
    from megatron_xmod.moe.losses import lm_cross_entropy_and_z_loss
    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import BaselineTopKRouter, DTopPRouter

    config = moe_config_from_backbone(TINY, name, use_cpu_initialization=True)
    model = build_moe_gpt_model(config, TINY.vocab_size, 32, rotary_base=TINY.rotary_base)
    mlp = model.decoder.layers[0].mlp
    assert mlp.shared_experts is None
    assert type(mlp.router) is (BaselineTopKRouter if name.endswith("topk8") else DTopPRouter)
    assert sum(p.numel() for p in model.parameters()) == count_model(TINY, name, 32).total_params
    tokens = torch.randint(0, TINY.vocab_size, (2, 33))
    logits = model(tokens[:, :-1], torch.arange(32).expand(2, 32), None)  # logits: the loss adds the LM z-loss
    ce, z = lm_cross_entropy_and_z_loss(logits, tokens[:, 1:])  # logits [b, s, V]
    loss = (ce + config.lm_z_loss_coeff * z).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert mlp.router.weight.grad.abs().sum() > 0


def _entry_point_config(flags, monkeypatch):
    """The MoEConfig the entry point builds from ``flags``: expand, megatron's own parser, megatron's
    config from args, then the MoE fields (as megatron_xmod.training.providers.config_from_args)."""
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    from megatron_xmod.moe.args import add_moe_arguments, apply_moe_arguments, expand_moe_arguments
    from megatron_xmod.moe.config import MoEConfig
    from megatron_xmod.training.flags import scan_argv
    from megatron_xmod.xmod.config import XModConfig

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1"]
    argv = expand_moe_arguments(base + flags, scan_argv(base + flags))
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    args = parse_args(extra_args_provider=add_moe_arguments)
    args.rank, args.world_size = 0, 1
    validate_args(args)
    config = core_transformer_config_from_args(args, XModConfig)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(XModConfig) if f.init}
    return argv, MoEConfig(**apply_moe_arguments(args, fields))


def test_dtopp_paper_presets_expand_into_entry_point_flags(monkeypatch):
    """``--moe-preset dtopp-paper-*`` through megatron's own argument parser, as the entry point runs it."""
    argv, topk = _entry_point_config(["--moe-preset", "dtopp-paper-topk8"], monkeypatch)
    assert "--moe-shared-expert-intermediate-size" not in argv and "--moe-router-enable-expert-bias" not in argv
    assert argv[argv.index("--lm-z-loss-coeff") + 1] == "0.0001"
    assert (topk.moe_router_type, topk.moe_router_topk, topk.num_moe_experts, topk.moe_ffn_hidden_size) == ("topk", 8, 64, 16)
    assert topk.lm_z_loss_coeff == 1e-4 and topk.moe_aux_loss_coeff == 1e-4 and topk.moe_router_score_function == "softmax"
    assert topk.dtopp_routing_norm == "fixed" and topk.moe_shared_expert_intermediate_size is None
    _, dtopp = _entry_point_config(["--moe-preset", "dtopp-paper-t8"], monkeypatch)
    assert (dtopp.moe_router_type, dtopp.dtopp_target_experts, dtopp.dtopp_routing_norm) == ("dtopp", 8.0, "learnable")
    assert dtopp.lm_z_loss_coeff == 1e-4 and dtopp.moe_shared_expert_intermediate_size is None
    # Same experts and recipe, DTop-p router: the paper's DTop-p model.
    _, switched = _entry_point_config(["--moe-preset", "dtopp-paper-topk8", "--moe-router-type", "dtopp"], monkeypatch)
    assert (switched.dtopp_target_experts, switched.dtopp_routing_norm, switched.moe_token_dispatcher_type) == (
        8.0, "learnable", "allgather")


def test_explicit_flags_win_over_the_preset_at_the_entry_point(monkeypatch):
    """megatron's MoE flags as well as ours: the config from args must not re-apply the preset over them."""
    _, config = _entry_point_config(["--moe-preset", "dtopp-paper-topk8", "--moe-aux-loss-coeff", "0.001",
                                     "--moe-router-topk", "4", "--lm-z-loss-coeff", "0"], monkeypatch)
    assert (config.moe_aux_loss_coeff, config.moe_router_topk, config.lm_z_loss_coeff) == (1e-3, 4, 0.0)
    assert config.num_moe_experts == 64 and config.dtopp_routing_norm == "fixed"  # the rest of the preset
    # Without the expansion (a plain parser), apply_moe_arguments applies the preset itself.
    from megatron_xmod.moe.args import add_moe_arguments, apply_moe_arguments

    args = add_moe_arguments(argparse.ArgumentParser()).parse_args(["--moe-preset", "dtopp-paper-topk8"])
    assert apply_moe_arguments(args, {"ffn_hidden_size": 128, "moe_aux_loss_coeff": 0.0})["moe_aux_loss_coeff"] == 1e-4


def test_moe_preset_takes_every_moe_model_name():
    """slurm/xmod_train.sh passes its moe-* and dtopp-* models as --moe-preset."""
    from megatron_xmod.moe.args import add_moe_arguments, apply_moe_arguments

    parser = add_moe_arguments(argparse.ArgumentParser())
    kwargs = apply_moe_arguments(parser.parse_args(["--moe-preset", "dtopp-t6"]), {"ffn_hidden_size": 128})
    assert kwargs["moe_router_type"] == "dtopp" and kwargs["dtopp_target_experts"] == 6.0
    assert kwargs["moe_shared_expert_intermediate_size"] == 2 * 16  # the X-MoD recipe's 2 shared experts
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-preset", "dtopp-paper-t6"])


@pytest.mark.parametrize("name", ["dtopp-paper-t6", "dtopp-paper-topk4", "dtopp-paper"])
def test_bad_dtopp_paper_names(name):
    with pytest.raises(ValueError, match="model:"):
        parse_moe_model(name)


def test_topk_learnable_routing_norm_is_rejected():
    from megatron_xmod.moe.config import MoEConfig

    with pytest.raises(ValueError, match="dtopp_routing_norm"):
        MoEConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                  dtopp_routing_norm="learnable")


# --- the Top-k baseline router ------------------------------------------------------------------

def _topk_routers(name, **overrides):
    """BaselineTopKRouter and megatron's TopKRouter with the same weights."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_xmod.moe.model import moe_config_from_backbone
    from megatron_xmod.moe.router import BaselineTopKRouter

    config = moe_config_from_backbone(TINY, name, use_cpu_initialization=True, **overrides)
    ours = BaselineTopKRouter(config, pg_collection=get_default_pg_collection())
    megatrons = TopKRouter(config, pg_collection=get_default_pg_collection())
    megatrons.load_state_dict(ours.state_dict())
    for router in (ours, megatrons):
        router.set_layer_number(1)
    return ours, megatrons


@pytest.mark.parametrize("name, overrides, loss_name", [
    ("moe-8x64", {}, "load_balancing_loss"),
    ("moe-8x64", dict(calculate_per_token_loss=True), "load_balancing_loss"),
    ("dtopp-paper-topk8", {}, "load_balancing_loss"),
    ("dtopp-paper-topk8", dict(calculate_per_token_loss=True), "load_balancing_loss"),
    ("dtopp-paper-topk8", dict(moe_router_load_balancing_type="seq_aux_loss"), "seq_load_balancing_loss"),
    ("dtopp-paper-topk8", dict(moe_router_load_balancing_type="global_aux_loss"), "global_load_balancing_loss"),
])
def test_topk_router_all_padding_gives_zero_loss_and_finite_gradients(seeded, name, overrides, loss_name):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    router, _ = _topk_routers(name, **overrides)
    get_moe_metrics_tracker().clear()
    probs, _ = router(torch.randn(8, 2, TINY.hidden_size), padding_mask=torch.ones(8, 2, dtype=torch.bool))
    probs.sum().backward()
    assert torch.isfinite(router.weight.grad).all()
    assert get_moe_metrics_tracker().metrics[loss_name].values.sum() == 0
    if router.expert_bias is not None:
        assert router.local_tokens_per_expert.sum() == 0  # padding does not move the expert bias


@pytest.mark.parametrize("name", ["moe-8x64", "dtopp-paper-topk8", "dtopp-t2-e8"])
def test_all_padding_micro_batch_through_the_model_keeps_gradients_finite(seeded, name):
    """GPTModel's padding_mask (True = padding) reaches every router; a micro-batch of padding
    only (its loss mask all 0) must leave every gradient finite, for Top-k and DTop-p alike."""
    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone

    config = moe_config_from_backbone(TINY, name, use_cpu_initialization=True)
    model = build_moe_gpt_model(config, TINY.vocab_size, 16, rotary_base=TINY.rotary_base)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens,
                 padding_mask=torch.ones(2, 16, dtype=torch.bool))
    (loss * torch.zeros_like(loss)).sum().backward()  # the loss mask of a padding-only micro-batch
    for param_name, param in model.named_parameters():
        assert param.grad is None or torch.isfinite(param.grad).all(), param_name


def test_megatron_topk_router_still_gives_nan_on_all_padding(seeded):
    """Why BaselineTopKRouter exists: megatron 0.19's own router, same config and input."""
    _, megatrons = _topk_routers("dtopp-paper-topk8", dtopp_routing_norm="none")
    probs, _ = megatrons(torch.randn(8, 2, TINY.hidden_size), padding_mask=torch.ones(8, 2, dtype=torch.bool))
    probs.sum().backward()
    assert not torch.isfinite(megatrons.weight.grad).all(), "megatron fixed it? BaselineTopKRouter's guard can go"


@pytest.mark.parametrize("name, overrides, padded", [
    ("moe-8x64", {}, False),  # sigmoid scores, expert bias
    ("dtopp-paper-topk8", dict(dtopp_routing_norm="none"), False),
    ("dtopp-paper-topk8", dict(dtopp_routing_norm="none"), True),  # megatron crashes on padding with the expert bias
    ("dtopp-paper-topk8", dict(dtopp_routing_norm="none", moe_router_load_balancing_type="seq_aux_loss"), True),
])
def test_topk_router_is_megatrons_on_batches_with_tokens(seeded, name, overrides, padded):
    """Bit for bit: routing weights, routing map, gate gradient and expert-bias counts."""
    ours, megatrons = _topk_routers(name, **overrides)
    x = torch.randn(8, 2, TINY.hidden_size)
    padding = torch.zeros(8, 2, dtype=torch.bool)
    padding[5:, 1] = True
    results = []
    for router in (ours, megatrons):
        probs, routing_map = router(x, padding_mask=padding if padded else None)
        (probs * torch.linspace(-1, 1, probs.numel()).view_as(probs)).sum().backward()
        results.append((probs, routing_map, router.weight.grad, router.local_tokens_per_expert))
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)


def test_topk_router_expert_bias_counts_exclude_padding(seeded):
    router, _ = _topk_routers("moe-8x64")
    padding = torch.zeros(8, 2, dtype=torch.bool)
    padding[3:, 0] = True  # 5 of the 16 tokens
    router(torch.randn(8, 2, TINY.hidden_size), padding_mask=padding)
    assert router.local_tokens_per_expert.sum().item() == 6 * 11  # top-6 of the 11 valid tokens


def test_topk_router_fixed_normalisation_ignores_the_logit_scale(seeded):
    """"Global 1.0": theta * (z - mu) / sigma, so scaling the gate (hence the logits) by 3 routes
    every token the same way; megatron's plain softmax sharpens instead."""
    x = torch.randn(16, 2, TINY.hidden_size)
    for norm in ("fixed", "none"):
        router, _ = _topk_routers("dtopp-paper-topk8", dtopp_routing_norm=norm)
        router.eval()
        probs, routing_map = router(x)
        with torch.no_grad():
            router.weight.mul_(3)
        scaled_probs, scaled_map = router(x)
        assert torch.equal(routing_map, scaled_map)
        if norm == "fixed":
            torch.testing.assert_close(scaled_probs, probs, rtol=1e-4, atol=1e-5)
        else:
            assert not torch.allclose(scaled_probs, probs, rtol=1e-2, atol=1e-3)
