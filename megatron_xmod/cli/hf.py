"""``xmod export-hf``, ``xmod add-tokenizer`` and ``xmod import-hf`` (see docs/hf.md)."""
from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("export-hf", help="megatron torch_dist checkpoint (any TP/PP) -> Hugging Face folder")
    p.add_argument("--load", required=True, help="the run's --save folder (or one iter_*/release folder)")
    p.add_argument("--output", required=True, help="new folder for the HF model")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest checkpoint")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="weights' dtype (default: the run's parameter dtype)")
    p.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (e.g. 500MB, 5GB)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the run's own tokenizer file/folder, when the path the run saved is not valid here")
    p.add_argument("--hf-tokenizer", default=None, metavar="PATH",
                   help="a tokenizer of your own instead of the run's: a folder written by save_pretrained, a "
                        "tokenizer.json or a SentencePiece BPE .model; its size must match the checkpoint's "
                        "vocabulary. For data you pre-tokenized (NullTokenizer runs); without it such a run "
                        "exports its weights only")
    p.add_argument("--no-verify", action="store_true",
                   help="export a checkpoint without its checksum manifest (saved before megatron_xmod wrote them); "
                        "by default the checkpoint is verified against it, as --load does")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_export)

    p = subparsers.add_parser("add-tokenizer", help="add your tokenizer to a weights-only export-hf folder")
    p.add_argument("folder", help="a folder written by xmod export-hf without a tokenizer")
    p.add_argument("--hf-tokenizer", required=True, metavar="PATH",
                   help="a folder written by save_pretrained, a tokenizer.json or a SentencePiece BPE .model; its "
                        "size must match the checkpoint's vocabulary")
    p.set_defaults(func=_add_tokenizer)

    p = subparsers.add_parser("import-hf", help="Hugging Face folder from export-hf -> megatron torch_dist checkpoint")
    p.add_argument("folder", help="a folder written by xmod export-hf")
    p.add_argument("--save", required=True, help="new checkpoint folder (pass it as --load to continue training)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--overwrite", action="store_true",
                   help="--save already holds a run: replace its release checkpoint and point its tracker at it")
    p.set_defaults(func=_import)


def _export(args) -> int:
    from megatron_xmod.hf.export import export_checkpoint

    result = export_checkpoint(args.load, args.output, iteration=args.iteration, dtype=args.dtype,
                               max_shard_size=args.max_shard_size, tokenizer_model=args.tokenizer_model,
                               hf_tokenizer=args.hf_tokenizer, progress=not args.no_progress,
                               verify=not args.no_verify)
    print(f"[export-hf] {result.summary()}")
    print(f"[export-hf] {result.tokenizer}")
    return 0


def _add_tokenizer(args) -> int:
    from megatron_xmod.hf.export import add_tokenizer

    print(f"[add-tokenizer] {add_tokenizer(args.folder, args.hf_tokenizer)}")
    return 0


def _import(args) -> int:
    from megatron_xmod.hf.importer import import_folder

    path = import_folder(args.folder, args.save, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                         overwrite=args.overwrite)
    print(f"[import-hf] wrote {path} (a release checkpoint: --load {args.save} starts at iteration 0 with a fresh "
          f"optimizer; saved for TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size})")
    return 0
