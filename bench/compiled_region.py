"""What one compiled region per layer buys a routed layer on this machine (issue 28, item 2's "one compiled
region ... is a fair way to get there; say what it costs at start-up").

    python bench/compiled_region.py                 # cpu-256, L = 2048, a stack of 8 X-MoD K = 8 layers + 1 dense

Two copies of one model (``D + S8*8 + D``, megatron's GPTModel built by megatron_xmod, same weights): one
eager, one whose layers run megatron's attention and MLP (``XModSparseLayer._attention_and_mlp``; the dense
layer's whole ``forward``) through ``torch.compile(dynamic=False)``: Inductor fuses megatron's RMSNorms,
RoPE, SwiGLU and residual adds around the matmuls, forward and backward. The routing, permutation and
gated update stay eager (the fused routing step is the GPU's answer to them). The routed layers share one
compiled graph (same shapes, parameters as graph inputs), so the start-up cost is paid once per layer kind.
Each timed step is one forward + backward of the 8 routed layers, then of the dense layer, eager and
compiled interleaved step by step (ratio of medians); the compiled copy's output and input gradient are
checked against the eager one's.

Inductor writes its kernels to a fresh cache directory for the run: a cache written on a CPU of another
vector width can hand back wrong kernels (docs/reliability.md). Writes
``compiled_region_<machine>_<date>.json`` / ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
from throughput import CPU_BACKBONE, model_config, run_meta, single_rank_megatron  # noqa: E402

ROUTED = 8


def _step(layers, x0, rope):
    x = x0.clone().requires_grad_(True)
    h = x
    for layer in layers:
        h, _ = layer(h, attention_mask=None, rotary_pos_emb=rope)
    h.backward(torch.ones_like(h))
    return h.detach(), x.grad


def measure(seq_len: int, steps: int, log=print) -> dict:
    import torch._dynamo
    import torch._dynamo.utils

    from megatron_xmod.model import build_gpt_model

    torch._dynamo.config.disable = False  # a CPU run of megatron turns Dynamo off (cpu_shim patch 11)
    # megatron's local linear warns on every call that it was given no tp_group (megatron/core/utils.py,
    # get_tensor_model_parallel_group_if_none): a graph break each time. Silenced here, for this process.
    import megatron.core.utils

    megatron.core.utils.warnings = types.SimpleNamespace(warn=lambda *args, **kwargs: None)
    config = model_config(CPU_BACKBONE, f"D + S8*{ROUTED} + D", torch.device("cpu"), bf16=False)
    eager, compiled = (build_gpt_model(config, CPU_BACKBONE.vocab_size, seq_len, rotary_base=CPU_BACKBONE.rotary_base)
                       .train() for _ in range(2))
    compiled.load_state_dict(eager.state_dict())  # same weights (a deepcopy would copy the process groups)
    rope = eager.rotary_pos_emb(seq_len)
    x0 = torch.randn(seq_len, 1, CPU_BACKBONE.hidden_size, generator=torch.Generator().manual_seed(0))
    stacks = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        layers = list(model.decoder.layers)
        stacks[name] = {"routed": layers[1:1 + ROUTED], "dense": layers[:1]}
    for layer in stacks["compiled"]["routed"]:
        layer._attention_and_mlp = torch.compile(layer._attention_and_mlp, dynamic=False)
    for layer in stacks["compiled"]["dense"]:
        layer.forward = torch.compile(layer.forward, dynamic=False)
    _step(stacks["eager"]["routed"], x0, rope)
    _step(stacks["eager"]["dense"], x0, rope)
    start = time.perf_counter()
    torch._dynamo.utils.counters.clear()
    checks = {}
    for kind in ("routed", "dense"):
        first = time.perf_counter()
        out, grad = _step(stacks["compiled"][kind], x0, rope)
        log(f"[compiled_region] {kind}: compiled in {time.perf_counter() - first:.1f} s")
        ref_out, ref_grad = _step(stacks["eager"][kind], x0, rope)
        checks[kind] = dict(output_max_abs_diff=float((out - ref_out).abs().max()),
                            input_grad_max_abs_diff=float((grad - ref_grad).abs().max()))
    compile_s = time.perf_counter() - start
    stats = {k: int(v) for k, v in torch._dynamo.utils.counters["stats"].items()}
    breaks = {k.strip().splitlines()[0]: int(v) for k, v in torch._dynamo.utils.counters["graph_break"].items()}
    times = {(name, kind): [] for name in stacks for kind in ("routed", "dense")}
    for i in range(steps):
        for kind in ("routed", "dense"):
            for name in ("eager", "compiled"):  # interleaved: load drift hits both alike
                t = time.perf_counter()
                _step(stacks[name][kind], x0, rope)
                times[name, kind].append(time.perf_counter() - t)
        log(f"[compiled_region] step {i + 1}/{steps}")
    med = {key: statistics.median(v) for key, v in times.items()}
    return dict(seq_len=seq_len, steps=steps, routed_layers=ROUTED, compile_s=compile_s, dynamo_stats=stats,
                graph_breaks=breaks, checks=checks,
                routed_layer_ms={name: med[name, "routed"] / ROUTED * 1e3 for name in stacks},
                dense_layer_ms={name: med[name, "dense"] * 1e3 for name in stacks},
                routed_speedup=med["eager", "routed"] / med["compiled", "routed"],
                dense_speedup=med["eager", "dense"] / med["compiled", "dense"],
                samples_s={f"{name}/{kind}": v for (name, kind), v in times.items()})


def render_markdown(meta, r) -> str:
    eager_ratio = r["dense_layer_ms"]["eager"] / r["routed_layer_ms"]["eager"]
    compiled_ratio = r["dense_layer_ms"]["compiled"] / r["routed_layer_ms"]["compiled"]
    return "\n".join([
        f"# A compiled region per layer ({meta['device']})", "",
        f"- date: {meta['date']}; commit {meta['commit']}; torch {meta['torch']}",
        f"- cpu-256, L = {r['seq_len']}, b = 1, fp32; {r['routed_layers']} X-MoD K = 8 routed layers and one dense layer, "
        f"forward + backward, eager and compiled interleaved, median of {r['steps']}",
        f"- load average at the end (1/5/15 min): {meta['loadavg']}", "",
        "| layer | eager ms | compiled ms | speedup |", "|---|---:|---:|---:|",
        f"| routed (K = 8, per layer) | {r['routed_layer_ms']['eager']:.1f} | {r['routed_layer_ms']['compiled']:.1f} | "
        f"{r['routed_speedup']:.2f}x |",
        f"| dense | {r['dense_layer_ms']['eager']:.1f} | {r['dense_layer_ms']['compiled']:.1f} | {r['dense_speedup']:.2f}x |",
        "",
        f"Dense layer / routed layer: {eager_ratio:.2f} eager, {compiled_ratio:.2f} compiled (FLOP-ideal at K = 8 is "
        "between 8, the matmuls, and 64, attention).",
        f"Start-up: {r['compile_s']:.0f} s to compile both layer kinds (Dynamo stats {r['dynamo_stats']}; graph breaks "
        f"{r['graph_breaks'] or 'none'}). Compiled vs eager: {r['checks']}.", ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (interleaved)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default=None, help="result name: compiled_region_<tag>.json/.md (default cpu_<date>)")
    a = p.parse_args(argv)
    if a.seq_len % 8:
        p.error(f"--seq-len: {a.seq_len} is not divisible by K = 8; use a multiple of 8")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="xmod-inductor-"))
    with single_rank_megatron():
        result = measure(a.seq_len, a.steps)
    meta = run_meta("cpu", {})
    tag = a.tag or f"cpu_{dt.datetime.now(dt.UTC).strftime('%Y%m%d')}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"compiled_region_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, result=result), f, indent=1)
    text = render_markdown(meta, result)
    with open(os.path.join(a.out, f"compiled_region_{tag}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
