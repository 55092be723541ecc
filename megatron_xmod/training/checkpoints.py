"""Checkpoint integrity around megatron's own ``save_checkpoint`` / ``load_checkpoint``.

megatron writes ``<save>/iter_NNNNNNN/`` and then its tracker ``latest_checkpointed_iteration.txt``.
On top of that (patch 17 of :mod:`megatron_xmod.training.patches`):

- before a save, the model's weights are checked for NaN/Inf on every rank; a non-finite weight
  refuses the save (the last good checkpoint stays the latest) and stops the run, naming it;
- after a save, a manifest ``checksums_iter_NNNNNNN.json`` (size and checksum of every file of the
  iteration) is written atomically (tmp file, fsync, ``os.replace``) next to the tracker. Ranks hash
  disjoint subsets of the files, so the cost per rank is the checkpoint size over the world size;
- before a load, the iteration the tracker (or ``--ckpt-step``) names is verified against its
  manifest the same way; a mismatch names the file and refuses to load;
- a ``--load`` directory with ``iter_*`` checkpoints but no readable tracker is an error listing the
  iterations (megatron would start from scratch next to them); garbage in the tracker is an error.

The checksum is xxHash XXH3-128 when the ``xxhash`` package is installed, else BLAKE2b (hashlib);
the manifest records which. ``xmod ckpt verify DIR`` checks a directory by hand.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST_VERSION = 1
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded or written, or a folder that cannot be read as one (training,
    export, import); the message names the file or the field and the fix."""


# ----------------------------------------------------------------------------- names
def iteration_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def manifest_path(checkpoint_dir: str, iteration: int, release: bool = False) -> str:
    return os.path.join(checkpoint_dir, f"checksums_{iteration_dir_name(iteration, release)}.json")


