"""``xmod export-hf``: a megatron ``torch_dist`` checkpoint (any TP/PP/DP layout) -> a Hugging Face
model folder, on one CPU process.

    xmod export-hf --load runs/x/ckpt --output hf/x [--iteration N] [--dtype bf16|fp16|fp32] [--hf-tokenizer PATH]
    xmod add-tokenizer hf/x --hf-tokenizer PATH       # a tokenizer for a weights-only export

Writes ``config.json`` (``model_type`` "megatron_xmod" and the ``auto_map`` that lets
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` load it with transformers
alone), the weights as safetensors (sharded above ``--max-shard-size`` with
``model.safetensors.index.json``), ``generation_config.json``, the tokenizer (the run's, or the
user's own ``--hf-tokenizer``; none for pre-tokenized data without one:
:mod:`megatron_xmod.hf.tokenizer_export`), the modeling files copied verbatim
(``state_dict_adapter.EXPORTED_FILES``) and ``megatron_xmod_export.json`` (the source checkpoint,
its iteration and the megatron arguments it was trained with, which ``xmod import-hf`` reads back).
Every file gets the permissions of a file created under the process's umask (safetensors alone
would write its files 0600).

The model description comes from the checkpoint's own saved ``args``; the weights from megatron's
dist-checkpointing (:mod:`megatron_xmod.hf.checkpoint_io`); the mapping from the adapter beside the
HF model (:mod:`megatron_xmod.hf.state_dict_adapter`). A setting the HF model cannot reproduce is an
error naming the field, raised before any tensor is read.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EXPORT_INFO = "megatron_xmod_export.json"
# Router state that decides routing by comparison with a threshold: kept in fp32 whatever --dtype says.
FP32_SUFFIXES = ("mlp.router.dtopp_threshold", "mlp.router.dtopp_integral", "mlp.router.expert_bias")


@dataclasses.dataclass
class ExportResult:
    output: Path
    iteration: int
    num_parameters: int
    dtype: str
    weight_files: list[str]
    hf_config: object
    tokenizer: str = ""  # what was written for the tokenizer (or that none was), one line

    def summary(self) -> str:
        return (f"exported iteration {self.iteration}: {self.num_parameters:,} parameters ({self.dtype}) in "
                f"{len(self.weight_files)} safetensors file(s) to {self.output}")


# ---------------------------------------------------------------------------------------- args as JSON
def args_to_json(args) -> dict:
    """megatron's args namespace as JSON (dtypes and enums tagged, so :func:`args_from_json` restores them)."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if isinstance(value, torch.dtype):
            out[key] = {"__dtype__": str(value).removeprefix("torch.")}
        elif isinstance(value, enum.Enum):
            out[key] = {"__enum__": f"{type(value).__module__}:{type(value).__qualname__}", "name": value.name}
        else:
            try:
                json.dumps(value)
            except TypeError:
                continue  # callables and the like: not part of the model description
            out[key] = value
    return out


def args_from_json(data: dict):
    import argparse

    def decode(value):
        if isinstance(value, dict) and "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if isinstance(value, dict) and "__enum__" in value:
            module, name = value["__enum__"].split(":")
            return getattr(importlib.import_module(module), name)[value["name"]]
        return value

    return argparse.Namespace(**{k: decode(v) for k, v in data.items()})


# ---------------------------------------------------------------------------------------------- export
def export_checkpoint(load, output, iteration: Optional[int] = None, dtype: Optional[str] = None,
                      max_shard_size: str | int = "2GB", tokenizer_model=None, progress: bool = True,
                      hf_tokenizer=None, verify: bool = True) -> ExportResult:
    """Export the checkpoint under ``load`` (latest iteration unless ``iteration``) into ``output``;
    ``hf_tokenizer``: a tokenizer of the user's own instead of the run's (checked against the
    checkpoint's vocabulary). The checkpoint is verified against its checksum manifest first (unless
    ``verify`` is False) and against its run identity record."""
    from transformers import GenerationConfig

    from megatron_xmod.cpu_shim import cpu_patches
    from megatron_xmod.hf import checkpoint_io
    from megatron_xmod.hf.checkpoint_io import checkpoint_path, load_checkpoint, read_common, single_process_args
    from megatron_xmod.hf.state_dict_adapter import AUTO_MAP, EXPORTED_FILES, hf_config_from_args, megatron_to_hf
    from megatron_xmod.hf.tokenizer_export import resolve_tokenizer
    from megatron_xmod.training.run_identity import check_export, identity_of, saved_identity

    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output: {output} exists and is not empty; choose a new folder")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    # Everything that can refuse the export does so before the tensors are read.
    path, _ = checkpoint_path(load, iteration)
    if verify:
        checkpoint_io.verify_checkpoint(path)
    with cpu_patches(training=False):
        args = read_common(path)["args"]
        hf_config = hf_config_from_args(single_process_args(args))
    check_export(path, args, tokenizer_model if hf_tokenizer is None else None)
    resolved = resolve_tokenizer(args, output, tokenizer_model, hf_tokenizer)
    tokenizer = resolved.tokenizer
    if dtype is None:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(getattr(args, "params_dtype", None), "fp32")

    bar = _progress(progress, total=3, desc="export-hf")
    checkpoint = load_checkpoint(load, iteration)
    bar.update(1)
    bar.set_postfix_str("mapping")
    hf_state = megatron_to_hf(checkpoint.state_dict, hf_config)
    hf_state = {k: v.to(torch.float32 if k.endswith(FP32_SUFFIXES) else DTYPES[dtype]).contiguous()
                for k, v in hf_state.items()}
    bar.update(1)
    bar.set_postfix_str("writing")
    output.mkdir(parents=True, exist_ok=True)
    weight_files = write_safetensors(hf_state, output, max_shard_size, progress)
    hf_config.auto_map = dict(AUTO_MAP)
    hf_config.architectures = [AUTO_MAP["AutoModelForCausalLM"].split(".")[-1]]
    hf_config.dtype = str(DTYPES[dtype]).removeprefix("torch.")
    hf_config.save_pretrained(str(output))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(output))
    generation_config(GenerationConfig(), tokenizer).save_pretrained(str(output))
    for name, source in EXPORTED_FILES.items():
        shutil.copyfile(source, output / name)
    identity = saved_identity(path, args)[0] or identity_of(args, with_tokenizer_hash=False)
    info = {"source": str(checkpoint.path.resolve()), "iteration": checkpoint.iteration, "dtype": dtype,
            "megatron_args": args_to_json(checkpoint.args), "run_identity": identity}
    (output / EXPORT_INFO).write_text(json.dumps(info, indent=1, sort_keys=True))
    umask_permissions(output)
    bar.update(1)
    bar.close()
    params = sum(v.numel() for k, v in hf_state.items() if not k.endswith(FP32_SUFFIXES))
    return ExportResult(output=output, iteration=checkpoint.iteration, num_parameters=params, dtype=dtype,
                        weight_files=weight_files, hf_config=hf_config, tokenizer=resolved.description)


