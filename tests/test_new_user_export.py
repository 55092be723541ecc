"""A new user's export, evaluation and texts (issue 26, items 8 and 9).

Export: a run on data pre-tokenized by the user's own tokenizer (megatron's NullTokenizer with its own
``--vocab-size``) exports with that tokenizer (``--hf-tokenizer``, checked against the checkpoint's
vocabulary), or its weights only and the tokenizer later (``xmod add-tokenizer``); every exported file
gets the permissions of the rest of the folder. lm-eval tasks from the user's own held-out text.
Texts: the entry point's --help states each default once and truthfully, examples/own_data_cpu.sh
finds the repository's venv or says how to make one, the Jaccard of two layers that routed nothing
is not 1, and the routing report numbers blocks as the start-up summary does.
"""
import argparse
import collections
import copy
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import hf_io_helpers
import pytest
import torch
from helpers import english_bytes, tiny_model

from megatron_xmod.cli import main as xmod

REPO = Path(__file__).resolve().parents[1]
hf_checkpoints = hf_io_helpers.hf_checkpoints  # the session's shared checkpoints
SAMPLE = "the module provides a class for the object of the data and the file"


# --- a user's own tokenizer and a run pre-tokenized with it -------------------------------------------

def word_tokenizer(folder: Path, size: int) -> Path:
    """A tokenizer of the user's own: word level, the ``size - 2`` most frequent words of English prose
    plus unknown and end-of-document tokens, saved with ``save_pretrained``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = re.findall(r"\w+|[^\w\s]", bytes(english_bytes().tolist()).decode("utf-8"))
    common = sorted(collections.Counter(words).items(), key=lambda item: (-item[1], item[0]))[: size - 2]
    vocab = {"[UNK]": 0, "<eod>": 1, **{word: i + 2 for i, (word, _) in enumerate(common)}}
    assert len(vocab) == size
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eod>")
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def user_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_tokenizers")
    return {size: word_tokenizer(root / f"tok{size}", size) for size in (200, 300)}


@pytest.fixture(scope="module")
def pretokenized(hf_checkpoints, tmp_path_factory):
    """The checkpoint of a NullTokenizer run with ``--vocab-size 200`` (ids of a 200-token tokenizer;
    megatron pads the embedding to 256 rows): the session's tiny dense run with that vocabulary,
    saved by megatron's dist-checkpointing."""
    from megatron_xmod.hf.checkpoint_io import load_checkpoint, save_checkpoint

    loaded = load_checkpoint(hf_checkpoints("dense"))
    args = copy.deepcopy(loaded.args)
    assert args.tokenizer_type == "NullTokenizer" and args.padded_vocab_size == 256
    args.vocab_size = 200
    save = tmp_path_factory.mktemp("pretokenized") / "ckpt"
    save_checkpoint(loaded.state_dict, args, save)
    return save


def _no_tensors_read(monkeypatch):
    import megatron_xmod.hf.checkpoint_io as checkpoint_io

    def refuse(*args, **kwargs):
        raise AssertionError("the export read the checkpoint's tensors before refusing")

    monkeypatch.setattr(checkpoint_io, "load_checkpoint", refuse)


@pytest.mark.slow
def test_pretokenized_run_exports_with_the_users_tokenizer(pretokenized, user_tokenizers, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "hf"
    assert xmod(["export-hf", "--load", str(pretokenized), "--output", str(out), "--dtype", "fp32", "--no-progress",
                 "--hf-tokenizer", str(user_tokenizers[200])]) == 0
    printed = capsys.readouterr().out
    assert f"tokenizer: {user_tokenizers[200]}, 200 tokens" in printed
    mine = AutoTokenizer.from_pretrained(str(user_tokenizers[200]))
    exported = AutoTokenizer.from_pretrained(str(out))
    ids = exported(SAMPLE)["input_ids"]
    assert ids == mine(SAMPLE)["input_ids"] and len(exported) == 200 and max(ids) < 200
    assert ids != list(SAMPLE.encode())  # not the byte tokenizer
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == exported.eos_token_id == 1
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), 256)


