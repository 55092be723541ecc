"""Document-masked routed layers (--reset-attention-mask): a routed token attends only to the routed
tokens of its own document, at the RoPE position megatron's dense layers give it.

- the sparse layer against an independent plain-torch fp64 reference (tests/test_sparse_layer.py's
  helpers, with a block-diagonal causal mask over the routed tokens built from the documents' EOD
  tokens, not from megatron's mask): outputs and gradients, X-MoD and MoD, top-k training and
  threshold evaluation, and the sequence-parallel code path at one rank;
- a whole tiny model: changing the tokens of one document leaves every other document's logits
  unchanged (a perturbation check that fails when a routed layer ignores the mask);
- the entry point training with --reset-attention-mask on a corpus of many short documents (slow).
"""
import sys

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from test_sparse_layer import HIDDEN, make_config, make_layer, reference_layer, rope_freqs

from megatron_xmod.xmod.layers import _routed_document_mask

EOD = 255


@pytest.fixture(autouse=True)
def outside_megatron_training(monkeypatch):
    """Routed layers drop the dataloader's mask in a megatron run without --reset-attention-mask (it is
    plain causal there); these tests hand masks to layers directly, so no parsed arguments may linger."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None:
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)


def documents(seq_len, batch, generator, mean_length=4):
    """Random tokens with EOD every ~``mean_length`` tokens: (tokens [b, s], megatron's mask [b, 1, s, s]
    (True = masked) from its own GPT-dataset code with reset_attention_mask, document ids [s, b])."""
    tokens = torch.randint(0, EOD, (batch, seq_len), generator=generator)
    tokens[torch.rand(batch, seq_len, generator=generator) < 1 / mean_length] = EOD
    masks = [_get_ltor_masks_and_position_ids(t, EOD, False, True, False, True)[0] for t in tokens]
    eod = (tokens == EOD).long()
    ids = (eod.cumsum(-1) - eod).t()  # an EOD token ends (belongs to) its document
    return tokens, torch.stack(masks), ids


def fp64_layer(family):
    return make_layer(make_config(family=family, xmod_router_bce_coeff=0.0), family=family).double()


def saturated_inputs(layer, seq_len, batch, generator):
    """Random hidden states whose router logits are +-(100..200): the fp32 gate sigmoid(s) of a routed
    token is exactly 1.0 in the layer and in the reference. (The layer's routing runs in fp32 by design
    and torch's vectorised fp32 sigmoid can differ from another call's by an ulp, 6e-8, which would
    hide the fp64 comparison of what this file tests: attention, MLP and the gated update under
    document masks. test_sparse_layer.py checks the gate itself.)"""
    direction = torch.nn.functional.normalize(torch.randn(HIDDEN, dtype=torch.float64, generator=generator), dim=0)
    with torch.no_grad():
        layer.router.weight.copy_(100 * direction)
        layer.router.bias.zero_()
    x = torch.randn(seq_len, batch, HIDDEN, dtype=torch.float64, generator=generator)
    sign = torch.where(torch.rand(seq_len, batch, generator=generator) < 0.5, -1.0, 1.0).double()
    along = sign * (1 + torch.rand(seq_len, batch, generator=generator, dtype=torch.float64))
    return x - (x @ direction)[..., None] * direction + along[..., None] * direction


def compare(layer, x, mask, ids, family, rule, run=None):
    """(output error, largest gradient error) of ``layer`` (or ``run(x)``) against the reference."""
    seq_len = x.shape[0]
    x_layer, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = run(x_layer) if run else layer(x_layer, attention_mask=mask, rotary_pos_emb=rope_freqs(seq_len))[0]
    weights = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    expected = reference_layer(weights, x_ref, family, 4, rule, document_ids=ids, router_dtype=torch.float32)
    probe = torch.randn_like(x)
    (out * probe).sum().backward()
    (expected * probe).sum().backward()
    errors = {"x": (x_layer.grad - x_ref.grad).abs().max().item()}
    for name, p in layer.named_parameters():
        errors[name] = (p.grad - weights[name].grad).abs().max().item()
    return (out - expected).abs().max().item(), errors


@pytest.mark.parametrize("family", ["xmod", "mod"])
@pytest.mark.parametrize("rule", ["topk", "threshold"])
def test_document_masked_layer_matches_reference(seeded, family, rule):
    """Also covers a routed token that is the first routed one of its document (it attends to itself
    only: no all-masked row, no NaN) and, with threshold routing, the padded batch."""
    generator = torch.Generator().manual_seed(7)
    _, mask, ids = documents(32, 3, generator)
    layer = fp64_layer(family)
    layer.train(rule == "topk")
    x = saturated_inputs(layer, 32, 3, generator)
    out_error, grad_errors = compare(layer, x, mask, ids, family, rule)
    print(f"{family} {rule}: output {out_error:.1e}, gradients {max(grad_errors.values()):.1e}")
    assert out_error < 1e-12, out_error
    assert max(grad_errors.values()) < 1e-12, grad_errors
    # the mask mattered: without it the layer is the plain causal one, far from the reference
    with torch.no_grad():
        plain = layer(x, rotary_pos_emb=rope_freqs(32))[0]
        masked = layer(x, attention_mask=mask, rotary_pos_emb=rope_freqs(32))[0]
    assert (plain - masked).abs().max() > 1e-3


@pytest.mark.parametrize("rule", ["topk", "threshold"])
def test_sequence_parallel_code_path_applies_the_document_mask(seeded, rule):
    """The sequence-parallel update (_routed_update_sequence_parallel) at one rank, where its
    reduce-scatter and all-gather are identities: the same gathered mask as the reference. (Its end
    padding to a multiple of T comes last, so causal order keeps it out, test below.)"""
    from megatron_xmod.xmod.routing import capacity_selection

    generator = torch.Generator().manual_seed(3)
    _, mask, ids = documents(32, 2, generator)
    layer = fp64_layer("xmod")
    layer.train(rule == "topk")

    def run(x):
        scores = layer.router(x).squeeze(-1).float()
        if rule == "topk":
            indices, valid = torch.topk(scores, 8, dim=0).indices.sort(0).values, None
        else:
            indices, valid, _ = capacity_selection(torch.sigmoid(scores) >= 0.5)
        return layer._routed_update_sequence_parallel(x, indices, scores, rope_freqs(32), valid, document_mask=mask)[0]

    x = saturated_inputs(layer, 32, 2, generator)
    out_error, grad_errors = compare(layer, x, mask, ids, "xmod", rule, run=run)
    assert out_error < 1e-12 and max(grad_errors.values()) < 1e-12, (out_error, grad_errors)


def test_routed_mask_never_masks_a_whole_row():
    """Document resets, padding at the end of a routed batch, and a mask that forbids everything: each
    routed token still sees itself (an all-masked row would make SDPA return NaN)."""
    indices = torch.tensor([[0, 1], [3, 2], [5, 6], [5, 6]])  # [k, b]; the last row: end padding
    everything = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    masked = _routed_document_mask(everything, indices)  # [b, 1, k, k], True = masked
    assert masked.shape == (2, 1, 4, 4)
    assert torch.equal(~masked[:, 0], torch.eye(4, dtype=torch.bool).expand(2, 4, 4))
    assert _routed_document_mask(None, indices) is None  # plain causal: the core attention's own mask type
    # megatron's reset mask: positions 0-2 one document, 3-7 another; causal in the batch's order
    reset = torch.ones(8, 8, dtype=torch.bool).tril()
    reset[3:, :3] = False
    allowed = ~_routed_document_mask(~reset[None, None], indices)[:, 0]
    assert allowed[0].tolist() == [[True, False, False, False], [False, True, False, False],
                                   [False, True, True, False], [False, True, True, True]]
    assert allowed[1].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [False, False, True, False], [False, False, True, True]]


def test_non_sdpa_core_attention_refuses_a_document_mask(seeded):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    config = make_config()
    layer = make_layer(config, submodules=get_gpt_layer_local_submodules(qk_layernorm=True, normalization="RMSNorm"))
    _, mask, _ = documents(16, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"attention_mask: .*SDPA core attention.*--transformer-impl local"):
        layer(torch.randn(16, 2, HIDDEN), attention_mask=mask, rotary_pos_emb=rope_freqs(16))


def test_dataloader_causal_mask_is_dropped_without_reset(monkeypatch):
    """In a megatron run without --reset-attention-mask the dataloader's mask is plain causal: routed
    layers drop it (SDPA keeps is_causal, TransformerEngine layers keep working); with the flag it is applied."""
    import types

    from megatron_xmod.xmod.layers import _document_mask

    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)
    global_vars = types.SimpleNamespace(_GLOBAL_ARGS=types.SimpleNamespace(reset_attention_mask=False))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    assert _document_mask(mask) is None
    global_vars._GLOBAL_ARGS.reset_attention_mask = True
    assert _document_mask(mask) is mask


def test_preflight_names_what_a_document_mask_needs():
    import types

    from megatron_xmod.training.flags import expand_arguments
    from megatron_xmod.training.preflight import check_document_masks

    def args(**fields):
        return types.SimpleNamespace(**dict(dict(reset_attention_mask=True, create_attention_mask_in_dataloader=True,
                                                 transformer_impl="local", context_parallel_size=1), **fields))

    check_document_masks(args(), routed=True)
    with pytest.raises(ValueError, match="reset_attention_mask: .*--no-create-attention-mask-in-dataloader"):
        check_document_masks(args(create_attention_mask_in_dataloader=False), routed=False)
    with pytest.raises(ValueError, match="reset_attention_mask: .*--transformer-impl local"):
        check_document_masks(args(transformer_impl="transformer_engine"), routed=True)
    check_document_masks(args(transformer_impl="transformer_engine"), routed=False)  # dense: megatron's own
    check_document_masks(args(context_parallel_size=2), routed=True)  # test_context_parallel.py runs it
    check_document_masks(args(context_parallel_size=2), routed=False)  # dense: key columns reordered (step.py)
    packed = dict(dataloader_inter_document_masking=True, pipeline_model_parallel_size=1)
    check_document_masks(args(**packed), routed=True)  # local, CP 1, PP 1: test_packed_sequences_... trains it
    with pytest.raises(ValueError, match="dataloader_inter_document_masking: routed layers .*--transformer-impl local"):
        check_document_masks(args(**packed, transformer_impl="transformer_engine"), routed=True)
    check_document_masks(args(**packed, transformer_impl="transformer_engine", context_parallel_size=2), routed=False)
    with pytest.raises(ValueError, match="dataloader_inter_document_masking: .*context parallelism.*--reset-attention-mask"):
        check_document_masks(args(**packed, context_parallel_size=2), routed=True)
    with pytest.raises(ValueError, match="dataloader_inter_document_masking: .*pipeline stages.*--reset-attention-mask"):
        check_document_masks(args(**dict(packed, pipeline_model_parallel_size=2)), routed=False)
    cpu = ["--xmod-cpu", "--xmod-routing-family", "xmod", "--xmod-layout", "D + S4", "--num-layers", "2"]
    assert "--no-create-attention-mask-in-dataloader" in expand_arguments(cpu)
    assert "--no-create-attention-mask-in-dataloader" not in expand_arguments(cpu + ["--reset-attention-mask"])


def test_perturbing_one_document_leaves_the_others_unchanged(seeded):
    """A tiny X-MoD model (dense and routed layers) in evaluation, fp64. Threshold routing decides for
    each token from its own hidden state (sigmoid(s) >= 0.5), and the token-choice bias is per token
    too, so with document masks in every layer the whole model is document-local: a token's logits
    depend on its own document only. (Under top-k routing, which ranks the whole sequence, changing a
    document may legitimately change which tokens of another are routed; threshold routing takes that
    path away, so a difference here can only come from attention reaching across documents.)
    Changing every token of the first document must leave the logits of all later documents equal up
    to rounding (the threshold batch's padded shape may change), while the check has power: the same
    perturbation without masks moves them, and on a layer that ignores the mask (main before document
    masks) the routed layers' leak makes this check fail."""
    from helpers import tiny_model

    from megatron_xmod.model import sparse_layers

    model, _ = tiny_model("D + (S4*2 + D)", xmod_routing_family="xmod", xmod_router_bce_coeff=0.0)
    model = model.double().eval()
    with torch.no_grad():  # larger router weights than the init's so that each layer routes a good share
        for layer in sparse_layers(model):
            layer.router.weight.mul_(20.0)
    generator = torch.Generator().manual_seed(11)
    seq_len = 64
    tokens, mask, ids = documents(seq_len, 2, generator, mean_length=12)
    tokens[:, 9] = EOD  # the first document ends at position 9 in both sequences
    tokens[:, :9] = torch.randint(0, EOD, (2, 9), generator=generator)
    mask = torch.stack([_get_ltor_masks_and_position_ids(t, EOD, False, True, False, True)[0] for t in tokens])
    positions = torch.arange(seq_len).expand(2, -1)
    changed = tokens.clone()
    changed[:, :9] = (tokens[:, :9] + 1 + torch.randint(0, 100, (2, 9), generator=generator)) % EOD
    later = slice(10, None)
    routed = []

    def count(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        routed.append((output[0] != hidden).any(-1).sum().item())

    hooks = [layer.register_forward_hook(count, with_kwargs=True) for layer in sparse_layers(model)]
    with torch.no_grad():
        base, other = (model(t, positions, mask) for t in (tokens, changed))
        plain, plain_other = (model(t, positions, None) for t in (tokens, changed))
    for hook in hooks:
        hook.remove()
    assert min(routed) > 8, routed  # every sparse layer routed tokens in both sequences
    leak = (base[:, later] - other[:, later]).abs().max().item()
    unmasked = (plain[:, later] - plain_other[:, later]).abs().max().item()
    print(f"later documents' logits: {leak:.1e} with document masks, {unmasked:.1e} without")
    assert leak < 1e-10, leak
    assert unmasked > 1e-4, unmasked


def short_documents(prefix):
    """A byte corpus of many short documents (8-40 bytes + EOD 255): a 64-token sequence spans several."""
    import numpy as np
    from helpers import english_bytes
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    data = english_bytes().numpy()
    lengths = np.random.default_rng(0).integers(8, 41, size=len(data) // 8)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    start = 0
    for length in lengths:
        if start + length > len(data):
            break
        builder.add_item(torch.tensor(np.append(data[start : start + length], EOD).astype(np.int64)))
        builder.end_document()
        start += length
    builder.finalize(prefix + ".idx")
    return prefix


PROBE = '''
import runpy, sys
from megatron_xmod.xmod import layers

forward, seen = layers.XModSparseLayer.forward, []


def probed(self, hidden_states, attention_mask=None, *args, **kwargs):
    mask = layers._document_mask(attention_mask)
    if mask is not None and len(seen) < 1:
        seen.append(1)
        across = bool(mask[:, 0].tril(-1).any())  # masked below the diagonal: not the plain causal mask
        print(f"[probe] routed layer {self.layer_number}: document mask {tuple(mask.shape)}, "
              f"resets={across}", flush=True)
    return forward(self, hidden_states, attention_mask, *args, **kwargs)


layers.XModSparseLayer.forward = probed
sys.argv = ["megatron_xmod.pretrain", *sys.argv[1:]]
runpy.run_module("megatron_xmod.pretrain", run_name="__main__")
'''


@pytest.mark.slow
def test_entry_point_trains_with_reset_attention_mask(tmp_path):
    """The entry point with --reset-attention-mask (and --reset-position-ids) on many short documents:
    megatron's dataloader builds the block-diagonal mask (--no-create-attention-mask-in-dataloader
    dropped), the routed layers receive and apply it (a probe around their forward reports it), and
    training and validation run with finite losses."""
    from entry_point_helpers import common_flags, torchrun, train_losses, validation_losses

    data = short_documents(str(tmp_path / "docs"))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    flags = [f for f in common_flags(data, 3, "--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)",
                                     "--num-layers", "4", "--reset-attention-mask", "--reset-position-ids",
                                     "--eval-interval", "3")
             if f != "--no-create-attention-mask-in-dataloader"]
    result = torchrun(1, [str(probe)], flags)
    assert "[probe] routed layer 2: document mask (2, 1, 64, 64), resets=True" in result.stdout, result.stdout[-3000:]
    losses = train_losses(result.stdout)
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    validation = validation_losses(result.stdout)  # threshold routing (and the top-k comparison) under the mask
    assert 3 in validation and torch.isfinite(torch.tensor(validation[3]["lm loss"]))


@pytest.mark.slow
def test_packed_sequences_train_as_document_masks(tmp_path):
    """--dataloader-inter-document-masking (megatron's packed sequences: the micro-batch's 2 samples in one THD
    row with cu_seqlens, document-relative RoPE) trains the routed model as --reset-attention-mask does (the same
    documents, each sample ranked on its own by top-k), and unlike plain causal attention across documents; TP 2
    with sequence parallelism trains it as one rank does."""
    from entry_point_helpers import common_flags, torchrun, train_losses, validation_losses

    data = short_documents(str(tmp_path / "docs"))
    model = ["--xmod-routing-family", "xmod", "--xmod-layout", "D + (S4*2 + D)", "--num-layers", "4",
             "--eval-interval", "3"]
    runs = {}
    packed_flags = ["--dataloader-inter-document-masking"]
    for name, nproc, extra in (("packed", 1, packed_flags), ("masked", 1, ["--reset-attention-mask"]), ("causal", 1, []),
                               ("packed-tp2-sp", 2, [*packed_flags, "--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel"])):
        flags = [f for f in common_flags(data, 3, *model, *extra) if not extra or f != "--no-create-attention-mask-in-dataloader"]
        result = torchrun(nproc, ["-m", "megatron_xmod.pretrain"], flags)
        runs[name] = (train_losses(result.stdout), validation_losses(result.stdout))
    (packed, packed_valid), (masked, masked_valid), (causal, _) = runs["packed"], runs["masked"], runs["causal"]
    # TP 2 with sequence parallelism: the packed row split over the ranks, the routed batch too
    assert runs["packed-tp2-sp"][0] == pytest.approx(packed, rel=1e-5), (runs["packed-tp2-sp"], packed)
    assert runs["packed-tp2-sp"][1][3] == pytest.approx(packed_valid[3], rel=1e-5)
    assert sorted(packed) == [1, 2, 3] and packed_valid.keys() == masked_valid.keys() == {3}
    # RoPE at document-relative positions (THD) vs packed positions (the mask): equal up to rounding (the
    # console's 6 digits agree); routed layers that ignored the documents, or ranked the 2 samples together,
    # differ by 3e-4 and 7e-4
    assert packed == pytest.approx(masked, rel=1e-5), (packed, masked)
    assert packed_valid[3] == pytest.approx(masked_valid[3], rel=1e-5)
    assert abs(packed[3] - causal[3]) > 1e-3, (packed, causal)

