"""Small builders shared by the tests (tiny backbones so that CPU runs take seconds)."""
import os
import subprocess
import sys
import tempfile

import torch

from megatron_xmod.model import build_gpt_model, config_from_backbone
from megatron_xmod.presets import Backbone

TINY = Backbone("tiny", hidden_size=64, head_dim=16, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, num_layers=4, vocab_size=256, rotary_base=10000)


def tiny_model(layout: str, vocab_size: int = 256, seq_len: int = 64, **overrides):
    """``overrides`` go to the config, e.g. xmod_routing_family="mod", xmod_token_choice_bias_tau=0."""
    config = config_from_backbone(TINY, layout, use_cpu_initialization=True, **overrides)
    return build_gpt_model(config, vocab_size, seq_len, rotary_base=TINY.rotary_base), config


def english_bytes() -> torch.Tensor:
    """Real English prose that ships with Python itself (stdlib docstrings), as byte tokens."""
    import argparse
    import collections
    import csv
    import difflib
    import email
    import json
    import logging
    import pathlib
    import subprocess
    import threading
    text = "\n\n".join(m.__doc__ for m in (argparse, collections, csv, difflib, email, json, logging,
                                            pathlib, subprocess, threading) if m.__doc__)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def record_in_place(layers) -> list:
    """Hooks on megatron ``layers``: the list gets, per call, whether the layer's output shares its input's storage
    (its update was written into the input in place)."""
    in_place = []

    def same_storage(layer, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        in_place.append(output[0].untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr())

    for layer in layers:
        layer.register_forward_hook(same_storage, with_kwargs=True)
    return in_place


def run_triton_interp_tests(test_file: str, kernels: set[str], drop_env=(), timeout: int = 300) -> str:
    """Run ``test_file``'s ``triton_interp_`` tests in a child pytest under TRITON_INTERPRET=1, which must be
    set before Triton defines its kernels; they must pass and none be skipped. Then every kernel launch they
    made must compile for A100 and H100 (sm_80, sm_90) within a block's resources, without spilling, and
    ``kernels`` must be among them (triton_targets.check_compiled). ``drop_env``: variables the child must
    not inherit besides MASTER_ADDR / MASTER_PORT (conftest exports those for this session's process group:
    the child needs its own). Returns the child's summary line."""
    from triton_targets import check_compiled, compile_for_gpus

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", *drop_env)}
    env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        env["XMOD_TRITON_LAUNCHES"] = launches = os.path.join(folder, "launches.json")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "triton_interp_"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        assert " passed" in last and "skipped" not in last, last
        check_compiled(compile_for_gpus(launches), kernels)
    return last
