"""Launch helpers for tests that start real training processes (torchrun, CPU/gloo): a tiny byte
corpus, the tiny model's megatron flags, and parsers for megatron's console output.

The flags mirror tests/test_pretrain.py (ARCH, CPU), so a launch here trains the same tiny model.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from helpers import english_bytes

from megatron_xmod.training.flags import CPU_COMPILED_FUSIONS

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
RUNNER = TESTS / "run_megatron_lm.py"

ARCH = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--swiglu", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--qk-layernorm"]
CPU = ["--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
       "--no-persist-layer-norm", "--no-create-attention-mask-in-dataloader", "--use-cpu-initialization",
       "--no-rope-fusion", *CPU_COMPILED_FUSIONS]  # what --xmod-cpu gives (these also reach Megatron-LM's pretrain_gpt.py)
SCHEDULE = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]


def write_byte_data(prefix: str) -> str:
    """English prose as byte tokens in megatron's .bin/.idx format (400-byte documents + EOD 255)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    data = english_bytes().numpy()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for start in range(0, len(data), 400):
        builder.add_item(torch.tensor(np.append(data[start : start + 400], 255).astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_flags(data: str, iters: int, *extra: str) -> list[str]:
    """Megatron-LM flags both routes accept (no --xmod-*), for the tiny model on CPU."""
    return [*ARCH, *CPU, "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(iters), *SCHEDULE, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--data-path", data, "--split", "90,5,5", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--seed", "1234", "--log-interval", "1", "--eval-interval", "4",
            "--eval-iters", "1", *extra]


def torchrun(nproc: int, target: list[str], argv: list[str], check: bool = True, timeout: int = 600):
    """``target``: ["-m", "megatron_xmod.pretrain"] or [path/to/script.py]."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *target, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed ({result.returncode}):\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}")
    return result


def tagged_json(output: str, tag: str):
    """The JSON value a worker printed after ``tag`` (e.g. ``RESULT {...}``). Searched in the whole output, not
    line by line: the ranks share one pipe, and another rank's text may land on the same line."""
    start = output.index(tag + " ") + len(tag) + 1
    return json.JSONDecoder().raw_decode(output, start)[0]


def routed_run(nproc: int, data: str, routed: list[str], iters: int, *extra: str):
    """(training losses, validation losses) of the entry point training the tiny model with ``routed``
    flags for ``iters`` iterations, validating every 3 (the multi-rank reproduction tests' run)."""
    flags = common_flags(data, iters, "--eval-interval", "3", "--no-load-rng", *extra)
    result = torchrun(nproc, ["-m", "megatron_xmod.pretrain"], [*routed, *flags])
    return train_losses(result.stdout), validation_losses(result.stdout)


def common_start(root: Path, routed: list[str], iters: int):
    """(data, checkpoint, single-process losses from it): one process saves iteration 1 and stops, and
    trains on from there; runs of other layouts load the same checkpoint (megatron reshards it), because
    megatron seeds every pipeline stage differently."""
    data = write_byte_data(str(root / "bytes"))
    checkpoint = root / "ckpt"
    routed_run(1, data, routed, iters, "--save", str(checkpoint), "--save-interval", "1", "--exit-interval", "1")
    return data, checkpoint, routed_run(1, data, routed, iters, "--load", str(checkpoint))


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")
_VALIDATION = re.compile(r"validation loss at iteration (\d+) \|([^\n]*)")
# megatron 0.19: "number of parameters on (tensor, gtp_remat, pipeline) model parallel rank (0, 0, 1): N"
_PARAMS = re.compile(r"number of parameters on \(tensor, (?:[a-z_]+, )*pipeline\) model parallel rank "
                     r"\((\d+), (?:\d+, )*(\d+)\): (\d+)")


def train_losses(output: str) -> dict[int, float]:
    """{iteration: lm loss} from megatron's console lines ``iteration N/ M | ... | lm loss: X |``."""
    return {int(i): float(v) for i, v in _ITERATION.findall(output)}


def validation_losses(output: str) -> dict[int, dict[str, float]]:
    """{iteration: {name: value}} from ``validation loss at iteration N | lm loss value: X | ...``."""
    out: dict[int, dict[str, float]] = {}
    for iteration, rest in _VALIDATION.findall(output):
        values = dict(re.findall(r"([a-z][a-z _]*?) value: ([0-9.Ee+-]+)", rest))
        out[int(iteration)] = {name.strip(): float(value) for name, value in values.items()}
    return out


def parameter_counts(output: str) -> dict[tuple[int, int], int]:
    """{(tp rank, pp rank): parameters} from megatron's ``number of parameters on ...`` lines."""
    return {(int(t), int(p)): int(n) for t, p, n in _PARAMS.findall(output)}
