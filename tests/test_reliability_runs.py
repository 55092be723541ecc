"""Issue 16 through the entry point (slow lane): every case ends with a non-zero exit code and a
message naming the culprit, and none hangs (each launch has a subprocess timeout).

One reference run (6 iterations, saves at 3 and 6) is shared by the checkpoint cases; faults are
injected by tests/reliability_faults.py (a NaN router weight, SIGKILL in the middle of a save).
"""
import os
import shutil

import pytest
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
    result = launch(byte_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "3", iters=8)
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
