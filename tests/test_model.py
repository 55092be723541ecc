"""Dense / MoD / X-MoD megatron GPTModels: routing behaviour in the model, and training on CPU."""
import dataclasses

import pytest
import torch
from helpers import english_bytes, tiny_model

import megatron_xmod.xmod.layers as layers_module
from megatron_xmod.model import sparse_layers
from megatron_xmod.xmod.routing_state import report as routing_report
from megatron_xmod.xmod.routing_state import set_eval_routing

SEQ = 64


def _tokens(batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, SEQ), generator=g)


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)


def _sharpen_routers(model, scale=20.0):
    """Random routers at init give tiny logits; scale them so routing is decided by content."""
    with torch.no_grad():
        for layer in sparse_layers(model):
            layer.router.weight.mul_(scale)


def test_threshold_routing_is_causal(seeded):
    model, _ = tiny_model("D + (S4*4 + D) + S4*2")
    _sharpen_routers(model)
    model.eval()
    tokens = _tokens()
    changed = tokens.clone()
    t = 40
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % 256
    with torch.no_grad():
        before, after = _logits(model, tokens), _logits(model, changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-5)
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :])
    # and it is a real routing decision: neither nothing nor everything was selected
    fractions = [v for k, v in routing_report(model).items() if k.startswith("eval_selected_fraction/")]
    assert any(0 < f < 1 for f in fractions)


def test_topk_routing_in_the_model_selects_exactly_l_over_k(seeded):
    model, _ = tiny_model("D + (S4*4 + D)")
    model.train()
    _logits(model, _tokens()).sum().backward()
    report = routing_report(model)
    assert [report[f"selected_fraction/layer_{n:03d}"] for n in (2, 3, 4, 5)] == [0.25] * 4


def _capture_routing(monkeypatch):
    calls = []
    original = layers_module.routing_step

    def spy(logits, sparsity_k, rule, carried_bias=None, tau=0.0, *args, **kwargs):
        # the carried bias is the routing state's hand-over buffer, which the step overwrites in place
        carried = None if carried_bias is None else carried_bias.clone()
        step = original(logits, sparsity_k, rule, carried_bias, tau, *args, **kwargs)
        calls.append(dict(logits=logits.detach(), bias=carried, decision=step.decision))
        return step

    monkeypatch.setattr(layers_module, "routing_step", spy)
    return calls


def test_token_choice_bias_carries_within_block_and_resets_at_anchor(seeded, monkeypatch):
    model, config = tiny_model("D + (S4*3 + D) + (S4 + D)", xmod_token_choice_bias_tau=0.5)
    model.train()
    calls = _capture_routing(monkeypatch)
    with torch.no_grad():
        _logits(model, _tokens())
    assert len(calls) == 4
    first, second, third, after_anchor = calls
    assert first["bias"] is None and after_anchor["bias"] is None  # reset at the anchor
    assert torch.equal(second["bias"], first["decision"].selected.float())
    assert torch.equal(third["bias"], first["decision"].selected.float() + second["decision"].selected.float())
    # a token selected in layer 1 has its routing score lowered by tau in layer 2
    chosen = first["decision"].selected
    lowered = second["logits"] - second["decision"].scores
    assert torch.allclose(lowered[chosen], torch.full_like(lowered[chosen], 0.5))
    assert torch.all(lowered[~chosen] == 0)
    # a second forward pass starts from zero again
    calls.clear()
    with torch.no_grad():
        _logits(model, _tokens(seed=1))
    assert calls[0]["bias"] is None


def test_bias_lowers_adjacent_layer_overlap(seeded):
    jaccards = {}
    for tau in (0.0, 0.5):
        torch.manual_seed(3)
        model, _ = tiny_model("D + (S4*4 + D)", xmod_token_choice_bias_tau=tau)
        with torch.no_grad():  # identical routers in every layer: without the bias they agree a lot
            shared = torch.randn_like(sparse_layers(model)[0].router.weight)
            for layer in sparse_layers(model):
                layer.router.weight.copy_(shared)
        model.train()
        with torch.no_grad():
            _logits(model, _tokens(batch=4))
        jaccards[tau] = routing_report(model)["adjacent_jaccard"]
    assert jaccards[0.0] > 0.3
    assert jaccards[0.5] < jaccards[0.0]