def generation_config(config, tokenizer):
    """``config`` (a GenerationConfig) with the tokenizer's end of document as eos and pad (and bos
    when it has none); unchanged without a tokenizer."""
    if tokenizer is None:
        return config
    eos = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    config.eos_token_id = config.pad_token_id = eos
    return config


def add_tokenizer(folder, hf_tokenizer) -> str:
    """Write the user's tokenizer ``hf_tokenizer`` into ``folder``, a weights-only export (``xmod
    add-tokenizer``): checked against the vocabulary the export recorded; returns one line."""
    from transformers import GenerationConfig

    from megatron_xmod.hf.tokenizer_export import check_vocabulary, load_user_tokenizer

    folder = Path(folder)
    info = read_export_info(folder)
    if info is None:
        raise ValueError(f"folder: {folder} has no {EXPORT_INFO}; fix: give a folder written by xmod export-hf")
    present = [name for name in ("tokenizer.json", "tokenizer_config.json") if (folder / name).is_file()]
    if present:
        raise ValueError(f"folder: {folder} already has a tokenizer ({present[0]}); fix: export again into a new "
                         "folder with --hf-tokenizer PATH")
    tokenizer = load_user_tokenizer(hf_tokenizer)
    check_vocabulary(tokenizer, args_from_json(info["megatron_args"]), hf_tokenizer)
    tokenizer.save_pretrained(str(folder))
    try:
        config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        config = GenerationConfig()
    generation_config(config, tokenizer).save_pretrained(str(folder))
    umask_permissions(folder)
    return f"tokenizer: {hf_tokenizer}, {len(tokenizer)} tokens, written to {folder}"


def umask_permissions(folder: Path) -> None:
    """Every file directly in ``folder`` readable as the umask allows (0644 under umask 022), as
    ``open()`` creates files: safetensors writes its files 0600."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~mask)


def write_safetensors(state: dict, output: Path, max_shard_size: str | int, progress: bool = True) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    above ``max_shard_size`` (transformers' own naming, via huggingface_hub's splitter)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    files = sorted(split.filename_to_tensors)
    for name in _progress(progress, iterable=files, desc="safetensors", leave=False):
        save_file({k: state[k] for k in split.filename_to_tensors[name]}, str(output / name), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def _progress(enabled: bool, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(disable=not enabled, **kwargs)


def read_export_info(folder) -> Optional[dict]:
    path = Path(folder) / EXPORT_INFO
    return json.loads(path.read_text()) if path.is_file() else None


# ------------------------------------------------------------------------------------------------ demo
def demo_export(checkpoint_dir, output_dir, prompt: str, max_new_tokens: int = 80, seed: int = 0) -> str:
    """Export ``checkpoint_dir`` to ``output_dir``, generate from ``prompt`` with the HF model and its
    sparse KV cache, and return printable lines (what ``xmod demo`` ends with)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import megatron_xmod.hf  # noqa: F401  (registers the classes with the Auto* factories)
    from megatron_xmod.hf.cache import XModCache, dense_cache_bytes

    if (Path(output_dir) / EXPORT_INFO).is_file():  # a previous demo's export: replace it
        shutil.rmtree(output_dir)
    result = export_checkpoint(checkpoint_dir, output_dir, dtype="fp32", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    model = AutoModelForCausalLM.from_pretrained(str(output_dir), dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40,
                             pad_token_id=tokenizer.eos_token_id)
        cache = XModCache(model.config)  # what generation holds after the last token: one pass gives the same
        model(out, cache=cache, use_cache=True)
    sparse_bytes = cache.nbytes(valid_only=True)["total"]
    dense_bytes = dense_cache_bytes(model.config, out.shape[1])
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    lines = [f"[hf] {result.summary()}",
             f"[hf] load it anywhere: AutoModelForCausalLM.from_pretrained({str(output_dir)!r}, trust_remote_code=True)",
             f"[hf] generated from {prompt!r} (sampling, temperature 0.8, top-k 40):", "",
             *("    " + line for line in text.splitlines() if line.strip()), "",
             f"[hf] KV cache after {out.shape[1]} tokens: {sparse_bytes / 1024:.1f} KiB with the sparse cache vs "
             f"{dense_bytes / 1024:.1f} KiB dense ({sparse_bytes / dense_bytes:.0%}): sparse layers keep only the "
             "tokens they routed"]
    return "\n".join(lines)
