"""``--spec megatron_xmod.spec <name>``: the layer spec builds the layout's layers under megatron's
plain TransformerConfig, one stage at a time, and equals the model our own builders make."""
import dataclasses

import pytest
import torch
from helpers import TINY, tiny_model
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_xmod import spec as xmod_spec
from megatron_xmod.accounting import count_model
from megatron_xmod.model import sparse_layers
from megatron_xmod.xmod.layers import XModSparseLayer
from megatron_xmod.xmod.routing_state import routing_states

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
    for model in (first, second):  # nothing outlives a build (it travels on the block's process-group collection)
        assert not hasattr(model.decoder.pg_collection, xmod_spec.SpecChunkBuild.ATTRIBUTE)
    assert all(isinstance(m, XModSparseLayer) for m in first.decoder.layers[1:3])


def _builder_config(config, layer_spec):
    from megatron.training.models.gpt import GPTModelConfig

    return GPTModelConfig(transformer=_plain(config), transformer_layer_spec=layer_spec, vocab_size=TINY.vocab_size,
                          seq_length=SEQ, position_embedding_type="rope", rotary_base=TINY.rotary_base,
                          share_embeddings_and_output_weights=False)


@pytest.mark.parametrize("as_callable", [False, True])
def test_gpt_model_builder_builds_the_routed_layers(seeded, as_callable):
    """megatron's GPTModelBuilder (what Megatron-LM 0.19's pretrain_gpt.py builds through) uses a
    ModuleSpec as it is and calls a callable one with (GPTModelConfig, vp_stage=...)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    layout = "D + (S4*2 + D)*2"
    _, config = tiny_model(layout)
    seen = []

    def callable_spec(model_config, vp_stage=None):
        seen.append((type(model_config).__name__, vp_stage))
        return xmod_spec.layout_spec(layout)

    layer_spec = callable_spec if as_callable else xmod_spec.layout_spec(layout)
    model = GPTModelBuilder(_builder_config(config, layer_spec)).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
    assert seen == ([("GPTModelConfig", None)] if as_callable else [])
    assert sum(p.numel() for p in model.parameters()) == count_model(TINY, config.layer_layout, SEQ).total_params
    assert [type(m).__name__ for m in model.decoder.layers] == ["TransformerLayer"] + (["XModSparseLayer"] * 2 + ["TransformerLayer"]) * 2
    (state,) = routing_states(model)
    assert state.eval_rule == "threshold"  # evaluation routes by the causal threshold unless told otherwise


def test_gpt_model_builder_with_local_attention_backend(seeded, monkeypatch):
    """GPTModelBuilder sets spec.submodules.self_attention.submodules.core_attention for
    --attention-backend local: every layer of the layout is built with megatron's local attention,
    and the routed model still runs forward and backward."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend
    from megatron.training.models.gpt import GPTModelBuilder

    layout = "D + (S4*2 + D)"
    _, config = tiny_model(layout)
    model_config = _builder_config(config, xmod_spec.layout_spec(layout))
    model_config.transformer.attention_backend = AttnBackend.local
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # each build sets them for its backend
        monkeypatch.delenv(name, raising=False)
    model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                                      pre_process=True, post_process=True)
    assert [type(m).__name__ for m in model.decoder.layers] == ["TransformerLayer", "XModSparseLayer", "XModSparseLayer", "TransformerLayer"]
    assert all(type(m.self_attention.core_attention) is DotProductAttention for m in model.decoder.layers)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=tokens)
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    # another spec object is unaffected: it builds the plugin's own attention
    monkeypatch.delenv("NVTE_FLASH_ATTN")
    monkeypatch.delenv("NVTE_FUSED_ATTN")
    monkeypatch.delenv("NVTE_UNFUSED_ATTN")
    fresh = _gpt(_plain(config), xmod_spec.layout_spec(layout))
    assert type(fresh.decoder.layers[1].self_attention.core_attention) is not DotProductAttention


def test_router_bce_coefficient_reaches_the_gradient(seeded):
    """Megatron-LM's loss_func only sums the LM loss: the router BCE must reach the gradient from
    inside the layer (RouterLossAutoScaler), so the coefficient changes the router's gradient."""
    layout = "D + (S4*2 + D)"
    _, config = tiny_model(layout)
    grads = []
    for coefficient in (0.0, 1.0):
        torch.manual_seed(5)
        model = _gpt(_plain(config), xmod_spec.layout_spec(layout, router_bce_coeff=coefficient))
        tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(SEQ).expand_as(tokens)
        model(tokens, positions, None, labels=tokens).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if "router" in name})
    assert grads[0], "no router parameters found"
    for name in grads[0]:
        assert not torch.allclose(grads[0][name], grads[1][name]), name


