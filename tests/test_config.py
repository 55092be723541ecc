"""Invalid X-MoD configurations are rejected with a message that names the field."""
import pytest

from megatron_xmod.xmod.config import XModConfig

BASE = dict(num_layers=10, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
            ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
            use_cpu_initialization=True)
GOOD_XMOD = dict(xmod_routing_family="xmod", xmod_sparsity_k=4, xmod_anchor_stride=1, xmod_dense_prefix=2,
                 xmod_activated_depth=4)  # D*2 + (S4*4 + D): 2 + 1 + 4/4 = 4 activated, 7 physical


def make(**fields):
    return XModConfig(**{**BASE, **fields})


def test_valid_configs_resolve_their_layout():
    config = make(**{**GOOD_XMOD, "num_layers": 7})
    assert config.layer_layout.notation == "D*2 + (S4*4 + D)"
    assert make(xmod_routing_family="dense").layer_layout.num_layers == 10
    assert make(num_layers=5, xmod_routing_family="mod", xmod_layout="D + (S4 + D)*2").layer_layout.num_sparse_layers == 2


INVALID = [
    (dict(xmod_routing_family="moe"), "routing_family"),
    (dict(GOOD_XMOD, num_layers=7, xmod_sparsity_k=0), "sparsity_k"),
    (dict(GOOD_XMOD, num_layers=7, xmod_sparsity_k=1), "sparsity_k"),
    (dict(GOOD_XMOD, num_layers=7, xmod_anchor_stride=-1.0), "anchor_stride"),
    (dict(GOOD_XMOD, num_layers=7, xmod_anchor_stride=0.3), "anchor_stride"),  # A*K = 1.2 layers
    (dict(GOOD_XMOD, num_layers=7, xmod_activated_depth=5), "anchor_stride"),  # N1 = 3/2
    (dict(GOOD_XMOD, num_layers=7, xmod_dense_prefix=-1), "dense_prefix"),
    (dict(GOOD_XMOD), "num_layers"),  # 10 != 7 physical layers
    (dict(num_layers=7, xmod_routing_family="xmod", xmod_layout="D*2 + (S4*4 + D"), "layout"),
    (dict(num_layers=7, xmod_routing_family="xmod", xmod_layout="D*2 + (S4*4 + D)", xmod_anchor_stride=2.0), "layout"),
    (dict(num_layers=7, xmod_routing_family="dense", xmod_layout="D*2 + (S4*4 + D)"), "layout"),
    (dict(num_layers=7, xmod_routing_family="xmod", xmod_layout="D*7"), "layout"),
    (dict(GOOD_XMOD, num_layers=7, xmod_router_bce_coeff=-1e-4), "xmod_router_bce_coeff"),
    (dict(GOOD_XMOD, num_layers=7, xmod_token_choice_bias_tau=float("nan")), "xmod_token_choice_bias_tau"),
    (dict(GOOD_XMOD, num_layers=7, xmod_token_choice_bias_increment=-1.0), "xmod_token_choice_bias_increment"),
    (dict(GOOD_XMOD, num_layers=7, xmod_gate_scale_init=0.0), "xmod_gate_scale_init"),
    (dict(GOOD_XMOD, num_layers=7, xmod_eval_routing="sample"), "xmod_eval_routing"),
    (dict(num_layers=5, xmod_routing_family="mod", xmod_sparsity_k=4, xmod_anchor_stride=2.0, xmod_activated_depth=4), "anchor_stride"),
    (dict(GOOD_XMOD, num_layers=7, apply_rope_fusion=True), "apply_rope_fusion"),
]


@pytest.mark.parametrize("fields, field_name", INVALID, ids=[f"{i}-{f}" for i, (_, f) in enumerate(INVALID)])
def test_invalid_config_names_the_field(fields, field_name):
    with pytest.raises(ValueError) as error:
        make(**fields)
    assert field_name in str(error.value), str(error.value)


def test_allowed_values_are_listed():
    with pytest.raises(ValueError, match="dense, mod, xmod"):
        make(xmod_routing_family="moe")
    with pytest.raises(ValueError, match="threshold, topk"):
        make(**GOOD_XMOD, num_layers=7, xmod_eval_routing="sample")


def test_sequence_parallel_full_recompute_and_context_parallel_are_accepted():
    """All three were refused before the routed layers supported them (tests/test_sequence_parallel.py,
    tests/test_recompute.py, tests/test_context_parallel.py)."""
    make(**GOOD_XMOD, num_layers=7, sequence_parallel=True, tensor_model_parallel_size=2)
    make(**GOOD_XMOD, num_layers=7, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    make(**GOOD_XMOD, num_layers=7, context_parallel_size=2)