def iterations_found(checkpoint_dir: str) -> list[int]:
    """The iterations that have an ``iter_*`` directory in ``checkpoint_dir``, ascending."""
    if not os.path.isdir(checkpoint_dir):
        return []
    found = []
    for name in os.listdir(checkpoint_dir):
        match = _ITER_DIR.match(name)
        if match and os.path.isdir(os.path.join(checkpoint_dir, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def read_tracker(checkpoint_dir: str) -> Optional[tuple[int, bool]]:
    """(iteration, release) from megatron's tracker; None for a directory with no checkpoint at all.

    Raises CheckpointError where megatron would silently start from scratch (``iter_*`` directories
    but no tracker) or print an error and exit 0 (garbage in the tracker)."""
    tracker = os.path.join(checkpoint_dir, TRACKER)
    if not os.path.exists(tracker):
        found = iterations_found(checkpoint_dir)
        if not found:
            return None
        listed = ", ".join(str(i) for i in found)
        raise CheckpointError(
            f"load: {checkpoint_dir!r} holds checkpoints of iterations {listed} but no {TRACKER} (megatron would "
            f"start from scratch next to them); check one with `xmod ckpt verify {checkpoint_dir} --iteration "
            f"{found[-1]}`, then write its number into {tracker} (or pass --ckpt-step {found[-1]}); use another "
            "--load directory to start fresh")
    try:
        with open(tracker) as stream:
            text = stream.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"load: cannot read {tracker} ({error}); fix the file or its permissions") from error
    if text == "release":
        return 0, True
    if not re.fullmatch(r"\d+", text):
        found = iterations_found(checkpoint_dir)
        raise CheckpointError(
            f"load: {tracker} holds {text[:40]!r}, not an iteration number; write the iteration to resume from "
            f"into it (checkpoints found: {', '.join(map(str, found)) or 'none'})")
    return int(text), False


# ----------------------------------------------------------------------------- checksums
def checksum_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b"
    return "xxh3_128"


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise CheckpointError(f"manifest: unknown checksum algorithm {algorithm!r} (known: xxh3_128, blake2b); "
                          "the manifest was written by a newer megatron_xmod, or is damaged")


def file_checksum(path: str, algorithm: str) -> str:
    hasher = _hasher(algorithm)
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def checkpoint_files(iteration_dir: str) -> list[str]:
    """Every regular file below ``iteration_dir``, relative and sorted (the same list on every rank)."""
    files = []
    for root, _, names in os.walk(iteration_dir):
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                files.append(os.path.relpath(path, iteration_dir))
    return sorted(files)


def _share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def checksum_share(iteration_dir: str, files: list[str], algorithm: str, rank: int = 0,
                   world: int = 1) -> dict[str, dict]:
    """{relative path: {size, checksum}} for this rank's share of ``files``."""
    return {name: {"size": os.path.getsize(os.path.join(iteration_dir, name)),
                   "checksum": file_checksum(os.path.join(iteration_dir, name), algorithm)}
            for name in _share(files, rank, world)}


def _file_mode(iteration_dir: str) -> int:
    """The permission bits of the iteration's files (what megatron's writes gave them under the run's
    umask): the manifest gets the same, so whoever can read the checkpoint can verify and load it
    (``mkstemp`` alone would make it 0600)."""
    for name in checkpoint_files(iteration_dir)[:1] if os.path.isdir(iteration_dir) else []:
        return os.stat(os.path.join(iteration_dir, name)).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_atomically(path: str, text: str, mode: Optional[int] = None) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as stream:
            stream.write(text)
            stream.flush()
            if mode is not None:
                os.fchmod(stream.fileno(), mode)
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def write_manifest(checkpoint_dir: str, iteration: int, entries: dict[str, dict], algorithm: str,
                   release: bool = False) -> str:
    path = manifest_path(checkpoint_dir, iteration, release)
    manifest = {"version": MANIFEST_VERSION, "iteration": iteration, "release": release,
                "directory": iteration_dir_name(iteration, release), "algorithm": algorithm,
                "files": dict(sorted(entries.items()))}
    _write_atomically(path, json.dumps(manifest, indent=1) + "\n",
                      mode=_file_mode(os.path.join(checkpoint_dir, iteration_dir_name(iteration, release))))
    return path


def read_manifest(checkpoint_dir: str, iteration: int, release: bool = False) -> Optional[dict]:
    """The manifest of one iteration; None when there is none (a checkpoint from before megatron_xmod
    wrote manifests, from another tool, or a crash between megatron's tracker and the manifest)."""
    path = manifest_path(checkpoint_dir, iteration, release)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as stream:
            manifest = json.load(stream)
        if not isinstance(manifest.get("files"), dict) or "algorithm" not in manifest:
            raise ValueError("no 'files' table or no 'algorithm'")
    except (OSError, ValueError, AttributeError) as error:
        raise CheckpointError(f"manifest: {path} is not a readable checksum manifest ({error}); "
                              f"run `xmod ckpt verify {checkpoint_dir} --iteration {iteration} --rewrite` only if you "
                              "trust the checkpoint files") from error
    return manifest


def verify_share(checkpoint_dir: str, iteration: int, manifest: dict, rank: int = 0, world: int = 1,
                 release: bool = False) -> list[str]:
    """Problems in this rank's share of one iteration: each names the file and what is wrong."""
    iteration_dir = os.path.join(checkpoint_dir, iteration_dir_name(iteration, release))
    expected = manifest["files"]
    problems = []
    if rank == 0:
        present = set(checkpoint_files(iteration_dir)) if os.path.isdir(iteration_dir) else set()
        for name in sorted(set(expected) - present):
            problems.append(f"{os.path.join(iteration_dir, name)}: missing (listed in the manifest)")
        for name in sorted(present - set(expected)):
            problems.append(f"{os.path.join(iteration_dir, name)}: not in the manifest (written after the save?)")
    for name in _share(sorted(expected), rank, world):
        path = os.path.join(iteration_dir, name)
        if not os.path.isfile(path):
            continue  # reported once, by rank 0
        size, want = os.path.getsize(path), expected[name]
        if size != want["size"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or replaced)")
        elif file_checksum(path, manifest["algorithm"]) != want["checksum"]:
            problems.append(f"{path}: checksum mismatch ({manifest['algorithm']}); the file changed after the save")
    return problems


def verify_iteration(checkpoint_dir: str, iteration: int, release: bool = False) -> tuple[Optional[dict], list[str]]:
    """(manifest, problems) of one iteration in this process alone (``xmod ckpt verify``)."""
    manifest = read_manifest(checkpoint_dir, iteration, release)
    if manifest is None:
        return None, []
    return manifest, verify_share(checkpoint_dir, iteration, manifest, release=release)


# ----------------------------------------------------------------------------- in the training run
def _rank_world() -> tuple[int, int]:
    import torch

    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    import torch

    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def nonfinite_parameters(model_chunks) -> list[str]:
    """Names of this rank's parameters holding NaN/Inf (one host sync for all of them)."""
    import torch

    named = [(name, param) for chunk in model_chunks for name, param in chunk.named_parameters()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(param).all() for _, param in named]).cpu()
    return [name for (name, _), ok in zip(named, finite.tolist()) if not ok]


