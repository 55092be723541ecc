"""Routed layers under tensor parallelism 2 with sequence parallelism equal tensor parallelism 1: the
top-k ranks the whole sequence although each rank holds half of it. torchrun --nproc_per_node=2 on
gloo (worker: tests/dist_worker_sp.py): the same weights and batches, 6 SGD steps through megatron's
DistributedDataParallel and finalize_model_grads; the losses agree to fp32 tolerance, every sparse
layer routes the same tokens at every step, and so does the threshold rule of evaluation."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torchrun workers

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker_sp.py")
STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_tp2_sequence_parallel_equals_tp1(family):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port()),
         WORKER, family, str(STEPS)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    runs = json.loads(line[len("RESULT "):])
    tp1, tp2 = runs["tp1"], runs["tp2_sp"]
    assert len(tp1["losses"]) == STEPS
    assert tp2["losses"] == pytest.approx(tp1["losses"], rel=1e-5)
    assert tp1["losses"][-1] < tp1["losses"][0]  # it trained
    # routed sets: 2 sparse layers per training step, then the evaluation's threshold routing
    assert len(tp1["routed"]) == 2 * STEPS + 2
    assert tp2["routed"] == tp1["routed"]
    assert tp2["eval_loss"] == pytest.approx(tp1["eval_loss"], rel=1e-5)
