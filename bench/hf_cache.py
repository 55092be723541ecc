"""KV-cache bytes of generation with an exported routed model: the sparse cache (each sparse layer keeps
K/V of the tokens it routed, megatron_xmod.hf.cache.XModCache) against a dense cache of the same model
(every layer keeps every token).

    .venv/bin/python bench/hf_cache.py HF_FOLDER [--tokens 2048] [--prompt TEXT] [--seed 0] [--out bench/results]

Writes ``hf_cache_<date>.json`` and ``.md`` under ``--out``: per layer its kind, K, the entries it
cached, the fraction of tokens it routed (1/K expected of a trained router under the threshold rule),
and the bytes, sparse against dense.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch


def measure(folder: str, tokens: int, prompt: str, seed: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import megatron_xmod.hf  # noqa: F401  (registers the classes)
    from megatron_xmod.hf.cache import XModCache, dense_cache_bytes

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cfg = model.config
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cache = XModCache(cfg)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():  # sampled (greedy text of a tiny model loops), fixed seed
        out = model.generate(ids, cache=cache, max_new_tokens=tokens - ids.shape[1], do_sample=True, top_k=50,
                             pad_token_id=tokenizer.eos_token_id or 0, min_new_tokens=tokens - ids.shape[1])
    seconds = time.perf_counter() - start
    total = cache.seen_tokens  # the last sampled token is never fed back, so it is not cached
    trained = min(cfg.max_position_embeddings, total)
    nbytes = cache.nbytes()
    dense_total = dense_cache_bytes(cfg, total, dtype=model.dtype)
    per_layer_dense = dense_total // cfg.num_hidden_layers
    layers = layer_rows(cache, cfg, total, trained, per_layer_dense)
    sparse_layers = [row for row in layers if row["kind"] == "sparse"]
    return dict(
        date=datetime.date.today().isoformat(), machine=f"{platform.node()}: 2-core CPU dev machine, no GPU",
        model=folder, layout=cfg.layout, dtype=str(model.dtype).removeprefix("torch."), tokens=total,
        prompt_tokens=ids.shape[1], trained_positions=trained, seconds=round(seconds, 1), cache_bytes=nbytes["total"],
        dense_cache_bytes=dense_total, ratio=nbytes["total"] / dense_total,
        sparse_layer_ratio=(sum(r["bytes"] for r in sparse_layers) / (per_layer_dense * len(sparse_layers))
                            if sparse_layers else None),
        layers=layers, text=tokenizer.decode(out[0, ids.shape[1]:ids.shape[1] + 60]),
    )


def cached_positions(layer) -> torch.Tensor:
    """Positions of the valid entries a layer cache holds, all sequences of the batch."""
    entries = [layer.sequence(row) for row in range(layer.batch)] if layer.is_initialized else []
    return torch.cat([positions[valid] for _, _, valid, positions in entries]) if entries else torch.zeros(0)


def layer_rows(cache, cfg, total: int, trained: int, dense_layer_bytes: int) -> list[dict]:
    """Per layer of ``cache`` after ``total`` tokens: kind, K, entries, routed fraction, the fraction of
    the ``trained`` first positions it routed, its bytes and a dense layer's."""
    nbytes = cache.nbytes()["per_layer"]
    return [dict(layer=i, kind=cfg.layer_kinds[i], k=cfg.layer_sparsity_k[i], entries=entries,
                 routed_fraction=entries / total, bytes=b, dense_bytes=dense_layer_bytes,
                 # positions the model was trained at (RoPE beyond them is extrapolation)
                 routed_fraction_trained_positions=int((cached_positions(layer) < trained).sum()) / trained)
            for i, (entries, b, layer) in enumerate(zip(cache.entries(), nbytes, cache.layers))]


def markdown(result: dict) -> str:
    mib = 2 ** 20
    sparse = [r for r in result["layers"] if r["kind"] == "sparse"]
    lines = [f"# KV cache of a {result['tokens'] + 1}-token generation ({result['date']}, {result['machine']})", "",
             f"Model `{result['model']}`, layout `{result['layout']}`, {result['dtype']}; "
             f"{result['prompt_tokens']} prompt tokens, sampled (top-k 50, fixed seed), {result['seconds']} s; "
             f"{result['tokens']} tokens cached (the last sampled token is never fed back).", "",
             f"Sparse cache {result['cache_bytes'] / mib:.2f} MiB vs dense cache {result['dense_cache_bytes'] / mib:.2f} MiB "
             f"(ratio {result['ratio']:.3f}); sparse layers hold {result['sparse_layer_ratio']:.3f} of a dense layer's bytes "
             f"(a router whose threshold rule agrees with top-k would hold 1/K = "
             f"{sum(1 / r['k'] for r in sparse) / max(1, len(sparse)):.3f}).",
             "", f"| layer | kind | K | entries | routed fraction | same, positions < {result['trained_positions']} "
             "| bytes | dense bytes |", "|---|---|---|---|---|---|---|---|"]
    for r in result["layers"]:
        lines.append(f"| {r['layer']} | {r['kind']} | {r['k']} | {r['entries']} | {r['routed_fraction']:.3f} | "
                     f"{r['routed_fraction_trained_positions']:.3f} | {r['bytes']} | {r['dense_bytes']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an exported HF folder (xmod export-hf)")
    parser.add_argument("--tokens", type=int, default=2048, help="total sequence length after generation")
    parser.add_argument("--prompt", default="First Citizen:\nBefore we proceed any further, hear me speak.\n")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one token a step: small ops)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.folder, args.tokens, args.prompt, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"hf_cache_{result['date'].replace('-', '')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
