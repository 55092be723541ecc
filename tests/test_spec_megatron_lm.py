"""``--spec megatron_xmod.spec ...`` in Megatron-LM's own, unmodified ``pretrain_gpt.py`` (tag
core_v0.19.0, ../shared/reference/), run through tests/run_megatron_lm.py under torchrun on CPU.

Each launch is compared with ``python -m megatron_xmod.pretrain`` given the same megatron flags and
seed (and ``--xmod-layout`` for the layout the spec carries, ``--xmod-validation-continues`` for
megatron's validation protocol): same loss at every iteration for TP1,
TP2 and PP2 (and PP2 with ``xmod partition --block-aligned``'s layout, whose first stage ends on a
sparse layer); the routed layers really built (megatron's parameter count equals ``xmod count``'s
count_model, which differs from the dense model's); the router BCE reaches the loss; evaluation
uses threshold routing; a wrong ``--num-layers``, or a pipeline stage starting inside a sparse block,
stops with an error naming the field.
"""
from __future__ import annotations

import re

import pytest
from entry_point_helpers import (
    RUNNER,
    common_flags,
    parameter_counts,
    torchrun,
    train_losses,
    validation_losses,
    write_byte_data,
)
from helpers import TINY
from run_megatron_lm import MEGATRON_LM_DIR
from spec_models import LAYOUT

from megatron_xmod.accounting import count_model
from megatron_xmod.xmod.layout import parse_layout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MEGATRON_LM_DIR / "pretrain_gpt.py").is_file(),
                       reason=f"no Megatron-LM pretrain_gpt.py at {MEGATRON_LM_DIR}"),
]

ITERS = 8
PARALLEL = {"tp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", "2"]),
            "pp2": (2, ["--pipeline-model-parallel-size", "2"])}


def built_stages(output: str) -> list[str]:
    """The stages' "[xmod] --spec built layers 1-4 of 8 (2 routed" lines, sorted; searched in the whole
    output, since the ranks' lines share one pipe and may run into each other."""
    return sorted(re.findall(r"\[xmod\] --spec built layers (\d+-\d+ of \d+ \(\d+ routed)", output))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_byte_data(str(tmp_path_factory.mktemp("data") / "bytes"))


class Runs:
    """Launches on demand and keeps each (route, parallel, extra) result for the module."""

    def __init__(self, data):
        self.data, self.cache = data, {}

    def megatron_lm(self, parallel: str, spec: str = "tiny", *extra: str, check: bool = True):
        nproc, flags = PARALLEL[parallel]
        argv = ["--spec", "spec_models", spec, "--num-layers", "8", *flags, *common_flags(self.data, ITERS, *extra)]
        return self._run(("megatron-lm", parallel, spec, extra), nproc, [str(RUNNER)], argv, check)

    def ours(self, parallel: str, *extra: str):
        """--xmod-validation-continues: megatron's own validation protocol (the --spec route gets
        none of our patches), so both routes score the same batches at every validation."""
        nproc, flags = PARALLEL[parallel]
        argv = ["--xmod-routing-family", "xmod", "--xmod-layout", LAYOUT, "--xmod-validation-continues", *flags,
                *common_flags(self.data, ITERS, *extra)]
        return self._run(("ours", parallel, extra), nproc, ["-m", "megatron_xmod.pretrain"], argv, True)

    def _run(self, key, nproc, target, argv, check):
        if key not in self.cache:
            result = torchrun(nproc, target, argv, check=check)
            self.cache[key] = (result.returncode, result.stdout + result.stderr)
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(data):
    return Runs(data)


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_pretrain_gpt_with_spec_matches_our_entry_point(runs, parallel):
    _, theirs = runs.megatron_lm(parallel)
    _, ours = runs.ours(parallel)
    their_losses, our_losses = train_losses(theirs), train_losses(ours)
    assert sorted(their_losses) == list(range(1, ITERS + 1)), theirs[-3000:]
    for iteration in range(1, ITERS + 1):
        # same weights (CPU init, same seed), same samples, same loss: megatron prints 7 digits
        assert their_losses[iteration] == pytest.approx(our_losses[iteration], rel=1e-6, abs=0), iteration
    assert their_losses[ITERS] < their_losses[1] - 0.5  # and it learns
    # each stage built its own part of the layout, with its routed layers
    stages = {"tp1": ["1-8 of 8 (4 routed"], "tp2": ["1-8 of 8 (4 routed"] * 2,
              "pp2": ["1-4 of 8 (2 routed", "5-8 of 8 (2 routed"]}[parallel]
    built = built_stages(theirs)
    assert built == sorted(stages), built
    # evaluation: the threshold rule (the RoutingState default), i.e. our entry point's "lm loss",
    # not its "lm loss topk routing"
    their_eval, our_eval = validation_losses(theirs), validation_losses(ours)
    assert sorted(their_eval) == [4, 8]
    for iteration in (4, 8):
        assert their_eval[iteration]["lm loss"] == pytest.approx(our_eval[iteration]["lm loss"], rel=1e-6, abs=0)
        if "lm loss topk routing" in our_eval[iteration]:  # reported without pipeline parallelism
            assert their_eval[iteration]["lm loss"] != our_eval[iteration]["lm loss topk routing"]


