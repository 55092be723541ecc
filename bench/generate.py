"""Prefill and decode speed of the Hugging Face models (megatron_xmod.hf), Dense against MoD and X-MoD
A4K8 / A3K16 at the same activated depth, with the KV-cache bytes and the host syncs per decoded token.

    .venv/bin/python bench/generate.py                       # CPU: hidden 512, prompts 256 and 2048, batch 1 and 8
    .venv/bin/python bench/generate.py --device cuda         # the same on a GPU
    .venv/bin/python bench/generate.py --quick               # seconds: hidden 64, prompt 32, 8 new tokens
    .venv/bin/python bench/generate.py --device cuda --fixed-shape   # also the fixed-shape decode (CUDA graph)
    .venv/bin/python bench/generate.py --prompts --long-contexts 2048 8192 32768 --new-tokens 16 --repeats 1 \
        --tag _long                                          # decode only, from synthetic caches of long contexts

The models are built from the X-MoD paper's Table 4 shape at ``--hidden`` (activated depth 28, dense
prefix 4: Dense 28 layers, MoD 49, X-MoD A4K8 161, A3K16 298) with random weights drawn as megatron-core
draws them (``--init megatron``: output projections at std / sqrt(2 layers); ``--init hf``, transformers'
one std, built the models of the results before session 28: see ``build_model``), and each sparse
layer's router bias is then set, layer by layer on a calibration prompt, so that the threshold rule
routes 1/K of the tokens (as a trained router does; a fresh one routes about half). Each row records
how evenly: the share of a sequence's tokens each sparse layer routes in a prefill of the timed prompt,
x 1/K. Greedy decoding (argmax), the model's own ``XModCache``. Every timed configuration runs the
models interleaved (model A, B, C, D, then again), medians of ``--repeats``.

Prefill computes the logits of the last position only (``logits_to_keep=1``, what ``generate``
asks for). With ``--per-layer-decode`` each repeat also decodes from a copy of the same prefill
with ``XModModel.decode_skips_unrouted = False`` ("decode before"): every sparse layer runs its
router and selection at every step and reads the selection back from the device (the decode path
before the run-ahead of ``XModModel._decode_sparse_run``).

With ``--fixed-shape`` each model also decodes from its own prefill into a fixed-shape cache
(``XModCache(max_cache_len=..., sparse_room=--sparse-room)``, megatron_xmod/hf/static_decode.py): timed
after its first two steps (the first builds the buffers, the second captures the CUDA graph on a GPU),
with the seconds of those two, whether a graph was captured, its host syncs per token, how often the
adaptive room read the counts and laid a layer out again, and whether it decoded the default path's
tokens; a failure (e.g. the first capture on a new GPU stack) is recorded in the row.

Writes ``generate_<machine>_<date>.json`` / ``.md`` and ``generate_<machine>_<date>.png`` (decode
tokens/s against prompt length) under ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the sync counter is a test tool, shared with the tests

from throughput import git_commit, keep_freed_memory, loadavg, machine_name  # noqa: E402  (bench/, this script's folder)

from megatron_xmod.hf.modeling_xmod import PREFILL_ATTENTION  # noqa: E402
from megatron_xmod.hf.static_decode import SPARSE_ROOM_POLICIES, if_node_provider  # noqa: E402

MODELS = ("dense", "mod", "xmod-a4k8", "xmod-a3k16")


INITS = ("megatron", "hf")


def build_model(name: str, hidden: int, vocab: int, max_positions: int, seed: int = 0, device="cpu",
                family=None, heads=None, init: str = "megatron"):
    """An HF model of ``name`` (a megatron_xmod model name or a layout notation of ``family``) on the
    Table 4 shape (activated depth 28, dense prefix 4) at width ``hidden``, random weights.

    ``init``: ``"megatron"`` draws each layer's output projections (attention's ``o_proj``, the MLPs' and
    experts' ``down_proj``) as megatron-core's ``output_layer_init_method`` does for the models our users
    train: std ``initializer_range / sqrt(2 * layers)``; ``"hf"``: every matrix at ``initializer_range``
    (transformers' convention, :meth:`XModPreTrainedModel._init_weights`). Under ``"hf"`` the 161-298
    layers' unscaled updates swamp the embeddings with a component that each sequence shares (the
    residual norm grows ~30x), so a router bias calibrated to route 1/K routes from none to over 40% of
    one sequence's tokens in a layer and 1/K only on average over sequences (:func:`routed_shares`), where a trained
    router, fitted to each sequence's top L/K (the router BCE), routes about 1/K of every sequence."""
    from megatron_xmod.hf.configuration_xmod import XModHFConfig
    from megatron_xmod.hf.modeling_xmod import XModForCausalLM
    from megatron_xmod.xmod.layout import layout_from_model_name

    if init not in INITS:
        raise ValueError(f"init: {init!r} is not a way of drawing the weights; use one of {', '.join(INITS)}")
    layout = layout_from_model_name(name, activated_depth=28, dense_prefix=4, family=family)
    heads = heads or max(1, hidden // 64)
    config = XModHFConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layout.num_layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_positions,
        routing_family=layout.family, layer_kinds=["sparse" if layer.is_sparse else "dense" for layer in layout.layers],
        layer_sparsity_k=[layer.sparsity_k for layer in layout.layers], layout=layout.notation)
    torch.manual_seed(seed)
    model = XModForCausalLM(config)
    if init == "megatron":
        std = config.initializer_range / math.sqrt(2.0 * config.num_hidden_layers)
        with torch.no_grad():
            for module_name, module in model.named_modules():
                if module_name.endswith((".o_proj", ".down_proj")):
                    module.weight.normal_(0.0, std)
    return model.to(device).eval()


