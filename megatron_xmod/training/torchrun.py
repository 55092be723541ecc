"""torchrun for preemptible jobs: ``python -m megatron_xmod.training.torchrun`` takes torchrun's
arguments and runs torchrun (``torch.distributed.run``) unchanged, except for what its agent does on
SIGTERM.

torchrun's agent answers SIGTERM by signalling its workers, killing those still alive after
``--shutdown_timeout`` and exiting non-zero. SLURM, at preemption and with ``#SBATCH
--signal=TERM@...`` before the time limit, sends SIGTERM to every process of the job step: to the
workers, which under ``--exit-signal-handler`` finish their iteration, save a complete checkpoint and
exit 0, and to the agent. So a preempted job ended with a failed step status, and a save that took
longer than the shutdown timeout was killed part-way (the last good checkpoint survived: saves are
atomic, but the iterations since were lost).

Here the agent answers the first SIGTERM by passing it on to its workers (a signal sent to the agent
alone, ``kill <pid>``, then reaches them too; a worker that already got it from SLURM just sees it
again) and goes on supervising them: the job ends with their exit status, 0 after a preemption save,
and a save may take as long as it takes (SLURM's own kill at the end of the grace period still
applies). A second SIGTERM, a SIGTERM before any worker started, and SIGINT / SIGHUP / SIGQUIT get
torchrun's own handling: shut the workers down and exit non-zero.
"""
from __future__ import annotations

import os
import signal
import sys

# torchrun's agent installs its handler for each signal of its --signals-to-handle (default below);
# the one for SIGTERM is ours.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def child_pids(pid: int) -> list[int]:
    """The direct children of process ``pid`` (Linux /proc; empty where it cannot be read)."""
    children = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as f:
                children += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return sorted(set(children))


def signals_left_to_torchrun(requested: str | None) -> str:
    """torchrun's --signals-to-handle for the agent: the user's list (or torchrun's default) without SIGTERM."""
    names = [name.strip() for name in (requested or TORCHRUN_SIGNALS).split(",")]
    return ",".join(name for name in names if name and name != "SIGTERM")


class PreemptionHandler:
    """The agent's SIGTERM handler: pass the first one on to the workers and keep supervising them."""

    def __init__(self, pid: int):
        self.pid = pid
        self.received = 0

    def __call__(self, signum, frame) -> None:
        self.received += 1
        workers = child_pids(self.pid)
        if self.received > 1 or not workers:
            from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

            print(f"[xmod] torchrun: {'a second SIGTERM' if workers else 'SIGTERM before any worker started'}: "
                  "shutting the workers down as torchrun does", file=sys.stderr, flush=True)
            _terminate_process_handler(signum, frame)  # raises torchrun's SignalException
            return
        print(f"[xmod] torchrun: SIGTERM: passed on to the workers (pids {' '.join(map(str, workers))}); waiting "
              "for them to save and exit (a second SIGTERM shuts them down)", file=sys.stderr, flush=True)
        for worker in workers:
            try:
                os.kill(worker, signal.SIGTERM)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(argv)
    args.signals_to_handle = signals_left_to_torchrun(args.signals_to_handle)
    signal.signal(signal.SIGTERM, PreemptionHandler(os.getpid()))
    torchrun.run(args)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
