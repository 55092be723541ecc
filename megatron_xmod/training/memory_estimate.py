"""Per-GPU memory of a Dense / MoD / X-MoD / MoE training run: weights, gradients, optimizer state,
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
- MoE layer (megatron's MoELayer, every layer of an MoE model): the dense layer's attention half, the
  pre-MLP norm (3h), the shared experts as a SwiGLU of their summed width (5 S d_e), and per *dispatched copy* of a
  token (k of them for Top-k, T on average for DTop-p): the permuted input (h), its routing probability
  (fp32) and the expert's SwiGLU (6 d_e); plus the router's fp32 / int64 [tokens, E] tensors (scores,
  routing map, top-k indices; about 8E + 20k bytes a token for megatron's TopKRouter, 12E with the
  fixed routing normalisation, 37E for the DTop-p router) and the dispatcher's indices (8E alltoall,
  5E allgather). The DTop-p controller state (a few scalars a layer) is left out;
- tensor parallel t divides a, g, f terms; sequence parallelism also the h terms, except the
  router-input chain's rows of a routed layer, which every rank keeps for all routed tokens (at
  most its own L/t). Expert parallelism
  (EP) splits the routed experts' weights, gradients and optimizer state over EP ranks, expert tensor
  parallelism (ETP, megatron's default: TP) their FFN; ETP all-gathers the dispatched tokens (each
  rank holds T_r k ETP copies of width h, T_r = its local tokens), so ETP divides only the d_e terms.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron_xmod.accounting import (
    attention_matmul_params,
    embedding_params,
    layer_matmul_params,
    layer_norm_params,
    mlp_matmul_params,
    router_params,
)
from megatron_xmod.moe.presets import MoEModel
from megatron_xmod.presets import Backbone, ModelDescription
from megatron_xmod.xmod.routing import context_parallel_width

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
    ep: int = 1  # expert parallel (megatron's --expert-model-parallel-size); MoE models only
    etp: Optional[int] = None  # expert tensor parallel (--expert-tensor-parallel-size); None: TP, megatron's default
    cp: int = 1  # context parallel (--context-parallel-size): each rank holds L/CP positions of every sequence
    routing_segments: int = 1  # the run's --xmod-routing-segments: with 2 CP | S a rank's routed batch is L/(K CP)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch_size", "bytes_per_activation", "ep", "cp", "routing_segments"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and int(self.etp) < 1:
            raise ValueError(f"etp: must be >= 1, got {self.etp}")
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


def _dense_mlp_bytes(b: Backbone, tokens: int, e: int, tp: int, sp: bool) -> float:
    """The MLP half of :func:`dense_layer_bytes`: the pre-MLP norm (input, output, rstd), fc1's input, SwiGLU (5f)."""
    h_split = tp if sp else 1
    return tokens * (e * (3 * b.hidden_size / h_split + 5 * b.ffn_hidden_size / tp) + 4 / h_split)


# --------------------------------------------------------------------------- MoE layers
ROUTERS = ("topk", "topk-norm", "dtopp")
DISPATCHERS = ("alltoall", "allgather")
# Bytes a token the router saves for backward (fp32 scores, int64 indices, whatever the activation
# dtype): (per expert, per routed expert of the token, constant), measured on megatron 0.19's TopKRouter
# (sigmoid scores + expert bias: logits and scores [tokens, E]), our BaselineTopKRouter with the fixed
# routing normalisation (one more [tokens, E]) and the DTop-p router (normalisation, softmax, threshold
# mask, entropy: seven fp32, one int64 and one bool [tokens, E]).
_ROUTER_BYTES = {"topk": (8, 20, 8), "topk-norm": (12, 20, 8), "dtopp": (37, 0, 12)}
# The dispatcher's index tensors, bytes per token and expert (alltoall: the sorted routing map;
# allgather: the routing map and the probabilities of the gathered tokens); 8 more per dispatched copy.
_DISPATCH_BYTES = {"alltoall": 8, "allgather": 5}


