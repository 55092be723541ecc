"""lm-evaluation-harness tasks built deterministically from held-out text, run fully offline: by
default the embedded corpus's held-out plays (``megatron_xmod.data.corpus.TEST_WORKS``: plays no
training split contains), or text files of your own (``--held-out FILE ...``: text your run did not
train on, each read line by line).

    python -m megatron_xmod.hf.eval_tasks --out runs/eval_tasks [--held-out my_valid.txt ...]
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf \
        --model_args pretrained=hf/x,trust_remote_code=True --include_path runs/eval_tasks \
        --tasks xmod_next_line,xmod_perplexity --device cpu --batch_size 8

* ``xmod_next_line`` (multiple choice, acc / acc_norm): two consecutive lines of a text, then the true
  next line against three other lines of the same text (drawn with a fixed seed);
* ``xmod_perplexity`` (loglikelihood_rolling: word/byte perplexity, bits per byte): the texts cut into
  documents of consecutive whole lines of at most ``max_chars`` characters.

The YAMLs beside this file are the tasks; :func:`build_tasks` writes their JSONL data and copies of
the YAMLs that point at it (lm-eval reads ``data_files`` relative to its working directory, so the
copies carry absolute paths).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
TASKS = ("xmod_next_line", "xmod_perplexity")
SEED = 1234


def play_lines(works: Optional[tuple[str, ...]] = None, texts: Optional[list[Path]] = None) -> dict[str, list[str]]:
    """{work: its non-empty lines (stripped of trailing spaces)} for the held-out ``works``."""
    from megatron_xmod.data import corpus

    works = works or corpus.TEST_WORKS
    texts = texts if texts is not None else corpus.ensure_texts()
    by_name = {corpus.work_name(Path(p)): Path(p) for p in texts}
    missing = [w for w in works if w not in by_name]
    if missing:
        raise ValueError(f"works: {missing} are not in the corpus texts ({len(by_name)} works)")
    return {w: [line.rstrip() for line in by_name[w].read_text(encoding="utf-8").splitlines() if line.strip()]
            for w in works}


def own_lines(paths, choices: int = 4, min_chars: int = 12) -> dict[str, list[str]]:
    """{name: non-empty lines} of the user's held-out text files (name: the file's stem, numbered when
    two files share one); each must be UTF-8 with at least ``choices`` distinct lines of
    ``min_chars`` characters (what one next-line question needs)."""
    out: dict[str, list[str]] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"held_out: {path} is not a file; fix: give text files the model was not trained on")
        try:
            rows = [line.rstrip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError as error:
            raise ValueError(f"held_out: {path} is not UTF-8 text (byte {error.start}); fix: convert it, e.g. "
                             "iconv -t UTF-8") from None
        usable = len({row for row in rows if len(row) >= min_chars})
        if usable < choices:
            raise ValueError(f"held_out: {path} has {usable} distinct lines of >= {min_chars} characters; the "
                             f"next-line task needs at least {choices}; fix: give a longer text")
        name, n = path.stem, 2
        while name in out:
            name, n = f"{path.stem}_{n}", n + 1
        out[name] = rows
    if not out:
        raise ValueError("held_out: no files given; fix: name one or more text files")
    return out


def next_line_docs(lines: dict[str, list[str]], per_work: int = 50, choices: int = 4,
                   min_chars: int = 12) -> list[dict]:
    """Multiple-choice documents: ``context`` (two lines + newline), ``choices`` (lines), ``label``."""
    rng = random.Random(SEED)
    docs = []
    for work, rows in lines.items():
        candidates = [i for i in range(2, len(rows)) if len(rows[i]) >= min_chars]
        for i in sorted(rng.sample(candidates, min(per_work, len(candidates)))):
            true = rows[i]
            pool = [r for r in rows if len(r) >= min_chars and r != true]
            options = rng.sample(pool, choices - 1) + [true]
            rng.shuffle(options)
            docs.append({"work": work, "context": rows[i - 2] + "\n" + rows[i - 1] + "\n",
                         "choices": options, "label": options.index(true)})
    return docs


def perplexity_docs(lines: dict[str, list[str]], max_chars: int = 2000, max_docs: Optional[int] = None) -> list[dict]:
    """Documents of consecutive whole lines, each at most ``max_chars`` characters."""
    docs = []
    for work, rows in lines.items():
        current: list[str] = []
        for row in rows:
            row = row[:max_chars]
            if current and len("\n".join(current + [row])) > max_chars:
                docs.append({"work": work, "text": "\n".join(current)})
                current = []
            current.append(row)
        if current:
            docs.append({"work": work, "text": "\n".join(current)})
    return docs[:max_docs] if max_docs else docs


def build_tasks(out_dir, works: Optional[tuple[str, ...]] = None, texts: Optional[list[Path]] = None,
                next_line_per_work: int = 50, perplexity_max_chars: int = 2000,
                perplexity_max_docs: Optional[int] = None, held_out: Optional[list] = None) -> Path:
    """Write both tasks (YAMLs + JSONL data) into ``out_dir``; pass it as ``--include_path``.
    ``held_out``: text files of your own instead of the corpus's held-out plays."""
    if held_out is not None and works is not None:
        raise ValueError("held_out: give either your own held-out files or corpus works, not both")
    lines = own_lines(held_out) if held_out is not None else play_lines(works, texts)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = {"next_line.jsonl": next_line_docs(lines, per_work=next_line_per_work),
            "perplexity.jsonl": perplexity_docs(lines, perplexity_max_chars, perplexity_max_docs)}
    for name, docs in data.items():
        (out / name).write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    for task in TASKS:
        yaml = (HERE / f"{task}.yaml").read_text().replace("__DATA_DIR__", str(out))
        (out / f"{task}.yaml").write_text(yaml)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the task YAMLs and data (--include_path)")
    parser.add_argument("--held-out", nargs="+", default=None, metavar="FILE",
                        help="UTF-8 text files your run did not train on, read line by line (default: the embedded "
                             "corpus's held-out plays)")
    parser.add_argument("--next-line-per-work", type=int, default=50, help="questions per text (default: 50)")
    parser.add_argument("--perplexity-max-chars", type=int, default=2000,
                        help="characters per perplexity document (default: 2000)")
    args = parser.parse_args(argv)
    try:
        out = build_tasks(args.out, next_line_per_work=args.next_line_per_work,
                          perplexity_max_chars=args.perplexity_max_chars, held_out=args.held_out)
    except ValueError as error:  # names the field
        print(f"eval_tasks: error: {error}", file=sys.stderr)
        return 2
    source = ", ".join(args.held_out) if args.held_out else "the embedded corpus's held-out plays"
    print(f"[eval-tasks] {', '.join(TASKS)} from {source} in {out} (--include_path {out})")
    return 0
