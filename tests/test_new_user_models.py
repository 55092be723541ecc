"""A new user's own models (issue 26): the per-GPU memory estimate of MoE models (parameters against a
built model, activations against the bytes autograd saves), small backbones in ``xmod count`` /
``partition`` / ``plan``, and the dense-prefix error naming the flags that set it."""
import argparse
import json

import pytest
import torch
from helpers import TINY

from megatron_xmod.cli import main as xmod
from megatron_xmod.presets import BACKBONES, backbone_to_dict, get_backbone, parse_model
from megatron_xmod.training.memory_estimate import (
    MoELayerShape,
    Parallel,
    add_memory_arguments,
    check_launch_memory,
    estimate,
    moe_layer_bytes,
    print_memory,
)

MOE_MODELS = ["moe-8x64", "dtopp-t2-e8", "dtopp-paper-topk8", "dtopp-paper-t8"]


def _tiny_moe(name, seq_len=64, **overrides):
    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone

    config = moe_config_from_backbone(TINY, name, use_cpu_initialization=True, **overrides)
    return build_moe_gpt_model(config, TINY.vocab_size, seq_len, rotary_base=TINY.rotary_base), config


# --- item 5: MoE memory -----------------------------------------------------------------------------

@pytest.mark.usefixtures("fresh_moe_tracker")
@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_estimate_counts_the_built_models_parameters(seeded, name):
    """Every parameter of megatron's MoE layer (attention, norms, router, DRN theta, shared and routed
    experts) is in the estimate, and the routed experts are the part EP and ETP split."""
    model, _ = _tiny_moe(name, seq_len=32)
    built = {n: p.numel() for n, p in model.named_parameters()}
    routed = sum(v for n, v in built.items() if ".mlp.experts." in n)
    description = parse_model(name, TINY)
    est = estimate(description, 32, Parallel(bytes_per_activation=4))
    assert est.params_per_gpu == sum(built.values())
    assert est.expert_params_per_gpu == routed
    # EP 4 x ETP 2 (TP 2, DP 4): the routed experts / 8, the rest / TP as for a dense layer
    split = estimate(description, 32, Parallel(tp=2, dp=4, ep=4, etp=2, sequence_parallel=True))
    assert split.expert_params_per_gpu == routed // 8
    # the routed experts' Adam state: split 8-fold by EP 8 or by the distributed optimizer over DP 8, not both
    # (the expert data-parallel size is TP x DP / (EP x ETP) = 1)
    ep8 = estimate(description, 32, Parallel(dp=8, ep=8, distributed_optimizer=True))
    assert ep8.optimizer_state == pytest.approx(estimate(description, 32, Parallel(dp=8, distributed_optimizer=True))
                                                .optimizer_state)
    assert estimate(description, 32, Parallel(dp=8, ep=8)).optimizer_state == pytest.approx(
        (est.params_per_gpu - routed) * 12 + routed / 8 * 12)


def _measured_moe_layers(name, seq_len=64):
    """Bytes each MoE layer saves for backward (bench/memory.py's counter, fp32) and, for Top-p
    routers, the copies each layer dispatched per token."""
    from bench.memory import saved_bytes_per_layer
    from megatron_xmod.moe.router import dtopp_routers

    model, config = _tiny_moe(name, seq_len)
    model.train()
    x = torch.randn(seq_len, 1, TINY.hidden_size, requires_grad=True)
    per_layer = saved_bytes_per_layer(model, x, model.rotary_pos_emb(seq_len))
    active = [(r.dtopp_active_sum / r.dtopp_token_count).item() for r in dtopp_routers(model)]
    return per_layer, active or [config.moe_router_topk] * len(per_layer)


@pytest.mark.usefixtures("fresh_moe_tracker")
@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_activation_formula_matches_saved_bytes(seeded, name):
    """What the estimate assumes an MoE layer saves, against what autograd saves (within 1%), for
    megatron's TopKRouter + alltoall (moe-8x64), the DTop-p router + allgather and the DTop-p paper's
    Top-k with the fixed routing normalisation; the dispatched copies are the ones each layer made."""
    from megatron_xmod.moe.presets import parse_moe_model

    per_layer, active = _measured_moe_layers(name)
    shape = MoELayerShape.from_model(parse_moe_model(name), TINY.ffn_hidden_size)
    for measured, k in zip(per_layer, active):
        expected = moe_layer_bytes(TINY, MoELayerShape(**{**shape.__dict__, "active_experts": k}), 64)
        assert measured == pytest.approx(expected, rel=0.01), (measured, expected, k)
    # the copies dominate: a layer with twice the dispatched copies saves clearly more
    assert moe_layer_bytes(TINY, shape, 64) < moe_layer_bytes(
        TINY, MoELayerShape(**{**shape.__dict__, "active_experts": 2 * shape.active_experts}), 64)


def _memory_args(*argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dense-prefix", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seq-len", type=int, default=32768)
    add_memory_arguments(parser)
    return parser.parse_args(["--memory", *argv])


