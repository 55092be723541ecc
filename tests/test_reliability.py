"""Issue 16, in-process (fast lane): the pre-flight checks of the data, tokenizer, outputs and --load;
checkpoint manifests and their verification; non-finite router logits turned into a NaN loss.

The entry-point runs (a flipped byte refused at resume, kill -9 during a save, a NaN router weight)
are in tests/test_reliability_runs.py (slow lane).
"""
import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_xmod.training import checkpoints
from megatron_xmod.training.preflight import (
    check_data,
    check_load,
    check_outputs,
    check_split,
    check_tokenizer,
    first_token_at_or_above,
    read_indexed_dataset,
)


def write_documents(prefix, documents, dtype=np.uint16) -> str:
    """Documents (lists of token ids) in megatron's .bin/.idx format, by megatron's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(torch.tensor(document, dtype=torch.int64), [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def corpus(n=12, length=40, seed=0):
    g = np.random.default_rng(seed)
    return [list(g.integers(0, 250, size=length + i)) for i in range(n)]


def data_args(prefix, **overrides):
    fields = dict(data_path=[prefix], train_data_path=None, valid_data_path=None, test_data_path=None,
                  data_args_path=None, per_split_data_args_path=None, split="90,5,5", train_iters=10,
                  train_samples=None, eval_iters=1, tokenizer_type="NullTokenizer", skip_train=False,
                  full_validation=False)
    fields.update(overrides)
    return SimpleNamespace(**fields)


# ----------------------------------------------------------------------------- .idx / .bin
def test_consistent_dataset_reads_like_megatron(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = write_documents(tmp_path / "ok", corpus())
    data = read_indexed_dataset(prefix)
    reference = IndexedDataset(prefix, mmap=True)
    assert data.num_documents == reference.document_indices.shape[0] - 1 == 12
    assert data.num_tokens == sum(len(reference[i]) for i in range(len(reference)))
    assert data.dtype is np.uint16


@pytest.mark.parametrize("damage, message", [
    ("truncate_bin", r"ok\.bin is \d+ bytes, truncated"),
    ("empty_bin", r"ok\.bin is 0 bytes, empty"),
    ("swap_bin", r"ok\.bin is \d+ bytes, larger than its index says .*swapped"),
    ("truncate_idx", r"ok\.idx is \d+ bytes but its header announces"),
    ("bin_as_idx", r"ok\.idx is not a Megatron index"),
    ("missing_bin", r"ok\.bin does not exist"),
])
def test_damaged_dataset_is_named(tmp_path, damage, message):
    prefix = write_documents(tmp_path / "ok", corpus())
    other = write_documents(tmp_path / "other", corpus(n=30, seed=1))
    bin_, idx = prefix + ".bin", prefix + ".idx"
    if damage == "truncate_bin":
        os.truncate(bin_, os.path.getsize(bin_) - 2)
    elif damage == "empty_bin":
        os.truncate(bin_, 0)
    elif damage == "swap_bin":
        shutil.copy(other + ".bin", bin_)
    elif damage == "truncate_idx":
        os.truncate(idx, os.path.getsize(idx) - 8)
    elif damage == "bin_as_idx":
        shutil.copy(bin_, idx)
    elif damage == "missing_bin":
        os.remove(bin_)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_indexed_dataset(prefix)
    # the entry point's check reaches the same error
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_data(data_args(prefix, split="50,25,25"), vocab_size=256)


# ----------------------------------------------------------------------------- token ids vs vocabulary
def test_first_token_at_or_above_matches_a_plain_scan(tmp_path, monkeypatch):
    import megatron_xmod.training.preflight as preflight

    documents = corpus(n=20)
    documents[7][13] = 300
    documents[11][2] = 999
    prefix = write_documents(tmp_path / "big", documents)
    monkeypatch.setattr(preflight, "_SCAN_TOKENS", 97)  # many chunks, boundaries inside documents
    data = read_indexed_dataset(prefix)
    for limit in (256, 301, 1000):
        expected = next(((d, p, t) for d, doc in enumerate(documents) for p, t in enumerate(doc) if t >= limit), None)
        assert first_token_at_or_above(data, limit) == expected


def test_token_id_above_vocabulary_names_the_document(tmp_path):
    documents = corpus()
    documents[5][3] = 256
    prefix = write_documents(tmp_path / "vocab", documents)
    with pytest.raises(ValueError, match=r"vocab\.bin, document 5 \(token 3\): token id 256 is not below the "
                                         r"vocabulary size 256"):
        check_data(data_args(prefix, split="50,25,25"), vocab_size=256)
    check_data(data_args(prefix, split="50,25,25"), vocab_size=257)


# ----------------------------------------------------------------------------- splits
def test_split_with_an_empty_split_names_it_and_a_working_split(tmp_path):
    """Before the fix, megatron's dataset builder spun forever on this (issue 16)."""
    prefix = write_documents(tmp_path / "few", corpus(n=12))
    with pytest.raises(ValueError, match=r"split: --split 90,5,5 leaves the validation split .* empty "
                                         r"\(12 documents.*use --split (\d+,\d+,\d+)"):
        check_data(data_args(prefix), vocab_size=256)
    try:
        check_split(data_args(prefix))
    except ValueError as error:
        suggested = str(error).split("use --split ")[1].split()[0]
    check_split(data_args(prefix, split=suggested))


