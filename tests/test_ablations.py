"""The X-MoD paper's stabiliser ablations (its Table 3, on the A1K16 reference) as model names, the
fixed gate scale, the token-choice bias warm-up, and the entry-point patches that serve them."""
import json

import pytest
import torch
from helpers import TINY, tiny_model

from megatron_xmod.xmod.layout import (
    ABLATIONS,
    LayoutError,
    ablation_settings,
    layout_from_model_name,
    split_ablations,
    without_anchors,
)
from megatron_xmod.xmod.routing import SparseLayerRouting, tau_at


def test_ablation_names_give_the_ablated_layouts():
    full = layout_from_model_name("xmod-a1k16")
    assert full.notation == "D*4 + (S16*16 + D)*12"  # N1 = (28 - 4) / (1 + 1)
    no_anchors = layout_from_model_name("xmod-a1k16-no-anchors")
    # 12 anchors become 12 x 16 sparse layers: 4 dense + 12 * (16 + 16) sparse, one block
    assert no_anchors.notation == "D*4 + S16*384" and no_anchors.activated_depth == 28
    assert {layer.block for layer in no_anchors.layers if layer.is_sparse} == {0}
    no_prefix = layout_from_model_name("xmod-a1k16-no-prefix")
    assert no_prefix.notation == "(S16*16 + D)*14" and no_prefix.activated_depth == 28  # N1 = 28 / 2
    for name in ("xmod-a1k16-no-bias", "xmod-a1k16-no-gate-scale"):
        assert layout_from_model_name(name) == full
    both = layout_from_model_name("xmod-a1k16-no-prefix-no-anchors")
    assert both.notation == "S16*448" and both.activated_depth == 28


def test_ablation_suffixes_parse_and_fail_clearly():
    assert split_ablations("xmod-a1k16-no-bias-no-gate-scale") == ("xmod-a1k16", ("no-bias", "no-gate-scale"))
    assert split_ablations("mod") == ("mod", ())
    assert ablation_settings("xmod-a1k16-no-bias") == {"xmod_token_choice_bias_tau": 0.0}
    assert ablation_settings("xmod-a1k16-no-gate-scale")["xmod_gate_scale_learnable"] is False
    assert set(ABLATIONS) == {"no-anchors", "no-bias", "no-gate-scale", "no-prefix"}
    with pytest.raises(LayoutError, match="model: the ablations"):
        layout_from_model_name("mod-no-bias")
    with pytest.raises(LayoutError, match="repeats"):
        split_ablations("xmod-a1k16-no-bias-no-bias")


def test_without_anchors_keeps_k_per_block():
    layout = without_anchors(layout_from_model_name("D + (S4*2 + D) + (S8*8 + D)"))
    assert layout.notation == "D + S4*6 + S8*16"
    assert layout.activated_depth == 1 + 6 / 4 + 16 / 8


