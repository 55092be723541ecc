"""bench/quality.py (the seed study) and the seed spread `xmod demo` prints from it."""
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402

from megatron_xmod.demo import seed_spread_lines  # noqa: E402


def _run(model, seed, loss, curve=((10.0, 6.0), (20.0, 5.0))):
    return dict(model=model, seed=seed, seq_length=256, val_loss_threshold=loss, val_loss_topk=None,
                train_seconds=curve[-1][0], time_curve=[list(p) for p in curve])


def test_differences_are_paired_by_seed_and_resolved_only_beyond_two_standard_errors():
    runs = [_run("dense", 1, 5.50), _run("dense", 2, 5.60), _run("dense", 3, 5.40),
            _run("xmod", 1, 5.40), _run("xmod", 2, 5.51), _run("xmod", 3, 5.29),  # 0.10 below dense each seed
            _run("mod", 1, 5.60), _run("mod", 2, 5.50), _run("mod", 3, 5.40)]  # the same losses, other seeds
    rows = quality.compare(runs, ["dense", "mod", "xmod"], lambda r: r["val_loss_threshold"])
    assert rows["dense"]["mean"] == pytest.approx(5.5) and rows["dense"]["sd"] == pytest.approx(0.1)
    diffs = [-0.10, -0.09, -0.11]
    assert rows["xmod"]["diffs"] == pytest.approx(diffs)
    sd = math.sqrt(sum((d + 0.10) ** 2 for d in diffs) / 2)
    assert rows["xmod"]["diff_sd"] == pytest.approx(sd) and rows["xmod"]["diff_se"] == pytest.approx(sd / math.sqrt(3))
    assert rows["xmod"]["resolved"] and rows["xmod"]["resolved_t95"]  # a consistent 0.10 against an SE of 0.006
    assert rows["xmod"]["xmod_minus_mod"]["diffs"] == pytest.approx([-0.20, 0.01, -0.11])
    assert rows["mod"]["diff_mean"] == pytest.approx(0.0) and not rows["mod"]["resolved"]  # +0.1, -0.1, 0


def test_equal_wall_clock_interpolates_each_curve_at_the_shortest_run():
    assert quality.loss_at([(10.0, 6.0), (20.0, 5.0)], 15.0) == pytest.approx(5.5)
    assert quality.loss_at([(10.0, 6.0), (20.0, 5.0)], 30.0) == 5.0 and quality.loss_at([(10.0, 6.0)], 1.0) == 6.0
    runs = [_run("dense", s, 5.0, ((10.0, 6.0), (20.0, 5.0))) for s in (1, 2)]
    runs += [_run("xmod", s, 4.9, ((15.0, 6.0), (40.0, 4.9))) for s in (1, 2)]  # slower: 40 s
    summary = quality.summarise(runs, ["dense", "xmod"], [256])[256]
    assert summary["wall_clock_horizon_s"] == 20.0
    assert summary["equal_wall_clock"]["xmod"]["mean"] == pytest.approx(6.0 - 1.1 * 5 / 25)
    assert summary["equal_flops_threshold"]["xmod"]["diff_mean"] == pytest.approx(-0.1)


def test_training_seconds_sum_megatrons_iteration_times():
    log = "\n".join(f" [2026] iteration {i}/ 3 | consumed samples: 8 | elapsed time per iteration (ms): {ms} |"
                    for i, ms in ((1, 900.0), (2, 250.0), (3, 260.0)))
    assert quality.training_seconds(log) == pytest.approx({1: 0.9, 2: 1.15, 3: 1.41})


def _record(tmp_path, **settings):
    base = dict(seq_length=256, dense_iters=160, micro_batch_size=4, global_batch_size=8, lr=3e-3,
                tokenizer="sentencepiece")
    record = dict(source="bench/results/quality_x.md", machine="2-core CPU", isa="AVX512", date="2026-12-02", seeds=3,
                  settings={**base, **settings},
                  models={"dense": {"mean": 5.58, "sd": 0.01, "n": 3},
                          "mod": {"mean": 5.50, "sd": 0.02, "n": 3, "diff_mean": -0.08, "diff_sd": 0.01,
                                  "diff_se": 0.006, "resolved": True, "resolved_t95": True},
                          "xmod": {"mean": 5.57, "sd": 0.03, "n": 3, "diff_mean": -0.01, "diff_sd": 0.03,
                                   "diff_se": 0.017, "resolved": False, "resolved_t95": False,
                                   "xmod_minus_mod": {"diff_mean": 0.07, "diff_sd": 0.04, "diff_se": 0.023,
                                                      "resolved": True, "resolved_t95": False}}})
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(record))
    return path


def test_demo_prints_the_recorded_spread_and_claims_no_unresolved_ranking(tmp_path):
    args = types.SimpleNamespace(seq_length=256, dense_iters=160, micro_batch_size=4, global_batch_size=8, lr=3e-3,
                                 tokenizer="sentencepiece")
    text = "\n".join(seed_spread_lines(args, _record(tmp_path)))
    assert "bench/results/quality_x.md: 3 seeds" in text and "dense 0.0100" in text
    assert "mod minus dense: -0.0800 +- 0.0100 (beyond its spread (95%))" in text
    assert "xmod minus dense: -0.0100 +- 0.0300 (not resolved by 3 seeds: no ranking)" in text
    assert "xmod minus mod: +0.0700 +- 0.0400 (beyond 2 standard errors, not at 95%: a weak ranking)" in text
    other = "\n".join(seed_spread_lines(types.SimpleNamespace(**{**vars(args), "seq_length": 64}), _record(tmp_path)))
    assert "measured at other settings" in other and "minus dense" not in other
    assert "no seed spread recorded" in seed_spread_lines(args, tmp_path / "missing.json")[0]


def test_the_packaged_record_is_the_demo_default_settings():
    """The record `xmod demo` reads (written by bench/quality.py --write-demo-record) matches the demo's own
    defaults, so a plain `xmod demo` prints it."""
    import argparse

    from megatron_xmod.cli import demo as demo_cli
    from megatron_xmod.demo import SEED_SPREAD

    parser = argparse.ArgumentParser()
    demo_cli.register(parser.add_subparsers())
    args = parser.parse_args(["demo"])
    record = json.loads(SEED_SPREAD.read_text())
    assert {key: getattr(args, key) for key in record["settings"]} == record["settings"]
    assert set(record["models"]) == {"dense", "mod", "xmod"} and record["seeds"] >= 3


@pytest.mark.slow
def test_the_study_trains_resumes_and_reports(tmp_path):
    """Two seeds of Dense and X-MoD at L = 64, a few steps: the table, the JSON and the PNG; a second call
    reuses the finished runs (resumable) and trains nothing."""
    command = [sys.executable, str(ROOT / "bench" / "quality.py"), "--seeds", "1", "2", "--seq-lengths", "64",
               "--dense-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--final-eval-iters", "1",
               "--models", "dense,xmod", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"), "--tag", "t"]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    first = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "quality_t.json").read_text())
    assert len(data["runs"]) == 4 and {r["seed"] for r in data["runs"]} == {1, 2}
    assert all(r["train_seconds"] > 0 and r["time_curve"] for r in data["runs"])
    xmod = data["summary"]["64"]["equal_flops_threshold"]["xmod"]
    assert xmod["n"] == 2 and len(xmod["diffs"]) == 2
    assert "## L = 64: equal wall clock" in (tmp_path / "out" / "quality_t.md").read_text()
    assert (tmp_path / "out" / "quality_t.png").stat().st_size > 5_000
    second = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0 and "train (" not in second.stderr + second.stdout  # nothing trained again
