"""The entry point's flags: the ``--xmod-*`` group and the expansion of presets into megatron's own flags.

``--xmod-backbone`` expands a backbone into megatron's architecture flags and ``--xmod-model`` a
model name into an explicit layout (placed before the user's flags, so explicit flags still win);
``--moe-preset`` expands into megatron's MoE flags (:mod:`megatron_xmod.moe.args`). The command
line is read by one function, :func:`scan_argv`, before megatron parses it: as given, then once more with
the backbone's flags in front (what the MoE and pipeline expansions read).
"""
from __future__ import annotations

import argparse

from megatron_xmod.presets import BACKBONES, backbone_flags, resolve_backbone, split_model_name
from megatron_xmod.xmod.layout import (
    ROUTING_FAMILIES,
    LayoutError,
    ablation_settings,
    layout_from_model_name,
    resolve_layout,
)

MUON_TABLE5 = [  # the X-MoD paper, Table 5 (peak LR 3.2e-3; AdamW settings for the non-matrix parameters)
    "--optimizer", "muon", "--lr", "3.2e-3", "--muon-momentum", "0.95", "--muon-num-ns-steps", "5",
    "--muon-nesterov", "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--weight-decay", "0.1",
]
PAPER_SCHEDULE = ["--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.01"]  # cosine to 10% of peak
# megatron on a CPU (gloo, no fused kernels, local attention, weights initialised on the CPU): --xmod-cpu.
CPU_FLAGS = ["--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
             "--no-persist-layer-norm", "--no-create-attention-mask-in-dataloader", "--use-cpu-initialization",
             "--no-rope-fusion"]
# megatron's compiled fusions (torch.compile, i.e. Inductor's C++ code generation on CPU), off with --xmod-cpu
# unless --xmod-cpu-fusions: at CPU sizes they buy nothing, they make the numbers depend on the code
# generator and the CPU's vector width, and a PyTorch 2.13 Inductor cache written on a CPU of another
# vector width hands back wrong kernels (docs/reliability.md); off, a CLI run builds what the tests build.
CPU_COMPILED_FUSIONS = ["--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion"]
# Flags that describe the layout: after expansion only the explicit family and layout remain.
_LAYOUT_FLAGS = {"--xmod-model", "--xmod-routing-family", "--xmod-layout", "--xmod-anchor-stride",
                 "--xmod-dense-prefix", "--xmod-activated-depth"}




