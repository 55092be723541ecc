"""Hugging Face side of megatron_xmod models: configuration, modeling (generation with a sparse KV
cache), and the megatron <-> HF state-dict adapter (see docs/hf.md).

Importing this package registers :class:`XModHFConfig` / :class:`XModForCausalLM` with transformers'
``AutoConfig`` / ``AutoModelForCausalLM``, so an exported folder loads without
``trust_remote_code`` where megatron_xmod is installed; elsewhere the folder's own copies of these
files load it with ``trust_remote_code=True``. Nothing here imports megatron.
"""
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_xmod.hf.cache import XModCache, dense_cache_bytes
from megatron_xmod.hf.configuration_xmod import XModHFConfig
from megatron_xmod.hf.modeling_xmod import XModForCausalLM

AutoConfig.register(XModHFConfig.model_type, XModHFConfig, exist_ok=True)
AutoModelForCausalLM.register(XModHFConfig, XModForCausalLM, exist_ok=True)

__all__ = ["XModHFConfig", "XModForCausalLM", "XModCache", "dense_cache_bytes"]
