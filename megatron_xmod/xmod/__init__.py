"""The sparse-depth core: how a token is routed through depth (X-MoD and MoD), in data-path order.

- ``layout``: the notation of every depth structure (which layer is dense, which routed, its K, its block);
- ``routing``: the rules in plain torch (top-k, threshold, the token-choice bias of Eq.8, the router BCE of
  Eq.9, the gated residual update of Eq.6 / Eq.7); reused by the HF model, the diagnostics and the tests;
- ``routing_state``: what crosses layers and steps in one built model chunk (the bias hand-over, the
  router-input chain, the recompute replay, the interval statistics);
- ``kernels/``, ``permute/``: the fused routing step and the token gather / gated scatter (Triton, CUDA
  C++, torch reference);
- ``config``: ``XModConfig``, megatron's ``TransformerConfig`` plus the routing fields;
- ``layers``: ``XModSparseLayer``, a megatron ``TransformerLayer`` run on the routed subsequence (and the
  local path's SDPA core attention);
- ``block``: the decoder block spec, sliced per pipeline stage;
- ``compile``: ``--xmod-compile-layers``, each built layer's compute wired to one compiled region.

``moe/`` is its sibling for routing in width (MoE baselines, the DTop-p router).
"""
