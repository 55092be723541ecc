"""``xmod preprocess``: text or JSONL -> a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

What a document is:
* ``.jsonl`` / ``.json`` files: one document per non-empty line, the string under ``--jsonl-key``;
* any other file: the whole file is one document, or with ``--split-blank-lines`` every block of text
  between blank lines is one (leading/trailing blank lines of a block are dropped);
* a directory stands for every non-hidden file below it, in sorted order.

Each document is stored as one sequence with the tokenizer's end-of-document id appended, so decoding a
sequence without its last id gives the document text back exactly (for gpt2, sentencepiece and bytes).
Empty and whitespace-only documents are skipped (an EOD alone would teach nothing). The two files are
written under temporary names and renamed at the end, so an interrupted run never leaves a prefix that
looks complete. Last, ``PREFIX.tokenizer.json`` records the tokenizer that wrote them (kind, model file
and its sha256, vocabulary size, eod; :mod:`megatron_xmod.data.tokenizer_record`): the entry point's
pre-flight refuses to train the dataset with another tokenizer.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np

from megatron_xmod.data.tokenizer_record import make_record, record_path, write_record
from megatron_xmod.data.tokenizers import TOKENIZER_KINDS, get_tokenizer

JSON_SUFFIXES = (".jsonl", ".json")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


class DataError(ValueError):
    """Bad data input (missing, empty, unreadable); the message names the file."""


def expand_inputs(inputs) -> list[Path]:
    """Files named by ``inputs`` (files or directories), checked to exist, in a reproducible order."""
    if not inputs:
        raise DataError("no --input given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise DataError(f"input directory {path} contains no files")
            files.extend(found)
        else:
            raise DataError(f"input not found: {path}")
    return files


def _not_utf8(path: Path, raw: bytes, error: UnicodeDecodeError, offset: int = 0, lineno: int = 1) -> DataError:
    """Name the file, line and byte of the first byte that is not UTF-8, and what to do."""
    position = offset + error.start
    line = lineno + raw[:error.start].count(b"\n")
    return DataError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {position}, "
                     f"{raw[error.start:error.start + 4]!r}); convert the file, e.g. `iconv -f latin1 -t utf-8`")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        # Keep \r\n as written (no newline translation), so the round trip is exact on Windows-style files too.
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw, e) from None


def _json_lines(path: Path):
    """(line number, text, size in bytes) of a JSONL file; a line that is not UTF-8 is named."""
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8"), len(raw)
            except UnicodeDecodeError as e:
                raise _not_utf8(path, raw, e, offset, lineno) from None
            offset += len(raw)


def iter_documents(files, jsonl_key: str = "text", split_blank_lines: bool = False):
    """Yield ``(text, source_bytes)``; ``source_bytes`` advances the progress bar by input size."""
    for path in files:
        if path.suffix.lower() in JSON_SUFFIXES:
            for lineno, line, line_size in _json_lines(path):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
                if not isinstance(record, dict) or jsonl_key not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{path}:{lineno}: no key {jsonl_key!r} (--jsonl-key); found {keys}")
                text = record[jsonl_key]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{lineno}: {jsonl_key!r} must be a string, "
                                    f"got {type(text).__name__}")
                yield (text if text.strip() else ""), line_size
            continue
        text = _read_text(path)
        size = path.stat().st_size
        if not split_blank_lines:
            yield (text if text.strip() else ""), size
            continue
        blocks = [b.strip("\r\n") for b in _BLANK_LINES.split(text)]
        blocks = [b for b in blocks if b.strip()]
        for i, block in enumerate(blocks):
            yield block, size if i == len(blocks) - 1 else 0


# Whitespace-only documents arrive as "" so that they encode to nothing and are skipped.
# Worker processes build their own tokenizer once; sending a tiktoken encoder through pickle is not possible.
_WORKER_TOKENIZER = None


def _init_worker(kind: str, model):
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = get_tokenizer(kind, model)


def _encode_in_worker(item):
    text, size = item
    return _WORKER_TOKENIZER.encode(text), size


MIN_SENTENCEPIECE_VOCAB = 300  # 256 byte pieces (byte fallback) + unk/bos/eos + a few merges


def train_tokenizer_on(files, vocab_size: int, model_path: Path, jsonl_key: str = "text",
                       split_blank_lines: bool = False) -> Path:
    """Train a SentencePiece model of ``vocab_size`` pieces on the documents of ``files`` (the same
    documents preprocessing reads, JSONL included); returns the ``.model`` path."""
    import tempfile

    from megatron_xmod.data.tokenizers import train_sentencepiece

    if vocab_size < MIN_SENTENCEPIECE_VOCAB:
        raise ValueError(f"train_tokenizer: {vocab_size} is too small (byte fallback alone takes 259 pieces); use at "
                         f"least {MIN_SENTENCEPIECE_VOCAB}, e.g. 8000")
    model_path = Path(model_path)
    prefix = model_path.with_suffix("") if model_path.suffix == ".model" else model_path
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "documents.txt"
        with open(text, "w", encoding="utf-8") as f:
            for document, _ in iter_documents(files, jsonl_key, split_blank_lines):
                if document:
                    f.write(document.replace("\r\n", "\n") + "\n")
        try:
            return train_sentencepiece(text, vocab_size, prefix)
        except RuntimeError as e:
            raise ValueError(f"train_tokenizer: SentencePiece could not train {vocab_size} pieces on {len(files)} "
                             f"file(s) ({str(e).strip()}); try a smaller --train-tokenizer") from None


def pretrain_flags(result: dict) -> list[str]:
    """The entry point's data and tokenizer flags that read what :func:`preprocess` wrote."""
    from megatron_xmod.data.tokenizers import megatron_tokenizer_args
    from megatron_xmod.data.splits import working_split

    split = working_split("98,1,1", result["documents"])
    data = ["--data-path", result["prefix"]]
    data += ["--split", split] if split else ["--split", "100,0,0", "--eval-iters", "0"]
    return data + megatron_tokenizer_args(result["tokenizer"], result.get("tokenizer_model"))


