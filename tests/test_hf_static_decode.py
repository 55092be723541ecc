"""Issue 22: fixed-shape decode steps (``XModCache(max_cache_len=...)``, megatron_xmod/hf/static_decode.py),
which one CUDA graph with conditional nodes can capture: no host read in a replayed step.

The references are the default decode path (the run-ahead over the per-sequence cache, itself checked
against recomputation in test_hf_decode.py) and recomputation. Graph safety is proven on CPU with the
emulated capture and replay of tests/graph_replay.py, extended with conditional nodes: the recorded
step's ops are replayed without any Python module code, the emulator deciding each sparse layer's
IF node from the replayed flag as the device would.
"""
import contextlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from generate import calibrate_routers  # noqa: E402
from graph_replay import NotCapturable, record  # noqa: E402
from helpers import run_triton_interp_tests  # noqa: E402
from hf_helpers import left_padded  # noqa: E402
from test_hf_decode import PAD, VOCAB, cached, prompt, recomputed, routed_model  # noqa: E402

from megatron_xmod.hf import region_attention as regions  # noqa: E402
from megatron_xmod.hf.cache import XModCache  # noqa: E402
from megatron_xmod.hf.configuration_xmod import XModHFConfig  # noqa: E402
from megatron_xmod.hf.modeling_xmod import XModForCausalLM  # noqa: E402
from megatron_xmod.xmod.layout import layout_from_model_name  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="runs inside test_region_attention_interpreter's subprocess")


def static_cached(model, tokens, steps, max_cache_len=64):
    """As test_hf_decode.cached, on a fixed-shape cache."""
    return cached(model, tokens, steps, XModCache(model.config, max_cache_len=max_cache_len))


@torch.no_grad()
def first_fixed_step(model, start, room):
    """The prefill and the first decode step (eager: it builds the state) on a fixed-shape cache of
    ``room`` tokens past the prompt. Returns (cache, tokens so far, logits of each step so far)."""
    cache = XModCache(model.config, max_cache_len=start.shape[1] + room)
    logits = [model(start, cache=cache).logits[:, -1]]
    tokens = torch.cat([start, logits[-1].argmax(-1, keepdim=True)], dim=1)
    logits.append(model(tokens[:, -1:], cache=cache).logits[:, -1])
    return cache, tokens, logits


@torch.no_grad()
def greedy_steps(model, cache, tokens, logits, steps):
    """``steps`` more greedy decode steps through the model; returns the final tokens and logits [b, n, vocab]."""
    for _ in range(steps):
        tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
        logits.append(model(tokens[:, -1:], cache=cache).logits[:, -1])
    return torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1), torch.stack(logits, 1)


def stepwise(model, cache, tokens, logits, steps, watch):
    """As greedy_steps, one step at a time, with ``watch()`` after each step; returns (tokens, logits, watched)."""
    watched = []
    for _ in range(steps):
        tokens, logits = greedy_steps(model, cache, tokens, logits, 1)
        tokens, logits = tokens[:, :-1], list(logits.unbind(1))
        watched.append(watch())
    return *greedy_steps(model, cache, tokens, logits, 0), watched


def graph_on_emulated_cuda(monkeypatch, state, graph=None, graph_class=None):
    """``state`` decodes with CUDA graphs captured and replayed by the emulator of tests/graph_replay.py
    (``graph``: the stand-in for torch.cuda.graph, by default the emulator's over the state's buffers;
    ``graph_class``: for torch.cuda.CUDAGraph, by default EmulatedCUDAGraph); EmulatedCUDAGraph.captures
    counts from 0."""
    from graph_replay import EmulatedCUDAGraph, emulated_graph

    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class or EmulatedCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph or emulated_graph(state.buffers))
    monkeypatch.setattr(EmulatedCUDAGraph, "captures", 0)
    state.graphed = True


def moe_routed_model(seed=0):
    """X-MoD with MoE MLPs (Top-k of 4 experts), routers calibrated to 1/K."""
    layout = layout_from_model_name("D + S4*6 + D", family="xmod")
    config = XModHFConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layout.num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, routing_family="xmod",
        layer_kinds=["sparse" if layer.is_sparse else "dense" for layer in layout.layers],
        layer_sparsity_k=[layer.sparsity_k for layer in layout.layers], layout=layout.notation,
        num_experts=4, moe_intermediate_size=16, moe_router_topk=2)
    torch.manual_seed(seed)
    model = XModForCausalLM(config).eval()
    calibrate_routers(model, torch.randint(0, PAD, (2, 64), generator=torch.Generator().manual_seed(seed)))
    return model


@pytest.mark.parametrize("family", ["xmod", "mod", "xmod-moe"])
def test_fixed_shape_decode_equals_recomputation(family):
    model = moe_routed_model() if family == "xmod-moe" else routed_model(family)
    start = prompt()
    want_tokens, want_logits = recomputed(model, start, 12)
    tokens, logits, cache = static_cached(model, start, 12)
    assert cache.static is not None and cache.static.steps == 11  # every decode step took the fixed shapes
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    _, _, default = cached(model, start, 12)
    assert cache.entries() == default.entries()  # the same entries per layer as the per-sequence cache


