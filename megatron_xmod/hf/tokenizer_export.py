"""The tokenizer a megatron run trained with, written as a Hugging Face tokenizer folder that
``AutoTokenizer.from_pretrained`` loads with transformers alone (a ``tokenizer.json`` for the
``tokenizers`` library: no sentencepiece, no megatron at load time).

From the run's saved ``args`` (``--tokenizer-type`` / ``--tokenizer-model`` / ``--vocab-file``):

* ``HuggingFaceTokenizer``: the folder it named (the GPT-2 BPE of ``megatron_xmod.data.tokenizers``
  is one), re-saved;
* ``GPT2BPETokenizer``: its ``--vocab-file`` / ``--merge-file``;
* ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``: the ``.model`` file (BPE) turned into
  the equivalent ``tokenizers`` BPE (byte fallback, "▁" for spaces, digits split as the corpus
  SentencePiece trains them); the ids are checked against sentencepiece's own before writing;
* ``NullTokenizer``: byte ids (``--vocab-size`` 256 or 257), end of document ``vocab_size - 1``
  as megatron's NullTokenizer has it.

Anything else is an error naming ``tokenizer_type``.

A tokenizer of the user's own (``--hf-tokenizer PATH``: a folder written by ``save_pretrained``, a
``tokenizer.json`` or a SentencePiece BPE ``.model``) replaces the run's: what data pre-tokenized
outside megatron (``NullTokenizer`` with its own ``--vocab-size``) needs. :func:`resolve_tokenizer`
checks it against the checkpoint's vocabulary; a ``NullTokenizer`` run at another vocabulary than
bytes without one exports its weights only (:data:`NO_TOKENIZER`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

EOD_TEXT = "<|endoftext|>"
SUPPORTED = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
             "NullTokenizer")
# Checked through both tokenizers before a converted SentencePiece model is written.
_CHECK_TEXT = ("  To be, or not to be: that is the question.\n\tWhether 'tis nobler in the mind 1604 ...\n"
               "Ophélie, naïve café — “quoted” ☃ emoji 🙂 and   runs of   spaces\n\n\nEND 0123456789")


def _existing(path, field: str) -> Path:
    if not path:
        raise ValueError(f"{field}: the checkpoint's args name no tokenizer file; export with --tokenizer-model PATH "
                         "(the run's tokenizer file) or --hf-tokenizer PATH (a tokenizer of your own)")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{field}: {path} does not exist here (the path the run trained with); "
                         "pass --tokenizer-model PATH (that file, where it is now) or --hf-tokenizer PATH to export-hf")
    return path


def build_tokenizer(args: argparse.Namespace, tokenizer_model: str | os.PathLike | None = None):
    """A ``PreTrainedTokenizerFast`` for the run's tokenizer (``tokenizer_model`` overrides the path
    saved in ``args``)."""
    kind = getattr(args, "tokenizer_type", None)
    model_path = tokenizer_model or getattr(args, "tokenizer_model", None)
    if kind == "HuggingFaceTokenizer":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(_existing(model_path, "tokenizer_model")))
    if kind == "GPT2BPETokenizer":
        return _gpt2_from_files(_existing(tokenizer_model or args.vocab_file, "vocab_file"),
                                _existing(getattr(args, "merge_file", None), "merge_file"))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return sentencepiece_tokenizer(_existing(model_path, "tokenizer_model"))
    if kind == "NullTokenizer":
        return byte_tokenizer(int(args.vocab_size))
    raise ValueError(f"tokenizer_type: {kind!r} cannot be exported; supported: {', '.join(SUPPORTED)}")


# ------------------------------------------------------------------------------ the user's own tokenizer
@dataclasses.dataclass
class ResolvedTokenizer:
    tokenizer: object  # a PreTrainedTokenizerFast, or None: the export writes the weights only
    description: str  # one line for the export's output


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """megatron's embedding rows for ``vocab_size`` tokens under the run's padding
    (``--make-vocab-size-divisible-by`` x the TP size it trained at)."""
    multiple = int(getattr(args, "make_vocab_size_divisible_by", 128) or 1) * int(
        getattr(args, "tensor_model_parallel_size", 1) or 1)
    return int(math.ceil(vocab_size / multiple) * multiple)


def load_user_tokenizer(path: str | os.PathLike):
    """A tokenizer the user gives: a folder written by ``save_pretrained`` (what ``AutoTokenizer``
    loads), a ``tokenizer.json`` of the ``tokenizers`` library, or a SentencePiece BPE ``.model``."""
    path = Path(path)
    fix = ("fix: give a folder written by tokenizer.save_pretrained(DIR), a tokenizer.json, or a "
           "SentencePiece BPE .model file")
    if not path.exists():
        raise ValueError(f"hf_tokenizer: {path} does not exist; {fix}")
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as error:  # transformers raises OSError, ValueError, KeyError, ... here
            reason = " ".join(str(error).split())[:200]
            raise ValueError(f"hf_tokenizer: {path} is not a tokenizer folder transformers can load ({reason}); "
                             f"{fix}") from None
    if path.suffix == ".model":
        return sentencepiece_tokenizer(path)
    if path.suffix == ".json":
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        except Exception as error:
            reason = " ".join(str(error).split())[:200]
            raise ValueError(f"hf_tokenizer: {path} is not a tokenizers JSON file ({reason}); {fix}") from None
    raise ValueError(f"hf_tokenizer: {path} is neither a folder, a .json nor a .model file; {fix}")


def check_vocabulary(tokenizer, args: argparse.Namespace, source) -> None:
    """A supplied tokenizer must be the one the run's token ids come from: for a ``NullTokenizer`` run
    exactly its ``--vocab-size``, otherwise as many tokens as pad to the checkpoint's embedding rows."""
    size, rows = len(tokenizer), int(args.padded_vocab_size)
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        if size != int(args.vocab_size):
            raise ValueError(f"hf_tokenizer: {source} has {size} tokens but the checkpoint was trained with "
                             f"--vocab-size {args.vocab_size} (NullTokenizer: pre-tokenized ids; {rows} embedding rows "
                             "after padding); fix: give the tokenizer the data was tokenized with")
        return
    if size > rows or padded_vocab_size(size, args) != rows:
        raise ValueError(f"hf_tokenizer: {source} has {size} tokens (padded: {padded_vocab_size(size, args)} rows) but "
                         f"the checkpoint's vocabulary has {rows} embedding rows; fix: give the tokenizer the run "
                         "trained with")


