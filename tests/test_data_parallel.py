"""Data parallelism with the launchers' distributed-optimizer flags (CPU/gloo, torchrun).

The SLURM launchers overlap the distributed optimizer's data-parallel sync with compute
(``OVERLAP_ARGS`` in slurm/xmod_train.sh: megatron reduce-scatters each gradient bucket as the last
micro-batch's backward fills it, and all-gathers the parameters during the next forward). X-MoD moves
5-10x Dense's bytes there (every parameter, not the activated ones), which is why it matters to us. The
overlap changes when the collectives run, not what they compute: at DP 2 an overlapped run must train
exactly as the synchronous one, for the routed layers (router, bias hand-over, in-place updates) and for
the expert routers (an expert may get no token in a micro-batch, and megatron's overlapped hook insists
on every gradient arriving).
"""
import re
from types import SimpleNamespace

import pytest
from entry_point_helpers import REPO, common_flags, torchrun, train_losses, validation_losses, write_byte_data

# What the launchers pass on GPUs besides the overlap (slurm/xmod_train.sh: OPT_ARGS' Muon of Table 5,
# DEVICE_ARGS' distributed optimizer in bf16): the layer-wise Muon and Adam's distributed optimizer both
# take part in the sync.
LAUNCH = ["--xmod-muon-table5", "--use-distributed-optimizer", "--bf16"]
FAMILIES = {
    "xmod": ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4 + S8 + D)*2 + D",
             "--xmod-token-choice-bias-tau", "0.5"],
    "dtopp": ["--moe-preset", "dtopp-t2-e8", "--num-layers", "2"],
}
ITERS = 5


def launcher_overlap_flags() -> list[str]:
    text = (REPO / "slurm" / "xmod_train.sh").read_text()
    match = re.search(r"^\s*OVERLAP_ARGS=\(([^)]*)\)", text, re.MULTILINE)
    assert match, "slurm/xmod_train.sh sets no OVERLAP_ARGS"
    return match.group(1).split()


def _train(data, family, *extra):
    flags = common_flags(data, ITERS, "--eval-interval", "3", *LAUNCH, *extra)
    result = torchrun(2, ["-m", "megatron_xmod.pretrain"], [*FAMILIES[family], *flags])
    return result.stdout, train_losses(result.stdout), validation_losses(result.stdout)


def test_the_launchers_overlap_both_halves_of_the_sync():
    assert launcher_overlap_flags() == ["--overlap-grad-reduce", "--overlap-param-gather"]


def test_the_run_summary_says_whether_the_sync_is_exposed():
    from megatron_xmod.training.log import data_parallel_sync

    args = SimpleNamespace(data_parallel_size=8, use_distributed_optimizer=False, overlap_grad_reduce=False,
                           overlap_param_gather=False)
    assert data_parallel_sync(args) == "gradients all-reduced after the last micro-batch (exposed: --overlap-grad-reduce hides it)"
    assert data_parallel_sync(SimpleNamespace(**{**vars(args), "data_parallel_size": 1})) == ""
    sharded = SimpleNamespace(**{**vars(args), "use_distributed_optimizer": True, "overlap_grad_reduce": True})
    assert data_parallel_sync(sharded) == (
        "gradients reduce-scattered during the last micro-batch's backward (--overlap-grad-reduce); parameters "
        "all-gathered after the optimizer step (exposed: --overlap-param-gather hides it)")


def test_the_layer_wise_distributed_optimizer_without_bf16_is_refused_naming_the_fix():
    from megatron_xmod.training.preflight import check_optimizer

    fp32 = SimpleNamespace(use_layer_wise_distributed_optimizer=True, bf16=False, optimizer="muon")
    with pytest.raises(ValueError, match=r"^use_distributed_optimizer: .*--optimizer muon with "
                                         r"--use-distributed-optimizer .* bf16 only .*; add --bf16, or drop "
                                         r"--use-distributed-optimizer"):
        check_optimizer(fp32)
    check_optimizer(SimpleNamespace(**{**vars(fp32), "bf16": True}))  # the launchers' setting
    check_optimizer(SimpleNamespace(use_layer_wise_distributed_optimizer=False, bf16=False, optimizer="adam"))


@pytest.mark.slow
def test_the_entry_point_refuses_fp32_muon_with_the_distributed_optimizer_before_building(tmp_path):
    """megatron-core 0.19 would build the model and then stop with a bare AssertionError; the pre-flight
    names the flag before anything is built (no start-up summary, no model)."""
    data = write_byte_data(str(tmp_path / "bytes"))
    flags = common_flags(data, ITERS, "--xmod-muon-table5", "--use-distributed-optimizer")
    result = torchrun(1, ["-m", "megatron_xmod.pretrain"], [*FAMILIES["xmod"], *flags], check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "error: use_distributed_optimizer: megatron's layer-wise distributed optimizer" in output
    assert "megatron_xmod run" not in output and "AssertionError" not in output


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_overlapped_sync_trains_as_the_synchronous_one_at_dp2(tmp_path, family):
    data = write_byte_data(str(tmp_path / "bytes"))
    overlap = launcher_overlap_flags()
    out_sync, train_sync, valid_sync = _train(data, family)
    out_overlap, train_overlap, valid_overlap = _train(data, family, *overlap)
    # the run's summary (rank 0, megatron's own arguments after validation): Muon's layer-wise distributed optimizer
    assert ("dp sync    gradients reduce-scattered after the last micro-batch (exposed: --overlap-grad-reduce hides "
            "it); parameters all-gathered after the optimizer step (exposed") in out_sync
    assert ("dp sync    gradients reduce-scattered during the last micro-batch's backward (--overlap-grad-reduce); "
            "parameters all-gathered during the next forward (--overlap-param-gather)") in out_overlap
    assert "parallel   world 2 = data 2 x tensor 1 x pipeline 1" in out_overlap
    assert sorted(train_sync) == list(range(1, ITERS + 1)) and valid_sync
    assert train_overlap == pytest.approx(train_sync, rel=1e-6)
    assert train_sync[ITERS] < train_sync[1]  # it trains
    assert valid_overlap.keys() == valid_sync.keys()
    for iteration, values in valid_sync.items():
        assert valid_overlap[iteration] == pytest.approx(values, rel=1e-6)
