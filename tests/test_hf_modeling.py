"""Hugging Face model (megatron_xmod.hf): logit parity with the megatron model in eval mode, the exact
state-dict round trip, generation with the sparse KV cache, and loading an exported folder where
megatron is not installed."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import TINY
from hf_helpers import KINDS, SEQ, build_megatron, hf_twin, left_padded, megatron_logits

from megatron_xmod.hf import XModForCausalLM, XModHFConfig
from megatron_xmod.hf.cache import XModCache, dense_cache_bytes
from megatron_xmod.hf.state_dict_adapter import (
    AUTO_MAP,
    EXPORTED_FILES,
    hf_config_from_megatron,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_xmod.xmod.routing_state import set_eval_routing

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("fresh_moe_tracker")


PAD = TINY.vocab_size - 1  # never in a prompt (generate reads pad ids in a prompt as padding)


def _tokens(batch=2, length=SEQ, seed=0):
    return torch.randint(0, PAD, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- parity ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_megatron_in_eval_mode(seeded, kind):
    model, config = build_megatron(kind)
    hf = hf_twin(model, config)
    tokens = _tokens()
    expected = megatron_logits(model, tokens)
    with torch.no_grad():
        got = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    if config.layer_layout.num_sparse_layers:  # the same, with top-k routing on both sides
        set_eval_routing(model, "topk")
        with torch.no_grad():
            got_topk = hf(tokens, routing_rule="topk").logits
        torch.testing.assert_close(got_topk, megatron_logits(model, tokens), rtol=0, atol=1e-4)
        assert not torch.allclose(got_topk, got, atol=1e-3), "top-k and threshold routing should differ here"


def test_segment_topk_reaches_the_export(seeded):
    """--xmod-routing-segments 4: the HF config records it and top-k scoring ranks within the 4 segments
    (the parity above holds for this kind); read as whole-sequence top-k, the logits differ."""
    model, config = build_megatron("xmod-segments")
    hf = hf_twin(model, config)
    assert hf.config.routing_segments == 4
    tokens = _tokens()
    with torch.no_grad():
        segmented = hf(tokens, routing_rule="topk").logits
        hf.config.routing_segments = 1
        whole = hf(tokens, routing_rule="topk").logits
    assert not torch.allclose(segmented, whole, atol=1e-3)


def test_routing_is_mixed_in_the_parity_models(seeded):
    """The parity above means something only if routing selects some but not all tokens."""
    model, config = build_megatron("xmod")
    hf = hf_twin(model, config)
    cache = XModCache(hf.config)
    with torch.no_grad():
        hf(_tokens(), cache=cache, use_cache=True)
    entries = cache.entries()
    sparse = [i for i in range(hf.config.num_hidden_layers) if hf.config.is_sparse(i)]
    assert all(0 < entries[i] < 2 * SEQ for i in sparse), entries
    assert all(entries[i] == 2 * SEQ for i in range(len(entries)) if i not in sparse)


# --- state dict ----------------------------------------------------------------------------------------

def _tensors(state_dict):
    return {k: v for k, v in state_dict.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_round_trip_is_bit_identical(seeded, kind):
    model, config = build_megatron(kind)
    hf_config = hf_config_from_megatron(config, vocab_size=TINY.vocab_size, max_position_embeddings=SEQ)
    original = _tensors(model.state_dict())
    back = hf_to_megatron(megatron_to_hf(model.state_dict(), hf_config), hf_config)
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    # Transformer Engine / torch_dist naming of the fused layer norms and grouped experts
    renamed = {}
    for key, value in original.items():
        key = key.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        if not hf_config.is_moe:
            key = key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        if ".local_experts." in key:
            prefix, rest = key.split("experts.local_experts.")
            expert, name = rest.split(".", 1)
            key = f"{prefix}experts.{name}{expert}"
        renamed[key] = value
    te = hf_to_megatron(megatron_to_hf(renamed, hf_config), hf_config, layer_norm_names="te",
                        experts="grouped" if hf_config.is_moe else "sequential")
    assert te.keys() == renamed.keys() and all(torch.equal(te[k], v) for k, v in renamed.items())


def test_fused_qkv_split_follows_megatron_query_groups():
    """Rows of linear_qkv are [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]."""
    from megatron_xmod.hf.state_dict_adapter import split_qkv

    cfg = XModHFConfig(hidden_size=4, num_attention_heads=4, num_key_value_heads=2, head_dim=2, intermediate_size=4)
    rows = torch.arange(8.0).repeat_interleave(2).unsqueeze(1)  # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1 (2 rows each)
    q, k, v = split_qkv(rows, cfg)
    assert q[::2].flatten().tolist() == [0, 1, 4, 5] and k[::2].flatten().tolist() == [2, 6] and v[::2].flatten().tolist() == [3, 7]


def test_adapter_refuses_foreign_keys_and_configs(seeded):
    model, config = build_megatron("xmod")
    hf_config = hf_config_from_megatron(config, vocab_size=TINY.vocab_size, max_position_embeddings=SEQ)
    state = dict(model.state_dict())
    state["decoder.layers.0.mlp.linear_fc1.bias"] = torch.zeros(1)
    with pytest.raises(ValueError, match="state_dict: 1 entries"):
        megatron_to_hf(state, hf_config)
    del state["decoder.layers.0.mlp.linear_fc1.bias"], state["decoder.layers.2.router.weight"]
    with pytest.raises(ValueError, match="state_dict: missing decoder.layers.2.router.weight"):
        megatron_to_hf(state, hf_config)
    import dataclasses
    for field, value in (("add_bias_linear", True), ("normalization", "LayerNorm"), ("softmax_type", "off-by-one")):
        bad = dataclasses.replace(config, **{field: value}) if field != "normalization" else config
        if field == "normalization":
            object.__setattr__(bad, "normalization", value)
        with pytest.raises(ValueError, match=f"^{field}:"):
            hf_config_from_megatron(bad, vocab_size=256, max_position_embeddings=SEQ)
        config.normalization = "RMSNorm"
    with pytest.raises(ValueError, match="^position_embedding_type:"):
        hf_config_from_megatron(config, vocab_size=256, max_position_embeddings=SEQ, position_embedding_type="learned_absolute")


@pytest.mark.parametrize("fields, message", [
    (dict(layer_kinds=["dense", "sparse"], layer_sparsity_k=[1, 4], num_hidden_layers=2), "^routing_family:"),
    (dict(routing_family="xmod", layer_kinds=["dense", "sparse"], layer_sparsity_k=[1, 0], num_hidden_layers=2),
     "^layer_sparsity_k:"),
    (dict(routing_rule="random"), "^routing_rule:"),
    (dict(routing_segments=0), "^routing_segments:"),
    (dict(num_experts=4, moe_intermediate_size=8, moe_router_type="dtopp", moe_score_function="sigmoid"),
     "^moe_score_function:"),
    (dict(num_key_value_heads=3), "^num_key_value_heads:"),
])
def test_config_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        XModHFConfig(**{"num_attention_heads": 4, "hidden_size": 16, **fields})


# --- generation ----------------------------------------------------------------------------------------

def _greedy_without_cache(hf, prompt, steps):
    tokens = prompt
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(tokens, use_cache=False).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.fixture(scope="module")
def xmod_hf(megatron_parallel):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    model, config = build_megatron("xmod")
    return hf_twin(model, config)


def test_cached_generation_equals_recomputation(xmod_hf):
    prompt = _tokens(batch=1, length=7, seed=3)
    steps = 16
    generated = xmod_hf.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=PAD)
    assert torch.equal(generated, _greedy_without_cache(xmod_hf, prompt, steps))
    # The incremental cache holds what one pass over the whole text routes, entry for entry.
    incremental, one_pass = XModCache(xmod_hf.config), XModCache(xmod_hf.config)
    with torch.no_grad():
        xmod_hf(prompt, cache=incremental)
        for t in range(prompt.shape[1], generated.shape[1]):
            xmod_hf(generated[:, t:t + 1], cache=incremental)
        xmod_hf(generated, cache=one_pass)
    assert incremental.entries() == one_pass.entries()
    for a, b in zip(incremental.layers, one_pass.layers):
        (keys_a, _, _, positions_a), (keys_b, _, _, positions_b) = a.sequence(0), b.sequence(0)
        assert torch.equal(positions_a, positions_b)
        torch.testing.assert_close(keys_a, keys_b, rtol=0, atol=1e-5)
    sparse = [i for i, layer in enumerate(one_pass.layers) if layer.sparse]
    assert all(one_pass.entries()[i] < generated.shape[1] for i in sparse)


def test_left_padded_batch_generation_equals_one_by_one(xmod_hf):
    prompts = [_tokens(1, 9, seed=5)[0], _tokens(1, 4, seed=6)[0], _tokens(1, 6, seed=7)[0]]
    batch, mask = left_padded(prompts, PAD)
    width = batch.shape[1]
    steps = 6
    together = xmod_hf.generate(batch, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=PAD)
    for row, p in enumerate(prompts):
        alone = xmod_hf.generate(p[None], max_new_tokens=steps, do_sample=False, pad_token_id=PAD)
        assert torch.equal(together[row, width:], alone[0, len(p):]), row


def test_prefill_without_padding_attends_causally_without_a_mask(xmod_hf, monkeypatch):
    """A first pass without padding runs every layer's attention as plain causal attention (no mask: the
    kernel skips the blocks above the diagonal) and gives the logits of the masked path, which a padded
    batch's dense layers take (its sparse layers attend among each sequence's routed tokens, padding
    never among them: causal still)."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    tokens = _tokens(batch=3, length=SEQ, seed=11)
    with torch.no_grad():
        causal = xmod_hf(tokens).logits
        assert calls and set(calls) == {(True, True)}, calls
        calls.clear()
        padded = tokens.clone()
        padded[2, :3] = PAD
        mask = torch.ones_like(tokens)
        mask[2, :3] = 0
        masked = xmod_hf(padded, attention_mask=mask).logits
    dense_layers = sum(not layer.sparse for layer in xmod_hf.model.layers)
    assert calls.count((False, False)) == dense_layers and set(calls) == {(False, False), (True, True)}, calls
    torch.testing.assert_close(masked[:2], causal[:2], rtol=0, atol=1e-5)