@pytest.mark.parametrize("parallel", ["tp1", "pp2"])
def test_megatron_parameter_count_is_the_routed_models(runs, parallel):
    """Summed over the pipeline stages (untied embeddings: nothing is counted twice)."""
    _, theirs = runs.megatron_lm(parallel)
    counts = parameter_counts(theirs)
    assert sorted(counts) == ([(0, 0)] if parallel == "tp1" else [(0, 0), (0, 1)]), counts
    routed = count_model(TINY, parse_layout(LAYOUT, "xmod"), 64).total_params
    dense = count_model(TINY, parse_layout("D*8", "dense"), 64).total_params
    assert routed != dense
    assert sum(counts.values()) == routed


def test_router_bce_reaches_the_loss(runs):
    """Megatron-LM's loss_func sums only the LM loss; the BCE enters through the layers' backward:
    a larger coefficient leaves iteration 1's loss (before any update) as it is and changes the
    later ones, exactly as --xmod-router-bce-coeff does in our entry point. (Adam's first update is
    lr * sign(grad) elementwise, which a larger BCE rarely flips: iteration 2 may still agree.)"""
    default = train_losses(runs.megatron_lm("tp1")[1])
    strong = train_losses(runs.megatron_lm("tp1", "tiny_strong_bce")[1])
    assert strong[1] == default[1]
    assert all(strong[i] != default[i] for i in range(3, ITERS + 1)), (strong, default)
    ours = train_losses(runs.ours("tp1", "--xmod-router-bce-coeff", "0.5")[1])
    for iteration in range(1, ITERS + 1):
        assert strong[iteration] == pytest.approx(ours[iteration], rel=1e-6, abs=0), iteration


def test_num_layers_disagreeing_with_the_layout_is_a_clear_error(runs):
    returncode, output = runs.megatron_lm("tp1", "tiny", "--num-layers", "9", check=False)
    assert returncode != 0
    assert "num_layers: 9 does not match the --spec layout 'D + (S4*2 + D)*2 + D'" in output
    assert "set --num-layers 8" in output
    assert "iteration        1/" not in output


