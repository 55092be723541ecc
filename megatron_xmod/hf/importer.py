"""``xmod import-hf``: a Hugging Face folder written by ``xmod export-hf`` -> a megatron ``torch_dist``
checkpoint to continue pre-training from.

    xmod import-hf hf/x --save runs/x2/ckpt [--tensor-model-parallel-size T --pipeline-model-parallel-size P]
    torchrun --nproc_per_node=T*P -m megatron_xmod.pretrain ... --load runs/x2/ckpt --save runs/x2/ckpt \
        --tensor-model-parallel-size T --pipeline-model-parallel-size P

The weights go back through the adapter's exact inverse (``hf_to_megatron``), so export -> import
gives the original tensors bit for bit (in the exported dtype). The model description is the
megatron args the export recorded (``megatron_xmod_export.json``); the HF ``config.json`` must
still describe the same model (checked). The checkpoint is a megatron *release* checkpoint:
``--load`` starts at iteration 0 with a fresh optimizer and LR schedule, at any TP/PP, since
``torch_dist`` reshards on load; T and P are recorded in its args as the intended layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards an index names."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"folder: {folder} has no model.safetensors(.index.json); export it with xmod export-hf")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def import_folder(folder, save, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                  overwrite: bool = False) -> Path:
    """Write the megatron checkpoint of the HF ``folder`` under ``save``; returns its release folder. A
    ``save`` that already holds a run is refused unless ``overwrite``."""
    from megatron_xmod.cpu_shim import cpu_patches
    from megatron_xmod.hf.checkpoint_io import save_checkpoint, single_process_args
    from megatron_xmod.hf.configuration_xmod import XModHFConfig
    from megatron_xmod.hf.export import args_from_json, read_export_info
    from megatron_xmod.hf.state_dict_adapter import hf_config_from_args, hf_to_megatron

    folder = Path(folder)
    for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("pipeline_model_parallel_size", pipeline_model_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    if not (folder / "config.json").is_file():
        raise ValueError(f"folder: {folder} has no config.json; give a folder written by xmod export-hf")
    info = read_export_info(folder)
    if info is None:
        raise ValueError(f"folder: {folder} has no megatron_xmod_export.json (the megatron arguments of the run); "
                         "import-hf reads folders written by xmod export-hf")
    hf_config = XModHFConfig.from_pretrained(str(folder))
    args = args_from_json(info["megatron_args"])
    with cpu_patches(training=False):
        described = hf_config_from_args(single_process_args(args))
    _check_same_model(hf_config, described)
    if args.num_layers % pipeline_model_parallel_size:
        raise ValueError(f"pipeline_model_parallel_size: {pipeline_model_parallel_size} does not divide the "
                         f"{args.num_layers} layers")
    for name in ("num_attention_heads", "num_query_groups"):
        value = getattr(args, name, None) or args.num_attention_heads
        if value % tensor_model_parallel_size:
            raise ValueError(f"tensor_model_parallel_size: {tensor_model_parallel_size} does not divide {name}={value}")
    from megatron_xmod.hf.checkpoint_io import existing_run

    held = existing_run(Path(save))
    if held and not overwrite:  # before the weights are read (save_checkpoint says it again, with the model)
        save_checkpoint({}, args, save, overwrite=False)
    weights = read_hf_weights(folder)
    check_hf_shapes(weights, hf_config, folder)
    state = hf_to_megatron(weights, hf_config)
    # The checkpoint holds the exported dtype's values in the run's parameter dtype.
    dtype = args.params_dtype
    state = {k: (v if k.endswith(("dtopp_threshold", "dtopp_integral", "expert_bias")) else v.to(dtype))
             for k, v in state.items()}
    return save_checkpoint(state, args, save, tensor_model_parallel_size, pipeline_model_parallel_size,
                           overwrite=overwrite, identity=info.get("run_identity"), where=f"{folder}'s weights")


def check_hf_shapes(weights: dict, hf_config, folder: Path) -> None:
    """Every tensor of the folder's safetensors in the shape the HF model of its config.json has (named
    with both shapes; torch's ``size mismatch`` traceback otherwise)."""
    from megatron_xmod.hf.checkpoint_io import check_shapes
    from megatron_xmod.hf.modeling_xmod import XModForCausalLM

    with torch.device("meta"):
        model = XModForCausalLM(hf_config)
    check_shapes(model.state_dict(), weights, f"{folder}'s safetensors")


def _check_same_model(hf_config, described) -> None:
    """config.json and the recorded megatron args must describe the same model."""
    ignore = {"architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
              "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "routing_rule"}
    have, want = hf_config.to_dict(), described.to_dict()
    differ = sorted(k for k in set(have) | set(want) if k not in ignore and have.get(k) != want.get(k))
    if differ:
        key = differ[0]
        raise ValueError(f"{key}: config.json has {have.get(key)!r} but the recorded megatron arguments give "
                         f"{want.get(key)!r}; the folder was edited after export")