@torch.no_grad()
def calibrate_routers(model, tokens: torch.Tensor) -> list[float]:
    """Set each sparse layer's router bias so that the threshold rule routes 1/K of ``tokens`` there,
    layer by layer (each layer sees the input the calibrated layers before it produce). Returns the
    routed fraction per sparse layer on ``tokens`` afterwards."""
    inner, cfg = model.model, model.config
    x = inner.embed_tokens(tokens)
    b, n = tokens.shape
    positions = torch.arange(n, device=tokens.device).expand(b, n)
    valid = torch.ones(b, n, dtype=torch.bool, device=tokens.device)
    bias, fractions = None, []
    for i, layer in enumerate(inner.layers):
        carried = bias if cfg.carries_bias(i) else None
        if layer.sparse:
            scores = layer.router_logits(x)
            if carried is not None:
                scores = scores - cfg.token_choice_bias_tau * carried
            layer.router.bias -= torch.quantile(scores.flatten(), 1 - 1 / layer.sparsity_k).to(layer.router.bias.dtype)
        x, bias = layer(x, positions, valid, None, carried, "threshold")
        if layer.sparse:
            fractions.append(float(selected_here(bias, carried).float().mean()))
    return fractions


def selected_here(bias: torch.Tensor, carried) -> torch.Tensor:
    """The tokens a sparse layer routed, from the token-choice bias it returned and the one it was handed
    (``carried``, None at the start of a chain): the layer adds its increment (> 0, Eq. 8) to exactly those."""
    return (bias if carried is None else bias - carried) > 0


@contextlib.contextmanager
def routed_shares(model):
    """Yields a list that collects, for the passes run inside the block (run prefills only: no padding),
    the share of each sequence's tokens that each sparse layer routes, in units of 1/K (1.0: a layer
    routes n/K of that sequence's n tokens), one value per (sequence, sparse layer, pass)."""
    shares = []

    def record(layer, args, kwargs, output):
        carried = args[4] if len(args) > 4 else kwargs.get("carried_bias")
        shares.extend((selected_here(output[1], carried).float().mean(1) * layer.sparsity_k).tolist())

    hooks = [layer.register_forward_hook(record, with_kwargs=True) for layer in model.model.layers if layer.sparse]
    try:
        yield shares
    finally:
        for hook in hooks:
            hook.remove()


def deciles(values: list[float]) -> tuple[float, float, float]:
    """(10th, 50th, 90th percentile) of ``values``."""
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return cuts[0], statistics.median(values), cuts[-1]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def prefill(model, prompt, max_cache_len=None, sparse_room="adaptive"):
    """Greedy token after ``prompt`` and the cache; ``max_cache_len``: a fixed-shape cache of that many tokens
    (``sparse_room``: its sparse regions' room, static_decode.py)."""
    from megatron_xmod.hf.cache import XModCache

    cache = XModCache(model.config, max_cache_len=max_cache_len, sparse_room=sparse_room)
    logits = model(prompt, cache=cache, logits_to_keep=1).logits[:, -1]
    return logits.argmax(-1, keepdim=True), cache