def check_finite_before_save(model_chunks, iteration: int) -> None:
    """Every rank calls this; all refuse together when any rank holds a non-finite weight."""
    bad = nonfinite_parameters(model_chunks)
    everyone = [names for names in _gather(bad) if names]
    if everyone:
        first = everyone[0]
        more = f" and {len(first) - 1} more" if len(first) > 1 else ""
        raise CheckpointError(
            f"save: the weights at iteration {iteration} are not finite ({first[0]}{more} hold NaN/Inf); no "
            "checkpoint was written, the last one saved stays the latest. Resume from it with a lower --lr (with "
            "--no-load-optim: megatron keys the optimizer state by the learning rate), gradient clipping "
            "(--clip-grad) or --check-for-nan-in-loss-and-grad (the default)")


def set_aside_incomplete(save_dir: str, iteration: int, release: bool = False) -> Optional[str]:
    """Every rank calls this before megatron saves ``iteration``. A directory of that iteration which
    the tracker does not name is what a run killed during its save left behind; megatron's
    distributed save refuses a non-empty directory (dist_checkpointing/serialization.py:420), so the
    resumed run would crash at that very save. Rank 0 renames it ``iter_NNNNNNN.incomplete-<time>``
    (kept for inspection; ``xmod ckpt verify`` ignores it). Returns the new name, on rank 0."""
    import time

    import torch

    rank, _ = _rank_world()
    moved = None
    directory = os.path.join(save_dir, iteration_dir_name(iteration, release))
    if rank == 0 and os.path.isdir(directory):
        try:
            tracked = read_tracker(save_dir)
        except CheckpointError:
            tracked = None
        if tracked != (iteration, release):
            moved = f"{directory}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(directory, moved)
            stale = manifest_path(save_dir, iteration, release)
            if os.path.exists(stale):
                os.replace(stale, moved + ".json")
            print(f"[xmod] {directory} was not a complete checkpoint (the tracker does not name it: a save that "
                  f"was interrupted); moved to {moved} before saving iteration {iteration} again", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return moved


def manifest_after_save(save_dir: str, iteration: int, release: bool = False) -> Optional[str]:
    """Every rank calls this after megatron's save returned; rank 0 writes the manifest."""
    import torch

    rank, world = _rank_world()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's files are on disk
    iteration_dir = os.path.join(save_dir, iteration_dir_name(iteration, release))
    algorithm = checksum_algorithm()
    files = checkpoint_files(iteration_dir) if rank == 0 else None
    files = _broadcast(files)
    entries: dict[str, dict] = {}
    for share in _gather(checksum_share(iteration_dir, files, algorithm, rank, world)):
        entries.update(share)
    path = None
    if rank == 0:
        path = write_manifest(save_dir, iteration, entries, algorithm, release)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return path


def _broadcast(obj):
    import torch

    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def verify_before_load(load_dir: str, ckpt_step: Optional[int] = None) -> Optional[int]:
    """Every rank calls this before megatron loads; raises CheckpointError naming the damaged file.
    Returns the iteration verified (None when there is nothing to load or no manifest)."""
    rank, world = _rank_world()
    tracked = (int(ckpt_step), False) if ckpt_step else read_tracker(load_dir)
    if tracked is None:
        return None
    iteration, release = tracked
    manifest = read_manifest(load_dir, iteration, release)
    if manifest is None:
        if rank == 0:
            print(f"[xmod] WARNING: {manifest_path(load_dir, iteration, release)} does not exist: iteration "
                  f"{iteration} is loaded unverified (saved without megatron_xmod, or the run stopped between "
                  "megatron's tracker and the manifest)", flush=True)
        return None
    problems = [p for share in _gather(verify_share(load_dir, iteration, manifest, rank, world, release)) for p in share]
    if problems:
        listed = "\n  ".join(problems)
        raise CheckpointError(
            f"load: iteration {iteration} of {load_dir!r} does not match its manifest, refusing to load it:\n  {listed}\n"
            f"Restore the file(s) from a copy, or resume from an older iteration that `xmod ckpt verify {load_dir}` "
            "passes (--ckpt-step N)")
    if rank == 0:
        print(f"[xmod] checkpoint iteration {iteration} of {load_dir} verified against its manifest "
              f"({len(manifest['files'])} files, {manifest['algorithm']})", flush=True)
    return iteration


# ----------------------------------------------------------------------------- disk space
def directory_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in checkpoint_files(directory))


