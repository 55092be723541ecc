"""Routing state belongs to the built model: two models share nothing, specs stay data, and a
sparse layer builds from its spec inside a model whose config is megatron's plain TransformerConfig."""
import dataclasses

import torch
from helpers import TINY, tiny_model
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_xmod.model import build_gpt_model, sparse_layers
from megatron_xmod.xmod.block import get_xmod_decoder_block_spec
from megatron_xmod.xmod.routing import SparseLayerRouting
from megatron_xmod.xmod.routing_state import attach_routing_state, report, routing_states, set_eval_routing

SEQ = 32


def _run(model, batch=2, seed=0):
    tokens = torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed))
    return model(tokens, torch.arange(SEQ).expand_as(tokens), None)


def test_two_models_from_one_spec_share_nothing(seeded):
    _, config = tiny_model("D + (S4*2 + D)")
    spec = get_xmod_decoder_block_spec(config, use_transformer_engine=False)
    first = build_gpt_model(config, 256, SEQ, rotary_base=TINY.rotary_base, transformer_layer_spec=spec)
    second = build_gpt_model(config, 256, SEQ, rotary_base=TINY.rotary_base, transformer_layer_spec=spec)
    (state_a,), (state_b,) = routing_states(first), routing_states(second)
    assert state_a is not state_b
    assert all(layer.routing_state is state_a for layer in sparse_layers(first))
    # the spec holds data only: no live object that the two models could share
    for layer_spec in spec.layer_specs:
        for value in layer_spec.params.values():
            assert isinstance(value, SparseLayerRouting)
    first.train()
    second.eval()
    set_eval_routing(second, "topk")
    with torch.no_grad():
        _run(first, batch=2)
    assert state_a.eval_rule == "threshold" and state_b.eval_rule == "topk"
    assert state_b.take_bias(3, (SEQ, 2)) == (None, None)  # no bias handed over from the other model
    with torch.no_grad():
        _run(second, batch=3)
    stats_a, stats_b = report(first), report(second)
    # routing statistics carry the mode's prefix; the health count of non-finite logits is kept in both
    routing_a = [name for name in stats_a if not name.startswith("nonfinite_router_logits")]
    routing_b = [name for name in stats_b if not name.startswith("nonfinite_router_logits")]
    assert routing_a and all(not name.startswith("eval_") for name in routing_a)
    assert routing_b and all(name.startswith("eval_") for name in routing_b)
    assert stats_b["eval_selected_fraction"] == 0.25  # second's top-k rule, not first's


def test_sparse_layer_spec_builds_under_a_plain_transformer_config(seeded):
    """The routing settings travel in the spec params: a plain TransformerConfig model equals the
    XModConfig model with the same weights, including a non-default tau and gate init."""
    model, config = tiny_model("D + (S4*2 + D)", xmod_token_choice_bias_tau=1.5, xmod_gate_scale_init=0.5)
    spec = get_xmod_decoder_block_spec(config, use_transformer_engine=False)
    plain_fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    plain = TransformerConfig(**plain_fields)
    assert type(plain) is TransformerConfig and not hasattr(plain, "layer_layout")
    other = GPTModel(config=plain, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=TINY.rotary_base)
    attach_routing_state(other)
    assert [layer.gate_scale.item() for layer in sparse_layers(other)] == [0.5, 0.5]
    other.load_state_dict(model.state_dict())
    for m in (model, other):
        with torch.no_grad():  # routers decisive enough that tau changes the routed sets
            for layer in sparse_layers(m):
                layer.router.weight.mul_(20)
    for training in (True, False):
        model.train(training)
        other.train(training)
        with torch.no_grad():
            torch.testing.assert_close(_run(other), _run(model), rtol=0, atol=0)
