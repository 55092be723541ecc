"""A new user's first hour (issue 17): --help, one-process runs, own backbones in count/plan/fit, the
planner's dense reference and fitted range, the log's random references, preprocess errors.

The end-to-end run of examples/own_data_cpu.sh is in tests/test_examples.py (slow lane).
"""
import argparse
import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_xmod.accounting import count, count_model
from megatron_xmod.cli import main as xmod
from megatron_xmod.demo import DEMO_BACKBONE, MODELS
from megatron_xmod.presets import BACKBONES, backbone_from_dict, backbone_to_dict, parse_model, resolve_backbone
from megatron_xmod.scaling.law import TABLE8, predict_delta
from megatron_xmod.training.log import layer_map, mean_reference, random_reference
from megatron_xmod.xmod.layout import parse_layout
from megatron_xmod.xmod.routing import jaccard_tensor

DEMO_XMOD = MODELS["xmod"][1]  # "D*2 + (S4*4 + D)*2"


@pytest.fixture
def demo_backbone_file(tmp_path):
    path = tmp_path / "my_backbone.json"
    path.write_text(json.dumps(backbone_to_dict(DEMO_BACKBONE)))
    return path


# --- --help and one process ----------------------------------------------------------------------

def test_help_lists_our_flags_with_defaults_despite_megatrons_broken_help_string():
    from megatron.training.arguments import add_megatron_arguments

    from megatron_xmod.training.pretrain import build_parser

    plain = add_megatron_arguments(argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    with pytest.raises((ValueError, TypeError, KeyError)):  # megatron 0.19's own help string breaks argparse
        plain.format_help()
    text = build_parser().format_help()
    for flag, default in (("--xmod-sparsity-k", ""), ("--xmod-token-choice-bias-tau", "0.5"),
                          ("--xmod-router-bce-coeff", "0.0001"), ("--xmod-eval-routing", "threshold"),
                          ("--dtopp-kp", "0.1, or the --moe-preset's"), ("--moe-paged-stash-buffer-size-factor-cuda", None)):
        entry = re.search(r"\n  " + re.escape(flag) + r"[ \n](.*?)(?=\n  -|\n\n)", text, re.DOTALL)
        assert entry, flag
        if default == "":  # unset (derived from other flags): no "(default: None)"
            assert "(default:" not in entry.group(1), flag
        elif default is not None:
            assert f"(default: {default})" in " ".join(entry.group(1).split()), flag


@pytest.mark.slow
def test_help_exits_0_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "megatron_xmod.pretrain", "--help"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--xmod-sparsity-k" in result.stdout and "--xmod-backbone" in result.stdout
    assert "Transformer Engine" not in result.stderr  # CPU-only fall-back notices silenced


def test_one_process_defaults_only_without_a_launcher():
    from megatron_xmod.training.pretrain import single_process_defaults

    env: dict = {"PATH": "/usr/bin"}
    assert single_process_defaults(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert 0 < int(env["MASTER_PORT"]) < 65536
    kept = {"MASTER_ADDR": "node1", "MASTER_PORT": "6000"}  # exported by the user: kept
    assert single_process_defaults(kept) and (kept["MASTER_ADDR"], kept["MASTER_PORT"], kept["RANK"]) == ("node1", "6000", "0")
    for launcher in ({"RANK": "3", "WORLD_SIZE": "8"}, {"LOCAL_RANK": "0"}, {"SLURM_NTASKS": "4"}):
        untouched = dict(launcher)
        assert not single_process_defaults(untouched)
        assert untouched == launcher


# --- own backbones ---------------------------------------------------------------------------------

def test_backbone_file_is_the_same_backbone(demo_backbone_file):
    b = resolve_backbone(str(demo_backbone_file))
    assert dataclasses.replace(b, name=DEMO_BACKBONE.name) == DEMO_BACKBONE
    assert resolve_backbone("165m") == BACKBONES["165m"]


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "hidden_size: missing"),
    ({"hidden_size": "128"}, "hidden_size: must be a positive integer, got '128'"),
    ({"num_layers": 0}, "num_layers: must be a positive integer"),
    ({"qk_layernorm": 1}, "qk_layernorm: must be true or false"),
    ({"num_query_groups": 3}, "num_query_groups: 3 does not divide num_attention_heads 4"),
    ({"hidden": 128}, "hidden: not a backbone field; use only hidden_size"),
])
def test_bad_backbone_fields_are_named(change, message):
    data = {**backbone_to_dict(DEMO_BACKBONE), **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        backbone_from_dict(data, "backbone my.json")


def test_bad_backbone_file_and_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{hidden_size: 1")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        resolve_backbone(str(bad))
    with pytest.raises(ValueError, match="missing.json: file not found"):
        resolve_backbone(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="'7b' is neither a preset .* nor a JSON file"):
        resolve_backbone("7b")


def test_count_with_a_backbone_file_matches_the_preset_count(demo_backbone_file, capsys):
    assert xmod(["count", "--backbone", str(demo_backbone_file), "--model", DEMO_XMOD, "--seq-len", "256", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    expected = count_model(DEMO_BACKBONE, parse_layout(DEMO_XMOD, "xmod"), 256)
    assert row["total_params"] == expected.total_params and row["active_params"] == expected.active_params
    assert row["dense_reference"] == "D*6"
    dense = count_model(DEMO_BACKBONE, "dense", 256)
    assert row["flops_ratio_vs_dense"] == pytest.approx(expected.flops_per_token / dense.flops_per_token)


def test_count_compares_with_the_dense_model_of_the_same_activated_depth(capsys):
    b = BACKBONES["165m"]  # num_layers 28; this layout activates 6
    counted = count(parse_model(DEMO_XMOD, b), 4096)
    assert counted.flops_ratio_vs_dense == pytest.approx(counted.flops_per_token
                                                         / count_model(b, "D*6", 4096).flops_per_token)
    assert xmod(["count", "--backbone", "165m", "--model", DEMO_XMOD]) == 0
    assert "D*6 differ from the backbone's activated depth num_layers = 28" in capsys.readouterr().out
    assert xmod(["count", "--backbone", "165m", "--model", "D + (S4 + D)*2"]) == 2  # activates 3.5 layers
    assert "activates 3.5 layers per token, which no dense model matches" in capsys.readouterr().err


# --- the planner -----------------------------------------------------------------------------------

def _plan(capsys, *argv):
    assert xmod(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_dense_answer_has_delta_zero(capsys):
    plan = _plan(capsys, "--seq-len", "512", "--n-act", "165m", "--A", "1")
    assert plan["K"] == 1 and plan["predicted_delta"] == 0.0
    # the law itself gives the bias e at K = 1: Delta = 0 is the definition, not the law's value
    assert float(predict_delta(TABLE8, 1.6e8, 1.0, 512, 1, 1.0)) == pytest.approx(TABLE8.e)


def test_wallclock_dense_row_is_its_own_curve(tmp_path):
    from megatron_xmod.scaling.planner import DenseCurve, plan_wallclock

    tp = tmp_path / "throughput.csv"
    tp.write_text("K,A,tokens_per_s\n1,,50000\n8,1,20000\n")  # dense far faster here
    tokens = np.geomspace(1e8, 1e11, 20)
    curve = DenseCurve(tokens, 2.5 + 5 * (tokens / 1e8) ** -0.3)
    plan = plan_wallclock(BACKBONES["556m"], 32768, str(tp), curve, hours=24)
    dense = next(o for o in plan.options if o.design.K == 1)
    assert dense.predicted_delta == 0.0
    assert dense.predicted_loss == pytest.approx(curve(50000 * 24 * 3600))
    assert plan.best.design.K == 1


def test_bare_plan_stays_inside_the_fitted_range(capsys):
    from megatron_xmod.scaling.planner import FITTED_RANGE

    plan = _plan(capsys, "--seq-len", "4096", "--n-act", "165m")
    assert plan["K"] <= FITTED_RANGE["K"][1] and FITTED_RANGE["A"][0] <= plan["A"] <= FITTED_RANGE["A"][1]
    assert plan["num_layers"] < 400 and plan["total_params"] < 2e9  # the unbounded search gave 1,288 layers, 5.1B
    assert not [w for w in plan["warnings"] if "extrapolation" in w]
    wide = _plan(capsys, "--seq-len", "65536", "--n-act", "165m", "--A", "1", "--k-max", "64")
    notes = " ".join(wide["warnings"])
    assert "L = 65536 is outside the law's fitted range" in notes and f"K = {wide['K']} is above" in notes


def test_n_act_as_a_number_uses_that_number_in_the_law(capsys, demo_backbone_file):
    from megatron_xmod.scaling.design import design

    plan = _plan(capsys, "--seq-len", "8192", "--n-act", "300e6", "--A", "1")
    assert plan["backbone"] == "298m"  # the preset of nearest size counts the layouts
    d = design("298m", plan["K"], 1.0, 8192)
    assert plan["predicted_delta"] == pytest.approx(float(predict_delta(TABLE8, 300e6, d.capacity_ratio, 8192,
                                                                         plan["K"], 1.0)))
    own = _plan(capsys, "--seq-len", "256", "--n-act", "14e6", "--backbone", str(demo_backbone_file), "--A", "1")
    assert own["backbone"] == "my_backbone"


# --- fit ---------------------------------------------------------------------------------------------

def _rows():
    from megatron_xmod.scaling.synthetic import synthetic_rows

    return [r for r in synthetic_rows(TABLE8, noise=0.0) if r["backbone"] == "556m" and r["L"] == 8192]


def _write_csv(path, rows):
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def test_fit_reads_a_backbone_file_like_its_preset(tmp_path):
    from megatron_xmod.scaling.runs import load_runs

    (tmp_path / "b556.json").write_text(json.dumps(backbone_to_dict(BACKBONES["556m"])))
    rows = _rows()
    by_name = load_runs(_write_csv(tmp_path / "a.csv", rows))
    by_file = load_runs(_write_csv(tmp_path / "b.csv", [dict(r, backbone="b556.json") for r in rows]))
    np.testing.assert_allclose(by_file.capacity_ratio, by_name.capacity_ratio)
    assert by_file.backbone[0] == str(tmp_path / "b556.json")


def test_fit_states_and_checks_the_minimum_runs(tmp_path, capsys):
    rows = _rows()  # one backbone, one L: stage 1 fits e, u, w, rho_N, rho_L -> at least 6 A = 1 runs
    path = _write_csv(tmp_path / "few.csv", rows[:5])
    assert xmod(["fit", path, "--out", str(tmp_path / "fit")]) == 2
    err = capsys.readouterr().err
    assert "stage 1 (A = 1) needs at least 6 sparse runs" in err and "found 5" in err
    assert xmod(["fit", str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv: file not found" in capsys.readouterr().err


# --- the log's references ------------------------------------------------------------------------------

def test_layer_map_of_the_demo_layout():
    assert layer_map(parse_layout(DEMO_XMOD, "xmod")) == [
        "1-2 dense", "3-6 sparse K=4 (block 1, #1-#4)", "7 anchor (block 1)",
        "8-11 sparse K=4 (block 2, #1-#4)", "12 anchor (block 2)"]


def test_random_references_match_random_routing():
    """Routing blind to the tokens (a random 1/K per layer) lands on the documented references."""
    layout = parse_layout("D + (S4*3 + D)", "xmod")
    generator = torch.Generator().manual_seed(0)
    tokens, k = 200_000, 4
    picked = [torch.zeros(tokens, dtype=torch.bool) for _ in range(3)]
    for mask in picked:
        mask[torch.randperm(tokens, generator=generator)[: tokens // k]] = True
    covered = torch.zeros(tokens, dtype=torch.bool)
    for j, mask in enumerate(picked):
        layer_number = 2 + j
        covered |= mask
        assert random_reference(layout, "eval_selected_fraction", layer_number) == mask.float().mean().item()
        assert random_reference(layout, "coverage", layer_number) == pytest.approx(covered.float().mean().item(), abs=0.005)
        if j:
            assert random_reference(layout, "adjacent_jaccard", layer_number) == pytest.approx(
                jaccard_tensor(picked[j - 1], mask).item(), abs=0.005)
    assert random_reference(layout, "coverage", 1) is None  # a dense layer has none
    assert mean_reference(layout, "coverage", {2: 0.3, 3: 0.5}) == pytest.approx((0.25 + 1 - 0.75 ** 2) / 2)


# --- preprocess errors -------------------------------------------------------------------------------

def test_preprocess_names_the_line_that_is_not_utf8(tmp_path):
    from megatron_xmod.data.preprocess import DataError, preprocess

    text = tmp_path / "latin1.txt"
    text.write_bytes("fine\nstill fine\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt:3: not UTF-8 text .* at byte 19"):
        preprocess([text], tmp_path / "out", tokenizer="bytes", progress=False)
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"docs.jsonl:2: not UTF-8 text"):
        preprocess([lines], tmp_path / "out", tokenizer="bytes", progress=False)
    assert not list(tmp_path.glob("out*"))


def test_preprocess_refuses_a_bad_sentencepiece_model(tmp_path):
    from megatron_xmod.data.preprocess import preprocess
    from megatron_xmod.data.tokenizers import TokenizerFileError

    text = tmp_path / "a.txt"
    text.write_text("hello")
    model = tmp_path / "tokenizer.model"
    model.write_text("not a model")
    with pytest.raises(TokenizerFileError, match="tokenizer.model is not a SentencePiece model"):
        preprocess([text], tmp_path / "out", tokenizer="sentencepiece", tokenizer_model=model, progress=False)
    with pytest.raises(ValueError, match="train_tokenizer: trains a SentencePiece model"):
        preprocess([text], tmp_path / "out", tokenizer="bytes", train_tokenizer=500, progress=False)


def test_validation_statistics_describe_the_evaluation_rule_only(seeded):
    """The top-k comparison pass of validation (training/step.py) runs under statistics_paused, so the
    eval_* statistics are those of the threshold pass alone."""
    from helpers import tiny_model

    from megatron_xmod.xmod.routing_state import eval_routing, per_layer, routing_states, statistics_paused

    model, _ = tiny_model("D + (S4*2 + D)")
    model.eval()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.no_grad():
            model(tokens, torch.arange(64).expand_as(tokens), None)

    names = ["eval_selected_fraction", "eval_coverage"]
    forward()  # threshold rule alone
    alone = per_layer(model, names)
    for state in routing_states(model):
        state.forget(names)
    forward()
    with eval_routing(model, "topk"), statistics_paused(model):
        forward()
    assert per_layer(model, names) == alone
    with eval_routing(model, "topk"):
        forward()  # not paused: top-k routes exactly 1/4, which now mixes in
    mixed = per_layer(model, names)["eval_selected_fraction"]
    for layer, value in alone["eval_selected_fraction"].items():
        assert mixed[layer] == pytest.approx((value + 0.25) / 2)
