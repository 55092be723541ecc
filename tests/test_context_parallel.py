"""Context parallelism through routed layers (CPU/gloo, torchrun).

Unit level (worker: tests/dist_worker_cp.py): the same weights and batches at CP1 and CP2 through
megatron's DistributedDataParallel; the per-token losses of the first step, its gradients, the router
BCE, every sparse layer's routed set at every step (top-k and the threshold rule), the routing
statistics, the losses of 4 SGD steps and the evaluation loss agree; a CP2 training step makes no host sync. The layout's S32 layer
routes one token a sequence, so one CP rank holds none of a sequence's routed tokens in every layer call.
X-MoD also under megatron's full recompute (the token-choice bias replayed, the CP collectives run again).

Entry point: CP2 reproduces CP1's training and validation losses (threshold and top-k rules) from a
common checkpoint, with dense, S4 and S64 (one routed token a sequence) layers; and CP2 x TP2 with
sequence parallelism, and CP2 x PP2 with a stage boundary inside a sparse block; with --reset-attention-mask,
CP2 reproduces CP1 for a dense and a routed model. Segment-local top-k (--xmod-routing-segments 2C) gives
every CP rank a routed batch of exactly k/C tokens (unit level).
"""
import os
import subprocess
import sys

import pytest
import torch
from entry_point_helpers import (
    common_flags,
    common_start,
    free_port,
    routed_run,
    tagged_json,
    torchrun,
    train_losses,
    validation_losses,
    write_byte_data,
)

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker_cp.py")
STEPS = 4


def _worker(family, *options):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               WORKER, family, str(STEPS), *options]
    root = os.path.dirname(os.path.dirname(WORKER))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.path.dirname(WORKER)]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return tagged_json(result.stdout, "RESULT")


@pytest.mark.parametrize("family, options", [("xmod", []), ("mod", []), ("xmod", ["full-recompute"]),
                                             ("xmod", ["segments"])],
                         ids=["xmod", "mod", "xmod-full-recompute", "xmod-segments"])
def test_routed_layers_under_cp2_match_cp1(family, options):
    result = _worker(family, *options)
    cp1, cp2 = result["cp1"], result["cp2"]
    torch.testing.assert_close(torch.tensor(cp2["first_step_tokens"]), torch.tensor(cp1["first_step_tokens"]),
                               rtol=1e-5, atol=1e-6)
    assert result["grad_rel_diff"] < 1e-4, result["grad_rel_diff"]
    assert cp2["first_step_router_bce"] == pytest.approx(cp1["first_step_router_bce"], rel=1e-6)
    calls = STEPS * (2 if options == ["full-recompute"] else 1) + 1  # a recomputed layer routes again in its replay; + evaluation
    assert cp2["routed"] == cp1["routed"] and len(cp1["routed"]) == 3 * calls
    for name in ("statistics", "eval_statistics"):
        assert cp2[name].keys() == cp1[name].keys() and "coverage" in cp1["statistics"], (cp1[name], cp2[name])
        assert cp2[name] == pytest.approx(cp1[name], rel=1e-5, abs=1e-7)
    assert "eval_coverage" in cp1["eval_statistics"] and "adjacent_jaccard" in cp1["statistics"]
    assert cp2["losses"] == pytest.approx(cp1["losses"], rel=1e-5)
    assert cp2["eval_loss"] == pytest.approx(cp1["eval_loss"], rel=1e-5)
    assert cp2["syncs"] == [], cp2["syncs"]
    if options == ["segments"]:
        # 4 segments = 2 x CP: each rank's routed batch is exactly its k/2 tokens (S4: k = 8, S8: k = 4), no padding
        assert cp2["cp_batches"] == [[4, 4, True], [8, 2, True]], cp2["cp_batches"]


# --- the entry point -----------------------------------------------------------------------------
# S64 at L = 64: one routed token a sequence, so in every call one CP rank holds none of it.
ROUTED = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4 + S64 + D)*2 + D",
          "--xmod-token-choice-bias-tau", "0.5"]
ITERS = 5


