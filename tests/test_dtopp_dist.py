"""With torchrun --nproc_per_node=2 (gloo, expert-parallel 2 x data-parallel 2), p_t is identical
on all ranks after every step, for both Top-p dispatchers."""
import os
import socket
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "test_dtopp_dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_threshold_identical_on_all_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
         str(_free_port()), WORKER, "4", "allgather", "alltoall"],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for dispatcher in ("allgather", "alltoall"):  # alltoall with a capacity factor (the supported form)
        assert f"OK {dispatcher}" in result.stdout, result.stdout
    print(result.stdout.strip())
