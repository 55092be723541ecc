"""``--spec megatron_xmod.spec <name>``: the layer spec builds the layout's layers under megatron's
plain TransformerConfig, one stage at a time, and equals the model our own builders make."""
import dataclasses

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_xmod import spec as xmod_spec
from megatron_xmod.accounting import count_model
from megatron_xmod.layers import XModSparseLayer
from megatron_xmod.model import sparse_layers
from megatron_xmod.routing_state import routing_states

from helpers import TINY, tiny_model

SEQ = 32


def _plain(config, **changes):
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    return TransformerConfig(**{**fields, **changes})


def _gpt(config, layer_spec):
    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=TINY.vocab_size, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=TINY.rotary_base)


@pytest.mark.parametrize("layout, family", [("D + (S4*2 + D)*2", "xmod"), ("D + (S4 + D)*2", "mod")])
def test_spec_model_equals_the_builders_model(seeded, layout, family):
    torch.manual_seed(5)
    ours, config = tiny_model(layout, xmod_routing_family=family, xmod_token_choice_bias_tau=0.7)
    torch.manual_seed(5)
    theirs = _gpt(_plain(config), xmod_spec.layout_spec(layout, family=family, token_choice_bias_tau=0.7))
    assert sum(p.numel() for p in theirs.parameters()) == count_model(TINY, config.layer_layout, SEQ).total_params
    assert [type(m).__name__ for m in theirs.decoder.layers] == [type(m).__name__ for m in ours.decoder.layers]
    (state,) = routing_states(theirs)  # one routing state for the chunk, attached while building
    assert all(layer.routing_state is state for layer in sparse_layers(theirs))
    for name, tensor in ours.state_dict().items():
        if torch.is_tensor(tensor):
            assert torch.equal(tensor, theirs.state_dict()[name]), name  # same weights from the same seed
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand_as(tokens)
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        with torch.no_grad():
            torch.testing.assert_close(theirs(tokens, positions, None), ours(tokens, positions, None), rtol=0, atol=0)


def test_spec_named_models_and_errors(seeded):
    assert xmod_spec.xmod_a3k16.params["xmod"].parsed().num_layers == 298
    assert xmod_spec.mod.params["xmod"].parsed().family == "mod"
    _, config = tiny_model("D*4")
    with pytest.raises(ValueError, match="num_layers: 4 does not match"):
        _gpt(_plain(config), xmod_spec.layout_spec("D + (S4*4 + D)"))
    with pytest.raises(ValueError, match="apply_rope_fusion"):
        _gpt(_plain(config, num_layers=4, apply_rope_fusion=True), xmod_spec.layout_spec("D + (S4*2 + D)"))


def test_two_models_from_one_spec_get_two_states(seeded):
    _, config = tiny_model("D + (S4*2 + D)")
    layer_spec = xmod_spec.layout_spec("D + (S4*2 + D)")
    first, second = _gpt(_plain(config), layer_spec), _gpt(_plain(config), layer_spec)
    assert routing_states(first)[0] is not routing_states(second)[0]
    assert xmod_spec.LayoutLayer._chunk_state is None  # nothing outlives a build
    assert all(isinstance(m, XModSparseLayer) for m in first.decoder.layers[1:3])