def test_sparse_cache_holds_only_routed_tokens(xmod_hf):
    cfg = xmod_hf.config
    cache = XModCache(cfg)
    tokens = _tokens(batch=1, length=48, seed=9)
    with torch.no_grad():
        xmod_hf(tokens, cache=cache)
    nbytes = cache.nbytes()
    per_entry = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert nbytes["per_layer"] == [n * per_entry for n in cache.entries()]
    dense = dense_cache_bytes(cfg, 48)
    assert nbytes["total"] < dense and nbytes["dense"] == dense * (cfg.layer_kinds.count("dense")) // cfg.num_hidden_layers


# --- exported folder -------------------------------------------------------------------------------------

def _export(hf, folder):
    hf.config.auto_map = AUTO_MAP
    hf.save_pretrained(folder)
    for name, source in EXPORTED_FILES.items():
        shutil.copyfile(source, os.path.join(folder, name))


def test_exported_files_import_only_torch_and_transformers():
    """What an exported folder runs must import nothing of megatron or megatron_xmod at module level
    (the modeling file's package fallback sits in the except branch of its relative imports); Triton is
    optional (region_attention.py: ``try: import triton`` with a torch fallback)."""
    import ast

    allowed = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
    for name, source in EXPORTED_FILES.items():
        tree = ast.parse(source.read_text())
        for node in tree.body:
            if isinstance(node, ast.Try):  # try: from .x import ...  except ImportError: from megatron_xmod...
                optional = all(isinstance(n, ast.Import) and {a.name.split(".")[0] for a in n.names} == {"triton"}
                               for n in node.body)
                assert optional or all(isinstance(n, ast.ImportFrom) and n.level == 1 for n in node.body), name
                continue
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." if node.level else node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, (name, roots)


