"""Per-layer training cost of a model, from the accounting (:mod:`megatron_xmod.accounting`).

The pipeline sees a model as a sequence of *items*: megatron's layout letters ``E`` (embedding, on
the first stage), one ``t`` per decoder layer, and ``L`` (final norm, LM head and loss, on the last
stage). Each item has, per micro-batch of ``micro_batch_size`` sequences of ``seq_len`` tokens:

- ``flops``: forward + backward FLOPs (3x the forward FLOPs of :func:`~megatron_xmod.accounting.count_layer`,
  the accounting's convention: attention at full length; the LM head 2*h*V per token);
- ``bytes_moved``: memory traffic proxy: weights read in the forward and twice in the backward and
  the fp32 gradient accumulated, plus every stored activation written and read once in the forward
  and twice in the backward. A routed layer still touches every token (router, gather, gated
  scatter), which is why it costs more than 1/K of a dense layer;
- ``time_s``: ``flops / hardware.flops_per_s + bytes_moved / hardware.bytes_per_s`` (a roofline
  sum; both rates are *achieved* rates, not peaks), or the measured time from a calibration file;
- ``params``: parameters held by the stage (memory for weights, gradients and optimizer states);
- ``activation_bytes``: what one in-flight micro-batch keeps for the backward pass (bf16, flash
  attention, no recompute); the 1F1B schedule keeps ``pp - rank`` of them on pipeline rank ``rank``.

Calibration file (JSON, written by a profiling run): measured forward+backward seconds per micro-batch
by item kind, ``{"D": 0.0123, "S16": 0.0011, "E": 0.0002, "L": 0.004}`` (``D`` dense, ``S<K>``
sparse with that K, ``E`` embedding, ``L`` head and loss). Kinds the file leaves out keep the proxy,
scaled by the median measured/proxy ratio of the kinds it gives.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_xmod.accounting import count_layer
from megatron_xmod.presets import Backbone, ModelDescription

BF16 = 2


@dataclass(frozen=True)
class Hardware:
    """Achieved rates of one accelerator (defaults: an H100-class GPU at ~60% of its bf16 peak and
    ~75% of its HBM bandwidth). Only their ratio matters for the layout."""

    flops_per_s: float = 600e12
    bytes_per_s: float = 2.5e12


DEFAULT_HARDWARE = Hardware()


@dataclass(frozen=True)
class Item:
    kind: str  # "E", "L", "D" or "S<K>"
    flops: float
    bytes_moved: float
    params: int
    activation_bytes: float
    time_s: float

    @property
    def letter(self) -> str:
        """megatron's --pipeline-model-parallel-layout letter."""
        return self.kind if self.kind in ("E", "L") else "t"


def _stored_per_token(b: Backbone) -> int:
    """Elements a dense SwiGLU/GQA layer stores per token for its backward pass: both norm inputs and
    outputs (4h), Q, K, V (h_att + 2 kv), the attention output (h_att), fc1's output (2 ffn) and the
    SwiGLU output (ffn)."""
    kv = b.num_query_groups * b.head_dim
    return 4 * b.hidden_size + 2 * b.attention_dim + 2 * kv + 3 * b.ffn_hidden_size


def layer_items(model: ModelDescription, seq_len: int, micro_batch_size: int = 1,
                hardware: Hardware = DEFAULT_HARDWARE) -> list[Item]:
    """``[E, layer 1 .. layer n, L]`` of ``model`` (proxy costs, uncalibrated)."""
    if seq_len < 1 or micro_batch_size < 1:
        raise ValueError(f"seq_len/micro_batch_size: must be >= 1, got {seq_len}/{micro_batch_size}")
    b, layout = model.backbone, model.layout
    tokens = seq_len * micro_batch_size
    h, vocab = b.hidden_size, b.vocab_size

    def item(kind, flops, weight_params, stored_bytes, params):
        weight_traffic = weight_params * (3 * BF16 + 2 * 4)  # read fwd + 2x bwd; fp32 grad read+write
        activation_traffic = 3 * 2 * stored_bytes  # written+read in the forward, twice that backward
        moved = weight_traffic + activation_traffic
        return Item(kind, flops, moved, params, stored_bytes,
                    flops / hardware.flops_per_s + moved / hardware.bytes_per_s)

    items = [item("E", 0.0, tokens * h, tokens * 8, vocab * h)]  # a row gather; keeps the token ids
    for layer in layout.layers:
        counted = count_layer(b, layer, layout.family, model.moe)
        forward = 2 * counted.active_matmul + 4 * seq_len * b.attention_dim * counted.attention_units
        if layer.is_sparse:
            routed = float(layer.routed_fraction)
            # routed tokens store a dense layer's activations; every token keeps the layer input (for
            # the gated scatter and the router) and an fp32 router logit
            stored = tokens * (routed * _stored_per_token(b) * BF16 + h * BF16 + 4)
            kind = f"S{layer.sparsity_k}"
        else:
            stored = tokens * _stored_per_token(b) * BF16
            kind = "D"
        items.append(item(kind, 3 * float(forward) * tokens, float(counted.total), stored, int(counted.total)))
    # final norm + LM head + cross-entropy: the norm input (bf16) and the fp32 logits are kept
    head_stored = tokens * (h * BF16 + vocab * 4)
    items.append(item("L", 3 * 2.0 * h * vocab * tokens, h * vocab, head_stored, h * vocab + h))
    return items


def read_calibration(path: str | Path) -> dict[str, float]:
    where = f"calibration {path}"
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{where}: file not found; write measured seconds per kind, e.g. "
                         '{"D": 0.012, "S16": 0.0011, "E": 0.0002, "L": 0.004}')
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error}); write one object of kind -> seconds") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: expected a non-empty JSON object of kind -> seconds (kinds: D, S<K>, E, L)")
    for kind, seconds in data.items():
        if not (kind in ("D", "E", "L") or (kind.startswith("S") and kind[1:].isdigit())):
            raise ValueError(f"{where}: {kind}: not an item kind; use D, S<K> (e.g. S16), E or L")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"{where}: {kind}: must be a positive number of seconds, got {seconds!r}")
    return {kind: float(seconds) for kind, seconds in data.items()}


def calibrate(items: list[Item], measured: dict[str, float]) -> list[Item]:
    """Replace the proxy time of every kind in ``measured``; scale the other kinds by the median
    measured/proxy ratio, so that all times stay in one unit."""
    proxy = {item.kind: item.time_s for item in items}
    ratios = [measured[kind] / proxy[kind] for kind in measured if kind in proxy]
    if not ratios:
        raise ValueError(f"calibration: none of its kinds ({', '.join(measured)}) occurs in the model "
                         f"(kinds: {', '.join(sorted(proxy))})")
    scale = statistics.median(ratios)
    return [Item(i.kind, i.flops, i.bytes_moved, i.params, i.activation_bytes,
                 measured.get(i.kind, i.time_s * scale)) for i in items]


def model_items(model: ModelDescription, seq_len: int, micro_batch_size: int = 1,
                hardware: Hardware = DEFAULT_HARDWARE, calibration: Optional[str | Path] = None) -> list[Item]:
    items = layer_items(model, seq_len, micro_batch_size, hardware)
    return items if calibration is None else calibrate(items, read_calibration(calibration))