@torch.no_grad()
def decode(model, token, cache, steps: int):
    """Greedy steps from ``token`` [b, 1]; returns the generated tokens [b, steps]."""
    out = []
    for _ in range(steps):
        token = model(token, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1)


def time_prefill(model, prompt, device, max_cache_len=None, sparse_room="adaptive"):
    _sync(device)
    start = time.perf_counter()
    token, cache = prefill(model, prompt, max_cache_len, sparse_room)
    _sync(device)
    return time.perf_counter() - start, token, cache


def time_decode(model, token, cache, new_tokens: int, device):
    _sync(device)
    start = time.perf_counter()
    generated = decode(model, token, cache, new_tokens)
    _sync(device)
    return time.perf_counter() - start, generated


def time_fixed_shape_decode(model, token, cache, new_tokens: int, device):
    """A fixed-shape decode: the first two steps apart (the first builds the buffers, the second captures the
    CUDA graph where one is captured), then the rest timed. Returns (first two steps' seconds, the rest's
    seconds, generated tokens)."""
    _sync(device)
    start = time.perf_counter()
    first = decode(model, token, cache, 2)
    _sync(device)
    middle = time.perf_counter()
    rest = decode(model, first[:, -1:], cache, new_tokens - 2)
    _sync(device)
    return middle - start, time.perf_counter() - middle, torch.cat([first, rest], dim=1)


class BytesRead(TorchDispatchMode):
    """The bytes a decode step cannot avoid reading: the weights its matmuls multiply by (``mm``'s second
    operand, ``addmm``'s third) and the keys and values its attention calls read. At decode batch sizes
    that is nearly all a step reads (the activations are a few rows), so a model's bytes against Dense's
    bound its decode speed-up on a machine whose decode is bound by memory, as a CPU's and a GPU's are."""

    def __init__(self):
        super().__init__()
        self.weights = self.keys_values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # With autograd on (no_grad included) linear and attention reach a dispatch mode decomposed (mm,
        # addmm, the attention kernel's op); under inference_mode whole (linear, scaled_dot_product_attention)
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm", "linear"):
            weight = args[2] if name == "addmm" else args[1]
            self.weights += weight.numel() * weight.element_size()
        elif name.startswith(("_scaled_dot_product", "scaled_dot_product")):
            self.keys_values += sum(t.numel() * t.element_size() for t in args[1:3])
        return func(*args, **(kwargs or {}))


def decode_counts(model, token, cache, steps: int) -> tuple[float, float, float]:
    """(host syncs, MiB of weights read, MiB of keys and values read: :class:`BytesRead`) per decode step of
    ``steps`` greedy steps from ``token``.

    ``python bench/generate.py --bytes-only`` prints the MiB apart (weights, keys and values) for synthetic
    caches, without timing anything."""
    from sync_counter import SyncCounter

    with SyncCounter() as counter, BytesRead() as read:
        decode(model, token, cache, steps)
    if not (read.weights and read.keys_values):
        raise RuntimeError(f"decode_mib_read_per_step: the decode read {read.weights} bytes of weights and "
                           f"{read.keys_values} of keys and values, a count that missed its ops; see BytesRead")
    return counter.count / steps, read.weights / steps / 2**20, read.keys_values / steps / 2**20


def print_bytes(models, hidden, batches, contexts, device, init="megatron") -> None:
    """The MiB a decode step reads, weights and keys / values apart, from :func:`synthetic_cache` (one step)."""
    built = build_models(models, hidden, max(contexts) + 8, 512, device, init=init)
    print(f"# MiB a decode step reads ({machine_name(device)}, commit {git_commit()}, hidden {hidden}, fp32, "
          f"synthetic caches)\n| batch | context | model | weights | keys and values | total | Dense's / this |")
    for batch in batches:
        for context in contexts:
            token = torch.randint(0, built[models[0]][0].config.vocab_size, (batch, 1),
                                  generator=torch.Generator().manual_seed(3)).to(device)
            dense_total = None
            for name, (model, _) in built.items():
                cache = synthetic_cache(model, batch, context)
                decode(model, token, cache, 1)
                _, weights, keys_values = decode_counts(model, token, cache, 1)
                total = weights + keys_values
                dense_total = total if name == "dense" else dense_total
                bound = f"{dense_total / total:.2f}" if dense_total else "-"
                print(f"| {batch} | {context} | {name} | {weights:.0f} | {keys_values:.0f} | {total:.0f} | {bound} |",
                      flush=True)
                del cache