def test_validation_weight_zero_with_eval_iters_is_an_error(tmp_path):
    """Before the fix: training ran, then forward_step crashed with a TypeError at the validation."""
    prefix = write_documents(tmp_path / "data", corpus(n=40))
    with pytest.raises(ValueError, match=r"split: --split 100,0,0 gives the validation split no data but "
                                         r"--eval-iters 1.*--eval-iters 0"):
        check_data(data_args(prefix, split="100,0,0"), vocab_size=256)
    check_data(data_args(prefix, split="100,0,0", eval_iters=0), vocab_size=256)


def test_forward_step_without_data_names_the_split():
    from megatron_xmod.training.step import forward_step

    with pytest.raises(ValueError, match="split: megatron asked for a batch of a split that has no data"):
        forward_step(None, torch.nn.Linear(1, 1))


def test_per_split_paths_need_validation_data_when_validating(tmp_path):
    prefix = write_documents(tmp_path / "train", corpus(n=4))
    args = data_args(None, data_path=None, train_data_path=[prefix])
    with pytest.raises(ValueError, match="valid_data_path: --train-data-path without --valid-data-path"):
        check_data(args, vocab_size=256)
    check_data(data_args(None, data_path=None, train_data_path=[prefix], valid_data_path=[prefix]), vocab_size=256)


# ----------------------------------------------------------------------------- tokenizer, outputs
def tokenizer_args(**overrides):
    fields = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=None, tokenizer_model=None,
                  vocab_size=None)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_tokenizer_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="vocab_file: --tokenizer-type GPT2BPETokenizer reads its vocabulary"):
        check_tokenizer(tokenizer_args())
    with pytest.raises(FileNotFoundError, match="vocab_file: --vocab-file .*nowhere.json does not exist"):
        check_tokenizer(tokenizer_args(vocab_file=str(tmp_path / "nowhere.json"), merge_file="x"))
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    merges.write_text("#version: 0.2\na b\n")
    check_tokenizer(tokenizer_args(vocab_file=str(vocab), merge_file=str(merges)))
    vocab.write_text("not json")
    with pytest.raises(ValueError, match="vocab_file: --vocab-file .*vocab.json does not parse as a JSON object"):
        check_tokenizer(tokenizer_args(vocab_file=str(vocab), merge_file=str(merges)))
    model = tmp_path / "bad.model"
    model.write_bytes(os.urandom(200))
    with pytest.raises(ValueError, match="tokenizer_model: --tokenizer-model .*bad.model is not a SentencePiece model"):
        check_tokenizer(tokenizer_args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(model)))
    with pytest.raises(ValueError, match="vocab_size: --tokenizer-type NullTokenizer needs --vocab-size"):
        check_tokenizer(tokenizer_args(tokenizer_type="NullTokenizer"))


def test_hub_tokenizer_is_never_fetched(monkeypatch):
    from huggingface_hub import constants

    from megatron_xmod.training.preflight import check_before_megatron_setup

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "")  # recorded, so the test's changes are undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    args = tokenizer_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="no-such-org/no-such-model-xmod",
                          save=None, tensorboard_dir=None, wandb_save_dir=None, data_cache_path=None)
    with pytest.raises(ValueError, match="tokenizer_model: --tokenizer-model no-such-org/no-such-model-xmod is neither "
                                         "a local directory nor in the HF cache"):
        check_before_megatron_setup(args)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True


def test_unwritable_outputs_are_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    outputs = dict(save=None, tensorboard_dir=None, wandb_save_dir=None, data_cache_path=None)
    with pytest.raises(ValueError, match=r"save: --save .*a_file/ckpt cannot be created \(its parent .*a_file is a file"):
        check_outputs(SimpleNamespace(**{**outputs, "save": str(blocker / "ckpt")}))
    # /proc refuses new files even to root (os.access would say yes)
    with pytest.raises(ValueError, match="tensorboard_dir: --tensorboard-dir /proc/xmod_tb is not writable"):
        check_outputs(SimpleNamespace(**{**outputs, "tensorboard_dir": "/proc/xmod_tb"}))
    check_outputs(SimpleNamespace(**{**outputs, "save": str(tmp_path / "new" / "ckpt")}))
    assert not (tmp_path / "new").exists()  # checked, nothing created