def test_moe_router_state_stays_fp32_in_a_bf16_model(tmp_path):
    cfg = XModHFConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_experts=4, moe_intermediate_size=8, moe_router_type="dtopp", moe_routing_norm="learnable")
    model = XModForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[0].mlp.router.dtopp_threshold.fill_(0.55)
    model.save_pretrained(tmp_path)
    loaded = XModForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    router = loaded.model.layers[0].mlp.router
    assert loaded.model.layers[0].mlp.experts[0].up_proj.weight.dtype == torch.bfloat16
    assert router.dtopp_threshold.dtype == torch.float32 and router.dtopp_threshold.item() == torch.tensor(0.55).item()
    assert loaded(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("router", ["topk", "dtopp"])
def test_moe_runs_each_expert_on_its_tokens_with_one_device_read(router):
    """A prefill's MoE layer equals the plain sum over each token's routed experts (weighted), top-p's
    varying number of experts a token included, and reads the device once for the whole layer."""
    from sync_counter import SyncCounter

    cfg = XModHFConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_experts=8, moe_intermediate_size=8, moe_router_type=router, moe_router_topk=2,
                       shared_expert_intermediate_size=8)
    moe = XModForCausalLM(cfg).model.layers[0].mlp
    tokens = torch.randn(3, 11, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))  # peaked scores: top-p varies
        if router == "dtopp":
            moe.router.dtopp_threshold.fill_(0.5)
        weights, routing_map = moe.router(tokens.reshape(-1, 16))
        flat = tokens.reshape(-1, 16)
        expected = torch.stack([sum(moe.experts[e](flat[t]) * weights[t, e] for e in routing_map[t].nonzero().flatten())
                                for t in range(flat.shape[0])]) + moe.shared_experts(flat)
        with SyncCounter() as syncs:
            got = moe(tokens)
    per_token = routing_map.sum(1)
    assert router == "topk" or per_token.min() < per_token.max(), per_token  # top-p: tokens take 1, 2, ... experts
    assert routing_map.any(0).sum() >= 4  # several experts ran
    torch.testing.assert_close(got.reshape(-1, 16), expected, rtol=0, atol=1e-6)
    assert syncs.count == 1, syncs.summary()


