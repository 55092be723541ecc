"""Issue 22: the decode path of the HF model pays only for the sparse layers that route a new token.

Models here are HF models with random weights whose routers are calibrated (bench/generate.py) so that
the threshold rule routes 1/K of the tokens, on layouts with long runs of sparse layers (where the
decode path skips most layers), X-MoD and MoD. The reference is the same model without the cache:
one full-sequence pass per generated token.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from generate import build_model, calibrate_routers, decode, prefill  # noqa: E402
from hf_helpers import left_padded  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402

from megatron_xmod.hf.cache import XModCache  # noqa: E402

VOCAB, PAD = 96, 95
LAYOUT = "D + (S4*6 + D)*2"  # two runs of six sparse layers


def routed_model(family="xmod", layout=LAYOUT, seed=0):
    model = build_model(layout, hidden=64, vocab=VOCAB, max_positions=128, seed=seed, family=family, heads=4)
    fractions = calibrate_routers(model, torch.randint(0, PAD, (2, 64), generator=torch.Generator().manual_seed(seed)))
    assert all(0.1 < f < 0.45 for f in fractions), fractions  # about 1/K = 0.25 routed: routing is mixed
    return model


def prompt(batch=1, length=12, seed=1):
    return torch.randint(0, PAD, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def recomputed(model, tokens, steps):
    """Greedy tokens and each step's logits, from a full pass over the whole text per step (no cache)."""
    logits = []
    for _ in range(steps):
        last = model(tokens, use_cache=False).logits[:, -1]
        logits.append(last)
        tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], dim=1)
    return tokens, torch.stack(logits, 1)


@torch.no_grad()
def cached(model, tokens, steps, cache=None):
    """Greedy tokens, each step's logits and the cache (None: a new XModCache), decoding with the cache."""
    cache = XModCache(model.config) if cache is None else cache
    logits = [model(tokens, cache=cache).logits[:, -1]]
    for _ in range(steps - 1):
        tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
        logits.append(model(tokens[:, -1:], cache=cache).logits[:, -1])
    tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
    return tokens, torch.stack(logits, 1), cache


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_decoding_that_skips_layers_equals_recomputation(family):
    model = routed_model(family)
    start = prompt()
    want_tokens, want_logits = recomputed(model, start, 12)
    tokens, logits, cache = cached(model, start, 12)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    one_pass = XModCache(model.config)
    with torch.no_grad():
        model(tokens[:, :-1], cache=one_pass)
    assert cache.entries() == one_pass.entries()  # batch 1: exactly the entries one pass routes


def test_left_padded_batch_decodes_as_each_prompt_alone():
    model = routed_model()
    prompts = [prompt(1, 9, seed=5)[0], prompt(1, 4, seed=6)[0], prompt(1, 6, seed=7)[0]]
    batch, mask = left_padded(prompts, PAD)
    width = batch.shape[1]
    together = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    for row, p in enumerate(prompts):
        alone, _ = recomputed(model, p[None], 8)
        assert torch.equal(together[row, width:], alone[0, len(p):]), row


def _routers_run_per_step(model, steps):
    calls = []
    sparse = [layer for layer in model.model.layers if layer.sparse]

    def counted(router_logits):
        def call(x):
            calls.append(1)
            return router_logits(x)
        return call

    for layer in sparse:
        layer.router_logits = counted(layer.router_logits)
    try:
        token, cache = prefill(model, prompt())
        calls.clear()
        with SyncCounter() as syncs:
            decode(model, token, cache, steps)
    finally:
        for layer in sparse:
            del layer.router_logits
    return len(calls) / steps, syncs.count / steps


def test_decode_runs_the_routers_of_the_layers_that_route_only():
    """Before: every sparse layer ran its router, its selection and one device read at every step
    (12 routers and 12 syncs per token here)."""
    model = routed_model()
    sparse = sum(layer.sparse for layer in model.model.layers)
    runs = len(model.model.sparse_runs())
    routers, syncs = _routers_run_per_step(model, 16)
    # A step runs the router of each layer that routes its token (1/K = 1/4 of them, ~3 of 12) and
    # reads the device once per run plus once per such layer.
    assert routers < sparse / 2, routers
    assert syncs <= runs + routers + 0.5, (syncs, runs, routers)
    model.model.decode_skips_unrouted = False  # every layer's own routing at every step (the path before)
    assert _routers_run_per_step(model, 16) == (sparse, sparse)


