"""Layer layouts: one small notation for every depth structure of the X-MoD paper.

Grammar (whitespace is ignored)::

    layout := term ('+' term)*
    term   := atom ('*' INT)?
    atom   := 'D' | 'S' INT | '(' layout ')'

``D`` is a dense transformer layer, ``S<K>`` a sparse layer that processes the top 1/K of the
tokens, ``*n`` repeats, ``+`` concatenates. Examples (equations of the X-MoD paper):

    Eq.(3)  generic X-MoD   D*4 + (S8*8 + D)*4            (N0=4, A=1, K=8, N1=4)
            fractional A    D*4 + (S8*4 + D)*16           (A=0.5: A*K=4 sparse layers a block)
    Eq.(34) MoD             D + (S8 + D)*24
    Eq.(35) X-MoD A4K8      D*4 + (S8*24 + D) + (S8*32 + D)*4
    Eq.(36) X-MoD A3K16     D*4 + (S16*48 + D)*6

A layout expands to a per-layer list of :class:`LayoutLayer`. A dense layer that directly follows a
sparse layer is an *anchor*: it closes a sparse block, and the token-choice bias (Eq.8) is reset
there. A layout also knows its routing family (dense, MoD or X-MoD), since the notation alone cannot
tell MoD's ``(S8 + D)`` from an X-MoD block with A = 1/8. The block spec builder and the accounting
both read this, nothing else.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

ROUTING_FAMILIES = ("dense", "mod", "xmod")


@dataclass(frozen=True)
class LayoutLayer:
    kind: str  # "dense" | "sparse" | "anchor"
    sparsity_k: int = 1  # tokens routed = 1/sparsity_k of the sequence
    block: int = -1  # index of the sparse block (sparse layers and the anchor that closes them)
    index_in_block: int = -1  # 0 for the first sparse layer of a block (where the bias b starts at 0)

    @property
    def is_sparse(self) -> bool:
        return self.kind == "sparse"

    @property
    def routed_fraction(self) -> Fraction:
        return Fraction(1, self.sparsity_k)


@dataclass(frozen=True)
class Layout:
    notation: str
    layers: tuple[LayoutLayer, ...]
    family: str = "dense"  # dense | mod | xmod: MoD's Eq.(6) or X-MoD's Eq.(7) in every sparse layer

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_sparse_layers(self) -> int:
        return sum(layer.is_sparse for layer in self.layers)

    @property
    def activated_depth(self) -> Fraction:
        """Layers a token passes through on average: dense layers count 1, sparse layers 1/K."""
        return sum((layer.routed_fraction for layer in self.layers), Fraction(0))

    def kinds(self) -> list[str]:
        return [layer.kind for layer in self.layers]

    def __str__(self) -> str:
        return self.notation


class LayoutError(ValueError):
    pass


_TOKEN = re.compile(r"\s*(?:(D)|S(\d+)|(\d+)|([()+*]))")


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise LayoutError(
                f"layout: unexpected {text[pos:pos + 8]!r} at position {pos} in {text!r}; "
                "allowed: 'D', 'S<K>', '*<n>', '+', parentheses"
            )
        dense, sparse_k, integer, punct = match.groups()
        if dense:
            tokens.append(("D", ""))
        elif sparse_k is not None:
            tokens.append(("S", sparse_k))
        elif integer is not None:
            tokens.append(("INT", integer))
        else:
            tokens.append((punct, ""))
        pos = match.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0

    def _peek(self) -> Optional[str]:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def _take(self, kind: str) -> str:
        if self._peek() != kind:
            found = self._peek() or "end of layout"
            raise LayoutError(f"layout: expected {kind!r} but found {found!r} in {self.text!r}")
        value = self.tokens[self.pos][1]
        self.pos += 1
        return value

    def parse(self) -> list[int]:
        """Returns the expanded list of per-layer sparsity K (K=1 for a dense layer)."""
        layers = self._layout()
        if self._peek() is not None:
            raise LayoutError(f"layout: trailing {self._peek()!r} in {self.text!r}")
        return layers

    def _layout(self) -> list[int]:
        layers = self._term()
        while self._peek() == "+":
            self._take("+")
            layers += self._term()
        return layers

    def _term(self) -> list[int]:
        kind = self._peek()
        if kind == "D":
            self._take("D")
            atom = [1]
        elif kind == "S":
            k = int(self._take("S"))
            if k < 2:
                raise LayoutError(f"layout: sparse layer S{k} needs K >= 2 (S1 would be a dense layer, write D)")
            atom = [k]
        elif kind == "(":
            self._take("(")
            atom = self._layout()
            self._take(")")
        else:
            raise LayoutError(f"layout: expected 'D', 'S<K>' or '(' but found {kind or 'end of layout'!r} in {self.text!r}")
        if self._peek() == "*":
            self._take("*")
            count = int(self._take("INT"))
            if count < 1:
                raise LayoutError(f"layout: repeat count must be >= 1, got *{count} in {self.text!r}")
            atom = atom * count
        return atom


def parse_layout(text: str, family: Optional[str] = None) -> Layout:
    """``family`` defaults to dense for a layout without sparse layers and to xmod otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise LayoutError("layout: empty layout string; example: 'D*4 + (S8*8 + D)*4'")
    per_layer_k = _Parser(text).parse()
    layers, block, index, in_sparse_run = [], -1, 0, False
    for k in per_layer_k:
        if k > 1:
            if not in_sparse_run:
                block, index, in_sparse_run = block + 1, 0, True
            layers.append(LayoutLayer("sparse", k, block, index))
            index += 1
        elif in_sparse_run:
            layers.append(LayoutLayer("anchor", 1, block))
            in_sparse_run = False
        else:
            layers.append(LayoutLayer("dense", 1, -1))
    has_sparse = any(layer.is_sparse for layer in layers)
    if family is None:
        family = "xmod" if has_sparse else "dense"
    if family not in ROUTING_FAMILIES:
        raise LayoutError(f"routing_family: {family!r} is not one of {', '.join(ROUTING_FAMILIES)}")
    if family == "dense" and has_sparse:
        raise LayoutError(f"layout: routing_family 'dense' allows only D layers, got {text!r}")
    if family != "dense" and not has_sparse:
        raise LayoutError(f"layout: routing_family {family!r} needs at least one S<K> layer, got {text!r}")
    return Layout(" ".join(text.split()), tuple(layers), family)