@dataclass(frozen=True)
class MoELayerShape:
    """What the memory of one of megatron's MoE layers depends on."""

    num_experts: int  # routed experts E
    active_experts: float  # routed experts a token is dispatched to: k, or T on average for DTop-p
    expert_ffn: int  # d_e
    shared_ffn: int = 0  # the shared experts' summed width (megatron builds them as one MLP)
    router: str = "topk"  # topk | topk-norm (fixed routing normalisation) | dtopp (DTop-p / Top-p)
    dispatcher: str = "alltoall"
    router_temperature: bool = False  # DTop-p's learnable theta_l: one parameter a layer

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router: {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"moe_token_dispatcher_type: {self.dispatcher!r} is not one of {', '.join(DISPATCHERS)}")
        if not 0 < self.active_experts <= self.num_experts:
            raise ValueError(f"active_experts: {self.active_experts:g} routed experts a token, but there are "
                             f"{self.num_experts}; give 1..{self.num_experts}")

    @classmethod
    def from_model(cls, moe: MoEModel, ffn_hidden_size: int) -> MoELayerShape:
        if moe.active_routed is None:
            raise ValueError(f"model: {moe.name} routes a token to a variable number of experts (a fixed threshold); "
                             "the memory estimate needs a mean: use dtopp-t<T> (the controller holds it at T)")
        fields = moe.megatron_fields(ffn_hidden_size)
        router = "dtopp" if moe.router_type != "topk" else "topk-norm" if moe.recipe == "dtopp-paper" else "topk"
        return cls(moe.routed_experts, float(moe.active_routed), fields["moe_ffn_hidden_size"],
                   fields["moe_shared_expert_intermediate_size"] or 0, router, fields["moe_token_dispatcher_type"],
                   router_temperature=moe.router_type == "dtopp")

    def params(self, b: Backbone, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[float, float]:
        """(non-expert, routed-expert) parameters of one MoE layer on one GPU."""
        dense = (attention_matmul_params(b) / tp + layer_norm_params(b) + self.num_experts * b.hidden_size
                 + self.router_temperature + mlp_matmul_params(b, self.shared_ffn) / tp)
        return dense, self.num_experts / ep * mlp_matmul_params(b, self.expert_ffn) / etp


def moe_layer_bytes(b: Backbone, shape: MoELayerShape, tokens: int, e: int = 4, tp: int = 1, sp: bool = False,
                    recompute: str = "none", ep: int = 1, etp: Optional[int] = None) -> float:
    """Bytes one of megatron's MoE layers saves for backward when it processes ``tokens`` (= L x b; with
    sequence parallelism each TP rank routes L/TP of them), tokens spread evenly over the experts."""
    etp = tp if etp is None else etp
    h = b.hidden_size
    local = tokens / (tp if sp else 1)  # the tokens this rank routes
    attention = dense_layer_bytes(b, tokens, e, tp, sp, recompute) - _dense_mlp_bytes(b, tokens, e, tp, sp)
    norm = local * (3 * h * e + 4)  # its input, output and rstd, and the normalised input the router (and fc1) keep
    shared = tokens * 5 * shape.shared_ffn / tp * e  # the shared experts: one SwiGLU MLP of their summed width
    per_expert, per_copy, constant = _ROUTER_BYTES[shape.router]
    k = shape.active_experts
    router = local * (per_expert * shape.num_experts + per_copy * k + constant)
    copies = local * k * etp  # the dispatched copies this rank's experts process (all-gathered over ETP)
    gathered = local * etp * ep if shape.dispatcher == "allgather" else local
    dispatch = gathered * _DISPATCH_BYTES[shape.dispatcher] * shape.num_experts + copies * 8
    experts = copies * (e * h + 4 + 6 * e * shape.expert_ffn / etp)
    return attention + norm + shared + router + dispatch + experts


def routed_layer_bytes(b: Backbone, seq_tokens: int, sparsity_k: int, family: str = "xmod", e: int = 4,
                       tp: int = 1, sp: bool = False, recompute: str = "none", cp: int = 1,
                       segments: int = 1) -> float:
    """Bytes a routed layer saves (inside a chain, without the block's base), ``seq_tokens`` = L x b.

    Under context parallelism a rank runs its routed tokens at the static width of
    routing.context_parallel_width per sequence (min(L/K, L/CP): it may hold any number of them; L/(K CP)
    with ``segments`` a multiple of 2 CP) and keeps the keys and values gathered from every CP rank; its
    router scores stay full length (every rank routes the whole sequence)."""
    routed = context_parallel_width(seq_tokens / sparsity_k, seq_tokens, cp, segments)
    h_split = tp if sp else 1
    # the chain's rows: under sequence parallelism every rank keeps all routed rows (a static shape, no
    # host sync), at most all of its own
    chain_rows = min(routed, seq_tokens / cp / h_split)
    extra_per_routed = b.hidden_size * e / h_split + 3 * 8 + (3 if family == "xmod" else 2) * 4  # + gated update
    return (dense_layer_bytes(b, routed, e, tp, sp, recompute) + routed * extra_per_routed + chain_rows * b.hidden_size * e
            + gathered_kv_bytes(b, routed, e, tp, cp) + seq_tokens * 3 * 4)


def gathered_kv_bytes(b: Backbone, tokens: float, e: int, tp: int, cp: int) -> float:
    """The keys and values of the other CP ranks a layer keeps for backward (``tokens``: its own rows)."""
    return tokens * (cp - 1) * 2 * b.num_query_groups * b.head_dim / tp * e


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
    activations_moe_layers: float = 0.0
    expert_params_per_gpu: int = 0  # the routed experts' share of params_per_gpu

    def to_dict(self) -> dict:
        return asdict(self)


def _check_expert_grid(shape: MoELayerShape, p: Parallel, etp: int) -> None:
    """megatron's own conditions on an MoE launch, before any estimate."""
    if p.tp > 1 and not p.sequence_parallel:
        raise ValueError(f"sequence_parallel: megatron's MoE layer refuses to train at TP {p.tp} without sequence "
                         "parallelism (it raises at the first step); add --sequence-parallel")
    if shape.num_experts % p.ep:
        raise ValueError(f"expert_model_parallel_size: {shape.num_experts} experts do not split over EP {p.ep}; use a "
                         f"divisor of {shape.num_experts} (--ep for xmod count, --expert-model-parallel-size for megatron)")
    if (p.tp * p.dp) % (etp * p.ep):
        raise ValueError(f"expert_model_parallel_size: EP {p.ep} x expert TP {etp} must divide the TP {p.tp} x DP "
                         f"{p.dp} GPUs of a pipeline stage (megatron's expert grid); lower --ep / --etp")


def estimate(description: ModelDescription, seq_len: int, parallel: Parallel,
             moe: Optional[MoELayerShape] = None) -> MemoryEstimate:
    """Per-GPU bytes of the most loaded pipeline stage (the first: it holds pp micro-batches of
    activations under 1F1B; the embedding and, for the estimate, the LM head are counted on it too).

    An MoE model (``description.moe``, or ``moe`` from a launch's flags) has megatron's MoE layer in
    every layer of its layout (a routed layer runs it on its L/K routed tokens); its routed experts are split over EP x ETP ranks and their optimizer
    state over the expert data-parallel ranks (TP x DP / (EP x ETP))."""
    p = parallel
    b, layout = description.backbone, description.layout
    if moe is None and description.moe is not None:
        moe = MoELayerShape.from_model(description.moe, b.ffn_hidden_size)
    if seq_len % (p.tp if p.sequence_parallel else 1):
        raise ValueError(f"seq_len: sequence parallelism needs L ({seq_len}) divisible by TP ({p.tp})")
    if seq_len % (2 * p.cp):
        raise ValueError(f"seq_len: context parallelism splits L ({seq_len}) into 2 x CP = {2 * p.cp} equal chunks; "
                         f"use a multiple of {2 * p.cp}")
    if moe is not None and p.cp > 1:
        raise ValueError("cp: the estimate of MoE layers under context parallelism is not modelled; use --cp 1")
    e, tp, sp = p.bytes_per_activation, p.tp, p.sequence_parallel
    etp = tp if p.etp is None else p.etp
    if moe is not None:
        _check_expert_grid(moe, p, etp)
        dense_part, expert_part = moe.params(b, tp, p.ep, etp)
        layer_params, expert_params = layout.num_layers * dense_part, layout.num_layers * expert_part
    else:
        layer_params = layout.num_layers * (layer_matmul_params(b) / tp + layer_norm_params(b))
        expert_params = 0.0
    layer_params += layout.num_sparse_layers * router_params(b, layout.family)
    params = layer_params / p.pp + embedding_params(b) / tp  # input embedding + LM head (untied)
    experts = expert_params / p.pp
    weights = (params + experts) * e
    gradients = (params + experts) * (4 if p.fp32_gradients else e)  # megatron's gradient buffer
    per_param = 12 if p.optimizer == "adam" else 8  # fp32 master + Adam m, v | Muon momentum
    state, expert_state = params * per_param, experts * per_param
    if p.distributed_optimizer:  # dense parameters over DP, experts over the expert data-parallel ranks
        state, expert_state = state / p.dp, expert_state / (tp * p.dp / (etp * p.ep))
    state += expert_state
    tokens = seq_len * p.micro_batch_size
    local = tokens / p.cp  # the positions this CP rank holds
    in_flight = p.pp if p.num_microbatches is None else min(p.pp, p.num_microbatches)
    dense = routed = bases = moe_layers = 0.0
    blocks = set()
    for layer in layout.layers:
        if p.recompute == "full":  # every layer keeps its input (the checkpoint), full length
            dense += block_base_bytes(b, local, e, tp, sp)
            continue
        if layer.is_sparse:
            routed += routed_layer_bytes(b, tokens, layer.sparsity_k, layout.family, e, tp, sp, p.recompute, p.cp,
                                         p.routing_segments)
            if moe is not None:  # its layer runs megatron's MoE layer, not the dense one, on the routed tokens
                inner = tokens / layer.sparsity_k
                routed += (moe_layer_bytes(b, moe, inner, e, tp, sp, p.recompute, p.ep, etp)
                           - dense_layer_bytes(b, inner, e, tp, sp, p.recompute))
            blocks.add(layer.block)
        elif moe is not None:
            moe_layers += moe_layer_bytes(b, moe, tokens, e, tp, sp, p.recompute, p.ep, etp)
        else:
            dense += dense_layer_bytes(b, local, e, tp, sp, p.recompute) + gathered_kv_bytes(b, local, e, tp, p.cp)
    bases = len(blocks) * block_base_bytes(b, local, e, tp, sp)
    scale = in_flight / p.pp  # this stage's share of the layers, times the micro-batches it holds
    dense, routed, bases, moe_layers = dense * scale, routed * scale, bases * scale, moe_layers * scale
    if p.recompute == "full":  # one layer's activations live again while it is recomputed
        dense += (moe_layer_bytes(b, moe, tokens, e, tp, sp, "none", p.ep, etp) if moe is not None
                  else dense_layer_bytes(b, local, e, tp, sp) + gathered_kv_bytes(b, local, e, tp, p.cp))
    logits = local * b.vocab_size / tp * (e + 4)  # logits and the fp32 softmax of the cross entropy
    total = weights + gradients + state + dense + routed + bases + moe_layers + logits
    return MemoryEstimate(description.name, seq_len, int(params + experts), weights, gradients, state, dense, routed,
                          bases, logits, total, activations_moe_layers=moe_layers, expert_params_per_gpu=int(experts))


def format_estimate(est: MemoryEstimate) -> str:
    gib = lambda x: f"{x / GIB:7.2f} GiB"  # noqa: E731
    rows = [("weights", est.weights), ("gradients", est.gradients), ("optimizer state", est.optimizer_state),
            ("activations: dense layers", est.activations_dense_layers),
            ("activations: routed layers", est.activations_routed_layers),
            ("activations: block bases", est.activations_block_bases)]
    if est.activations_moe_layers:
        rows.append(("activations: MoE layers", est.activations_moe_layers))
    rows += [("logits", est.logits), ("total", est.total)]
    return "\n".join(f"  {name:<28} {gib(value)}" for name, value in rows)


# --------------------------------------------------------------------------- xmod count --memory
def add_memory_arguments(p) -> None:
    p.add_argument("--memory", action="store_true",
                   help="per-GPU memory by part (weights, gradients, optimizer state, activations, logits)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (--memory)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (--memory)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (--memory)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size, megatron's --expert-model-parallel-size (--memory, MoE models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size, megatron's --expert-tensor-parallel-size (--memory, MoE models; "
                        "default: --tp, as megatron)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size, megatron's --context-parallel-size (--memory)")
    p.add_argument("--routing-segments", type=int, default=1,
                   help="the run's --xmod-routing-segments (--memory): with --cp C and 2C dividing it, a rank's "
                        "routed batch is L/(K C) tokens instead of min(L/K, L/C)")
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
                    distributed_optimizer=args.distributed_optimizer, ep=getattr(args, "ep", 1),
                    etp=getattr(args, "etp", None), cp=getattr(args, "cp", 1),
                    routing_segments=getattr(args, "routing_segments", 1))


