"""Which tokenizer wrote a dataset: ``PREFIX.tokenizer.json`` beside ``PREFIX.bin`` / ``PREFIX.idx``.

``xmod preprocess`` (:func:`megatron_xmod.data.preprocess.preprocess`) writes the record atomically
once the two data files are in place: the tokenizer's kind (``gpt2``, ``sentencepiece``, ``bytes``),
its model file and that file's sha256, the vocabulary size, the end-of-document id, the document and
token counts of the ``.idx`` it describes, and the ids of a fixed probe text.

Before training, :func:`mismatch` compares a record with the run's megatron tokenizer flags
(``--tokenizer-type`` / ``--tokenizer-model`` / ``--vocab-size``, see :func:`run_tokenizer`):

* ``gpt2``: ``HuggingFaceTokenizer`` on a folder whose ``vocab.json`` / ``merges.txt`` are GPT-2's
  (sha256; the folder :func:`~megatron_xmod.data.tokenizers.write_gpt2_hf_files` writes, or the hub's
  ``gpt2``), or ``GPT2BPETokenizer`` with those two files;
* ``sentencepiece``: ``SentencePieceTokenizer`` (or ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer``)
  on a ``--tokenizer-model`` with the recorded sha256;
* ``bytes``: ``NullTokenizer --vocab-size 257``. A ``NullTokenizer`` takes the ids as they are, so any
  record is matched by one of the record's vocabulary size (its eod is vocab_size - 1, as ours);
* any other run tokenizer (another Hugging Face folder, TikTokenizer, ...) matches when megatron's
  built tokenizer encodes the probe text to the recorded ids.

A dataset without a record (megatron's own preprocess_data.py, or made before records existed) is
not checked.
"""
from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_xmod.data.tokenizers import (
    GPT2_ENCODER_JSON_SHA256,
    GPT2_TIKTOKEN_SHA256,
    GPT2_VOCAB_BPE_SHA256,
    ByteTokenizer,
    Tokenizer,
    default_cache_dir,
    sha256_file,
)

RECORD_SUFFIX = ".tokenizer.json"
RECORD_FORMAT = 1
PROBE_TEXT = "Hello, world! The 1234 quick foxes; déjà vu.\n\tEnd"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
GPT2_HUB_NAMES = ("gpt2", "openai-community/gpt2")


def record_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{RECORD_SUFFIX}")


def make_record(tokenizer: Tokenizer, kind: str, model: str | os.PathLike | None, documents: int,
                tokens: int) -> dict:
    """The record of a dataset of ``documents`` / ``tokens`` written by ``tokenizer`` (of ``kind``)."""
    model_path = str(Path(model).resolve()) if model else None
    if kind == "sentencepiece":
        digest = sha256_file(model_path)
    elif kind == "gpt2":
        digest = sha256_file(model_path) if model_path else GPT2_TIKTOKEN_SHA256
    else:
        digest = None
    return {"format": RECORD_FORMAT, "written_by": "xmod preprocess", "kind": kind, "tokenizer_model": model_path,
            "sha256": digest, "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod),
            "documents": int(documents), "tokens": int(tokens), "probe": PROBE_TEXT,
            "probe_ids": [int(i) for i in tokenizer.encode(PROBE_TEXT)]}


def write_record(prefix: str | os.PathLike, record: dict) -> Path:
    """Write ``PREFIX.tokenizer.json`` atomically (a temporary file renamed into place), readable like
    the ``.bin``/``.idx`` beside it (the umask's permissions, not the temporary file's 0600)."""
    path = record_path(prefix)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(json.dumps(record, indent=1) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_record(prefix: str | os.PathLike) -> Optional[dict]:
    """The record beside ``prefix``, None when there is none; a damaged record is an error."""
    path = record_path(prefix)
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"data_path: cannot read {path}, the tokenizer record of {prefix} ({error.strerror}); fix its "
                         "permissions") from error
    try:
        record = json.loads(text)
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"data_path: {path} (the tokenizer record of {prefix}) does not parse ({error}); re-run "
                         "`xmod preprocess` for this prefix, or delete the record to train unchecked") from error
    if not isinstance(record, dict) or record.get("kind") not in ("gpt2", "sentencepiece", "bytes"):
        raise ValueError(f"data_path: {path} is not a tokenizer record of `xmod preprocess` (kind "
                         f"{record.get('kind') if isinstance(record, dict) else None!r}); re-run `xmod preprocess` "
                         "for this prefix, or delete the record to train unchecked")
    return record


def describe_record(record: dict) -> str:
    kind = record["kind"]
    if kind == "gpt2":
        return f"GPT-2 BPE ({record['vocab_size']} ids, eod {record['eod']})"
    if kind == "sentencepiece":
        return (f"the SentencePiece model {record.get('tokenizer_model')} (sha256 {str(record.get('sha256'))[:12]}..., "
                f"{record['vocab_size']} pieces)")
    return f"bytes ({record['vocab_size']} ids, eod {record['eod']})"


def record_flags(record: dict) -> tuple[list[str], list[str]]:
    """(the entry point's tokenizer flags, the slurm launchers' knobs) that train with ``record``'s tokenizer."""
    kind = record["kind"]
    if kind == "gpt2":
        folder = str(default_cache_dir() / "tokenizers" / "gpt2")
        return (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder],
                ["TOKENIZER_TYPE=HuggingFaceTokenizer", f"TOKENIZER_MODEL={folder}"])
    if kind == "sentencepiece":
        model = str(record.get("tokenizer_model"))
        return (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model],
                ["TOKENIZER_TYPE=SentencePieceTokenizer", f"TOKENIZER_MODEL={model}"])
    vocab = str(record.get("vocab_size", ByteTokenizer.vocab_size))
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", vocab], ["TOKENIZER_TYPE=NullTokenizer",
                                                                           f"VOCAB_SIZE={vocab}"]