def test_count_memory_estimates_moe_models_and_refuses_above_the_gpu_memory(capsys):
    b = get_backbone("1.65b")
    args = _memory_args("--tp", "8", "--dp", "8", "--sequence-parallel", "--recompute", "selective",
                        "--optimizer", "muon", "--distributed-optimizer")
    assert print_memory(args, b, ["moe-8x64", "dtopp-t6"]) == 0
    out = capsys.readouterr().out
    assert "activations: MoE layers" in out and "EP 1 x ETP 8" in out and "routed experts" in out
    args.gpu_mem_gb = 20.0
    assert print_memory(args, b, ["moe-8x128"]) == 1
    assert "expert parallelism (--ep)" in capsys.readouterr().out
    # expert parallelism divides the routed experts' weights, gradients and state, not their activations
    model = parse_model("moe-8x128", b)
    base = dict(tp=8, dp=8, sequence_parallel=True, etp=1)
    plain, ep8 = estimate(model, 32768, Parallel(**base)), estimate(model, 32768, Parallel(**base, ep=8))
    assert ep8.expert_params_per_gpu * 8 == pytest.approx(plain.expert_params_per_gpu, rel=1e-6)
    assert ep8.weights < 0.3 * plain.weights
    assert ep8.activations_moe_layers == pytest.approx(plain.activations_moe_layers)


@pytest.mark.parametrize("argv, message", [
    (["--tp", "8"], "sequence_parallel: megatron's MoE layer refuses to train at TP 8 without sequence parallelism"),
    (["--ep", "3"], "expert_model_parallel_size: 64 experts do not split over EP 3"),
    (["--ep", "4", "--dp", "2"], "expert_model_parallel_size: EP 4 x expert TP 1 must divide"),
])
def test_moe_estimate_refuses_what_megatron_refuses(argv, message):
    with pytest.raises(ValueError, match=message):
        print_memory(_memory_args(*argv), get_backbone("556m"), ["moe-8x64"])


def test_fixed_threshold_top_p_is_refused_by_name():
    with pytest.raises(ValueError, match="model: topp-p0.5 routes a token to a variable number of experts"):
        print_memory(_memory_args(), get_backbone("556m"), ["topp-p0.5"])


def _launch_args(**changes):
    """megatron's parsed arguments of an MoE launch, as the dry run hands them to the estimate."""
    b = BACKBONES["1.65b"]
    args = dict(
        num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=768, moe_shared_expert_intermediate_size=1536,
        moe_token_dispatcher_type="alltoall", moe_router_type=None, dtopp_routing_norm=None,
        expert_model_parallel_size=1, expert_tensor_parallel_size=8,
        num_attention_heads=b.num_attention_heads, hidden_size=b.hidden_size, kv_channels=b.head_dim,
        num_query_groups=b.num_query_groups, ffn_hidden_size=b.ffn_hidden_size, padded_vocab_size=50304,
        qk_layernorm=True, num_layers=28, tensor_model_parallel_size=8, pipeline_model_parallel_size=1,
        data_parallel_size=8, micro_batch_size=1, sequence_parallel=True, recompute_granularity="selective",
        optimizer="muon", use_distributed_optimizer=True, bf16=True, fp16=False, global_batch_size=80,
        seq_length=32768, spec=None, xmod_routing_family="dense", xmod_layout="D*28")
    args.update(changes)
    return argparse.Namespace(**args)


def test_dry_run_estimates_moe_launches(capsys, monkeypatch):
    """The launchers' DRY_RUN (check_launch_memory): MoE launches get the estimate and the GPU_MEM_GB
    refusal like every other model; a launch megatron would crash on stops with the flag to add."""
    import megatron_xmod.training.memory_estimate as memory
    from megatron_xmod.xmod.layout import parse_layout

    monkeypatch.setattr(memory, "_spec_layout", lambda args: parse_layout(args.xmod_layout))
    assert check_launch_memory(_launch_args(), limit_gb=80) == 0
    out = capsys.readouterr().out
    assert "activations: MoE layers" in out and "not estimated" not in out
    assert check_launch_memory(_launch_args(), limit_gb=20) == 1
    assert "FAILED (memory)" in capsys.readouterr().out
    assert check_launch_memory(_launch_args(sequence_parallel=False), limit_gb=80) == 1
    assert "add --sequence-parallel" in capsys.readouterr().out
    dtopp = _launch_args(moe_router_type="dtopp", dtopp_target_experts=6.0, moe_token_dispatcher_type="allgather")
    assert check_launch_memory(dtopp, limit_gb=80) == 0
    assert check_launch_memory(_launch_args(moe_router_type="topp-fixed"), limit_gb=80) == 0
    assert "memory: not estimated: moe_router_type: topp-fixed" in capsys.readouterr().out


# --- item 7: small or own backbones --------------------------------------------------------------------

@pytest.fixture
def four_layers(tmp_path):
    """The issue's backbone file: TINY, 4 layers (too shallow for K = 8 MoD or an X-MoD block after N0 = 4)."""
    path = tmp_path / "mybb.json"
    path.write_text(json.dumps(backbone_to_dict(TINY)))
    return path


