"""Issue 27, items 1 and 2: a run's identity checked on every load, and export/import reading what the
training loop reads.

1. ``--load`` of a checkpoint of another model or data contract (K 4 -> 8, family xmod -> mod, another
   vocabulary, another tokenizer, another layout) is refused before the model is built, one line per
   field (old -> new), unless ``--xmod-allow-model-change FIELD``; what may change on resume (lr,
   iterations, data) still resumes.
2. ``xmod export-hf`` verifies the checksum manifest (``--no-verify`` to skip), names a garbage tracker
   and a missing ``.metadata``; ``xmod import-hf`` refuses a ``--save`` holding a run unless
   ``--overwrite``, and names a tensor of the wrong shape with both shapes.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from argparse import Namespace
from pathlib import Path

import hf_io_helpers
import pytest
import torch

from megatron_xmod.training.preflight import check_load
from megatron_xmod.training.run_identity import IdentityError, allowed_changes, identity_of, write_record

hf_checkpoints = hf_io_helpers.hf_checkpoints  # the session's shared checkpoints
ROUTED = dict(xmod_routing_family="xmod", xmod_layout="D + (S4*2 + D)", num_layers=4)


def run_args(ckpt, **overrides):
    """A run's parsed arguments, as far as check_load reads them."""
    fields = dict(load=str(ckpt), ckpt_step=None, finetune=False, no_load_optim=True, use_checkpoint_args=False,
                  override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False, hidden_size=64,
                  ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=16, num_experts=None,
                  xmod_sparsity_k=None, xmod_anchor_stride=None, xmod_dense_prefix=None, xmod_activated_depth=None,
                  vocab_size=256, tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_file=None,
                  merge_file=None, xmod_gate_scale_learnable=True, xmod_router_bce_coeff=1e-4, lr=3e-3, train_iters=10, data_path=["a"],
                  xmod_allow_model_change=None, **ROUTED)
    fields.update(overrides)
    return Namespace(**fields)


def write_checkpoint(ckpt: Path, saved: Namespace, iteration=6, record=False) -> Path:
    """A checkpoint in megatron's legacy ``torch`` layout with the saved args (and the identity record)."""
    folder = ckpt / f"iter_{iteration:07d}"
    (folder / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": saved, "iteration": iteration}, folder / "mp_rank_00" / "model_optim_rng.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    if record:
        write_record(saved, str(ckpt), iteration)
    return folder


def refusal(args) -> str:
    with pytest.raises(ValueError) as info:
        check_load(args)
    return str(info.value)


# ----------------------------------------------------------------------------- 1. --load
@pytest.mark.parametrize("record", [False, True], ids=["saved-args", "record"])
@pytest.mark.parametrize("change, lines", [
    (dict(xmod_layout="D + (S8*2 + D)"), ["layout: D + (S4*2 + D) -> D + (S8*2 + D)", "sparsity_k: 1,4,4,1 -> 1,8,8,1"]),
    (dict(xmod_routing_family="mod", xmod_layout="D + (S4 + D) + D"),
     ["layout: D + (S4*2 + D) -> D + (S4 + D) + D", "family: xmod -> mod", "sparsity_k: 1,4,4,1 -> 1,4,1,1"]),
    (dict(vocab_size=512), ["vocab_size: 256 -> 512"]),
    (dict(num_layers=5, xmod_layout="D + (S4*3 + D)"),
     ["layout: D + (S4*2 + D) -> D + (S4*3 + D)", "sparsity_k: 1,4,4,1 -> 1,4,4,4,1", "num_layers: 4 -> 5"]),
    (dict(xmod_gate_scale_learnable=False), ["xmod_gate_scale_learnable: True -> False"]),
], ids=["K4-to-8", "xmod-to-mod", "vocab-512", "layout", "routing"])
def test_another_model_is_refused_one_line_per_field(tmp_path, change, lines, record):
    write_checkpoint(tmp_path, run_args(tmp_path), record=record)
    message = refusal(run_args(tmp_path, **change))
    assert message.startswith(f"load: --load {tmp_path} holds a checkpoint of another model or data contract "
                              "(iter_0000006")
    for line in lines:
        assert f"\n  {line}\n" in message
    assert "--xmod-allow-model-change " + ",".join(line.split(":")[0] for line in lines) in message
    names = ",".join(line.split(":")[0] for line in lines)
    check_load(run_args(tmp_path, xmod_allow_model_change=[names], **change))  # explicitly allowed


def test_another_tokenizer_is_refused_by_type_and_by_file_hash(tmp_path):
    spm = tmp_path / "a.model"
    spm.write_bytes(b"sentencepiece 8k")
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, run_args(ckpt))
    message = refusal(run_args(ckpt, tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(spm), vocab_size=None))
    assert "\n  vocab_size: 256 -> None\n  tokenizer_type: NullTokenizer -> SentencePieceTokenizer\n" in message
    # the same type and path, another file: only the record (written at save) knows the hash
    ckpt2 = tmp_path / "ckpt2"
    saved = run_args(ckpt2, tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(spm))
    folder = write_checkpoint(ckpt2, saved, record=True)
    assert json.loads((folder / "xmod_run_identity.json").read_text())["identity"]["tokenizer_sha256"]
    check_load(saved)
    spm.write_bytes(b"another sentencepiece 8k")
    assert "\n  tokenizer_sha256: " in refusal(saved)
    check_load(run_args(ckpt2, tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(spm),
                        xmod_allow_model_change=["tokenizer-sha256"]))


