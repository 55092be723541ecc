"""Per-GPU memory of a Dense / MoD / X-MoD training run: weights, gradients, optimizer state,
activations by layer kind and logits, before anything is allocated (``xmod count --memory``, the
launchers' DRY_RUN).

The activation formulas count what autograd saves for backward per token a layer processes, for the
layers this plugin builds (megatron's local GPT layer: RMSNorm, QK-norm, GQA, RoPE, SwiGLU; SDPA
flash attention, which keeps q, k, v, the output and the log-sum-exp, not the L x L scores).
``bench/memory.py`` measures the same quantities with ``torch.autograd.graph.saved_tensors_hooks`` and
checks the formulas against them (fp32, CPU); at bf16 the tensors are counted at 2 bytes and the
norm / softmax statistics, router scores and indices at their own (fp32 / int64) sizes.

- dense layer, per token: 6h + 5 a d + 4 g d + 5 f (activations) + 2 + 2a + g (fp32 norm and
  softmax statistics) + 4d (RoPE cos/sin, per position) elements;
- routed layer, per routed token (L/K of them): the same, plus the rows of the previous routed layer
  (the router-input chain of megatron_xmod.xmod.routing_state) and the gated update (2h), indices and gates;
  per token of the sequence: 3 fp32 router scalars (scores, BCE target); per block: one full-length
  base [L, b, h];
- tensor parallel t divides a, g, f terms; sequence parallelism also the h terms.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron_xmod.accounting import embedding_params, layer_matmul_params, layer_norm_params, router_params
from megatron_xmod.presets import Backbone, ModelDescription

OPTIMIZERS = ("adam", "muon")
RECOMPUTE = ("none", "selective", "full")
GIB = 1024 ** 3


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    optimizer: str = "adam"
    distributed_optimizer: bool = False  # megatron's distributed optimizer (Adam) / layer-wise (Muon)
    fp32_gradients: bool = True  # megatron accumulates bf16 gradients in fp32 (accumulate_allreduce_grads_in_fp32)
    bytes_per_activation: int = 2  # bf16
    num_microbatches: Optional[int] = None  # None: at least pp (the 1F1B steady state)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch_size", "bytes_per_activation"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute: {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


# --------------------------------------------------------------------------- per-layer activations
def dense_layer_bytes(b: Backbone, tokens: int, e: int = 4, tp: int = 1, sp: bool = False,
                      recompute: str = "none") -> float:
    """Bytes a dense layer saves for backward when it processes ``tokens`` (= sequence positions x micro-batch)."""
    h, a, g, d, f = b.hidden_size, b.num_attention_heads, b.num_query_groups, b.head_dim, b.ffn_hidden_size
    h_split = tp if sp else 1
    big = 6 * h / h_split + (5 * a * d + 4 * g * d + 5 * f) / tp
    stats = 2 / h_split + (2 * a + g) / tp
    if recompute == "selective":  # megatron recomputes core attention: its output and log-sum-exp are not kept
        big -= a * d / tp
        stats -= a / tp
    return tokens * (e * big + 4 * stats + e * 4 * d)


def routed_layer_bytes(b: Backbone, seq_tokens: int, sparsity_k: int, family: str = "xmod", e: int = 4,
                       tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Bytes a routed layer saves (inside a chain, without the block's base), ``seq_tokens`` = L x b."""
    routed = seq_tokens / sparsity_k
    h_split = tp if sp else 1
    extra_per_routed = 2 * b.hidden_size * e / h_split + 3 * 8 + (3 if family == "xmod" else 2) * 4
    return dense_layer_bytes(b, routed, e, tp, sp, recompute) + routed * extra_per_routed + seq_tokens * 3 * 4


def block_base_bytes(b: Backbone, seq_tokens: int, e: int = 4, tp: int = 1, sp: bool = False) -> float:
    """The full-length block input the routers of one block share."""
    return seq_tokens * b.hidden_size * e / (tp if sp else 1)