def test_fixed_shape_decode_of_a_batch_whose_first_layer_is_sparse():
    """The batch size comes from the cache's entries whatever kind of layer comes first (a sparse layer's
    buffer is one flat region buffer, batch 1 in its shape)."""
    model = routed_model(layout="S4*6 + D + S4*4")
    start = prompt(3, 10, seed=15)
    want_tokens, want_logits, want_cache = cached(model, start, 8)
    tokens, logits, cache = static_cached(model, start, 8)
    assert cache.static.batch == 3 and cache.static.input_ids.shape == (3, 1)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert cache.entries() == want_cache.entries()


def test_generate_with_a_static_cache_equals_the_default_cache_on_a_left_padded_batch():
    model = routed_model()
    prompts = [prompt(1, 9, seed=5)[0], prompt(1, 4, seed=6)[0], prompt(1, 6, seed=7)[0]]
    batch, mask = left_padded(prompts, PAD)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, output_scores=True,
                  return_dict_in_generate=True)
    default = model.generate(batch, **kwargs)
    fixed = model.generate(batch, cache_implementation="static", **kwargs)
    assert isinstance(fixed.past_key_values, XModCache) and fixed.past_key_values.static is not None
    assert fixed.past_key_values.static.max_cache_len == batch.shape[1] + 10 - 1  # the last token is never fed
    assert torch.equal(fixed.sequences, default.sequences)
    torch.testing.assert_close(torch.stack(fixed.scores), torch.stack(default.scores), rtol=0, atol=1e-5)
    # the next call, other prompts of the same batch size, refills the model's state (its graph kept on a GPU)
    state = fixed.past_key_values.static
    batch, mask = left_padded([prompt(1, 7, seed=8)[0], prompt(1, 9, seed=9)[0], prompt(1, 5, seed=10)[0]], PAD)
    default = model.generate(batch, attention_mask=mask, **{k: v for k, v in kwargs.items() if k != "attention_mask"})
    fixed = model.generate(batch, cache_implementation="static", attention_mask=mask,
                           **{k: v for k, v in kwargs.items() if k != "attention_mask"})
    assert fixed.past_key_values.static is state
    assert torch.equal(fixed.sequences, default.sequences)
    torch.testing.assert_close(torch.stack(fixed.scores), torch.stack(default.scores), rtol=0, atol=1e-5)


def _replayed_decode(model, tokens, steps):
    """Greedy decode from ``tokens`` [b, n]: the prefill and the first step eagerly, then one recorded step
    (the emulated capture) replayed for every further step. Returns (tokens, logits [b, steps, vocab],
    state, recording)."""
    n = tokens.shape[1]
    cache, tokens, logits = first_fixed_step(model, tokens, steps + 1)
    state = cache.static
    saved = [t.clone() for t in state.buffers()]
    recording = record(lambda: model.model.decode_static(state), branch_owner=state)
    with torch.no_grad():  # a capture runs nothing: the state is as before it
        for buffer, value in zip(state.buffers(), saved):
            buffer.copy_(value)
        for step in range(2, steps):
            tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
            state.input_ids.copy_(tokens[:, -1:])
            state.positions.fill_(n + step - 1)
            logits.append(model.lm_head(recording.replay())[:, -1])
    tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
    return tokens, torch.stack(logits, 1), state, recording


@pytest.mark.parametrize("batch", [1, 3])
def test_a_recorded_decode_step_replays_without_host_reads(batch):
    """One recorded step (no host read: the recording refuses any) replayed for every later token gives
    the default path's tokens, logits and cache entries; each sparse layer is one conditional node, and the
    replays both ran and skipped layers (the device's decision, not a fixed pattern)."""
    model = routed_model()
    start = prompt(batch, 10, seed=11)
    want_tokens, want_logits, want_cache = cached(model, start, 14)
    tokens, logits, state, recording = _replayed_decode(model, start, 14)
    sparse = sum(layer.sparse for layer in model.model.layers)
    assert recording.conditionals() == sparse
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert state.entries() == want_cache.entries()
    grown = [e for e, s in zip(state.entries(), state.sparse) if s]
    assert 0 < sum(grown) and min(grown) < max(grown)


def test_the_default_decode_step_cannot_be_captured():
    """What the fixed-shape path is for: the default decode step reads the device to decide which layer
    runs (the emulated capture refuses it)."""
    model = routed_model()
    start = prompt()
    cache = XModCache(model.config)
    with torch.no_grad():
        token = model(start, cache=cache).logits[:, -1:].argmax(-1)
    with pytest.raises(NotCapturable, match="host synchronisation"), torch.no_grad():
        record(lambda: model(token, cache=cache))


