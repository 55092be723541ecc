"""The megatron sparse layers against an independent plain-torch implementation of Eq.(6)/(7)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_xmod.xmod.block import get_layer_submodules
from megatron_xmod.xmod.config import XModConfig
from megatron_xmod.xmod.layers import XModSparseLayer
from megatron_xmod.xmod.routing_state import RoutingState

HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, BASE = 32, 4, 2, 8, 64, 10000.0


def make_config(**fields):
    return XModConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                      kv_channels=HEAD_DIM, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6,
                      gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
                      hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                      xmod_routing_family=fields.pop("family", "xmod"), xmod_layout="S4 + D", **fields)


def make_layer(config, sparsity_k=4, family="xmod", submodules=None):
    routing = dataclasses.replace(config.sparse_layer_routing(config.layer_layout.layers[0]),
                                  sparsity_k=sparsity_k, family=family)
    spec = ModuleSpec(module=XModSparseLayer, submodules=submodules or get_layer_submodules(config, False),
                      params=dict(routing=routing))
    layer = build_module(spec, config=config, layer_number=1)
    layer.routing_state = RoutingState()
    with torch.no_grad():  # random, not-small weights everywhere (norm weights too)
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0))
    return layer


def rope_freqs(seq_len):
    inv_freq = 1.0 / BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], -1)[:, None, None, :]  # [s, 1, 1, d]


# ---------------------------------------------------------------- independent reference
def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(t, positions):
    inv_freq = 1.0 / BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = positions[:, None].float() * inv_freq[None]  # [n, d/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [n, 1, d/2]
    t1, t2 = t[..., : HEAD_DIM // 2], t[..., HEAD_DIM // 2 :]
    return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)


def reference_branches(w, x, positions, allowed=None):
    """a and f of a pre-norm GQA/SwiGLU/QK-norm layer on the token sequence x [n, h] at ``positions``;
    ``allowed`` [n, n]: which keys each query may attend to (default: causal)."""
    n = x.shape[0]
    qkv = rms(x, w["input_layernorm.weight"]) @ w["self_attention.linear_qkv.weight"].T
    per_group = qkv.view(n, GROUPS, (HEADS // GROUPS + 2) * HEAD_DIM)
    q, k, v = per_group.split([HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    q = rms(q.reshape(n, HEADS, HEAD_DIM), w["self_attention.q_layernorm.weight"])
    k = rms(k.reshape(n, GROUPS, HEAD_DIM), w["self_attention.k_layernorm.weight"])
    v = v.reshape(n, GROUPS, HEAD_DIM)
    q, k = rotate(q, positions), rotate(k, positions)
    k, v = k.repeat_interleave(HEADS // GROUPS, 1), v.repeat_interleave(HEADS // GROUPS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    if allowed is None:
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    context = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    a = context @ w["self_attention.linear_proj.weight"].T
    gate_up = rms(x + a, w["pre_mlp_layernorm.weight"]) @ w["mlp.linear_fc1.weight"].T
    gate, up = gate_up.chunk(2, -1)
    f = (F.silu(gate) * up) @ w["mlp.linear_fc2.weight"].T
    return a, f


def reference_layer(w, x, family, sparsity_k, rule, document_ids=None, router_dtype=None):
    """Eq.(6)/(7) sequence by sequence: route, run the layer on the routed tokens, gate, scatter.
    ``document_ids`` [s, b]: a routed token attends only to the earlier routed tokens of its own
    document; ``router_dtype``: the router logits rounded to it (the layer routes in fp32)."""
    out = x.clone()
    for j in range(x.shape[1]):
        s = x[:, j] @ w["router.weight"][0] + w["router.bias"][0]
        if router_dtype is not None:
            s = s.to(router_dtype)
        if rule == "topk":
            chosen = torch.argsort(s, descending=True)[: x.shape[0] // sparsity_k].sort().values
        else:
            chosen = torch.nonzero(torch.sigmoid(s) >= 0.5)[:, 0]
        if len(chosen) == 0:
            continue
        allowed = None
        if document_ids is not None:
            doc = document_ids[chosen, j]
            allowed = (doc[:, None] == doc[None, :]) & torch.ones(len(chosen), len(chosen), dtype=torch.bool).tril()
        a, f = reference_branches(w, x[chosen, j], chosen, allowed)
        r = torch.sigmoid(s[chosen]).to(x.dtype)[:, None]
        if family == "xmod":
            out[chosen, j] = x[chosen, j] + w["gate_scale"] * r * (a + f)
        else:
            out[chosen, j] = x[chosen, j] + a + r * f
    return out


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("family", ["xmod", "mod"])
@pytest.mark.parametrize("rule, core", [("topk", "sdpa"), ("threshold", "sdpa"), ("threshold", "megatron")])
def test_sparse_layer_matches_reference(seeded, family, rule, core):
    """threshold + sdpa: padded batch with a mask; threshold + megatron's own core attention (which
    only knows its causal mask type): sequence by sequence."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    config = make_config(family=family)
    submodules = None if core == "sdpa" else get_gpt_layer_local_submodules(qk_layernorm=True, normalization="RMSNorm")
    layer = make_layer(config, family=family, submodules=submodules)
    layer.train(rule == "topk")
    x = torch.randn(16, 3, HIDDEN)
    out, _ = layer(x, rotary_pos_emb=rope_freqs(16))
    weights = {k: v.detach() for k, v in layer.state_dict().items() if torch.is_tensor(v)}
    expected = reference_layer(weights, x, family, 4, rule)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    routed = (out != x).any(-1)
    if rule == "topk":
        assert routed.sum(0).tolist() == [4, 4, 4]  # exactly L/K per sequence
    else:  # sequences route different numbers of tokens, so padding was exercised
        assert len(set(routed.sum(0).tolist())) > 1
    # non-routed tokens pass through bit-identical
    assert torch.equal(out[~routed], x[~routed])


