"""Checks of a parsed command line that fail before any model is built or any node waits: the routed
config, the sequence length against K, the data paths and the split. The entry point and the
launchers' dry run (:mod:`megatron_xmod.training.dry_run`) both run :func:`validate_before_training`."""
from __future__ import annotations

import os
from typing import Optional

from megatron_xmod.training.providers import config_from_args


def validate_before_training(args) -> None:
    """Fail before any training starts: the routed config, sequence length, data paths."""
    config = config_from_args(args)  # raises with the field name
    ks = {layer.sparsity_k for layer in config.layer_layout.layers if layer.is_sparse}
    if ks and args.reset_attention_mask:
        raise ValueError("reset_attention_mask: routed layers attend causally over the routed subsequence and do "
                         "not apply per-document masks; train without --reset-attention-mask")
    for k in ks:
        if args.seq_length % k:
            raise ValueError(f"seq_length: {args.seq_length} is not divisible by sparsity K={k} (top-k routes exactly L/K tokens)")
    if not args.mock_data:
        paths = [p for p in (args.data_path or []) + (args.train_data_path or []) if not _is_number(p)]
        held_out = [p for p in (args.valid_data_path or []) + (args.test_data_path or []) if not _is_number(p)]
        if not paths and not args.per_split_data_args_path and not args.data_args_path:
            raise ValueError("data_path: no training data given (--data-path PREFIX or --train-data-path PREFIX)")
        for prefix in paths + held_out:
            if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
                raise FileNotFoundError(f"data_path: no Megatron dataset at {prefix!r} (expected .bin and .idx; "
                                        "make one with `xmod preprocess`)")
        check_split(args)


_SPLIT_NAMES = ("train", "validation", "test")


def split_document_ranges(split: str, num_documents: int) -> list[Optional[tuple[int, int]]]:
    """The documents ``[begin, end)`` of each split of a ``--split`` string over ``num_documents``
    documents, by megatron's own arithmetic (``parse_and_normalize_split``,
    ``convert_split_vector_to_split_matrix`` and the rounding of ``_build_megatron_dataset_splits``);
    None for a split of weight 0."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if bookends is None else (int(round(bookends[0] * float(num_documents))),
                                           int(round(bookends[1] * float(num_documents))))
            for bookends in matrix]


def working_split(split: str, num_documents: int) -> Optional[str]:
    """A ``--split`` in document counts that keeps ``split``'s non-zero splits and gives each at least
    one document (checked with megatron's arithmetic); None when there are too few documents."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    weights = parse_and_normalize_split(split)
    nonzero = [i for i, w in enumerate(weights) if w > 0]
    if num_documents < len(nonzero):
        return None
    counts = [max(1, int(w * num_documents)) if w > 0 else 0 for w in weights]
    first = nonzero[0]
    counts[first] = num_documents - sum(c for i, c in enumerate(counts) if i != first)
    if counts[first] < 1:
        return None
    candidate = ",".join(str(c) for c in counts)
    ranges = split_document_ranges(candidate, num_documents)
    if all(r is None or r[1] > r[0] for r in ranges):
        return candidate
    return None


def check_split(args) -> None:
    """An empty non-zero split of ``--data-path`` makes megatron's dataset building loop forever;
    fail now, naming the split and a ``--split`` that works."""
    if not args.data_path or args.split is None:
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    needed = [bool(args.train_iters or args.train_samples), args.eval_iters > 0, args.eval_iters > 0]
    for prefix in [p for p in args.data_path if not _is_number(p)]:
        num_documents = IndexedDataset(prefix, mmap=True).document_indices.shape[0] - 1
        for name, used, bounds in zip(_SPLIT_NAMES, needed, split_document_ranges(args.split, num_documents)):
            if used and bounds is not None and bounds[1] <= bounds[0]:
                fix = working_split(args.split, num_documents)
                fix = (f"use --split {fix} (document counts), or give the held-out data as --train-data-path / "
                       "--valid-data-path / --test-data-path" if fix else
                       "give the held-out data as --train-data-path / --valid-data-path / --test-data-path, or "
                       "preprocess the corpus into more documents")
                raise ValueError(f"split: --split {args.split} leaves the {name} split of {prefix!r} empty "
                                 f"({num_documents} documents; megatron would wait forever building it); {fix}")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