def test_fixed_shape_cache_refuses_what_it_cannot_do():
    model = routed_model()
    start = prompt(1, 10)
    with pytest.raises(ValueError, match="max_cache_len: the tokens a sequence may reach"):
        XModCache(model.config, max_cache_len=0)
    with pytest.raises(ValueError, match="max_cache_len: the cache holds 12 tokens"):
        static_cached(model, start, 4, max_cache_len=12)  # 10 + 3 decoded tokens
    _, _, cache = static_cached(model, start, 3, max_cache_len=20)
    for call in (lambda: cache.crop(-1), lambda: cache.batch_select_indices(torch.tensor([0])),
                 lambda: cache.batch_repeat_interleave(2)):
        with pytest.raises(ValueError, match="fixed-shape cache"):
            call()
    with pytest.raises(ValueError, match="inputs_embeds"), torch.no_grad():
        model(inputs_embeds=model.model.embed_tokens(start[:, -1:]), cache=cache)
    # a pass of several tokens after the fixed-shape steps began (a second prompt, an assisted draft) would
    # attend to nothing it cached: refused, the state untouched
    entries = cache.entries()
    with pytest.raises(ValueError, match="cache: a fixed-shape cache .* got 3 tokens"), torch.no_grad():
        model(start[:, :3], cache=cache)
    assert cache.entries() == entries
    with pytest.raises(ValueError, match="cache_implementation: 'static' .* beam_search needs the default"):
        model.generate(start, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=PAD,
                       cache_implementation="static")
    with pytest.raises(ValueError, match="sparse_room: .* one of adaptive, full, got 'tight'"):
        XModCache(model.config, max_cache_len=20, sparse_room="tight")
    cache = XModCache(model.config, max_cache_len=20, graphed=True)  # a model on the CPU
    with pytest.raises(ValueError, match="graphed: CUDA-graph capture of a decode step needs the model on one GPU"), \
            torch.no_grad():
        model(start, cache=cache)
        model(start[:, -1:], cache=cache)