def test_k1_gate1_equals_dense_layer(seeded):
    config = make_config()
    sparse = make_layer(config, sparsity_k=1)
    dense = build_module(ModuleSpec(module=TransformerLayer, submodules=get_layer_submodules(config, False)),
                         config=config, layer_number=1)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith(("router", "gate_scale"))})
    with torch.no_grad():  # r = sigmoid(bias) everywhere, varsigma = 1/r: the gate is exactly 1
        sparse.router.weight.zero_()
        sparse.router.bias.fill_(0.3)
        sparse.gate_scale.fill_(1 / torch.sigmoid(torch.tensor(0.3)).item())
    sparse.train()
    x = torch.randn(12, 2, HIDDEN)
    freqs = rope_freqs(12)
    out_sparse, _ = sparse(x, rotary_pos_emb=freqs)
    out_dense, _ = dense(x, rotary_pos_emb=freqs)
    torch.testing.assert_close(out_sparse, out_dense, atol=1e-5, rtol=1e-5)


def test_router_and_gate_scale_receive_gradient(seeded):
    layer = make_layer(make_config())
    layer.train()
    x = torch.randn(16, 2, HIDDEN, requires_grad=True)
    out, _ = layer(x, rotary_pos_emb=rope_freqs(16))
    (out ** 2).sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.gate_scale.grad.abs().sum() > 0


def test_bce_gradient_reaches_router_through_autoscaler(seeded):
    """With the layer's output detached from the loss, only Eq.(9) can move the router."""
    config = make_config(xmod_router_bce_coeff=1.0)
    layer = make_layer(config)
    layer.train()
    x = torch.randn(16, 2, HIDDEN)
    out, _ = layer(x, rotary_pos_emb=rope_freqs(16))
    out.sum().backward()
    grad_with_bce = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.routing = dataclasses.replace(layer.routing, router_bce_coeff=0.0)
    out, _ = layer(x, rotary_pos_emb=rope_freqs(16))
    out.sum().backward()
    assert not torch.allclose(grad_with_bce, layer.router.weight.grad)


