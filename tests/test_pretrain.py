"""The pre-training entry point on megatron's own loop (python -m megatron_xmod.pretrain), on CPU/gloo.

Each case launches real processes with torch.distributed.run; models are tiny so a launch takes
~20-40 s on 2 cores, most of it megatron start-up.
"""
import os
import subprocess
import sys

import pytest
from entry_point_helpers import free_port, write_byte_data

from megatron_xmod.training.flags import CPU_COMPILED_FUSIONS

pytestmark = pytest.mark.slow

ITERS = 12
ROUTED = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2 + D"]  # 8 layers, anchors at 4 and 7
ARCH = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--swiglu", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--qk-layernorm"]
CPU = ["--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
       "--no-persist-layer-norm", "--no-create-attention-mask-in-dataloader", "--use-cpu-initialization",
       *CPU_COMPILED_FUSIONS]


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    return write_byte_data(str(tmp_path_factory.mktemp("data") / "bytes"))


SCHEDULE = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]


def launch(nproc, out, data, *extra, check=True, arch=ARCH, routed=ROUTED, schedule=SCHEDULE):
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "-m", "megatron_xmod.pretrain", *routed, *arch, *CPU,
               "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--train-iters", str(ITERS), *schedule, "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "256", "--data-path", data, "--split", "90,5,5", "--attention-dropout", "0",
               "--hidden-dropout", "0", "--seed", "1234", "--log-interval", "1", "--eval-interval", "6",
               "--eval-iters", "1", "--tensorboard-dir", str(out / "tb"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def scalars(tb_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for name in sorted(os.listdir(tb_dir)):
        events = EventAccumulator(str(tb_dir / name), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return out


@pytest.fixture(scope="module")
def reference_run(byte_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    launch(1, out, byte_data, "--save", str(out / "ckpt"), "--save-interval", "6")
    return out


def test_tensorboard_has_routing_and_flops_scalars(reference_run):
    tags = scalars(reference_run / "tb")
    for tag in ("lm loss", "router bce loss", "tokens seen", "training flops", "forward flops per token",
                "D over D_dense", "routing/selected_fraction", "routing/coverage", "routing/adjacent_jaccard",
                "routing/selected_fraction/layer_002", "lm loss validation", "lm loss topk routing validation"):
        assert tag in tags, f"missing {tag}; have {sorted(tags)[:40]}"
    assert tags["routing/selected_fraction/layer_002"][ITERS] == pytest.approx(0.25)  # top-k: exactly 1/K
    assert tags["tokens seen"][ITERS] == ITERS * 4 * 64
    losses = tags["lm loss"]
    assert losses[ITERS] < losses[1] - 0.5  # it learns
    flops = tags["training flops"]
    assert flops[ITERS] == pytest.approx(3 * tags["forward flops per token"][ITERS] * ITERS * 4 * 64)


def test_resume_reproduces_uninterrupted_losses(byte_data, reference_run, tmp_path):
    """Killed after 6 iterations (exit-interval), resumed with --load: bit-identical losses.

    Exact equality holds because dropout is 0 and the data order is a function of the consumed
    samples; the 2nd logged iteration after any start is megatron's average of two iterations
    (training.py `should_reset`), so iteration 8 is compared like for like with the reference's 2nd.
    """
    ckpt = tmp_path / "ckpt"
    launch(1, tmp_path / "a", byte_data, "--save", str(ckpt), "--save-interval", "6", "--exit-interval", "6")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    launch(1, tmp_path / "b", byte_data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "6")
    reference = scalars(reference_run / "tb")["lm loss"]
    resumed = scalars(tmp_path / "b" / "tb")["lm loss"]
    assert sorted(resumed) == list(range(7, ITERS + 1))
    for iteration in [7] + list(range(9, ITERS + 1)):
        assert resumed[iteration] == reference[iteration], (iteration, resumed[iteration], reference[iteration])


def test_tensor_parallel_2_matches_tp1(byte_data, reference_run, tmp_path):
    launch(2, tmp_path, byte_data, "--tensor-model-parallel-size", "2")
    tp2, tp1 = scalars(tmp_path / "tb")["lm loss"], scalars(reference_run / "tb")["lm loss"]
    for iteration in range(1, ITERS + 1):
        # same master weights (CPU init) and data; fp32 sums in the row-parallel all-reduce and the
        # vocab-parallel cross entropy run in another order, a 1e-4 relative effect at step 1
        assert tp2[iteration] == pytest.approx(tp1[iteration], rel=1e-3), iteration


def test_pipeline_parallel_2_trains(byte_data, tmp_path):
    """Stage boundary after layer 4 (an anchor). megatron seeds each stage differently (seed + 100 *
    pp_rank), so the weights, and hence the losses, are not those of the 1-process run."""
    launch(2, tmp_path, byte_data, "--pipeline-model-parallel-size", "2")
    tags = scalars(tmp_path / "tb")
    assert tags["lm loss"][ITERS] < tags["lm loss"][1] - 0.5
    # routing statistics reach the log from the sparse layers of both stages
    for layer in (2, 3, 5, 6):
        assert tags[f"routing/selected_fraction/layer_{layer:03d}"][ITERS] == pytest.approx(0.25)


def test_compiled_layers_train_as_the_eager_run(byte_data, reference_run, tmp_path):
    """--xmod-compile-layers through megatron's loop: the same losses as the eager reference run (float
    rounding apart), validation included (threshold routing runs the routed layers eagerly)."""
    launch(1, tmp_path, byte_data, "--xmod-compile-layers")
    tags, reference = scalars(tmp_path / "tb"), scalars(reference_run / "tb")
    assert sorted(tags["lm loss"]) == sorted(reference["lm loss"]) == list(range(1, ITERS + 1))
    for step, loss in reference["lm loss"].items():
        assert tags["lm loss"][step] == pytest.approx(loss, rel=2e-3), step
    validation = [tag for tag in reference if tag.startswith("lm loss validation")]
    assert validation and all(tags[tag] == pytest.approx(reference[tag], rel=2e-3) for tag in validation)


@pytest.mark.parametrize("extra, message", [
    (["--num-layers", "9"], "num_layers: 9 does not match the layout"),
    (["--xmod-sparsity-k", "3"], "sparsity_k: 3 disagrees with the layout"),
    (["--xmod-compile-layers", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "recompute_granularity: --xmod-compile-layers"),
])
def test_inconsistent_xmod_arguments_fail_before_training(byte_data, tmp_path, extra, message):
    result = launch(1, tmp_path, byte_data, *extra, check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "iteration        1/" not in result.stdout


def test_missing_data_path_fails_before_training(tmp_path):
    result = launch(1, tmp_path, str(tmp_path / "nowhere"), check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"data_path: {tmp_path / 'nowhere'}.idx does not exist" in output  # the pre-flight check names the file
    assert "iteration        1/" not in result.stdout


def test_dtopp_moe_through_the_entry_point(byte_data, tmp_path):
    """Issue 4's flags on issue 3's entry point: the DTop-p controller runs inside megatron's loop."""
    moe = ["--moe-preset", "moe-8x64", "--moe-router-type", "dtopp", "--dtopp-target-experts", "8",
           "--lm-z-loss-coeff", "1e-4"]
    arch = [a for a in ARCH if a != "--qk-layernorm"] + ["--num-layers", "2", "--no-rope-fusion"]
    launch(1, tmp_path, byte_data, *moe, arch=arch, routed=[])
    tags = scalars(tmp_path / "tb")
    assert tags["lm loss"][ITERS] < tags["lm loss"][1]
    assert "lm z loss" in tags and "load_balancing_loss" in tags
    thresholds = tags["routing/dtopp_threshold"]
    assert thresholds[ITERS] != thresholds[1]  # the PI controller moved p_t
    assert 1 <= tags["routing/dtopp_active_experts"][ITERS] <= 64
    assert tags["forward flops per token"][ITERS] > 0


def test_muon_table5_and_paper_schedule(byte_data, tmp_path):
    """Table 5's Muon (megatron's emerging-optimizers integration) with 1% warmup and cosine to 10%."""
    launch(1, tmp_path, byte_data, "--xmod-muon-table5", "--xmod-paper-schedule", schedule=[])
    tags = scalars(tmp_path / "tb")
    lr = tags["learning-rate"]
    assert max(lr.values()) == pytest.approx(3.2e-3, rel=0.05)  # Table 5 peak
    assert lr[ITERS] == pytest.approx(3.2e-4, rel=1e-3)  # cosine down to 10% of the peak
    assert tags["lm loss"][ITERS] < tags["lm loss"][1] - 0.5
