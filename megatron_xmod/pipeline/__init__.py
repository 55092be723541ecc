"""Pipeline parallelism for deep sparse-depth models: a per-layer cost model, the cost-balanced
stage layout (``xmod partition``), and the adapter that carries the token-choice bias across
pipeline stages (:mod:`megatron_xmod.pipeline.carry`)."""
