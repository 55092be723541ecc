"""bench/host_overhead.py: the step model against a hand calculation, and the script's measurements
at the smallest size on CPU (the host times themselves are a benchmark, in bench/results/)."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import host_overhead  # noqa: E402


def test_step_model_matches_hand_calculation():
    # 1e9 FLOPs/token x 3 (fwd + bwd) x 1000 tokens / TP 2 = 1.5e12 FLOPs; at 100 TFLOP/s x 50% MFU: 30 ms.
    # Host: 2 dense x 100 + 3 sparse x 200 = 800 launches x 10 us = 8 ms; graphed 5 layers x 2 x 10 us.
    r = host_overhead.step_model(1e9, 1000, 2, n_dense=2, n_sparse=3, dense_launches=100, sparse_launches=200,
                                 us_per_launch=10.0, peak_flops=100e12, mfu=0.5, graph_launch_us=10.0)
    assert r["flops_per_gpu"] == pytest.approx(1.5e12)
    assert r["device_s"] == pytest.approx(0.03)
    assert r["launches"] == 800 and r["eager_host_s"] == pytest.approx(0.008)
    assert r["eager_factor"] == pytest.approx(0.008 / 0.03)
    assert r["graphed_host_s"] == pytest.approx(1e-4) and r["graphed_factor"] == pytest.approx(1e-4 / 0.03)


def test_headline_a3k16_is_host_bound_about_4x_at_10us():
    """The issue's estimate: 1.65B A3K16, TP 8, L = 32768 on an H100 at 45% MFU is ~0.16 s of device
    time per micro-batch, while 298 layers of eager launches at 10 us are ~0.6 s."""
    layers = [dict(layer="dense", forward_launches=38, backward_launches=94),
              dict(layer="xmod_sparse", forward_launches=89, backward_launches=121),
              dict(layer="mod_sparse", forward_launches=75, backward_launches=117)]
    rows = {(r["model"], r["gpu"]): r for r in host_overhead.headline_table(layers, us_per_launch=10.0, mfu=0.45)}
    a3k16 = rows[("xmod-a3k16", "H100")]
    # D*4 + (S16*48 + D)*6: 10 dense and 288 sparse layers
    assert a3k16["num_layers"] == 298 and a3k16["launches"] == 10 * 132 + 288 * 210
    assert a3k16["flops_per_gpu"] == pytest.approx(5.81e9 * 3 * 32768 / 8, rel=0.01)
    assert a3k16["device_s"] == pytest.approx(5.81e9 * 3 * 32768 / 8 / (989e12 * 0.45), rel=0.01)  # 0.160 s
    assert a3k16["eager_host_s"] == pytest.approx(0.618)
    assert a3k16["eager_factor"] == pytest.approx(3.85, abs=0.05)
    assert a3k16["graphed_host_s"] == pytest.approx(298 * 2 * 10e-6)
    # the A100's lower peak makes the same host cost 989/312 times less host-bound
    assert rows[("xmod-a3k16", "A100")]["eager_factor"] == pytest.approx(a3k16["eager_factor"] * 312 / 989)
    mod = rows[("mod", "H200")]  # MoD: its sparse layers are MoD's (75 + 117 launches)
    assert mod["launches"] == 25 * 132 + 24 * 192


def test_data_parallel_sync_per_step_matches_hand_calculation():
    # 16e9 parameters / TP 8 = 2e9 per GPU; x 6 bytes (fp32 grads + bf16 params) x 7/8 at DP 8 = 10.5 GB;
    # at 50 GB/s: 0.21 s.
    r = host_overhead.dp_sync_model(16e9, tp=8, dp=8, link_bytes_per_s=50e9)
    assert r["dp_bytes"] == pytest.approx(10.5e9) and r["dp_sync_s"] == pytest.approx(0.21)
    assert host_overhead.dp_sync_model(16e9, tp=8, dp=1, link_bytes_per_s=50e9)["dp_bytes"] == 0
    layers = [dict(layer=name, forward_launches=40, backward_launches=100)
              for name in ("dense", "xmod_sparse", "mod_sparse")]
    rows = {(r["model"], r["gpu"]): r for r in host_overhead.headline_table(layers, us_per_launch=10.0)}
    dense, a3k16 = rows[("dense", "H100")], rows[("xmod-a3k16", "H100")]
    # every parameter is synced: the bytes scale with N (xmod count: 1.62B and 15.21B), not the FLOPs
    assert a3k16["dp_bytes"] / dense["dp_bytes"] == pytest.approx(a3k16["total_params"] / dense["total_params"])
    assert 9 < a3k16["dp_bytes"] / dense["dp_bytes"] < 10
    assert a3k16["step_device_s"] == pytest.approx(10 * a3k16["device_s"])
    share = a3k16["dp_sync_s"] / (a3k16["step_device_s"] + a3k16["dp_sync_s"])
    assert a3k16["dp_sync_fraction"] == pytest.approx(share) and a3k16["dp_sync_fraction"] > 5 * dense["dp_sync_fraction"]
    # overlapped (the launchers' --overlap-grad-reduce --overlap-param-gather): the part that does not fit behind
    # the last micro-batch's backward (2/3 of its device time) and the next forward (1/3) stays exposed
    rs, ag, mb = a3k16["dp_reduce_scatter_s"], a3k16["dp_all_gather_s"], a3k16["device_s"]
    assert rs == pytest.approx(2 * ag) and rs + ag == pytest.approx(a3k16["dp_sync_s"])
    assert rs > 2 / 3 * mb and ag > mb / 3  # A3K16 on an H100: more to sync than one micro-batch hides
    assert a3k16["dp_exposed_s"] == pytest.approx(rs - 2 / 3 * mb + ag - mb / 3)
    assert a3k16["dp_exposed_fraction"] < a3k16["dp_sync_fraction"] / 3
    # Dense hides all of it but one 40M-parameter bucket each way
    bucket = 40e6 / dense["dp_params_per_gpu"]
    assert dense["dp_exposed_s"] == pytest.approx(bucket * dense["dp_sync_s"])


@pytest.mark.slow
def test_smallest_run_writes_consistent_results(megatron_parallel, tmp_path):
    assert host_overhead.main(["--device", "cpu", "--models", "dense", "mod", "--activated-depth", "9",
                               "--hidden-size", "32", "--seq-len", "16", "--calls", "2", "--repeats", "1",
                               "--steps", "1", "--graphs", "--out", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "host_overhead_t.json").read_text())
    layers = {r["layer"]: r for r in data["layers"]}
    assert list(layers) == ["dense", "xmod_sparse", "mod_sparse"]
    assert all(r["forward_us"] > 0 and r["backward_us"] > 0 and r["forward_cpu_us"] > 0 for r in layers.values())
    # the launch counts are bench/ops.py's: a routed layer's forward issues more than the dense one's
    assert layers["xmod_sparse"]["forward_launches"] > layers["mod_sparse"]["forward_launches"] \
        > layers["dense"]["forward_launches"] > 10
    assert data["meta"]["us_per_launch"] == pytest.approx(host_overhead.host_us_per_launch(data["layers"]))
    steps = {r["model"]: r for r in data["steps"]}
    assert steps["dense"]["num_layers"] == 9 and steps["mod"]["num_sparse_layers"] > 0
    dense_layer = layers["dense"]["forward_us"] + layers["dense"]["backward_us"]
    assert steps["dense"]["layers_sum_ms"] == pytest.approx(9 * dense_layer / 1e3)
    assert all(r["fwd_bwd_ms"] > 0 and r["optimizer_ms"] > 0 for r in steps.values())
    # the step model is the one of the measured launch counts and host time per launch
    a3k16 = next(r for r in data["step_model"] if r["model"] == "xmod-a3k16" and r["gpu"] == "H100")
    launches = {k: r["forward_launches"] + r["backward_launches"] for k, r in layers.items()}
    assert a3k16["launches"] == 10 * launches["dense"] + 288 * launches["xmod_sparse"]
    assert a3k16["eager_host_s"] == pytest.approx(a3k16["launches"] * data["meta"]["us_per_launch"] * 1e-6)
    # no GPU: the graph rows say so, the profiled step has host time and no device time
    assert all(r["error"].startswith("skipped") for r in data["graphs"])
    assert [r["model"] for r in data["profiled"]] == ["dense", "mod"]
    assert all(r["host_ops_ms"] > 0 and r["device_ms"] is None for r in data["profiled"])
    text = (tmp_path / "host_overhead_t.md").read_text()
    assert "| xmod-a3k16 | H100 | 298 |" in text and "eager host/device" in text


def test_the_profiled_length_fits_the_gpus_memory(monkeypatch):
    """gpu_check's host step profiles A3K16 at 298m and L = 32768 (~117 GiB by throughput.py's estimate): at that
    length on an H200, at a quarter of it on an H100 (~78 GiB at 16384); Dense fits either at 32768."""
    from types import SimpleNamespace

    from megatron_xmod.presets import get_backbone

    backbone, cuda = get_backbone("298m"), torch.device("cuda")
    for gib, a3k16 in ((80, 8192), (141, 32768)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d, gib=gib: SimpleNamespace(total_memory=gib * 2**30))
        assert host_overhead.fitting_seq_len(backbone, "xmod-a3k16", 32768, cuda) == a3k16
        assert host_overhead.fitting_seq_len(backbone, "dense", 32768, cuda) == 32768
    assert host_overhead.fitting_seq_len(backbone, "xmod-a3k16", 32768, torch.device("cpu")) == 32768
