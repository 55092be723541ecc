"""The SLURM launchers: DRY_RUN (megatron's full validation at the launch's world size), the empty-split
error, --mock-data, and SMOKE=1 end to end under a real local slurmctld + slurmd + munge."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "slurm"
GENERIC = SLURM / "xmod_train.sh"
LAUNCHERS = sorted(p.name for p in SLURM.glob("*.sh"))
# Named launchers: (nodes x GPUs per node, TP) each must validate at.
NAMED = {"xmod_1p65b.sh": (64, 8), "dense_1p65b.sh": (64, 8), "moe8x64_1p65b.sh": (64, 8)}
TABLE6_BACKBONES = ("165m", "298m", "556m", "936m", "1.65b")
TABLE6_MODELS = ("dense", "mod", "xmod-a4k8", "xmod-a3k16", "moe-8x64", "moe-8x128")


def _launch(script: str | Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not inside a job
    for knob in ("NODES", "NPROC", "TP", "PP", "CP", "SEQ", "GBS", "BACKBONE", "MODEL", "FLOPS", "DATA", "ITERS",
                 "EXTRA_ARGS", "SMOKE", "DRY_RUN", "SPLIT", "ROUTING_SEGMENTS"):
        clean.pop(knob, None)
    clean.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(script)], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=timeout)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    out = proc.stdout
    m = re.search(r"world size (\d+) = data-parallel (\d+) x TP (\d+) x PP (\d+)", out)
    g = re.search(r"global batch (\d+) sequences per step", out)
    it = re.search(r"\[dry-run\] iterations (\d+), layers (\d+)", out)
    assert m and g and it, f"no dry-run summary:\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    return {"world": int(m[1]), "dp": int(m[2]), "tp": int(m[3]), "pp": int(m[4]), "gbs": int(g[1]),
            "iters": int(it[1]), "layers": int(it[2])}


def _write_corpus(prefix: Path, num_documents: int) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for i in range(num_documents):
        builder.add_document(torch.arange(50 + i, dtype=torch.int64) % 200, [50 + i])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


# ----------------------------------------------------------------------------- fast: split arithmetic
def test_split_ranges_follow_megatron_arithmetic():
    from megatron_xmod.data.splits import split_document_ranges, working_split

    assert split_document_ranges("99,1,0", 10) == [(0, 10), (10, 10), None]  # validation empty
    assert split_document_ranges("99,1,0", 1000) == [(0, 990), (990, 1000), None]
    assert working_split("99,1,0", 10) == "9,1,0"
    assert split_document_ranges("9,1,0", 10) == [(0, 9), (9, 10), None]
    assert working_split("98,1,1", 3) == "1,1,1"
    assert working_split("99,1,0", 1) is None  # one document cannot feed two splits


def test_empty_validation_split_is_an_error_naming_the_split_and_a_fix(tmp_path):
    from megatron_xmod.training.preflight import check_split

    prefix = _write_corpus(tmp_path / "small", 10)
    args = SimpleNamespace(data_path=[prefix], split="99,1,0", train_iters=10, train_samples=None, eval_iters=2)
    with pytest.raises(ValueError, match=r"split: --split 99,1,0 leaves the validation split .* empty .*"
                                         r"10 documents.*--split 9,1,0"):
        check_split(args)
    check_split(SimpleNamespace(**{**vars(args), "split": "9,1,0"}))  # the suggested split works
    check_split(SimpleNamespace(**{**vars(args), "eval_iters": 0}))  # no validation: nothing to build
    weighted = SimpleNamespace(**{**vars(args), "data_path": ["0.5", prefix, "0.5", prefix]})
    with pytest.raises(ValueError, match="validation split"):
        check_split(weighted)


def test_bad_backbone_and_missing_data_fail_before_python_work():
    proc = _launch(GENERIC, BACKBONE="2b", timeout=60)
    assert proc.returncode == 2 and "BACKBONE: '2b' is not one of" in proc.stderr
    proc = _launch(GENERIC, BACKBONE="165m", MODEL="dense", ITERS=1, timeout=60)  # a real run needs DATA
    assert proc.returncode == 2 and "DATA: set DATA" in proc.stderr


def test_named_launchers_are_thin_wrappers_of_the_generic_one():
    for name in NAMED:
        text = (SLURM / name).read_text()
        assert 'exec bash "$HERE/xmod_train.sh"' in text
        assert "srun" not in text and "torch.distributed.run" not in text
    assert set(NAMED) | {"xmod_train.sh"} == set(LAUNCHERS)


# ----------------------------------------------------------------------------- DRY_RUN
@pytest.fixture(scope="module")
def dry_runs():
    """Every launcher's DRY_RUN and the generic launcher's at every Table 6 configuration, two at a time:
    {launcher name or (backbone, model): CompletedProcess}. Each is a Python start-up and megatron's
    validation on one core, so two run side by side on the 2-core CI machine in about half the time."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {launcher: dict(script=SLURM / launcher) for launcher in LAUNCHERS}
    jobs.update({(backbone, model): dict(script=GENERIC, BACKBONE=backbone, MODEL=model)
                 for backbone in TABLE6_BACKBONES for model in TABLE6_MODELS})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(_launch, DRY_RUN=1, **job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.slow
def test_headline_dry_run_is_data_parallel_8_tp_8_80_sequences(dry_runs):
    proc = dry_runs["xmod_1p65b.sh"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = _summary(proc)
    assert (s["world"], s["dp"], s["tp"], s["pp"], s["gbs"]) == (64, 8, 8, 1, 80)
    assert "--attention-dropout 0 --hidden-dropout 0" in proc.stdout
    # the distributed optimizer's DP sync overlapped with compute (tests/test_data_parallel.py trains with it)
    assert "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16" in proc.stdout
    assert "[xmod] command: srun" in proc.stdout and not (ROOT / "runs" / "xmod-1p65b").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_passes_dry_run_at_its_own_world_size(dry_runs, launcher):
    proc = dry_runs[launcher]
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = _summary(proc)
    world, tp = NAMED.get(launcher, (64, 8))  # the generic default is the headline run
    assert (s["world"], s["tp"], s["dp"], s["gbs"]) == (world, tp, world // tp, 80)


@pytest.mark.slow
@pytest.mark.parametrize("backbone", TABLE6_BACKBONES)
@pytest.mark.parametrize("model", TABLE6_MODELS)
def test_table6_configuration_passes_dry_run_through_the_generic_launcher(dry_runs, backbone, model):
    from megatron_xmod.presets import get_backbone, parse_model

    proc = dry_runs[(backbone, model)]
    if (backbone, model) == ("936m", "xmod-a3k16"):  # 8.4B parameters at TP 1: over 80 GB by the memory estimate
        assert proc.returncode != 0 and "FAILED (memory)" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s = _summary(proc)
    tp = 8 if backbone == "1.65b" else 1  # TP 8 where the paper used it, DDP elsewhere
    assert (s["tp"], s["world"], s["dp"], s["gbs"]) == (tp, 64 if tp == 8 else 8, 8, 80)
    assert s["layers"] == parse_model(model, get_backbone(backbone)).layout.num_layers
    assert "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" in proc.stdout  # full recompute too
    assert s["iters"] > 1


@pytest.mark.slow
def test_dry_run_fails_naming_gbs_when_the_batch_does_not_divide():
    proc = _launch(SLURM / "xmod_1p65b.sh", DRY_RUN=1, GBS=76)
    assert proc.returncode == 2  # our message (issue 26: before megatron's, which named eval_global_batch_size)
    assert "GBS: GBS=76 sequences per step do not split evenly over data-parallel 8 x MBS 1" in proc.stderr
    assert "or GBS=72 or 80 at NODES=8" in proc.stderr
    assert "nothing was started" in proc.stderr


@pytest.mark.slow
def test_dry_run_with_context_parallelism_validates_cp_and_the_sequence_split():
    """CP=2: replicas of TP 8 x CP 2 (data-parallel 4), the memory estimate at L/CP; a SEQ that does not
    split into 2 x CP x TP (sequence parallelism) parts is refused before megatron, naming the knob."""
    proc = _launch(SLURM / "xmod_1p65b.sh", DRY_RUN=1, CP=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--context-parallel-size 2" in proc.stdout and "CP 2, 80 sequences per step" in proc.stdout
    assert "[dry-run] OK: world size 64 = data-parallel 4 x TP 8 x PP 1 x CP 2" in proc.stdout
    assert "min(L/K, L/2) tokens (2/K of a dense layer's CP traffic); --xmod-routing-segments 4" in proc.stdout
    # ROUTING_SEGMENTS=4 (2 x CP): balanced CP ranks, and the routed layers' activations at L/(K CP)
    balanced = _launch(SLURM / "xmod_1p65b.sh", DRY_RUN=1, CP=2, ROUTING_SEGMENTS=4)
    assert balanced.returncode == 0, balanced.stderr[-3000:]
    assert "--xmod-routing-segments 4" in balanced.stdout
    assert "every CP rank holds exactly L/(K x 2) routed tokens" in balanced.stdout

    def routed_gib(out):
        return float(re.search(r"activations: routed layers\s+([0-9.]+) GiB", out).group(1))
    assert routed_gib(balanced.stdout) < 0.6 * routed_gib(proc.stdout), (balanced.stdout[-2000:], proc.stdout[-2000:])
    proc = _launch(SLURM / "xmod_1p65b.sh", DRY_RUN=1, CP=2, SEQ=32752)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "seq_length: context parallelism splits a sequence into 2 x CP 2 x TP 8 (sequence parallelism) = 32" \
        in proc.stdout + proc.stderr


@pytest.mark.slow
def test_dry_run_with_a_small_corpus_names_the_empty_split(tmp_path):
    prefix = _write_corpus(tmp_path / "small", 10)
    env = dict(DRY_RUN=1, BACKBONE="165m", MODEL="dense", NPROC=1, SEQ=1024, GBS=8, ITERS=10, DATA=prefix)
    proc = _launch(GENERIC, **env)
    assert proc.returncode != 0 and "split: --split 99,1,0 leaves the validation split" in proc.stderr
    assert "--split 9,1,0" in proc.stderr
    proc = _launch(GENERIC, SPLIT="9,1,0", **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    os.truncate(f"{prefix}.bin", os.path.getsize(f"{prefix}.bin") - 10)  # a copy cut short: named, before srun
    proc = _launch(GENERIC, SPLIT="9,1,0", **env)
    assert proc.returncode != 0 and f"data_path: {prefix}.bin is" in proc.stderr and "truncated" in proc.stderr
    assert "nothing was started" in proc.stderr


@pytest.mark.slow
def test_mock_data_trains_through_the_entry_point(tmp_path):
    from megatron_xmod.demo import CPU_FLAGS, _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
           "-m", "megatron_xmod.pretrain", "--hidden-size", "64", "--num-attention-heads", "4",
           "--ffn-hidden-size", "128", "--num-layers", "2", "--seq-length", "64", "--max-position-embeddings", "64",
           "--position-embedding-type", "rope", "--no-rope-fusion", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", *CPU_FLAGS,
           "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1"]
    inductor = tmp_path / "inductor"  # where torch.compile would write the kernels it generates
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(inductor)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"iteration\s+2/\s*2", out) and "validation loss at iteration 2" in out
    # --xmod-cpu turns megatron's compiled fusions off, and the CPU shim skips the JIT warm-up that
    # compiled them anyway: nothing was compiled
    assert not inductor.exists() or not any(path.is_file() for path in inductor.rglob("*"))


# ----------------------------------------------------------------------------- SMOKE=1 under a real slurmctld
@pytest.mark.slow
def test_smoke_run_under_a_local_slurm(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from slurm_helpers import LocalSlurm, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    state, run_dir = tmp_path / "slurm", tmp_path / "run"
    out = tmp_path / "job.out"
    with LocalSlurm(state) as slurm:
        env = dict(slurm.env, SMOKE="1", XMOD_ROOT=str(ROOT), SMOKE_DIR=str(run_dir))
        for knob in ("NODES", "NPROC", "TP", "ITERS", "EXTRA_ARGS", "DRY_RUN", "DATA"):
            env.pop(knob, None)
        # The launcher's #SBATCH lines ask for 8 GPUs and 32 CPUs; the command line wins.
        proc = slurm.run(["sbatch", "--wait", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count() or 1}",
                          f"--output={out}", str(GENERIC)], check=False, env=env, timeout=1200)
        log = out.read_text() if out.exists() else ""
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log[-5000:]}"
        # DRY_RUN under sbatch: the headline wrapper, squeezed onto this one node, validates at 1 x 8.
        dry_out = tmp_path / "dry.out"
        dry_env = dict(env, DRY_RUN="1")
        dry_env.pop("SMOKE")
        dry = slurm.run(["sbatch", "--wait", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count() or 1}",
                         f"--output={dry_out}", str(SLURM / "xmod_1p65b.sh")], check=False, env=dry_env, timeout=600)
        dry_log = dry_out.read_text() if dry_out.exists() else ""
        assert dry.returncode == 0, f"{dry.stdout}\n{dry.stderr}\n{dry_log[-3000:]}"
    assert "[dry-run] OK: world size 8 = data-parallel 1 x TP 8" in dry_log and "srun" not in dry_log.split("[dry-run]")[-1]
    assert "[dry-run] OK: world size 2 = data-parallel 1 x TP 2" in log  # validated before srun
    assert re.search(r"iteration\s+4/\s*4", log), log[-3000:]
    assert re.search(r"validation loss at iteration \d+ .*lm loss value: [0-9.E+-]+", log), log[-3000:]
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert any((run_dir / "ckpt" / "iter_0000004").iterdir())
    assert list((run_dir / "tb").iterdir())
    assert not slurm.pids  # every daemon it started was stopped by pid