def test_a_layer_whose_score_is_within_rounding_of_zero_takes_its_own_decision():
    """The run-ahead's matmul may differ from the layer's router in the last bits: a layer scored that
    close to 0 is decided by its own router, as decoding without the run-ahead decides it. (At a
    score that close to 0 a full-sequence pass, whose router sums in another order too, may decide
    either way, so the reference here is the decode path that runs every layer's own routing.)"""
    model = routed_model(seed=3)
    start = prompt(seed=4)
    layers = [layer for layer in model.model.layers if layer.sparse]
    with torch.no_grad():  # put the first sparse layer's score of the first decoded token at 0
        text = recomputed(model, start, 1)[0]  # the prompt and the first decoded token
        n = text.shape[1]
        x, _ = model.model.layers[0](model.model.embed_tokens(text), torch.arange(n)[None],
                                     torch.ones(1, n, dtype=torch.bool))  # the input of the first sparse layer
        layers[0].router.bias -= layers[0].router_logits(x[:, -1:]).flatten()
    model.model.decode_skips_unrouted = False
    want_tokens, want_logits, _ = cached(model, start, 6)
    model.model.decode_skips_unrouted = True
    runs = []
    hook = layers[0].register_forward_pre_hook(lambda module, args, kwargs: runs.append(kwargs.get("routes_one")),
                                               with_kwargs=True)
    tokens, logits, _ = cached(model, start, 6)
    hook.remove()
    assert runs[1] is False  # the first decode step: the layer's own routing, its count read back
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_run_ahead_margin_covers_the_layers_own_rounding_in_half_precision(dtype):
    """In bf16 and fp16 the layers' routers round their logits in the model's dtype, where the run-ahead
    scores in fp32: over a decode, every layer's own score (router in ``dtype``, then s - tau b) lies within
    the margin of the run-ahead's (measured: within half of it), and the run-ahead decides nearly every routed
    layer itself (before, routers rounding x w + bias in the model's dtype and a margin of whole percents of
    the logit left about half of them to their own routing at h = 64 in bf16). At batch 1 the decode equals
    the one that runs every layer's own routing."""
    from megatron_xmod.hf.modeling_xmod import run_ahead_margin

    model = routed_model(seed=1).to(dtype)
    inner = model.model
    ratios, decided, own = [], [], []
    run_sparse = inner._decode_sparse_run

    def checked_run(start, x, positions, valid, cache, rope, *args):
        end = inner._sparse_run_end[start]
        weight, weight_abs, router_bias, router_bias_abs = inner._router_stacks(start, end)
        x32 = x[:, 0].float()
        logits = torch.nn.functional.linear(x32, weight, router_bias)
        bound = torch.nn.functional.linear(x32.abs(), weight_abs, router_bias_abs)
        theirs = torch.stack([inner.layers[j].router_logits(x)[:, 0] for j in range(start, end)], 1)
        margin = run_ahead_margin(logits, logits, bound, router_bias, x.shape[-1], dtype)  # tau b cancels out
        ratios.append(float(((logits - theirs).abs() / margin).max()))
        return run_sparse(start, x, positions, valid, cache, rope, *args)

    def count(module, args, kwargs):
        (decided if kwargs.get("routed") is not None else own).append(1)

    hooks = [layer.register_forward_pre_hook(count, with_kwargs=True) for layer in inner.layers if layer.sparse]
    inner._decode_sparse_run = checked_run
    tokens, logits, _ = cached(model, prompt(seed=2), 24)
    del inner._decode_sparse_run
    for hook in hooks:
        hook.remove()
    prefill_calls = sum(layer.sparse for layer in inner.layers)
    own = own[prefill_calls:]  # the prefill runs every sparse layer's own routing
    assert ratios and max(ratios) <= 1.0, max(ratios)
    assert len(decided) >= 10 * len(own), (len(decided), len(own))
    inner.decode_skips_unrouted = False
    want_tokens, want_logits, _ = cached(model, prompt(seed=2), 24)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def _left_padded_generation(model, prompts, steps):
    """Greedy generation of a left-padded batch; returns (tokens, logits [b, steps, vocab], cache)."""
    batch, mask = left_padded(prompts, PAD)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=PAD,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1), out.past_key_values


