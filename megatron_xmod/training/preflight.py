"""Checks of a parsed command line that fail before any model is built or any node waits: the routed
config, the sequence length against K, the data (``.idx``/``.bin`` consistency, documents per split,
token ids against the vocabulary), the tokenizer files, the output directories and the ``--load``
tracker. The entry point and the launchers' dry run (:mod:`megatron_xmod.training.dry_run`) both run
:func:`validate_before_training`; :func:`check_before_megatron_setup` runs earlier, before megatron
builds the tokenizer and the tensorboard writer (patch 19 of :mod:`megatron_xmod.training.patches`).

Every error is a ``ValueError`` / ``FileNotFoundError`` of the form ``flag: what is wrong; what to
do``; the entry point turns it into exit code 2. docs/reliability.md lists the checks.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_xmod.data.splits import split_document_ranges, working_split
from megatron_xmod.training.providers import config_from_args

_SPLIT_NAMES = ("train", "validation", "test")
# megatron/core/datasets/indexed_dataset.py: header, version, dtype code, sequence and document counts
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_SCAN_TOKENS = 1 << 26  # tokens per chunk of the vocabulary scan (bounded memory)
# Tokenizers that megatron/HF may try to fetch from a model hub when a file is missing.
_HUB_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def validate_before_training(args, vocab_size: Optional[int] = None) -> None:
    """Fail before any training starts: the routed config, sequence length, data, outputs, --load.

    ``vocab_size``: the tokenizer's vocabulary (default: megatron's built tokenizer)."""
    config = config_from_args(args)  # raises with the field name
    ks = {layer.sparsity_k for layer in config.layer_layout.layers if layer.is_sparse}
    if ks and args.reset_attention_mask:
        raise ValueError("reset_attention_mask: routed layers attend causally over the routed subsequence and do "
                         "not apply per-document masks; train without --reset-attention-mask")
    for k in ks:
        if args.seq_length % k:
            raise ValueError(f"seq_length: {args.seq_length} is not divisible by sparsity K={k} (top-k routes exactly L/K tokens)")
    check_outputs(args)
    check_load(args)
    if not args.mock_data:
        check_data(args, vocab_size if vocab_size is not None else _tokenizer_vocab_size(args))


def check_before_megatron_setup(args) -> None:
    """What must hold before megatron builds the tokenizer and the log writers (patch 19)."""
    for name in _HUB_VARIABLES:  # tokenizer files are local: never wait on a model hub
        os.environ.setdefault(name, "1")
    hub = sys.modules.get("huggingface_hub.constants")  # reads the variable once, at import
    if hub is not None and os.environ["HF_HUB_OFFLINE"] == "1":
        hub.HF_HUB_OFFLINE = True
    check_tokenizer(args)
    check_outputs(args)


# ----------------------------------------------------------------------------- data
@dataclass(frozen=True)
class IndexedData:
    """What the ``.idx`` of a megatron dataset says, checked against its ``.bin``."""

    prefix: str
    dtype: type
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def num_documents(self) -> int:
        return self.document_indices.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.astype(np.int64).sum())


def read_indexed_dataset(prefix: str) -> IndexedData:
    """Read ``prefix.idx`` as megatron does (indexed_dataset.py ``_IndexReader``) and check it against
    ``prefix.bin``: header, dtype, the table sizes, the pointers, the document boundaries, the size of
    the ``.bin``. Raises naming the file that is wrong."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.exists(path):
            raise FileNotFoundError(f"data_path: {path} does not exist (a Megatron dataset is PREFIX.bin + PREFIX.idx; "
                                    "make one with `xmod preprocess`)")
    fix = "re-run `xmod preprocess` (or megatron's preprocess_data.py) for this prefix"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as stream:
        head = stream.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != _INDEX_HEADER:
        raise ValueError(f"data_path: {idx} is not a Megatron index (bad header, {idx_size} bytes; a .bin given as "
                         f".idx, or a truncated file); {fix}")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in _DTYPES:
        raise ValueError(f"data_path: {idx} has index version {version} / dtype code {code}; megatron reads version 1 "
                         f"with dtype codes {sorted(_DTYPES)}; {fix}")
    table = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if idx_size not in (table, table + sequences):  # + one int8 mode per sequence for multimodal data
        raise ValueError(f"data_path: {idx} is {idx_size} bytes but its header announces {sequences} sequences and "
                         f"{documents - 1} documents ({table} bytes): truncated or overwritten; {fix}")
    raw = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(raw, dtype=np.int32, count=sequences, offset=_HEADER_BYTES)
    pointers = np.frombuffer(raw, dtype=np.int64, count=sequences, offset=_HEADER_BYTES + 4 * sequences)
    doc_index = np.frombuffer(raw, dtype=np.int64, count=documents, offset=_HEADER_BYTES + 12 * sequences)
    dtype = _DTYPES[code]
    itemsize = np.dtype(dtype).itemsize
    if documents < 1 or doc_index[0] != 0 or doc_index[-1] != sequences or np.any(np.diff(doc_index) < 0):
        raise ValueError(f"data_path: {idx}: the document boundaries do not cover its {sequences} sequences; {fix}")
    if sequences and (lengths.min() < 0 or pointers[0] != 0
                      or np.any(pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * itemsize)):
        raise ValueError(f"data_path: {idx}: sequence pointers and lengths disagree; {fix}")
    expected = int(lengths.astype(np.int64).sum()) * itemsize
    if bin_size != expected:
        what = ("empty" if bin_size == 0 else "truncated" if bin_size < expected else
                "larger than its index says (a .bin of another dataset, or files swapped?)")
        raise ValueError(f"data_path: {bin_} is {bin_size} bytes, {what}; {idx} describes {expected} bytes "
                         f"({expected // itemsize} tokens of {np.dtype(dtype).name}); {fix}")
    if documents - 1 < 1 or expected == 0:
        raise ValueError(f"data_path: {prefix!r} holds no tokens ({documents - 1} documents); preprocess a non-empty "
                         "corpus")
    return IndexedData(prefix, dtype, lengths, pointers, doc_index)