def test_a_gpu_that_cannot_capture_the_step_decodes_eagerly_and_says_so(monkeypatch):
    """By default a GPU without IF nodes (or a model over several devices) decodes the fixed-shape steps
    eagerly, with a warning naming why (a host read a sparse layer a step); graphed=True is refused there;
    asking for eager steps, or a CPU, warns of nothing; a GPU with IF nodes captures."""
    from megatron_xmod.hf import static_decode

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(static_decode, "conditional_nodes_available", lambda device=None: False)
    with pytest.warns(UserWarning, match=r"static decode on cuda:0: no CUDA graph \(conditional nodes do not run "
                                         r"here\), so each fixed-shape step reads the device once a sparse layer"):
        assert static_decode.decode_graphed(gpu, True, None) is False
    with pytest.warns(UserWarning, match="the model spans several devices"):
        assert static_decode.decode_graphed(gpu, False, None) is False
    with pytest.raises(ValueError, match="graphed: CUDA-graph capture .* pass graphed=False"):
        static_decode.decode_graphed(gpu, True, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert static_decode.decode_graphed(gpu, True, False) is False
        assert static_decode.decode_graphed(torch.device("cpu"), True, None) is False
        monkeypatch.setattr(static_decode, "conditional_nodes_available", lambda device=None: True)
        assert static_decode.decode_graphed(gpu, True, None) is True


def test_the_decode_state_captures_its_second_step_as_a_graph_and_replays_it(monkeypatch):
    """StaticDecodeState's own capture code (what a GPU runs), against the emulated CUDA graph: the first
    decode step runs eagerly, the second captures the step (a relaxed warm-up capture, then the graph
    kept) and replays it, every later step only replays (no Python of the model runs), and the tokens,
    logits and entries are the default path's."""
    from graph_replay import EmulatedCUDAGraph

    model = routed_model()
    start = prompt(2, 10, seed=12)
    want_tokens, want_logits, want_cache = cached(model, start, 12)
    cache, tokens, logits = first_fixed_step(model, start, 12)
    state = cache.static
    assert state.graph is None and state.steps == 1
    graph_on_emulated_cuda(monkeypatch, state)
    steps_run = []
    decode_static = model.model.decode_static
    monkeypatch.setattr(model.model, "decode_static", lambda s: steps_run.append(1) or decode_static(s))
    tokens, logits = greedy_steps(model, cache, tokens, logits, 10)
    assert EmulatedCUDAGraph.captures == 2 and state.graph.capture_error_mode == "global"
    assert len(steps_run) == 2  # the two captures; the ten steps were replays
    assert state.graph.recording.conditionals() == sum(layer.sparse for layer in model.model.layers)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert state.entries() == want_cache.entries()


def _tight_room(monkeypatch):
    """Regions with almost no room beyond what each sequence's rate so far predicts: they run short often."""
    from megatron_xmod.hf import static_decode

    monkeypatch.setattr(static_decode, "ROOM_SLACK", 1.0)
    monkeypatch.setattr(static_decode, "ROOM_MARGIN", 1)


def _regions_hold_their_entries(state) -> bool:
    """Every sparse region's count within its size, with at least the free room the host counts on for the
    steps it will not check (no entry written past the region)."""
    return all(0 <= state._unchecked <= size - n for i, layout in state.regions.items()
               for n, size in zip(state.layers[i][2].tolist(), layout.sizes))


def test_adaptive_room_reads_the_counts_rarely_and_lays_out_again_where_a_region_runs_short(monkeypatch):
    """The adaptive room (the default): regions sized by each sequence's routing so far. With tight room the
    host reads the counts only when a region could fill, lays out again the layers that run short, and the
    decode still equals the default path (an entry written past its region would land in the next
    sequence's); with the default room a 40-token decode reads the counts at most every 8 steps, and the
    regions take less memory than room for every token left ("full": no read, no new layout)."""
    model = routed_model()
    start = prompt(3, 10, seed=16)
    want_tokens, want_logits, want_cache = cached(model, start, 40)
    with monkeypatch.context() as patch:
        _tight_room(patch)
        cache, tokens, logits = first_fixed_step(model, start, 40)
        state = cache.static
        tokens, logits, held = stepwise(model, cache, tokens, logits, 38, lambda: _regions_hold_their_entries(state))
    assert all(held)
    assert 0 < state.layout_changes <= state.room_reads < state.steps and state.relayouts >= state.layout_changes
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert state.entries() == want_cache.entries()

    sizes = {}
    for room in ("adaptive", "full"):
        tokens, logits, cache = cached(model, start, 40, XModCache(model.config, max_cache_len=60, sparse_room=room))
        assert torch.equal(tokens, want_tokens)
        sizes[room] = cache.nbytes(allocated=True)["sparse"]
        assert cache.static.layout_changes <= cache.static.room_reads <= cache.static.steps // 8
    assert cache.static.room_reads == 0 and cache.static.relayouts == 0  # "full"
    assert sizes["adaptive"] < 0.8 * sizes["full"], sizes


@pytest.mark.parametrize("capture_fails_once", [False, True])
def test_a_new_layout_is_captured_again(monkeypatch, capture_fails_once):
    """A layer laid out again has new buffers, which a captured graph does not know: the graph is dropped and
    the next step captures anew, once (the state's kernels are initialised), or, where that capture fails,
    after a warm-up capture; the tokens, logits and entries stay the default path's."""
    import contextlib

    from graph_replay import EmulatedCUDAGraph, emulated_graph

    model = routed_model()
    start = prompt(2, 10, seed=17)
    want_tokens, want_logits, want_cache = cached(model, start, 30)
    _tight_room(monkeypatch)
    cache, tokens, logits = first_fixed_step(model, start, 30)
    state = cache.static
    graph, failed = emulated_graph(state.buffers), []

    @contextlib.contextmanager
    def failing_once(cuda_graph, capture_error_mode="global", **kwargs):
        if capture_fails_once and state._warm and capture_error_mode == "global" and not failed:
            failed.append(1)
            raise RuntimeError("operation not permitted when stream is capturing")
        with graph(cuda_graph, capture_error_mode=capture_error_mode, **kwargs):
            yield

    graph_on_emulated_cuda(monkeypatch, state, failing_once)
    tokens, logits, changes = stepwise(model, cache, tokens, logits, 28, lambda: state.layout_changes)
    # two captures (relaxed, then kept) at the first graphed step, one after every step that laid out again,
    # and a failed one's warm-up
    new_layouts = changes[-1] - changes[0]
    assert new_layouts > 1 and len(failed) == capture_fails_once
    assert EmulatedCUDAGraph.captures == 2 + new_layouts + capture_fails_once
    assert state.graph.capture_error_mode == "global"
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert state.entries() == want_cache.entries()


def test_a_later_generation_refills_the_models_decode_state_and_replays_its_graph(monkeypatch):
    """The model keeps its last fixed-shape decode state (as transformers keeps a static cache): a later
    generation of the same batch size whose entries fit refills the buffers in place and replays the graph
    captured by the first one from its first step (no capture, no Python of the model), with the default
    path's tokens; the cache that held the buffers before is released (refused afterwards), and a
    generation that does not fit (another batch size) gets a state of its own."""
    from graph_replay import EmulatedCUDAGraph

    model = routed_model()
    first, later = prompt(2, 10, seed=18), prompt(2, 10, seed=18)[:, :8]
    want_tokens, want_logits, _ = cached(model, later, 12)
    cache, tokens, logits = first_fixed_step(model, first, 12)
    state = cache.static
    graph_on_emulated_cuda(monkeypatch, state)
    greedy_steps(model, cache, tokens, logits, 4)
    assert EmulatedCUDAGraph.captures == 2 and model.model.static_decode_state is state
    steps_run = []
    decode_static = model.model.decode_static
    monkeypatch.setattr(model.model, "decode_static", lambda s: steps_run.append(1) or decode_static(s))
    # a prefix of the first prompt: the threshold rule is causal, so every layer routes a subset of its
    # tokens and every region fits where the first prompt's did
    tokens, logits, again = cached(model, later, 12, XModCache(model.config, max_cache_len=20))
    assert again.static is state and EmulatedCUDAGraph.captures == 2 and not steps_run
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    for use in (lambda: model(tokens[:, -1:], cache=cache), lambda: model(tokens[:, -3:], cache=cache),
                cache.entries, cache.nbytes):  # a decode step, a pass of several tokens, the cache's counts
        with pytest.raises(ValueError, match="buffers were handed to a newer fixed-shape cache"), torch.no_grad():
            use()
    wider = prompt(3, 8, seed=19)
    _, _, other = cached(model, wider, 3, XModCache(model.config, max_cache_len=20))
    assert other.static is not state and again.static is state and model.model.static_decode_state is other.static


def test_a_refill_takes_only_what_its_graph_was_captured_for():
    """A refill keeps a graph that holds parameter addresses and configuration constants: a model whose
    parameters were replaced (not updated in place) gets a new state. A cache that gave the state up (reset,
    a new prompt not decoded yet) is not released when another cache takes it. A copy of the model does not
    carry the state (device buffers, a CUDA graph)."""
    import copy

    model = routed_model()
    start = prompt(2, 10, seed=20)
    _, _, first = static_cached(model, start, 4, max_cache_len=20)
    state = first.static
    first.reset()
    with torch.no_grad():  # the reset cache's new prompt, not decoded yet
        token = model(start[:, :6], cache=first).logits[:, -1:].argmax(-1)
    _, _, second = static_cached(model, start, 4, max_cache_len=20)
    assert second.static is state and not first._released
    with torch.no_grad():  # the first cache decodes again: it takes the state back from the second
        model(token, cache=first)
    assert first.static is state and second._released
    assert copy.deepcopy(model).model.static_decode_state is None and model.model.static_decode_state is state
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())
    _, _, third = static_cached(model, start, 4, max_cache_len=20)
    assert third.static is not state and not first._released


