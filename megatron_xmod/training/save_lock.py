"""One writer per ``--save`` folder: ``<save>/.xmod_save.lock``.

Two runs given the same ``--save`` would both exit 0 while one replaces the other's checkpoints (which
one is a race). Rank 0 of a run (``RANK``, else ``SLURM_PROCID``) takes the lock at start-up, before megatron builds the tokenizer, the
log writers or the model (the entry point's pre-flight, patch 19); the run's other ranks never take
or read it, so they cannot mistake their own run for a second writer. The lock is a small JSON file
created with ``O_CREAT | O_EXCL`` (atomic, NFS included) holding the holder's host, pid, process start
time, command and SLURM job; it is removed when the process exits (``atexit``).

A second run on the folder stops with :class:`SaveLockError`, naming the holder. A lock left by a
process that no longer exists (same host, pid dead or reused by another process; or the same SLURM
job and step, requeued) is stale: it is reclaimed with a message. A lock of another host cannot be judged from
here: the message names the file to delete once that run is known to be gone.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from typing import Optional

LOCK_NAME = ".xmod_save.lock"
_HELD: dict[str, dict] = {}  # path -> the record this process wrote


class SaveLockError(ValueError):
    """Another live run writes to the same --save folder."""


def lock_path(save_dir: str) -> str:
    return os.path.join(save_dir, LOCK_NAME)


def _start_time(pid: int) -> Optional[float]:
    """The process's start time (seconds since the epoch), None when it does not exist."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1.0  # alive, start time unknown
    except Exception:  # psutil.NoSuchProcess, AccessDenied, ZombieProcess
        try:
            import psutil

            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return None
        except Exception:
            return None
        return -1.0


def own_record() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid) or time.time(),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_step": os.environ.get("SLURM_STEP_ID"),
            "command": " ".join(sys.argv)[:300]}


def read_lock(save_dir: str) -> Optional[dict]:
    try:
        with open(lock_path(save_dir)) as stream:
            record = json.load(stream)
        return record if isinstance(record, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: judged stale below only if old


def describe(record: dict) -> str:
    job = f", SLURM job {record['slurm_job']}" if record.get("slurm_job") else ""
    return (f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started_at')}{job}: "
            f"{record.get('command', '?')}")


def stale_reason(record: dict) -> Optional[str]:
    """Why the lock's holder is known to be gone; None while it may be alive."""
    if not record:
        return "the lock file is empty or unreadable"
    ours = own_record()
    if (record.get("slurm_job") and record.get("slurm_job") == ours["slurm_job"]
            and record.get("slurm_step") == ours["slurm_step"] and record.get("pid") != ours["pid"]):
        return f"SLURM job {record['slurm_job']} step {record.get('slurm_step')} is this one, requeued"
    if record.get("host") != ours["host"]:
        return None
    pid = record.get("pid")
    if not isinstance(pid, int):
        return "the lock names no pid"
    started = _start_time(pid)
    if started is None:
        return f"pid {pid} no longer exists on {ours['host']}"
    wanted = record.get("started")
    if started >= 0 and isinstance(wanted, (int, float)) and abs(started - wanted) > 2:
        return f"pid {pid} is now another process (started {time.strftime('%H:%M:%S', time.localtime(started))})"
    return None


def acquire(save_dir: str, log=print) -> str:
    """Take the lock of ``save_dir`` for this process (creating the folder); returns the lock's path.
    Raises SaveLockError when a live run holds it; reclaims a stale one with a message."""
    os.makedirs(save_dir, exist_ok=True)
    path = lock_path(save_dir)
    if path in _HELD:
        return path
    record = own_record()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_lock(save_dir)
            if holder is None:
                continue  # released in between
            if holder.get("pid") == record["pid"] and holder.get("host") == record["host"]:
                break  # this process took it before
            reason = stale_reason(holder)
            if reason is None:
                raise SaveLockError(
                    f"save: --save {save_dir} is being written by another run ({describe(holder)}); two runs on one "
                    f"folder replace each other's checkpoints. Give this run its own --save, or stop the other run "
                    f"first; if it is known to be gone (another host cannot be checked from here), delete {path}") from None
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            log(f"[xmod] reclaimed the stale lock {path} of {describe(holder)} ({reason})", flush=True)
            continue
        with os.fdopen(fd, "w") as stream:
            json.dump(record, stream)
            stream.write("\n")
        break
    else:
        raise SaveLockError(f"save: could not take the lock {path} (it keeps reappearing: another run is starting "
                            "on the same --save folder); give each run its own --save")
    _HELD[path] = record
    if len(_HELD) == 1:
        atexit.register(release_all)
    return path


def release(save_dir: str) -> None:
    """Remove the lock of ``save_dir`` if this process holds it (never another run's)."""
    path = lock_path(save_dir)
    record = _HELD.pop(path, None)
    if record is None:
        return
    holder = read_lock(save_dir)
    if holder and holder.get("pid") == record["pid"] and holder.get("host") == record["host"]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def release_all() -> None:
    for path in list(_HELD):
        release(os.path.dirname(path))


def take_for_run(args, log=print) -> Optional[str]:
    """The entry point's start-up: rank 0 of a run with ``--save`` takes the lock (other ranks: None)."""
    save = getattr(args, "save", None)
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or getattr(args, "rank", 0) or 0
    if not save or int(rank) != 0:
        return None
    return acquire(save, log=log)