# ----------------------------------------------------------------------------- checkpoints
def fake_checkpoint(root, iteration, files=None, tracker=True):
    directory = root / checkpoints.iteration_dir_name(iteration)
    directory.mkdir(parents=True)
    for name, content in (files or {"__0_0.distcp": os.urandom(3000), ".metadata": b"meta", "sub/common.pt": b"c"}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    algorithm = checkpoints.checksum_algorithm()
    entries = checkpoints.checksum_share(str(directory), checkpoints.checkpoint_files(str(directory)), algorithm)
    checkpoints.write_manifest(str(root), iteration, entries, algorithm)
    if tracker:
        (root / checkpoints.TRACKER).write_text(str(iteration))
    return directory


def test_manifest_is_atomic_and_verifies(tmp_path):
    directory = fake_checkpoint(tmp_path, 6)
    manifest = json.loads((tmp_path / "checksums_iter_0000006.json").read_text())
    assert set(manifest["files"]) == {"__0_0.distcp", ".metadata", "sub/common.pt"}
    assert manifest["files"]["__0_0.distcp"]["size"] == 3000
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp_")] == []  # no temporary left
    assert checkpoints.verify_iteration(str(tmp_path), 6)[1] == []
    assert checkpoints.verify_before_load(str(tmp_path)) == 6
    # sharded over 3 "ranks", the shares cover every file exactly once
    shares = [checkpoints.verify_share(str(tmp_path), 6, manifest, rank, 3) for rank in range(3)]
    assert shares == [[], [], []]
    assert directory.is_dir()


@pytest.mark.parametrize("algorithm", ["xxh3_128", "blake2b"])
def test_flipped_byte_truncation_and_missing_file_are_named(tmp_path, monkeypatch, algorithm):
    if algorithm == "xxh3_128":
        pytest.importorskip("xxhash")
    monkeypatch.setattr(checkpoints, "checksum_algorithm", lambda: algorithm)
    directory = fake_checkpoint(tmp_path, 3)
    data = bytearray((directory / "__0_0.distcp").read_bytes())
    data[1234] ^= 0x01
    (directory / "__0_0.distcp").write_bytes(bytes(data))
    os.truncate(directory / ".metadata", 2)
    os.remove(directory / "sub" / "common.pt")
    (directory / "late.pt").write_bytes(b"x")
    problems = checkpoints.verify_iteration(str(tmp_path), 3)[1]
    assert any("__0_0.distcp: checksum mismatch" in p for p in problems)
    assert any(".metadata: 2 bytes, the manifest says 4" in p for p in problems)
    assert any("common.pt: missing" in p for p in problems)
    assert any("late.pt: not in the manifest" in p for p in problems)
    with pytest.raises(checkpoints.CheckpointError, match=r"(?s)refusing to load it:\n.*__0_0.distcp: checksum mismatch"):
        checkpoints.verify_before_load(str(tmp_path))


def test_missing_or_garbage_tracker_is_an_error(tmp_path):
    fake_checkpoint(tmp_path, 3, tracker=False)
    fake_checkpoint(tmp_path, 6, tracker=False)
    args = SimpleNamespace(load=str(tmp_path), ckpt_step=None)
    with pytest.raises(checkpoints.CheckpointError, match=r"holds checkpoints of iterations 3, 6 but no "
                                                           r"latest_checkpointed_iteration.txt.*--ckpt-step 6"):
        check_load(args)
    check_load(SimpleNamespace(load=str(tmp_path), ckpt_step=6))  # an explicit iteration needs no tracker
    (tmp_path / checkpoints.TRACKER).write_text("six\n")
    with pytest.raises(checkpoints.CheckpointError, match=r"holds 'six', not an iteration number.*found: 3, 6"):
        check_load(args)
    (tmp_path / checkpoints.TRACKER).write_text("9")
    with pytest.raises(ValueError, match="names iteration 9 but .*iter_0000009 does not exist"):
        check_load(args)
    check_load(SimpleNamespace(load=str(tmp_path / "fresh"), ckpt_step=None))  # nothing there: a fresh start


def test_incomplete_iteration_is_set_aside_before_saving_it_again(tmp_path):
    """megatron refuses to save into the non-empty directory a killed save left behind."""
    fake_checkpoint(tmp_path, 3)
    partial = fake_checkpoint(tmp_path, 6, tracker=False)  # the tracker still names 3
    moved = checkpoints.set_aside_incomplete(str(tmp_path), 6)
    assert moved is not None and not partial.exists() and os.path.isdir(moved)
    assert checkpoints.iterations_found(str(tmp_path)) == [3]
    assert not os.path.exists(checkpoints.manifest_path(str(tmp_path), 6))
    assert checkpoints.set_aside_incomplete(str(tmp_path), 3) is None  # the tracked checkpoint stays


def test_missing_manifest_loads_unverified(tmp_path, capsys):
    fake_checkpoint(tmp_path, 2)
    os.remove(tmp_path / "checksums_iter_0000002.json")
    assert checkpoints.verify_before_load(str(tmp_path)) is None
    assert "loaded unverified" in capsys.readouterr().out


def test_non_finite_weights_refuse_the_save():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    checkpoints.check_finite_before_save([model], 5)  # finite: no error
    with torch.no_grad():
        model[1].weight[0, 2] = float("inf")
    with pytest.raises(checkpoints.CheckpointError, match=r"save: the weights at iteration 5 are not finite "
                                                           r"\(1.weight hold NaN/Inf\); no checkpoint was written"):
        checkpoints.check_finite_before_save([model], 5)


def test_ckpt_verify_command_exit_codes(tmp_path, capsys):
    from megatron_xmod.cli import main

    directory = fake_checkpoint(tmp_path, 4)
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert "iter_0000004: OK (3 files" in capsys.readouterr().out
    data = bytearray((directory / "__0_0.distcp").read_bytes())
    data[0] ^= 0xFF
    (directory / "__0_0.distcp").write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(tmp_path), "--iteration", "4"]) == 1
    assert "__0_0.distcp: checksum mismatch" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path), "--rewrite"]) == 0  # trust the files as they are now
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    (tmp_path / checkpoints.TRACKER).write_text("garbage")
    assert main(["ckpt", "verify", str(tmp_path)]) == 2
    assert "not an iteration number" in capsys.readouterr().err
    assert main(["ckpt", "verify", str(tmp_path / "nowhere")]) == 2


