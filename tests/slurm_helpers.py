"""A real single-node SLURM (slurmctld + slurmd + munged) on localhost for the launcher tests.

Follows ``../shared/reference/slurm-local`` (README.md, up.sh, slurm.conf.in): all state under one
folder, free ports, no systemd. Installs the Debian packages when they are missing and this process is
root with apt-get; otherwise :func:`unavailable` says exactly why. The daemons are stopped by the pids
they wrote (never by name).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo")

CONF = """ClusterName=xmodtest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={state}/state
SlurmdSpoolDir={state}/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def unavailable() -> str | None:
    """None when a local SLURM can be brought up (installing the packages if needed), else the reason."""
    if not _missing():
        return None if os.geteuid() == 0 else "slurm-local needs root (munged/slurmd run as root, SlurmUser=root)"
    if os.geteuid() != 0:
        return f"SLURM binaries {_missing()} are missing and this process is not root, so cannot apt-get install {PACKAGES}"
    if shutil.which("apt-get") is None:
        return f"SLURM binaries {_missing()} are missing and there is no apt-get to install {PACKAGES}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"
    return None if not _missing() else f"after apt-get install, still missing {_missing()}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """``with LocalSlurm(folder) as slurm: slurm.run(["sbatch", ...])``."""

    def __init__(self, state: Path):
        self.state = Path(state)
        self.conf = self.state / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.pids: dict[str, int] = {}

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        s = self.state
        for sub in ("munge", "state", "spool"):
            (s / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(s / "munge", 0o755)
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)
        memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
        self.conf.write_text(CONF.format(host=socket.gethostname(), state=s, ctld_port=_free_port(),
                                         d_port=_free_port(), cpus=os.cpu_count() or 1, memory=memory))
        subprocess.run([_binary("munged"), "--force", f"--socket={s}/munge/munge.sock", f"--key-file={key}",
                        f"--log-file={s}/munge/munged.log", f"--pid-file={s}/munge/munged.pid",
                        f"--seed-file={s}/munge/munged.seed"], check=True, env=self.env)
        self.pids["munged"] = self._pid(s / "munge" / "munged.pid")
        subprocess.run([_binary("slurmctld"), "-f", str(self.conf)], check=True, env=self.env)
        self.pids["slurmctld"] = self._pid(s / "slurmctld.pid")
        subprocess.run([_binary("slurmd"), "-f", str(self.conf)], check=True, env=self.env)
        self.pids["slurmd"] = self._pid(s / "slurmd.pid")
        for _ in range(60):
            out = self.run(["sinfo", "-h", "-o", "%t"], check=False).stdout
            if "idle" in out:
                return
            time.sleep(1)
        raise RuntimeError(f"local SLURM node never became idle; see {s}/slurmctld.log and {s}/slurmd.log")

    @staticmethod
    def _pid(path: Path, timeout: float = 15.0) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            time.sleep(0.2)
        raise RuntimeError(f"{path} was not written: the daemon did not start (see the logs next to it)")

    def run(self, cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kwargs.pop("env", self.env), capture_output=True, text=True, check=check,
                              **kwargs)

    def stop(self) -> None:
        """Stop the daemons this object started, by their pids (slurmd first, munged last)."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
