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


def test_other_ranks_never_take_the_lock(tmp_path, monkeypatch):
    class Args:
        save, rank = str(tmp_path), 0

    monkeypatch.delenv("RANK", raising=False)
    for variable in ("RANK", "SLURM_PROCID"):  # torchrun's rank, else srun's task number
        monkeypatch.setenv(variable, "1")
        assert save_lock.take_for_run(Args()) is None and not (tmp_path / save_lock.LOCK_NAME).exists()
        monkeypatch.delenv(variable)


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
AGENT = [sys.executable, "-m", "megatron_xmod.training.torchrun"]  # the launchers' torchrun


@pytest.mark.slow
def test_sigterm_to_every_process_of_a_torchrun_job_saves_and_exits_0(tmp_path):
    """SIGTERM to the agent and to every worker process, as SLURM sends it. Before: the signal also
    killed megatron's checkpoint-writer helper (a multiprocessing Manager), the save failed with
    BrokenPipeError; and torchrun's agent, signalled too, exited non-zero."""
    import psutil

    data = write_byte_data(str(tmp_path / "bytes"))
    save = tmp_path / "ckpt"
    log = open(tmp_path / "log.txt", "w+")
    command = [*AGENT, "--nproc_per_node=1", f"--master_port={free_port()}",
               "-m", "megatron_xmod.pretrain", *ROUTED,
               *common_flags(data, 500, "--save", str(save), "--save-interval", "2", "--exit-signal-handler",
                             "--eval-interval", "1000")]
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=entry_env(), cwd=REPO)
    try:
        deadline = time.time() + 600
        # after the save of iteration 2: megatron's writer helper exists (it starts at the first save)
        while "iteration        3/" not in open(log.name).read():
            assert job.poll() is None and time.time() < deadline, open(log.name).read()[-5000:]
            time.sleep(1)
        agent = psutil.Process(job.pid)
        workers = agent.children(recursive=True)  # workers and their helper processes
        assert any("multiprocessing" in " ".join(p.cmdline()) for p in workers)  # megatron's writer helper
        for process in [agent, *workers]:
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
    assert "[xmod] torchrun: SIGTERM: passed on to the workers" in text
    iteration, _ = checkpoints.read_tracker(str(save))
    assert iteration >= 3  # the save on the exit path, after the periodic one at 2
    manifest, problems = checkpoints.verify_iteration(str(save), iteration)
    assert manifest is not None and problems == []


SLOW_SAVER = """
import os, signal, sys, time
def save_and_exit(signum, frame):
    time.sleep(4)  # a preemption save longer than the agent's --shutdown_timeout
    with open(sys.argv[1], "a") as f:
        f.write(os.environ["RANK"] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, save_and_exit)
open(sys.argv[1] + "." + os.environ["RANK"] + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("to_workers", [True, False], ids=["sigterm-to-every-process", "sigterm-to-the-agent-only"])
def test_the_agent_waits_for_a_save_longer_than_the_shutdown_timeout(tmp_path, to_workers):
    """Before (plain torchrun): the agent killed the workers 1 s (--shutdown_timeout) after SIGTERM,
    nothing was saved, and it exited 1 with a SignalException."""
    script, saved = tmp_path / "saver.py", tmp_path / "saved.txt"
    script.write_text(SLOW_SAVER)
    job = subprocess.Popen([*AGENT, "--nproc_per_node=2", "--shutdown_timeout=1", f"--master_port={free_port()}",
                            str(script), str(saved)], env=entry_env(), cwd=REPO, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while not all((tmp_path / f"saved.txt.{rank}.ready").exists() for rank in (0, 1)):
            assert job.poll() is None and time.time() < deadline
            time.sleep(0.05)
        if to_workers:
            os.killpg(job.pid, signal.SIGTERM)  # the agent and its workers: one process group here
        else:
            job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    assert sorted(saved.read_text().split()) == ["0", "1"]  # both workers finished their save
    assert "passed on to the workers" in output and "SignalException" not in output


def test_the_agent_leaves_sigterm_to_itself_and_the_rest_to_torchrun():
    from megatron_xmod.training.torchrun import signals_left_to_torchrun

    assert signals_left_to_torchrun(None) == "SIGINT,SIGHUP,SIGQUIT"
    assert signals_left_to_torchrun("SIGTERM, SIGUSR1") == "SIGUSR1"


# ----------------------------------------------------------------------------- 5. clear errors
def blend_args(**overrides):
    import argparse

    values = dict(data_path=None, train_data_path=None, valid_data_path=None, test_data_path=None)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("blend, message", [
    (["-1", "a", "1", "b"], "the weight -1 of a is not a positive number"),
    (["0", "a", "1", "b"], "the weight 0 of a is not a positive number"),
    (["0.5", "a", "b"], "3 values, so a weight or a prefix is missing"),
    (["a", "0.5", "b", "0.5"], "'a' (value 1) is not a weight"),
])
def test_blend_weights_are_named_before_the_model_is_built(blend, message):
    """Before: bare AssertionErrors ('path prefix 0.5') from megatron's dataset building, after the model."""
    from megatron_xmod.training.preflight import check_blend

    with pytest.raises(ValueError, match=r"^data_path: --data-path .*" + message.replace("(", r"\(").replace(")", r"\)")):
        check_blend(blend_args(data_path=blend))
    check_blend(blend_args(data_path=["a", "b"]))  # prefixes alone
    check_blend(blend_args(data_path=["0.3", "a", "0.7", "b"]))