def test_eval_routing_switch(seeded):
    model, _ = tiny_model("D + (S4*4 + D)")
    model.eval()
    set_eval_routing(model, "topk")
    with torch.no_grad():
        _logits(model, _tokens())
    assert routing_report(model)["eval_selected_fraction"] == 0.25
    with pytest.raises(ValueError, match="xmod_eval_routing"):
        set_eval_routing(model, "random")


def test_xmod_gpt_trains_through_megatron_schedule(seeded):
    """N0=1, A=1, K=4 X-MoD GPT, megatron's forward-backward function, byte-level English text."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, config = tiny_model("D + (S4*4 + D)", seq_len=SEQ)
    assert config.layer_layout.notation == "D + (S4*4 + D)"
    data = english_bytes()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    forward_backward = get_forward_backward_func()
    g = torch.Generator().manual_seed(0)

    def batches():
        while True:
            starts = torch.randint(0, len(data) - SEQ - 1, (4,), generator=g)
            chunk = torch.stack([data[s : s + SEQ + 1] for s in starts])
            yield chunk[:, :-1], chunk[:, 1:]

    def forward_step(iterator, model):
        tokens, labels = next(iterator)
        positions = torch.arange(SEQ).expand_as(tokens)
        losses = model(tokens, positions, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place

        return losses, loss_func

    iterator, lm_losses, router_grads, gate_grads, bce = batches(), [], [], [], []
    model.train()
    for _ in range(30):
        optimizer.zero_grad()
        result = forward_backward(forward_step_func=forward_step, data_iterator=iterator, model=model,
                                  num_microbatches=2, seq_length=SEQ, micro_batch_size=4, forward_only=False)
        lm_losses.append(torch.stack([r["lm loss"] for r in result]).mean().item())
        router_grads.append(sum(layer.router.weight.grad.abs().sum().item() for layer in sparse_layers(model)))
        gate_grads.append(sum(layer.gate_scale.grad.abs().sum().item() for layer in sparse_layers(model)))
        bce.append(routing_report(model)["router_bce_loss"])
        optimizer.step()
    first, last = sum(lm_losses[:3]) / 3, sum(lm_losses[-3:]) / 3
    assert first > 5.0 and last < first - 1.0, lm_losses
    assert all(g > 0 for g in router_grads) and all(g > 0 for g in gate_grads)
    assert all(0 < b < 1 for b in bce)
    assert bce[-1] < bce[0]  # the router learns to predict its own top-k choice


def test_block_spec_slices_pipeline_stages_like_megatron(seeded):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_xmod.xmod.block import get_xmod_decoder_block_spec
    from megatron_xmod.xmod.layers import XModSparseLayer

    _, config = tiny_model("D + (S4*4 + D) + D*2", xmod_token_choice_bias_tau=0.0)
    config = dataclasses.replace(config, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    kinds = config.layer_layout.kinds()
    seen = []
    for rank in (0, 1):
        ours = get_xmod_decoder_block_spec(config, use_transformer_engine=False, pp_rank=rank)
        theirs = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=rank)
        assert len(ours.layer_specs) == len(theirs.layer_specs)
        seen += ["sparse" if s.module is XModSparseLayer else "dense" for s in ours.layer_specs]
    assert seen == ["sparse" if k == "sparse" else "dense" for k in kinds]
    # with the bias on, a boundary inside a sparse block is allowed (layer 5 starts stage 2): the bias
    # crosses it with the activations (megatron_xmod.pipeline.carry, tests/test_pipeline_parallel.py)
    _, config = tiny_model("D + (S4*4 + D) + D*2", xmod_token_choice_bias_tau=0.5)
    config = dataclasses.replace(config, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    second = get_xmod_decoder_block_spec(config, use_transformer_engine=False, pp_rank=1)
    assert second.layer_specs[0].module is XModSparseLayer and kinds[3] == "sparse"