def test_spec_check_cli_lets_import_errors_through(capsys):
    """megatron's import_module logs an ImportError and builds its dense default; the check does not."""
    assert xmod_spec.main(["megatron_xmod.spec", "xmod_a3k16", "--num-layers", "298"]) == 0
    assert "xmod, 298 layers (288 routed): D*4 + (S16*48 + D)*6" in capsys.readouterr().out
    assert xmod_spec.main(["megatron_xmod.spec", "xmod_a3k16", "--num-layers", "28"]) == 2
    assert "num_layers: 28 does not match the --spec layout" in capsys.readouterr().err
    assert xmod_spec.main(["megatron_xmod.spek", "xmod_a3k16"]) == 2
    assert "No module named 'megatron_xmod.spek'" in capsys.readouterr().err
    assert xmod_spec.main(["megatron_xmod.spec", "xmod_a3k61"]) == 2
    assert "has no 'xmod_a3k61'" in capsys.readouterr().err
    assert xmod_spec.main(["megatron_xmod.spec", "LayoutSpecLayer"]) == 2
    assert "not a megatron_xmod layout spec" in capsys.readouterr().err


@pytest.mark.parametrize("split,starts", [
    (dict(pipeline_model_parallel_size=2), [0, 4]),
    (dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2), [0, 2, 4, 6]),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2), [0, 2, 4, 6]),
    (dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3), [0, 3]),
    # embedding and loss count as one layer each: 10 units, 5 per stage, the first holds E + 4 layers
    (dict(pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True), [0, 4]),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*2|t|t*2|t*3L"), [0, 2, 3, 5]),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|t*4|t*4|L"), [0, 4]),  # empty chunks
])
def test_chunk_starts_follow_megatrons_split(split, starts):
    assert xmod_spec.chunk_starts(8, xmod_spec.PipelineSplit(**split)) == starts


def test_spec_check_reads_the_launchs_pipeline_flags(capsys):
    """Given a launch's whole argument list, the check finds a stage start inside a sparse block
    (layout D + (S4*2 + D)*2 + D: blocks 2-3 and 5-6) before megatron would, wherever the split comes from."""
    launch = ["spec_models", "tiny", "--spec", "spec_models", "tiny", "--num-layers", "8", "--lr", "3e-3", "--swiglu"]
    assert xmod_spec.main([*launch, "--pipeline-model-parallel-size", "2"]) == 0
    assert "pipeline chunks start at layers 1, 5: none inside a sparse block" in capsys.readouterr().out
    for flags, layer in ((["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"], 3),
                         (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4"], 3),
                         (["--pipeline-model-parallel-size", "1", "--pipeline-model-parallel-layout", "Et*5|t*3L"], 6)):
        assert xmod_spec.main([*launch, *flags]) == 2
        assert f"a pipeline stage starts at layer {layer}, inside the sparse block" in capsys.readouterr().err
    # the last occurrence wins, as in megatron: a later block-aligned layout passes
    assert xmod_spec.main([*launch, "--pipeline-model-parallel-layout", "Et*2|t*6L",
                           "--pipeline-model-parallel-layout", "Et*3|t*5L"]) == 0
    capsys.readouterr()
    for flags, message in ((["--pipeline-model-parallel-size", "3"], "pipeline_model_parallel_size: megatron refuses"),
                           (["--pipeline-model-parallel-layout", "Et*4|x*4L"], "unknown letter(s) 'x'"),
                           (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*2|t*2|t*4L"],
                            "has 3 stages of 8 transformer layers")):
        assert xmod_spec.main([*launch, *flags]) == 2
        assert message in capsys.readouterr().err


def test_spec_model_checkpoints_layer_by_layer(seeded):
    """Under megatron's plain config the spec turns on per-layer distributed checkpointing, as
    XModConfig does: the sparse layers' router has a key of its own, not a slice of a stacked tensor."""
    layout = "D + (S4*2 + D)"
    _, config = tiny_model(layout)
    plain = _plain(config, hetereogenous_dist_checkpoint=False)
    model = _gpt(plain, xmod_spec.layout_spec(layout))
    assert plain.hetereogenous_dist_checkpoint
    keys = set(model.sharded_state_dict().keys())
    assert "decoder.layers.1.router.weight" in keys and "decoder.layers.2.router.weight" in keys
    assert not any(key.startswith("decoder.layers.router") for key in keys)
    ours = set(tiny_model(layout)[0].sharded_state_dict().keys())
    assert keys == ours  # the same checkpoint layout as our builders' model