def region_case(seed=0, dtype=torch.float32, head_dim=24):
    """Queries of 3 sequences (4 heads, 2 KV heads, head_dim 24 by default: not a power of two) over a flat
    buffer whose regions hold 1, 70 (over one 64-slot block) and 5 entries, with room after each."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, 1, head_dim, generator=gen).to(dtype)
    keys, values = (torch.randn(1, 2, 120, head_dim, generator=gen).to(dtype) for _ in range(2))
    starts, ends = torch.tensor([0, 10, 100]), torch.tensor([1, 80, 105])
    return q, keys, values, starts, ends


def test_region_attention_reference_attends_to_each_region_only():
    """The torch path against a plain per-sequence softmax over each region's slots."""
    q, keys, values, starts, ends = region_case()
    out = regions.region_attention_torch(q, keys, values, starts, ends, 0.2)
    for row in range(3):
        k = keys[0, :, starts[row]:ends[row]].repeat_interleave(2, dim=0)  # [heads, n, d]
        v = values[0, :, starts[row]:ends[row]].repeat_interleave(2, dim=0)
        weights = torch.softmax(q[row, :, 0, None, :] @ k.transpose(1, 2) * 0.2, dim=-1)  # [heads, 1, n]
        torch.testing.assert_close(out[row, :, 0], (weights @ v)[:, 0], rtol=0, atol=1e-6)


def test_region_attention_backend_is_checked():
    q, keys, values, starts, ends = region_case()
    with pytest.raises(ValueError, match="backend: 'cuda' is not one of auto, torch, triton"):
        regions.region_attention(q, keys, values, starts, ends, 0.2, backend="cuda")
    if not INTERP and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend: the Triton region attention needs a CUDA device"):
            regions.region_attention(q, keys, values, starts, ends, 0.2, backend="triton")


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_interp_region_attention_matches_the_reference(dtype):
    q, keys, values, starts, ends = region_case(dtype=dtype)
    got = regions.region_attention_triton(q, keys, values, starts, ends, 0.2)
    want = regions.region_attention_torch(q.float(), keys.float(), values.float(), starts, ends, 0.2)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


@needs_interp
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_interp_region_attention_at_model_head_dims(head_dim):
    """The Table 4 backbones' head dims (a 64 x head_dim tile of keys and values a step): what
    test_region_attention_interpreter compiles for the GPUs."""
    q, keys, values, starts, ends = region_case(dtype=torch.bfloat16, head_dim=head_dim)
    got = regions.region_attention_triton(q, keys, values, starts, ends, head_dim ** -0.5)
    want = regions.region_attention_torch(q.float(), keys.float(), values.float(), starts, ends, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)