def print_memory(args, backbone: Backbone, models: list[str]) -> int:
    import json

    from megatron_xmod.presets import parse_model

    parallel = parallel_from_args(args)
    descriptions = [parse_model(m, backbone, dense_prefix=args.dense_prefix) for m in models]
    estimates = [estimate(d, args.seq_len, parallel) for d in descriptions]
    if args.json:
        for m, est in zip(models, estimates):
            print(json.dumps(dict(est.to_dict(), model=m, backbone=backbone.name, **asdict(parallel))))
    else:
        experts = any(d.moe is not None for d in descriptions)
        etp = parallel.tp if parallel.etp is None else parallel.etp
        print(f"backbone {backbone.name}, L = {args.seq_len}, TP {parallel.tp} x PP {parallel.pp}"
              + (f" x CP {parallel.cp}" if parallel.cp > 1 else "") + f" x DP {parallel.dp}"
              + (f" (experts: EP {parallel.ep} x ETP {etp})" if experts else "")
              + f", micro-batch {parallel.micro_batch_size}, sequence parallel "
              f"{'on' if parallel.sequence_parallel else 'off'}, recompute {parallel.recompute}, {parallel.optimizer}"
              f"{' (distributed)' if parallel.distributed_optimizer else ''}, bf16; per GPU, before CUDA/NCCL overheads")
        for m, est in zip(models, estimates):
            routed = (f", {est.expert_params_per_gpu / 1e6:.0f}M of them routed experts"
                      if est.expert_params_per_gpu else "")
            print(f"{m} ({est.params_per_gpu / 1e6:.0f}M parameters per GPU{routed})")
            print(format_estimate(est))
    limit = getattr(args, "gpu_mem_gb", None)
    over = [m for m, est in zip(models, estimates) if limit is not None and est.total > limit * GIB]
    if over:
        experts = any(est.expert_params_per_gpu for m, est in zip(models, estimates) if m in over)
        print(f"gpu_mem_gb: {', '.join(over)} need more than {limit:g} GiB per GPU; add tensor/pipeline parallelism, "
              f"--sequence-parallel, recompute{', expert parallelism (--ep)' if experts else ''}, or a distributed "
              "optimizer")
        return 1
    return 0


