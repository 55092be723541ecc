"""Cost-balanced pipeline layouts (``xmod partition``, ``--xmod-pipeline-balance auto``): the
partition is the exact min-max split (brute force agrees), its string is megatron's own layout
grammar, the cost model adds up to the accounting, and the done-when figure of issue 13 holds."""
import itertools
import json
import random
import time
from types import SimpleNamespace

import pytest

from megatron_xmod.accounting import count
from megatron_xmod.cli import main as xmod
from megatron_xmod.pipeline.cost import calibrate, layer_items, read_calibration
from megatron_xmod.pipeline.partition import (
    balanced_partition,
    default_partition,
    in_flight_microbatches,
    min_max_split,
)
from megatron_xmod.presets import get_backbone, parse_model


def _items(backbone="1.65b", model="xmod-a3k16", seq_len=32768):
    return layer_items(parse_model(model, get_backbone(backbone)), seq_len)


def _brute_force(costs, chunks):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_min_max_split_is_exact():
    rng = random.Random(0)
    for _ in range(40):
        costs = [rng.choice([1.0, 0.05, 0.07, 3.0, 0.5]) * rng.uniform(0.5, 1.5) for _ in range(rng.randint(3, 10))]
        chunks = rng.randint(1, len(costs))
        sizes = min_max_split(costs, chunks)
        assert len(sizes) == chunks and sum(sizes) == len(costs) and min(sizes) >= 1
        bounds = [0, *itertools.accumulate(sizes)]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == pytest.approx(_brute_force(costs, chunks))