def _whole(value: Fraction | float, field: str, what: str) -> int:
    value = Fraction(value).limit_denominator(10_000)
    if value.denominator != 1:
        raise LayoutError(f"{field}: {what} must be a whole number, got {float(value):g}")
    return int(value)


def fitting_dense_prefix(anchor_stride: float, activated_depth: int, dense_prefix: int) -> Optional[int]:
    """The dense prefix N0 nearest ``dense_prefix`` (the smaller one on a tie) that leaves a whole number
    N1 >= 1 of sparse blocks in ``activated_depth`` layers, each activating 1 + A; None when none does."""
    a = Fraction(anchor_stride).limit_denominator(10_000)
    fits = [n0 for n0 in range(activated_depth)
            if (Fraction(activated_depth - n0) / (1 + a)).denominator == 1]
    return min(fits, key=lambda n0: (abs(n0 - dense_prefix), n0)) if fits else None


def _prefix_fix(anchor_stride: float, activated_depth: int, dense_prefix: int, no_room: bool) -> str:
    """How to fix N0, naming the flags that set it (xmod count / partition / plan; the entry point and launchers)."""
    fit = fitting_dense_prefix(anchor_stride, activated_depth, dense_prefix)
    if fit is None:
        return (f"no dense prefix leaves whole blocks of 1 + A = {1 + anchor_stride:g} activated layers in "
                f"{activated_depth}; use another A or a backbone of another depth (num_layers)")
    return (f"set N0 = {fit} (--dense-prefix {fit} for xmod count / partition / plan, --xmod-dense-prefix {fit} for "
            "python -m megatron_xmod.pretrain and the launchers' EXTRA_ARGS)"
            + (", or use a deeper backbone (num_layers)" if no_room else ""))


