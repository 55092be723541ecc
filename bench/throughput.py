"""End-to-end training and evaluation tokens/s of Dense, MoD, X-MoD A4K8 and A3K16 (the X-MoD
paper's Table 11), through the real megatron model, schedule and optimizer step.

Every model is built at the same activated depth (the backbone's ``num_layers``, 28 for Table 4)
by megatron_xmod's builders, wrapped like megatron's training loop wraps it (Float16Module for
bf16, megatron's DistributedDataParallel, the DistributedOptimizer from
``get_megatron_optimizer``, ``finalize_model_grads``) on a single-rank process group, and timed
over whole steps: ``forward_backward_func`` over ``--num-microbatches`` micro-batches (default 10
on a GPU: the paper's 80 sequences a step on 8 GPUs; 4 on CPU), then one ``optimizer.step()``,
the two timed apart. The models' steps are interleaved (step 1 of every model, then step 2, ...)
so that a drift of the machine's load hits every model alike; on a GPU where all models do not fit
at once (or with ``--sequential``) they run model after model. Evaluation is ``forward_only``, one
micro-batch a step, under the top-k rule (a fresh router's threshold rule would route about half
of the tokens, not the 1/K a trained router routes).

For each model it prints tokens/s, the ratio to Dense, the FLOP-ideal ratio (Dense FLOPs per
token / the model's, from megatron_xmod.accounting) and the fraction of it achieved, and writes
bench/results/throughput_<machine>_<date>.json and .md.

    python bench/throughput.py                    # GPU: L=32768, largest Table 4 backbone that fits
    python bench/throughput.py --device cpu       # CPU: small backbone, L=2048
    python bench/throughput.py --tiny             # seconds, for the CI test and gpu_check.sh --cpu
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_xmod.accounting import count  # noqa: E402
from megatron_xmod.presets import BACKBONES, Backbone, get_backbone, parse_model  # noqa: E402

MODELS = ("dense", "mod", "xmod-a4k8", "xmod-a3k16")
# CPU: the Table 4 shape (GQA 2:1, SwiGLU 3x, 28 activated layers) at a width a 2-core CPU can step.
CPU_BACKBONE = Backbone("cpu-256", hidden_size=256, head_dim=64, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=768, num_layers=28, vocab_size=1024, rotary_base=10000)
TINY_BACKBONE = Backbone("tiny-32", hidden_size=32, head_dim=16, num_attention_heads=2, num_query_groups=1,
                         ffn_hidden_size=64, num_layers=28, vocab_size=128, rotary_base=10000)
# bytes per parameter with the distributed optimizer on one rank: bf16 param, fp32 grad, fp32 main
# param, Adam m and v.
BYTES_PER_PARAM = 2 + 4 + 4 + 8


# ------------------------------------------------------------------------------------ set-up

@contextlib.contextmanager
def single_rank_megatron(seed: int = 1234):
    """megatron-core's model-parallel state on a one-rank process group (gloo on CPU, nccl on GPU),
    with the CPU patches where there is no GPU."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xmod.cpu_shim import cpu_patches

    with cpu_patches(training=False):
        if not torch.distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(0)
            torch.distributed.init_process_group(backend, rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        yield parallel_state


def keep_freed_memory() -> bool:
    """glibc's malloc serves a large request (a 2048-token pass's activations, 6-100 MB) with a fresh mmap and
    hands it back to the kernel on free, so the next pass faults in and zeroes its pages again; which requests
    pay depends on what the process allocated before (glibc moves its mmap threshold as it goes). On this
    machine that made the same Dense prefill (generate.py) take 1x-2x as long from one call to the next, and
    X-MoD, whose sparse layers allocate small tensors, hardly at all: ratios that measured the allocator.
    Serving every request from the heap and never trimming it (``mallopt``) measures the model. Call before
    the models are built; returns False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_mmap_max, m_trim_threshold = -4, -1  # glibc's malloc.h
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))  # a C int
    except (OSError, AttributeError):
        return False


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{os.cpu_count()}-core CPU ({model}), no GPU"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        # changed tracked code only: a run's own new result files under bench/results are not a change to it
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "megatron_xmod", "bench",
                                "csrc"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def memory_bandwidth_gbs(device, mib: int = 256, repeats: int = 5) -> float | None:
    """The memory bandwidth a copy gets now (GB/s read + written, best of ``repeats`` copies of ``mib`` MiB with
    torch's threads; CPU only, None on a GPU). A 298-layer A3K16 micro-batch streams its 235M parameters'
    weights, gradients and fp32 main gradients (several GB) through memory where Dense's 22.6M fit the caches
    far better, so a neighbour on the same host taking bandwidth slows X-MoD most, which the load average (this
    machine's own CPUs) does not show (bench/contention.py). Recorded before the run and after every round."""
    if torch.device(device).type != "cpu":
        return None
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return round(2 * source.numel() * 4 / best / 1e9, 1)


def run_meta(device, extra: dict) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), device=machine_name(torch.device(device)),
                device_type=torch.device(device).type, commit=git_commit(), torch=torch.__version__,
                cuda=torch.version.cuda, triton=triton_version, python=sys.version.split()[0], loadavg=loadavg(),
                **extra)


# ------------------------------------------------------------------------------------ models

def model_config(backbone: Backbone, name: str, device: torch.device, bf16: bool, compile_layers: bool = False):
    from megatron_xmod.model import config_from_backbone

    dtype = {"params_dtype": torch.bfloat16, "bf16": True} if bf16 else {}
    return config_from_backbone(backbone, name, use_cpu_initialization=device.type == "cpu",
                                xmod_compile_layers=compile_layers, **dtype)


def build_training(backbone: Backbone, name: str, seq_len: int, device: torch.device, bf16: bool,
                   compile_layers: bool = False):
    """(wrapped model, optimizer, config): what megatron.training's setup_model_and_optimizer makes."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_xmod.model import build_gpt_model

    config = model_config(backbone, name, device, bf16, compile_layers)
    model = build_gpt_model(config, backbone.vocab_size, seq_len, rotary_base=backbone.rotary_base)
    if device.type == "cuda":
        model = model.cuda()
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=False)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=bf16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=True, clip_grad=1.0), [model])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, config


def forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)  # per-token LM loss [b, s]

    def loss_func(per_token):
        loss = per_token.float().mean()
        # a copy: megatron's schedule divides the returned loss by num_microbatches in place
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def batches(backbone: Backbone, seq_len: int, micro_batch: int, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(seq_len).expand(micro_batch, seq_len).to(device)
    while True:
        tokens = torch.randint(0, backbone.vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class ModelRun:
    """One model built for training, stepped one optimizer step at a time (so that several models'
    steps can be interleaved): ``forward_backward_func`` over ``num_microbatches`` micro-batches,
    then ``optimizer.step()``, each timed on its own."""

    def __init__(self, backbone, name, seq_len, micro_batch, num_microbatches, device, bf16, compile_layers=False):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.name, self.device, self.num_microbatches = name, device, num_microbatches
        self.tokens = seq_len * micro_batch  # per micro-batch
        self.model, self.optimizer, self.config = build_training(backbone, name, seq_len, device, bf16, compile_layers)
        self.forward_backward = get_forward_backward_func()
        self.common = dict(forward_step_func=self._forward_step, data_iterator=batches(backbone, seq_len, micro_batch, device),
                           model=[self.model], seq_length=seq_len, micro_batch_size=micro_batch)
        self.forward_calls = 0  # micro-batches run (training and evaluation)
        self.train_microbatches = self.eval_microbatches = 0
        self.fwd_bwd_s, self.optimizer_s, self.train_losses, self.eval_s = [], [], [], []
        self.warmup_fwd_bwd_s, self.eval_warmup_s = [], []  # untimed steps (with --compile-layers: compilation)
        self.grad_norm, self.routing, self.peak_gib = None, {}, None
        self.launched: dict = {}

    def _forward_step(self, data_iterator, model):
        self.forward_calls += 1
        return forward_step(data_iterator, model)  # the module's, looked up per call (tests count it)

    def _count_launches(self, before):
        from megatron_xmod.xmod import kernels

        for k, v in kernels.launch_counts.items():
            if v - before.get(k, 0):
                self.launched[k] = self.launched.get(k, 0) + v - before.get(k, 0)

    def train_step(self, timed: bool):
        from megatron_xmod.xmod import kernels

        before = dict(kernels.launch_counts)
        self.model.train()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        calls = self.forward_calls
        _sync(self.device)
        t0 = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(forward_only=False, num_microbatches=self.num_microbatches, **self.common)
        _sync(self.device)
        t1 = time.perf_counter()
        _ok, grad_norm, _ = self.optimizer.step()
        _sync(self.device)
        t2 = time.perf_counter()
        self.train_microbatches += self.forward_calls - calls
        self._count_launches(before)
        if self.device.type == "cuda":  # with interleaving this includes the other models' resident state
            self.peak_gib = max(self.peak_gib or 0.0, torch.cuda.max_memory_allocated() / 2**30)
        if not timed:
            self.warmup_fwd_bwd_s.append(t1 - t0)
        else:
            self.fwd_bwd_s.append(t1 - t0)
            self.optimizer_s.append(t2 - t1)
            self.train_losses.append(float(statistics.mean(float(x["lm loss"]) for x in losses)))
            self.grad_norm = float(grad_norm) if grad_norm is not None else None

    def end_training(self):
        from megatron_xmod.xmod.routing_state import report

        self.routing = report(self.model) if self.name != "dense" else {}

    def eval_step(self, timed: bool):
        """One forward-only micro-batch under the top-k rule (no optimizer step to amortise)."""
        from megatron_xmod.xmod import kernels
        from megatron_xmod.xmod.routing_state import eval_routing

        before = dict(kernels.launch_counts)
        calls = self.forward_calls
        self.model.eval()
        with eval_routing(self.model, "topk"), torch.no_grad():
            _sync(self.device)
            t0 = time.perf_counter()
            self.forward_backward(forward_only=True, num_microbatches=1, **self.common)
            _sync(self.device)
            elapsed = time.perf_counter() - t0
        self.model.train()
        self.eval_microbatches += self.forward_calls - calls
        self._count_launches(before)
        (self.eval_s if timed else self.eval_warmup_s).append(elapsed)

    def result(self) -> dict:
        steps = [a + b for a, b in zip(self.fwd_bwd_s, self.optimizer_s)]
        train_tokens = self.tokens * self.num_microbatches
        med = lambda v: statistics.median(v) if v else None  # noqa: E731
        tok = lambda n, t: n / t if t else None  # noqa: E731
        return dict(train_step_s=steps, train_fwd_bwd_s=list(self.fwd_bwd_s), train_optimizer_s=list(self.optimizer_s),
                    eval_step_s=list(self.eval_s), train_loss=list(self.train_losses),
                    warmup_fwd_bwd_s=list(self.warmup_fwd_bwd_s), eval_warmup_s=list(self.eval_warmup_s),
                    num_microbatches=self.num_microbatches, train_microbatches_run=self.train_microbatches,
                    eval_microbatches_run=self.eval_microbatches,
                    fwd_bwd_s=med(self.fwd_bwd_s), optimizer_s=med(self.optimizer_s),
                    optimizer_fraction=(med(self.optimizer_s) / med(steps)) if steps else None,
                    train_tok_s=tok(train_tokens, med(steps)), eval_tok_s=tok(self.tokens, med(self.eval_s)),
                    # best-of: on a shared machine the fastest step is the closest to the code's own cost
                    train_best_tok_s=tok(train_tokens, min(steps, default=None)),
                    eval_best_tok_s=tok(self.tokens, min(self.eval_s, default=None)),
                    selected_fraction=self.routing.get("selected_fraction"), peak_gib=self.peak_gib,
                    params=sum(p.numel() for p in self.model.parameters()),
                    routing_step_calls=dict(self.launched), grad_norm=self.grad_norm)


def time_models(backbone, models, seq_len, micro_batch, num_microbatches, device, bf16, warmup, steps, eval_steps,
                interleave=True, on_progress=None, compile_layers=False) -> dict:
    """{model: result}. ``interleave``: all models are built first and stepped round-robin (step 1 of
    every model, then step 2, ...), so that a drift of the machine's load hits every model alike;
    otherwise model after model (one model in memory at a time). ``on_progress(results)`` after
    every timed round (or model), so that a run cut off keeps what finished."""
    groups = [list(models)] if interleave else [[m] for m in models]
    results = {}
    for group in groups:
        runs = {}
        for m in group:
            print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] build {m} on {backbone.name}, L={seq_len}", flush=True)
            runs[m] = ModelRun(backbone, m, seq_len, micro_batch, num_microbatches, device, bf16, compile_layers)
        for i in range(warmup + steps):
            for run in runs.values():
                run.train_step(timed=i >= warmup)
            if i >= warmup and on_progress and interleave:
                on_progress({**results, **{m: r.result() for m, r in runs.items()}})
        for run in runs.values():
            run.end_training()
        for i in range(1 + eval_steps):  # one untimed warm-up step
            for run in runs.values():
                run.eval_step(timed=i >= 1)
        for m, run in runs.items():
            results[m] = run.result()
        if on_progress:
            on_progress(dict(results))
        del runs
        free_memory(device)
    return results


# ------------------------------------------------------------------------------------ sizing

def estimated_parts_gib(backbone: Backbone, name: str, seq_len: int, micro_batch: int) -> tuple[float, float]:
    """(resident state, one micro-batch's activations) in GiB: a rough upper estimate."""
    description = parse_model(name, backbone)
    params = count(description, seq_len).total_params
    tokens, h = seq_len * micro_batch, backbone.hidden_size
    activations = 0.0
    for layer in description.layout.layers:
        routed = tokens * float(layer.routed_fraction)
        # ~24 saved bf16 values per routed token and hidden unit (norms, qkv, SwiGLU, flash attention)
        # plus, for a sparse layer, its full-length output and router input.
        activations += routed * h * 2 * 24 + (2 * tokens * h * 2 if layer.is_sparse else 0)
    logits = tokens * backbone.vocab_size * 4 * 3
    return params * BYTES_PER_PARAM / 2**30, (activations + logits) / 2**30


def estimated_gib(backbone: Backbone, name: str, seq_len: int, micro_batch: int) -> float:
    """A rough upper estimate of one training step's memory (optimizer state + activations)."""
    return sum(estimated_parts_gib(backbone, name, seq_len, micro_batch))


def fit_together(backbone: Backbone, models, seq_len: int, micro_batch: int, device) -> bool:
    """Whether every model's resident state plus the largest model's activations fit at once (the
    interleaved schedule keeps all models built); always on CPU."""
    if device.type != "cuda":
        return True
    parts = [estimated_parts_gib(backbone, m, seq_len, micro_batch) for m in models]
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return sum(state for state, _ in parts) + max(act for _, act in parts) < 0.85 * total


def pick_backbone(models, seq_len, micro_batch, device, requested: str | None):
    """The requested backbone, or on a GPU the largest Table 4 backbone all models are estimated to fit."""
    if requested:
        return [get_backbone(requested) if requested not in (CPU_BACKBONE.name, TINY_BACKBONE.name) else
                {CPU_BACKBONE.name: CPU_BACKBONE, TINY_BACKBONE.name: TINY_BACKBONE}[requested]]
    if device.type != "cuda":
        return [CPU_BACKBONE]
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    fitting = [b for b in sorted(BACKBONES.values(), key=lambda b: -b.hidden_size)
               if max(estimated_gib(b, m, seq_len, micro_batch) for m in models) < 0.9 * total]
    return fitting or [min(BACKBONES.values(), key=lambda b: b.hidden_size)]


# ------------------------------------------------------------------------------------ report

def ideal_ratios(backbone: Backbone, models, seq_len: int) -> dict:
    return {m: count(parse_model(m, backbone), seq_len).tokens_ratio_vs_dense for m in models}


def summarize(rows: list[dict]) -> list[dict]:
    dense = next((r for r in rows if r["model"] == "dense"), None)
    def over(r, key):
        return r[key] / dense[key] if dense and r[key] is not None and dense[key] else None

    for r in rows:
        for phase in ("train", "eval"):
            ratio = over(r, f"{phase}_tok_s")
            r[f"{phase}_ratio"] = ratio
            r[f"{phase}_fraction_of_ideal"] = ratio / r["ideal_ratio"] if ratio is not None else None
            r[f"{phase}_best_ratio"] = over(r, f"{phase}_best_tok_s")
    return rows


def render_markdown(meta: dict, rows: list[dict]) -> str:
    b = meta["backbone"]
    out = [f"# Throughput: Dense, MoD, X-MoD at equal activated depth ({meta['device']})", "",
           f"- date: {meta['date']}; commit {meta['commit']}; torch {meta['torch']} (CUDA {meta['cuda']}), "
           f"triton {meta['triton']}",
           f"- backbone {b['name']} (h={b['hidden_size']}, heads {b['num_attention_heads']}/{b['num_query_groups']}, "
           f"ffn {b['ffn_hidden_size']}, activated depth {b['num_layers']}, vocab {b['vocab_size']}); "
           f"L={meta['seq_len']}, micro-batch {meta['micro_batch']}, {meta['dtype']}",
           f"- per model: {meta['warmup']} warm-up + {meta['steps']} timed training steps of {meta['num_microbatches']} "
           f"micro-batches each (forward_backward_func over the micro-batches, then one DistributedOptimizer Adam "
           f"step; median), {meta['eval_steps']} evaluation steps of one micro-batch (forward only, top-k rule)",
           f"- schedule: {meta['schedule']}",
           "- malloc: " + ("freed memory kept by the process (mallopt; keep_freed_memory)" if meta.get("steady_malloc")
                           else "the C library's defaults"),
           "- layers: " + ("each one torch.compile region (--xmod-compile-layers); warm-up forward + backward "
                           "(compilation included) " + ", ".join(f"{r['model']} {sum(r['warmup_fwd_bwd_s']):.0f} s"
                                                                 for r in rows) if meta.get("compile_layers") else "eager"),
           f"- routing step backend: {meta['routing_backend']}; permutation backend: {meta['permute_backend']}",
           f"- load average before/after (1/5/15 min): {meta['loadavg_start']} / {meta['loadavg']}",
           *(["- memory bandwidth (GB/s read + written, best of 5 copies of 256 MiB): before the run, then after each round: "
              + ", ".join(f"{v:g}" for v in meta["memory_gbs"])] if meta.get("memory_gbs") else []), "",
           "| model | layers | params | fwd+bwd s/step | optimizer s/step | train tok/s | vs Dense | FLOP-ideal | of ideal "
           "| eval tok/s | vs Dense | of ideal |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        out.append(f"| {r['model']} | {r['num_layers']} | {r['params'] / 1e6:.1f}M | {f(r['fwd_bwd_s'], '.3f')} | "
                   f"{f(r['optimizer_s'], '.3f')} ({f(r['optimizer_fraction'], '.0%')}) | {f(r['train_tok_s'], '.0f')} | "
                   f"{f(r['train_ratio'], '.2f')}x | {r['ideal_ratio']:.2f}x | {f(r['train_fraction_of_ideal'], '.0%')} | "
                   f"{f(r['eval_tok_s'], '.0f')} | {f(r['eval_ratio'], '.2f')}x | {f(r['eval_fraction_of_ideal'], '.0%')} |")
    out += ["", "Best-of (fastest step, closer to the code's own cost on a shared machine): "
            + "; ".join(f"{r['model']} train {f(r['train_best_tok_s'], '.0f')} tok/s ({f(r['train_best_ratio'], '.2f')}x), "
                        f"eval {f(r['eval_best_tok_s'], '.0f')} tok/s ({f(r['eval_best_ratio'], '.2f')}x)" for r in rows) + "."]
    out += ["", "FLOP-ideal: Dense forward FLOPs per token / the model's (megatron_xmod.accounting: matmuls and "
            "full-length attention, LM head excluded)."]
    if meta["device_type"] == "cpu":
        out += ["", "CPU numbers are not the GPU targets: per-op overhead weighs far more at this width (the X-MoD "
                "models have 6-10x the layers of Dense; bench/results/ops_*), and CPU kernels are not equally "
                "efficient at every shape (attention over L versus L/K tokens, thin matmuls). The GPU run of "
                "bench/gpu_check.sh gives the numbers the targets refer to."]
        if meta["loadavg_start"] and meta["loadavg_start"][0] > 0.5 * (os.cpu_count() or 1):
            out += [f"The machine was shared (load {meta['loadavg_start'][0]} on {os.cpu_count()} cores): "
                    "times include waits for other processes."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--backbone", default=None,
                   help=f"one of {', '.join(BACKBONES)}, {CPU_BACKBONE.name}, {TINY_BACKBONE.name} "
                        "(default: GPU the largest that fits, CPU cpu-256)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--seq-len", type=int, default=None, help="default: 32768 on GPU, 2048 on CPU")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--eval-steps", type=int, default=None)
    p.add_argument("--num-microbatches", type=int, default=None,
                   help="micro-batches per optimizer step (default: 10 on GPU, the paper's 80 sequences a step on 8 "
                        "GPUs; 4 on CPU)")
    p.add_argument("--sequential", action="store_true",
                   help="model after model instead of interleaving the models' steps (on a GPU this is the "
                        "fallback when all models do not fit at once)")
    p.add_argument("--activated-depth", type=int, default=None,
                   help="activated depth every model is matched to (default: the backbone's, 28 for Table 4)")
    p.add_argument("--compile-layers", action="store_true",
                   help="every model with --xmod-compile-layers (each layer one torch.compile region); the warm-up "
                        "step, which compiles, is reported apart")
    p.add_argument("--tiny", action="store_true", help=f"{TINY_BACKBONE.name}, L=64, 1+1 steps: seconds (CI; pass --num-microbatches for fewer than 4)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default=None, help="results name throughput_<tag>.* (default <machine>_<date>)")
    a = p.parse_args(argv)

    device_name = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_name not in ("cpu", "cuda"):
        p.error(f"--device: {device_name!r} is not cpu or cuda")
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device: cuda requested but no CUDA device is available; use --device cpu")
    on_gpu = device.type == "cuda"
    if a.tiny:
        a.backbone = a.backbone or TINY_BACKBONE.name
        a.seq_len = a.seq_len or 64
    seq_len = a.seq_len or (32768 if on_gpu else 2048)
    warmup = a.warmup if a.warmup is not None else (1 if a.tiny or not on_gpu else 2)
    steps = a.steps if a.steps is not None else (1 if a.tiny else 3)
    eval_steps = a.eval_steps if a.eval_steps is not None else (1 if a.tiny else 2)
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"--models: {unknown} not among {', '.join(MODELS)}")
    num_microbatches = a.num_microbatches if a.num_microbatches is not None else (10 if on_gpu else 4)
    if steps < 1 or eval_steps < 1 or warmup < 0:
        p.error("--steps/--eval-steps: at least 1 each; --warmup: >= 0")
    if num_microbatches < 1:
        p.error("--num-microbatches: at least 1")
    try:
        candidates = pick_backbone(a.models, seq_len, a.micro_batch, device, a.backbone)
        if a.activated_depth is not None:
            candidates = [replace(b, num_layers=a.activated_depth) for b in candidates]
        for b in candidates[:1]:  # fail before any expensive work: layouts and L/K
            for m in a.models:
                description = parse_model(m, b)
                for layer in description.layout.layers:
                    if layer.is_sparse and seq_len % layer.sparsity_k:
                        raise ValueError(f"--seq-len: {seq_len} is not divisible by K={layer.sparsity_k} of {m}; "
                                         "use a multiple of 16")
    except ValueError as e:
        p.error(str(e))

    bf16 = on_gpu
    steady_malloc = not on_gpu and keep_freed_memory()
    loadavg_start = loadavg()
    memory_gbs = [memory_bandwidth_gbs(device)] if not on_gpu else []
    tag = a.tag or f"{'gpu' if on_gpu else 'cpu'}_{dt.datetime.now(dt.UTC).strftime('%Y%m%d')}"
    settings = dict(seq_len=seq_len, micro_batch=a.micro_batch, num_microbatches=num_microbatches, eval_microbatches=1,
                    dtype="bf16" if bf16 else "fp32", warmup=warmup, steps=steps, eval_steps=eval_steps,
                    loadavg_start=loadavg_start, compile_layers=a.compile_layers, steady_malloc=steady_malloc,
                    memory_gbs=memory_gbs)
    rows = None
    with single_rank_megatron():
        for backbone in candidates:
            ideal = ideal_ratios(backbone, a.models, seq_len)
            interleave = not a.sequential and fit_together(backbone, a.models, seq_len, a.micro_batch, device)
            while True:
                schedule = ("interleaved: step i of every model, then step i + 1" if interleave else
                            "sequential: model after model")
                print(f"{backbone.name}: {schedule}", flush=True)

                rows = []

                def progress(results, backbone=backbone, schedule=schedule, rows=rows, ideal=ideal):
                    # after every round (or model): a run cut off by a time limit keeps what finished
                    if memory_gbs:
                        memory_gbs.append(memory_bandwidth_gbs(device))
                    rows[:] = [make_row(m, backbone, ideal, results[m]) for m in a.models if m in results]
                    write_results(a.out, tag, device, backbone, dict(settings, schedule=schedule), rows)

                try:
                    time_models(backbone, a.models, seq_len, a.micro_batch, num_microbatches, device, bf16, warmup,
                                steps, eval_steps, interleave=interleave, on_progress=progress,
                                compile_layers=a.compile_layers)
                    break
                except torch.cuda.OutOfMemoryError as e:
                    why = str(e).splitlines()[0]
                # here, after the except block, the traceback and the models its frames held are gone
                print(f"    out of memory on {backbone.name} ({why})")
                rows = None
                free_memory(device)
                if not interleave:
                    break
                    interleave = False  # the fallback: one model in memory at a time
                    print("    retrying model after model", flush=True)
            if rows is not None:
                break
            print("    trying a smaller backbone", flush=True)
        if rows is None:
            print("no backbone fits", file=sys.stderr)
            return 1
    for r in rows:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['model']:11s} fwd+bwd {r['fwd_bwd_s']:.3f} s + optimizer {r['optimizer_s']:.3f} s a step; "
              f"train {r['train_tok_s']:10.0f} tok/s  x{f(r['train_ratio'], '.2f')} of Dense "
              f"(ideal x{r['ideal_ratio']:.2f}, {f(r['train_fraction_of_ideal'], '.0%')})   "
              f"eval {r['eval_tok_s']:10.0f} tok/s x{f(r['eval_ratio'], '.2f')}")
    print(f"wrote {a.out}/throughput_{tag}.json and .md")
    return 0


def make_row(model: str, backbone: Backbone, ideal: dict, result: dict) -> dict:
    layout = parse_model(model, backbone).layout
    return dict(model=model, layout=layout.notation, num_layers=layout.num_layers, ideal_ratio=ideal[model], **result)


def write_results(out_dir, tag, device, backbone, settings, rows):
    from megatron_xmod.xmod import permute

    summarize(rows)
    probe = torch.zeros(1, 1, 8, device=device, dtype=torch.bfloat16 if settings["dtype"] == "bf16" else torch.float32)
    routed = [r for r in rows if r["routing_step_calls"]]  # the first routed model's calls name the backend
    calls = routed[0]["routing_step_calls"] if routed else {}
    meta = run_meta(device, dict(backbone=asdict(backbone), **settings, permute_backend=permute.selected_backend(probe),
                                 routing_backend=", ".join(f"{k} ({v} calls)" for k, v in calls.items()) or "-"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"throughput_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out_dir, f"throughput_{tag}.md"), "w") as f:
        f.write(render_markdown(meta, rows))


if __name__ == "__main__":
    sys.exit(main())
