"""bench/throughput.py at a tiny size on CPU: the numbers it reports are consistent with the
accounting and with each other (speed itself is a benchmark, recorded in bench/results/)."""
import json
import os
import re
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import throughput  # noqa: E402
from megatron_xmod.accounting import count  # noqa: E402
from megatron_xmod.presets import Backbone, parse_model  # noqa: E402


@pytest.mark.slow
def test_tiny_run_reports_consistent_numbers(megatron_parallel, tmp_path, monkeypatch):
    models = ["dense", "xmod-a4k8"]
    # Count the micro-batches that really ran: every forward_step call, per model (the wrapped model
    # megatron hands to forward_step is the one ModelRun built).
    calls, order, forward_step = {}, [], throughput.forward_step
    built = {}
    real_init = throughput.ModelRun.__init__

    def init(self, backbone, name, *args, **kwargs):
        real_init(self, backbone, name, *args, **kwargs)
        built[id(self.model)] = name

    def counting_forward_step(data_iterator, model):
        name = built[id(model)]
        calls[name] = calls.get(name, 0) + 1
        if not order or order[-1] != name:
            order.append(name)
        return forward_step(data_iterator, model)

    monkeypatch.setattr(throughput.ModelRun, "__init__", init)
    monkeypatch.setattr(throughput, "forward_step", counting_forward_step)
    assert throughput.main(["--tiny", "--activated-depth", "9", "--models", *models, "--num-microbatches", "3",
                            "--out", str(tmp_path), "--tag", "t"]) == 0
    data = json.loads((tmp_path / "throughput_t.json").read_text())
    meta, rows = data["meta"], {r["model"]: r for r in data["rows"]}
    assert list(rows) == models and meta["seq_len"] == 64 and meta["dtype"] == "fp32"
    assert meta["num_microbatches"] == 3 and meta["schedule"].startswith("interleaved")
    # 1 warm-up + 1 timed step of 3 micro-batches, then 1 + 1 evaluation steps of one micro-batch;
    # round-robin: dense's step, then the X-MoD model's, then dense's again, ...
    assert calls == {m: 2 * 3 + 2 for m in models}
    assert order == models * 4
    backbone = Backbone(**meta["backbone"])
    assert backbone.num_layers == 9
    tokens = meta["seq_len"] * meta["micro_batch"]
    for name, r in rows.items():
        description = parse_model(name, backbone)
        counted = count(description, meta["seq_len"])
        # The model that ran is the one the accounting describes, and the ideal is the accounting's.
        assert r["num_layers"] == description.layout.num_layers and r["layout"] == description.layout.notation
        assert r["params"] == counted.total_params
        assert r["ideal_ratio"] == pytest.approx(counted.tokens_ratio_vs_dense)
        assert r["train_microbatches_run"] == 2 * 3 and r["eval_microbatches_run"] == 2
        # fwd+bwd and the optimizer step are timed apart; a step is their sum, of 3 micro-batches' tokens
        assert r["train_step_s"] == pytest.approx([a + b for a, b in zip(r["train_fwd_bwd_s"], r["train_optimizer_s"])])
        assert r["fwd_bwd_s"] > 0 and r["optimizer_s"] > 0
        assert r["train_tok_s"] == pytest.approx(3 * tokens / statistics.median(r["train_step_s"]))
        assert r["eval_tok_s"] == pytest.approx(tokens / statistics.median(r["eval_step_s"]))
        for phase in ("train", "eval"):
            ratio = r[f"{phase}_tok_s"] / rows["dense"][f"{phase}_tok_s"]
            assert r[f"{phase}_ratio"] == pytest.approx(ratio)
            assert r[f"{phase}_fraction_of_ideal"] == pytest.approx(ratio / r["ideal_ratio"])
        # A fresh model on random tokens: the LM loss is near ln(vocab), and finite.
        assert all(abs(loss - 4.852) < 0.5 for loss in r["train_loss"])
    xmod = rows["xmod-a4k8"]
    sparse = parse_model("xmod-a4k8", backbone).layout.num_sparse_layers
    assert xmod["selected_fraction"] == pytest.approx(1 / 8)  # top-k routes exactly L/K
    # Every sparse layer's routing step of every forward pass (training and top-k evaluation) went
    # through megatron_xmod.xmod.kernels: 2 training steps (warm-up + timed) of 3 micro-batches, 2 evaluation passes.
    assert sum(xmod["routing_step_calls"].values()) == sparse * (2 * 3 + 2)
    assert meta["routing_backend"] == ", ".join(f"{k} ({v} calls)" for k, v in xmod["routing_step_calls"].items())
    # the host's memory bandwidth before the run, then at each report: the timed round, the evaluation
    assert len(meta["memory_gbs"]) == 3 and all(v > 0 for v in meta["memory_gbs"])
    text = (tmp_path / "throughput_t.md").read_text()
    assert "| xmod-a4k8 | 37 |" in text and "FLOP-ideal" in text and "optimizer s/step" in text
    assert "memory bandwidth" in text and f"routing step backend: {meta['routing_backend']};" in text