def decode_counts_after_prefill(model, prompt, steps: int, max_cache_len=None,
                                sparse_room="adaptive") -> tuple[float, float, float]:
    """:func:`decode_counts` of a decode from ``prompt``; with ``max_cache_len`` (fixed-shape decode) after its
    first two steps."""
    token, cache = prefill(model, prompt, max_cache_len, sparse_room)
    if max_cache_len is not None:
        token = decode(model, token, cache, 2)[:, -1:]
    return decode_counts(model, token, cache, steps)


def build_models(models, hidden, max_positions, calibration_length, device, log=print, vocab=50304, init="megatron"):
    """{name: (model, routed fraction per sparse layer after calibration)}; ``init``: :func:`build_model`'s."""
    built = {}
    for name in models:
        model = build_model(name, hidden, vocab, max_positions, device=device, init=init)
        calibration = torch.randint(0, vocab, (2, calibration_length), generator=torch.Generator().manual_seed(1)).to(device)
        fractions = calibrate_routers(model, calibration)
        built[name] = (model, fractions)
        log(f"[generate] built {name}: {model.config.num_hidden_layers} layers"
            + (f", routed fraction after calibration {statistics.mean(fractions):.3f}" if fractions else ""))
    return built


def measure(built, prompt_lengths, batches, new_tokens, repeats, device, log=print, after_each=None,
            per_layer_decode=False, fixed_shape=False, sparse_room="adaptive"):
    """Rows of every (batch, prompt, model); ``after_each(rows)`` after each (batch, prompt), so that a run
    cut off keeps what finished. ``fixed_shape``: each model also decodes from its own prefill into a
    fixed-shape cache (``XModCache(max_cache_len=..., sparse_room=sparse_room)``, static_decode.py)."""
    models = list(built)
    vocab = built[models[0]][0].config.vocab_size
    rows = []
    for batch in batches:
        for length in prompt_lengths:
            prompt = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(2)).to(device)
            times = {(name, path): ([], []) for name in models for path in ("after", "before", "fixed")}
            capacity = length + new_tokens + 1
            peaks = {}  # GPU: MiB the fixed-shape decode allocated beyond its prefill, at its peak
            outputs = {}
            shares = {}  # name: the routed shares of the warm-up prefill (routed_shares)
            for name in models:  # warm-up, untimed: first calls allocate and pick kernels
                # at the timed size: a first 2048-token prefill of Dense ran at a third of the next ones' speed
                # (the allocator's first requests of its activations' sizes), after a 64-token warm-up too
                with routed_shares(built[name][0]) as shares[name]:
                    token, cache = prefill(built[name][0], prompt)
                decode(built[name][0], token, cache, 2)
                del cache
            for _ in range(repeats):
                for name in models:  # interleaved
                    model = built[name][0]
                    pre, token, prefilled = time_prefill(model, prompt, device)
                    paths = ("after", "before") if name != "dense" and per_layer_decode else ("after",)
                    for path in paths:
                        model.model.decode_skips_unrouted = path == "after"
                        # both paths decode from the same prefill
                        cache = copy.deepcopy(prefilled) if len(paths) > 1 else prefilled
                        dec, generated = time_decode(model, token, cache, new_tokens, device)
                        times[name, path][0].append(pre)
                        times[name, path][1].append(dec)
                        # the bytes, not the cache: at batch 8 four models' caches held ~8 GB, and the memory
                        # pressure slowed the next prefill of Dense (its activations the largest) 3x on this machine
                        outputs[name, path] = (dict(total=cache.nbytes()["total"],
                                                    allocated=cache.nbytes(allocated=True)["total"]), generated)
                        del cache
                    del prefilled
                    model.model.decode_skips_unrouted = True
                    if fixed_shape and not isinstance(outputs.get((name, "fixed")), Exception):
                        try:  # a failed capture (the first GPU run of it) is a result, not the end of the run
                            # a new state every time: the first two steps build its buffers and capture its graph,
                            # where a state kept from the last generation would be refilled (static_decode.py)
                            model.model.static_decode_state = None
                            _, token, cache = time_prefill(model, prompt, device, capacity, sparse_room)
                            if device.type == "cuda":  # what the capture adds (e.g. a cuBLAS workspace a stream)
                                torch.cuda.reset_peak_memory_stats(device)
                                before = torch.cuda.memory_allocated(device)
                            first, dec, generated = time_fixed_shape_decode(model, token, cache, new_tokens, device)
                            if device.type == "cuda":
                                peaks[name] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
                        except Exception as error:  # noqa: BLE001
                            outputs[name, "fixed"] = error
                            log(f"[generate] fixed-shape decode of {name} failed: {error!r}")
                            continue
                        times[name, "fixed"][0].append(first)
                        times[name, "fixed"][1].append(dec)
                        outputs[name, "fixed"] = (cache.nbytes(allocated=True)["total"], generated,
                                                  cache.static.graph is not None,
                                                  (cache.static.room_reads, cache.static.layout_changes,
                                                   cache.static.relayouts))
                        del cache
            for name in models:
                model, fractions = built[name]
                cache_bytes, generated = outputs[name, "after"]
                pre, dec = (statistics.median(t) for t in times[name, "after"])
                row = dict(model=name, layers=model.config.num_hidden_layers, batch=batch, prompt=length,
                           new_tokens=new_tokens, prefill_tok_s=batch * length / pre, decode_tok_s=batch * new_tokens / dec,
                           kv_cache_bytes=cache_bytes["total"], kv_cache_allocated_bytes=cache_bytes["allocated"],
                           routed_fraction=statistics.mean(fractions) if fractions else 1.0)
                syncs, weights, keys_values = decode_counts_after_prefill(model, prompt, min(8, new_tokens))
                row.update(syncs_per_token=syncs, decode_mib_read_per_step=weights + keys_values)
                if fractions:
                    row["routed_share_deciles"] = deciles(shares[name])
                if name != "dense" and per_layer_decode:
                    _, before_cache_generated = outputs[name, "before"]
                    row["same_tokens_as_before"] = bool(torch.equal(before_cache_generated, generated))
                    row["decode_tok_s_before"] = batch * new_tokens / statistics.median(times[name, "before"][1])
                    model.model.decode_skips_unrouted = False
                    row["syncs_per_token_before"] = decode_counts_after_prefill(model, prompt, min(8, new_tokens))[0]
                    model.model.decode_skips_unrouted = True
                if fixed_shape and isinstance(outputs[name, "fixed"], Exception):
                    row["fixed_error"] = repr(outputs[name, "fixed"])[:400]
                elif fixed_shape:
                    allocated, fixed_generated, graphed, (reads, changes, relayouts) = outputs[name, "fixed"]
                    first, dec = (statistics.median(t) for t in times[name, "fixed"])
                    row.update(fixed_decode_tok_s=batch * (new_tokens - 2) / dec, fixed_first_steps_s=first,
                               fixed_kv_cache_allocated_bytes=allocated, fixed_cuda_graph=graphed,
                               fixed_sparse_room=sparse_room, fixed_room_reads=reads, fixed_layout_changes=changes,
                               fixed_relayouts=relayouts,
                               fixed_decode_peak_mib=peaks.get(name),
                               fixed_same_tokens=bool(torch.equal(fixed_generated, generated)),
                               fixed_syncs_per_token=decode_counts_after_prefill(
                                   model, prompt, min(8, new_tokens - 2), capacity, sparse_room)[0])
                rows.append(row)
                log(f"[generate] batch {batch} prompt {length} {name}: prefill {row['prefill_tok_s']:.0f} tok/s, "
                    f"decode {row['decode_tok_s']:.1f} tok/s, {row['syncs_per_token']:.1f} syncs/token")
            compare_with_dense(rows)
            if after_each is not None:
                after_each(rows)
    return rows