def xmod_notation(sparsity_k: int, anchor_stride: float, dense_prefix: int, activated_depth: int) -> str:
    """Eq.(3): [Dense]*N0 + ([Sparse(K)]*AK + [Dense])*N1 with N1 = (depth - N0) / (1 + A)."""
    sparse_per_block = _whole(Fraction(anchor_stride).limit_denominator(10_000) * sparsity_k,
                              "anchor_stride", f"A*K (= {anchor_stride:g}*{sparsity_k}, sparse layers per block)")
    if dense_prefix >= activated_depth:
        raise LayoutError(f"dense_prefix: {dense_prefix} leaves no room for a sparse block in {activated_depth} "
                          f"activated layers; {_prefix_fix(anchor_stride, activated_depth, dense_prefix, True)}")
    n1 = Fraction(activated_depth - dense_prefix) / (1 + Fraction(anchor_stride).limit_denominator(10_000))
    if n1.denominator != 1:
        raise LayoutError(f"anchor_stride: N1 = (activated_depth - dense_prefix)/(1 + A) = ({activated_depth} - "
                          f"{dense_prefix})/(1 + {anchor_stride:g}) must be a whole number, got {float(n1):g}; "
                          f"{_prefix_fix(anchor_stride, activated_depth, dense_prefix, False)}")
    num_blocks = int(n1)
    if num_blocks < 1:
        raise LayoutError(f"dense_prefix: {dense_prefix} leaves no room for a sparse block in {activated_depth} "
                          f"activated layers; {_prefix_fix(anchor_stride, activated_depth, dense_prefix, True)}")
    prefix = [f"D*{dense_prefix}"] if dense_prefix > 1 else (["D"] if dense_prefix == 1 else [])
    block = f"(S{sparsity_k}*{sparse_per_block} + D)" if sparse_per_block > 1 else f"(S{sparsity_k} + D)"
    return " + ".join(prefix + [block + (f"*{num_blocks}" if num_blocks > 1 else "")])


def mod_notation(sparsity_k: int, activated_depth: int, dense_prefix: Optional[int] = None) -> str:
    """Eq.(1)/(34): ([Sparse(K)] + [Dense])*N after a dense prefix that fills the activated depth.

    Each pair activates 1 + 1/K layers, so N is a multiple of K; the paper's 28-layer MoD with K=8
    is D + (S8 + D)*24 (1 + 24 + 24/8 = 28).
    """
    groups = activated_depth // (sparsity_k + 1)
    if dense_prefix is not None:
        groups = (activated_depth - dense_prefix) // (sparsity_k + 1)
    pairs = groups * sparsity_k
    prefix = activated_depth - groups * (sparsity_k + 1)
    after = f" after a dense prefix of {dense_prefix}" if dense_prefix is not None else ""
    if pairs < 1:
        room = activated_depth - (dense_prefix or 0)
        raise LayoutError(
            f"sparsity_k: MoD with K={sparsity_k} cannot fill {activated_depth} activated layers{after}: each group of "
            f"K sparse + K dense layers activates K + 1 = {sparsity_k + 1}; "
            + (f"use K <= {room - 1} (mod-k{room - 1}, --xmod-sparsity-k {room - 1}) or a deeper backbone (num_layers)"
               if room >= 3 else "use a smaller dense prefix or a deeper backbone (num_layers)"))
    if dense_prefix is not None and prefix != dense_prefix:
        fits = [n0 for n0 in range(activated_depth - sparsity_k) if (activated_depth - n0) % (sparsity_k + 1) == 0]
        fit = min(fits, key=lambda n0: (abs(n0 - dense_prefix), n0))
        raise LayoutError(
            f"dense_prefix: MoD with K={sparsity_k} cannot fill {activated_depth} activated layers{after}: groups of "
            f"K + 1 = {sparsity_k + 1} leave {activated_depth - dense_prefix - groups * (sparsity_k + 1)} over; set "
            f"--xmod-dense-prefix {fit} (or leave it out)")
    head = [f"D*{prefix}"] if prefix > 1 else (["D"] if prefix == 1 else [])
    return " + ".join(head + [f"(S{sparsity_k} + D)*{pairs}"])