@pytest.mark.slow
def test_tokenizer_model_of_a_null_tokenizer_run_is_used_not_ignored(pretokenized, user_tokenizers, tmp_path):
    from transformers import AutoTokenizer

    from megatron_xmod.hf.export import export_checkpoint

    result = export_checkpoint(pretokenized, tmp_path / "hf", dtype="fp32", progress=False,
                               tokenizer_model=user_tokenizers[200])
    assert "taken as --hf-tokenizer" in result.tokenizer
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "hf"))) == 200


@pytest.mark.slow
def test_a_tokenizer_of_another_size_is_refused_before_any_tensor_is_read(hf_checkpoints, pretokenized,
                                                                          user_tokenizers, tmp_path, monkeypatch,
                                                                          capsys):
    from megatron_xmod.hf.export import export_checkpoint

    _no_tensors_read(monkeypatch)
    with pytest.raises(ValueError, match=r"^hf_tokenizer: .*tok300 has 300 tokens but the checkpoint was trained "
                                         r"with --vocab-size 200 .*; fix: "):
        export_checkpoint(pretokenized, tmp_path / "a", hf_tokenizer=user_tokenizers[300], progress=False)
    with pytest.raises(ValueError, match=r"^hf_tokenizer: .*tok200 has 200 tokens .* --vocab-size 256 "):
        export_checkpoint(hf_checkpoints("dense"), tmp_path / "b", tokenizer_model=user_tokenizers[200],
                          progress=False)  # the byte run: --tokenizer-model is the user's tokenizer there too
    with warnings.catch_warnings():  # a library's deprecation warning, printed once a process, is not our message
        warnings.simplefilter("ignore")
        assert xmod(["export-hf", "--load", str(pretokenized), "--output", str(tmp_path / "c"),
                     "--hf-tokenizer", str(tmp_path / "nowhere")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "hf_tokenizer: " in error and "does not exist; fix: " in error
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.slow
def test_pretokenized_run_without_a_tokenizer_exports_weights_only_and_takes_one_later(pretokenized,
                                                                                       user_tokenizers, tmp_path,
                                                                                       capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "hf"
    assert xmod(["export-hf", "--load", str(pretokenized), "--output", str(out), "--dtype", "fp32",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "weights only, no tokenizer written" in printed and "--vocab-size 200" in printed
    assert f"xmod add-tokenizer {out} --hf-tokenizer PATH" in printed
    assert not list(out.glob("tokenizer*")) and (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)  # the weights alone load
    assert xmod(["add-tokenizer", str(out), "--hf-tokenizer", str(user_tokenizers[300])]) == 2
    assert re.search(r"hf_tokenizer: .* has 300 tokens .* --vocab-size 200", capsys.readouterr().err)
    assert xmod(["add-tokenizer", str(out), "--hf-tokenizer", str(user_tokenizers[200])]) == 0
    assert "200 tokens" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer(SAMPLE)["input_ids"] == AutoTokenizer.from_pretrained(str(user_tokenizers[200]))(SAMPLE)["input_ids"]
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == tokenizer.eos_token_id == 1
    umask = os.umask(0)
    os.umask(umask)
    assert {path.name for path in out.iterdir() if stat.S_IMODE(path.stat().st_mode) != 0o666 & ~umask} == set()
    assert xmod(["add-tokenizer", str(out), "--hf-tokenizer", str(user_tokenizers[200])]) == 2
    assert "already has a tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_every_exported_file_gets_the_permissions_of_the_folder(hf_checkpoints, tmp_path):
    from megatron_xmod.hf.export import export_checkpoint

    old = os.umask(0o022)
    try:
        out = tmp_path / "hf"
        export_checkpoint(hf_checkpoints("dense"), out, dtype="fp32", max_shard_size="200KB", progress=False)
    finally:
        os.umask(old)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert len([name for name in modes if name.endswith(".safetensors")]) > 1  # sharded: several weight files
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {name: mode for name, mode in modes.items() if mode != 0o644} == {}


def test_vocabulary_check_of_a_run_with_a_tokenizer_file(user_tokenizers):
    """Other runs record only the padded vocabulary: the tokenizer must pad to the same rows."""
    from transformers import AutoTokenizer

    from megatron_xmod.hf.tokenizer_export import check_vocabulary

    args = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", padded_vocab_size=256,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1)
    for size in (200, 300):
        tokenizer = AutoTokenizer.from_pretrained(str(user_tokenizers[size]))
        if size == 200:
            check_vocabulary(tokenizer, args, "tok200")  # 200 pads to 256 rows
        else:
            with pytest.raises(ValueError, match=r"^hf_tokenizer: tok300 has 300 tokens \(padded: 384 rows\) but the "
                                                 r"checkpoint's vocabulary has 256 embedding rows; fix: "):
                check_vocabulary(tokenizer, args, "tok300")
    small = argparse.Namespace(**{**vars(args), "padded_vocab_size": 512})
    with pytest.raises(ValueError, match="has 200 tokens \\(padded: 256 rows\\) but .* 512 embedding rows"):
        check_vocabulary(AutoTokenizer.from_pretrained(str(user_tokenizers[200])), small, "tok200")


# --- lm-eval tasks from your own held-out text -------------------------------------------------------

def _held_out(path: Path, name: str, lines: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = path / f"{name}.txt"
    text.write_text("\n".join(f"{name} line {i}: what the model has not seen, number {i * 7}." for i in range(lines))
                    + "\n\n")
    return text


def test_eval_tasks_are_built_from_your_own_held_out_text(tmp_path, capsys):
    from megatron_xmod.hf.eval_tasks import main

    notes, diary = _held_out(tmp_path / "a", "notes", 30), _held_out(tmp_path / "b", "diary", 12)
    twin = _held_out(tmp_path / "c", "notes", 10)  # the same file name twice: numbered
    out = tmp_path / "tasks"
    assert main(["--out", str(out), "--held-out", str(notes), str(diary), str(twin), "--next-line-per-work", "5",
                 "--perplexity-max-chars", "150"]) == 0
    printed = capsys.readouterr().out
    assert str(notes) in printed and f"--include_path {out}" in printed
    docs = [json.loads(line) for line in (out / "next_line.jsonl").read_text().splitlines()]
    assert sorted({d["work"] for d in docs}) == ["diary", "notes", "notes_2"] and len(docs) == 15
    for doc in docs:
        lines = {"notes": notes, "diary": diary, "notes_2": twin}[doc["work"]].read_text().splitlines()
        first, second = doc["context"].rstrip("\n").split("\n")
        i = lines.index(second)
        assert lines[i - 1] == first and doc["choices"][doc["label"]] == lines[i + 1]
        assert all(choice in lines for choice in doc["choices"])
    texts = [json.loads(line) for line in (out / "perplexity.jsonl").read_text().splitlines()]
    assert all(len(t["text"]) <= 150 for t in texts)
    assert "\n".join(t["text"] for t in texts if t["work"] == "notes").split("\n") == \
        [line for line in notes.read_text().splitlines() if line]
    for task in ("xmod_next_line", "xmod_perplexity"):
        assert str(out) in (out / f"{task}.yaml").read_text()


def test_eval_tasks_refuse_held_out_text_they_cannot_use(tmp_path, capsys):
    from megatron_xmod.hf.eval_tasks import main

    short = _held_out(tmp_path, "short", 3)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait, a line long enough\n".encode("latin-1") * 8)
    for path, message in ((tmp_path / "missing.txt", "is not a file; fix: "),
                          (short, "has 3 distinct lines of >= 12 characters; the next-line task needs at least 4"),
                          (latin, "is not UTF-8 text (byte 3); fix: ")):
        assert main(["--out", str(tmp_path / "tasks"), "--held-out", str(path)]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and f"held_out: {path} {message}" in error
    assert not (tmp_path / "tasks").exists()


def test_readme_lm_eval_command_sets_the_batch_size():
    for doc in (REPO / "README.md", REPO / "docs" / "hf.md"):
        commands = [block for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.DOTALL) if "lm_eval" in block]
        assert commands, doc
        for block in commands:
            command = block.replace("\\\n", " ")
            line = next(line for line in command.splitlines() if "lm_eval " in line)
            assert re.search(r"--batch_size \d+", line), (doc.name, line)


# --- the entry point's --help -------------------------------------------------------------------------

OUR_GROUPS = ("X-MoD", "MoE / DTop-p")


@pytest.fixture(scope="module")
def real_help():
    env = dict(os.environ, COLUMNS="100")
    result = subprocess.run([sys.executable, "-m", "megatron_xmod.pretrain", "--help"], capture_output=True, text=True,
                            timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _entries(text: str) -> dict[str, tuple[argparse.Action, str]]:
    """{flag: (action, its help as printed)} of the plugin's groups, read from the printed --help."""
    from megatron_xmod.cpu_shim import cpu_patches
    from megatron_xmod.training.pretrain import build_parser

    with cpu_patches(training=False):
        parser = build_parser()
    formatter = parser._get_formatter()
    out = {}
    for group in parser._action_groups:
        if group.title not in OUR_GROUPS:
            continue
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS:
                continue
            invocation = formatter._format_action_invocation(action)
            found = re.search(r"\n  " + re.escape(invocation) + r"(.*?)(?=\n  -|\n\n|\Z)", text, re.DOTALL)
            assert found, invocation
            out[action.option_strings[0]] = (action, " ".join(found.group(1).split()))
    return out


def test_pretrain_help_states_each_default_once_and_truthfully(real_help):
    entries = _entries(real_help)
    assert len(entries) > 30
    for flag, (action, text) in entries.items():
        assert len(re.findall(r"default", text, re.IGNORECASE)) <= 1, f"{flag}: {text}"
        if action.nargs == 0:  # a switch: "True"/"None" would read as "on by default"
            assert "(default: True)" not in text and "(default: None)" not in text, f"{flag}: {text}"
        assert text, f"{flag} has no help"
    gate = entries["--xmod-fixed-gate-scale"][1]
    assert "default: off, varsigma is learned" in gate
    assert entries["--xmod-dense-prefix"][1].endswith("for MoD what fills the activated depth)")
    assert entries["--dtopp-kp"][1] == "K_pro (default: 0.1, or the --moe-preset's)"
    assert entries["--xmod-token-choice-bias-tau"][1].endswith("(default: 0.5)")  # argparse's own, kept


# --- examples/own_data_cpu.sh without an activated venv ------------------------------------------------

def test_own_data_example_finds_the_repo_venv_or_says_how_to_make_it(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"  # a `python` on PATH without megatron_xmod, as outside the venv
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'megatron_xmod'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path), "INPUT": "corpus.txt",
           "OUT": str(tmp_path / "run")}
    bare = tmp_path / "checkout"  # a checkout without .venv
    (bare / "examples").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "own_data_cpu.sh", bare / "examples")
    result = subprocess.run(["bash", str(bare / "examples" / "own_data_cpu.sh")], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    error = result.stderr.strip()
    assert len(error.splitlines()) == 1 and "ModuleNotFoundError" not in result.stdout + error
    assert error.startswith("own_data_cpu.sh: PY: ") and f"fix: bash {bare}/scripts/setup_env.sh" in error
    assert not (tmp_path / "run").exists()
    given = subprocess.run(["bash", str(bare / "examples" / "own_data_cpu.sh")], capture_output=True, text=True,
                           env={**env, "PY": str(fake)}, cwd=tmp_path, timeout=60)
    assert given.returncode == 2 and f"PY: {fake} cannot import megatron_xmod" in given.stderr
    venv = REPO / ".venv" / "bin" / "python"
    if not venv.exists():
        pytest.skip("this checkout has no .venv to find")
    env.pop("INPUT")  # stops right after choosing the Python
    found = subprocess.run(["bash", str(REPO / "examples" / "own_data_cpu.sh")], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=120)
    assert f"[own_data] python: {venv}" in found.stdout
    assert found.returncode != 0 and "INPUT: set INPUT" in found.stderr


# --- the Jaccard of two layers that routed nothing -----------------------------------------------------

LAYOUT = "D + (S4*3 + D)"  # layers 2-4 sparse (block 1), Jaccard at layers 3 and 4


def _validation_line(monkeypatch, biases: dict[int, float]):
    """Route a validation batch with the router biases given per sparse layer (weights 0: -100 routes
    nothing, +100 every token) and return RoutingLog.evaluation's (console line, scalars)."""
    import megatron.training

    from megatron_xmod.model import sparse_layers
    from megatron_xmod.training.log import RoutingLog

    model, _ = tiny_model(LAYOUT, xmod_routing_family="xmod")
    with torch.no_grad():
        for layer in sparse_layers(model):
            layer.router.weight.zero_()
            layer.router.bias.fill_(biases[layer.layer_number])
    model.eval()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, torch.arange(64).expand_as(tokens), None)
    printed = []
    args = argparse.Namespace(num_layers=5, xmod_layout=LAYOUT, xmod_routing_family="xmod",
                              xmod_eval_routing="threshold")
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(megatron.training, "get_tensorboard_writer", lambda: None)
    monkeypatch.setattr(megatron.training, "print_rank_last", printed.append)
    monkeypatch.setattr(RoutingLog, "setup", lambda self, args: None)
    scalars = RoutingLog(model_chunks=[model]).evaluation(6, write_to_tensorboard=False)
    assert len(printed) == 1
    return printed[0], scalars


def test_validation_jaccard_of_layers_that_routed_nothing_is_not_available(seeded, monkeypatch):
    line, scalars = _validation_line(monkeypatch, {2: -100.0, 3: -100.0, 4: -100.0})
    assert "selected fraction: 0.0000" in line
    assert "adjacent jaccard: n.a. for 2 of 2 layer pairs: neither layer routed a token" in line
    assert "adjacent jaccard: 1.0000" not in line
    assert not any("adjacent_jaccard" in tag for tag in scalars)
    # layers 2 and 3 route nothing, layer 4 every token: only the pair (3, 4) is defined, and disjoint
    line, scalars = _validation_line(monkeypatch, {2: -100.0, 3: -100.0, 4: 100.0})
    assert "adjacent jaccard: 0.0000 (random: 0.1429; n.a. for 1 of 2 layer pairs" in line
    assert scalars["routing/eval_adjacent_jaccard"] == 0.0
    assert "routing/eval_adjacent_jaccard/layer_003" not in scalars
    assert scalars["routing/eval_adjacent_jaccard/layer_004"] == 0.0
    assert scalars["routing/eval_adjacent_jaccard random"] == pytest.approx(0.25 / 1.75)


# --- routing-report numbers blocks as the start-up summary does ----------------------------------------

def test_routing_report_numbers_blocks_like_the_startup_summary(seeded):
    from megatron_xmod.diagnostics.routing_report import format_table, routing_report
    from megatron_xmod.training.log import layer_map
    from megatron_xmod.xmod.layout import parse_layout

    layout = "D + (S4*2 + D)*2"
    model, _ = tiny_model(layout, seq_len=16, xmod_routing_family="xmod")
    report = routing_report(model, torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0)),
                            rule="topk")
    summary = layer_map(parse_layout(layout, "xmod"))
    assert summary[1] == "2-3 sparse K=4 (block 1, #1-#2)" and summary[3] == "5-6 sparse K=4 (block 2, #1-#2)"
    assert [(b["block"], b["layers"]) for b in report["blocks"]] == [(1, [2, 3]), (2, [5, 6])]
    assert {row["layer"]: row["block"] for row in report["layers"]} == {2: 1, 3: 1, 5: 2, 6: 2}
    table = format_table(report)
    assert "blocks numbered from 1" in table.splitlines()[0]
    rows = [line.split() for line in table.splitlines()]
    assert ["1", "2-3"] in [row[:2] for row in rows] and ["2", "5-6"] in [row[:2] for row in rows]