@needs_interp
def test_triton_interp_fixed_shape_decode_through_the_kernel_equals_the_default_path(monkeypatch):
    calls = []
    kernel = regions.region_attention_triton
    monkeypatch.setattr(regions, "region_attention_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = routed_model()
    start = prompt(2, 10, seed=13)
    want_tokens, want_logits, want_cache = cached(model, start, 8)
    cache, tokens, logits = first_fixed_step(model, start, 8)
    assert not calls  # "auto" on a CPU: the torch path
    cache.static.attention_backend = "triton"
    tokens, logits = greedy_steps(model, cache, tokens, logits, 6)
    assert calls  # the kernel ran for the sparse layers that routed a token
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert cache.static.entries() == want_cache.entries()


def test_region_attention_interpreter():
    """Runs this file's ``triton_interp_`` tests under TRITON_INTERPRET=1 (set before Triton defines kernels);
    then every launch they made compiles for A100 and H100 (sm_80, sm_90) within a block's resources."""
    pytest.importorskip("triton")
    if INTERP:
        pytest.skip("already inside the interpreter run")
    last = run_triton_interp_tests(__file__, {"_region_attention_kernel"}, timeout=600)
    assert last.startswith("5 passed"), last


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")
def test_gpu_fixed_shape_decode_replays_one_cuda_graph_without_host_reads():
    """On a GPU: the second decode step captures the step as one CUDA graph (IF nodes where torch has
    them), later steps replay it with no host read (counted), and the tokens, logits and entries are the
    default path's; the sparse layers' attention runs the Triton region kernel."""
    from sync_counter import SyncCounter

    from megatron_xmod.hf.static_decode import conditional_nodes_available

    if not conditional_nodes_available():
        pytest.skip("this torch cannot capture CUDA-graph conditional nodes (CUDA >= 12.4 needed)")
    calls = []
    kernel = regions.region_attention_triton
    model = routed_model().cuda()
    start = prompt(3, 12, seed=14).cuda()
    want_tokens, want_logits, want_cache = cached(model, start, 16)
    cache, tokens, logits = first_fixed_step(model, start, 16)
    tokens, logits = greedy_steps(model, cache, tokens, logits, 2)  # the second step captures
    assert cache.static.graph is not None
    with SyncCounter() as syncs:
        tokens, logits = greedy_steps(model, cache, tokens[:, :-1], list(logits.unbind(1)), 12)
    torch.cuda.synchronize()
    assert syncs.count == 0, syncs.summary()
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)
    assert cache.static.entries() == want_cache.entries()
    # a later generation (a prefix of the prompt: every region fits) refills the state and replays the same graph
    state, graph = cache.static, cache.static.graph
    want_tokens, want_logits, _ = cached(model, start[:, :9], 10)
    again = XModCache(model.config, max_cache_len=25)  # 16 tokens of room, as the first generation had
    with torch.no_grad():
        logits = [model(start[:, :9], cache=again).logits[:, -1]]
    with SyncCounter() as syncs:  # the refill and nine replayed steps
        tokens, logits = greedy_steps(model, again, start[:, :9], logits, 9)
    torch.cuda.synchronize()
    assert again.static is state and state.graph is graph and cache.static is None  # the first cache released
    assert syncs.count == 0, syncs.summary()
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)
    model.model.static_decode_state = None  # the next cache builds a state of its own
    with pytest.MonkeyPatch.context() as patch:  # a fresh state: the kernel ran inside the captured step
        patch.setattr(regions, "region_attention_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
        static_cached(model, start, 4)
    assert calls


# ------------------------------------------------------ IF nodes where torch has none (csrc/graph_if_node.cu)
class _GraphOfAnOlderTorch:
    """torch.cuda.CUDAGraph before 2.12 as the emulator stands in for it: no IF-node methods, and ``pool()``
    refused until the capture ended, as torch refuses it."""

    def __init__(self):
        self.recorder = self.recording = self.capture_error_mode = self.captured_pool = None

    def pool(self):
        if self.captured_pool is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.captured_pool

    def replay(self) -> None:
        self.recording.replay()


class _EmulatedExtension:
    """The extension's two calls (graph_if_node_bindings.cpp), opening the emulator's conditional nodes in the
    graph being captured into the pool they are given; records the pools."""

    def __init__(self):
        self.capturing, self.open, self.pools = {}, [], []  # pool -> graph being captured into it

    def graph(self, state):
        """torch.cuda.graph of the emulator, noting which graph captures into which pool."""
        import contextlib

        from graph_replay import emulated_graph

        inner = emulated_graph(state.buffers)

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.capturing[tuple(pool)] = cuda_graph
            with inner(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                yield
            del self.capturing[tuple(pool)]
            cuda_graph.captured_pool = tuple(pool)

        return graph

    def begin_capture_to_if_node(self, pred, pool_first, pool_second):
        assert pred.dtype == torch.bool and pred.numel() == 1
        self.pools.append((pool_first, pool_second))
        self.open.append(self.capturing[(pool_first, pool_second)])
        self.open[-1].recorder.begin_conditional(pred)

    def end_capture_to_conditional_node(self):
        self.open.pop().recorder.end_conditional()


def test_a_torch_without_if_nodes_captures_them_through_the_extension(monkeypatch):
    """Where torch's CUDAGraph has no begin_capture_to_if_node (torch < 2.12, the GPU machine's 2.11), the
    decode state opens each sparse layer's IF node through the package's extension, in the memory pool the
    graph is being captured into (which such a CUDAGraph tells only after its capture): the same graph (one
    conditional node a sparse layer), tokens, logits and entries as with torch's own IF nodes."""
    from graph_replay import EmulatedCUDAGraph

    from megatron_xmod.hf import static_decode

    model = routed_model()
    start = prompt(2, 10, seed=12)
    want_tokens, want_logits, want_cache = cached(model, start, 12)
    cache, tokens, logits = first_fixed_step(model, start, 12)
    state = cache.static
    extension = _EmulatedExtension()
    monkeypatch.setattr(static_decode, "extension_if_nodes", lambda: extension)
    graph_on_emulated_cuda(monkeypatch, state, extension.graph(state), _GraphOfAnOlderTorch)
    tokens, logits = greedy_steps(model, cache, tokens, logits, 10)
    sparse = sum(layer.sparse for layer in model.model.layers)
    assert EmulatedCUDAGraph.captures == 2 and state.graph.recording.conditionals() == sparse
    # the warm-up capture's nodes in its own graph's pool, then the kept graph's in its pool
    assert len(extension.pools) == 2 * sparse and extension.pools[-sparse:] == [state.graph.pool()] * sparse
    assert len(set(extension.pools)) == 2 and not extension.open
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    assert state.entries() == want_cache.entries()


def test_who_opens_the_if_nodes(monkeypatch):
    """torch's IF nodes where its CUDAGraph has them, else the extension's, else none (eager decode)."""
    from megatron_xmod.hf import static_decode

    monkeypatch.setattr(static_decode, "extension_if_nodes", lambda: object())
    assert static_decode.if_node_provider() == ("torch" if hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
                                                else "extension")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _GraphOfAnOlderTorch)
    assert static_decode.if_node_provider() == "extension"
    monkeypatch.setattr(static_decode, "extension_if_nodes", lambda: None)
    assert static_decode.if_node_provider() == "none"


class _CountedPool:
    """torch.cuda.MemPool as the caching allocator counts its uses: one for the MemPool itself."""

    made: list = []

    def __init__(self):
        self.id, self.uses = (0, len(self.made) + 1), 1
        self.made.append(self)

    def use_count(self) -> int:
        return self.uses


@pytest.mark.parametrize("uses_a_node_takes", [2, 0, 1], ids=["torch-2.13", "a-torch-that-balances", "unexpected"])
def test_torchs_if_nodes_leave_the_graph_pool_held_once(monkeypatch, uses_a_node_takes):
    """torch 2.12-2.14's IF nodes take a use of the graph's pool at each node's start and end that nothing gives
    back (the allocator's beginAllocateToPool increfs): after each capture the decode state gives back exactly
    those, so the pool is held by its MemPool and the capture only (the MemPool then goes: the graph holds it);
    with a torch that balances its own nothing goes back, and a count that matches neither is left, with a
    warning."""
    from graph_replay import EmulatedCUDAGraph, emulated_graph

    from megatron_xmod.hf import static_decode

    class GraphTakingPoolUses(EmulatedCUDAGraph):
        def begin_capture_to_if_node(self, pred):
            self.pool.uses += uses_a_node_takes // 2
            super().begin_capture_to_if_node(pred)

        def end_capture_to_conditional_node(self):
            super().end_capture_to_conditional_node()
            self.pool.uses += uses_a_node_takes - uses_a_node_takes // 2

    model = routed_model()
    start = prompt(2, 10, seed=12)
    want_tokens, want_logits, _ = cached(model, start, 12)
    cache, tokens, logits = first_fixed_step(model, start, 12)
    state = cache.static
    inner = emulated_graph(state.buffers)
    monkeypatch.setattr(_CountedPool, "made", [])
    pools = _CountedPool.made

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        cuda_graph.pool = next(p for p in pools if p.id == pool)
        cuda_graph.pool.uses += 1  # capture_begin's beginAllocateToPool
        with inner(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield

    def released(device_index, pool_id):
        assert device_index == 0  # the device current when the pool was made
        next(p for p in pools if p.id == pool_id).uses -= 1

    monkeypatch.setattr(static_decode, "if_nodes_take_pool_uses", lambda: True)
    monkeypatch.setattr(torch.cuda, "MemPool", _CountedPool)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(static_decode, "release_pool_use", released)
    graph_on_emulated_cuda(monkeypatch, state, graph, GraphTakingPoolUses)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        tokens, logits = greedy_steps(model, cache, tokens, logits, 10)
    sparse = sum(layer.sparse for layer in model.model.layers)
    assert EmulatedCUDAGraph.captures == 2 and len(pools) == 2  # the warm-up capture and the kept one
    assert state.graph.recording.conditionals() == sparse
    if uses_a_node_takes == 2:
        assert [p.uses for p in pools] == [2, 2] and state.pool_uses_given_back == 2 * 2 * sparse and not warned
    elif uses_a_node_takes == 0:
        assert [p.uses for p in pools] == [2, 2] and state.pool_uses_given_back == 0 and not warned
    else:
        assert [p.uses for p in pools] == [2 + sparse] * 2 and state.pool_uses_given_back == 0
        assert len(warned) == 2 and "none given back" in str(warned[0].message)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)


def test_a_graph_pool_is_counted_only_where_torchs_if_nodes_take_uses(monkeypatch):
    """A MemPool whose uses are counted where this torch's IF nodes take some on a GPU; a plain handle, and
    nothing to give back, elsewhere: without a GPU, under the extension's nodes (which balance their own), and
    on a torch outside the releases read."""
    from megatron_xmod.hf import static_decode

    pool = static_decode.GraphPool()
    assert len(pool.handle) == 2
    if static_decode.if_nodes_take_pool_uses():
        assert isinstance(pool.owner, torch.cuda.MemPool) and pool.handle == pool.owner.id
    else:
        assert pool.owner is None and pool.give_back() == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(static_decode, "if_node_provider", lambda: "torch")
    assert static_decode.if_nodes_take_pool_uses()
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    assert not static_decode.if_nodes_take_pool_uses()
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    monkeypatch.setattr(static_decode, "if_node_provider", lambda: "extension")
    assert not static_decode.if_nodes_take_pool_uses()


def _extension():
    from megatron_xmod.hf.static_decode import extension_if_nodes

    extension = extension_if_nodes()
    if extension is None:
        pytest.skip("the CUDA extension is not built here (no CUDA toolkit at install time)")
    return extension


def test_the_extension_opens_if_nodes_and_refuses_what_it_cannot():
    """The extension built here (CUDA 13 headers) opens IF nodes: its condition kernel is compiled for A100 and
    H100 without a stack frame, and its calls name what is wrong before touching any CUDA state."""
    pytest.importorskip("triton")
    from triton_targets import binary_resource_usage

    extension = _extension()
    assert extension.if_nodes_built()
    kernels = [k for k in binary_resource_usage(extension.__file__) if "set_if_condition" in k["kernel"]]
    assert sorted(k["arch"] for k in kernels) == [80, 90] and all(k["stack"] == 0 for k in kernels), kernels
    with pytest.raises(RuntimeError, match="pred must be a one-element bool CUDA tensor"):
        extension.begin_capture_to_if_node(torch.zeros((), dtype=torch.bool), 0, 0)
    with pytest.raises(RuntimeError, match="no node is open on this thread"):
        extension.end_capture_to_conditional_node()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")
def test_gpu_extension_if_node_runs_its_body_only_when_the_flag_is_true():
    """On a GPU, the extension's IF node (whatever torch's version): a replay skips the body while the device
    flag is False and runs it when True, with a tensor allocated inside the body (served by the graph's pool)."""
    extension = _extension()
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    counter = torch.zeros(4, device="cuda")
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(2):  # two nodes, one after the other: the second reuses the first's stream
            extension.begin_capture_to_if_node(flag, *pool)
            try:
                counter.add_(torch.arange(4, device="cuda", dtype=torch.float32) + 1)  # allocates inside the body
            finally:
                extension.end_capture_to_conditional_node()
        counter.mul_(2)  # after the nodes: always runs
    # the graph holds its pool as often as a graph of the same work without IF nodes (else reset would not free it)
    plain, plain_pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.cuda.graph(plain, pool=plain_pool):
        torch.zeros(4, device="cuda").add_(torch.arange(4, device="cuda", dtype=torch.float32) + 1)
    device = torch.cuda.current_device()
    assert extension.pool_use_count(device, *pool) == extension.pool_use_count(device, *plain_pool)
    graph.replay()
    flag.fill_(True)
    graph.replay()
    flag.fill_(False)
    graph.replay()
    torch.cuda.synchronize()
    # 0 -> 0 -> (0 + 2 [1,2,3,4]) * 2 -> * 2
    assert counter.tolist() == [8.0, 16.0, 24.0, 32.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")
def test_gpu_a_graph_of_torchs_if_nodes_holds_its_pool_once_after_the_give_back():
    """On a GPU whose torch's IF nodes take pool uses (2.12-2.14): three nodes take six uses or none, the
    give-back returns them, the bodies run on replay, and deleting the graph frees the pool's memory."""
    from megatron_xmod.hf import static_decode

    if not static_decode.if_nodes_take_pool_uses():
        pytest.skip(f"torch {torch.__version__}: no IF nodes of its own, or a release not read")
    flag = torch.ones((), dtype=torch.bool, device="cuda")
    counter = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    graph, pool = torch.cuda.CUDAGraph(), static_decode.GraphPool()
    owner = pool.owner
    with torch.cuda.graph(graph, pool=pool.handle):
        for _ in range(3):
            static_decode.begin_if_node(graph, pool, flag)
            try:
                counter.add_(torch.arange(4, device="cuda", dtype=torch.float32))  # allocates inside the body
            finally:
                static_decode.end_if_node(graph, pool)
    taken = owner.use_count() - 2
    assert taken in (0, 6) and pool.taken == 6, taken
    assert pool.give_back() == taken and owner.use_count() == 2 and pool.owner is None
    graph.replay()
    torch.cuda.synchronize()
    assert counter.tolist() == [0.0, 3.0, 6.0, 9.0]
    del graph, owner, pool
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == reserved