def test_what_may_change_on_resume_resumes(tmp_path):
    write_checkpoint(tmp_path, run_args(tmp_path), record=True)
    check_load(run_args(tmp_path, lr=1e-4, train_iters=50, data_path=["b"], tensor_model_parallel_size=2,
                        seq_length=128, override_opt_param_scheduler=True, xmod_router_bce_coeff=1e-2,
                        xmod_token_choice_bias_tau=0.1))


def test_unknown_allowed_field_is_refused_naming_the_fields(tmp_path):
    with pytest.raises(IdentityError, match=r"^xmod_allow_model_change: 'lr' is not a field of a run's identity; "
                                            r"the fields are layout, family, sparsity_k, num_layers"):
        check_load(run_args(None, load=None, xmod_allow_model_change=["layout,lr"]))
    assert allowed_changes(run_args(None, xmod_allow_model_change=["--sparsity-k", "layout,family"])) == {
        "sparsity_k", "layout", "family"}


def test_identity_of_a_dense_and_a_moe_run():
    dense = identity_of(run_args(None, xmod_routing_family="dense", xmod_layout=None))
    assert dense["layout"] == "D*4" and dense["sparsity_k"] == "1,1,1,1" and dense["tokenizer_sha256"] is None
    moe = identity_of(run_args(None, num_experts=8, moe_router_type="dtopp", dtopp_target_experts=2.0))
    assert moe["num_experts"] == 8 and moe["moe_router_type"] == "dtopp" and moe["dtopp_target_experts"] == 2.0


# ----------------------------------------------------------------------------- through the entry point
@pytest.mark.slow
def test_resume_with_another_k_is_refused_by_the_entry_point_before_the_model_is_built(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from entry_point_helpers import common_flags, torchrun, write_byte_data

    data = write_byte_data(str(tmp_path / "bytes"))
    ckpt = tmp_path / "ckpt"
    routed = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)"]
    first = torchrun(1, ["-m", "megatron_xmod.pretrain"],
                     routed + common_flags(data, 3, "--save", str(ckpt), "--save-interval", "3", "--eval-iters", "0"),
                     check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    record = json.loads((ckpt / "iter_0000003" / "xmod_run_identity.json").read_text())["identity"]
    assert record["sparsity_k"] == "1,4,4,1" and record["tokenizer_vocab_size"] == 256
    manifest = json.loads((ckpt / "checksums_iter_0000003.json").read_text())
    assert "xmod_run_identity.json" in manifest["files"]  # covered by the checksums
    other = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S8*2 + D)"]
    resumed = torchrun(1, ["-m", "megatron_xmod.pretrain"],
                       other + common_flags(data, 3, "--load", str(ckpt), "--eval-iters", "0", "--vocab-size", "512"),
                       check=False)
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode != 0 and "exitcode: 2" in text, text[-3000:]  # the entry point's 2, under torchrun
    assert "holds a checkpoint of another model or data contract" in text
    assert "  sparsity_k: 1,4,4,1 -> 1,8,8,1" in text and "  vocab_size: 256 -> 512" in text
    assert "number of parameters on" not in text and "KeyError" not in text  # before the model is built

    # The same model, resumed wrongly (issue 27's smaller cases, through the entry point): each refused
    # with exit 2 before the model is built, naming the flag and the fix.
    for extra, message in [
        (["--train-iters", "2"], "train_iters: --train-iters 2 is below iteration 3"),  # before: a scheduler assertion
        (["--ckpt-step", "99"], "ckpt_step: --ckpt-step 99"),  # before: 'loaded unverified', then a missing folder
        (["--lr", "1e-3"], "no_load_optim: "),  # before: megatron's 'Could not find parameter group with key'
    ]:
        flags = common_flags(data, 6, "--load", str(ckpt), "--eval-iters", "0")
        resumed = torchrun(1, ["-m", "megatron_xmod.pretrain"], routed + flags + extra, check=False)
        text = resumed.stdout + resumed.stderr
        assert "exitcode: 2" in text and message in text, (extra, text[-3000:])
        assert "number of parameters on" not in text, extra