def test_batched_decode_runs_and_caches_the_routing_sequences_only():
    """A decode step runs a sparse layer's attention and MLP for the sequences of the batch that route
    their token there, and appends cache entries for those alone: each sequence's cache holds exactly
    what it holds decoded alone, and its columns in use are those entries, with no padding (the prompt's
    padded block keeps each sequence's valid entries first; decode steps append per sequence, not a
    column for everyone whenever one sequence routes, the padded path before)."""
    model = routed_model()
    prompts = [prompt(1, 9, seed=5)[0], prompt(1, 4, seed=6)[0], prompt(1, 6, seed=7)[0], prompt(1, 7, seed=8)[0]]
    steps = 10
    subsets = []  # how many sequences of the batch each decode step's layer ran for
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: subsets.append(len(kwargs["routed"][1] or args[0])) if kwargs.get("routed") else None,
        with_kwargs=True) for layer in model.model.layers if layer.sparse]
    tokens, logits, cache = _left_padded_generation(model, prompts, steps)
    for hook in hooks:
        hook.remove()
    assert subsets and min(subsets) < len(prompts), subsets  # layers ran for a part of the batch
    width = tokens.shape[1] - steps
    for row, p in enumerate(prompts):
        want_tokens, want_logits = recomputed(model, p[None], steps)
        assert torch.equal(tokens[row, width:], want_tokens[0, len(p):]), row
        torch.testing.assert_close(logits[row], want_logits[0], rtol=0, atol=1e-5)
        alone = XModCache(model.config)
        with torch.no_grad():
            model(want_tokens[:, :-1], cache=alone)  # the cache decoding it alone ends with
        mine = [layer.entries_per_sequence()[row] for layer in cache.layers]
        assert mine == alone.entries(), row
        for layer, entries in zip(cache.layers, mine):  # a sparse layer keeps the sequence's valid entries only
            assert not layer.sparse or (layer.fills[row] == entries and layer.sequence(row)[2].all()), row


def test_sparse_layers_hold_each_sequences_entries_without_padding():
    """A batch's sparse layers hold what each sequence routed and nothing for the others: the bytes in
    use are the valid entries', and each sequence's buffer is at most an eighth (or 16 entries) longer
    than its entries, where one buffer as wide as the busiest sequence held the sum of the widest fill."""
    model = routed_model()
    prompts = [prompt(1, 40, seed=5)[0], prompt(1, 12, seed=6)[0], prompt(1, 31, seed=7)[0], prompt(1, 22, seed=8)[0]]
    _, _, cache = _left_padded_generation(model, prompts, 6)
    sparse = [layer for layer in cache.layers if layer.sparse]
    assert any(len(set(layer.fills)) > 1 for layer in sparse)  # sequences routed different numbers of tokens
    assert sum(layer.nbytes() for layer in sparse) == sum(layer.nbytes(valid_only=True) for layer in sparse)
    entries, widest = sum(sum(layer.fills) for layer in sparse), sum(len(layer.fills) * layer.used for layer in sparse)
    assert entries < 0.8 * widest, (entries, widest)
    for layer in sparse:
        for row, fill in enumerate(layer.fills):
            assert layer.capacity(row) <= fill + max(16, fill // 8), (row, fill, layer.capacity(row))


def test_batched_prefill_runs_each_sequences_routed_tokens_only():
    """A batched prefill runs a sparse layer's MLP on the tokens its sequences routed, packed, not on
    every sequence padded to the busiest one's count, and gives each prompt's logits alone."""
    model = routed_model()
    prompts = [prompt(1, 40, seed=5)[0], prompt(1, 12, seed=6)[0], prompt(1, 31, seed=7)[0], prompt(1, 22, seed=8)[0]]
    batch, mask = left_padded(prompts, PAD)
    sparse = [i for i, layer in enumerate(model.model.layers) if layer.sparse]
    rows = {}
    hooks = [model.model.layers[i].mlp.register_forward_hook(
        lambda module, args, out, i=i: rows.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]).shape[0]))
        for i in sparse]
    with torch.no_grad():
        cache = XModCache(model.config)
        logits = model(batch, attention_mask=mask, cache=cache).logits[:, -1]
    for hook in hooks:
        hook.remove()
    assert [rows.get(i, 0) for i in sparse] == [sum(cache.layers[i].fills) for i in sparse]
    assert sum(rows.values()) < 0.8 * sum(len(prompts) * cache.layers[i].used for i in sparse)
    for row, p in enumerate(prompts):
        with torch.no_grad():
            alone = model(p[None]).logits[:, -1]
        torch.testing.assert_close(logits[row], alone[0], rtol=0, atol=1e-5)


def _prefill_counting_attention_calls(model, mode, monkeypatch, *args, **kwargs):
    """(output, cache, scaled_dot_product_attention calls) of one pass with ``prefill_attention = mode``."""
    import torch.nn.functional as F

    calls, attention = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    model.model.prefill_attention = mode
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out, kwargs.get("cache"), len(calls)