NO_TOKENIZER = ("weights only, no tokenizer written: the run used NullTokenizer (pre-tokenized ids) with "
                "--vocab-size {vocab}, which is not bytes; add the tokenizer your data was tokenized with "
                "later: xmod add-tokenizer {output} --hf-tokenizer PATH (or export again with --hf-tokenizer PATH)")


def resolve_tokenizer(args: argparse.Namespace, output, tokenizer_model=None, hf_tokenizer=None) -> ResolvedTokenizer:
    """The tokenizer an export writes, checked against the checkpoint's vocabulary before any tensor
    is read: ``hf_tokenizer`` (the user's own) if given; else the run's (``tokenizer_model``: its
    file at a new path); a ``NullTokenizer`` run names no file, so there ``tokenizer_model`` is the
    user's own too, and without either only a byte vocabulary (256/257) has a tokenizer."""
    kind = getattr(args, "tokenizer_type", None)
    if hf_tokenizer is not None and tokenizer_model is not None:
        raise ValueError("hf_tokenizer: give either --hf-tokenizer (your own tokenizer) or --tokenizer-model (the "
                         "run's tokenizer file at a new path), not both")
    note = ""
    if kind == "NullTokenizer" and tokenizer_model is not None:  # nothing of the run's to relocate
        hf_tokenizer, note = tokenizer_model, " (--tokenizer-model of a NullTokenizer run: taken as --hf-tokenizer)"
    if hf_tokenizer is not None:
        tokenizer = load_user_tokenizer(hf_tokenizer)
        check_vocabulary(tokenizer, args, hf_tokenizer)
        return ResolvedTokenizer(tokenizer, f"tokenizer: {hf_tokenizer}, {len(tokenizer)} tokens{note}")
    if kind == "NullTokenizer" and getattr(args, "vocab_size", None) not in (256, 257):
        return ResolvedTokenizer(None, NO_TOKENIZER.format(vocab=args.vocab_size, output=output))
    tokenizer = build_tokenizer(args, tokenizer_model)
    if len(tokenizer) > int(args.padded_vocab_size):
        raise ValueError(f"vocab_size: the tokenizer has {len(tokenizer)} tokens but the model only "
                         f"{args.padded_vocab_size} embedding rows")
    if kind == "NullTokenizer":
        return ResolvedTokenizer(tokenizer, f"tokenizer: UTF-8 bytes (NullTokenizer, --vocab-size {args.vocab_size}); "
                                            "if your data was tokenized otherwise, export with --hf-tokenizer PATH")
    return ResolvedTokenizer(tokenizer, f"tokenizer: the run's {kind}, {len(tokenizer)} tokens")


