"""Checks of a parsed command line that fail before any model is built or any node waits: the routed
config, the sequence length against K, the data (``.idx``/``.bin`` consistency, the tokenizer that
wrote it where ``xmod preprocess`` recorded one, documents per split, token ids against the
vocabulary), the tokenizer files, the output directories, the ``--load`` tracker and the checkpoint it
names (the same run identity; the same learning-rate schedule unless a flag says which wins). The entry
point and the launchers' dry run (:mod:`megatron_xmod.training.dry_run`) both run
:func:`validate_before_training`; :func:`check_before_megatron_setup` runs earlier, before megatron
builds the tokenizer and the tensorboard writer (patch 19 of :mod:`megatron_xmod.training.patches`).
The dry run also runs :func:`check_batch_layout` before megatron's validation.

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
from megatron_xmod.data.tokenizer_record import RECORD_SUFFIX, mismatch, read_record, run_tokenizer, stale
from megatron_xmod.training.providers import config_from_args
from megatron_xmod.xmod.routing import topk_count

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
    check_document_masks(args, routed=bool(ks))
    check_context_parallel(args)
    check_optimizer(args)
    segments = getattr(args, "xmod_routing_segments", 1) or 1
    for k in sorted(ks):
        topk_count(args.seq_length, k, segments)  # seq_length: L must split into S x K (top-k routes L/K exactly)
    check_outputs(args)
    check_blend(args)
    check_resume_point(args)
    check_load(args)
    if not args.mock_data:
        built = _built_tokenizer()
        if vocab_size is None and built is not None:
            vocab_size = int(built.vocab_size)
        check_data(args, vocab_size, built_tokenizer=built)


def check_document_masks(args, routed: bool) -> None:
    """Per-document attention (docs/routing.md, 'Document masks'): --reset-attention-mask needs the
    dataloader's mask, and routed layers apply it with the SDPA core attention only; packed sequences
    (--dataloader-inter-document-masking: THD with cu_seqlens) likewise, and not under context or
    pipeline parallelism."""
    if getattr(args, "dataloader_inter_document_masking", False):
        local = args.transformer_impl == "local"
        if routed and not local:
            raise ValueError(f"dataloader_inter_document_masking: routed layers keep their routed tokens inside their "
                             f"documents with the SDPA core attention of --transformer-impl local only "
                             f"(--transformer-impl {args.transformer_impl}); train with --transformer-impl local")
        if args.context_parallel_size > 1 and (routed or local):
            raise ValueError("dataloader_inter_document_masking: packed sequences under context parallelism need "
                             "TransformerEngine attention and a dense model; use --reset-attention-mask (document "
                             "masks work under CP) or --context-parallel-size 1")
        if args.pipeline_model_parallel_size > 1:
            raise ValueError("dataloader_inter_document_masking: packed sequences (one [mbs x L, 1, h] row a "
                             "micro-batch) are not passed between pipeline stages by this entry point; use "
                             "--reset-attention-mask (document masks work with PP) or --pipeline-model-parallel-size 1")
    if not args.reset_attention_mask:
        return
    if not args.create_attention_mask_in_dataloader:
        raise ValueError("reset_attention_mask: --reset-attention-mask builds its per-document mask in the dataloader, "
                         "but --no-create-attention-mask-in-dataloader switches that off (megatron would train with a "
                         "plain causal mask, silently); drop --no-create-attention-mask-in-dataloader (--xmod-cpu "
                         "leaves it out when --reset-attention-mask is given)")
    if routed and args.transformer_impl != "local":
        raise ValueError(f"reset_attention_mask: routed layers apply the document mask with the SDPA core attention "
                         f"of --transformer-impl local only (--transformer-impl {args.transformer_impl}'s causal "
                         "attention ignores an explicit mask); train with --transformer-impl local, or without "
                         "--reset-attention-mask")


def check_context_parallel(args) -> None:
    """Context parallelism splits every sequence into 2 x CP chunks (megatron's load-balanced layout) and,
    with sequence parallelism, a CP rank's rows over the TP ranks; megatron finds an uneven split only
    in its first forward pass (a view error)."""
    cp = args.context_parallel_size
    if cp <= 1:
        return
    unit = 2 * cp * (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    if args.seq_length % unit:
        what = f"2 x CP {cp}" + (f" x TP {args.tensor_model_parallel_size} (sequence parallelism)"
                                  if args.sequence_parallel else "")
        raise ValueError(f"seq_length: context parallelism splits a sequence into {what} = {unit} equal parts, "
                         f"{args.seq_length} tokens do not; use a multiple of {unit} (SEQ / --seq-length)")


def check_optimizer(args) -> None:
    """megatron-core 0.19 turns Muon with --use-distributed-optimizer into its layer-wise distributed optimizer
    (args.use_layer_wise_distributed_optimizer), whose set-up works in bf16 only: in fp32 it stops once the model
    is built (an AssertionError without a message in ChainedOptimizer, or, with
    --no-use-layer-wise-param-layout, 'TensorParallelMuon' object has no attribute 'get_loss_scale')."""
    if getattr(args, "use_layer_wise_distributed_optimizer", False) and not args.bf16:
        raise ValueError(f"use_distributed_optimizer: megatron's layer-wise distributed optimizer, which "
                         f"--optimizer {args.optimizer} with --use-distributed-optimizer becomes, sets up in bf16 only "
                         "(in fp32 it fails once the model is built); add --bf16, or drop --use-distributed-optimizer "
                         "(every data-parallel rank then keeps the optimizer's whole state)")


def check_before_megatron_setup(args) -> None:
    """What must hold before megatron builds the tokenizer and the log writers (patch 19)."""
    for name in _HUB_VARIABLES:  # tokenizer files are local: never wait on a model hub
        os.environ.setdefault(name, "1")
    hub = sys.modules.get("huggingface_hub.constants")  # reads the variable once, at import
    if hub is not None and os.environ["HF_HUB_OFFLINE"] == "1":
        hub.HF_HUB_OFFLINE = True
    check_tokenizer(args)
    check_outputs(args)


# ----------------------------------------------------------------------------- world size and batch
def check_batch_layout(args, nodes: Optional[int] = None, gpus_per_node: Optional[int] = None) -> None:
    """The world size must hold whole model replicas (TP x PP x CP GPUs each) and the global batch must
    split evenly over the data-parallel replicas' micro-batches. megatron asserts both deep in its
    validation, naming ``eval_global_batch_size`` (which follows --global-batch-size) and suggesting
    nothing; this names what was set and node counts / batch sizes that work. Run on megatron's parsed,
    not yet validated, arguments. ``nodes`` / ``gpus_per_node``: the slurm launchers' NODES / NPROC,
    which then name the message's fields."""
    launcher = nodes is not None and gpus_per_node is not None
    world = nodes * gpus_per_node if launcher else int(args.world_size)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    replica = tp * pp * cp
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    eval_gbs = args.eval_global_batch_size if getattr(args, "eval_global_batch_size", None) else gbs
    eval_mbs = args.eval_micro_batch_size if getattr(args, "eval_micro_batch_size", None) else mbs
    if not (gbs and mbs and replica and world):
        return
    model = f"TP {tp} x PP {pp}" + (f" x CP {cp}" if cp > 1 else "")
    if launcher:
        gpus = f"NODES {nodes} x NPROC {gpus_per_node} = {world} GPUs"
    else:
        gpus = f"world size {world} (WORLD_SIZE, the launcher's processes)"

    def works(n_world: int) -> bool:
        if n_world % replica:
            return False
        dp = n_world // replica
        return gbs % (mbs * dp) == 0 and eval_gbs % (eval_mbs * dp) == 0

    unit = gpus_per_node if launcher else 1
    current = world // unit
    counts = [n for n in range(1, 2 * max(current, 4) + 1) if works(n * unit)]  # up to twice as many
    below = [n for n in counts if n < current][-1:]
    above = [n for n in counts if n > current][:2]
    suggestions = below + above
    where = ("NODES=" if launcher else "a world size of ") + _either([str(n) for n in suggestions])
    if world % replica:
        field = "NODES" if launcher else "world_size"
        fix = f"use {where}" if suggestions else f"use a multiple of {replica} GPUs"
        raise ValueError(f"{field}: {gpus} do not split into model replicas of {model} = {replica} GPUs each "
                         f"(megatron: 'world size ({world}) is not divisible by total_model_size'); {fix}, or change "
                         + ("TP / PP" if launcher else "--tensor-model-parallel-size / --pipeline-model-parallel-size"))
    dp = world // replica
    for batch, micro, batch_name, micro_name in ((gbs, mbs, "GBS" if launcher else "global_batch_size",
                                                  "MBS" if launcher else "--micro-batch-size"),
                                                 (eval_gbs, eval_mbs, "eval_global_batch_size",
                                                  "--eval-micro-batch-size")):
        step = micro * dp
        if batch % step == 0:
            continue
        flag = {"GBS": "GBS=", "global_batch_size": "--global-batch-size "}.get(batch_name, "--eval-global-batch-size ")
        lower, upper = (batch // step) * step, (batch // step + 1) * step
        sizes = flag + _either([str(b) for b in (lower, upper) if b > 0])
        at = f"NODES={nodes}" if launcher else f"world size {world}"
        keep = f"{flag}{batch}"
        nodes_fix = f"use {where} (with {keep}), or " if suggestions else ""
        raise ValueError(
            f"{batch_name}: {keep} sequences per step do not split evenly over data-parallel {dp} x {micro_name} "
            f"{micro} (data-parallel {dp} = {gpus} / ({model})); every step needs a multiple of {micro_name} x "
            f"data-parallel = {step} sequences; {nodes_fix}{sizes} at {at}")


def _either(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


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


def check_data(args, vocab_size: Optional[int], built_tokenizer=None) -> None:
    """Every prefix consistent, written by the run's tokenizer where it records one (``PREFIX.tokenizer.json``
    of ``xmod preprocess``; ``built_tokenizer``: megatron's, for tokenizers known only by what they encode),
    every needed split non-empty, every token id below ``vocab_size``."""
    prefixes = data_prefixes(args)
    if not prefixes["blend"] and not prefixes["train"]:
        raise ValueError("data_path: no training data given (--data-path PREFIX or --train-data-path PREFIX)")
    validating = args.eval_iters > 0 and not getattr(args, "skip_train", False) or getattr(args, "full_validation", False)
    if prefixes["train"] and not prefixes["blend"] and validating and not prefixes["valid"]:
        raise ValueError(f"valid_data_path: --train-data-path without --valid-data-path but --eval-iters "
                         f"{args.eval_iters} asks for validation (megatron would crash in forward_step at the first "
                         "one); give --valid-data-path PREFIX or pass --eval-iters 0")
    scan = int(os.environ.get("LOCAL_RANK", "0")) == 0  # once per node: the files are the same for every rank
    run, unrecorded = None, []
    for prefix in dict.fromkeys(p for group in prefixes.values() for p in group):
        data = read_indexed_dataset(prefix)
        record = read_record(prefix)
        if record is None:
            unrecorded.append(prefix)
        else:
            run = run or run_tokenizer(args)
            problem = (stale(prefix, record, data.num_documents, data.num_tokens)
                       or mismatch(prefix, record, run, built_tokenizer))
            if problem:
                raise ValueError(problem)
        if vocab_size is not None and scan:
            found = first_token_at_or_above(data, vocab_size)
            if found is not None:
                document, position, token = found
                raise ValueError(
                    f"data_path: {prefix}.bin, document {document} (token {position}): token id {token} is not below "
                    f"the vocabulary size {vocab_size} (--tokenizer-type {args.tokenizer_type}); the data was "
                    "tokenized with another tokenizer: preprocess it with the tokenizer you train with, or pass the "
                    "matching --vocab-size / tokenizer files")
    if unrecorded and getattr(args, "rank", 0) == 0:
        print(f"[xmod] note: {', '.join(unrecorded)}: no tokenizer record (PREFIX{RECORD_SUFFIX}, which `xmod "
              f"preprocess` writes), so --tokenizer-type {getattr(args, 'tokenizer_type', None)} is not checked against the data",
              flush=True)
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


def _built_tokenizer():
    """megatron's built tokenizer; None when there is none (a test's hand-made args: no scan)."""
    try:
        from megatron.training import get_tokenizer

        return get_tokenizer()
    except Exception:
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
    """A --load directory with iter_* checkpoints needs a readable tracker (or --ckpt-step); the checkpoint
    it names must be of this run's model and, unless a flag says which wins, of its learning-rate schedule."""
    from megatron_xmod.training.run_identity import allowed_changes

    allowed_changes(args)  # an unknown --xmod-allow-model-change FIELD, with or without --load
    if not getattr(args, "load", None):
        return
    from megatron_xmod.training.checkpoints import iteration_dir_name, read_tracker

    if getattr(args, "ckpt_step", None):
        tracked = (int(args.ckpt_step), False)
    else:
        tracked = read_tracker(args.load)
        if tracked is not None and not tracked[1]:
            directory = os.path.join(args.load, iteration_dir_name(tracked[0]))
            if not os.path.isdir(directory):
                raise ValueError(f"load: {args.load}/latest_checkpointed_iteration.txt names iteration {tracked[0]} "
                                 f"but {directory} does not exist; write the iteration of a checkpoint that exists "
                                 "into it")
    if tracked is None or getattr(args, "use_checkpoint_args", False):
        return
    directory = os.path.join(args.load, iteration_dir_name(*tracked))
    saved = saved_common_state(directory)
    check_same_model(args, directory, (saved or {}).get("args"))  # the identity record, else the saved args
    if saved is None:
        return
    if not tracked[1] and not getattr(args, "finetune", False) and not getattr(args, "no_load_optim", False):
        check_schedule(args, directory, saved.get("opt_param_scheduler"))


def saved_common_state(directory: str) -> Optional[dict]:
    """The non-sharded part of a megatron checkpoint (its ``args``, ``iteration``, ``opt_param_scheduler``):
    ``torch_dist``'s common state (a few kB of the checkpoint), or the legacy ``torch`` format's rank-0 file,
    memory-mapped. None when it cannot be read (megatron's own load then says why)."""
    try:
        if os.path.isfile(os.path.join(directory, "metadata.json")):
            from megatron.core.dist_checkpointing.serialization import load_common_state_dict

            state = load_common_state_dict(directory)
        else:
            import torch

            files = [os.path.join(directory, name, "model_optim_rng.pt") for name in ("mp_rank_00", "mp_rank_00_000")]
            path = next((f for f in files if os.path.isfile(f)), None)
            if path is None:
                return None
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # unreadable, another format: not ours to judge
        return None
    return state if isinstance(state, dict) else None


def check_same_model(args, directory: str, saved_args) -> None:
    """A checkpoint of another model or data contract (a --load folder shared by two configurations, another
    tokenizer) would fail megatron's load after the model is built, or load silently: its run identity
    (:mod:`megatron_xmod.training.run_identity`) against this run's, one line per differing field."""
    from megatron_xmod.training.run_identity import check_load as check_identity

    check_identity(args, directory, saved_args)


# megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.load_state_dict: the values it compares
# (its own names), and the flags that set each.
_SCHEDULE_FIELDS = (
    ("max_lr", "learning rate", "--lr"),
    ("min_lr", "minimum learning rate", "--min-lr"),
    ("lr_warmup_steps", "warmup iterations", "--lr-warmup-iters / --lr-warmup-fraction x the decay, in samples"),
    ("lr_decay_steps", "total number of iterations", "--lr-decay-iters (default --train-iters) x --global-batch-size, "
                                                     "in samples"),
    ("lr_decay_style", "learning rate decay style", "--lr-decay-style"),
    ("start_wd", "start weight decay", "--start-weight-decay"),
    ("end_wd", "end weight decay", "--end-weight-decay"),
    ("wd_incr_steps", "total number of weight decay iterations", "--train-iters x --global-batch-size, in samples"),
    ("wd_incr_style", "weight decay incr style", "--weight-decay-incr-style"),
)


def run_schedule(args) -> Optional[dict]:
    """The values megatron's ``get_optimizer_param_scheduler`` (training.py) gives this run's scheduler."""
    if args.train_iters:
        decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        decay = decay_iters * args.global_batch_size
        wd_incr = args.train_iters * args.global_batch_size
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * args.global_batch_size)
    elif args.train_samples:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        wd_incr = args.train_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
    else:
        return None
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": args.lr_decay_style, "start_wd": args.start_weight_decay,
            "end_wd": args.end_weight_decay, "wd_incr_steps": wd_incr, "wd_incr_style": args.weight_decay_incr_style}


def check_schedule(args, directory: str, saved: Optional[dict]) -> None:
    """Resuming with another schedule (e.g. more --train-iters) without --override-opt_param-scheduler or
    --use-checkpoint-opt_param-scheduler stops megatron's load on a bare assertion; name the flags now."""
    if (not isinstance(saved, dict) or getattr(args, "override_opt_param_scheduler", False)
            or getattr(args, "use_checkpoint_opt_param_scheduler", False)):
        return
    try:
        ours = run_schedule(args)
    except (AttributeError, TypeError):  # hand-made or partial arguments
        return
    if ours is None:
        return
    aliases = {"max_lr": "start_lr", "lr_warmup_steps": "warmup_steps", "lr_decay_steps": "decay_steps",
               "lr_decay_style": "decay_style"}
    differ = []
    for key, megatron_name, flags in _SCHEDULE_FIELDS:
        if key not in saved and aliases.get(key) not in saved:
            continue  # an older checkpoint without it: megatron does not compare it either
        value = saved.get(key, saved.get(aliases.get(key)))
        if value != ours[key]:
            differ.append((key, megatron_name, flags, value, ours[key]))
    if not differ:
        return
    key, megatron_name, _, old, new = differ[0]
    changes = "; ".join(f"{key} {old} there, {new} here ({flags})" for key, _, flags, old, new in differ)
    raise ValueError(
        f"override_opt_param_scheduler: --load {os.path.dirname(directory)} resumes a checkpoint saved with another "
        f"learning-rate schedule than this command line's ({changes}), and megatron would stop at its load with "
        f"'OptimizerParamScheduler: class input value {new} and checkpoint value {old} for {megatron_name} do not "
        "match'; pass --override-opt_param-scheduler to continue on this command line's schedule (the usual choice "
        "when training longer; slurm launchers: EXTRA_ARGS=--override-opt_param-scheduler), or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


# ----------------------------------------------------------------------------- blend weights
def check_blend(args) -> None:
    """``--data-path`` (and the per-split paths) is either prefixes alone or ``W1 PREFIX1 W2 PREFIX2 ...``
    with every weight a positive number; megatron asserts deep in its dataset building (``path prefix 0.5``
    for a missing weight), after the model is built. Name the flag, the position and the fix now."""
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        values = list(getattr(args, flag, None) or [])
        option = "--" + flag.replace("_", "-")
        if len(values) < 2 or not any(_is_number(v) for v in values):
            continue  # prefixes alone (equal weights by size)
        given = " ".join(values)
        form = f"{option} W1 PREFIX1 W2 PREFIX2 ... (a positive weight before every prefix)"
        if len(values) % 2:
            raise ValueError(f"{flag}: {option} {given}: {len(values)} values, so a weight or a prefix is missing; "
                             f"write {form}, or give the prefixes alone")
        for position in range(0, len(values), 2):
            weight, prefix = values[position], values[position + 1]
            if not _is_number(weight):
                raise ValueError(f"{flag}: {option} {given}: {weight!r} (value {position + 1}) is not a weight; write "
                                 f"{form}")
            if _is_number(prefix):
                raise ValueError(f"{flag}: {option} {given}: {prefix!r} (value {position + 2}) is a number where a "
                                 f"prefix belongs; write {form}")
            number = float(weight)
            if not (number > 0 and np.isfinite(number)):
                raise ValueError(f"{flag}: {option} {given}: the weight {weight} of {prefix} is not a positive number "
                                 "(megatron normalizes the weights to sum to 1; 0 or a negative weight is an assertion "
                                 f"after the model is built); give it a weight above 0, or leave {prefix} out")


# ----------------------------------------------------------------------------- where a resume starts
def check_resume_point(args) -> None:
    """What megatron meets later, with tracebacks, when resuming: a ``--ckpt-step`` of an iteration the
    ``--load`` folder does not hold (megatron warns "loaded unverified", then fails on the folder); a
    ``--train-iters`` below the checkpoint's iteration (an ``OptimizerParamScheduler`` assertion); a new
    ``--lr`` / ``--min-lr`` / weight decay with the optimizer state loaded (megatron's parameter groups are
    keyed by them: ``Could not find parameter group with key``)."""
    load = getattr(args, "load", None)
    if not load or not os.path.isdir(load):
        return
    from megatron_xmod.training.checkpoints import iteration_dir_name, iterations_found, read_tracker

    step = getattr(args, "ckpt_step", None)
    if step:
        directory = os.path.join(load, iteration_dir_name(int(step)))
        if not os.path.isdir(directory):
            found = iterations_found(load)
            listed = ", ".join(map(str, found)) or "none"
            fix = (f"pass one of them (--ckpt-step {found[-1]} is the latest), or drop --ckpt-step to resume "
                   "from the iteration latest_checkpointed_iteration.txt names" if found else
                   "drop --ckpt-step and --load to start from scratch")
            raise ValueError(f"ckpt_step: --ckpt-step {step} asks for iteration {step} but {directory} does not exist "
                             f"(iterations in --load {load}: {listed}); {fix}")
        tracked = (int(step), False)
    else:
        tracked = read_tracker(load)
    if tracked is None or tracked[1] or getattr(args, "finetune", False):
        return  # nothing to resume, a release checkpoint or --finetune: training starts at iteration 0
    iteration = tracked[0]
    train_iters = getattr(args, "train_iters", None)
    if train_iters and iteration > train_iters:
        raise ValueError(f"train_iters: --train-iters {train_iters} is below iteration {iteration} of the checkpoint "
                         f"--load {load} resumes (megatron would stop on an OptimizerParamScheduler assertion); pass "
                         f"--train-iters above {iteration} (with --override-opt_param-scheduler for the longer "
                         f"schedule), or --ckpt-step N of an earlier checkpoint, or --finetune to start the count at 0")
    if getattr(args, "no_load_optim", False) or getattr(args, "use_checkpoint_args", False):
        return
    saved = saved_common_state(os.path.join(load, iteration_dir_name(iteration)))
    saved_args = (saved or {}).get("args")
    if saved_args is None:
        return
    differ = [(flag, getattr(saved_args, name), getattr(args, name))
              for name, flag in (("lr", "--lr"), ("min_lr", "--min-lr"), ("start_weight_decay", "--start-weight-decay"),
                                 ("end_weight_decay", "--end-weight-decay"))
              if hasattr(saved_args, name) and hasattr(args, name) and getattr(saved_args, name) is not None
              and getattr(args, name) is not None and getattr(saved_args, name) != getattr(args, name)]
    if differ:
        text = ", ".join(f"{flag} {old} there, {new} here" for flag, old, new in differ)
        raise ValueError(
            f"no_load_optim: --load {load} (iteration {iteration}) was saved with other optimizer settings ({text}); "
            "megatron keys the optimizer state's parameter groups by them and would stop with 'Could not find "
            "parameter group with key (...)'. To train on with the new values pass --no-load-optim (the weights "
            "are loaded, Adam's moments restart; add --override-opt_param-scheduler if the schedule changes too), "
            "or resume with the checkpoint's " + " ".join(f"{flag} {old}" for flag, old, _ in differ))


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
