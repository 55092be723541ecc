"""Issue 16 through the entry point (slow lane): every case ends with a non-zero exit code and a
message naming the culprit, and none hangs (each launch has a subprocess timeout).

One reference run (6 iterations, saves at 3 and 6) is shared by the checkpoint cases; faults are
injected by tests/reliability_faults.py (a NaN router weight, SIGKILL in the middle of a save).
"""
import os
import shutil

import numpy as np
import pytest
import torch
from entry_point_helpers import common_flags, torchrun, train_losses, write_byte_data
from test_reliability import corpus, write_documents

from megatron_xmod.training import checkpoints

pytestmark = pytest.mark.slow

ITERS = 6
ROUTED = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2 + D"]
ENTRY = ["-m", "megatron_xmod.pretrain"]
FAULTS = ["tests/reliability_faults.py"]
MODEL_BUILT = "number of parameters on"  # megatron prints it once the model exists


def launch(data, *extra, fault=None, iters=ITERS, timeout=900):
    target = ENTRY if fault is None else [*FAULTS, fault]
    return torchrun(1, target, ROUTED + common_flags(data, iters, *extra), check=False, timeout=timeout)


def output(result) -> str:
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    return write_byte_data(str(tmp_path_factory.mktemp("data") / "bytes"))


@pytest.fixture(scope="module")
def reference(byte_data, tmp_path_factory):
    """(checkpoint directory, {iteration: lm loss}) of an uninterrupted run saving at 3 and 6."""
    ckpt = tmp_path_factory.mktemp("reference") / "ckpt"
    result = launch(byte_data, "--save", str(ckpt), "--save-interval", "3")
    assert result.returncode == 0, output(result)[-5000:]
    return ckpt, train_losses(result.stdout)


