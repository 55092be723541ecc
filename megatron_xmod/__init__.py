"""megatron_xmod: sparse-depth routed transformers (X-MoD, MoD) and DTop-p MoE for megatron-core.

Data path, in the order a token meets it: ``layout`` (and ``presets``: which model a name describes)
-> ``routing`` (the rules, plain torch; ``routing_state``: what crosses layers and steps in one built
model) -> ``permute`` -> ``layers`` -> ``block`` -> ``model`` (``spec``: the same layers for a
Megatron-LM ``--spec`` launch) -> ``training/`` (megatron's loop: flags, step, log, patches, hooks).
``accounting`` counts any model; ``moe/`` holds the MoE baselines and the DTop-p router.
"""
__version__ = "0.1.0"