def add_xmod_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--xmod-*`` group; each dest is an :class:`~megatron_xmod.xmod.config.XModConfig` field name,
    so megatron's ``core_transformer_config_from_args`` maps them onto the config unchanged."""
    group = parser.add_argument_group("X-MoD", "sparse-depth routing (megatron_xmod)")
    group.add_argument("--xmod-backbone", default=None, metavar="PRESET_OR_JSON",
                       help=f"a Table 4 preset ({', '.join(BACKBONES)}) or a backbone JSON file (fields of "
                            "`xmod count --help`): expands to megatron's architecture flags; its num_layers is "
                            "the activated depth named models are derived for")
    group.add_argument("--xmod-model", default=None,
                       help="named model: dense, mod, mod-k<K>, xmod-a<A>k<K> (xmod-a4k8, xmod-a3k16), a layout, "
                            "an MoE name (same as --moe-preset), or <depth>+<moe> (xmod-a4k8+moe-8x64: the layout "
                            "with that MoE feed-forward in every layer)")
    group.add_argument("--xmod-routing-family", dest="xmod_routing_family", default="dense", choices=ROUTING_FAMILIES,
                       help="dense, mod (Eq.6: x + a + r f) or xmod (Eq.7: x + s r (a + f)) for every sparse layer")
    group.add_argument("--xmod-sparsity-k", dest="xmod_sparsity_k", type=int, default=None,
                       help="K: a sparse layer processes 1/K of the tokens (with --xmod-routing-family)")
    group.add_argument("--xmod-anchor-stride", dest="xmod_anchor_stride", type=float, default=None,
                       help="A: a sparse block is A*K sparse layers and one dense anchor (X-MoD)")
    group.add_argument("--xmod-dense-prefix", dest="xmod_dense_prefix", type=int, default=None,
                       help="N0: dense layers before the first sparse block of a derived layout (default: 4 for "
                            "X-MoD and named models; for MoD what fills the activated depth)")
    group.add_argument("--xmod-layout", dest="xmod_layout", default=None,
                       help="an explicit layout, e.g. 'D*4 + (S8*8 + D)*4' (D dense, S<K> sparse)")
    group.add_argument("--xmod-activated-depth", dest="xmod_activated_depth", type=int, default=None,
                       help="layers a token passes through on average (a sparse layer counts 1/K); derives the "
                            "layout of --xmod-model / --xmod-sparsity-k (default: the backbone's num_layers, else 28)"
                           )
    group.add_argument("--xmod-token-choice-bias-tau", dest="xmod_token_choice_bias_tau", type=float, default=0.5,
                       help="tau of the token-choice bias (Eq.8); 0 switches it off")
    group.add_argument("--xmod-token-choice-bias-tau-warmup", dest="xmod_token_choice_bias_tau_warmup", type=int,
                       default=0, help="iterations over which tau ramps linearly from 0 (docs/routing.md)")
    group.add_argument("--xmod-token-choice-bias-increment", dest="xmod_token_choice_bias_increment", type=float,
                       default=1.0, help="added to b for each sparse layer that routed the token (Eq.8)")
    group.add_argument("--xmod-router-bce-coeff", dest="xmod_router_bce_coeff", type=float, default=1e-4,
                       help="weight of the router BCE loss that teaches threshold routing")
    group.add_argument("--xmod-gate-scale-init", dest="xmod_gate_scale_init", type=float, default=1.0,
                       help="initial X-MoD gate scale (varsigma of Eq.7)")
    group.add_argument("--xmod-fixed-gate-scale", dest="xmod_gate_scale_learnable", action="store_false",
                       help="keep varsigma at --xmod-gate-scale-init, not learned (ablation 'w/o gated residual "
                            "scaling'; default: off, varsigma is learned)")
    group.add_argument("--xmod-routing-segments", dest="xmod_routing_segments", type=int, default=1,
                       help="S: training top-k routes L/(S K) tokens of each of S equal segments of a sequence "
                            "(default 1: L/K of the whole sequence). With --context-parallel-size C, a multiple of 2C "
                            "gives every CP rank exactly L/(K C) routed tokens: 1/K of a dense layer's CP traffic "
                            "(docs/routing.md, 'Routing segments')")
    group.add_argument("--xmod-eval-routing", dest="xmod_eval_routing", default="threshold", choices=("threshold", "topk"),
                       help="routing rule at validation: threshold (deployable, sigmoid > 0.5) or top-k")
    group.add_argument("--xmod-eval-capacity-factor", dest="xmod_eval_capacity_factor", type=float, default=0.0,
                       help="F > 0: threshold-rule validation at static shapes, one host read per forward pass instead of "
                            "one per sparse layer: each sparse layer batches max(F x L/K, 1.25 x its widest selection last "
                            "time) tokens a sequence, and a pass that overflowed runs again at exact widths; results equal "
                            "exact widths up to the rounding of the padded shapes (~1e-5 of the loss). Default 0: exact "
                            "widths, one host read per sparse layer (parallel layouts agree to 1e-5)")
    group.add_argument("--xmod-compile-layers", dest="xmod_compile_layers", action="store_true",
                       help="run each dense layer and each routed layer's update (gather, attention and MLP, gated "
                            "scatter) as one torch.compile region (static shapes), forward and backward: fewer, fused "
                            "kernels and less Python per layer, paid for by a few compilations at start-up "
                            "(bench/README.md, 'Compiled layers'). TP 1, CP 1, no MoE, no recompute, no CUDA graphs")
    group.add_argument("--xmod-muon-table5", action="store_true", help="the paper's Muon settings (Table 5)")
    group.add_argument("--xmod-paper-schedule", action="store_true", help="1%% warmup, cosine to 10%% of peak")
    group.add_argument("--xmod-no-topk-validation", action="store_true",
                       help="skip the top-k routing comparison loss during validation")
    group.add_argument("--xmod-validation-continues", action="store_true",
                       help="each validation scores the next --eval-iters batches, as megatron's evaluate() does "
                            "(default: off, every validation scores the same first batches, so a curve shows "
                            "progress rather than batch difficulty)")
    group.add_argument("--xmod-pipeline-balance", default="default", choices=("default", "auto"),
                       help="auto: with --pipeline-model-parallel-size > 1 and no split of your own, the cost-balanced "
                            "--pipeline-model-parallel-layout of `xmod partition`; default: megatron's own split"
                           )
    group.add_argument("--xmod-cpu", action="store_true",
                       help="megatron on a CPU: " + " ".join(CPU_FLAGS + CPU_COMPILED_FUSIONS))
    group.add_argument("--xmod-cpu-fusions", action="store_true",
                       help="with --xmod-cpu, keep megatron's torch.compile fusions (bias-dropout-add, bias-SwiGLU/GeLU); "
                            "default: off on CPU")
    group.add_argument("--xmod-allow-model-change", dest="xmod_allow_model_change", action="append", default=None,
                       metavar="FIELD[,FIELD]",
                       help="with --load: resume although the checkpoint's run identity differs in FIELD (e.g. "
                            "tokenizer_sha256, xmod_router_bce_coeff; repeatable or comma-separated; the fields: "
                            "megatron_xmod/training/run_identity.py, docs/first_run.md)")
    group.add_argument("--xmod-megatron-args", default="auto", choices=("auto", "console", "file"),
                       help="megatron's argument dump: console, or file (megatron_arguments.txt in --save, else "
                            "--tensorboard-dir); auto = console with a GPU, file on CPU")
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """All of the plugin's flag groups (megatron's ``extra_args_provider``)."""
    from megatron_xmod.moe.args import add_moe_arguments

    return add_moe_arguments(add_xmod_arguments(parser))