def export_tokenizer(args: argparse.Namespace, output_dir: str | os.PathLike,
                     tokenizer_model: str | os.PathLike | None = None):
    """Write the tokenizer files into ``output_dir``; returns the tokenizer."""
    tokenizer = build_tokenizer(args, tokenizer_model)
    tokenizer.save_pretrained(str(output_dir))
    return tokenizer


def _gpt2_from_files(vocab_file: Path, merge_file: Path):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(vocab_file, Path(folder) / "vocab.json")
        shutil.copyfile(merge_file, Path(folder) / "merges.txt")
        config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOD_TEXT, "eos_token": EOD_TEXT,
                  "unk_token": EOD_TEXT}
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))
        return AutoTokenizer.from_pretrained(folder)


def sentencepiece_tokenizer(model_file: Path):
    """The SentencePiece BPE ``model_file`` as a ``tokenizers`` BPE with the same ids."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    extractor = SentencePieceExtractor(str(model_file))
    spec = extractor.proto.trainer_spec
    if spec.model_type != 2:  # 1 unigram, 2 bpe
        raise ValueError(f"tokenizer_model: {model_file} is a SentencePiece model of type {spec.model_type} "
                         "(unigram?); only BPE models (what megatron_xmod trains) are exported")
    if extractor.proto.normalizer_spec.add_dummy_prefix or extractor.proto.normalizer_spec.name not in ("identity", ""):
        raise ValueError(f"tokenizer_model: {model_file} normalises text (add_dummy_prefix / "
                         f"{extractor.proto.normalizer_spec.name!r}); only identity-normalised models are exported")
    pieces = extractor.extract(BPE)
    unk = sp.id_to_piece(sp.unk_id())
    tok = Tokenizer(BPE(vocab=pieces["vocab"], merges=pieces["merges"], unk_token=unk, fuse_unk=True,
                        byte_fallback=bool(spec.byte_fallback)))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    if spec.split_digits:
        tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = {"unk_token": unk}
    if sp.bos_id() >= 0:
        special["bos_token"] = sp.id_to_piece(sp.bos_id())
    if sp.eos_id() >= 0:
        special["eos_token"] = sp.id_to_piece(sp.eos_id())
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    expected, got = sp.encode(_CHECK_TEXT), tokenizer(_CHECK_TEXT, add_special_tokens=False)["input_ids"]
    if expected != got:
        raise ValueError(f"tokenizer_model: the converted {model_file.name} does not reproduce sentencepiece's ids "
                         f"(first difference at token {next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)})")
    return tokenizer


def byte_tokenizer(vocab_size: int):
    """UTF-8 bytes as ids (megatron's NullTokenizer): ids below ``vocab_size - 1`` are bytes, the last
    id ends a document."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    if vocab_size not in (256, 257):
        raise ValueError(f"vocab_size: a NullTokenizer run exports as byte ids only with --vocab-size 256 or 257 "
                         f"(end of document last), got {vocab_size}")
    eod = vocab_size - 1
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for the bytes
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(eod)}
    assert set(vocab) <= set(byte_chars)
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    tokenizer.add_special_tokens({"eos_token": EOD_TEXT})
    if tokenizer.convert_tokens_to_ids(EOD_TEXT) != eod:
        raise AssertionError(f"byte tokenizer: end of document got id {tokenizer.convert_tokens_to_ids(EOD_TEXT)}, "
                             f"expected {eod}")
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
