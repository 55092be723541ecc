"""The routing report: its statistics against a hand-computed routing, the recorder against the
layer's own routing rule, and ``xmod routing-report`` on a checkpoint of the entry point."""
import json
import math

import pytest
import torch
from helpers import tiny_model

from megatron_xmod.diagnostics.routing_stats import (
    MaskAgreement,
    adjacent_jaccard,
    binomial_distribution,
    block_stats,
    masks_at_scores,
    random_coverage,
    random_jaccard,
    references,
)


def _mask(rows: list[str]) -> torch.Tensor:
    """'1010...' strings, one per layer, for one sequence: -> [T, s, 1] bool."""
    return torch.tensor([[c == "1" for c in row] for row in rows]).unsqueeze(-1)


def test_block_statistics_match_a_hand_computed_routing():
    # One block of T = 3 layers, K = 4, 8 tokens, two sequences.
    first = _mask(["11000000",   # layer 1: tokens 0, 1
                   "01100000",   # layer 2: tokens 1, 2       J(1,2) = |{1}| / |{0,1,2}| = 1/3
                   "00000011"])  # layer 3: tokens 6, 7       J(2,3) = 0 / 4 = 0
    second = _mask(["00000000",  # layer 1: nothing
                    "00000000",  # layer 2: nothing           J(1,2): empty union, undefined
                    "10000000"])  # layer 3: token 0           J(2,3) = 0 / 1 = 0
    selected = torch.cat([first, second], dim=-1)
    stats = block_stats(selected, sparsity_k=4)
    assert stats.num_layers == 3 and stats.sparsity_k == 4
    assert stats.selected_fraction == pytest.approx([2 / 16, 2 / 16, 3 / 16])
    # covered: sequence 1 tokens {0,1,2,6,7} = 5, sequence 2 token {0} = 1 -> 6 of 16
    assert stats.coverage == pytest.approx(6 / 16)
    # sequence 1: mean(1/3, 0) = 1/6; sequence 2: only the defined pair, 0 -> mean 1/12
    assert stats.adjacent_jaccard == pytest.approx((1 / 6 + 0) / 2)
    # counts: seq 1: token 1 -> 2, tokens 0,2,6,7 -> 1, three tokens 0; seq 2: token 0 -> 1, seven 0
    assert stats.update_count_distribution == pytest.approx([10 / 16, 5 / 16, 1 / 16, 0])
    assert stats.mean_update_count == pytest.approx((5 * 1 + 1 * 2) / 16)


def test_jaccard_is_undefined_without_pairs_and_one_for_a_repeated_subset():
    assert adjacent_jaccard(_mask(["1100"])) is None  # T = 1 (MoD): no adjacent pair
    assert adjacent_jaccard(_mask(["0000", "0000"])) is None  # no pair with a non-empty union
    assert adjacent_jaccard(_mask(["0110", "0110", "0110"])) == 1.0
    same = block_stats(_mask(["0110", "0110", "0110"]), 2)
    assert same.coverage == 0.5 and same.update_count_distribution == [0.5, 0, 0, 0.5]


def test_analytic_references_agree_with_simulated_independent_random_routing():
    """Independent random subsets of rate p = 1/K: coverage 1-(1-p)^T, Jaccard p/(2-p), Binomial(T, p)."""
    k, length, seq, batch = 4, 5, 4096, 8
    generator = torch.Generator().manual_seed(0)
    selected = torch.rand(length, seq, batch, generator=generator) < 1 / k
    stats = block_stats(selected, k)
    assert stats.coverage == pytest.approx(random_coverage(1 / k, length), abs=0.005)
    assert stats.adjacent_jaccard == pytest.approx(random_jaccard(1 / k), abs=0.005)
    assert stats.update_count_distribution == pytest.approx(binomial_distribution(1 / k, length), abs=0.005)
    assert sum(binomial_distribution(0.3, 7)) == pytest.approx(1.0)
    # the paper's Table 10 references (936M, percentages): A4K8 over 32 layers, A1K16 over 16
    assert 100 * random_coverage(1 / 8, 32) == pytest.approx(98.61, abs=0.005)
    assert 100 * random_coverage(1 / 16, 16) == pytest.approx(64.39, abs=0.005)
    assert 100 * random_jaccard(1 / 16) == pytest.approx(3.226, abs=0.0005)
    assert 100 * random_jaccard(1 / 8) == pytest.approx(6.667, abs=0.0005)
    repeated = references(8, 32)["repeated_subset"]
    assert repeated["coverage"] == 1 / 8 and repeated["update_count_distribution"][32] == 1 / 8