# megatron's flags that the expansion reads (the last occurrence wins, as in megatron's own parser).
_SCANNED_INT_FLAGS = ("--num-layers", "--ffn-hidden-size", "--hidden-size", "--num-attention-heads",
                      "--num-query-groups", "--kv-channels", "--vocab-size", "--seq-length", "--micro-batch-size",
                      "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
                      "--num-layers-per-virtual-pipeline-stage")
_SCANNED_TEXT_FLAGS = ("--lr", "--min-lr")
# A split of the user's own, which --xmod-pipeline-balance auto leaves alone.
_USER_PIPELINE_SPLIT = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                        "--decoder-last-pipeline-num-layers", "--hybrid-layer-pattern")
_VIRTUAL_STAGE_FLAGS = {"--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"}


def scan_argv(argv: list[str]) -> argparse.Namespace:
    """The one reading of a raw command line before megatron parses it: the plugin's flags and the
    megatron flags the expansion reads; everything else is ignored."""
    parser = add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    for flag in _SCANNED_INT_FLAGS:
        parser.add_argument(flag, type=int, default=None)
    for flag in _SCANNED_TEXT_FLAGS + _USER_PIPELINE_SPLIT:
        parser.add_argument(flag, default=None)
    return parser.parse_known_args(argv)[0]


def expand_arguments(argv: list[str]) -> list[str]:
    """Turn ``--xmod-backbone``/``--xmod-model``, the paper presets and ``--moe-preset`` into plain
    megatron flags. Layout errors surface here, before megatron starts anything."""
    pre = scan_argv(argv)
    head: list[str] = []
    activated = pre.xmod_activated_depth
    if pre.xmod_backbone:
        b = resolve_backbone(pre.xmod_backbone)
        activated = activated or b.num_layers
        head += backbone_flags(b)
    dense_prefix = pre.xmod_dense_prefix
    if pre.xmod_model:
        if pre.xmod_layout:
            raise LayoutError("xmod_model: give either --xmod-model or --xmod-layout")
        depth, width = split_model_name(pre.xmod_model)
        if width is not None:  # experts in every layer of the layout (the dense depth without one): a --moe-preset
            if pre.moe_preset is not None and pre.moe_preset != width:
                raise LayoutError(f"xmod_model: {pre.xmod_model!r} disagrees with --moe-preset {pre.moe_preset}; "
                                  "drop one of them")
            argv = argv + ["--moe-preset", width]
        if depth is None:
            layout = resolve_layout("dense", activated_depth=activated or 28)
        else:
            layout = layout_from_model_name(depth, activated_depth=activated or 28,
                                            dense_prefix=4 if dense_prefix is None else dense_prefix)
    else:
        layout = resolve_layout(pre.xmod_routing_family, num_layers=None if activated else pre.num_layers,
                                sparsity_k=pre.xmod_sparsity_k, anchor_stride=pre.xmod_anchor_stride,
                                dense_prefix=dense_prefix, layout=pre.xmod_layout, activated_depth=activated)
    # From here on the layout is explicit: the config re-validates it against --num-layers.
    argv = drop_flags(argv, _LAYOUT_FLAGS)
    tail = ["--xmod-routing-family", layout.family, "--xmod-layout", layout.notation]
    if pre.xmod_model and depth is not None:
        tail += ablation_flags(depth, argv, pre)
    if pre.num_layers is None:
        head += ["--num-layers", str(layout.num_layers)]
    if layout.num_sparse_layers:
        head += ["--no-rope-fusion"]
    if pre.xmod_cpu:  # a document mask (--reset-attention-mask) needs the dataloader's mask
        head += [flag for flag in CPU_FLAGS if flag != "--no-create-attention-mask-in-dataloader"
                 or "--reset-attention-mask" not in argv]
        if not pre.xmod_cpu_fusions:
            head += [flag for flag in CPU_COMPILED_FUSIONS if flag not in argv]
    if pre.xmod_muon_table5:
        head += MUON_TABLE5
    if pre.xmod_paper_schedule:
        head += PAPER_SCHEDULE
        if pre.min_lr is None:
            lr = pre.lr if pre.lr is not None else ("3.2e-3" if pre.xmod_muon_table5 else None)
            if lr is None:
                raise LayoutError("lr: --xmod-paper-schedule decays to 10% of the peak, so it needs --lr")
            tail += ["--min-lr", str(float(lr) * 0.1)]
    from megatron_xmod.moe.args import expand_moe_arguments

    # MoE presets size their experts from --ffn-hidden-size, which the backbone expansion provides.
    expanded = head + argv + tail
    scanned = scan_argv(expanded)  # as megatron will parse it: the backbone's flags, then the user's
    expanded = expand_moe_arguments(expanded, scanned)
    if pre.xmod_pipeline_balance == "auto":
        expanded = balanced_layout_flags(expanded, scanned, layout)
    return expanded