# ----------------------------------------------------------------------------- the run's tokenizer
@dataclass(frozen=True)
class RunTokenizer:
    """What the run's megatron flags say about its tokenizer: ``kind`` is ``gpt2``, ``sentencepiece``,
    ``null`` (NullTokenizer) or ``other`` (not identifiable from its files alone)."""

    kind: str
    flags: str
    sha256: Optional[str] = None
    vocab_size: Optional[int] = None
    eod: Optional[int] = None

    def describe(self) -> str:
        what = {"gpt2": "GPT-2 BPE", "sentencepiece": f"a SentencePiece model (sha256 {str(self.sha256)[:12]}...)",
                "null": f"NullTokenizer ids as they are ({self.vocab_size} ids, eod {self.eod})"}.get(self.kind)
        return f"{self.flags} ({what})" if what else self.flags


def _file_sha(path) -> Optional[str]:
    try:
        return sha256_file(path) if path and os.path.isfile(path) else None
    except OSError:
        return None


def _is_gpt2_files(vocab, merges) -> bool:
    return _file_sha(vocab) == GPT2_ENCODER_JSON_SHA256 and _file_sha(merges) == GPT2_VOCAB_BPE_SHA256


def run_tokenizer(args) -> RunTokenizer:
    """The run's tokenizer (megatron's parsed arguments), identified from its flags and files."""
    kind = getattr(args, "tokenizer_type", None)
    model = getattr(args, "tokenizer_model", None)
    flags = f"--tokenizer-type {kind}" + (f" --tokenizer-model {model}" if model and kind != "NullTokenizer" else "")
    if kind in SENTENCEPIECE_TYPES:
        return RunTokenizer("sentencepiece", flags, sha256=_file_sha(model))
    if kind == "NullTokenizer":
        vocab = getattr(args, "vocab_size", None)
        eod = getattr(args, "null_tokenizer_eod_id", None)
        vocab = int(vocab) if vocab else None
        return RunTokenizer("null", f"{flags} --vocab-size {vocab}", vocab_size=vocab,
                            eod=int(eod) if eod is not None else (vocab - 1 if vocab else None))
    if kind == "HuggingFaceTokenizer" and model:
        if str(model) in GPT2_HUB_NAMES or (os.path.isdir(model) and _is_gpt2_files(
                os.path.join(model, "vocab.json"), os.path.join(model, "merges.txt"))):
            return RunTokenizer("gpt2", flags)
    if kind == "GPT2BPETokenizer":
        vocab_file, merge_file = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
        flags = f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab_file} --merge-file {merge_file}"
        if _is_gpt2_files(vocab_file, merge_file):
            return RunTokenizer("gpt2", flags)
    return RunTokenizer("other", flags)


def _probe_matches(record: dict, built) -> Optional[bool]:
    """Does megatron's built tokenizer encode the probe text to the recorded ids? None: cannot tell."""
    if built is None or "probe_ids" not in record:
        return None
    try:
        ids = [int(i) for i in built.tokenize(record.get("probe", PROBE_TEXT))]
    except Exception:  # a tokenizer without text encoding
        return None
    bos = getattr(built, "bos", None)
    if ids and bos is not None and ids[0] == bos and record["probe_ids"][:1] != [bos]:
        ids = ids[1:]  # a tokenizer that prepends BOS still maps text to the same ids
    return ids == record["probe_ids"]


def mismatch(prefix: str, record: dict, run: RunTokenizer, built=None) -> Optional[str]:
    """None when ``run`` reads the ids ``record`` says the data holds, else the error line."""
    kind = record["kind"]
    if run.kind == "null":
        same = run.vocab_size == record["vocab_size"] and run.eod == record["eod"]
    elif run.kind in ("gpt2", "sentencepiece"):
        same = run.kind == kind and (kind != "sentencepiece" or run.sha256 is None or run.sha256 == record.get("sha256"))
    else:
        same = bool(_probe_matches(record, built))
    if same:
        return None
    flags, knobs = record_flags(record)
    field = "tokenizer_model" if run.kind == kind == "sentencepiece" else "tokenizer_type"
    return (f"{field}: {prefix} was tokenized with {describe_record(record)} (its record {record_path(prefix)}) but this run's "
            f"tokenizer is {run.describe()}; training would read its token ids with the wrong vocabulary. Train with "
            f"the dataset's tokenizer: {shlex.join(flags)} (slurm launchers: {' '.join(knobs)}), or preprocess the "
            "text again with the run's tokenizer (`xmod preprocess --tokenizer ...`)")


def stale(prefix: str, record: dict, documents: int, tokens: int) -> Optional[str]:
    """An error line when the record describes other data than the ``.idx`` holds."""
    if (record.get("documents"), record.get("tokens")) in ((documents, tokens), (None, None)):
        return None
    return (f"data_path: {record_path(prefix)} describes {record.get('documents')} documents / {record.get('tokens')} "
            f"tokens but {prefix}.idx holds {documents} / {tokens}: the record belongs to another preprocessing of "
            "this prefix; re-run `xmod preprocess` for it, or delete the record to train unchecked")