def test_sdpa_core_attention_matches_megatron_dot_product_attention(seeded):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    config = make_config()
    ours = build_module(ModuleSpec(module=TransformerLayer, submodules=get_layer_submodules(config, False)),
                        config=config, layer_number=1)
    megatron_own = build_module(ModuleSpec(module=TransformerLayer, submodules=get_gpt_layer_local_submodules(
        qk_layernorm=True, normalization="RMSNorm")), config=config, layer_number=1)
    megatron_own.load_state_dict(ours.state_dict())
    x = torch.randn(10, 2, HIDDEN)
    torch.testing.assert_close(ours(x, rotary_pos_emb=rope_freqs(10))[0],
                               megatron_own(x, rotary_pos_emb=rope_freqs(10))[0], atol=1e-5, rtol=1e-5)


def test_router_bce_keeps_its_weight_with_per_token_loss(seeded):
    """megatron's ``calculate_per_token_loss`` sums the LM loss over tokens and divides every
    gradient by the token count at the end; the router BCE (a per-token mean) must then enter as a
    sum, or it is shrunk by the micro-batch's token count. Both modes must give the same gradient."""
    grads = {}
    for per_token in (False, True):
        torch.manual_seed(0)
        layer = make_layer(make_config(xmod_router_bce_coeff=1.0, calculate_per_token_loss=per_token))
        layer.train()
        x = torch.randn(16, 2, HIDDEN)
        out, _ = layer(x, rotary_pos_emb=rope_freqs(16))
        (out * 0).sum().backward()  # only the BCE, through the autoscaler, reaches the router
        grad = layer.router.weight.grad.clone()
        grads[per_token] = grad / x.shape[0] / x.shape[1] if per_token else grad  # megatron's final division
    assert grads[False].abs().sum() > 0
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", ["topk", "topk_sequence_parallel", "threshold_nothing_routed",
                                  "threshold_megatron_core"])
def test_output_is_not_a_view(seeded, path):
    """What megatron's TransformerLayer returns (make_viewless_tensor): megatron's pipeline frees a
    stage's output with deallocate_output_tensor, which asserts it is no view (issue 26: a --spec
    stage ending on a sparse layer died at iteration 1). The views were the router-BCE autoscaler's
    output (its input handed back), the sequence-parallel path's ``view_as``, and the input itself
    when nothing is routed. The router-input chain (megatron_xmod.xmod.routing_state) fingerprints the
    object returned. ``topk_sequence_parallel``: the sequence-parallel branch on one rank
    (T = 1: the same result as without it, bit for bit)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    local = get_gpt_layer_local_submodules(qk_layernorm=True, normalization="RMSNorm")
    layer = make_layer(make_config(xmod_router_bce_coeff=0.0 if path == "topk_sequence_parallel" else 1e-4),
                       submodules=local if path == "threshold_megatron_core" else None)
    layer.train(path.startswith("topk"))
    x = torch.randn(16, 2, HIDDEN, requires_grad=True)
    if path == "threshold_nothing_routed":
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.bias.fill_(-10.0)  # sigmoid < 0.5 everywhere
        x = torch.randn(16, 2, 2 * HIDDEN)[..., :HIDDEN].requires_grad_()  # a view as input (a leaf)
    expected = None
    if path == "topk_sequence_parallel":
        expected = layer(x, rotary_pos_emb=rope_freqs(16))[0].detach()
        layer.config.sequence_parallel = True  # the layer's TP group has one rank
    out, _ = layer(x, rotary_pos_emb=rope_freqs(16))
    assert out._base is None
    if path != "threshold_nothing_routed":  # (routing nothing, the layer keeps no graph, so no chain base)
        # the router-input chain was handed this very object: the next routed layer takes it up
        assert layer.routing_state.router_inputs.take(layer.layer_number + 1, out) is not None
    if path == "threshold_nothing_routed":
        assert torch.equal(out, x)
    if expected is not None:
        assert torch.equal(out, expected)
    if layer.training:  # the gradient still reaches the router through it
        out.square().sum().backward()
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