def test_entry_point_flags_and_count_accept_the_ablations(capsys):
    from megatron_xmod.cli import main
    from megatron_xmod.training.flags import expand_arguments

    argv = expand_arguments(["--xmod-backbone", "936m", "--xmod-model", "xmod-a1k16-no-bias"])
    assert argv[argv.index("--xmod-token-choice-bias-tau") + 1] == "0"
    assert argv[argv.index("--xmod-layout") + 1] == "D*4 + (S16*16 + D)*12"
    argv = expand_arguments(["--xmod-backbone", "936m", "--xmod-model", "xmod-a1k16-no-gate-scale"])
    assert "--xmod-fixed-gate-scale" in argv
    argv = expand_arguments(["--xmod-backbone", "936m", "--xmod-model", "xmod-a1k16-no-anchors"])
    assert argv[argv.index("--num-layers") + 1] == "388"
    with pytest.raises(LayoutError, match="xmod_token_choice_bias_tau"):
        expand_arguments(["--xmod-model", "xmod-a1k16-no-bias", "--xmod-token-choice-bias-tau", "0.5"])

    assert main(["count", "--backbone", "936m", "--json", "--model", "xmod-a1k16", "--model", "xmod-a1k16-no-bias",
                 "--model", "xmod-a1k16-no-anchors"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    full, no_bias, no_anchors = rows
    assert no_bias["total_params"] == full["total_params"] and no_bias["layout"] == full["layout"]
    assert no_anchors["num_layers"] == 388 and no_anchors["total_params"] > full["total_params"]


def test_fixed_gate_scale_flag_reaches_the_config():
    import argparse

    from megatron_xmod.training.flags import add_xmod_arguments

    parser = add_xmod_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).xmod_gate_scale_learnable is True
    assert parser.parse_args(["--xmod-fixed-gate-scale"]).xmod_gate_scale_learnable is False
    assert parser.parse_args(["--xmod-token-choice-bias-tau-warmup", "30"]).xmod_token_choice_bias_tau_warmup == 30


def test_fixed_gate_scale_stays_one_while_the_learnable_one_moves(seeded):
    """w/o gated residual scaling: varsigma = 1 is not trained (same checkpoint keys)."""
    moved = {}
    for learnable in (True, False):
        torch.manual_seed(0)
        model, _ = tiny_model("D + (S4*2 + D)", seq_len=16, xmod_gate_scale_learnable=learnable)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.5)
        tokens = torch.randint(0, TINY.vocab_size, (2, 17))
        loss = model(tokens[:, :-1], torch.arange(16).expand(2, 16), None, labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        scales = [m.gate_scale for m in model.modules() if hasattr(m, "gate_scale")]
        assert len(scales) == 2 and all(s.requires_grad is learnable for s in scales)
        assert "decoder.layers.1.gate_scale" in model.state_dict()
        moved[learnable] = max(abs(s.item() - 1.0) for s in scales)
    assert moved[False] == 0.0 and moved[True] > 1e-4


def test_tau_warmup_is_linear_from_zero_and_full_outside_training():
    assert [tau_at(0.5, 10, i) for i in (0, 5, 10, 20)] == [0.0, 0.25, 0.5, 0.5]
    assert tau_at(0.5, 10, None) == 0.5 and tau_at(0.5, 0, 0) == 0.5
    routing = SparseLayerRouting("xmod", 4, token_choice_bias_tau=1.0, token_choice_bias_tau_warmup=4)
    assert routing.effective_tau(1) == 0.25
    with pytest.raises(ValueError, match="xmod_token_choice_bias_tau_warmup"):
        SparseLayerRouting("xmod", 4, token_choice_bias_tau_warmup=-1)


def test_layer_routes_with_the_warmed_up_tau(seeded):
    """With the routing state at iteration 0 of a warm-up the second layer routes as with tau = 0;
    outside training (iteration None) as with the full tau."""
    from megatron_xmod.diagnostics.routing_report import record_routing
    from megatron_xmod.xmod.routing_state import eval_routing

    def selections(model, iteration):
        model.routing_state.iteration = iteration
        with torch.no_grad(), eval_routing(model, "topk"), record_routing(model) as recorder:
            model(tokens[:, :-1], torch.arange(32).expand(2, 32), None)
        return [recorder.layer(n) for n in sorted(recorder.selected)]

    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(3))
    built = {}
    for name, overrides in {"warm": dict(xmod_token_choice_bias_tau=2.0, xmod_token_choice_bias_tau_warmup=10),
                            "tau0": dict(xmod_token_choice_bias_tau=0.0),
                            "full": dict(xmod_token_choice_bias_tau=2.0)}.items():
        torch.manual_seed(0)
        model, _ = tiny_model("D + (S4*3 + D)", seq_len=32, **overrides)
        for m in model.modules():
            if hasattr(m, "router"):
                torch.nn.init.normal_(m.router.weight, std=0.3)
        built[name] = model.eval()
    at_start = selections(built["warm"], 0)
    assert all(torch.equal(a, b) for a, b in zip(at_start, selections(built["tau0"], None)))
    trained = selections(built["warm"], None)
    assert all(torch.equal(a, b) for a, b in zip(trained, selections(built["full"], None)))
    assert not all(torch.equal(a, b) for a, b in zip(at_start, trained))  # the bias changes the routing


def test_forward_step_hands_megatrons_iteration_to_the_routing_states(seeded, monkeypatch):
    """The tau warm-up's clock is megatron's ``args.curr_iteration`` (set before each train step, restored
    on resume), read by our forward step in training mode only."""
    import argparse

    import megatron.training

    from megatron_xmod.training.step import forward_step

    model, _ = tiny_model("D + (S4*2 + D)", seq_len=16)
    tokens = torch.randint(0, 256, (1, 16))
    batch = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(1, 16), position_ids=torch.arange(16)[None])
    seen = []
    for iteration, training in ((7, True), (8, True), (9, False)):
        monkeypatch.setattr(megatron.training, "get_args",
                            lambda i=iteration: argparse.Namespace(curr_iteration=i, xmod_no_topk_validation=True))
        model.train(training)
        forward_step(iter([batch]), model)
        seen.append(model.routing_state.iteration)
    assert seen == [7, 8, 8]  # validation keeps the clock of the training step it follows
