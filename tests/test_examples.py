"""examples/ (launch scripts in Megatron-LM's style) in DRY_RUN or SMOKE form, and patches/.

DRY_RUN=1 prints the command and runs megatron's argument validation plus the plugin's at the
script's world size (python -m megatron_xmod.training.dry_run), with no GPU.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from entry_point_helpers import write_byte_data
from run_megatron_lm import MEGATRON_LM_DIR

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent


def run_example(name, timeout=300, **env):
    # tests/conftest.py exports MASTER_ADDR/MASTER_PORT for in-process runs; a launched script must not share them
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    full = dict(inherited, PY=sys.executable, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
                **{k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(EXAMPLES / name)], capture_output=True, text=True, env=full, cwd=REPO,
                          timeout=timeout)


def test_every_example_is_tested():
    here = Path(__file__).read_text()
    scripts = sorted(p.name for p in EXAMPLES.glob("*.sh"))
    assert scripts == ["own_data_cpu.sh", "preprocess_data.sh", "pretrain_gpt_spec.sh", "pretrain_xmod.sh"]
    for script in scripts:
        assert f'run_example("{script}"' in here, f"examples/{script} has no DRY_RUN or SMOKE test"


@pytest.mark.slow
def test_preprocess_example_smoke(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"body": f"document {i}: " + "some text " * 20}) + "\n" for i in range(5)))
    prefix = tmp_path / "out" / "bytes_text"
    env = dict(INPUT=corpus, OUTPUT_PREFIX=prefix, TOKENIZER="bytes", JSONL_KEY="body", WORKERS=1,
               EXTRA_ARGS="--quiet")
    dry = run_example("preprocess_data.sh", DRY_RUN=1, **env)
    assert dry.returncode == 0, dry.stderr
    assert f"xmod preprocess --input {corpus} --output-prefix {prefix} --tokenizer bytes --jsonl-key body" in dry.stdout
    assert not prefix.parent.exists()  # a dry run writes nothing
    result = run_example("preprocess_data.sh", **env)
    assert result.returncode == 0, result.stderr
    assert "5 documents" in result.stdout
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == 5
    assert bytes(dataset[0][:11].tolist()) == b"document 0:"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_byte_data(str(tmp_path_factory.mktemp("data") / "bytes"))


NULL_TOKENIZER = "--tokenizer-type NullTokenizer --vocab-size 256"


@pytest.mark.slow
def test_pretrain_xmod_example_dry_run(data):
    result = run_example("pretrain_xmod.sh", DRY_RUN=1, DATA=data, TOKENIZER="unused", EXTRA_ARGS=NULL_TOKENIZER)
    assert result.returncode == 0, result.stdout + result.stderr
    command = result.stdout.splitlines()[0]
    assert command.startswith("torchrun --nnodes 1 --nproc_per_node 8 ") and " -m megatron_xmod.pretrain " in command
    assert "--xmod-backbone 936m --xmod-model xmod-a4k8 --seq-length 32768" in command
    assert "world size 8 = data-parallel 1 x TP 8" in result.stdout
    assert "global batch 80 sequences per step" in result.stdout
    assert "layers 161" in result.stdout  # the A4K8 layout on the 936m backbone, expanded
    assert "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" in command  # as the launchers
    # a launch megatron would reject fails here, before any GPU is asked for
    bad = run_example("pretrain_xmod.sh", DRY_RUN=1, DATA=data, TOKENIZER="unused", TP=3, EXTRA_ARGS=NULL_TOKENIZER)
    assert bad.returncode != 0
    assert "divisible" in bad.stdout + bad.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_LM_DIR / "pretrain_gpt.py").is_file(), reason="no Megatron-LM checkout")
def test_pretrain_gpt_spec_example_dry_run(data):
    from megatron_xmod.presets import backbone_flags, get_backbone
    from megatron_xmod.training.flags import MUON_TABLE5

    env = dict(DRY_RUN=1, MEGATRON_LM=MEGATRON_LM_DIR, DATA=data, TOKENIZER="unused", EXTRA_ARGS=NULL_TOKENIZER)
    result = run_example("pretrain_gpt_spec.sh", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "--spec megatron_xmod.spec xmod_a3k16: xmod, 298 layers (288 routed): D*4 + (S16*48 + D)*6"
    command = lines[1]
    assert f"{MEGATRON_LM_DIR}/pretrain_gpt.py --spec megatron_xmod.spec xmod_a3k16 --num-layers 298 " in command
    assert "--xmod-" not in command  # Megatron-LM's parser rejects the plugin's flags
    # the spelled-out flags are the plugin's presets (936m backbone, Table 5 Muon)
    assert " ".join(backbone_flags(get_backbone("936m"))) in command
    assert " ".join(MUON_TABLE5[2:]) in command and "--optimizer muon --lr 3.2e-3" in command
    assert "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" in command
    assert "world size 8 = data-parallel 1 x TP 8" in result.stdout
    # --num-layers that disagrees with the spec's layout: stopped before anything starts
    bad = run_example("pretrain_gpt_spec.sh", **{**env, "NUM_LAYERS": 28})
    assert bad.returncode == 2
    assert "num_layers: 28 does not match the --spec layout" in bad.stderr
    assert "torchrun" not in bad.stdout
    # a misspelt spec (which megatron would swallow and train dense) is an error here
    typo = run_example("pretrain_gpt_spec.sh", **{**env, "SPEC": "xmod_a3k61"})
    assert typo.returncode == 2 and "has no 'xmod_a3k61'" in typo.stderr
    # PP 2: megatron's even split starts stage 2 inside a sparse block; a block-aligned layout passes
    split = run_example("pretrain_gpt_spec.sh", **{**env, "PP": 2})
    assert split.returncode == 2 and "a pipeline stage starts at layer 150, inside the sparse block" in split.stderr
    assert "torchrun" not in split.stdout
    aligned = run_example("pretrain_gpt_spec.sh", **{**env, "TP": 4, "PP": 2, "PP_LAYOUT": "Et*151|t*147L"})
    assert aligned.returncode == 0, aligned.stdout + aligned.stderr
    assert "pipeline chunks start at layers 1, 152: none inside a sparse block" in aligned.stdout
    assert "--pipeline-model-parallel-layout Et*151|t*147L" in aligned.stdout


def test_patches_folder_holds_only_patches_that_apply(tmp_path):
    folder = REPO / "patches"
    readme = (folder / "README.md").read_text()
    patches = sorted(folder.glob("*.patch"))
    if not patches:
        assert "**None are needed**" in readme
        assert sorted(p.name for p in folder.iterdir()) == ["README.md"]  # no stale files
        return
    assert "**None are needed**" not in readme
    if not (MEGATRON_LM_DIR / "pretrain_gpt.py").is_file():
        pytest.skip("no Megatron-LM checkout to apply the patches to")
    copy = tmp_path / "megatron-lm"
    shutil.copytree(MEGATRON_LM_DIR, copy)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    for patch in patches:
        assert "core_v" in patch.name or "core_v" in patch.read_text().splitlines()[0], \
            f"{patch.name}: name the Megatron-LM version it targets"
        check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=copy, capture_output=True, text=True)
        assert check.returncode == 0, f"{patch.name} does not apply to {MEGATRON_LM_DIR}: {check.stderr}"


@pytest.mark.slow
def test_own_data_cpu_example_end_to_end(tmp_path):
    """examples/own_data_cpu.sh on a tiny corpus: preprocess (with its own SentencePiece model) ->
    count -> train 6 -> resume to 10 -> evaluate; every step logs its command; the log and
    tensorboard carry the start-up summary, the validation routing statistics and compute."""
    import random

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    words = ("the quick brown fox jumps over a lazy dog while rivers run to the sea and tall mountains stand "
             "under a pale moon").split()
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(150)) for _ in range(40)))
    backbone = tmp_path / "tiny.json"  # a backbone file, as a user writes one
    backbone.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                                    "head_dim": 16, "ffn_hidden_size": 128, "num_layers": 6, "vocab_size": 400}))
    out = tmp_path / "run"
    result = run_example("own_data_cpu.sh", INPUT=corpus, OUT=out, VOCAB=400, BACKBONE=backbone, SEQ=64, MBS=2, GBS=4,
                         ITERS=6, MORE=4, EVAL_ITERS=1, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    logs = {step: (out / f"{step}.log").read_text() for step in ("preprocess", "count", "train", "resume", "evaluate")}
    for step, text in logs.items():
        assert text.lstrip().startswith("+ "), step  # the command first, ready to copy
    flags = logs["preprocess"].strip().splitlines()[-1]
    assert f"--data-path {out}/data/text" in flags and "--tokenizer-type SentencePieceTokenizer" in flags
    assert "D*6" in logs["count"]  # compared with the dense model of the same activated depth
    train = logs["train"]
    assert "layers     1-2 dense | 3-6 sparse K=4 (block 1, #1-#4) | 7 anchor (block 1)" in train
    assert "no launcher found" in train and "tokens/s:" in train and "ETA:" in train
    assert "[xmod] validation routing at iteration 6 (threshold rule) | selected fraction:" in train
    assert "[xmod] test routing at iteration 6 (threshold rule)" in train  # console only
    assert "iteration       10/      10" in logs["resume"]
    assert "validation loss at iteration 10 on validation set" in logs["evaluate"]
    tags: dict = {}
    for event_file in sorted((out / "tb").iterdir()):
        if not event_file.name.startswith("events"):
            continue
        events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            tags.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    # the validation statistics at the iteration of each validation, the last one included
    assert {6, 10} <= set(tags["routing/eval_selected_fraction"])
    assert tags["routing/eval_selected_fraction random"][10] == 0.25
    flops = tags["training flops"][10]
    assert flops == 3 * tags["forward flops per token"][10] * 10 * 4 * 64
    assert max(tags["lm loss vs training MFLOPs"]) == round(flops / 1e6)
