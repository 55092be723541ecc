"""bench/contention.py at a tiny size: the neighbour process runs on its own CPU during the second phase
only, the bench stays on its own CPU meanwhile and gives the caller its CPUs and threads back, and the
ratios it writes are those of its own timings."""
import json
import os
import statistics
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import contention  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="pins the bench and its neighbour to two CPUs")


@pytest.mark.slow
def test_tiny_run_times_each_model_alone_and_beside_the_neighbour(megatron_parallel, tmp_path, monkeypatch):
    started, neighbours, placed = [], [], []
    spawned = contention.multiprocessing.get_context("spawn").Process
    real_start, real_step = spawned.start, contention.throughput.ModelRun.train_step

    def start(self):
        started.append((self._target, self._args))
        real_start(self)
        neighbours.append(self)

    def step(self, timed=True):
        alive = [p for p in neighbours if p.is_alive()]
        placed.append((self.name, timed, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), len(alive)))
        return real_step(self, timed=timed)

    monkeypatch.setattr(spawned, "start", start)
    monkeypatch.setattr(contention.throughput.ModelRun, "train_step", step)
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    assert contention.main(["--tiny", "--models", "dense", "xmod-a4k8", "--out", str(tmp_path), "--tag", "t"]) == 0
    assert os.sched_getaffinity(0) == cpus and torch.get_num_threads() == threads

    mine, theirs = sorted(cpus)[:2]
    assert started == [(contention.copy_forever, (theirs, 256))]  # one neighbour, for the one round's second phase
    # compile steps, then the round alone, then beside the (live) neighbour; always one thread on one CPU
    assert [(name, timed, live) for name, timed, _, _, live in placed] == [
        ("dense", False, 0), ("xmod-a4k8", False, 0), ("dense", True, 0), ("xmod-a4k8", True, 0),
        ("dense", True, 1), ("xmod-a4k8", True, 1)]
    assert all(cpu == [mine] and n == 1 for _, _, cpu, n, _ in placed)
    assert not neighbours[0].is_alive()  # killed after its phase

    data = json.loads((tmp_path / "contention_t.json").read_text())
    rows = {r["model"]: r for r in data["rows"]}
    for name, r in rows.items():
        alone, busy = (statistics.median(data["times"][f"{name} {ph}"]) for ph in ("alone", "neighbour"))
        assert (r["alone_s"], r["neighbour_s"]) == (alone, busy) and r["slowdown"] == pytest.approx(busy / alone)
        assert r["ratio_alone"] == pytest.approx(rows["dense"]["alone_s"] / alone)
        assert r["ratio_neighbour"] == pytest.approx(rows["dense"]["neighbour_s"] / busy)
    assert rows["dense"]["ratio_alone"] == 1.0
    assert all(v > 0 for phase in data["meta"]["memory_gbs"].values() for v in phase)
    assert "| xmod-a4k8 |" in (tmp_path / "contention_t.md").read_text()


def test_ratios_need_dense(capsys):
    with pytest.raises(SystemExit) as excinfo:
        contention.main(["--tiny", "--models", "xmod-a4k8", "--out", "/nonexistent/never-written"])
    assert excinfo.value.code == 2 and "--models: the ratios are to Dense" in capsys.readouterr().err
