"""The routing rules (Eq.8, Eq.9, top-k in training, causal threshold in evaluation)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_xmod.xmod.routing import (
    capacity_selection,
    eval_capacity,
    jaccard_tensor,
    route,
    router_bce_loss,
    select_topk,
    topk_count,
    update_token_choice_bias,
)


def test_topk_selects_exactly_l_over_k_in_position_order():
    torch.manual_seed(0)
    scores = torch.randn(64, 3)
    for k in (2, 4, 8, 64):
        indices = select_topk(scores, k)
        assert indices.shape == (64 // k, 3)
        assert torch.all(indices[1:] > indices[:-1])  # sorted, unique: causal order kept
        for column in range(3):  # they are the top scores of that sequence
            chosen = set(indices[:, column].tolist())
            expected = set(torch.argsort(scores[:, column], descending=True)[: 64 // k].tolist())
            assert chosen == expected


def test_topk_needs_whole_capacity():
    with pytest.raises(ValueError, match="seq_length"):
        topk_count(10, 4)
    with pytest.raises(ValueError, match="seq_length: .*segments x sparsity K = 16 x 8.*--xmod-routing-segments"):
        topk_count(64, 8, segments=16)  # 4 tokens a segment cannot route 1/8 of them
    assert topk_count(64, 8, segments=8) == 8


@pytest.mark.parametrize("segments", [1, 2, 4, 8])
def test_segment_topk_routes_l_over_sk_of_each_segment(segments):
    """--xmod-routing-segments S: the top L/(S K) of each of S equal segments, sorted by position, against
    an independent per-segment argsort; k = L/K a sequence whatever S."""
    torch.manual_seed(0)
    scores = torch.randn(64, 3)
    indices = select_topk(scores, 4, segments)
    assert indices.shape == (16, 3) and torch.all(indices[1:] > indices[:-1])
    span = 64 // segments
    for column in range(3):
        expected = set()
        for start in range(0, 64, span):
            top = torch.argsort(scores[start:start + span, column], descending=True)[: span // 4]
            expected |= {start + i for i in top.tolist()}
        assert set(indices[:, column].tolist()) == expected
    if segments > 1:  # the constraint bites: the sequence's own top 16 lie unevenly over the segments
        assert not torch.equal(indices, select_topk(scores, 4))
    decision = route(scores, 4, "topk", segments=segments)
    assert torch.equal(decision.topk_indices, indices)
    assert torch.equal(route(scores, 4, "threshold", segments=segments).selected, scores >= 0)  # per token


def test_routing_segments_validated_by_field_name():
    from megatron_xmod.xmod.routing import SparseLayerRouting

    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="xmod_routing_segments: .*integer >= 1"):
            SparseLayerRouting(family="xmod", sparsity_k=4, routing_segments=bad)


def test_context_parallel_width_is_k_over_c_only_for_aligned_segments():
    """The static routed batch of a CP rank (routing.context_parallel_width): any number up to min(k, L/C)
    of a sequence's tokens under whole-sequence top-k; exactly k/C when 2C divides S."""
    from megatron_xmod.xmod.layers import load_balanced_positions
    from megatron_xmod.xmod.routing import context_parallel_width

    assert context_parallel_width(256, 1024, 2) == 256 and context_parallel_width(256, 1024, 8) == 128
    assert context_parallel_width(256, 1024, 4, segments=8) == 64
    assert context_parallel_width(256, 1024, 4, segments=16) == 64
    assert context_parallel_width(256, 1024, 4, segments=4) == 256  # a CP chunk holds half a segment: no bound
    # what it claims, counted: every rank's load-balanced chunks hold exactly k/C routed tokens
    torch.manual_seed(1)
    selected = torch.zeros(1024, 5, dtype=torch.bool).scatter_(0, select_topk(torch.randn(1024, 5), 4, 8), True)
    held = selected[load_balanced_positions(1024, 4)].sum(1)  # [C, b]
    assert torch.all(held == 64)


def test_threshold_is_sigmoid_half_of_bias_adjusted_score():
    logits = torch.tensor([[2.0], [0.4], [-0.1], [0.0]])
    bias = torch.tensor([[1.0], [1.0], [0.0], [0.0]])
    decision = route(logits, 4, "threshold", bias, tau=0.5)
    expected = torch.sigmoid(logits - 0.5 * bias) >= 0.5
    assert torch.equal(decision.selected, expected)
    assert decision.selected[:, 0].tolist() == [True, False, False, True]


def test_token_choice_bias_accumulates_and_lowers_scores():
    selected = torch.tensor([[True], [False], [True]])
    bias = update_token_choice_bias(None, selected, increment=1.0)
    bias = update_token_choice_bias(bias, torch.tensor([[True], [True], [False]]), increment=1.0)
    assert bias[:, 0].tolist() == [2.0, 1.0, 1.0]
    logits = torch.zeros(3, 1)
    assert torch.equal(route(logits, 3, "topk", bias, tau=0.5).scores, -0.5 * bias)


def test_bce_matches_eq9_by_hand():
    scores = torch.tensor([[1.5, -0.3], [0.2, 2.0]])
    selected = torch.tensor([[True, False], [False, True]])
    p = torch.sigmoid(scores)
    q = selected.float()
    by_hand = -(q * torch.log(p) + (1 - q) * torch.log(1 - p)).mean()
    assert torch.allclose(router_bce_loss(scores, selected), by_hand)
    assert torch.allclose(router_bce_loss(scores, selected), F.binary_cross_entropy(p, q))


def test_jaccard():
    a = torch.tensor([True, True, False, False])
    b = torch.tensor([True, False, True, False])
    assert jaccard_tensor(a, b).item() == pytest.approx(1 / 3)
    assert jaccard_tensor(a & False, b & False).item() == 1.0


def test_capacity_selection_lists_real_tokens_first_then_padding():
    """Each column: its selected positions ascending, then its earliest unselected ones (valid False);
    at a capacity below a column's selection that column keeps its earliest C and the width says so."""
    selected = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    indices, valid, width = capacity_selection(selected)  # exact: the host reads the width
    assert width == 3 and indices.shape == (3, 3)
    assert indices[:, 0].tolist() == [1, 3, 0] and valid[:, 0].tolist() == [True, True, False]
    assert indices[:, 1].tolist() == [0, 2, 3] and valid[:, 1].all()
    assert indices[:, 2].tolist() == [0, 1, 2] and not valid[:, 2].any()
    for j in range(3):  # unique per column, and the real tokens are exactly the selected ones
        assert len(set(indices[:, j].tolist())) == 3
        assert sorted(indices[valid[:, j], j].tolist()) == selected[:, j].nonzero().flatten().tolist()
    indices, valid, width = capacity_selection(selected, capacity=4)  # static: no host read
    assert torch.is_tensor(width) and int(width) == 3 and indices.shape == (4, 3)
    assert indices[:, 0].tolist() == [1, 3, 0, 2] and valid.sum(0).tolist() == [2, 3, 0]
    indices, valid, width = capacity_selection(selected, capacity=2)  # overflow: width > capacity
    assert int(width) == 3 and indices[:, 1].tolist() == [0, 2] and valid[:, 1].all()
    assert capacity_selection(torch.zeros(4, 2, dtype=torch.bool)) == (None, None, 0)


def test_eval_capacity_rounds_up_to_eight_within_the_sequence():
    assert eval_capacity(2048, 2048 / 8) == 256
    assert eval_capacity(2048, 257.5) == 264
    assert eval_capacity(20, 0.2) == 8 and eval_capacity(5, 3) == 5 and eval_capacity(64, 0) == 1
