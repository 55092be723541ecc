"""With torchrun --nproc_per_node=2 (gloo): p_t is identical on all ranks after every step under
expert-parallel 2 x data-parallel 2, for both Top-p dispatchers; and under tensor-parallel 2 with
sequence parallelism, megatron's finalize_model_grads leaves the DRN temperatures theta_l with the
same gradient (hence the same value) on both TP ranks. The worker is tests/dist_worker_dtopp.py."""
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torchrun workers

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker_dtopp.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*worker_args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
         str(_free_port()), WORKER, *worker_args],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


def test_threshold_identical_on_all_ranks():
    stdout = _torchrun("ep", "4", "allgather", "alltoall")
    for dispatcher in ("allgather", "alltoall"):  # alltoall with a capacity factor (the supported form)
        assert f"OK {dispatcher}" in stdout, stdout
    print(stdout.strip())


def test_drn_temperature_stays_identical_across_tp_ranks_with_sequence_parallel():
    stdout = _torchrun("tp-sp", "3")
    assert "OK tp-sp" in stdout, stdout
    print(stdout.strip())