# ----------------------------------------------------------------------------- non-finite routing
def test_loss_becomes_nan_and_names_the_layer(capsys):
    from megatron_xmod.training.step import loss_func

    mask = torch.ones(2, 8)
    output = torch.rand(2, 8)
    clean, tokens, reports = loss_func(mask, None, None, None, output)
    zero = loss_func(mask, None, None, None, output, nonfinite=([2, 3], torch.tensor([0.0, 0.0])))[0]
    assert torch.equal(zero, clean) and torch.isfinite(clean)  # bit-identical when all logits are finite
    bad, _, bad_reports = loss_func(mask, None, None, None, output, nonfinite=([2, 3, 5], torch.tensor([0.0, 16.0, 4.0])))
    assert torch.isnan(bad) and torch.isnan(bad_reports["lm loss"][0])
    out = capsys.readouterr().out
    assert "non-finite router logits in layer 3 (16 values), layer 5 (4 values)" in out and "layer 2" not in out


@pytest.mark.parametrize("rule", ["topk", "threshold"])
def test_sparse_layer_counts_nonfinite_logits(seeded, rule):
    """Before the fix, threshold routing on NaN logits routed no token: the layer was skipped silently."""
    from helpers import tiny_model

    from megatron_xmod.training.step import nonfinite_since, nonfinite_totals
    from megatron_xmod.xmod.routing_state import eval_routing, report

    model, _ = tiny_model("D + S4*2 + D")
    layer = next(m for m in model.modules() if getattr(m, "layer_number", None) == 2 and hasattr(m, "router"))
    tokens = torch.randint(0, 256, (2, 64))
    positions = torch.arange(64).expand(2, 64)
    model.eval()
    with torch.no_grad(), eval_routing(model, rule):
        before = nonfinite_totals(model)
        clean = model(tokens, positions, None)
        layers, counts = nonfinite_since(model, before)
        assert layers == [2, 3] and counts.tolist() == [0.0, 0.0]
        layer.router.weight[0, 0] = float("nan")
        before = nonfinite_totals(model)
        model(tokens, positions, None)
        layers, counts = nonfinite_since(model, before)
    assert counts[0].item() == 64 * 2  # every logit of layer 2
    assert torch.isfinite(clean).all()
    assert report(model)["nonfinite_router_logits/layer_002"] > 0


def test_dtopp_router_counts_nonfinite_logits(seeded):
    from test_dtopp import make_config, make_routers

    from megatron_xmod.xmod.routing_state import report

    routers = make_routers(make_config(), layers=2)
    x = torch.randn(8, 2, 32)
    with torch.no_grad():
        routers[1].weight[3, :] = float("nan")
        for router in routers:
            router(x)
    stats = report(routers)
    assert stats["nonfinite_router_logits/layer_001"] == 0
    assert stats["nonfinite_router_logits/layer_002"] == 16  # 16 tokens x expert 3
