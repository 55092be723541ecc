"""The main job end to end at a tiny budget: real runs in, table and plot out."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from megatron_xmod.demo import MODELS, equal_flops_iterations


def test_equal_flops_iterations_follow_the_accounting():
    iterations = equal_flops_iterations(100, 256)
    assert iterations["dense"] == 100
    # routed models are cheaper per token (attention on 1/K of the tokens), so they get more steps
    assert iterations["xmod"] > iterations["mod"] > iterations["dense"]


@pytest.mark.slow
def test_demo_runs_and_reports_from_the_runs(tmp_path):
    out = tmp_path / "demo"
    inductor = tmp_path / "inductor"  # where torch.compile would write the kernels it generates
    result = subprocess.run(
        [sys.executable, "-m", "megatron_xmod.cli", "demo", "--out", str(out), "--dense-iters", "6",
         "--seq-length", "64", "--eval-interval", "3", "--eval-iters", "1",
         "--final-eval-iters", "2", "--models", "dense,xmod"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # no torch.compile on CPU: megatron's compiled fusions are off (training/flags.py, CPU_COMPILED_FUSIONS)
    assert not inductor.exists() or not any(path.is_file() for path in inductor.rglob("*"))
    rows = {row["model"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    iterations = equal_flops_iterations(6, 64)
    for name in ("dense", "xmod"):
        assert rows[name]["layout"] == MODELS[name][1]
        assert rows[name]["tokens_seen"] == iterations[name] * 8 * 64  # global batch 8
        assert 0 < rows[name]["val_loss_threshold"] < 12
    assert rows["xmod"]["val_loss_topk"] is not None and rows["dense"]["val_loss_topk"] is None
    assert rows["xmod"]["D_over_D_dense"] == pytest.approx(iterations["xmod"] / iterations["dense"])
    assert rows["xmod"]["total_params"] > rows["dense"]["total_params"]  # more physical layers
    assert rows["xmod"]["active_params"] == pytest.approx(rows["dense"]["active_params"], rel=0.01)
    # equal training FLOPs up to rounding of the iteration count
    assert rows["xmod"]["training_flops"] == pytest.approx(rows["dense"]["training_flops"], rel=0.1)
    assert (out / "val_loss_vs_flops.png").stat().st_size > 10_000
    assert "warning" not in result.stdout  # the run built exactly the parameters the accounting counts
    # the demo ends with its X-MoD model exported to Hugging Face, generating with the sparse cache
    assert (out / "xmod" / "hf" / "config.json").is_file() and "[hf] KV cache after" in result.stdout
    for name in ("dense", "xmod"):  # each log starts with the command that wrote it, ready to copy
        for log in ("train.log", "eval.log"):
            command = (out / name / log).read_text().splitlines()[0]
            assert command.startswith("+ ") and "-m megatron_xmod.pretrain" in command
            assert shlex.split(command[2:])[0] == sys.executable
            assert f"--xmod-layout {shlex.quote(MODELS[name][1])}" in command
