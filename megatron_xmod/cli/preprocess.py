"""``xmod preprocess``: text or JSONL to a megatron indexed dataset (:mod:`megatron_xmod.data.preprocess`)."""
from __future__ import annotations

import argparse
import shlex

from megatron_xmod.data import preprocess as preprocess_module
from megatron_xmod.data.preprocess import preprocess, pretrain_flags
from megatron_xmod.data.tokenizers import TOKENIZER_KINDS


def register(subparsers) -> None:
    p = subparsers.add_parser("preprocess", help="text/JSONL -> Megatron indexed dataset (.bin/.idx)",
                              description=preprocess_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_DIR",
                   help="text files, .jsonl files, or directories of them")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="gpt2")
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file (required for sentencepiece); for gpt2 an optional "
                        "gpt2.tiktoken file, which must still match the GPT-2 sha256")
    p.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB_SIZE",
                   help="with --tokenizer sentencepiece: first train a SentencePiece model of this many pieces on "
                        "the inputs, written to --tokenizer-model (default OUTPUT_PREFIX_sentencepiece.model)")
    p.add_argument("--jsonl-key", default="text", help="field holding the document text in .jsonl lines")
    p.add_argument("--split-blank-lines", action="store_true",
                   help="in plain-text files, every blank-line-separated block is a document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    result = preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer,
                        tokenizer_model=args.tokenizer_model, jsonl_key=args.jsonl_key, workers=args.workers,
                        split_blank_lines=args.split_blank_lines, progress=not args.quiet,
                        train_tokenizer=args.train_tokenizer)
    if args.train_tokenizer is not None:
        print(f"trained {result['tokenizer_model']} ({result['vocab_size']} pieces)")
    print(f"wrote {result['bin']}, {result['idx']} and {result['record']}: {result['documents']} documents, "
          f"{result['tokens']} tokens ({result['tokenizer']}, vocab {result['vocab_size']}, eod {result['eod']})")
    print("pretrain flags for this dataset (python -m megatron_xmod.pretrain ...):")
    print("  " + " ".join(shlex.quote(flag) for flag in pretrain_flags(result)))
    return 0
