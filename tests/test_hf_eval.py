"""lm-evaluation-harness on an exported checkpoint, offline, on the tasks built from the held-out plays
(megatron_xmod.hf.eval_tasks). The perplexity lm-eval reports must be the loss the megatron model
itself computes on the same documents (token-weighted), and the multiple-choice accuracy the choice
megatron's log-likelihoods pick."""
import json
import os
import re
import subprocess
import sys

import hf_io_helpers
import pytest
import torch

from megatron_xmod.hf.eval_tasks import build_tasks, perplexity_docs

hf_checkpoints = hf_io_helpers.hf_checkpoints  # the session's shared checkpoints


def _fake_plays(tmp_path):
    lines = [f"Line {i} of the play, spoken by {('ARIEL', 'PROSPERO', 'MIRANDA')[i % 3]}." for i in range(40)]
    path = tmp_path / "tempest_gut.txt"
    path.write_text("\n".join(lines) + "\n\n")
    return [path]


def test_tasks_are_deterministic_and_well_formed(tmp_path):
    texts = _fake_plays(tmp_path)
    a = build_tasks(tmp_path / "a", works=("tempest",), texts=texts, next_line_per_work=10, perplexity_max_chars=120)
    b = build_tasks(tmp_path / "b", works=("tempest",), texts=texts, next_line_per_work=10, perplexity_max_chars=120)
    for name in ("next_line.jsonl", "perplexity.jsonl"):
        assert (a / name).read_text() == (b / name).read_text()
    docs = [json.loads(line) for line in (a / "next_line.jsonl").read_text().splitlines()]
    assert len(docs) == 10
    lines = texts[0].read_text().split("\n")
    for doc in docs:
        assert len(doc["choices"]) == 4 and len(set(doc["choices"])) == 4
        first, second = doc["context"].rstrip("\n").split("\n")
        i = lines.index(second)
        assert lines[i - 1] == first and doc["choices"][doc["label"]] == lines[i + 1]
    ppl = [json.loads(line)["text"] for line in (a / "perplexity.jsonl").read_text().splitlines()]
    assert all(len(t) <= 120 for t in ppl) and "\n".join(ppl).split("\n") == [x for x in lines if x]
    assert str(a) in (a / "xmod_perplexity.yaml").read_text()


class MegatronScorer:
    """The megatron model of a checkpoint (built at TP1/PP1 from its saved args, weights gathered by
    megatron's dist-checkpointing) in eval mode: the deployable threshold routing."""

    def __init__(self, checkpoint):
        from megatron_xmod.hf.checkpoint_io import build_model, load_checkpoint, single_process_megatron

        self._context = single_process_megatron()
        self._context.__enter__()
        loaded = load_checkpoint(checkpoint)
        self.model = build_model(loaded.args)
        self.model.load_state_dict(loaded.state_dict)
        self.model.eval()

    def nll(self, ids, targets_from):
        """Summed negative log-likelihood of ids[targets_from:] given what precedes them."""
        tokens = torch.tensor([ids[:-1]])
        with torch.no_grad():
            logits = self.model(tokens, torch.arange(tokens.shape[1])[None], None)[0].double()
        picked = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        return -float(picked[targets_from - 1:].sum())

    def close(self):
        self._context.__exit__(None, None, None)


@pytest.mark.slow
def test_lm_eval_runs_offline_and_agrees_with_the_model(hf_checkpoints, tmp_path):
    from megatron_xmod.data.corpus import ensure_texts
    from megatron_xmod.hf.eval_tasks import play_lines
    from megatron_xmod.hf.export import export_checkpoint

    checkpoint = hf_checkpoints("xmod")  # X-MoD, saved at TP2, byte tokenizer, 64-token context
    folder = tmp_path / "hf"
    export_checkpoint(checkpoint, folder, dtype="fp32", progress=False)
    # Perplexity documents that fit the model's 64-token context in one window (EOD + at most 63 bytes).
    lines = play_lines(("tempest",), ensure_texts())
    tasks = build_tasks(tmp_path / "tasks", works=("tempest",), next_line_per_work=8, perplexity_max_chars=60,
                        perplexity_max_docs=12)
    mc = [json.loads(line) for line in (tasks / "next_line.jsonl").read_text().splitlines()]
    assert len(mc) == 8
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "ds_cache"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={folder},trust_remote_code=True,dtype=float32", "--tasks", "xmod_next_line,xmod_perplexity",
               "--include_path", str(tasks), "--device", "cpu", "--batch_size", "1", "--output_path",
               str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = sorted((tmp_path / "out").rglob("results*.json"))
    assert files, result.stdout[-2000:]
    results = json.loads(files[-1].read_text())["results"]

    # perplexity: lm-eval scores [EOD] + document bytes in one window; the same through megatron
    docs = [json.loads(line)["text"] for line in (tasks / "perplexity.jsonl").read_text().splitlines()]
    assert docs == [d["text"] for d in perplexity_docs(lines, 60, 12)] and all(len(d.encode()) <= 63 for d in docs)
    eod = 255
    scorer = MegatronScorer(checkpoint)
    nll = sum(scorer.nll([eod] + list(d.encode()), 1) for d in docs)
    tokens = sum(len(d.encode()) for d in docs)
    loss = nll / tokens
    reported = results["xmod_perplexity"]
    assert reported["byte_perplexity,none"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-4)
    assert reported["bits_per_byte,none"] == pytest.approx(loss / torch.log(torch.tensor(2.0)).item(), rel=1e-4)
    words = sum(len(re.split(r"\s+", d)) for d in docs)  # lm-eval's word count
    assert reported["word_perplexity,none"] == pytest.approx(torch.tensor(nll / words).exp().item(), rel=1e-4)

    # multiple choice: the choice with the highest log-likelihood (and per character, acc_norm)
    hits, hits_norm = 0, 0
    for doc in mc:
        scores = []
        for choice in doc["choices"]:
            # lm-eval moves the context's trailing whitespace (our "\n") into the scored continuation and
            # keeps the last 64 + 1 tokens (its left truncation)
            context = doc["context"].rstrip()
            continuation = doc["context"][len(context):] + choice
            window = (list(context.encode()) + list(continuation.encode()))[-65:]
            scores.append(-scorer.nll(window, len(window) - len(continuation.encode())))
        hits += max(range(4), key=lambda i: scores[i]) == doc["label"]
        hits_norm += max(range(4), key=lambda i: scores[i] / len(doc["choices"][i])) == doc["label"]
    scorer.close()
    assert results["xmod_next_line"]["acc,none"] == pytest.approx(hits / len(mc))
    assert results["xmod_next_line"]["acc_norm,none"] == pytest.approx(hits_norm / len(mc))
