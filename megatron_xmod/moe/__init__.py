"""MoE baselines and the DTop-p router for megatron-core (see docs/moe.md).

Submodules are imported on use: ``presets`` and ``accounting`` (``xmod count``) stay free of
megatron imports; ``config``, ``router``, ``model``, ``losses`` and ``args`` need megatron-core.
"""