def copy_of(ckpt, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(ckpt, target)
    return target


def test_every_save_has_a_manifest_that_verifies(reference):
    ckpt, losses = reference
    assert sorted(losses) == list(range(1, ITERS + 1))
    for iteration in (3, 6):
        manifest, problems = checkpoints.verify_iteration(str(ckpt), iteration)
        assert manifest is not None and problems == []
        on_disk = checkpoints.checkpoint_files(str(ckpt / checkpoints.iteration_dir_name(iteration)))
        assert sorted(manifest["files"]) == on_disk and len(on_disk) >= 2


def test_flipped_byte_is_refused_at_resume_naming_the_file(reference, byte_data, tmp_path):
    """Before the fix the damaged checkpoint loaded as 'successfully loaded' and NaN followed."""
    ckpt = copy_of(reference[0], tmp_path)
    shard = max((ckpt / "iter_0000006").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    # 8 iterations resume the 6-iteration run's checkpoint on a longer schedule: the pre-flight (issue 26)
    # asks for --override-opt_param-scheduler, without which megatron would stop at load anyway
    result = launch(byte_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "3",
                    "--override-opt_param-scheduler", iters=8)
    assert result.returncode != 0
    text = output(result)
    assert f"{shard}: checksum mismatch" in text and "refusing to load it" in text
    assert "iteration        7/" not in text


def test_missing_tracker_is_an_error_before_the_model_is_built(reference, byte_data, tmp_path):
    """Before the fix: a silent fresh start next to the old checkpoints, exit 0."""
    ckpt = copy_of(reference[0], tmp_path)
    os.remove(ckpt / checkpoints.TRACKER)
    result = launch(byte_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "3", timeout=600)
    assert result.returncode != 0
    text = output(result)
    assert "holds checkpoints of iterations 3, 6 but no latest_checkpointed_iteration.txt" in text
    assert MODEL_BUILT not in text


def test_kill_9_during_a_save_resumes_from_the_last_complete_checkpoint(reference, byte_data, tmp_path):
    """SIGKILL while iteration 6 is being saved (a shard half written, the tracker not yet updated):
    the resume loads iteration 3, verified, and reproduces the uninterrupted run's losses."""
    ckpt = tmp_path / "ckpt"
    killed = launch(byte_data, "--save", str(ckpt), "--save-interval", "3", fault="kill-during-save:6")
    assert killed.returncode != 0
    assert (ckpt / checkpoints.TRACKER).read_text().strip() == "3"
    assert (ckpt / "iter_0000006").is_dir() and not os.path.exists(checkpoints.manifest_path(str(ckpt), 6))
    resumed = launch(byte_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "3")
    assert resumed.returncode == 0, output(resumed)[-5000:]
    assert "checkpoint iteration 3 of" in resumed.stdout and "verified against its manifest" in resumed.stdout
    # megatron would refuse to save 6 into the half-written directory: it is moved aside first
    assert "iter_0000006 was not a complete checkpoint" in resumed.stdout
    losses, expected = train_losses(resumed.stdout), reference[1]
    assert sorted(losses) == [4, 5, 6]
    # the 2nd logged iteration after a start is megatron's average of two (training.py should_reset)
    for iteration in (4, 6):
        assert losses[iteration] == expected[iteration], (iteration, losses[iteration], expected[iteration])
    assert checkpoints.verify_iteration(str(ckpt), 6)[1] == []  # the resumed run re-saved 6 completely


def saved_state(ckpt, iteration):
    """({name: tensor} of weights and Adam moments, megatron's RNG states) of a saved iteration."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt / checkpoints.iteration_dir_name(iteration)))
    items = reader.read_metadata().state_dict_metadata.items()
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in items if isinstance(v, TensorStorageMetadata)}
    rng = {k: io.BytesIO() for k, v in items if isinstance(v, BytesStorageMetadata) and k.startswith("rng_state")}
    loaded = {**tensors, **rng}
    dcp.load(loaded, storage_reader=reader, no_dist=True)  # replaces the BytesIO values by the objects
    (states,) = (loaded[k] for k in rng)  # one rank: [[{random_rng_state, np_rng_state, torch_rng_state, ...}]]
    while isinstance(states, list):
        (states,) = states
    return tensors, states


def same(a, b) -> bool:
    """Equality of nested RNG states (tuples, lists, dicts of tensors, numpy arrays, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


def test_resume_without_rng_state_is_bit_exact(reference, byte_data, tmp_path):
    """A --no-load-rng resume from iteration 3 trains bit for bit like the uninterrupted run.

    What looks like a difference (e.g. 5.5899 vs 5.5863 at the 2nd iteration after a
    resume, equal again by the 3rd) is megatron's console: training_log does not reset its loss sums
    at a run's first iteration (training.py ``should_reset = not is_first_iteration``), so with
    --log-interval 1 the 2nd line of every run prints the mean of that run's first two iterations.
    """
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(reference[0] / "iter_0000003", ckpt / "iter_0000003")
    shutil.copy(checkpoints.manifest_path(str(reference[0]), 3), checkpoints.manifest_path(str(ckpt), 3))
    (ckpt / checkpoints.TRACKER).write_text("3")
    resumed = launch(byte_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "3", "--no-load-rng")
    assert resumed.returncode == 0, output(resumed)[-5000:]
    # weights and optimizer moments after iteration 6: bit-equal, every tensor
    (expected, expected_rng), (got, got_rng) = saved_state(reference[0], 6), saved_state(ckpt, 6)
    assert expected.keys() == got.keys() and sum("optimizer.state.exp_avg_sq" in k for k in got) > 20
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    losses, ref = train_losses(resumed.stdout), reference[1]
    assert losses[4] == ref[4] and losses[6] == ref[6]
    # the console's 2nd line after the start: mean of iterations 4 and 5 (printed with 7 digits)
    assert losses[5] == pytest.approx((ref[4] + ref[5]) / 2, abs=2e-6) and abs(losses[5] - ref[5]) > 1e-3
    # training draws no random numbers: between the saves at 3 and 6 of the uninterrupted run the only
    # draw is torch's, one number, when the validation at iteration 4 opens a new DataLoader iterator
    # (torch seeds its workers from the default generator; patch 16 restarts validation every time)
    at_3 = saved_state(reference[0], 3)[1]
    for name in ("random_rng_state", "np_rng_state", "rng_tracker_states"):
        assert same(at_3[name], expected_rng[name]), name
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(at_3["torch_rng_state"])
        assert not torch.equal(torch.get_rng_state(), expected_rng["torch_rng_state"])
        torch.empty((), dtype=torch.int64).random_()
        assert torch.equal(torch.get_rng_state(), expected_rng["torch_rng_state"])
    # hence --no-load-rng ends where the uninterrupted run does: the same seed, the same start-up and
    # validation draws (a default resume restores the state saved at 3 and then opens the iterators)
    assert all(same(got_rng[name], expected_rng[name]) for name in expected_rng)


def test_nan_router_weight_names_the_layer_and_saves_nothing(byte_data, tmp_path):
    """Before the fix: top-k routed the NaN positions, and a checkpoint of NaN weights was written."""
    ckpt = tmp_path / "ckpt"
    result = launch(byte_data, "--save", str(ckpt), "--save-interval", "100", fault="nan-router:2")
    assert result.returncode != 0
    text = output(result)
    assert "non-finite router logits in layer 2 (128 values)" in text
    # megatron applies iteration 1's NaN update before its rerun machine validates anything, so by the
    # save on its exit path every weight is NaN: the refusal names the first one
    assert "save: the weights at iteration" in text and "hold NaN/Inf" in text and "no checkpoint was written" in text
    assert checkpoints.iterations_found(str(ckpt)) == []


def test_nan_exit_path_without_save_is_a_message_not_a_type_error(byte_data, tmp_path):
    """Before the fix megatron's save-and-exit path crashed with os.path.join(None, ...): TypeError."""
    result = launch(byte_data, fault="nan-router:2")
    assert result.returncode != 0
    text = output(result)
    assert "the run has no --save; pass --save DIR" in text
    assert "TypeError" not in text


def test_split_without_documents_fails_fast_instead_of_hanging(tmp_path):
    """Before the fix megatron's dataset builder spun forever (the timeout would fail this test)."""
    prefix = write_documents(tmp_path / "few", corpus(n=12))
    result = launch(prefix, timeout=600)
    assert result.returncode != 0
    text = output(result)
    assert "split: --split 90,5,5 leaves the validation split" in text and "12 documents" in text
    assert MODEL_BUILT not in text


def test_missing_vocab_file_is_named_by_the_dry_run_without_a_hub(byte_data, tmp_path):
    """Before the fix a missing --vocab-file spent a minute trying to reach a model hub, unnamed."""
    import subprocess
    import sys

    from entry_point_helpers import REPO

    argv = [a for a in ROUTED + common_flags(byte_data, ITERS) if a not in ("NullTokenizer",)]
    argv[argv.index("--tokenizer-type") + 1:argv.index("--tokenizer-type") + 1] = ["GPT2BPETokenizer"]
    env = dict(os.environ, WORLD_SIZE="1", HF_HUB_OFFLINE="")
    result = subprocess.run([sys.executable, "-m", "megatron_xmod.training.dry_run", *argv], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, output(result)[-3000:]
    assert "vocab_file: --tokenizer-type GPT2BPETokenizer reads its vocabulary from --vocab-file" in result.stderr