@torch.no_grad()
def synthetic_cache(model, batch: int, context: int, seed: int = 0):
    """An ``XModCache`` as after a ``context``-token prompt without running it: every dense layer holds
    ``context`` entries a sequence, every sparse layer ``context / K`` (its expected share under the
    calibrated routers), random keys and values. Decode time depends on how many entries a layer
    attends to, not on what they hold, so this measures decode at contexts whose prefill would take
    this machine an hour."""
    from megatron_xmod.hf.cache import XModCache

    cfg = model.config
    device, dtype = model.device, model.dtype
    cache = XModCache(cfg)
    generator = torch.Generator(device=device).manual_seed(seed)
    for layer_idx, layer in enumerate(cache.layers):
        entries = context if not layer.sparse else max(1, round(context / cfg.layer_sparsity_k[layer_idx]))
        shape = (batch, cfg.num_key_value_heads, entries, cfg.head_dim)
        keys = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        values = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        positions = torch.linspace(0, context - 1, entries, device=device).long().expand(batch, entries)
        layer.update(keys, values, positions=positions)
    cache.advance(context)
    return cache


def measure_long_context(built, contexts, batches, new_tokens, device, log=print, after_each=None):
    """Decode rows from :func:`synthetic_cache` (no prefill) at each context and batch, models interleaved
    once; ``routed_fraction`` here is the sparse layers' entries appended per token and sequence over 1/K."""
    rows = []
    vocab = next(iter(built.values()))[0].config.vocab_size
    for batch in batches:
        for context in contexts:
            token = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(3)).to(device)
            for name, (model, _) in built.items():
                cache = synthetic_cache(model, batch, context)
                before = cache.entries()
                decode(model, token, cache, 2)  # warm-up: first calls at this size allocate
                seconds, _ = time_decode(model, token, cache, new_tokens, device)
                _, weights, keys_values = decode_counts(model, token, cache, 1)
                cfg = model.config
                sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
                routed = [(cache.entries()[i] - before[i]) * cfg.layer_sparsity_k[i] for i in sparse]
                row = dict(model=name, layers=cfg.num_hidden_layers, batch=batch, prompt=context, synthetic_context=True,
                           new_tokens=new_tokens, decode_tok_s=batch * new_tokens / seconds,
                           kv_cache_bytes=cache.nbytes()["total"],
                           kv_cache_allocated_bytes=cache.nbytes(allocated=True)["total"], decode_mib_read_per_step=weights + keys_values,
                           routed_fraction=sum(routed) / (len(sparse) * batch * (new_tokens + 3)) if sparse else 1.0)
                rows.append(row)
                log(f"[generate] batch {batch} context {context} (synthetic) {name}: decode {row['decode_tok_s']:.1f} "
                    f"tok/s, routed {row['routed_fraction']:.2f} of 1/K")
                del cache
            compare_with_dense(rows)
            if after_each is not None:
                after_each(rows)
    return rows


