"""Cost of the reliability checks (docs/reliability.md): checksum throughput of the manifest
(xxHash XXH3-128 and BLAKE2b) and the token-id scan of the pre-flight, on a file in the page cache.

    python bench/reliability.py [--mib 1024] [--out bench/results/reliability_<date>.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time

import numpy as np

from megatron_xmod.training import checkpoints
from megatron_xmod.training.preflight import first_token_at_or_above, read_indexed_dataset


def best_of(fn, repeats=3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "blob.bin")
        tokens = np.random.default_rng(0).integers(0, 50000, size=args.mib * 2**19, dtype=np.uint16)
        tokens.tofile(path)
        gib = os.path.getsize(path) / 2**30
        for algorithm in ("xxh3_128", "blake2b"):
            if algorithm == "xxh3_128" and checkpoints.checksum_algorithm() != "xxh3_128":
                continue
            seconds = best_of(lambda algorithm=algorithm: checkpoints.file_checksum(path, algorithm))
            rows.append((f"checksum {algorithm}", seconds / gib))
        # a Megatron dataset of one document over the same tokens, scanned for ids >= the GPT-2 vocabulary
        from megatron.core.datasets.indexed_dataset import _IndexWriter

        prefix = os.path.join(tmp, "data")
        os.replace(path, prefix + ".bin")
        with _IndexWriter(prefix + ".idx", np.uint16) as writer:
            writer.write([tokens.shape[0]], None, [0, 1])
        data = read_indexed_dataset(prefix)
        seconds = best_of(lambda: first_token_at_or_above(data, 50257))
        rows.append(("token-id scan (uint16)", seconds / gib))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# reliability checks: cost per GiB ({when})", "",
             f"Machine: 2-core CPU dev machine, no GPU ({platform.processor() or platform.machine()}), shared with "
             f"other jobs; file of {args.mib} MiB in the page cache, best of 3.", "",
             "| check | seconds per GiB |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as stream:
            stream.write(text)


if __name__ == "__main__":
    main()
