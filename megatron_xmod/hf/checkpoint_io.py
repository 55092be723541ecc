"""Megatron ``torch_dist`` checkpoints in one CPU process: load one saved at any TP/PP/DP/EP layout
into a full (unsharded) state dict, and save a full state dict back as a checkpoint that our entry
point resumes from.

Both directions use megatron's own distributed checkpointing. A ``torch_dist`` checkpoint stores
every tensor in its global (TP1/PP1) shape with its shards' offsets, so building the model of the
checkpoint's saved ``args`` at TP1/PP1 in this process and asking
``megatron.core.dist_checkpointing.load`` for that model's sharded state dict gathers the whole
model, whatever layout wrote it (megatron's resharding does the work). The other way, the TP1/PP1
model's sharded state dict saved by ``dist_checkpointing.save`` is loadable at any TP/PP: the
saved ``args`` record the layout the checkpoint is meant for.

No launcher is needed: :func:`single_process_megatron` starts a one-process gloo group (a file
store, no port) and megatron's model-parallel state at TP1/PP1 unless the caller already has one.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from megatron_xmod.training.checkpoints import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"


@dataclasses.dataclass
class LoadedCheckpoint:
    state_dict: dict  # the TP1/PP1 model's state_dict(): the adapter's "full megatron state dict"
    args: argparse.Namespace  # megatron's arguments saved with the checkpoint
    iteration: int  # 0 for a release checkpoint
    path: Path  # the iteration folder that was read


# ---------------------------------------------------------------------------------------------- locating
def checkpoint_path(load_dir: str | os.PathLike, iteration: Optional[int] = None) -> tuple[Path, int]:
    """The iteration folder of ``load_dir`` (megatron's layout: ``iter_0000012/`` or ``release/`` and
    the tracker file) and its iteration (0 for release). Accepts an iteration folder itself too."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"load: {load_dir} is not a folder; give the --save folder of a megatron run")
    if (load_dir / "metadata.json").is_file() and iteration is None:  # an iteration folder itself
        name = load_dir.name
        return load_dir, 0 if name == "release" else int(name.rsplit("_", 1)[-1])
    if iteration is not None:
        path = load_dir / f"iter_{iteration:07d}"
        if not path.is_dir():
            have = sorted(p.name for p in load_dir.iterdir() if p.name.startswith(("iter_", "release")))
            raise CheckpointError(f"iteration: {load_dir} has no {path.name}; it has {have or 'no checkpoints'}")
        return path, iteration
    from megatron_xmod.training.checkpoints import read_tracker

    tracked = read_tracker(str(load_dir))  # garbage in the tracker: named, with the iterations found
    if tracked is None:
        raise CheckpointError(f"load: {load_dir} has no {TRACKER}; is it the --save folder of a megatron run?")
    if tracked[1]:
        return load_dir / "release", 0
    path = load_dir / f"iter_{tracked[0]:07d}"
    if not path.is_dir():
        raise CheckpointError(f"load: {load_dir / TRACKER} names iteration {tracked[0]} but {path} does not exist; "
                              "write the iteration of a checkpoint that exists into it, or pass --iteration N")
    return path, tracked[0]


def verify_checkpoint(path: Path) -> None:
    """The iteration folder ``path`` against the checksum manifest beside it, as ``--load`` does
    (:func:`megatron_xmod.training.checkpoints.verify_iteration`); a folder without one is refused
    (``verify=False`` / ``--no-verify`` for checkpoints saved before megatron_xmod wrote manifests)."""
    from megatron_xmod.training.checkpoints import manifest_path, verify_iteration

    path = Path(path)
    release = path.name == "release"
    iteration = 0 if release else int(path.name.rsplit("_", 1)[-1])
    manifest, problems = verify_iteration(str(path.parent), iteration, release)
    if manifest is None:
        raise CheckpointError(
            f"load: {manifest_path(str(path.parent), iteration, release)} does not exist, so {path} cannot be checked "
            "for damage before it is read; pass --no-verify for a checkpoint saved before megatron_xmod wrote "
            f"manifests (or `xmod ckpt verify {path.parent} --iteration {iteration} --rewrite` if you trust its files)")
    if problems:
        listed = "\n  ".join(problems)
        raise CheckpointError(f"load: {path} does not match its checksum manifest, refusing to read it:\n  {listed}\n"
                              "Restore the file(s) from a copy, or give another iteration that `xmod ckpt verify "
                              f"{path.parent}` passes (--iteration N)")