def first_token_at_or_above(data: IndexedData, limit: int) -> Optional[tuple[int, int, int]]:
    """(document, position in the document, token id) of the first token id >= ``limit`` in the
    ``.bin``, scanned memory-mapped in chunks; None when every id is below ``limit``."""
    if np.issubdtype(data.dtype, np.integer) and np.iinfo(data.dtype).max < limit:
        return None  # the dtype cannot hold an id that large
    tokens = np.memmap(data.prefix + ".bin", mode="r", dtype=data.dtype)
    for start in range(0, tokens.shape[0], _SCAN_TOKENS):
        chunk = tokens[start : start + _SCAN_TOKENS]
        if chunk.max() >= limit:
            offset = start + int(np.argmax(chunk >= limit))
            item = np.dtype(data.dtype).itemsize
            sequence = int(np.searchsorted(data.sequence_pointers // item, offset, side="right")) - 1
            document = int(np.searchsorted(data.document_indices, sequence, side="right")) - 1
            doc_start = int(data.sequence_pointers[data.document_indices[document]] // item)
            return document, offset - doc_start, int(tokens[offset])
    return None


def data_prefixes(args) -> dict[str, list[str]]:
    """{"blend" | "train" | "valid" | "test": prefixes} of the run (weights dropped)."""
    def strip(values):
        return [v for v in (values or []) if not _is_number(v)]

    out = {"blend": strip(args.data_path), "train": strip(args.train_data_path),
           "valid": strip(args.valid_data_path), "test": strip(args.test_data_path)}
    if getattr(args, "data_args_path", None):
        with open(args.data_args_path) as stream:
            out["blend"] += strip(stream.read().split())
    if getattr(args, "per_split_data_args_path", None):
        with open(args.per_split_data_args_path) as stream:
            per_split = json.load(stream)
        for split in ("train", "valid", "test"):
            out[split] += strip(per_split.get(split))
    return out


def check_data(args, vocab_size: Optional[int]) -> None:
    """Every prefix consistent, every needed split non-empty, every token id below ``vocab_size``."""
    prefixes = data_prefixes(args)
    if not prefixes["blend"] and not prefixes["train"]:
        raise ValueError("data_path: no training data given (--data-path PREFIX or --train-data-path PREFIX)")
    validating = args.eval_iters > 0 and not getattr(args, "skip_train", False) or getattr(args, "full_validation", False)
    if prefixes["train"] and not prefixes["blend"] and validating and not prefixes["valid"]:
        raise ValueError(f"valid_data_path: --train-data-path without --valid-data-path but --eval-iters "
                         f"{args.eval_iters} asks for validation (megatron would crash in forward_step at the first "
                         "one); give --valid-data-path PREFIX or pass --eval-iters 0")
    scan = int(os.environ.get("LOCAL_RANK", "0")) == 0  # once per node: the files are the same for every rank
    for prefix in dict.fromkeys(p for group in prefixes.values() for p in group):
        data = read_indexed_dataset(prefix)
        if vocab_size is not None and scan:
            found = first_token_at_or_above(data, vocab_size)
            if found is not None:
                document, position, token = found
                raise ValueError(
                    f"data_path: {prefix}.bin, document {document} (token {position}): token id {token} is not below "
                    f"the vocabulary size {vocab_size} (--tokenizer-type {args.tokenizer_type}); the data was "
                    "tokenized with another tokenizer: preprocess it with the tokenizer you train with, or pass the "
                    "matching --vocab-size / tokenizer files")
    if prefixes["blend"]:
        check_split(args)


def check_split(args) -> None:
    """An empty non-zero split of ``--data-path`` makes megatron's dataset building loop forever, and
    a validation split of weight 0 with ``--eval-iters`` > 0 crashes megatron's first validation
    (it builds no loader yet sets ``do_valid``): fail now, naming the split and a ``--split`` that works."""
    if not args.data_path or args.split is None:
        return
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    needed = [bool(args.train_iters or args.train_samples), args.eval_iters > 0, args.eval_iters > 0]
    weights = parse_and_normalize_split(args.split)
    if needed[1] and weights[1] == 0 and not (getattr(args, "valid_data_path", None)
                                              or getattr(args, "per_split_data_args_path", None)):
        raise ValueError(f"split: --split {args.split} gives the validation split no data but --eval-iters "
                         f"{args.eval_iters} asks for validation (megatron 0.19 would train, then crash in forward_step "
                         "at its first validation); pass --eval-iters 0 to train without validation, or give the "
                         "validation split a weight (e.g. --split 98,1,1)")
    for prefix in [p for p in args.data_path if not _is_number(p)]:
        num_documents = read_indexed_dataset(prefix).num_documents
        for name, used, bounds in zip(_SPLIT_NAMES, needed, split_document_ranges(args.split, num_documents)):
            if used and bounds is not None and bounds[1] <= bounds[0]:
                fix = working_split(args.split, num_documents)
                fix = (f"use --split {fix} (document counts), or give the held-out data as --train-data-path / "
                       "--valid-data-path / --test-data-path" if fix else
                       "give the held-out data as --train-data-path / --valid-data-path / --test-data-path, or "
                       "preprocess the corpus into more documents")
                raise ValueError(f"split: --split {args.split} leaves the {name} split of {prefix!r} empty "
                                 f"({num_documents} documents; megatron would wait forever building it); {fix}")


def _tokenizer_vocab_size(args) -> Optional[int]:
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # no tokenizer built (a test's hand-made args): no scan
        return None


# ----------------------------------------------------------------------------- tokenizer
_NEEDS_VOCAB = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer")
_NEEDS_MODEL = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "SFTTokenizer")


def check_tokenizer(args) -> None:
    """The tokenizer's files exist and parse, before megatron builds it (and before a missing file
    sends a library to a model hub)."""
    kind = args.tokenizer_type
    if kind == "NullTokenizer" and not args.vocab_size:
        raise ValueError("vocab_size: --tokenizer-type NullTokenizer needs --vocab-size N (the token ids are the data's)")
    if kind in _NEEDS_VOCAB:
        _need_file("vocab_file", args.vocab_file, f"--tokenizer-type {kind} reads its vocabulary from --vocab-file")
        if kind == "GPT2BPETokenizer":
            _need_file("merge_file", args.merge_file, "--tokenizer-type GPT2BPETokenizer reads its BPE merges from --merge-file")
            _parse("vocab_file", args.vocab_file, lambda text: isinstance(json.loads(text), dict), "a JSON object")
            _parse("merge_file", args.merge_file,
                   lambda text: all(len(line.split()) == 2 for line in text.splitlines()[1:] if line.strip()),
                   "a '#version' line then one merge pair per line")
    elif kind in _NEEDS_MODEL:
        _need_file("tokenizer_model", args.tokenizer_model, f"--tokenizer-type {kind} reads --tokenizer-model")
        if kind in _NEEDS_MODEL[:3]:
            _check_sentencepiece(args.tokenizer_model)
    elif kind == "HuggingFaceTokenizer":
        _check_hf_tokenizer(args)


def _need_file(flag: str, path: Optional[str], why: str) -> None:
    option = "--" + flag.replace("_", "-")
    if not path:
        raise ValueError(f"{flag}: {why}; pass {option} PATH (GPT-2 BPE files: see docs/first_run.md)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: {option} {path} does not exist or is not a file; pass the path of the file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag}: {option} {path} is not readable; fix its permissions")


def _parse(flag: str, path: str, ok, what: str) -> None:
    option = "--" + flag.replace("_", "-")
    try:
        with open(path, encoding="utf-8") as stream:
            good = ok(stream.read())
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{flag}: {option} {path} does not parse as {what} ({error}); pass the right file") from error
    if not good:
        raise ValueError(f"{flag}: {option} {path} is not {what}; pass the right file")


def _check_sentencepiece(path: str) -> None:
    try:
        import sentencepiece
    except ImportError:
        return  # megatron will say it needs the package
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(path)
    except (OSError, RuntimeError) as error:
        raise ValueError(f"tokenizer_model: --tokenizer-model {path} is not a SentencePiece model ({error}); pass the "
                         ".model file that spm_train (or `xmod preprocess`) wrote") from error


def _check_hf_tokenizer(args) -> None:
    name = args.tokenizer_model
    if not name:
        raise ValueError("tokenizer_model: --tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local "
                         "directory with tokenizer files, or a model name already in the HF cache)")
    if os.path.isdir(name):
        return
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return
    cached = any(isinstance(try_to_load_from_cache(name, file), str)
                 for file in ("tokenizer_config.json", "tokenizer.json", "vocab.json"))
    if not cached:
        raise ValueError(f"tokenizer_model: --tokenizer-model {name} is neither a local directory nor in the HF cache, "
                         "and training never downloads (HF_HUB_OFFLINE=1); download it beforehand "
                         f"(`huggingface-cli download {name}`) or pass a local directory")


# ----------------------------------------------------------------------------- outputs, --load
def check_outputs(args) -> None:
    """--save, --tensorboard-dir (and the other directories megatron writes to) writable now, not at
    the first save after hours of training."""
    for flag in ("save", "tensorboard_dir", "wandb_save_dir", "data_cache_path"):
        path = getattr(args, flag, None)
        if path:
            _check_writable(flag, path)


def _check_writable(flag: str, path: str) -> None:
    option = "--" + flag.replace("_", "-")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}: {option} {path} is a file, not a directory; pass a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    where = "it" if existing == os.path.abspath(path) else f"its parent {existing}"
    if not os.path.isdir(existing):
        raise ValueError(f"{flag}: {option} {path} cannot be created ({where} is a file); pass a directory path")
    try:  # a real write (os.access says yes to root on read-only mounts and root-squashed NFS)
        with tempfile.TemporaryFile(dir=existing, prefix=".xmod_write_check_"):
            pass
    except OSError as error:
        raise ValueError(f"{flag}: {option} {path} is not writable ({where}: {error.strerror}); pass a directory you "
                         "can write, or fix the permissions") from error


def check_load(args) -> None:
    """A --load directory with iter_* checkpoints needs a readable tracker (or --ckpt-step)."""
    if not getattr(args, "load", None) or getattr(args, "ckpt_step", None):
        return
    from megatron_xmod.training.checkpoints import read_tracker

    tracked = read_tracker(args.load)
    if tracked is not None and not tracked[1]:
        from megatron_xmod.training.checkpoints import iteration_dir_name

        directory = os.path.join(args.load, iteration_dir_name(tracked[0]))
        if not os.path.isdir(directory):
            raise ValueError(f"load: {args.load}/latest_checkpointed_iteration.txt names iteration {tracked[0]} but "
                             f"{directory} does not exist; write the iteration of a checkpoint that exists into it")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