def test_mask_agreement_precision_recall_by_hand():
    # 8 positions, K = 4 -> top-k routes 2: positions 1 (2.0) and 5 (1.5); threshold (>= 0): 1, 3, 5
    scores = torch.tensor([-1.0, 2.0, -3.0, 0.5, -0.1, 1.5, -2.0, -0.5]).unsqueeze(1)
    threshold, topk = masks_at_scores(scores, 4)
    assert threshold[:, 0].tolist() == [False, True, False, True, False, True, False, False]
    assert topk[:, 0].nonzero().flatten().tolist() == [1, 5]
    result = MaskAgreement().add(threshold, topk).to_dict()
    assert result["agreement"] == 7 / 8  # position 3 disagrees
    assert result["precision"] == 2 / 3 and result["recall"] == 1.0
    assert result["threshold_selected_fraction"] == 3 / 8


# ------------------------------------------------------------------------------------------ on a model
def _trained_router_free_report(rule, seeded_model):
    from megatron_xmod.diagnostics.routing_report import routing_report

    model, tokens = seeded_model
    return routing_report(model, tokens, rule=rule, micro_batch_size=2)


@pytest.fixture
def xmod_model(seeded):
    model, _ = tiny_model("D + (S4*3 + D)*2", seq_len=32)
    for layer in model.modules():  # spread the router logits so that both rules route something
        if hasattr(layer, "router"):
            torch.nn.init.normal_(layer.router.weight, std=0.5)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    return model, tokens


def test_report_under_topk_routes_exactly_one_in_k_and_agrees_with_itself(xmod_model):
    report = _trained_router_free_report("topk", xmod_model)
    assert report["family"] == "xmod" and report["num_sequences"] == 4 and report["seq_length"] == 32
    assert [b["layers"] for b in report["blocks"]] == [[2, 3, 4], [6, 7, 8]]
    assert all(row["selected_fraction"] == 0.25 for row in report["layers"])
    for block in report["blocks"]:
        # top-k: every layer routes 8 of 32, so the counts average to T/K = 0.75 exactly
        assert block["mean_update_count"] == pytest.approx(0.75)
        assert sum(block["update_count_distribution"]) == pytest.approx(1.0)
        assert block["references"]["independent_random"]["coverage"] == pytest.approx(1 - 0.75 ** 3)
    summary = report["summary"]
    assert set(summary["lm_loss"]) == {"topk"} and math.isfinite(summary["lm_loss"]["topk"])


def test_recorded_threshold_selection_is_the_layer_rule_applied_to_its_input(xmod_model):
    """The recorder sees what the layer routes: for the first layer of a block (b = 0) the mask must
    be sigmoid(router(x)) >= 1/2 of the layer's own input x, captured independently by a hook."""
    from megatron_xmod.diagnostics.routing_report import record_routing
    from megatron_xmod.model import sparse_layers
    from megatron_xmod.xmod.routing_state import eval_routing

    model, tokens = xmod_model
    first = sparse_layers(model)[0]
    inputs = []
    handle = first.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(kwargs.get(
        "hidden_states", args[0] if args else None)), with_kwargs=True)
    model.eval()
    try:
        with torch.no_grad(), eval_routing(model, "threshold"), record_routing(model) as recorder:
            model(tokens[:, :-1], torch.arange(32).expand(4, 32), None, labels=tokens[:, 1:])
    finally:
        handle.remove()
    expected = torch.sigmoid(first.router(inputs[0]).squeeze(-1).float()) >= 0.5
    assert torch.equal(recorder.layer(first.layer_number), expected)
    assert not any(state.observers for state in [model.routing_state])  # detached after the block


def test_report_threshold_rule_fields_and_table(xmod_model, tmp_path):
    from megatron_xmod.diagnostics.routing_report import format_table, plot_update_counts

    report = _trained_router_free_report("threshold", xmod_model)
    assert set(report["summary"]["lm_loss"]) == {"threshold", "topk"}
    agreement = report["summary"]["threshold_vs_topk"]
    assert agreement["positions"] == 6 * 4 * 32  # six sparse layers, 4 x 32 tokens
    # the per-layer counts add up to the pooled ones
    assert sum(row["threshold_vs_topk"]["positions"] for row in report["layers"]) == agreement["positions"]
    table = format_table(report)
    assert "against 1/K = 25.00%" in table and len(table.splitlines()) > 6 + 2
    json.dumps(report)  # the CLI writes it as JSON
    path = plot_update_counts(report, tmp_path / "counts.png")
    assert path.stat().st_size > 1000


def test_report_refuses_a_dense_model(seeded):
    from megatron_xmod.diagnostics.routing_report import routing_report

    model, _ = tiny_model("D*2", seq_len=16)
    with pytest.raises(ValueError, match="model: it has no routed"):
        routing_report(model, torch.zeros(2, 17, dtype=torch.long))


