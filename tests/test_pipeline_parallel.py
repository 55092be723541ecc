"""Pipeline parallelism with the token-choice bias crossing stage boundaries (CPU/gloo, torchrun).

megatron seeds every pipeline stage differently, so runs with different layouts start from one
checkpoint: a PP1 run saves iteration 1 and stops; PP1, PP2 and PP2 x VPP2 runs load it (megatron's
distributed checkpoint reshards it) and train on; the pipelined runs must reproduce PP1's losses,
training and validation, with pipeline boundaries inside sparse blocks. The tiny model's layout
``D + (S4*2 + D)*2 + D`` has sparse blocks at layers 2-3 and 5-6 (1-based).
"""
import pytest
from entry_point_helpers import common_start, routed_run

pytestmark = pytest.mark.slow

ROUTED = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2 + D",
          "--xmod-token-choice-bias-tau", "0.5", "--xmod-no-topk-validation"]
ITERS = 5


def _run(nproc, data, *extra):
    return routed_run(nproc, data, ROUTED, ITERS, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The common start (PP1 saves iteration 1), and PP1's losses from there."""
    return common_start(tmp_path_factory.mktemp("pipeline"), ROUTED, ITERS)


def _from_common_start(reference, layout, tensor_parallel=1):
    data, checkpoint, _ = reference
    if layout is None:
        pipeline = []
    else:
        pipeline = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", layout]
    if tensor_parallel > 1:
        pipeline += ["--tensor-model-parallel-size", str(tensor_parallel), "--sequence-parallel"]
    nproc = tensor_parallel * (1 if layout is None else 2)
    return _run(nproc, data, "--load", str(checkpoint), *pipeline)


def _assert_same(reference, run):
    (train_ref, valid_ref), (train, valid) = reference[2], run
    assert sorted(train) == list(range(2, ITERS + 1))
    for iteration, loss in train.items():
        assert loss == pytest.approx(train_ref[iteration], rel=1e-5), (iteration, train, train_ref)
    assert valid and valid.keys() == valid_ref.keys()
    for iteration, values in valid.items():
        assert values["lm loss"] == pytest.approx(valid_ref[iteration]["lm loss"], rel=1e-5)


def test_pp2_boundary_inside_sparse_block_matches_pp1(reference):
    # stage 2 starts at layer 3, the second sparse layer of the first block
    _assert_same(reference, _from_common_start(reference, "Et*2|t*6L"))


def test_pp2_vpp2_interleaved_matches_pp1(reference):
    # chunks: [E 1 2] [3] [4 5] [6 7 8 L] on ranks 0 1 0 1: boundaries 2|3 and 5|6 split sparse blocks
    _assert_same(reference, _from_common_start(reference, "Et*2|t|t*2|t*3L"))


def test_tp2_sequence_parallel_pp2_boundary_inside_sparse_block_matches_pp1(reference):
    # 4 processes: each stage's two TP ranks hold half of every sequence; the bias channels crossing
    # the 2|3 boundary are sent as sequence shards and all-gathered by the receiving stage
    _assert_same(reference, _from_common_start(reference, "Et*2|t*6L", tensor_parallel=2))


def test_tp2_sequence_parallel_matches_pp1(reference):
    _assert_same(reference, _from_common_start(reference, None, tensor_parallel=2))