def test_count_skips_default_models_the_backbone_cannot_build(four_layers, capsys):
    assert xmod(["count", "--backbone", str(four_layers), "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("note: skipped")]
    assert [line.split()[2] for line in skipped] == ["mod", "xmod-a4k8", "xmod-a3k16"]
    assert "sparsity_k: MoD with K=8 cannot fill 4 activated layers" in skipped[0] and "mod-k3" in skipped[0]
    assert "dense_prefix: 4 leaves no room" in skipped[2]
    assert "\ndense " in out  # the table still has the dense model
    # --json: the JSON lines stay parseable, the notes go to stderr
    assert xmod(["count", "--backbone", str(four_layers), "--seq-len", "256", "--json"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["model"] for line in captured.out.splitlines()] == ["dense"]
    assert captured.err.count("note: skipped") == 3
    # --memory takes the same default list
    assert xmod(["count", "--backbone", str(four_layers), "--seq-len", "256", "--memory"]) == 0
    assert "note: skipped mod" in capsys.readouterr().out
    # a model asked for by name is still an error
    assert xmod(["count", "--backbone", str(four_layers), "--model", "mod"]) == 2
    assert "sparsity_k: MoD with K=8" in capsys.readouterr().err


def test_dense_prefix_error_names_the_flags_and_a_value_that_fits(four_layers, capsys):
    assert xmod(["count", "--backbone", str(four_layers), "--model", "xmod-a1k4"]) == 2
    err = capsys.readouterr().err
    assert "dense_prefix: 4 leaves no room for a sparse block in 4 activated layers; set N0 = 2" in err
    assert "--dense-prefix 2 for xmod count / partition / plan" in err and "--xmod-dense-prefix 2" in err
    # the value it names fits, in xmod count and at the entry point
    assert xmod(["count", "--backbone", str(four_layers), "--model", "xmod-a1k4", "--dense-prefix", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "D*2 + (S4*4 + D)"
    from megatron_xmod.training.flags import expand_arguments

    argv = expand_arguments(["--xmod-backbone", str(four_layers), "--xmod-model", "xmod-a1k4", "--xmod-dense-prefix", "2"])
    assert argv[argv.index("--xmod-layout") + 1] == "D*2 + (S4*4 + D)"
    with pytest.raises(ValueError, match="--xmod-dense-prefix 2"):
        expand_arguments(["--xmod-backbone", str(four_layers), "--xmod-model", "xmod-a1k4"])
    # N1 not whole on a 28-layer backbone: the nearest N0 that makes it whole
    with pytest.raises(ValueError, match=r"anchor_stride: N1 = .*\(28 - 5\)/\(1 \+ 1\).*set N0 = 4 \(--dense-prefix 4"):
        parse_model("xmod-a1k4", BACKBONES["165m"], dense_prefix=5)


def test_partition_takes_a_backbone_file(four_layers, capsys):
    argv = ["partition", "--backbone", str(four_layers), "--model", "xmod-a1k4", "--dense-prefix", "2", "--pp", "2",
            "--seq-len", "256", "--json"]
    assert xmod(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backbone"] == "mybb" and len(out["stages"]) == 2
    assert sum(stage["layers"] for stage in out["stages"]) == 7  # D*2 + (S4*4 + D)
    # the same backbone as a preset-like object and as the file give one partition
    from megatron_xmod.cli.partition import plan

    assert plan(TINY, "xmod-a1k4", 256, 2, dense_prefix=2)[0].layout == out["layout"]


def test_plan_uses_the_backbones_depth_and_refuses_a_disagreeing_n_act(four_layers, capsys):
    # --backbone alone: planned on it (the default --n-act no longer names 556m against it)
    assert xmod(["plan", "--backbone", str(four_layers), "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "backbone mybb" in out and "(4-N0)/(1+A) with N0 = 4" in out and "(28-N0)" not in out
    assert "no sparse layout fits backbone mybb (4 activated layers)" in out and "--dense-prefix 2" in out
    argv = ["plan", "--backbone", str(four_layers), "--seq-len", "256", "--dense-prefix", "0", "--all", "--json"]
    assert xmod(argv) == 0  # with room for the blocks, sparse layouts are candidates
    assert any(c["K"] > 1 and c["layout"].startswith("(S") for c in json.loads(capsys.readouterr().out)["candidates"])
    # a number of parameters that disagrees with the backbone: refused, naming both sizes
    assert xmod(["plan", "--backbone", str(four_layers), "--n-act", "300M"]) == 2
    err = capsys.readouterr().err
    assert "n_act: 300M disagrees with backbone mybb" in err and "0.181M" in err and "leave --n-act out" in err
    # one that agrees (a nominal size) is used by the law and said so
    assert xmod(["plan", "--backbone", "556m", "--n-act", "5.5e8", "--seq-len", "4096", "--A", "1"]) == 0
    assert "N_act = 550M in the law, layouts counted on backbone 556m (543M)" in capsys.readouterr().out
    assert xmod(["plan", "--backbone", "556m", "--n-act", "165m"]) == 2
    assert "--n-act 165m already names a backbone" in capsys.readouterr().err