def test_block_aligned_stage_ending_on_a_sparse_layer_trains(runs):
    """Issue 26: the layout ``xmod partition --block-aligned`` prints for the tiny layout at PP 2 ends
    stage 0 on sparse layer 6 (the last of the block 5-6) and starts stage 1 on the anchor at 7. The
    pre-launch check approves it, and Megatron-LM's pipeline then frees stage 0's output, which
    must be no view (deallocate_output_tensor): it trains, with our entry point's losses."""
    from megatron_xmod.cli.partition import plan
    from megatron_xmod.spec import main as check_spec

    balanced, _ = plan("165m", LAYOUT, 32768, 2, block_aligned=True)
    layout = balanced.layout
    layers = parse_layout(LAYOUT, "xmod").layers
    last = balanced.stages[0].layers - 1  # 0-based last layer of stage 0
    assert layers[last].is_sparse and not layers[last + 1].is_sparse, layout
    assert check_spec(["spec_models", "tiny", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                       "--pipeline-model-parallel-layout", layout]) == 0
    _, theirs = runs.megatron_lm("pp2", "tiny", "--pipeline-model-parallel-layout", layout)
    _, ours = runs.ours("pp2", "--pipeline-model-parallel-layout", layout)
    assert "counter-productive to free a view" not in theirs
    built = built_stages(theirs)
    assert built == sorted([f"1-{last + 1} of 8 ({sum(layer.is_sparse for layer in layers[: last + 1])} routed",
                            f"{last + 2}-8 of 8 ({sum(layer.is_sparse for layer in layers[last + 1 :])} routed"]), built
    their_losses, our_losses = train_losses(theirs), train_losses(ours)
    assert sorted(their_losses) == list(range(1, ITERS + 1)), theirs[-3000:]
    for iteration in range(1, ITERS + 1):
        assert their_losses[iteration] == pytest.approx(our_losses[iteration], rel=1e-6, abs=0), iteration
    their_eval, our_eval = validation_losses(theirs), validation_losses(ours)
    assert sorted(their_eval) == [4, 8]
    for iteration in (4, 8):
        assert their_eval[iteration]["lm loss"] == pytest.approx(our_eval[iteration]["lm loss"], rel=1e-6, abs=0)


def test_stage_starting_inside_a_sparse_block_is_a_clear_error(runs):
    """Megatron-LM's pipeline sends hidden states only, so the --spec route cannot carry the
    token-choice bias (our entry point can): a stage starting at layer 3, the second sparse layer of
    the block 2-3, stops at build time instead of training a different model."""
    returncode, output = runs.megatron_lm("pp2", "tiny", "--pipeline-model-parallel-layout", "Et*2|t*6L",
                                          check=False)
    assert returncode != 0
    assert ("pipeline_model_parallel_layout: a pipeline stage starts at layer 3, inside the sparse block of "
            "layers 2-3") in output
    assert "put the boundary before layer 2 or after layer 3" in output
    assert "iteration        1/" not in output


def test_misspelt_spec_module_silently_builds_megatrons_dense_model(runs):
    """Why docs/cluster.md says to check the build: megatron's import_module logs the ImportError and
    returns None, and pretrain_gpt.py then builds its default dense layers (--num-layers of them)."""
    _, output = runs.megatron_lm("tp1", "tiny", "--spec", "spec_modelz", "tiny", "--train-iters", "3")
    assert "couldn't import module due to No module named 'spec_modelz'" in output
    assert "[xmod] --spec built layers" not in output
    dense = count_model(TINY, parse_layout("D*8", "dense"), 64).total_params
    assert parameter_counts(output) == {(0, 0): dense}


def test_checkpoint_save_and_resume_reproduces_the_losses(runs, tmp_path):
    """Megatron's distributed checkpoint of the spec-built model (the sparse layers' extra router and
    gate parameters are saved layer by layer): stopped after 4 iterations and resumed with --load,
    the losses are those of the uninterrupted run. The 2nd logged iteration after a start is
    megatron's average of two iterations, so iteration 6 is left out."""
    ckpt = str(tmp_path / "ckpt")
    runs.megatron_lm("tp1", "tiny", "--save", ckpt, "--save-interval", "4", "--exit-interval", "4")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    _, output = runs.megatron_lm("tp1", "tiny", "--save", ckpt, "--load", ckpt, "--save-interval", "4")
    resumed, reference = train_losses(output), train_losses(runs.megatron_lm("tp1")[1])
    assert sorted(resumed) == list(range(5, ITERS + 1)), output[-3000:]
    for iteration in (5, 7, 8):
        assert resumed[iteration] == reference[iteration], (iteration, resumed, reference)