# --------------------------------------------------------------------------- launchers (DRY_RUN)
class NotEstimated(Exception):
    """A launch the estimate cannot describe (its message says why)."""


def moe_shape_from_args(args) -> Optional[MoELayerShape]:
    """The MoE layer megatron's parsed arguments (with the plugin's MoE flags) describe; None without experts."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return None
    router_type = getattr(args, "moe_router_type", None) or "topk"
    norm = getattr(args, "dtopp_routing_norm", None)
    if router_type == "topp-fixed":
        raise NotEstimated("moe_router_type: topp-fixed routes a token to a variable number of experts (a fixed "
                           "threshold), so its memory has no set size; dtopp (--dtopp-target-experts) holds the mean")
    if router_type == "dtopp":
        targets = getattr(args, "dtopp_layer_targets", None) if getattr(args, "dtopp_layerwise", None) else None
        active = (sum(targets) / len(targets) if targets else getattr(args, "dtopp_target_experts", None)
                  or args.moe_router_topk)
        router = "dtopp"
    else:
        active, router = args.moe_router_topk, "topk-norm" if norm == "fixed" else "topk"
    return MoELayerShape(experts, float(active), args.moe_ffn_hidden_size or args.ffn_hidden_size,
                         getattr(args, "moe_shared_expert_intermediate_size", None) or 0, router,
                         getattr(args, "moe_token_dispatcher_type", None) or "allgather",
                         router_temperature=router_type == "dtopp" and norm in (None, "learnable"))


def estimate_from_args(args) -> MemoryEstimate:
    """The estimate of a launch from megatron's parsed arguments; :class:`NotEstimated` when it has none."""
    from megatron_xmod.training.providers import config_from_args

    moe = moe_shape_from_args(args)
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
        num_microbatches=max(1, args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)),
        ep=getattr(args, "expert_model_parallel_size", None) or 1,
        etp=getattr(args, "expert_tensor_parallel_size", None),
        cp=getattr(args, "context_parallel_size", None) or 1,
        routing_segments=getattr(args, "xmod_routing_segments", None) or 1)
    return estimate(ModelDescription(layout.notation, backbone, layout), args.seq_length, parallel, moe=moe)


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
    try:
        est = estimate_from_args(args)
    except NotEstimated as why:
        print(f"[dry-run] memory: not estimated: {why}")
        return 0
    except ValueError as error:  # a launch megatron would refuse or crash on (e.g. MoE at TP > 1 without SP)
        print(f"[dry-run] FAILED: {error}")
        return 1
    print(f"[dry-run] memory per GPU (estimate, before CUDA/NCCL overheads; GPU_MEM_GB={limit_gb:g}):")
    print(format_estimate(est))
    if est.total > limit_gb * GIB:
        print(f"[dry-run] FAILED (memory): the estimate {est.total / GIB:.1f} GiB exceeds GPU_MEM_GB={limit_gb:g}; add "
              "--sequence-parallel, tensor/pipeline parallelism, "
              + ("--expert-model-parallel-size, " if est.expert_params_per_gpu else "")
              + "--use-distributed-optimizer or recompute, or raise GPU_MEM_GB for larger GPUs")
        return 1
    return 0
