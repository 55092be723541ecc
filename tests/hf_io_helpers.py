"""Checkpoints for the HF export/import/eval tests: tiny models trained for two iterations by the real
entry point (torchrun on CPU/gloo) at the layouts the tests need, made once per session and shared
(tests/test_hf_export.py, tests/test_hf_eval.py import the fixture)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from entry_point_helpers import REPO, common_flags, torchrun, write_byte_data

ITERS = 2
# family -> (processes, layout flags, model flags); every family at one of the three layouts.
FAMILIES = {
    "dense": (1, [], ["--num-layers", "4"]),
    "xmod": (2, ["--tensor-model-parallel-size", "2"],
             ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)*2 + D"]),
    "mod": (2, ["--pipeline-model-parallel-size", "2"],
            ["--xmod-routing-family", "mod", "--xmod-layout", "D + (S4 + D)*2 + D"]),
    # the X-MoD paper's MoE baseline recipe (sigmoid scores + expert bias, 2 shared experts), 8 experts
    "moe": (2, ["--pipeline-model-parallel-size", "2"],
            ["--moe-preset", "moe-8x64", "--num-experts", "8", "--moe-router-topk", "2", "--num-layers", "2"]),
    # DTop-p: PI-controlled threshold, learnable DRN, 8 routed + 2 shared experts, T = 2. MoE under TP
    # needs megatron's sequence parallelism (on CPU through numbered patch 21).
    "dtopp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
              ["--moe-preset", "dtopp-t2-e8", "--num-layers", "2"]),
}
LAYOUT_NAMES = {"dense": "TP1/PP1", "xmod": "TP2", "mod": "PP2", "moe": "PP2", "dtopp": "TP2 + SP"}


def train(family: str, out: Path, data: str) -> Path:
    nproc, layout, model = FAMILIES[family]
    save = out / family
    torchrun(nproc, ["-m", "megatron_xmod.pretrain"],
             common_flags(data, ITERS, "--lr-warmup-iters", "1", "--save", str(save), "--save-interval", str(ITERS),
                          "--eval-iters", "0", *layout, *model))
    return save


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """``hf_checkpoints(family)``: the --save folder of a tiny run of that family (trained on first use)."""
    root = tmp_path_factory.mktemp("hf_ckpts")
    data = write_byte_data(str(root / "bytes"))
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = train(family, root, data)
        return made[family]

    get.data = data
    return get


# Loads the folder in a Python where megatron and megatron_xmod cannot be imported.
HIDDEN = textwrap.dedent("""
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("megatron", "megatron_xmod"):
                raise ImportError(f"{name} is hidden in this test")
    sys.meta_path.insert(0, Block())
    sys.path = [p for p in sys.path if p not in ("", ".", REPO) and not p.startswith(REPO + "/tests")]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # config.json's auto_map is remote code
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    ids = tok([sys.argv[2]], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=24, do_sample=False, use_cache=True)
        plain = model.generate(ids, max_new_tokens=24, do_sample=False, use_cache=False)
        logits = model(ids).logits
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "megatron_xmod"))
    print(json.dumps({"cached": cached[0].tolist(), "plain": plain[0].tolist(), "text": tok.decode(cached[0]),
                      "loaded": loaded, "class": type(model).__module__, "logits_sum": float(logits.double().sum()),
                      "prompt_ids": ids[0].tolist()}))
""").replace("REPO", repr(str(REPO)))


def run_hidden(folder: Path, prompt: str, cwd: Path) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", HIDDEN, str(folder), prompt], capture_output=True, text=True,
                            cwd=cwd, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def megatron_logits(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The megatron model of the checkpoint (built at TP1/PP1 from its saved args, weights gathered by
    megatron's dist-checkpointing) in eval mode: the deployable threshold routing."""
    from megatron_xmod.hf.checkpoint_io import build_model, load_checkpoint, single_process_megatron

    loaded = load_checkpoint(checkpoint)
    with single_process_megatron():
        model = build_model(loaded.args)
        model.load_state_dict(loaded.state_dict)
        model.eval()
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            return model(tokens, positions, None).float()