def test_min_max_split_with_forbidden_starts_is_exact():
    rng = random.Random(1)
    for _ in range(40):
        costs = [rng.uniform(0.05, 3.0) for _ in range(rng.randint(4, 10))]
        no_start = set(rng.sample(range(1, len(costs)), rng.randint(0, len(costs) // 2)))
        starts = [i for i in range(1, len(costs)) if i not in no_start]
        chunks = rng.randint(1, len(starts) + 1)
        sizes = min_max_split(costs, chunks, sorted(no_start))
        bounds = [0, *itertools.accumulate(sizes)]
        assert not no_start & set(bounds)
        best = min(max(sum(costs[a:b]) for a, b in zip(cut, cut[1:]))
                   for cut in ((0, *c, len(costs)) for c in itertools.combinations(starts, chunks - 1)))
        assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == pytest.approx(best)
    with pytest.raises(ValueError, match="pp/vpp: 3 stages cannot all start at an allowed item"):
        min_max_split([1.0] * 4, 3, [1, 2])


def test_block_aligned_layout_passes_the_spec_routes_check(capsys):
    """--block-aligned: what Megatron-LM's pretrain_gpt.py --spec can run (it cannot carry the bias
    across stages); the unconstrained layout splits blocks, and the --spec check refuses it."""
    from megatron_xmod import spec as xmod_spec

    for aligned in (True, False):
        assert xmod(["partition", "--backbone", "1.65b", "--model", "xmod-a3k16", "--pp", "8", "--json"]
                    + ["--block-aligned"] * aligned) == 0
        out = json.loads(capsys.readouterr().out)
        check = ["megatron_xmod.spec", "xmod_a3k16", "--num-layers", "298", "--pipeline-model-parallel-size", "8",
                 "--pipeline-model-parallel-layout", out["layout"]]
        assert xmod_spec.main(check) == (0 if aligned else 2)
        assert ("none inside a sparse block" in capsys.readouterr().out) is aligned
        if aligned:  # between the unconstrained optimum (1.029) and megatron's count split (2.02)
            assert 1.05 < out["max_over_mean"] < 1.3 < out["default_max_over_mean"]
            assert out["block_aligned"] is True
    # megatron's even split of 298 layers in 2 stages starts stage 2 at layer 150, inside a block
    assert xmod_spec.main(["megatron_xmod.spec", "xmod_a3k16", "--num-layers", "298",
                           "--pipeline-model-parallel-size", "2"]) == 2
    assert "a pipeline stage starts at layer 150, inside the sparse block of layers 103-150" in capsys.readouterr().err


@pytest.mark.parametrize("pp,vpp", [(8, 1), (4, 2), (2, 4)])
def test_layout_string_is_megatrons_grammar(pp, vpp):
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    items = _items("936m", "xmod-a4k8")
    partition = balanced_partition(items, pp, vpp)
    parsed = PipelineParallelLayerLayout(partition.layout, pp)
    parsed.validate_layer_layout(num_layers=len(items) - 2, mtp_num_layers=None)
    assert parsed.virtual_pipeline_model_parallel_size == vpp
    for stage in partition.stages:
        assert parsed.layout[stage.pp_rank][stage.vp_stage].count(LayerType.decoder) == stage.layers
    default = default_partition(items, pp, vpp)
    assert sum(s.layers for s in default.stages) == len(items) - 2
    assert max(s.layers for s in default.stages) - min(s.layers for s in default.stages) <= 1


def test_done_when_1p65b_a3k16_pp8(capsys):
    assert xmod(["partition", "--backbone", "1.65b", "--model", "xmod-a3k16", "--seq-len", "32768", "--pp", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"layout", "stages", "max_over_mean", "default_max_over_mean"} <= out.keys()
    assert out["max_over_mean"] <= 1.05 < 1.5 < out["default_max_over_mean"]
    stages = out["stages"]
    assert len(stages) == 8 and all({"layers", "flops", "params", "activation_bytes"} <= s.keys() for s in stages)
    model = parse_model("xmod-a3k16", get_backbone("1.65b"))
    counted = count(model, 32768)
    assert sum(s["layers"] for s in stages) == counted.num_layers == 298
    assert sum(s["params"] for s in stages) == counted.total_params  # embedding, layers and head, once each
    # 1F1B: rank r holds pp - r micro-batches in flight
    assert [s["in_flight"] for s in stages] == [8 - r for r in range(8)]


def test_flops_add_up_to_the_accounting():
    model = parse_model("xmod-a4k8", get_backbone("936m"))
    items = layer_items(model, 4096, micro_batch_size=2)
    layers = sum(item.flops for item in items[1:-1])
    assert layers == pytest.approx(3 * count(model, 4096).flops_per_token * 4096 * 2, rel=1e-9)
    assert items[-1].flops == pytest.approx(3 * 2 * 1536 * 50257 * 4096 * 2)  # LM head, fwd + bwd
    dense, sparse = items[1], items[5]
    assert dense.kind == "D" and sparse.kind == "S8"
    # a routed layer costs more than 1/K of a dense one: it still touches every token
    assert dense.time_s / 8 < sparse.time_s < dense.time_s


@pytest.mark.parametrize("pp,vpp", [(4, 1), (4, 2), (8, 4)])
def test_in_flight_matches_megatrons_warmup(pp, vpp):
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    held = in_flight_microbatches(pp, vpp, num_microbatches=64)
    for rank in range(pp):
        communicator = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r),
                                       virtual_pipeline_model_parallel_size=None if vpp == 1 else vpp)
        _, _, warmup, _ = get_pp_rank_microbatches(64, vpp, pp, p2p_communicator=communicator)
        assert sum(held[rank]) == warmup + 1


def test_300_layers_64_stages_well_under_a_second():
    items = _items("1.65b", "D*4 + (S16*48 + D)*6")
    start = time.perf_counter()
    partition = balanced_partition(items, 64)
    assert time.perf_counter() - start < 1.0
    assert len(partition.stages) == 64 and sum(s.layers for s in partition.stages) == 298


def test_calibration_replaces_measured_kinds_and_scales_the_rest(tmp_path):
    items = _items("936m", "xmod-a4k8")
    path = tmp_path / "measured.json"
    proxy = {item.kind: item.time_s for item in items}
    path.write_text(json.dumps({"D": 2 * proxy["D"], "S8": 4 * proxy["S8"]}))
    calibrated = {item.kind: item.time_s for item in calibrate(items, read_calibration(path))}
    assert calibrated["D"] == 2 * proxy["D"] and calibrated["S8"] == 4 * proxy["S8"]
    assert calibrated["L"] == pytest.approx(3 * proxy["L"])  # median of the ratios 2 and 4
    path.write_text(json.dumps({"X": 1.0}))
    with pytest.raises(ValueError, match="X: not an item kind"):
        read_calibration(path)


def test_bad_input_is_refused(capsys):
    assert xmod(["partition", "--backbone", "165m", "--model", "mod", "--pp", "1", "--vpp", "2"]) == 2
    assert "vpp: virtual pipeline stages need --pp > 1" in capsys.readouterr().err
    assert xmod(["partition", "--backbone", "165m", "--model", "dense", "--pp", "64"]) == 2
    assert "pp/vpp: 64 x 1 stages exceed the 28 layers" in capsys.readouterr().err


def test_pipeline_balance_auto_adds_the_layout():
    from megatron_xmod.cli.partition import plan
    from megatron_xmod.training.flags import expand_arguments

    base = ["--xmod-backbone", "936m", "--xmod-model", "xmod-a4k8", "--seq-length", "32768"]
    argv = expand_arguments([*base, "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank",
                             "2", "--xmod-pipeline-balance", "auto"])
    balanced, _ = plan("936m", "xmod-a4k8", 32768, 4, 2)
    assert argv[argv.index("--pipeline-model-parallel-layout") + 1] == balanced.layout
    assert "--num-virtual-stages-per-pipeline-rank" not in argv  # the layout implies VPP
    own = expand_arguments([*base, "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                            "Et*40|t*40|t*40|t*41L", "--xmod-pipeline-balance", "auto"])
    assert own.count("--pipeline-model-parallel-layout") == 1 and "Et*40|t*40|t*40|t*41L" in own
    assert "--pipeline-model-parallel-layout" not in expand_arguments([*base, "--xmod-pipeline-balance", "auto"])


@pytest.mark.parametrize("pp,vpp,microbatches", [(4, 1, 8), (4, 2, 8), (8, 4, 16)])
def test_schedule_simulation_has_the_textbook_bubble(pp, vpp, microbatches):
    from megatron_xmod.pipeline.schedule import simulate

    # equal chunks: bubble = ((pp - 1) / vpp) / (m + (pp - 1) / vpp) (Narayanan et al., 2021)
    simulation = simulate([1.0] * (pp * vpp), pp, microbatches)
    assert simulation.bubble == pytest.approx(((pp - 1) / vpp) / (microbatches + (pp - 1) / vpp))
    # the slowest stage sets the step: one chunk twice as slow stretches the 1F1B step
    if vpp == 1:
        slow = simulate([1.0] * (pp - 1) + [2.0], pp, microbatches)
        assert slow.step_time >= 2.0 * microbatches


def test_dropping_the_bias_at_a_boundary_changes_the_model(seeded, monkeypatch):
    """The PP loss-equality tests (test_pipeline_parallel.py) would catch a bias lost at their
    boundaries: restarting b at layer 3 or 6 of their layout changes the logits."""
    import torch
    from helpers import tiny_model

    from megatron_xmod.xmod.routing_state import RoutingState

    model, _ = tiny_model("D + (S4*2 + D)*2 + D", xmod_token_choice_bias_tau=0.5)
    model.train()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand_as(tokens)
    with torch.no_grad():
        carried = model(tokens, positions, None)
    take_bias = RoutingState.take_bias

    def lost_at_boundaries(self, layer_number, shape):
        return (None, None) if layer_number in (3, 6) else take_bias(self, layer_number, shape)

    monkeypatch.setattr(RoutingState, "take_bias", lost_at_boundaries)
    with torch.no_grad():
        lost = model(tokens, positions, None)
    assert not torch.allclose(carried, lost)