def test_blend_weight_minus_one_stops_the_entry_point_before_the_model(tmp_path):
    data = write_byte_data(str(tmp_path / "bytes"))
    flags = common_flags(data, 2)
    flags[flags.index("--data-path") + 1: flags.index("--data-path") + 2] = ["-1", data, "1", data]
    result = subprocess.run([sys.executable, "-m", "megatron_xmod.pretrain", *ROUTED, *flags], capture_output=True,
                            text=True, env=entry_env(), cwd=REPO, timeout=300)
    text = result.stdout + result.stderr
    assert result.returncode == 2, text[-3000:]
    assert "the weight -1 of" in text and MODEL_BUILT not in text and "Traceback" not in text


def fake_run(root, iterations=(3, 6), lr=3e-3, min_lr=3e-4):
    """A --load folder of megatron's legacy format (its common state is the rank-0 file) with a tracker."""
    import argparse

    import torch

    for iteration in iterations:
        folder = root / checkpoints.iteration_dir_name(iteration) / "mp_rank_00"
        folder.mkdir(parents=True)
        saved = argparse.Namespace(lr=lr, min_lr=min_lr, start_weight_decay=0.01, end_weight_decay=0.01)
        torch.save({"args": saved, "iteration": iteration}, folder / "model_optim_rng.pt")
    (root / checkpoints.TRACKER).write_text(str(iterations[-1]))
    return root


def resume_args(root, **overrides):
    import argparse

    values = dict(load=str(root), ckpt_step=None, finetune=False, train_iters=10, no_load_optim=False,
                  use_checkpoint_args=False, lr=3e-3, min_lr=3e-4, start_weight_decay=0.01, end_weight_decay=0.01)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_ckpt_step_of_a_missing_iteration_names_the_flag(tmp_path):
    """Before: 'iteration 99 is loaded unverified', then megatron fails on the missing folder."""
    from megatron_xmod.training.preflight import check_resume_point

    root = fake_run(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"^ckpt_step: --ckpt-step 99 .*iter_0000099 does not exist \(iterations in "
                                         r"--load .*: 3, 6\); pass one of them \(--ckpt-step 6 is the latest\)"):
        check_resume_point(resume_args(root, ckpt_step=99))
    check_resume_point(resume_args(root, ckpt_step=3))


def test_train_iters_below_the_checkpoint_names_the_fix(tmp_path):
    """Before: an OptimizerParamScheduler assertion at megatron's load."""
    from megatron_xmod.training.preflight import check_resume_point

    root = fake_run(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"^train_iters: --train-iters 4 is below iteration 6 .*--train-iters above 6"):
        check_resume_point(resume_args(root, train_iters=4))
    check_resume_point(resume_args(root, train_iters=4, ckpt_step=3))
    check_resume_point(resume_args(root, train_iters=4, finetune=True))


def test_new_lr_with_the_optimizer_state_suggests_no_load_optim(tmp_path):
    """Before: megatron's 'Could not find parameter group with key (...)' after the model is built."""
    from megatron_xmod.training.preflight import check_resume_point

    root = fake_run(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"^no_load_optim: .*--lr 0.003 there, 0.001 here.*Could not find parameter "
                                         r"group with key.*pass --no-load-optim.*or resume with the checkpoint's --lr "
                                         r"0.003"):
        check_resume_point(resume_args(root, lr=1e-3))
    check_resume_point(resume_args(root, lr=1e-3, no_load_optim=True))
    check_resume_point(resume_args(root))