def test_batched_prefill_attention_is_one_call_a_layer_and_equals_sequence_by_sequence(monkeypatch):
    """prefill_attention="batched" (the default on a GPU): a sparse layer's routed tokens of a left-padded
    batch attend in one call, padded to the busiest sequence, where "per_sequence" makes one call a
    sequence that routes a token; same logits (fp32, 1e-5), same entries in every sequence's cache, the same
    greedy continuation; packed documents (no cache) score alike; a wrong mode is named."""
    model = routed_model()
    prompts = [prompt(1, 40, seed=5)[0], prompt(1, 12, seed=6)[0], prompt(1, 31, seed=7)[0], prompt(1, 22, seed=8)[0]]
    batch, mask = left_padded(prompts, PAD)
    runs = {mode: _prefill_counting_attention_calls(model, mode, monkeypatch, batch, attention_mask=mask,
                                                    cache=XModCache(model.config))
            for mode in ("per_sequence", "batched")}
    (loop, loop_cache, loop_calls), (one, one_cache, one_calls) = runs["per_sequence"], runs["batched"]
    sparse = [i for i, layer in enumerate(model.model.layers) if layer.sparse]
    routing = [sum(fill > 0 for fill in loop_cache.layers[i].fills) for i in sparse]  # sequences routing a token
    dense = len(model.model.layers) - len(sparse)
    assert sum(routing) > 2 * len(sparse)  # most layers route tokens of several sequences
    assert loop_calls == dense + sum(routing)
    assert one_calls == dense + sum(count > 0 for count in routing)
    valid = mask.bool()
    torch.testing.assert_close(one.logits[valid], loop.logits[valid], rtol=0, atol=1e-5)
    for i in sparse:
        assert one_cache.layers[i].fills == loop_cache.layers[i].fills
        for row in range(len(prompts)):
            for a, b in zip(one_cache.layers[i].sequence(row), loop_cache.layers[i].sequence(row)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    tokens = {}
    for mode in ("per_sequence", "batched"):
        model.model.prefill_attention = mode
        with torch.no_grad():
            tokens[mode] = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens["batched"], tokens["per_sequence"])

    # packed documents (no cache), split differently in each row: the rows route different numbers of tokens
    documents = prompt(3, 22, seed=11)
    positions = torch.stack([torch.cat([torch.arange(9), torch.arange(13)]), torch.cat([torch.arange(4), torch.arange(18)]),
                             torch.cat([torch.arange(15), torch.arange(7)])])
    packed = {mode: _prefill_counting_attention_calls(model, mode, monkeypatch, documents, position_ids=positions)
              for mode in ("per_sequence", "batched")}
    (loop, _, loop_calls), (one, _, one_calls) = packed["per_sequence"], packed["batched"]
    assert one_calls <= len(model.model.layers) < loop_calls
    torch.testing.assert_close(one.logits, loop.logits, rtol=0, atol=1e-5)

    model.model.prefill_attention = "padded"
    with pytest.raises(ValueError, match="prefill_attention: 'padded' is not one of auto, batched, per_sequence"):
        model(batch[:, :4])


def test_cache_appends_write_into_preallocated_buffers():
    """A decode step writes its entries into the layer's buffers (no copy of the cache per token) until
    they are full; then they grow, keeping every entry."""
    model = routed_model()
    token, cache = prefill(model, prompt(length=40))
    dense = next(layer for layer in cache.layers if not layer.sparse)
    storage, capacity = dense.keys.untyped_storage().data_ptr(), dense.capacity
    assert capacity >= dense.used + 5
    before = dense.keys.clone()
    decode(model, token, cache, capacity - dense.used)  # fills the buffers exactly
    assert dense.keys.untyped_storage().data_ptr() == storage and dense.capacity == capacity == dense.used
    decode(model, token, cache, 1)  # one more: the buffers grow
    assert dense.capacity > capacity and dense.used == capacity + 1
    assert torch.equal(dense.keys[:, :, :before.shape[2]], before)
    assert cache.nbytes(allocated=True)["total"] > cache.nbytes()["total"]


def test_beam_search_with_the_cache_equals_beam_search_without(monkeypatch):
    """Beam search reorders the cache's sequences every step (``reorder_cache``), whose fills differ
    once the beams route differently."""
    model = routed_model()
    start = prompt(length=10, seed=9)
    kwargs = dict(num_beams=3, num_return_sequences=3, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                  early_stopping=False)
    reorders, select = [], XModCache.batch_select_indices

    def recording(cache, indices):
        uneven = any(len(set(layer.fills)) > 1 for layer in cache.layers if layer.sparse)
        reorders.append(uneven and indices.tolist() != sorted(indices.tolist()))
        select(cache, indices)

    monkeypatch.setattr(XModCache, "batch_select_indices", recording)
    with torch.no_grad():
        cached_beams = model.generate(start, **kwargs)
        recomputed_beams = model.generate(start, use_cache=False, **kwargs)
    assert any(reorders), reorders  # beams were reordered while their caches differed
    assert torch.equal(cached_beams, recomputed_beams)


