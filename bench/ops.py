"""Framework ops of one routed layer vs one dense layer, forward and backward (issue 15, point 2).

Hundreds of thin routed layers are launch-bound when each one issues many small ops: this counts
them. One model ``D + S8*2 + D`` (X-MoD) and one ``D + (S8 + D)`` (MoD) are built through
megatron_xmod's builders; the profiled layers are the dense layer, the X-MoD sparse layer that
receives the carried token-choice bias (the common case: 24-32 consecutive sparse layers a
block), and the MoD sparse layer. Each is run once unprofiled (warm-up), then forward and backward
are profiled separately.

- CPU: ``torch.profiler`` op events. An op counts if no enclosing event is an op itself (what the
  Python code and the autograd engine dispatch); each ``triton::*`` region counts as one launch.
  ``ops`` counts every op, ``kernels`` leaves out the ops that launch no kernel on a GPU (views,
  ``empty``: VIEW_OPS; ``to``/``reshape`` that copy nothing: COPY_IF_NEEDED); the permutation
  ops' CPU-only index checks are switched off (XMOD_PERMUTE_CHECK=0). Under ``TRITON_INTERPRET=1``
  the fused path runs the real Triton kernels through the interpreter, so its counts are the
  launches a GPU makes.
- GPU (``--device cuda``): CUDA kernel events per layer call, what the device really launched.

    python bench/ops.py                       # both paths on CPU, writes bench/results/ops_cpu_<date>.*
    python bench/ops.py --paths torch         # only the torch path (no Triton needed)

Paths: ``torch`` (routing step and permutation in plain torch), ``fused`` (the Triton routing step
of megatron_xmod.xmod.kernels and the Triton permutation kernels).
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VIEW_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::squeeze", "aten::unsqueeze", "aten::expand",
    "aten::permute", "aten::transpose", "aten::t", "aten::slice", "aten::select", "aten::as_strided",
    "aten::alias", "aten::detach", "aten::detach_", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::lift_fresh", "aten::split", "aten::chunk", "aten::unbind", "aten::narrow", "aten::flatten",
    "aten::contiguous", "aten::numpy_T", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
    "aten::is_nonzero", "aten::_reshape_alias", "aten::view_as", "aten::expand_as", "aten::unflatten",
    "aten::_has_compatible_shallow_copy_type",  # metadata check of `t.data = ...` (make_viewless_tensor)
}
PATHS = ("torch", "fused")
# Frames that only pass ops through (the CPU patches' device mode, the kernels' launchers).
ORIGIN_SKIP = ("cpu_shim.py", "training/patches.py", "/kernels/triton", "/permute/triton", "/permute/dispatch.py")
LAYERS = ("dense", "xmod_sparse", "mod_sparse")


# Ops that launch a kernel only when they copy (dtype change, non-contiguous input).
COPY_IF_NEEDED = {"aten::to", "aten::type_as", "aten::contiguous", "aten::reshape", "aten::float"}


def _copies(ev) -> bool:
    return any(child.name in ("aten::copy_", "aten::_to_copy", "aten::clone") or _copies(child)
               for child in ev.cpu_children)


def _launches(ev) -> bool:
    """Whether a top-level op launches work on a GPU."""
    if ev.name in COPY_IF_NEEDED:
        return _copies(ev)
    return ev.name not in VIEW_OPS


def _top_level(events):
    """Op events whose ancestors are no op (aten::*) and no launch region (triton::*)."""
    kept = []
    for ev in events:
        name = ev.name
        if not (name.startswith("aten::") or name.startswith("triton::")):
            continue
        parent, nested = ev.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name.startswith("triton::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            kept.append(ev)
    return kept


def _origin(ev) -> str:
    """Innermost megatron_xmod (else megatron) Python frame above an op (the profiler records
    frames as parent events): where the op comes from."""
    frames, parent = [], ev.cpu_parent
    while parent is not None:
        if "(" in parent.name and ".py(" in parent.name:
            frames.append(parent.name)
        parent = parent.cpu_parent
    for marker, prefix in (("megatron_xmod/", ""), ("megatron/core/", "megatron/")):
        for frame in frames:
            if marker in frame and not any(skip in frame for skip in ORIGIN_SKIP):
                path, func = frame.split(marker, 1)[1].split("(", 1)[0], frame.rsplit(": ", 1)[-1]
                return f"{prefix}{path}:{func}"
    return "autograd engine" if not frames else "other"


def profile_layer(layer, hidden, rope, device, before=None, with_stack=True):
    """(forward record, backward record) of one call of ``layer``. ``with_stack`` records the
    Python frames (for ``by_origin``); off for the interpreted Triton path, whose interpreter
    frames would swamp the profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    grad = torch.randn_like(hidden)
    records = []
    for phase in ("forward", "backward"):
        if before is not None:
            before()
        x = hidden.detach().clone().requires_grad_(True)
        if phase == "forward":
            with profile(activities=activities, with_stack=with_stack) as prof:
                out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        else:
            out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
            with profile(activities=activities, with_stack=with_stack) as prof:
                out.backward(grad)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        top = _top_level(prof.events())
        launching = [ev for ev in top if _launches(ev)]
        origins = collections.Counter(_origin(ev) for ev in launching) if with_stack else collections.Counter()
        record = dict(phase=phase, ops=len(top), kernels=len(launching),
                      by_name=dict(collections.Counter(ev.name for ev in launching).most_common()),
                      by_origin=dict(origins.most_common()))
        if device.type == "cuda":
            record["cuda_kernels"] = sum(1 for ev in prof.events() if ev.device_type.name == "CUDA")
        records.append(record)
    return records