# --------------------------------------------------------------------------- whole model, per GPU
@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    seq_len: int
    params_per_gpu: int
    weights: float
    gradients: float
    optimizer_state: float
    activations_dense_layers: float
    activations_routed_layers: float
    activations_block_bases: float
    logits: float
    total: float

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(description: ModelDescription, seq_len: int, parallel: Parallel) -> MemoryEstimate:
    """Per-GPU bytes of the most loaded pipeline stage (the first: it holds pp micro-batches of
    activations under 1F1B; the embedding and, for the estimate, the LM head are counted on it too)."""
    p = parallel
    b, layout = description.backbone, description.layout
    if description.moe is not None:
        raise ValueError("model: the memory estimate covers Dense / MoD / X-MoD models, not MoE")
    if seq_len % (p.tp if p.sequence_parallel else 1):
        raise ValueError(f"seq_len: sequence parallelism needs L ({seq_len}) divisible by TP ({p.tp})")
    e, tp, sp = p.bytes_per_activation, p.tp, p.sequence_parallel
    layer_params = sum(layer_matmul_params(b) / tp + layer_norm_params(b)
                       + (router_params(b, layout.family) if layer.is_sparse else 0) for layer in layout.layers)
    params = layer_params / p.pp + embedding_params(b) / tp  # input embedding + LM head (untied)
    weights = params * e
    gradients = params * (4 if p.fp32_gradients else e)  # megatron's gradient buffer
    state = params * (12 if p.optimizer == "adam" else 8)  # fp32 master + Adam m, v | Muon momentum
    if p.distributed_optimizer:
        state /= p.dp
    tokens = seq_len * p.micro_batch_size
    in_flight = p.pp if p.num_microbatches is None else min(p.pp, p.num_microbatches)
    dense = routed = bases = 0.0
    blocks = set()
    for layer in layout.layers:
        if p.recompute == "full":  # every layer keeps its input (the checkpoint), full length
            dense += block_base_bytes(b, tokens, e, tp, sp)
            continue
        if layer.is_sparse:
            routed += routed_layer_bytes(b, tokens, layer.sparsity_k, layout.family, e, tp, sp, p.recompute)
            blocks.add(layer.block)
        else:
            dense += dense_layer_bytes(b, tokens, e, tp, sp, p.recompute)
    bases = len(blocks) * block_base_bytes(b, tokens, e, tp, sp)
    scale = in_flight / p.pp  # this stage's share of the layers, times the micro-batches it holds
    dense, routed, bases = dense * scale, routed * scale, bases * scale
    if p.recompute == "full":  # one layer's activations live again while it is recomputed
        dense += dense_layer_bytes(b, tokens, e, tp, sp)
    logits = tokens * b.vocab_size / tp * (e + 4)  # logits and the fp32 softmax of the cross entropy
    total = weights + gradients + state + dense + routed + bases + logits
    return MemoryEstimate(description.name, seq_len, int(params), weights, gradients, state, dense, routed, bases,
                          logits, total)


def format_estimate(est: MemoryEstimate) -> str:
    gib = lambda x: f"{x / GIB:7.2f} GiB"  # noqa: E731
    rows = [("weights", est.weights), ("gradients", est.gradients), ("optimizer state", est.optimizer_state),
            ("activations: dense layers", est.activations_dense_layers),
            ("activations: routed layers", est.activations_routed_layers),
            ("activations: block bases", est.activations_block_bases), ("logits", est.logits),
            ("total", est.total)]
    return "\n".join(f"  {name:<28} {gib(value)}" for name, value in rows)


# --------------------------------------------------------------------------- xmod count --memory
def add_memory_arguments(p) -> None:
    p.add_argument("--memory", action="store_true",
                   help="per-GPU memory by part (weights, gradients, optimizer state, activations, logits)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (--memory)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (--memory)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (--memory)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (--memory)")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE, help="activation recompute (--memory)")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron's sequence parallelism (--memory)")
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS, help="(--memory)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="optimizer state sharded over DP: megatron's distributed optimizer (Adam) or layer-wise (Muon)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="with --memory: exit 1 when a model's estimate exceeds this many GB (GiB) per GPU")


def parallel_from_args(args) -> Parallel:
    return Parallel(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch_size=args.micro_batch_size,
                    sequence_parallel=args.sequence_parallel, recompute=args.recompute, optimizer=args.optimizer,
                    distributed_optimizer=args.distributed_optimizer)