def latest_complete_size(save_dir: str) -> Optional[tuple[int, int]]:
    """(iteration, bytes) of the checkpoint the tracker names in ``save_dir``; None when there is none."""
    try:
        tracked = read_tracker(save_dir)
    except CheckpointError:
        return None
    if tracked is None:
        return None
    directory = os.path.join(save_dir, iteration_dir_name(*tracked))
    return (tracked[0], directory_bytes(directory)) if os.path.isdir(directory) else None


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def check_free_space(checkpoint_dir: str, needed: int) -> None:
    """Before a checkpoint of about ``needed`` bytes is written into ``checkpoint_dir`` (an ``iter_*``
    folder, perhaps not created yet): refuse when its file system has less free space (a save that
    runs out of space leaves a half-written folder and torch's ``unexpected pos`` message)."""
    import shutil

    existing = os.path.abspath(checkpoint_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if needed > free:
        save_dir = os.path.dirname(os.path.abspath(checkpoint_dir))
        raise CheckpointError(
            f"save: not enough disk space for {checkpoint_dir}: the checkpoint needs about {_size(needed)}, the file "
            f"system of {save_dir} has {_size(free)} free (ENOSPC would follow); nothing was written, the last "
            "complete checkpoint stays the latest. Free space there (e.g. delete old iter_* folders) or move --save")


def name_disk_full(error: BaseException, checkpoint_dir: str) -> Optional[CheckpointError]:
    """A save that failed because the disk filled up (``OSError`` ENOSPC, or torch's
    ``[enforce fail at inline_container.cc] unexpected pos`` with no space left), as a CheckpointError
    naming ENOSPC; None for any other failure."""
    import errno
    import shutil

    causes, cause = [], error
    while cause is not None and len(causes) < 8:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes)
    if not full:
        existing = os.path.abspath(checkpoint_dir)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        try:
            free = shutil.disk_usage(existing).free
        except OSError:
            return None
        text = " ".join(str(c) for c in causes)
        full = free < (1 << 20) and ("unexpected pos" in text or "No space left" in text or "write" in text.lower())
    if not full:
        return None
    return CheckpointError(
        f"save: no space left on device (ENOSPC) while writing {checkpoint_dir} ({type(error).__name__}: "
        f"{str(error).strip()[:200]}); that folder is incomplete and is not named by the tracker: the last complete "
        "checkpoint stays the latest, and a resume sets the incomplete folder aside. Free space on the file system "
        "of --save (or move it), then resume with --load")