def test_batched_decode_reads_the_device_once_per_routing_event_only():
    """The only host syncs of a batched decode step are the run-ahead's reads: one per run of sparse
    layers plus one per layer that routes a token of the batch (none in the cache, the attention, the
    choice of rows)."""
    model = routed_model()
    batch, mask = left_padded([prompt(1, 9, seed=5)[0], prompt(1, 4, seed=6)[0], prompt(1, 6, seed=7)[0]], PAD)
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers if layer.sparse]
    steps = 6
    with torch.no_grad():
        cache = XModCache(model.config)
        token = model(batch, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
        calls.clear()
        with SyncCounter() as syncs:
            for _ in range(steps):
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                token = model(token, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
    for hook in hooks:
        hook.remove()
    assert calls and {hit.site.split(" in ")[-1] for hit in syncs.hits} == {"_decode_sparse_run"}, syncs.hits
    assert syncs.count <= steps * len(model.model.sparse_runs()) + len(calls), (syncs.count, len(calls))


def test_batched_decode_attends_to_each_sequences_own_buffer_without_a_mask(monkeypatch):
    """A decode step of an unpadded batch: a sparse layer's attention runs sequence by sequence on that
    sequence's buffer itself (a view of its storage, as long as its entries: no padded copy of the
    routing sequences' entries), and no layer builds a mask (every cached entry is valid, the new token
    last); the logits equal recomputation."""
    from megatron_xmod.hf.modeling_xmod import XModAttention

    model = routed_model()
    tokens = prompt(4, 10, seed=12)
    layer_of, calls = [None], []
    sdpa, attention_forward = torch.nn.functional.scaled_dot_product_attention, XModAttention.forward

    def recording(q, k, v, **kwargs):
        calls.append((layer_of[0], q.shape[0], k.shape[2], k.untyped_storage().data_ptr(), kwargs.get("attn_mask") is None))
        return sdpa(q, k, v, **kwargs)

    def attention(self, *args, **kwargs):
        layer_of[0] = self.layer_idx
        return attention_forward(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(XModAttention, "forward", attention)
    steps, checked = 8, 0
    want_tokens, want_logits = recomputed(model, tokens, steps)
    with torch.no_grad():
        cache = XModCache(model.config)
        logits = [model(tokens, cache=cache).logits[:, -1]]
        for step in range(1, steps):
            calls.clear()
            logits.append(model(want_tokens[:, tokens.shape[1] + step - 1:][:, :1], cache=cache).logits[:, -1])
            assert calls and all(no_mask for *_, no_mask in calls), calls
            for layer_idx, batch, keys, storage, _ in calls:
                layer = cache.layers[layer_idx]
                if layer.sparse:
                    assert batch == 1
                    rows = [r for r, stored in enumerate(layer._sequences)
                            if stored is not None and stored[0].untyped_storage().data_ptr() == storage]
                    assert len(rows) == 1 and keys == layer.fills[rows[0]], (layer_idx, keys, layer.fills)
                    checked += 1
    assert checked > steps  # sparse layers ran, several sequences a step in some
    torch.testing.assert_close(torch.stack(logits, 1), want_logits, rtol=0, atol=1e-5)


def test_synthetic_long_context_cache_holds_each_layers_share():
    """bench/generate.py --long-contexts decodes from a cache built without a prefill: each dense layer
    holds the whole context, each sparse layer context / K entries, and decoding from it appends as
    from a real one."""
    from generate import synthetic_cache

    model = routed_model()
    cfg = model.config
    cache = synthetic_cache(model, batch=2, context=96)
    assert cache.get_seq_length() == 96
    want = [96 if not cfg.is_sparse(i) else 96 // cfg.layer_sparsity_k[i] for i in range(cfg.num_hidden_layers)]
    assert cache.entries() == [2 * n for n in want]
    token = prompt(batch=2, length=1)
    decode(model, token, cache, 3)
    grown = [a - 2 * n for a, n in zip(cache.entries(), want)]
    assert all(g == 2 * 3 for g, sparse in zip(grown, map(cfg.is_sparse, range(len(want)))) if not sparse)
    assert 0 < sum(g for i, g in enumerate(grown) if cfg.is_sparse(i)) < 2 * 3 * sum(map(cfg.is_sparse, range(len(want))))


def test_sparse_cache_appends_several_sequences_at_their_own_fills():
    """A sparse layer's cache appended for several sequences at once (bench/generate.py's synthetic caches)
    writes each sequence after its own entries and returns them padded to the longest, with the columns of
    this pass's entries, from the host's fills (no device copy of them); offload and prefetch keep them."""
    from megatron_xmod.hf.cache import SparseKVLayer

    layer, heads, dim = SparseKVLayer(), 2, 4
    entries = lambda n, new, seed: torch.randn(n, heads, new, dim, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    first = entries(1, 3, 0)
    layer.update(first, first + 1, rows=[1], batch=3)  # sequence 1 holds 3 entries, the others none
    new = entries(3, 2, 1)
    keys, values, valid, columns = layer.update(new, new + 1, valid=torch.tensor([[True, False]] * 3))
    assert layer.fills == [2, 5, 2]
    assert columns.tolist() == [[0, 1], [3, 4], [0, 1]]
    assert keys.shape == (3, heads, 5, dim)
    torch.testing.assert_close(keys[1, :, :3], first[0], rtol=0, atol=0)
    for row in range(3):
        torch.testing.assert_close(keys[row, :, columns[row]], new[row], rtol=0, atol=0)
        torch.testing.assert_close(values[row, :, columns[row]], new[row] + 1, rtol=0, atol=0)
        stored_keys, _, stored_valid, _ = layer.sequence(row)
        torch.testing.assert_close(stored_keys, keys[row, :, :layer.fills[row]], rtol=0, atol=0)
        assert stored_valid.tolist() == valid[row, :layer.fills[row]].tolist()
    assert valid[0].tolist() == [True, False, False, False, False]  # padding past a sequence's fill is invalid
    layer.offload()
    layer.prefetch()
    torch.testing.assert_close(layer.sequence(1)[0], keys[1], rtol=0, atol=0)


def test_kv_cache_bench_reads_every_layer_kind():
    """bench/hf_cache.py's per-layer table from a generation's cache: each layer's entries and the positions
    they were cached at (a sparse layer keeps one buffer per sequence, a dense layer one for the batch)."""
    from hf_cache import layer_rows

    model = routed_model()
    tokens, mask = left_padded([prompt(1, 9, seed=5)[0], prompt(1, 5, seed=6)[0]], PAD)
    cache = XModCache(model.config)
    with torch.no_grad():
        model.generate(tokens, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    total = cache.seen_tokens
    rows = layer_rows(cache, model.config, total, trained=8, dense_layer_bytes=1)
    assert [r["entries"] for r in rows] == cache.entries()
    for row, layer in zip(rows, cache.layers):
        positions = torch.cat([layer.sequence(b)[3][layer.sequence(b)[2]] for b in range(2)])
        assert row["routed_fraction_trained_positions"] == int((positions < 8).sum()) / 8
        if layer.sparse:
            assert row["kind"] == "sparse" and 0 < row["entries"] < 2 * (total - 4)
        else:  # both sequences' valid tokens: every position of each up to its length, positions 0..7 twice
            assert row["entries"] == 2 * total - 4 and row["routed_fraction_trained_positions"] == 2.0


def _same_cache(a, b):
    """Every layer holds the same entries for every sequence (keys and values to rounding)."""
    assert a.seen_tokens == b.seen_tokens and a.entries() == b.entries()
    for layer_a, layer_b in zip(a.layers, b.layers):
        for row in range(layer_a.batch):
            (keys_a, values_a, valid_a, positions_a) = layer_a.sequence(row)
            (keys_b, values_b, valid_b, positions_b) = layer_b.sequence(row)
            assert torch.equal(valid_a, valid_b) and torch.equal(positions_a, positions_b)
            torch.testing.assert_close(keys_a[:, valid_a], keys_b[:, valid_b], rtol=0, atol=1e-5)
            torch.testing.assert_close(values_a[:, valid_a], values_b[:, valid_b], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_crop_leaves_the_cache_that_never_saw_the_dropped_tokens(family):
    """XModCache.crop(-r) after a multi-token pass (assisted decoding's verification) and after decode steps
    of a left-padded batch: every layer holds what a cache that never saw the last r tokens holds (sparse
    layers drop each sequence's routed entries of those tokens, at its own positions), and decoding goes
    on from it as from that cache."""
    model = routed_model(family)
    batch, mask = left_padded([prompt(1, 14, seed=5)[0], prompt(1, 8, seed=6)[0]], PAD)
    extra = prompt(2, 9, seed=9)
    full = torch.cat([mask, torch.ones_like(extra)], dim=1)
    cropped, reference = XModCache(model.config), XModCache(model.config)
    with torch.no_grad():
        for cache, tokens in ((cropped, extra), (reference, extra[:, :3])):
            model(batch, attention_mask=mask, cache=cache)
            model(tokens, attention_mask=full[:, :mask.shape[1] + tokens.shape[1]], cache=cache)
        def sparse_entries(cache):
            return sum(sum(layer.fills) for layer in cache.layers if layer.sparse)

        assert sparse_entries(cropped) > sparse_entries(reference)  # the tokens to drop have sparse-layer entries
        cropped.crop(-6)
        _same_cache(cropped, reference)
        # four decode steps dropped back to two equal two decode steps
        steps, past = prompt(2, 4, seed=10), full[:, :mask.shape[1] + 3]

        def decode_steps(cache, count):
            for i in range(count):
                model(steps[:, i:i + 1], attention_mask=torch.cat([past, torch.ones_like(steps[:, :i + 1])], 1),
                      cache=cache)

        decode_steps(cropped, 4)
        decode_steps(reference, 2)
        cropped.crop(-2)
        _same_cache(cropped, reference)
        again = model(steps[:, 2:3], attention_mask=torch.cat([past, torch.ones_like(steps[:, :3])], 1), cache=cropped)
        want = model(steps[:, 2:3], attention_mask=torch.cat([past, torch.ones_like(steps[:, :3])], 1), cache=reference)
        torch.testing.assert_close(again.logits, want.logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="tokens_to_remove"):
        cropped.crop(2)


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_assisted_decoding_equals_greedy_decoding(family, monkeypatch):
    """Assisted generation, prompt lookup and a routed draft model (transformers verifies several draft tokens
    in one pass and crops the cache back where the draft was wrong), gives greedy decoding's tokens, cropping
    real drafts."""
    model = routed_model(family)
    text = torch.cat([prompt(1, 10, seed=1)] * 3, dim=1)  # repeats: prompt lookup finds drafts
    with torch.no_grad():
        plain = model.generate(text, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
        drops, crop = [], XModCache.crop
        monkeypatch.setattr(XModCache, "crop", lambda self, n: (drops.append(-n), crop(self, n))[1])
        assisted = model.generate(text, max_new_tokens=24, do_sample=False, pad_token_id=PAD, prompt_lookup_num_tokens=4)
    assert torch.equal(assisted, plain)
    assert any(d > 0 for d in drops), drops  # some draft was rejected and its tokens cropped
    if family == "xmod":  # a routed draft model, whose own XModCache is cropped too
        draft = routed_model(layout="D + S4*3 + D", seed=1)
        with torch.no_grad():
            drafted = model.generate(text, max_new_tokens=24, do_sample=False, pad_token_id=PAD, assistant_model=draft)
        assert torch.equal(drafted, plain)


def test_inference_writes_residual_updates_into_the_models_own_hidden_states():
    """Without autograd every layer writes its residual update into the hidden states it was given (a sparse
    layer its routed rows, no copy of the others), never into the caller's inputs_embeds, and the logits are
    bit-identical to the out-of-place updates autograd needs."""
    model = routed_model()
    embeds = model.model.embed_tokens(prompt(2, 20, seed=4)).detach()
    kept = embeds.clone()
    same_storage = []
    hooks = [layer.register_forward_hook(lambda module, args, out: same_storage.append(out[0].data_ptr() == args[0].data_ptr()))
             for layer in model.model.layers]
    with torch.no_grad():
        in_place = model(inputs_embeds=embeds, use_cache=False).logits
    assert torch.equal(embeds, kept)
    assert len(same_storage) == len(model.model.layers) and all(same_storage)
    same_storage.clear()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    copied = model(inputs_embeds=embeds, use_cache=False).logits  # autograd on: each layer returns a new tensor
    for hook in hooks:
        hook.remove()
    assert not any(same_storage)
    assert torch.equal(in_place, copied)


def test_crop_refuses_entries_out_of_token_order_and_drops_nothing():
    """A padding token inside a pass, at a position given by position_ids below the dropped ones, leaves a
    sparse layer's positions out of token order: crop cannot tell the dropped tokens' entries apart, so it
    says so and leaves the cache as it was (generate's positions never do this). Dropping the padding token
    alone keeps every valid entry; its own entry, invalid, may stay (attention masks it)."""
    cache = XModCache(num_layers=2, sparse_layers=[True, False])
    entry = lambda n: torch.ones(1, 1, n, 2)  # noqa: E731
    for positions, valid in (([0, 1, 2], None), ([3], None), ([0], [False])):
        positions = torch.tensor([positions])
        valid = None if valid is None else torch.tensor([valid])
        cache.begin_pass(1, positions, valid)
        for layer_idx in range(2):
            cache.update(entry(positions.shape[1]), entry(positions.shape[1]), layer_idx, valid, positions)
        cache.advance(positions.shape[1])
    with pytest.raises(ValueError, match="not in token order"):
        cache.crop(-2)
    assert cache.seen_tokens == 5 and cache.entries() == [4, 4] and cache.layers[0].fills == [5]
    cache.crop(-1)
    assert cache.seen_tokens == 4 and cache.entries() == [4, 4] and cache.layers[1].used == 4
    assert cache.layers[0].sequence(0)[3][cache.layers[0].sequence(0)[2]].tolist() == [0, 1, 2, 3]
    cache.layers[1].crop(-1)  # a dense layer crops alone (one column a token); a sparse layer cannot
    assert cache.layers[1].used == 3
    with pytest.raises(ValueError, match="crop the XModCache"):
        cache.layers[0].crop(-1)


def test_generate_says_it_ignores_a_cache_implementation():
    """generate(cache_implementation="offloaded") cannot give a routed model transformers' cache: it says so
    and generates with the XModCache, the same tokens ("static" takes the fixed-shape decode:
    test_hf_static_decode.py)."""
    model = routed_model()
    with torch.no_grad():
        plain = model.generate(prompt(), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        with pytest.warns(UserWarning, match="cache_implementation"):
            other = model.generate(prompt(), max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                                   cache_implementation="offloaded")
    assert torch.equal(other, plain)


def test_bytes_a_decode_step_reads_are_the_weights_and_the_keys_and_values():
    """bench/generate.py's decode bytes bound: a Dense model's step at batch b after n tokens reads every
    linear weight once (the layers' and the LM head's) and, in each layer, the keys and values of n + 1
    tokens a sequence; a routed model's step reads its sparse layers' few entries instead."""
    from generate import BytesRead, synthetic_cache

    dense = build_model("dense", hidden=64, vocab=256, max_positions=128)
    cfg = dense.config
    batch, context = 3, 40
    cache = synthetic_cache(dense, batch, context)
    token = prompt(batch=batch, length=1)
    with BytesRead() as read:
        decode(dense, token, cache, 1)
    weights = sum(m.weight.numel() * 4 for m in dense.modules() if isinstance(m, torch.nn.Linear))
    assert read.weights == weights
    assert read.keys_values == cfg.num_hidden_layers * batch * (context + 1) * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    routed = build_model("xmod-a4k8", hidden=64, vocab=256, max_positions=128)
    calibrate_routers(routed, prompt(batch=2, length=64))
    cache = synthetic_cache(routed, batch, context)
    with BytesRead() as routed_read:
        decode(routed, token, cache, 1)
    assert 0 < routed_read.keys_values < read.keys_values
    with torch.inference_mode(), BytesRead() as whole:  # linear and attention reach the mode undecomposed
        dense(token, cache=synthetic_cache(dense, batch, context))
    assert (whole.weights, whole.keys_values) == (read.weights, read.keys_values)


def test_bench_models_draw_output_projections_as_megatron_core_does():
    """bench/generate.py's ``init="megatron"``: each layer's output projections at the std of megatron-core's
    own ``output_layer_init_method`` for a model of that many layers (what the models our users train start
    from), every other matrix at ``initializer_range``; ``init="hf"`` leaves them all at ``initializer_range``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = build_model("xmod-a4k8", hidden=64, vocab=256, max_positions=64)
    cfg = model.config
    megatron = TransformerConfig(num_layers=cfg.num_hidden_layers, hidden_size=64, num_attention_heads=1,
                                 init_method_std=cfg.initializer_range)
    reference = megatron.output_layer_init_method(torch.empty(4096, 1024)).std().item()

    def std_of(suffixes):
        return torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith(suffixes)]).std().item()

    assert abs(std_of(("o_proj.weight", "down_proj.weight")) / reference - 1) < 0.02
    assert abs(std_of(("q_proj.weight", "k_proj.weight", "up_proj.weight", "gate_proj.weight"))
               / cfg.initializer_range - 1) < 0.02
    assert reference < cfg.initializer_range / 10  # 161 layers: the scaling is what sets them apart
    plain = build_model("xmod-a4k8", hidden=64, vocab=256, max_positions=64, init="hf")
    assert abs(plain.model.layers[5].mlp.down_proj.weight.std().item() / cfg.initializer_range - 1) < 0.1
    with pytest.raises(ValueError, match="init: 'torch' .*megatron, hf"):
        build_model("dense", hidden=64, vocab=256, max_positions=64, init="torch")


def test_calibrated_bench_routers_route_about_1_over_k_of_every_sequence():
    """With megatron-core's init the calibrated threshold routes 0.6-1.5 x 1/K of each sequence's tokens in
    a layer; with transformers' one std for all 161 layers their updates carry a component each sequence
    shares, and the same calibration routes next to nothing of some sequences and over twice 1/K of others
    (the models of the generation results before session 28, bench/README.md)."""
    from generate import deciles, routed_shares

    text = prompt(batch=4, length=256, seed=2)
    spreads = {}
    for init in ("megatron", "hf"):
        model = build_model("xmod-a4k8", hidden=64, vocab=VOCAB, max_positions=300, init=init)
        calibrate_routers(model, prompt(batch=2, length=256, seed=1))
        with routed_shares(model) as shares:
            prefill(model, text)
        assert len(shares) == 4 * sum(layer.sparse for layer in model.model.layers)
        assert abs(sum(shares) / len(shares) - 1) < 0.25  # 1/K on average either way
        spreads[init] = deciles(shares)
    low, _, high = spreads["megatron"]
    assert 0.6 <= low and high <= 1.5, spreads
    low, _, high = spreads["hf"]
    assert low < 0.3 and high > 2, spreads