def balanced_layout_flags(argv: list[str], scanned: argparse.Namespace, layout) -> list[str]:
    """``argv`` (read as ``scanned``) with the cost-balanced ``--pipeline-model-parallel-layout`` of
    ``layout`` added; unchanged when the run is not pipelined or its user split it already
    (``--xmod-pipeline-balance auto``)."""
    from megatron_xmod.pipeline.auto import backbone_from_architecture, balanced_layout

    pipeline_size = scanned.pipeline_model_parallel_size or 1
    if pipeline_size < 2 or any(getattr(scanned, flag[2:].replace("-", "_")) is not None
                                for flag in _USER_PIPELINE_SPLIT):
        return argv
    backbone = backbone_from_architecture(scanned.hidden_size, scanned.num_attention_heads, scanned.num_query_groups,
                                          scanned.kv_channels, scanned.ffn_hidden_size, scanned.vocab_size)
    pipeline_layout = balanced_layout(layout, backbone, scanned.seq_length, scanned.micro_batch_size or 1,
                                      pipeline_size, scanned.num_virtual_stages_per_pipeline_rank,
                                      scanned.num_layers_per_virtual_pipeline_stage)
    return drop_flags(argv, _VIRTUAL_STAGE_FLAGS) + ["--pipeline-model-parallel-layout", pipeline_layout]


def ablation_flags(model: str, argv: list[str], explicit: argparse.Namespace) -> list[str]:
    """The --xmod-* flags of a model name's settings ablations (``-no-bias``: tau 0; ``-no-gate-scale``:
    varsigma fixed at 1); refuses an explicit flag (in ``argv``, read as ``explicit``) that contradicts them."""
    settings = ablation_settings(model)
    flags = []
    if "xmod_token_choice_bias_tau" in settings:
        flags += ["--xmod-token-choice-bias-tau", "0"]
    if "xmod_gate_scale_learnable" in settings:
        flags += ["--xmod-fixed-gate-scale", "--xmod-gate-scale-init", "1"]
    if flags and "-no-bias" in model and explicit.xmod_token_choice_bias_tau != 0 and any(
            a.split("=", 1)[0] == "--xmod-token-choice-bias-tau" for a in argv):
        raise LayoutError(f"xmod_token_choice_bias_tau: {model!r} is the ablation without the token-choice bias "
                          f"(tau = 0), but --xmod-token-choice-bias-tau {explicit.xmod_token_choice_bias_tau:g} was given; "
                          "drop one of them")
    if "-no-gate-scale" in model and any(a.split("=", 1)[0] == "--xmod-gate-scale-init" for a in argv) \
            and explicit.xmod_gate_scale_init != 1:
        raise LayoutError(f"xmod_gate_scale_init: {model!r} fixes varsigma at 1, but --xmod-gate-scale-init "
                          f"{explicit.xmod_gate_scale_init:g} was given; drop one of them")
    return flags


def drop_flags(argv: list[str], flags: set[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in flags:
            skip = "=" not in item
            continue
        out.append(item)
    return out