def test_sequential_fallback_and_microbatch_default(megatron_parallel, tmp_path, monkeypatch):
    """--sequential runs model after model; without --num-microbatches the CPU default is 4."""
    order = []
    forward_step = throughput.forward_step

    def counting_forward_step(data_iterator, model):
        order.append(id(model))
        return forward_step(data_iterator, model)

    monkeypatch.setattr(throughput, "forward_step", counting_forward_step)
    assert throughput.main(["--tiny", "--activated-depth", "9", "--models", "dense", "mod", "--warmup", "0",
                            "--sequential", "--out", str(tmp_path), "--tag", "s"]) == 0
    data = json.loads((tmp_path / "throughput_s.json").read_text())
    assert data["meta"]["num_microbatches"] == 4 and data["meta"]["schedule"].startswith("sequential")
    assert [r["train_microbatches_run"] for r in data["rows"]] == [4, 4]
    # model after model: all of dense's 4 + 2 forward calls, then all of MoD's
    assert len(order) == 12 and len(set(order[:6])) == 1 and len(set(order[6:])) == 1 and order[0] != order[6]


@pytest.mark.parametrize("argv, match", [
    (["--tiny", "--seq-len", "60"], "--seq-len: 60 is not divisible by K=8"),
    (["--tiny", "--models", "dense", "moe"], "--models: \\['moe'\\] not among"),
    (["--device", "tpu"], "--device: 'tpu' is not cpu or cuda"),
    (["--backbone", "2b"], "backbone: '2b' is not one of"),
    (["--tiny", "--num-microbatches", "0"], "--num-microbatches: at least 1"),
])
def test_bad_arguments_fail_before_any_work(argv, match, capsys):
    with pytest.raises(SystemExit) as excinfo:
        throughput.main(argv + ["--out", "/nonexistent/never-written"])
    assert excinfo.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.slow
def test_compiled_region_bench_is_one_graph_per_layer_kind(tmp_path):
    """bench/compiled_region.py (its own process: it turns Dynamo on and silences a megatron warning):
    the routed layers share one compiled graph and the dense layer has one, with no graph break, and
    the compiled layers compute what the eager ones do."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compiled_region.py"), "--seq-len", "64",
                           "--steps", "1", "--out", str(tmp_path), "--tag", "t"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "compiled_region_t.json").read_text())["result"]
    assert result["dynamo_stats"]["unique_graphs"] == 2 and not result["graph_breaks"], result
    for kind in ("routed", "dense"):
        assert result["checks"][kind]["output_max_abs_diff"] < 1e-5
        assert result["checks"][kind]["input_grad_max_abs_diff"] < 1e-5
    assert result["routed_layer_ms"]["eager"] > 0 and result["routed_speedup"] > 0
    assert "| routed (K = 8, per layer) |" in (tmp_path / "compiled_region_t.md").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm and glibc's mallopt")
def test_benchmarks_keep_freed_memory_resident():
    """The CPU benchmarks serve large requests from the heap and never trim it (keep_freed_memory): a freed
    64 MB tensor stays resident for the next pass to reuse, where glibc's default maps it fresh and hands it
    back on free (the next pass faults its pages in again; a cost that fell on Dense's large activations).
    In a child process: the setting is process-wide."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "bench")
        import torch
        from throughput import keep_freed_memory

        def resident_after_free():
            base = int(open("/proc/self/statm").read().split()[1]) * 4096
            t = torch.ones(16 * 2**20)
            del t
            return int(open("/proc/self/statm").read().split()[1]) * 4096 - base

        resident_after_free()  # torch's own first-use pages, not the tensor's
        print(resident_after_free(), keep_freed_memory(), resident_after_free())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    default, applied, kept = out.split()
    assert applied == "True"
    assert int(default) < 24 * 2**20 and int(kept) > 56 * 2**20, (default, kept)
