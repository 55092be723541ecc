"""A run's identity: what defines its model and its data contract, recorded with every checkpoint and
compared on every load (``--load``, ``xmod export-hf``, ``xmod import-hf --save``).

The identity is a flat ``{field: value}`` computed from megatron's parsed arguments (:func:`identity_of`):
the layout, routing family and K of every layer, the widths and heads, the vocabulary (the flag and
megatron's padded embedding rows), the tokenizer's type and the sha256 of its file(s), the routing
settings and the MoE settings. At each save it is written as ``xmod_run_identity.json`` inside the
iteration folder (atomically, before the checksum manifest, which therefore covers it). A checkpoint
without the record (saved before megatron_xmod wrote one, or with ``--async-save``) is judged by the
megatron arguments it holds; the tokenizer's file hash is then unknown and not compared.

Fields not in the identity may change on a resume (docs/first_run.md): learning rate and schedule
(with ``--override-opt_param-scheduler``), iterations, data path and split, batch sizes, parallel
layout (TP/PP/DP/EP: ``torch_dist`` reshards), sequence length, intervals, output folders, the routing
hyperparameters that steer training (tau, the router BCE coefficient, the evaluation rule). A field in
the identity changes only with ``--xmod-allow-model-change FIELD`` (repeatable or comma-separated).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

RECORD = "xmod_run_identity.json"
RECORD_VERSION = 1

# megatron / plugin argument names recorded as they are, grouped as the messages name them.
_SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
          "swiglu", "normalization", "qk_layernorm", "add_bias_linear", "position_embedding_type",
          "untie_embeddings_and_output_weights")
_VOCABULARY = ("vocab_size", "tokenizer_type")
# Routing hyperparameters that only steer training (--xmod-token-choice-bias-tau, --xmod-router-bce-coeff,
# --xmod-eval-routing) may change on resume (docs/first_run.md); the family, layout and K are above.
_ROUTING = ("xmod_gate_scale_learnable",)
_MOE = ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk",
        "moe_layer_freq", "moe_router_type", "moe_router_score_function", "moe_router_enable_expert_bias",
        "dtopp_target_experts", "dtopp_layer_targets", "dtopp_routing_norm")
# Computed fields: the layout's notation, the routing family, K of every layer, the tokenizer's hash.
DERIVED = ("layout", "family", "sparsity_k", "tokenizer_vocab_size", "tokenizer_sha256")
FIELDS = DERIVED[:3] + _SHAPE + _VOCABULARY + DERIVED[3:] + _ROUTING + _MOE
# Files a HuggingFace tokenizer folder is read from (hashed when present).
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                       "special_tokens_map.json", "vocab.txt")


class IdentityError(ValueError):
    """A checkpoint of another model or data contract than the run that loads, exports or overwrites it."""


# ----------------------------------------------------------------------------- what the identity is
def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def layout_fields(args) -> dict:
    """layout (notation), family and K per layer (comma-separated, 1 = a dense or anchor layer)."""
    from megatron_xmod.xmod.layout import resolve_layout

    family = getattr(args, "xmod_routing_family", "dense") or "dense"
    out = {"family": family}
    try:
        activated = getattr(args, "xmod_activated_depth", None)
        layout = resolve_layout(family, num_layers=getattr(args, "num_layers", None),
                                sparsity_k=getattr(args, "xmod_sparsity_k", None),
                                anchor_stride=getattr(args, "xmod_anchor_stride", None),
                                dense_prefix=getattr(args, "xmod_dense_prefix", None),
                                layout=getattr(args, "xmod_layout", None),
                                activated_depth=activated if activated is not None or family != "dense"
                                else getattr(args, "num_layers", None))
    except (ValueError, TypeError):  # hand-made or foreign arguments: the notation as given
        out["layout"] = getattr(args, "xmod_layout", None)
        return out
    out["layout"] = layout.notation
    out["sparsity_k"] = ",".join(str(layer.sparsity_k) for layer in layout.layers)
    return out


def tokenizer_sha256(args, tokenizer_model=None) -> Optional[str]:
    """sha256 of the tokenizer's file(s) (``--tokenizer-model`` file or folder, ``--vocab-file``,
    ``--merge-file``; ``tokenizer_model`` replaces the first); None when the run reads none."""
    paths = [("tokenizer_model", tokenizer_model or getattr(args, "tokenizer_model", None)),
             ("vocab_file", getattr(args, "vocab_file", None)), ("merge_file", getattr(args, "merge_file", None))]
    digest, found = hashlib.sha256(), False
    for role, path in paths:
        if not path:
            continue
        path = str(path)
        files = ([os.path.join(path, name) for name in _HF_TOKENIZER_FILES] if os.path.isdir(path) else [path])
        for file in files:
            if os.path.isfile(file):
                digest.update(f"{role}:{os.path.basename(file)}:{_file_sha256(file)}\n".encode())
                found = True
    return digest.hexdigest() if found else None


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def built_vocabulary() -> Optional[int]:
    """The vocabulary of megatron's built tokenizer in this process (a training run); None without one."""
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:
        return None


def identity_of(args, with_tokenizer_hash: bool = True, tokenizer_model=None,
                vocabulary: Optional[int] = None) -> dict:
    """The identity of the run ``args`` describe (fields the arguments lack are left out, not compared);
    ``vocabulary``: the built tokenizer's size, known in a training run only (megatron's padded embedding
    rows also depend on the TP size, which may change on resume)."""
    out = layout_fields(args)
    if vocabulary is not None:
        out["tokenizer_vocab_size"] = int(vocabulary)
    for name in _SHAPE + _VOCABULARY + _ROUTING + _MOE:
        if hasattr(args, name):
            out[name] = _plain(getattr(args, name))
    if with_tokenizer_hash:
        out["tokenizer_sha256"] = tokenizer_sha256(args, tokenizer_model)
    return {name: out[name] for name in FIELDS if name in out}