def compare_with_dense(rows) -> None:
    def key(r):
        return r["batch"], r["prompt"], r.get("synthetic_context", False)

    dense = {key(r): r for r in rows if r["model"] == "dense"}
    for r in rows:
        d = dense.get(key(r))
        if d is not None and "prefill_tok_s" in r:
            r["prefill_vs_dense"] = r["prefill_tok_s"] / d["prefill_tok_s"]
        if d is not None:
            r["decode_vs_dense"] = r["decode_tok_s"] / d["decode_tok_s"]
            if "decode_mib_read_per_step" in r and "decode_mib_read_per_step" in d:
                r["bytes_bound_vs_dense"] = d["decode_mib_read_per_step"] / r["decode_mib_read_per_step"]
            if "decode_tok_s_before" in r:
                r["decode_before_vs_dense"] = r["decode_tok_s_before"] / d["decode_tok_s"]
            if "fixed_decode_tok_s" in r and "fixed_decode_tok_s" in d:
                r["fixed_vs_dense_fixed"] = r["fixed_decode_tok_s"] / d["fixed_decode_tok_s"]
                r["fixed_vs_default"] = r["fixed_decode_tok_s"] / r["decode_tok_s"]


def render_markdown(meta, rows) -> str:
    out = [f"# Generation speed ({meta['date']})", "",
           f"- machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; {meta['dtype']}; "
           f"the fixed-shape decode's CUDA-graph IF nodes from: {meta.get('if_nodes', '-')}",
           f"- hidden {meta['hidden']}, greedy, {meta['new_tokens']} new tokens, median of {meta['repeats']} interleaved "
           f"runs; routers calibrated to route 1/K (see the script's docstring); weights drawn as "
           + ("megatron-core does (output projections at std / sqrt(2 layers))" if meta.get("init", "hf") == "megatron"
              else "transformers does (every matrix at the same std)"),
           f"- load average before/after (1/5/15 min): {meta['loadavg_start']} / {meta['loadavg']}",
           "- malloc: " + ("freed memory kept by the process (mallopt; throughput.keep_freed_memory)"
                           if meta.get("steady_malloc") else "the C library's defaults"), "",
           "| batch | prompt | model | layers | prefill tok/s | vs Dense | decode tok/s | vs Dense | decode before | "
           "before vs Dense | syncs/token (before) | KV cache KiB (allocated) | MiB read a decode step | "
           "Dense's / this (decode's bytes bound vs Dense) | prefill: share of a sequence a sparse layer routes, "
           "x 1/K, p10 / p50 / p90 |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        before = (f"{r['decode_tok_s_before']:.1f} | {r['decode_before_vs_dense']:.2f}" if "decode_tok_s_before" in r
                  else "- | -")
        syncs = (f"{r['syncs_per_token']:.1f}" if "syncs_per_token" in r else "-") + (f" ({r['syncs_per_token_before']:.1f})" if "syncs_per_token_before" in r
                                                 else "")
        prefill = (f"{r['prefill_tok_s']:.0f} | {r.get('prefill_vs_dense', 1):.2f}" if "prefill_tok_s" in r
                   else "- (synthetic context) | -")
        out.append(f"| {r['batch']} | {r['prompt']} | {r['model']} | {r['layers']} | {prefill} | "
                   f"{r['decode_tok_s']:.1f} | {r.get('decode_vs_dense', 1):.2f} | "
                   f"{before} | {syncs} | {r['kv_cache_bytes'] / 1024:.0f} "
                   f"({r.get('kv_cache_allocated_bytes', r['kv_cache_bytes']) / 1024:.0f}) | "
                   + (f"{r['decode_mib_read_per_step']:.0f} | {r.get('bytes_bound_vs_dense', 1):.2f} |"
                      if "decode_mib_read_per_step" in r else "- | - |")
                   + (" {:.2f} / {:.2f} / {:.2f} |".format(*r["routed_share_deciles"]) if "routed_share_deciles" in r
                      else " - |"))
    fixed = [r for r in rows if "fixed_decode_tok_s" in r or "fixed_error" in r]
    if fixed:
        out += ["", "Fixed-shape decode (`XModCache(max_cache_len=prompt + new tokens + 1)`, static_decode.py; "
                "timed after its first two steps, which build the buffers and, on a GPU, capture the CUDA graph):", "",
                "| batch | prompt | model | decode tok/s | vs default path | vs Dense (fixed) | first two steps s | "
                "syncs/token | CUDA graph | same tokens | sparse room: counts read / reads that laid out again "
                "(graphed: captures) / layers laid out again | "
                "KV cache KiB allocated | decode's peak MiB beyond the prefill |",
                "|---:|---:|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|"]
        for r in fixed:
            if "fixed_error" in r:
                out.append(f"| {r['batch']} | {r['prompt']} | {r['model']} | failed: {r['fixed_error']} |")
                continue
            out.append(f"| {r['batch']} | {r['prompt']} | {r['model']} | {r['fixed_decode_tok_s']:.1f} | "
                       f"{r.get('fixed_vs_default', 1):.2f} | {r.get('fixed_vs_dense_fixed', 1):.2f} | "
                       f"{r['fixed_first_steps_s']:.2f} | {r['fixed_syncs_per_token']:.1f} | "
                       f"{'yes' if r['fixed_cuda_graph'] else 'no (eager)'} | "
                       f"{'yes' if r['fixed_same_tokens'] else 'NO'} | "
                       f"{r.get('fixed_sparse_room', 'full')}: {r.get('fixed_room_reads', 0)} / "
                       f"{r.get('fixed_layout_changes', 0)} / {r.get('fixed_relayouts', 0)} | "
                       f"{r['fixed_kv_cache_allocated_bytes'] / 1024:.0f} | "
                       + ("-" if r.get("fixed_decode_peak_mib") is None else f"{r['fixed_decode_peak_mib']:.0f}") + " |")
    return "\n".join(out) + "\n"