def read_common(path: Path) -> dict:
    """The checkpoint's common (non-tensor) state: ``args``, ``iteration``, ``content_metadata``, ..."""
    from megatron.core import dist_checkpointing

    metadata = path / "metadata.json"
    if not metadata.is_file():
        raise CheckpointError(f"load: {path} is not a torch_dist checkpoint (no metadata.json); save with "
                              "--ckpt-format torch_dist (megatron's default)")
    if not (path / ".metadata").is_file():  # megatron: "AssertionError: metadata is None"
        raise CheckpointError(f"load: {path / '.metadata'} is missing (torch's index of the tensors, written last by "
                              "a save: the save was interrupted, or the file was lost in a copy); restore it from a copy, "
                              "or give another iteration (--iteration N)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    if not isinstance(common.get("args"), argparse.Namespace):
        raise CheckpointError(f"load: {path} holds no saved megatron args; it was not written by megatron's "
                              "training loop (or by xmod import-hf)")
    return common


# ----------------------------------------------------------------------------------- one-process megatron
@contextlib.contextmanager
def single_process_megatron():
    """megatron-core on this CPU process at TP1/PP1: a one-process gloo group and the model-parallel
    state, both torn down afterwards when this call created them."""
    from megatron.core import parallel_state

    from megatron_xmod.cpu_shim import cpu_patches

    created_group = created_mp = False
    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_patches(training=False))
        if not torch.distributed.is_initialized():
            store_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="xmod-hf-"))
            store = torch.distributed.FileStore(os.path.join(store_dir, "store"), 1)
            torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
            created_group = True
        if torch.distributed.get_world_size() != 1:
            raise RuntimeError("checkpoint conversion runs in one process; do not launch it with torchrun")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
            created_mp = True
        elif (parallel_state.get_tensor_model_parallel_world_size() != 1
              or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise RuntimeError("checkpoint conversion needs megatron's model-parallel state at TP1/PP1")
        try:
            yield
        finally:
            if created_mp:
                parallel_state.destroy_model_parallel()
            if created_group:
                torch.distributed.destroy_process_group()


def single_process_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` for the same model built whole in one process (TP1/PP1/EP1, no sequence parallel)."""
    args = copy.deepcopy(args)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "context_parallel_size", "expert_tensor_parallel_size"):
        if hasattr(args, name):
            setattr(args, name, 1)
    args.virtual_pipeline_model_parallel_size = None
    args.num_layers_per_virtual_pipeline_stage = None
    args.pipeline_model_parallel_layout = None
    args.decoder_first_pipeline_num_layers = None
    args.decoder_last_pipeline_num_layers = None
    args.sequence_parallel = False
    args.use_cpu_initialization = True
    args.perform_initialization = False  # every tensor is overwritten from the checkpoint
    args.recompute_granularity = None
    args.recompute_method = None
    args.recompute_num_layers = None
    args.transformer_impl = "local" if not torch.cuda.is_available() else args.transformer_impl
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The TP1/PP1 model of ``args`` (our entry point's model provider), in eval mode."""
    from megatron_xmod.training.providers import build_model as provide

    with torch.random.fork_rng(devices=[]):
        model = provide(single_process_args(args), pre_process=True, post_process=True)
    return model.eval()


def model_sharded_state_dict(model: torch.nn.Module, content_metadata: Optional[dict]) -> dict:
    from megatron.core import parallel_state

    metadata = dict(content_metadata or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return model.sharded_state_dict(metadata=metadata)


# ------------------------------------------------------------------------------------------------ load
def load_checkpoint(load_dir: str | os.PathLike, iteration: Optional[int] = None) -> LoadedCheckpoint:
    """The full TP1/PP1 state dict of a ``torch_dist`` checkpoint saved at any layout, and its args."""
    from megatron.core import dist_checkpointing

    path, iteration = checkpoint_path(load_dir, iteration)
    with single_process_megatron():
        common = read_common(path)
        args = common["args"]
        model = build_model(args)
        sharded = model_sharded_state_dict(model, common.get("content_metadata"))
        loaded = dist_checkpointing.load({"model": sharded}, str(path))
        model.load_state_dict(loaded["model"], strict=True)
        state_dict = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}
    return LoadedCheckpoint(state_dict=state_dict, args=args, iteration=int(common.get("iteration", iteration)),
                            path=path)


# ------------------------------------------------------------------------------------------------ save
def existing_run(save_dir: Path) -> Optional[str]:
    """What of a megatron run ``save_dir`` already holds (its tracker, iteration folders), one phrase; None."""
    from megatron_xmod.training.checkpoints import iterations_found

    save_dir = Path(save_dir)
    held = []
    if (save_dir / TRACKER).is_file():
        held.append(f"{TRACKER} (reading {(save_dir / TRACKER).read_text().strip()[:40]!r})")
    found = iterations_found(str(save_dir))
    if found:
        held.append(f"checkpoints of iterations {', '.join(map(str, found))}")
    if (save_dir / "release").is_dir() and any((save_dir / "release").iterdir()):
        held.append("a release checkpoint")
    return " and ".join(held) or None


def check_shapes(model_state: dict, state_dict: dict, where: str) -> None:
    """Every tensor of ``state_dict`` in the shape the model of the args needs, named with both shapes."""
    wrong = [(k, tuple(v.shape), tuple(model_state[k].shape)) for k, v in state_dict.items()
             if k in model_state and model_state[k] is not None and hasattr(v, "shape")
             and tuple(v.shape) != tuple(model_state[k].shape)]
    if wrong:
        listed = "; ".join(f"{k}: {have} in {where}, the model needs {need}" for k, have, need in wrong[:5])
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        raise CheckpointError(f"state_dict: {len(wrong)} tensor(s) of the wrong shape: {listed}{more}; the weights "
                              "are not those of the model their recorded arguments describe (edited, or files of "
                              "another export?)")


def save_checkpoint(state_dict: dict, args: argparse.Namespace, save_dir: str | os.PathLike,
                    tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                    overwrite: bool = False, identity: Optional[dict] = None, where: str = "the weights") -> Path:
    """Save a full TP1/PP1 state dict as a megatron *release* checkpoint under ``save_dir``
    (``release/`` and the tracker): ``--load`` starts from it at iteration 0 with a fresh optimizer and
    the data from its start, at any TP/PP (``torch_dist`` reshards on load). The saved args record ``tensor_model_parallel_size``
    and ``pipeline_model_parallel_size`` as the layout to resume with."""
    from megatron.core import dist_checkpointing

    from megatron_xmod.training import checkpoints, run_identity

    save_dir = Path(save_dir)
    path = save_dir / "release"
    held = existing_run(save_dir)
    if held and not overwrite:
        raise CheckpointError(f"save: --save {save_dir} already holds a run ({held}){_identity_lines(save_dir, args)}; "
                              "choose a new --save folder, or pass --overwrite to replace its release checkpoint and "
                              f"point {TRACKER} at it (its iter_* folders are kept)")
    if path.exists():
        import shutil

        shutil.rmtree(path)  # --overwrite
        for stale in (save_dir / "checksums_release.json",):
            stale.unlink(missing_ok=True)
    saved_args = copy.deepcopy(args)
    saved_args.tensor_model_parallel_size = tensor_model_parallel_size
    saved_args.pipeline_model_parallel_size = pipeline_model_parallel_size
    # megatron restores the data position from the saved args unless --finetune; a release checkpoint
    # starts at iteration 0, so its data starts at the beginning too.
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(saved_args, name, 0)
    with single_process_megatron():
        model = build_model(args)
        check_shapes(model.state_dict(), state_dict, where)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"state_dict: does not match the model of the args (missing {missing[:5]}, "
                                  f"unexpected {list(unexpected)[:5]})")
        content_metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        common = {"model": model_sharded_state_dict(model, content_metadata), "args": saved_args,
                  "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0}
        path.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(common, str(path), content_metadata=content_metadata)
    run_identity.write_record(args, str(save_dir), 0, release=True,
                              identity=identity or run_identity.identity_of(args, with_tokenizer_hash=False))
    algorithm = checkpoints.checksum_algorithm()  # the manifest --load and export-hf verify
    entries = checkpoints.checksum_share(str(path), checkpoints.checkpoint_files(str(path)), algorithm)
    checkpoints.write_manifest(str(save_dir), 0, entries, algorithm, release=True)
    (save_dir / TRACKER).write_text("release")
    return path


def _identity_lines(save_dir: Path, args) -> str:
    """How the run in ``save_dir`` differs from the model of ``args`` (old -> new lines), if it can be read."""
    from megatron_xmod.training import run_identity

    try:
        path, _ = checkpoint_path(save_dir)
        saved = read_common(path)["args"] if (path / "metadata.json").is_file() else None
        old, _ = run_identity.saved_identity(path, saved)
    except (ValueError, OSError):
        return ""
    differ = run_identity.differences(old or {}, run_identity.identity_of(args, with_tokenizer_hash=False))
    return f", of another model (old -> new:\n{run_identity.describe(differ)}\n)" if differ else ", of the same model"
