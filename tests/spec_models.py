"""``--spec`` objects for the tests' tiny launches: ``--spec spec_models tiny`` (tests/ on the path).

The layout and routing settings are those of tests/test_pretrain.py's ``ROUTED`` flags, so the same
model trains through Megatron-LM's own ``pretrain_gpt.py`` and through ``megatron_xmod.pretrain``.
"""
from megatron_xmod.spec import layout_spec

LAYOUT = "D + (S4*2 + D)*2 + D"  # 8 layers, anchors at 4 and 7
tiny = layout_spec(LAYOUT)  # the --xmod-* defaults: tau 0.5, increment 1, router BCE 1e-4
tiny_strong_bce = layout_spec(LAYOUT, router_bce_coeff=0.5)