def plot(rows, path) -> bool:
    """Draw decode tokens/s against the prompt length to ``path``; False where matplotlib is not installed
    (the GPU machine: ``--plot RESULTS.json`` draws it later from the results)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for k, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
            for synthetic in (False, True):
                pts = sorted((r["prompt"], r["decode_tok_s"]) for r in rows if r["model"] == name and r["batch"] == batch
                             and r.get("synthetic_context", False) == synthetic)
                if pts:
                    ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", color=f"C{k}",
                            linestyle="--" if synthetic else "-", label=name + (" (synthetic context)" if synthetic else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--prompts", type=int, nargs="*", default=[256, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="hidden 64, prompt 32, batch 1 and 2, 8 new tokens, 1 repeat")
    p.add_argument("--per-layer-decode", action="store_true",
                   help="also decode with every sparse layer's own routing at every step (the path before the run-ahead)")
    p.add_argument("--fixed-shape", action="store_true",
                   help="also decode with the fixed-shape cache (XModCache(max_cache_len=...); a CUDA graph on a GPU)")
    p.add_argument("--sparse-room", choices=SPARSE_ROOM_POLICIES, default="adaptive",
                   help="with --fixed-shape: the room of the sparse layers' regions (static_decode.py)")
    p.add_argument("--prefill-attention", choices=PREFILL_ATTENTION, default="auto",
                   help="how a sparse layer's threshold-routed tokens of a batch attend (XModModel.prefill_attention)")
    p.add_argument("--long-contexts", type=int, nargs="*", default=[],
                   help="also decode from a synthetic cache of this many tokens (no prefill; see synthetic_cache)")
    p.add_argument("--bytes-only", action="store_true",
                   help="print the MiB a decode step reads (weights, keys and values apart) from synthetic caches of "
                        "--long-contexts tokens at --batches, and exit (no timing)")
    p.add_argument("--plot", metavar="RESULTS_JSON",
                   help="draw the PNG of a results file (one written where matplotlib was missing) next to it, and exit")
    p.add_argument("--init", choices=INITS, default="megatron",
                   help="how the random weights are drawn (build_model): megatron-core's scaled output projections, "
                        "or transformers' one std for every matrix (the models of the results before session 28, bench/README.md)")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    if args.plot:
        results = Path(args.plot)
        if not plot(json.loads(results.read_text())["rows"], results.with_suffix(".png")):
            p.error("--plot: matplotlib is not installed")
        print(results.with_suffix(".png"))
        return None
    if args.quick:
        args.hidden, args.prompts, args.batches, args.new_tokens, args.repeats = 64, [32], [1, 2], 8, 1
    device = torch.device(args.device)
    if args.bytes_only:
        print_bytes(args.models, args.hidden, args.batches, args.long_contexts or [2048], device, args.init)
        return
    steady_malloc = device.type == "cpu" and keep_freed_memory()
    loadavg_start = loadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"generate_{device.type}_{datetime.date.today().strftime('%Y%m%d')}" + ("_quick" if args.quick else "") + args.tag

    unplotted = []  # the results whose PNG could not be drawn (matplotlib missing): said once

    def write(rows):
        meta = dict(date=datetime.date.today().isoformat(), machine=machine_name(device), commit=git_commit(),
                    torch=torch.__version__, dtype="fp32", hidden=args.hidden, new_tokens=args.new_tokens,
                    repeats=args.repeats, loadavg_start=loadavg_start, loadavg=loadavg(), steady_malloc=steady_malloc,
                    prefill_attention=args.prefill_attention, if_nodes=if_node_provider(), init=args.init)
        (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (out / f"{stem}.md").write_text(render_markdown(meta, rows))
        if not plot(rows, out / f"{stem}.png") and not unplotted:
            unplotted.append(stem)
            print(f"[generate] no PNG: matplotlib is not installed; draw it elsewhere with "
                  f"python bench/generate.py --plot {stem}.json", flush=True)
        return meta

    longest = max(args.prompts + args.long_contexts) + args.new_tokens + 8
    built = build_models(args.models, args.hidden, longest, min(512, max(args.prompts, default=512)), device,
                         init=args.init)
    for model, _ in built.values():
        model.model.prefill_attention = args.prefill_attention
    rows = measure(built, args.prompts, args.batches, args.new_tokens, args.repeats, device, after_each=write,
                   per_layer_decode=args.per_layer_decode, fixed_shape=args.fixed_shape, sparse_room=args.sparse_room)
    if args.long_contexts:
        rows += measure_long_context(built, args.long_contexts, args.batches, args.new_tokens, device,
                                     after_each=lambda long_rows: write(rows + long_rows))
    print(render_markdown(write(rows), rows))
    return rows


if __name__ == "__main__":
    main()