def test_manifest_has_the_permissions_of_the_checkpoint_files(tmp_path):
    """Before: checksums_iter_*.json were 0600 (mkstemp) next to 0644 files: a teammate could not --load."""
    folder = tmp_path / checkpoints.iteration_dir_name(3)
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    os.chmod(folder / "__0_0.distcp", 0o644)
    entries = checkpoints.checksum_share(str(folder), ["__0_0.distcp"], "blake2b")
    path = checkpoints.write_manifest(str(tmp_path), 3, entries, "blake2b")
    assert os.stat(path).st_mode & 0o777 == 0o644
    os.chmod(folder / "__0_0.distcp", 0o640)
    assert os.stat(checkpoints.write_manifest(str(tmp_path), 3, entries, "blake2b")).st_mode & 0o777 == 0o640


def disk(free):
    import shutil

    return shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free)


def test_not_enough_free_space_refuses_the_save_before_writing(tmp_path, monkeypatch):
    """Before: torch's '[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598' mid-save."""
    import shutil

    from megatron.core import dist_checkpointing

    from megatron_xmod.training import patches

    root = tmp_path / "ckpt"
    (root / checkpoints.iteration_dir_name(3)).mkdir(parents=True)
    (root / checkpoints.iteration_dir_name(3) / "__0_0.distcp").write_bytes(b"x" * 5000)
    (root / checkpoints.TRACKER).write_text("3")
    writes = []
    monkeypatch.setattr(dist_checkpointing, "save", lambda state, folder, *a, **k: writes.append(folder))
    patches.disk_space_before_save(checkpoints)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk(1000))
    target = str(root / checkpoints.iteration_dir_name(6))
    with pytest.raises(checkpoints.CheckpointError, match=r"^save: not enough disk space for .*iter_0000006: the "
                                                         r"checkpoint needs about 4.9 KiB, .* has 1000 B free \(ENOSPC"):
        dist_checkpointing.save({}, target)
    assert writes == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk(1 << 30))
    dist_checkpointing.save({}, target)
    assert writes == [target]


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")])
def test_disk_full_during_a_save_names_enospc(tmp_path, monkeypatch, failure):
    import shutil

    from megatron.core import dist_checkpointing

    from megatron_xmod.training import patches

    def save(state, folder, *args, **kwargs):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: disk(0))  # the save filled the disk
        raise failure

    monkeypatch.setattr(dist_checkpointing, "save", save)
    patches.disk_space_before_save(checkpoints)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk(1 << 30))
    with pytest.raises(checkpoints.CheckpointError, match=r"^save: no space left on device \(ENOSPC\) while writing"):
        dist_checkpointing.save({}, str(tmp_path / "iter_0000003"))
    other = RuntimeError("something else")
    monkeypatch.setattr(dist_checkpointing, "save", lambda *a, **k: (_ for _ in ()).throw(other))
    patches.disk_space_before_save(checkpoints)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk(1 << 30))
    with pytest.raises(RuntimeError, match="something else"):
        dist_checkpointing.save({}, str(tmp_path / "iter_0000003"))


def test_fp16_gradients_that_stay_zero_stop_the_run(monkeypatch):
    """Before: fp16 with --loss-scale 1e-30 trained on at grad norm 0.000 and exit 0."""
    import argparse

    import megatron.training.training as training

    from megatron_xmod.training import patches

    norms = iter([0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])

    def train_step(*args, **kwargs):
        return {}, False, False, False, 0, next(norms), 0, 0

    class Optimizer:
        def get_loss_scale(self):
            return 1e-30

    monkeypatch.setattr(training, "train_step", train_step)
    monkeypatch.setattr(training, "get_args", lambda: argparse.Namespace(fp16=True, loss_scale=1e-30))
    patches.stop_on_zero_gradients()
    for _ in range(6):  # a zero norm that recovers is not stopped
        training.train_step(None, None, None, Optimizer())
    with pytest.raises(ValueError, match=r"^fp16: the gradients were all zero for 3 iterations in a row \(grad norm "
                                         r"0.0 at a loss scale of 1e-30\).*Drop --loss-scale"):
        training.train_step(None, None, None, Optimizer())


def test_launchers_ask_for_the_preemption_signal_and_pass_the_handler():
    """Before: no --exit-signal-handler and no --signal: SLURM's time limit killed the run unsaved."""
    for launcher in sorted((REPO / "slurm").glob("*.sh")):
        assert "#SBATCH --signal=TERM@" in launcher.read_text(), launcher
    generic = (REPO / "slurm" / "xmod_train.sh").read_text()
    assert "--exit-signal-handler" in generic and '--shutdown_timeout="${PREEMPT_GRACE:-240}"' in generic
    assert '"$PY" -m megatron_xmod.training.torchrun' in generic and "torch.distributed.run" not in generic
