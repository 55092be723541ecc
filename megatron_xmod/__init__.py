"""megatron_xmod: sparse-depth routed transformers (X-MoD, MoD) and DTop-p MoE for megatron-core.

Data path, in the order a token meets it (``tests/test_architecture.py`` holds the imports to it):
``presets`` / ``accounting`` (which model a name describes, and what it costs; no megatron) ->
``xmod/`` (the sparse-depth core: layout, routing rules, routing state, config, layers, block, with
its kernels and permutation) and ``moe/`` (routing in width) -> ``model`` and ``spec`` (megatron
``GPTModel``s; the same layers for a Megatron-LM ``--spec`` launch) -> ``pipeline/`` -> ``data/`` ->
``training/`` (megatron's loop: ``python -m megatron_xmod.pretrain``, its flags, step, log, checks and
numbered patches) -> ``hf/`` (export) -> ``diagnostics/``, ``scaling/``, ``demo`` -> ``cli/`` (the
``xmod`` command). ``cpu_shim`` runs megatron on a machine without a GPU.
"""
__version__ = "0.1.0"
