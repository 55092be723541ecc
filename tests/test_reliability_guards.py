"""Issue 27 items 3-5: one writer per --save, preemption saves, clear errors for the remaining faults.

Every case here failed before its fix (a silent acceptance, a bare traceback, or a lost checkpoint).
The cases that train go through the entry point and are in the slow lane.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from entry_point_helpers import REPO, TESTS, common_flags, free_port, write_byte_data

from megatron_xmod.training import checkpoints, save_lock

ROUTED = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2 + D"]
MODEL_BUILT = "number of parameters on"


def entry_env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))


# ----------------------------------------------------------------------------- 3. one writer per --save
def test_second_writer_is_refused_naming_the_holder(tmp_path):
    """Before: both runs exit 0 and one replaces the other's checkpoints."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = dict(save_lock.own_record(), pid=holder.pid, started=save_lock._start_time(holder.pid),
                      command="python -m megatron_xmod.pretrain --save first")
        (tmp_path / save_lock.LOCK_NAME).write_text(json.dumps(record))
        with pytest.raises(save_lock.SaveLockError, match=rf"being written by another run \(pid {holder.pid} on host "
                                                          rf"{socket.gethostname()}.*--save first"):
            save_lock.acquire(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_pid_is_reclaimed_with_a_message(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = dict(save_lock.own_record(), pid=dead.pid, started=1.0)
    (tmp_path / save_lock.LOCK_NAME).write_text(json.dumps(record))
    said = []
    path = save_lock.acquire(str(tmp_path), log=lambda text, **_: said.append(text))
    try:
        assert "reclaimed the stale lock" in said[0] and f"pid {dead.pid} no longer exists" in said[0]
        assert json.loads(open(path).read())["pid"] == os.getpid()
    finally:
        save_lock.release(str(tmp_path))
    assert not os.path.exists(path)


def test_other_ranks_never_take_the_lock(tmp_path):
    class Args:
        save, rank = str(tmp_path), 1

    assert save_lock.take_for_run(Args()) is None and not (tmp_path / save_lock.LOCK_NAME).exists()


def test_second_run_on_one_save_stops_before_the_model_is_built(tmp_path):
    """Through the entry point: the lock of a live run stops a second one with exit 2, naming it."""
    data = write_byte_data(str(tmp_path / "bytes"))
    save = tmp_path / "ckpt"
    save.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record = dict(save_lock.own_record(), pid=holder.pid, started=save_lock._start_time(holder.pid),
                      command="the first run")
        (save / save_lock.LOCK_NAME).write_text(json.dumps(record))
        result = subprocess.run([sys.executable, "-m", "megatron_xmod.pretrain", *ROUTED,
                                 *common_flags(data, 2, "--save", str(save), "--save-interval", "2")],
                                capture_output=True, text=True, env=entry_env(), cwd=REPO, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    text = result.stdout + result.stderr
    assert result.returncode == 2, text[-3000:]
    assert f"being written by another run (pid {holder.pid}" in text and "the first run" in text
    assert MODEL_BUILT not in text


# ----------------------------------------------------------------------------- 4. preemption
@pytest.mark.slow
def test_sigterm_to_every_process_of_a_torchrun_job_saves_and_exits_0(tmp_path):
    """Before: the signal also killed megatron's checkpoint-writer helper (a multiprocessing Manager),
    the save failed with BrokenPipeError and the job did not exit 0."""
    import psutil

    data = write_byte_data(str(tmp_path / "bytes"))
    save = tmp_path / "ckpt"
    log = open(tmp_path / "log.txt", "w+")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
               "-m", "megatron_xmod.pretrain", *ROUTED,
               *common_flags(data, 500, "--save", str(save), "--save-interval", "1000", "--exit-signal-handler",
                             "--eval-interval", "1000")]
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=entry_env(), cwd=REPO)
    try:
        deadline = time.time() + 600
        while "iteration        3/" not in open(log.name).read():
            assert job.poll() is None and time.time() < deadline, open(log.name).read()[-5000:]
            time.sleep(1)
        workers = psutil.Process(job.pid).children(recursive=True)  # workers and their helper processes
        assert len(workers) >= 2  # the training process and megatron's writer helper
        for process in workers:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        rc = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    text = open(log.name).read()
    assert rc == 0, text[-5000:]
    assert "exiting program after receiving SIGTERM" in text and "BrokenPipeError" not in text
    iteration, _ = checkpoints.read_tracker(str(save))
    assert iteration >= 3
    manifest, problems = checkpoints.verify_iteration(str(save), iteration)
    assert manifest is not None and problems == []
