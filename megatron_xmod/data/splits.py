"""``--split`` in documents: which documents megatron gives each split, and a split every split can be fed from.

Used before training (:mod:`megatron_xmod.training.preflight`) and by ``xmod preprocess``, which prints
the flags of a dataset it just wrote."""
from __future__ import annotations

from typing import Optional


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