def _set_path(path):
    import torch

    from megatron_xmod.xmod import kernels, permute

    # The permutation ops validate index values on CPU tensors only (a host sync on GPU): off here,
    # so that the CPU counts are the ops a GPU run issues.
    os.environ[permute.dispatch.ENV_CHECK] = "0"
    os.environ[kernels.ENV_BACKEND] = "triton" if path == "fused" else "torch"
    # fused: the permutation backend a GPU run picks (CUDA extension, else Triton); Triton on CPU.
    permute.set_backend("torch" if path == "torch" else None if torch.cuda.is_available() else "triton")


def build_layers(device, seq_len, batch, hidden_size=128, head_dim=32, ffn_hidden_size=256):
    """One dense, one X-MoD sparse and one MoD sparse layer (from ``D + S8*2 + D`` X-MoD and
    ``D + (S8 + D)`` MoD models, GQA 2:1): ({name: (layer, before)}, rope, hidden, models), where
    ``before`` runs the X-MoD layer's predecessor so that the timed layer takes a carried bias."""
    import torch

    from megatron_xmod.model import build_gpt_model, config_from_backbone
    from megatron_xmod.presets import Backbone

    heads = hidden_size // head_dim
    backbone = Backbone("ops", hidden_size=hidden_size, head_dim=head_dim, num_attention_heads=heads,
                        num_query_groups=max(1, heads // 2), ffn_hidden_size=ffn_hidden_size, num_layers=4,
                        vocab_size=256, rotary_base=10000)
    models = {}
    for family, layout in (("xmod", "D + S8*2 + D"), ("mod", "D + (S8 + D)")):
        config = config_from_backbone(backbone, layout, use_cpu_initialization=device.type == "cpu",
                                      xmod_routing_family=family)
        models[family] = build_gpt_model(config, backbone.vocab_size, seq_len, rotary_base=backbone.rotary_base).to(device)
    xmod_layers = models["xmod"].decoder.layers
    rope = models["xmod"].rotary_pos_emb(seq_len)
    hidden = torch.randn(seq_len, batch, backbone.hidden_size, device=device)

    def carry_from_first_sparse():  # the measured X-MoD layer takes the bias of the layer before it
        xmod_layers[1](hidden, attention_mask=None, rotary_pos_emb=rope)

    targets = {"dense": (xmod_layers[0], None), "xmod_sparse": (xmod_layers[2], carry_from_first_sparse),
               "mod_sparse": (models["mod"].decoder.layers[1], None)}
    return targets, rope, hidden, models


def measure(paths, device_name="cpu", seq_len=64, batch=2):
    import torch

    device = torch.device(device_name)
    targets, rope, hidden, _ = build_layers(device, seq_len, batch)
    results = []
    for path in paths:
        _set_path(path)
        for name, (layer, before) in targets.items():
            layer.train()
            for _ in range(2):  # warm-up (Triton compiles, megatron allocates its buffers)
                if before:
                    before()
                out, _ = layer(hidden.clone().requires_grad_(True), attention_mask=None, rotary_pos_emb=rope)
                out.sum().backward()
            interpreted = device.type == "cpu" and path == "fused"
            for rec in profile_layer(layer, hidden, rope, device, before, with_stack=not interpreted):
                results.append(dict(path=path, layer=name, **rec))
    _set_path("torch")
    for name in ("XMOD_ROUTING_BACKEND", "XMOD_PERMUTE_CHECK"):
        os.environ.pop(name, None)
    return results


def render_markdown(meta, rows):
    out = [f"# Framework ops per layer call ({meta['device']})", "", f"- date: {meta['date']}",
           f"- commit: {meta['commit']}", f"- torch {meta['torch']}, triton {meta['triton']}",
           f"- sizes: L={meta['seq_len']}, b={meta['batch']}, h=128 (op counts do not depend on size)",
           "- ops: top-level framework ops (torch.profiler); kernels: those that launch work on a GPU "
           "(views/reshapes/empty left out); each triton:: region is one launch", ""]
    if meta.get("interpreted"):
        out += ["The fused path ran under TRITON_INTERPRET=1: the same Triton launches a GPU makes, run by "
                "the interpreter.", ""]
    out += ["| path | layer | phase | ops | kernels | kernels vs dense |", "|---|---|---|---:|---:|---:|"]
    dense = {(r["path"], r["phase"]): r["kernels"] for r in rows if r["layer"] == "dense"}
    for r in rows:
        ratio = r["kernels"] / dense[(r["path"], r["phase"])]
        out.append(f"| {r['path']} | {r['layer']} | {r['phase']} | {r['ops']} | {r['kernels']} | {ratio:.2f}x |")
    out += ["", "## Where the X-MoD sparse layer's kernels come from", ""]
    for r in rows:
        if r["layer"] == "xmod_sparse" and r["by_origin"]:
            origins = ", ".join(f"{k} {v}" for k, v in r["by_origin"].items())
            out.append(f"- {r['path']} {r['phase']}: {origins}")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default=None, help="result name: ops_<tag>.json/.md (default <device>_<date>)")
    a = p.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        p.error(f"--device: {device!r} is not cpu or cuda")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if "fused" in a.paths and device == "cpu" and not interpreted:
        p.error("--paths fused: on CPU the Triton kernels need TRITON_INTERPRET=1 set before the run; "
                "set it or pass --paths torch")
    from bench.throughput import run_meta, single_rank_megatron

    with single_rank_megatron():
        rows = measure(a.paths, device, a.seq_len, a.batch)
    meta = run_meta(device, dict(seq_len=a.seq_len, batch=a.batch, interpreted=interpreted and device == "cpu"))
    tag = a.tag or f"{device}_{dt.datetime.now(dt.UTC).strftime('%Y%m%d')}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"ops_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    text = render_markdown(meta, rows)
    with open(os.path.join(a.out, f"ops_{tag}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