def resolve_layout(
    routing_family: str,
    num_layers: Optional[int] = None,
    sparsity_k: Optional[int] = None,
    anchor_stride: Optional[float] = None,
    dense_prefix: Optional[int] = None,
    layout: Optional[str] = None,
    activated_depth: Optional[int] = None,
) -> Layout:
    """The single place that turns routing options into a layout, validating every field.

    Either ``layout`` is given explicitly, or it is derived from the family and K/A/N0 for a
    backbone of ``activated_depth`` layers. ``num_layers`` (physical layers, megatron's
    ``num_layers``) must match the layout when given.
    """
    if routing_family not in ROUTING_FAMILIES:
        raise LayoutError(f"routing_family: {routing_family!r} is not one of {', '.join(ROUTING_FAMILIES)}")
    if sparsity_k is not None and (not isinstance(sparsity_k, int) or sparsity_k < 1):
        raise LayoutError(f"sparsity_k: K must be an integer >= 1, got {sparsity_k!r}")
    if anchor_stride is not None and not anchor_stride > 0:
        raise LayoutError(f"anchor_stride: A must be > 0, got {anchor_stride!r}")
    if dense_prefix is not None and (not isinstance(dense_prefix, int) or dense_prefix < 0):
        raise LayoutError(f"dense_prefix: N0 must be an integer >= 0, got {dense_prefix!r}")
    if activated_depth is not None and (not isinstance(activated_depth, int) or activated_depth < 1):
        raise LayoutError(f"activated_depth: must be an integer >= 1, got {activated_depth!r}")

    if layout is not None:
        if any(v is not None for v in (anchor_stride, dense_prefix)):
            raise LayoutError("layout: give either an explicit layout or anchor_stride/dense_prefix, not both")
        resolved = parse_layout(layout, routing_family)
        sparse_ks = {layer.sparsity_k for layer in resolved.layers if layer.is_sparse}
        if sparsity_k is not None and sparse_ks - {sparsity_k}:
            raise LayoutError(f"sparsity_k: {sparsity_k} disagrees with the layout's sparse layers S{sorted(sparse_ks)}")
        if activated_depth is not None and resolved.activated_depth != activated_depth:
            raise LayoutError(
                f"layout: activates {float(resolved.activated_depth):g} layers per token, "
                f"but activated_depth is {activated_depth}"
            )
    else:
        depth = activated_depth if activated_depth is not None else num_layers
        if depth is None:
            raise LayoutError("activated_depth: needed to derive a layout (or give an explicit layout)")
        if routing_family == "dense":
            if sparsity_k not in (None, 1) or anchor_stride is not None:
                raise LayoutError("sparsity_k: routing_family 'dense' takes no sparsity_k/anchor_stride")
            notation = f"D*{depth}" if depth > 1 else "D"
        elif sparsity_k is None or sparsity_k < 2:
            raise LayoutError(f"sparsity_k: routing_family {routing_family!r} needs K >= 2, got {sparsity_k!r}")
        elif routing_family == "mod":
            if anchor_stride is not None:
                raise LayoutError("anchor_stride: MoD alternates one sparse and one dense layer; A is an X-MoD option")
            notation = mod_notation(sparsity_k, depth, dense_prefix)
        else:
            notation = xmod_notation(sparsity_k, 1.0 if anchor_stride is None else anchor_stride,
                                     4 if dense_prefix is None else dense_prefix, depth)
        resolved = parse_layout(notation, routing_family)

    if num_layers is not None and num_layers != resolved.num_layers:
        raise LayoutError(
            f"num_layers: {num_layers} does not match the layout {resolved.notation!r}, "
            f"which has {resolved.num_layers} physical layers"
        )
    return resolved


# The X-MoD paper's named layouts (Eq.34-36) for the 28-layer backbones of its Table 4.
NAMED_LAYOUTS = {
    "dense": ("dense", "D*28"),
    "mod": ("mod", "D + (S8 + D)*24"),
    "xmod-a4k8": ("xmod", "D*4 + (S8*24 + D) + (S8*32 + D)*4"),
    "xmod-a3k16": ("xmod", "D*4 + (S16*48 + D)*6"),
}

_XMOD_NAME = re.compile(r"^xmod-a(\d+(?:\.\d+)?)k(\d+)$")

# The stabiliser ablations of the X-MoD paper (its Table 3, 936M A1K16 reference, L = 32768, C = 1.5e20:
# full 2.476; w/o dense anchors 2.579; w/o gated residual scaling 2.492; w/o token-choice bias 2.657;
# w/o dense prefix 2.487), as suffixes of an ``xmod-a<A>k<K>`` name (combinable, e.g.
# ``xmod-a1k16-no-bias``). Two change the layout (here), two the routing settings (:data:`ABLATION_SETTINGS`).
ABLATIONS = {
    "no-anchors": "w/o dense anchors: each anchor becomes K sparse layers (same activated depth; fewer FLOPs/token, "
                  "since routed attention is cheaper); the sparse layers form one block, so the token-choice bias is "
                  "never reset",
    "no-bias": "w/o token-choice bias: tau = 0",
    "no-gate-scale": "w/o gated residual scaling: varsigma fixed at 1, not learned",
    "no-prefix": "w/o dense prefix: N0 = 0, N1 = activated depth / (1 + A)",
}
# XModConfig fields each settings ablation fixes (the entry point turns them into --xmod-* flags).
ABLATION_SETTINGS = {
    "no-bias": {"xmod_token_choice_bias_tau": 0.0},
    "no-gate-scale": {"xmod_gate_scale_learnable": False, "xmod_gate_scale_init": 1.0},
}