# ----------------------------------------------------------------------------- the record
def record_path(iteration_dir) -> str:
    return os.path.join(str(iteration_dir), RECORD)


def write_record(args, save_dir: str, iteration: int, release: bool = False, identity: Optional[dict] = None) -> None:
    """Rank 0 writes the record into the iteration folder megatron has just saved (atomically)."""
    from megatron_xmod.training.checkpoints import _rank_world, _write_atomically, iteration_dir_name

    directory = os.path.join(save_dir, iteration_dir_name(iteration, release))
    if _rank_world()[0] != 0 or not os.path.isdir(directory):
        return
    record = {"version": RECORD_VERSION, "identity": identity if identity is not None else
              identity_of(args, vocabulary=built_vocabulary())}
    _write_atomically(record_path(directory), json.dumps(record, indent=1) + "\n")


def saved_identity(iteration_dir, saved_args=None) -> tuple[Optional[dict], str]:
    """(identity, where it comes from) of a checkpoint: its record, else its saved megatron arguments
    (without the tokenizer hash); (None, "") when it has neither."""
    path = record_path(iteration_dir)
    if os.path.isfile(path):
        try:
            with open(path) as stream:
                record = json.load(stream)
            return dict(record["identity"]), path
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise IdentityError(f"load: {path} is not a readable run identity record ({error}); restore it from a copy "
                                "of the checkpoint, or delete it to judge the checkpoint by its saved arguments "
                                "alone") from error
    if saved_args is None:
        return None, ""
    return identity_of(saved_args, with_tokenizer_hash=False), "its saved megatron arguments"


# ----------------------------------------------------------------------------- comparing two
def differences(old: dict, new: dict, allowed=()) -> list[tuple[str, object, object]]:
    """(field, old, new) of every field both record and that differs, not in ``allowed``. A tokenizer
    hash that one side does not know is not compared."""
    out = []
    for name in FIELDS:
        if name in allowed or name not in old or name not in new:
            continue
        if name == "tokenizer_sha256" and (old[name] is None or new[name] is None):
            continue
        if _plain(old[name]) != _plain(new[name]):
            out.append((name, old[name], new[name]))
    return out


def describe(differ: list[tuple[str, object, object]]) -> str:
    """One line per field: ``  field: old -> new``."""
    def show(value):
        return value[:12] if isinstance(value, str) and len(value) == 64 else value  # a sha256: its start

    return "\n".join(f"  {name}: {show(old)} -> {show(new)}" for name, old, new in differ)


def allowed_changes(args) -> set[str]:
    """The fields ``--xmod-allow-model-change`` names (repeatable, comma-separated; ``--flag-name`` or
    ``flag_name``); an unknown one is an error listing the known."""
    out = set()
    for item in getattr(args, "xmod_allow_model_change", None) or []:
        for name in str(item).split(","):
            name = name.strip().lstrip("-").replace("-", "_")
            if not name:
                continue
            if name not in FIELDS:
                raise IdentityError(f"xmod_allow_model_change: {name!r} is not a field of a run's identity; the fields "
                                    f"are {', '.join(FIELDS)} (everything else may change on resume: docs/first_run.md)")
            out.add(name)
    return out


def check_load(args, iteration_dir: str, saved_args=None) -> None:
    """Refuse to resume ``iteration_dir`` (``--load``) with a run of another identity, one line per
    differing field, before megatron builds the model or reads the state dict."""
    old, source = saved_identity(iteration_dir, saved_args)
    if old is None:
        return
    differ = differences(old, identity_of(args, vocabulary=built_vocabulary()), allowed_changes(args))
    if not differ:
        return
    names = ",".join(name for name, _, _ in differ)
    raise IdentityError(
        f"load: --load {os.path.dirname(os.path.abspath(iteration_dir))} holds a checkpoint of another model or data "
        f"contract ({os.path.basename(iteration_dir)}, as {source} say{'s' if source.endswith('.json') else ''}); "
        f"old -> new:\n{describe(differ)}\n"
        "Resume it with its own flags, or give this model its own --load/--save folder (slurm launchers: one folder "
        "per MODEL, BACKBONE and SEQ by default, or CKPT=...); if the change is intended, pass "
        f"--xmod-allow-model-change {names} (a changed shape still fails megatron's load)")


def check_export(iteration_dir, saved_args, tokenizer_model=None) -> None:
    """``xmod export-hf``: the checkpoint's record and the model its saved arguments build agree, and the
    tokenizer file the export reads is the one the run trained with."""
    old, source = saved_identity(iteration_dir, saved_args)
    if old is None or not source.endswith(".json"):
        return
    new = identity_of(saved_args, tokenizer_model=tokenizer_model)
    differ = differences(old, new)
    if not differ:
        return
    tokenizer = [name for name, _, _ in differ if name == "tokenizer_sha256"]
    fix = ("the tokenizer file(s) changed since the run saved this checkpoint: pass --tokenizer-model PATH to the "
           "file the run trained with, or --hf-tokenizer PATH for a tokenizer of your own" if tokenizer else
           "the checkpoint's saved arguments and its identity record disagree (files copied between checkpoints?); "
           "export another iteration, or restore this one from a copy")
    raise IdentityError(f"load: {iteration_dir} would not export the model it recorded ({source}); recorded -> "
                        f"export:\n{describe(differ)}\n{fix}")