# ----------------------------------------------------------------------------- 2. export-hf, import-hf
@pytest.fixture
def dense_copy(hf_checkpoints, tmp_path):
    """A copy of the session's tiny dense run (2 iterations, with its manifest and identity record)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints("dense"), copy)
    return copy


def _export(load, out, *extra):
    from megatron_xmod.cli import main as xmod

    return xmod(["export-hf", "--load", str(load), "--output", str(out), "--dtype", "fp32", "--no-progress", *extra])


@pytest.mark.slow
def test_export_refuses_a_damaged_checkpoint_naming_the_file(dense_copy, tmp_path, capsys):
    iteration = dense_copy / "iter_0000002"
    victim = max((p for p in iteration.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 256] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 256])
    victim.write_bytes(bytes(data))
    assert _export(dense_copy, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert f"{victim}: checksum mismatch" in err and "refusing to read it" in err
    assert not (tmp_path / "hf").exists()
    os.remove(dense_copy / "checksums_iter_0000002.json")  # a checkpoint from before the manifests
    assert _export(dense_copy, tmp_path / "hf") == 2
    assert "checksums_iter_0000002.json does not exist" in capsys.readouterr().err and "--no-verify" in err + "--no-verify"
    assert _export(dense_copy, tmp_path / "hf", "--no-verify") == 0  # the escape (the weights are garbage here)


@pytest.mark.slow
def test_export_names_a_garbage_tracker_and_a_missing_metadata(dense_copy, tmp_path, capsys):
    tracker = dense_copy / "latest_checkpointed_iteration.txt"
    tracker.write_text("abc")
    assert _export(dense_copy, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert f"{tracker} holds 'abc', not an iteration number" in err and "checkpoints found: 2" in err
    assert "Traceback" not in err and "invalid literal" not in err
    tracker.write_text("2")
    os.remove(dense_copy / "iter_0000002" / ".metadata")
    assert _export(dense_copy, tmp_path / "hf", "--no-verify") == 2
    err = capsys.readouterr().err
    assert f"{dense_copy / 'iter_0000002' / '.metadata'} is missing" in err and "metadata is None" not in err


@pytest.mark.slow
def test_export_refuses_a_tokenizer_file_that_changed_since_the_save(dense_copy, tmp_path, capsys):
    record = dense_copy / "iter_0000002" / "xmod_run_identity.json"
    data = json.loads(record.read_text())
    data["identity"]["tokenizer_sha256"] = "0" * 64  # the run trained with another file than the one found now
    record.write_text(json.dumps(data))
    assert _export(dense_copy, tmp_path / "hf", "--no-verify", "--tokenizer-model", str(record)) == 2
    err = capsys.readouterr().err
    assert "would not export the model it recorded" in err and "  tokenizer_sha256: 000000000000 -> " in err


@pytest.mark.slow
def test_import_refuses_a_save_holding_a_run_and_names_a_wrong_shape(hf_checkpoints, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from megatron_xmod.cli import main as xmod

    folder = tmp_path / "hf"
    assert _export(hf_checkpoints("dense"), folder) == 0
    run = tmp_path / "run"
    shutil.copytree(hf_checkpoints("dense"), run)
    tracker = (run / "latest_checkpointed_iteration.txt").read_text()
    assert xmod(["import-hf", str(folder), "--save", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"save: --save {run} already holds a run (latest_checkpointed_iteration.txt (reading '2')" in err
    assert "pass --overwrite" in err and (run / "latest_checkpointed_iteration.txt").read_text() == tracker
    assert xmod(["import-hf", str(folder), "--save", str(run), "--overwrite"]) == 0
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (run / "iter_0000002").is_dir() and (run / "checksums_release.json").is_file()
    assert _export(run, tmp_path / "again") == 0  # the imported checkpoint verifies against its manifest
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    good = tuple(weights[name].shape)
    weights[name] = torch.zeros(good[0], good[1] + 1)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert xmod(["import-hf", str(folder), "--save", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert f"{name}: {(good[0], good[1] + 1)} in {folder}'s safetensors, the model needs {good}" in err
    assert "size mismatch" not in err and not (tmp_path / "new" / "release").exists()