def test_cli_checks_inputs_before_loading(tmp_path, capsys):
    from megatron_xmod.cli import main

    assert main(["routing-report", "--load", str(tmp_path / "nope"), "--data", "x"]) == 2
    assert "load:" in capsys.readouterr().err
    assert main(["routing-report", "--load", str(tmp_path), "--data", str(tmp_path / "missing")]) == 2
    assert "data:" in capsys.readouterr().err
    assert main(["routing-report", "--load", str(tmp_path), "--data", "x", "--num-sequences", "0"]) == 2
    assert "num_sequences:" in capsys.readouterr().err


@pytest.mark.slow
def test_periodic_validation_and_routing_report_on_an_entry_point_checkpoint(tmp_path, capsys):
    """Train a tiny X-MoD with the entry point at learning rate 0 (the weights never change) and
    validate every 2 iterations: every validation scores the same held-out batches (patch 16), so
    the losses at iterations 2 and 4 are equal (megatron alone would move on to the next batches).
    Then ``xmod routing-report`` on its checkpoint: table, JSON, the Figure-5 PNG; under top-k every
    layer routes exactly 1/K."""
    from entry_point_helpers import common_flags, torchrun, validation_losses, write_byte_data

    from megatron_xmod.cli import main

    data = write_byte_data(str(tmp_path / "bytes"))
    save = tmp_path / "ckpt"
    result = torchrun(1, ["-m", "megatron_xmod.pretrain"],
                      common_flags(data, 4, "--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2",
                                   "--num-layers", "7", "--save", str(save), "--save-interval", "4",
                                   "--lr", "0", "--min-lr", "0", "--eval-interval", "2", "--eval-iters", "2"))
    validation = validation_losses(result.stdout)
    assert {2, 4} <= set(validation)
    assert validation[2]["lm loss"] == validation[4]["lm loss"]
    out = tmp_path / "report"
    assert main(["routing-report", "--load", str(save), "--data", data, "--num-sequences", "6",
                 "--output", str(out)]) == 0
    assert "against 1/K = 25.00%" in capsys.readouterr().out
    report = json.loads((out / "routing_report.json").read_text())
    assert report["iteration"] == 4 and report["layout"] == "D + (S4*2 + D)*2"
    assert [b["layers"] for b in report["blocks"]] == [[2, 3], [5, 6]]
    assert report["num_sequences"] == 6 and report["seq_length"] == 64
    assert (out / "update_counts.png").stat().st_size > 1000 and (out / "routing_report.txt").is_file()
    assert main(["routing-report", "--load", str(save), "--data", data, "--num-sequences", "6", "--rule", "topk",
                 "--output", str(tmp_path / "tk")]) == 0
    rows = json.loads((tmp_path / "tk" / "routing_report.json").read_text())["layers"]
    assert all(row["selected_fraction"] == 0.25 for row in rows)


@pytest.mark.slow
def test_validation_continues_keeps_megatrons_protocol(tmp_path):
    """--xmod-validation-continues leaves patch 16 out: at learning rate 0 the validations at
    iterations 2 and 4 score different batches (megatron moves on), so their losses differ, where the
    default run above gives equal ones."""
    from entry_point_helpers import common_flags, torchrun, validation_losses, write_byte_data

    data = write_byte_data(str(tmp_path / "bytes"))
    result = torchrun(1, ["-m", "megatron_xmod.pretrain"],
                      common_flags(data, 4, "--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2",
                                   "--num-layers", "7", "--lr", "0", "--min-lr", "0", "--eval-interval", "2",
                                   "--eval-iters", "2", "--xmod-no-topk-validation", "--xmod-validation-continues"))
    validation = validation_losses(result.stdout)
    assert {2, 4} <= set(validation)
    assert validation[2]["lm loss"] != validation[4]["lm loss"]


def test_report_on_mod_has_one_layer_blocks(seeded, tmp_path):
    """MoD (S + D)*n: every block is one layer, so coverage is the selected fraction and there is no
    adjacent pair; the table and Figure 5 still come out."""
    from megatron_xmod.diagnostics.routing_report import format_table, plot_update_counts, routing_report

    model, _ = tiny_model("D + (S4 + D)*2", seq_len=16, xmod_routing_family="mod")
    report = routing_report(model, torch.randint(0, 256, (2, 17)), rule="topk")
    assert report["family"] == "mod" and [b["layers"] for b in report["blocks"]] == [[2], [4]]
    for block in report["blocks"]:
        assert block["coverage"] == block["selected_fraction"][0] == 0.25
        assert block["adjacent_jaccard"] is None and block["update_count_distribution"] == [0.75, 0.25]
    assert report["summary"]["adjacent_jaccard"] is None
    assert "Jaccard -%" in format_table(report)
    plot_update_counts(report, tmp_path / "mod.png")