def print_memory(args, backbone: Backbone, models: list[str]) -> int:
    import json

    from megatron_xmod.presets import parse_model

    parallel = parallel_from_args(args)
    estimates = [estimate(parse_model(m, backbone, dense_prefix=args.dense_prefix), args.seq_len, parallel)
                 for m in models]
    if args.json:
        for m, est in zip(models, estimates):
            print(json.dumps(dict(est.to_dict(), model=m, backbone=backbone.name, **asdict(parallel))))
    else:
        print(f"backbone {backbone.name}, L = {args.seq_len}, TP {parallel.tp} x PP {parallel.pp} x DP {parallel.dp}, "
              f"micro-batch {parallel.micro_batch_size}, sequence parallel {'on' if parallel.sequence_parallel else 'off'}, "
              f"recompute {parallel.recompute}, {parallel.optimizer}"
              f"{' (distributed)' if parallel.distributed_optimizer else ''}, bf16; per GPU, before CUDA/NCCL overheads")
        for m, est in zip(models, estimates):
            print(f"{m} ({est.params_per_gpu / 1e6:.0f}M parameters per GPU)")
            print(format_estimate(est))
    limit = getattr(args, "gpu_mem_gb", None)
    over = [m for m, est in zip(models, estimates) if limit is not None and est.total > limit * GIB]
    if over:
        print(f"gpu_mem_gb: {', '.join(over)} need more than {limit:g} GiB per GPU; add tensor/pipeline parallelism, "
              "--sequence-parallel, recompute, or a distributed optimizer")
        return 1
    return 0


# --------------------------------------------------------------------------- launchers (DRY_RUN)
def estimate_from_args(args) -> Optional[MemoryEstimate]:
    """The estimate of a launch from megatron's parsed arguments (None for MoE models)."""
    from megatron_xmod.training.providers import config_from_args

    if getattr(args, "num_experts", None):
        return None
    heads = args.num_attention_heads
    backbone = Backbone("launch", hidden_size=args.hidden_size, head_dim=args.kv_channels or args.hidden_size // heads,
                        num_attention_heads=heads, num_query_groups=args.num_query_groups or heads,
                        ffn_hidden_size=args.ffn_hidden_size,
                        vocab_size=getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 50257,
                        qk_layernorm=bool(getattr(args, "qk_layernorm", False)))
    layout = _spec_layout(args) or config_from_args(args).layer_layout
    optimizer = getattr(args, "optimizer", "adam")
    parallel = Parallel(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, dp=args.data_parallel_size,
        micro_batch_size=args.micro_batch_size, sequence_parallel=bool(args.sequence_parallel),
        recompute=args.recompute_granularity or "none", optimizer=optimizer if optimizer in OPTIMIZERS else "adam",
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)  # megatron turns it into
                                   or getattr(args, "use_layer_wise_distributed_optimizer", False)),  # this for Muon
        bytes_per_activation=2 if (args.bf16 or args.fp16) else 4,
        fp32_gradients=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", True)),
        num_microbatches=max(1, args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)))
    return estimate(ModelDescription(layout.notation, backbone, layout), args.seq_length, parallel)


def _spec_layout(args):
    """The layout a Megatron-LM launch gets from ``--spec MODULE NAME`` (its flags say nothing of routing)."""
    spec = getattr(args, "spec", None)
    if not spec or len(spec) != 2:
        return None
    from megatron_xmod.spec import resolve

    try:
        return resolve(*spec).params["xmod"].parsed()
    except (ImportError, AttributeError, TypeError):  # not one of ours: megatron's own spec, a dense model
        return None


def check_launch_memory(args, limit_gb: Optional[float] = None) -> int:
    """Print the per-GPU estimate of a launch; 1 when it exceeds ``GPU_MEM_GB`` (default 80) GiB."""
    import os

    if limit_gb is None:
        limit_gb = float(os.environ.get("GPU_MEM_GB") or 80)
    est = estimate_from_args(args)
    if est is None:
        print("[dry-run] memory: not estimated for MoE models")
        return 0
    print(f"[dry-run] memory per GPU (estimate, before CUDA/NCCL overheads; GPU_MEM_GB={limit_gb:g}):")
    print(format_estimate(est))
    if est.total > limit_gb * GIB:
        print(f"[dry-run] FAILED (memory): the estimate {est.total / GIB:.1f} GiB exceeds GPU_MEM_GB={limit_gb:g}; add "
              "--sequence-parallel, tensor/pipeline parallelism, --use-distributed-optimizer or recompute, or raise "
              "GPU_MEM_GB for larger GPUs")
        return 1
    return 0