def _run(nproc, data, *extra):
    return routed_run(nproc, data, ROUTED, ITERS, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The common start (CP1 saves iteration 1), and CP1's losses from there."""
    return common_start(tmp_path_factory.mktemp("context_parallel"), ROUTED, ITERS)


def _assert_same(reference, nproc, *flags):
    data, checkpoint, (train_ref, valid_ref) = reference
    train, valid = _run(nproc, data, "--load", str(checkpoint), *flags)
    assert sorted(train) == list(range(2, ITERS + 1))
    for iteration, loss in train.items():
        assert loss == pytest.approx(train_ref[iteration], rel=1e-5), (iteration, train, train_ref)
    assert valid and valid.keys() == valid_ref.keys()
    for iteration, values in valid.items():
        for name in values:  # lm loss (threshold rule) and, without pipelining, lm loss topk routing
            assert values[name] == pytest.approx(valid_ref[iteration][name], rel=1e-5), (name, valid, valid_ref)


def test_cp2_matches_cp1_through_the_entry_point(reference):
    _assert_same(reference, 2, "--context-parallel-size", "2")


def test_cp2_tp2_sequence_parallel_matches_cp1(reference):
    _assert_same(reference, 4, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel")


def test_cp2_pp2_boundary_inside_sparse_block_matches_cp1(reference):
    # stage 2 starts at layer 3, the second sparse layer of the first block (the top-k comparison pass of
    # validation runs without pipelining only: training/step.py)
    _assert_same(reference, 4, "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--pipeline-model-parallel-layout", "Et*2|t*6L")


def test_routing_segments_cp2_tp2_sequence_parallel_match_cp1(tmp_path):
    """--xmod-routing-segments 4 (2 x CP) through the entry point: CP2 x TP2 + SP reproduces CP1 (same S).
    That each CP rank's routed batch is then exactly its k/2 tokens is checked at unit level
    (test_routed_layers_under_cp2_match_cp1[xmod-segments])."""
    routed = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4 + S16 + D)*2 + D",
              "--xmod-token-choice-bias-tau", "0.5", "--xmod-routing-segments", "4"]
    data, checkpoint, (train_ref, valid_ref) = common_start(tmp_path, routed, ITERS)
    train, valid = routed_run(4, data, routed, ITERS, "--load", str(checkpoint), "--context-parallel-size", "2",
                              "--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert sorted(train) == list(range(2, ITERS + 1)) and valid.keys() == valid_ref.keys()
    assert train == pytest.approx({i: train_ref[i] for i in train}, rel=1e-5)
    for iteration, values in valid.items():
        assert values == pytest.approx(valid_ref[iteration], rel=1e-5), (valid, valid_ref)


# S64 routes one token a sequence (one CP rank holds none of it); S4 sixteen, across document boundaries
DOCUMENT_MODELS = {"dense": ["--num-layers", "2"],
                   "routed": ["--num-layers", "4", "--xmod-routing-family", "xmod", "--xmod-layout", "D + S4 + S64 + D"]}


@pytest.mark.parametrize("model", sorted(DOCUMENT_MODELS))
def test_document_masks_under_cp2_match_cp1(tmp_path, model):
    """--reset-attention-mask: megatron's per-document mask, split over the CP ranks by query rows, with
    its key columns put into the SDPA core attention's gathered order (training/step.py); routed layers
    read it at their routed queries and every rank's routed keys (layers._context_parallel_document_mask).
    The 400-byte documents of the byte corpus make most 64-token sequences cross a document boundary."""
    data = write_byte_data(str(tmp_path / "bytes"))
    flags = [flag for flag in common_flags(data, 3, *DOCUMENT_MODELS[model], "--eval-interval", "3",
                                           "--reset-attention-mask")
             if flag != "--no-create-attention-mask-in-dataloader"]
    runs = []
    for nproc, extra in ((1, []), (2, ["--context-parallel-size", "2"])):
        result = torchrun(nproc, ["-m", "megatron_xmod.pretrain"], [*flags, *extra])
        runs.append((train_losses(result.stdout), validation_losses(result.stdout)))
    (train_ref, valid_ref), (train, valid) = runs
    assert sorted(train) == [1, 2, 3] and valid.keys() == valid_ref.keys() == {3}
    assert train == pytest.approx(train_ref, rel=1e-5)
    assert valid[3]["lm loss"] == pytest.approx(valid_ref[3]["lm loss"], rel=1e-5)