def split_ablations(model: str) -> tuple[str, tuple[str, ...]]:
    """``xmod-a1k16-no-bias-no-prefix`` -> (``xmod-a1k16``, (``no-bias``, ``no-prefix``)); other names
    come back unchanged with no ablation. An ablation suffix on anything but ``xmod-a<A>k<K>`` is an error."""
    base, found = model, []
    while True:
        for suffix in ABLATIONS:
            if base.endswith("-" + suffix):
                base = base[: -len(suffix) - 1]
                found.append(suffix)
                break
        else:
            break
    if found and not _XMOD_NAME.match(base):
        raise LayoutError(f"model: the ablations ({', '.join('-' + a for a in ABLATIONS)}) apply to X-MoD names "
                          f"xmod-a<A>k<K>, e.g. xmod-a1k16-no-bias; got {model!r}")
    if len(set(found)) != len(found):
        raise LayoutError(f"model: {model!r} repeats an ablation suffix")
    return base, tuple(reversed(found))


def ablation_settings(model: str) -> dict:
    """The XModConfig fields a model name's ablations fix ({} for none)."""
    settings: dict = {}
    for ablation in split_ablations(model)[1]:
        settings.update(ABLATION_SETTINGS.get(ablation, {}))
    return settings


def without_anchors(layout: Layout) -> Layout:
    """Every anchor of ``layout`` replaced by K sparse layers of the block's K (the activated depth and
    FLOPs per token stay; the sparse layers merge into one block)."""
    ks = []
    for i, layer in enumerate(layout.layers):
        if layer.kind == "anchor":
            ks += [layout.layers[i - 1].sparsity_k] * layout.layers[i - 1].sparsity_k
        else:
            ks.append(layer.sparsity_k)
    terms: list[tuple[int, int]] = []  # run-length: (K, count)
    for k in ks:
        if terms and terms[-1][0] == k:
            terms[-1] = (k, terms[-1][1] + 1)
        else:
            terms.append((k, 1))
    notation = " + ".join(("D" if k == 1 else f"S{k}") + (f"*{n}" if n > 1 else "") for k, n in terms)
    return parse_layout(notation, layout.family)


def layout_from_model_name(model: str, activated_depth: int = 28, dense_prefix: int = 4,
                           family: Optional[str] = None) -> Layout:
    """``dense``, ``mod``, ``mod-k<K>``, ``xmod-a<A>k<K>`` (optionally with :data:`ABLATIONS` suffixes)
    or any layout notation (whose family is ``family``, by default dense without sparse layers and
    xmod with them)."""
    base, ablations = split_ablations(model)
    if ablations:
        layout = layout_from_model_name(base, activated_depth, 0 if "no-prefix" in ablations else dense_prefix)
        return without_anchors(layout) if "no-anchors" in ablations else layout
    named_prefix = NAMED_LAYOUTS.get(model, ("",))[0] != "xmod" or dense_prefix == 4  # the named X-MoD layouts have N0 = 4
    if model in NAMED_LAYOUTS and activated_depth == 28 and named_prefix:
        return parse_layout(NAMED_LAYOUTS[model][1], NAMED_LAYOUTS[model][0])
    if model == "dense":
        return resolve_layout("dense", activated_depth=activated_depth)
    if model == "mod":
        return resolve_layout("mod", sparsity_k=8, activated_depth=activated_depth)
    if model.startswith("mod-k") and model[5:].isdigit():
        return resolve_layout("mod", sparsity_k=int(model[5:]), activated_depth=activated_depth)
    match = _XMOD_NAME.match(model)
    if match:
        return resolve_layout("xmod", sparsity_k=int(match.group(2)), anchor_stride=float(match.group(1)),
                              dense_prefix=dense_prefix, activated_depth=activated_depth)
    if model[:1] in ("D", "S", "("):
        return parse_layout(model, family)
    raise LayoutError(
        f"model: {model!r} is not one of dense, mod, mod-k<K>, xmod-a<A>k<K> (e.g. xmod-a4k8, xmod-a3k16, with "
        f"optional ablations {', '.join('-' + a for a in ABLATIONS)}), or a layout such as 'D*4 + (S8*8 + D)*4'"
    )