HIDE_MEGATRON = textwrap.dedent("""
    import importlib.abc, json, sys
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("megatron", "megatron_xmod"):
                raise ImportError(f"{name} is hidden")
    sys.meta_path.insert(0, Hide())
    repo = sys.argv[5]  # the checkout is off the path too (only site-packages: torch, transformers)
    sys.path = [p for p in sys.path if p not in ("", ".") and not (p + "/").startswith((repo + "/megatron", repo + "/tests"))
                and p != repo]
    import torch
    from transformers import AutoModelForCausalLM
    folder, prompt, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    leaked = [m for m in sys.modules if m.split(".")[0] in ("megatron", "megatron_xmod")]
    assert not leaked, leaked
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=int(sys.argv[4]))
    module = sys.modules[type(model).__module__]
    print(json.dumps({"tokens": out[0].tolist(), "module_file": module.__file__}))
""")


@pytest.mark.slow
def test_exported_folder_generates_without_megatron(xmod_hf, tmp_path):
    folder = tmp_path / "export"
    _export(xmod_hf, folder)
    for name, source in EXPORTED_FILES.items():  # the routing rules travel as verbatim copies
        assert (folder / name).read_bytes() == source.read_bytes(), name
    assert json.loads((folder / "config.json").read_text())["auto_map"] == AUTO_MAP
    prompt = _tokens(1, 6, seed=11)
    expected = xmod_hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD)[0].tolist()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    result = subprocess.run([sys.executable, "-c", HIDE_MEGATRON, str(folder), json.dumps(prompt[0].tolist()), "8", str(PAD),
                             str(REPO)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["tokens"] == expected
    module_dir = os.path.dirname(loaded["module_file"])
    assert "megatron_xmod" not in module_dir
    for name, source in EXPORTED_FILES.items():  # what transformers imported is the package's code, byte for byte
        assert open(os.path.join(module_dir, name), "rb").read() == source.read_bytes(), name


def test_import_registers_with_auto_classes(xmod_hf, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    xmod_hf.save_pretrained(tmp_path)  # no code files, no auto_map: the registration must find the classes
    assert isinstance(AutoConfig.from_pretrained(tmp_path), XModHFConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is XModForCausalLM
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, xmod_hf(tokens).logits, rtol=0, atol=0)


def test_packed_documents_score_like_separate_sequences(xmod_hf):
    """transformers' packing convention (position_ids restarting for each document, as
    DataCollatorWithFlattening writes them): each document's logits equal those of the document alone
    (the threshold rule routes token by token, and attention stays inside the document); without the
    restarting positions the second document attends to the first."""
    from megatron_xmod.hf.modeling_xmod import packed_documents

    first, second = _tokens(1, 9, seed=11), _tokens(1, 13, seed=12)
    packed = torch.cat([first, second], dim=1).expand(2, -1)  # two rows: documents are found per row
    positions = torch.cat([torch.arange(9), torch.arange(13)])[None]
    assert packed_documents(positions).tolist() == [[0] * 9 + [1] * 13]
    assert packed_documents(torch.arange(22)[None]) is None
    with torch.no_grad():
        out = xmod_hf(packed, position_ids=positions)
        alone = [xmod_hf(t, use_cache=False).logits for t in (first, second)]
        crossed = xmod_hf(packed, use_cache=False).logits  # the same tokens as one document
    torch.testing.assert_close(out.logits[:, :9], alone[0].expand(2, -1, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[:, 9:], alone[1].expand(2, -1, -1), atol=1e-5, rtol=1e-5)
    assert (crossed[:, 9:] - alone[1]).abs().max() > 1e-3
    assert out.past_key_values is None  # several documents in a row: nothing to continue generating from
