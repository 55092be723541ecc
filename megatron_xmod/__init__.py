"""megatron_xmod: sparse-depth routed transformers (X-MoD, MoD) and DTop-p MoE for megatron-core.

Data path, one module each: layout -> routing -> permute -> layers -> block -> model -> train -> export.
"""
__version__ = "0.1.0"