def preprocess(inputs, output_prefix, tokenizer: str = "gpt2", tokenizer_model=None, jsonl_key: str = "text",
               workers: int = 1, split_blank_lines: bool = False, progress: bool = True,
               train_tokenizer: int | None = None) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.bin/.idx``; return ``{prefix, documents, tokens, ...}``.
    ``train_tokenizer``: first train a SentencePiece model of that many pieces on ``inputs`` (written
    to ``tokenizer_model``, default ``<output_prefix>_sentencepiece.model``)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {tokenizer!r} (--tokenizer); allowed: {', '.join(TOKENIZER_KINDS)}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if train_tokenizer is not None and tokenizer != "sentencepiece":
        raise ValueError(f"train_tokenizer: trains a SentencePiece model; add --tokenizer sentencepiece (got {tokenizer})")
    files = expand_inputs(inputs)
    if train_tokenizer is not None:
        tokenizer_model = train_tokenizer_on(files, train_tokenizer,
                                             Path(tokenizer_model or f"{output_prefix}_sentencepiece.model"),
                                             jsonl_key, split_blank_lines)
    tok = get_tokenizer(tokenizer, tokenizer_model)  # verifies hashes before any output exists

    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = prefix.with_name(f".{prefix.name}.tmp{os.getpid()}")
    bin_tmp, idx_tmp = Path(f"{tmp_prefix}.bin"), Path(f"{tmp_prefix}.idx")
    total_bytes = sum(f.stat().st_size for f in files)
    docs = iter_documents(files, jsonl_key, split_blank_lines)
    documents = tokens = 0
    pool = None
    try:
        builder = IndexedDatasetBuilder(str(bin_tmp), dtype=DType.optimal_dtype(tok.vocab_size))
        if workers == 1:
            encoded = ((tok.encode(text), size) for text, size in docs)
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer, tokenizer_model))
            encoded = pool.imap(_encode_in_worker, docs, chunksize=8)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"preprocess {prefix.name}",
                  disable=not progress, file=sys.stderr) as bar:
            for ids, size in encoded:
                bar.update(size)
                if not ids:
                    continue
                ids.append(tok.eod)
                builder.add_document(np.asarray(ids), [len(ids)])
                documents += 1
                tokens += len(ids)
                bar.set_postfix(docs=documents, tokens=tokens, refresh=False)
        if documents == 0:
            builder.data_file.close()
            raise DataError(f"no documents found in {', '.join(str(f) for f in files)} (all inputs are empty)")
        builder.finalize(str(idx_tmp))
        record = make_record(tok, tokenizer, tokenizer_model, documents, tokens)
        # No moment with new data beside an old record: the old one goes first, the new one comes last.
        record_path(prefix).unlink(missing_ok=True)
        os.replace(bin_tmp, f"{prefix}.bin")
        os.replace(idx_tmp, f"{prefix}.idx")
        write_record(prefix, record)
    finally:
        if pool is not None:
            pool.terminate()
        for leftover in (bin_tmp, idx_tmp):
            if leftover.exists():
                leftover.unlink()
    return {"prefix": str(prefix), "bin": f"{prefix}.bin", "idx": f"{prefix}.idx",
            "record": str(record_path(prefix)), "documents": documents,
            "tokens": tokens, "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "eod": tok.eod,
            "files": len(files), "tokenizer_model": None if tokenizer_model is None else str(tokenizer_model)}
