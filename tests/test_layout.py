"""The layout notation expresses Eq.(3) (incl. fractional A), Eq.(34), Eq.(35), Eq.(36) of the X-MoD
paper, "X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths"."""
import pytest

from megatron_xmod.xmod.layout import LayoutError, layout_from_model_name, parse_layout, resolve_layout


@pytest.mark.parametrize(
    "name, physical, sparse",
    [("dense", 28, 0), ("mod", 49, 24), ("xmod-a4k8", 161, 152), ("xmod-a3k16", 298, 288)],
)
def test_paper_layouts_have_the_papers_depths(name, physical, sparse):
    layout = layout_from_model_name(name)
    assert layout.num_layers == physical  # the paper's 28, 49, 161, 298 physical layers
    assert layout.num_sparse_layers == sparse
    assert layout.activated_depth == 28


def test_eq35_structure_blocks_and_anchors():
    layout = parse_layout("D*4 + (S8*24 + D) + (S8*32 + D)*4")
    kinds = layout.kinds()
    assert kinds[:4] == ["dense"] * 4
    assert kinds[4:28] == ["sparse"] * 24 and kinds[28] == "anchor"
    assert kinds[29:61] == ["sparse"] * 32 and kinds[61] == "anchor"
    assert kinds.count("anchor") == 5
    blocks = sorted({layer.block for layer in layout.layers if layer.is_sparse})
    assert blocks == [0, 1, 2, 3, 4]
    # every anchor closes the block of the sparse layers before it
    for i, layer in enumerate(layout.layers):
        if layer.kind == "anchor":
            assert layout.layers[i - 1].is_sparse and layout.layers[i - 1].block == layer.block


def test_eq34_mod_alternates_sparse_and_dense():
    layout = layout_from_model_name("mod")
    assert layout.notation == "D + (S8 + D)*24"
    kinds = layout.kinds()
    assert kinds[0] == "dense" and kinds[1::2] == ["sparse"] * 24 and kinds[2::2] == ["anchor"] * 24
    assert resolve_layout("mod", sparsity_k=8, activated_depth=28).notation == layout.notation


def test_generic_eq3_with_fractional_anchor_stride():
    layout = resolve_layout("xmod", sparsity_k=8, anchor_stride=0.5, dense_prefix=4, activated_depth=28)
    assert layout.notation == "D*4 + (S8*4 + D)*16"  # A*K = 4 sparse layers, N1 = 24/1.5 = 16
    assert layout.activated_depth == 28
    assert layout.num_layers == 4 + 16 * 5
    # Eq.(36) is the generic form with A=3, K=16, N0=4
    assert resolve_layout("xmod", sparsity_k=16, anchor_stride=3, dense_prefix=4,
                          activated_depth=28).notation == "D*4 + (S16*48 + D)*6"


def test_eq35_is_not_generic_and_says_why():
    with pytest.raises(LayoutError, match="anchor_stride: N1"):
        resolve_layout("xmod", sparsity_k=8, anchor_stride=4, dense_prefix=4, activated_depth=28)


@pytest.mark.parametrize("bad, field", [
    ("", "empty"), ("D*4 + ", "expected"), ("X*4", "unexpected"), ("S1*4", "K >= 2"),
    ("(S8 + D", "expected ')'"), ("D*0", "repeat count"), ("D D", "trailing"),
])
def test_bad_notation_is_rejected_with_a_reason(bad, field):
    with pytest.raises(LayoutError, match="layout") as error:
        parse_layout(bad)
    assert field in str(error.value)
