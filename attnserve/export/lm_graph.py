"""The language model's step graph (step.onnx), written node by node from `DecoderOnly`.

T new tokens per row after a past of W cache columns, T dynamic, so one graph prefills prompt
chunks and decodes (T = 1): `input_ids`, `attention_mask` (B, T), `past_mask` (B, W),
`past.{i}.key` / `.value` (B, Hkv, W, D), `logit_positions` (R,) -> `logits` (R, V) of the
positions asked for and `new.{i}.key` / `.value` (B, Hkv, T, D). It computes
`DecoderOnly.prefill`'s function (fp32 parity is checked at export), written for serving:

* The cache is an input and only the T new keys/values are outputs: scores over the past
  (B, Hkv, G, T, W) and over the new tokens (B, Hkv, G, T, T) share one softmax, and the output
  is `p_past @ V_past + p_new @ V_new`. The graph never concatenates the cache (a copy of all of
  it every step); the runtime appends the new columns to buffers with spare columns.
* Grouped-query attention without repeating K/V: the H query heads are viewed as (Hkv, G)
  (kv head j serves query heads jG..jG+G-1, as Hugging Face's `repeat_kv`), and the K/V of each
  kv head broadcast over its G queries in the MatMul.
* Positions come from the masks (real past columns plus real tokens before, in the chunk), so
  left padding, rows that joined later and reordered beams need nothing else. A padding token
  sees itself, so no query row is fully masked (its output is unused).
* Only the positions in `logit_positions` (flat indices b * T + t) reach the head: a step's or
  a prompt chunk's next-token scores are those of each row's last token (chunks are
  left-padded), while a prompt that is scored asks for every position. The head is a
  vocabulary-wide product per position, so a graph that computed it for every position would
  slow every prefill (ONNX Runtime runs a node whether or not an output that needs it is
  fetched); the index is the runtime's choice at each call.

It is written with as few nodes as ONNX Runtime runs well, because a decoding step of a small
model on the CPU pays a few microseconds per node whatever its size (torch's export of the same
function had ~1,900 nodes for SmolLM2's 30 layers, this graph ~1,200): RMSNorm is one
`RMSNormalization` (float32 inside), rotary embeddings one `RotaryEmbedding` per q and k (rotate-
half order; both ONNX opset 23) with the step's (B, T, D/2) cos/sin computed once from the
positions (no table: any position works, as in torch), q/k/v
one product with concatenated weights (the attention scale 1/sqrt(D) folded into q's: rotation
is linear) and gate/up another, each split after; the masks' additive biases are built once per
step; a tied head reads the embedding table through a Transpose that ONNX Runtime folds when
it loads the graph (the table is stored once).

The families' switches (`DecoderConfig`) are a few nodes each: projection biases one Add after
their product (q/k/v's concatenated), per-head q/k norms a Reshape / RMSNormalization / Reshape
per tensor before the rotation (the attention scale then folded into q's norm weight, since a
norm would undo it in q's projection), scaled rotary frequencies and YaRN's and LongRoPE's
attention factor only other constants (model/rope.py), partial rotation RotaryEmbedding's
`rotary_embedding_dim`, and a sliding window its own pair of mask biases, built from the key and
query positions, for the layers it covers. GroupQueryAttention takes the window as
`local_window_size`, which attnserve's kernel does not run: such graphs keep ONNX Runtime's.
Gemma's: norms stored as their scale (1 + w), a norm on each branch's output before its residual
Add, Gelu (tanh) for the MLP's activation, a Mul for the embedding scale, query_pre_attn_scalar
folded into q as the default scale is (GroupQueryAttention's own scale stays 1/sqrt(D), the
ratio folded), the attention soft cap a Tanh and a Mul before each mask bias (1 / cap folded
into q) or GroupQueryAttention's `softcap` (which also keeps ONNX Runtime's node), the final
soft cap after the head, and a second rotary pair (or table pair) for Gemma 3's sliding-window
layers' own base.

Dynamic NTK and LongRoPE frequencies depend on a row's length (model/rope.py): such a graph has
the input `rope_lengths` (B,) int64, the length each row's frequencies are chosen for (the
runtime passes the row's length after the call, or its whole prompt's during its prefill), and
computes (B, 1, R/2) frequencies from it: a Where between LongRoPE's long and short tables, or
dynamic NTK's base grown per row (a few element-wise nodes, float32 as torch computes it), so a
row's angles never depend on its batch (Gemma 3's sliding-window layers keep their plain
frequencies of their own base). GroupQueryAttention's own rotation reads one table of
whole-head frequencies for all rows; a model with partial rotation or per-row frequencies gets
q and k rotated by RotaryEmbedding before the node (`do_rotary` 0, positions from `seqlens_k`
as the node counts them, each layer by its own pair of cos/sin), which keeps ONNX Runtime's node
too (`lm_export.gqa_fallback`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from attnserve.engine.onnx.layout import (
    LM_GQA,
    LM_GQA_INPUTS,
    LM_INPUTS,
    LM_PLAIN,
    LOGIT_POSITIONS,
    LOGITS,
    ROPE_LENGTHS,
    lm_new_names,
    lm_past_names,
    lm_present_names,
)
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import (
    DecoderOnly,
    DecoderOnlyLayer,
    GroupedQueryAttention,
    RMSNorm,
)
from attnserve.model.rope import (
    length_dependent,
    longrope_frequencies,
    rope_frequencies,
)

# RMSNormalization and RotaryEmbedding are ONNX operators from opset 23 (IR version 11).
LM_OPSET = 23
LM_IR_VERSION = 11
ATTENTIONS = (LM_PLAIN, LM_GQA)
MS_DOMAIN = "com.microsoft"


def inverse_frequencies(config: DecoderConfig, local: bool = False) -> tuple[np.ndarray, float]:
    """(R/2,) float32 frequencies and the cos/sin factor: `rotary_cos_sin`'s, computed by
    torch as the model computes them (a length-dependent scaling's for a short sequence;
    `local`: those of the layers `config.local_rope` names)."""
    inv_freq, factor = rope_frequencies(config, local)
    return inv_freq.numpy(), factor


def rotates_outside(config: DecoderConfig) -> bool:
    """Whether the GroupQueryAttention graph rotates q and k before its attention nodes (the
    node's own rotation reads one table of whole-head frequencies for every row): partial
    rotation, or frequencies chosen per row by its length."""
    return config.rope_dim != config.head_dim or length_dependent(config)


# Initializers of at least this many bytes go to the external data file, when there is one.
EXTERNAL_MIN_BYTES = 1024
# Their offsets in it: a multiple of the page size, so that a runtime can map them.
EXTERNAL_ALIGN = 4096


class _Graph:
    """Nodes and initializers under construction, with fresh value names. With `data` (a file
    path), large initializers are written there as each is made, as ONNX external data named
    by the file's name (the graph is then saved in the same directory): the weights are never
    all in memory a second time beside the model's."""

    def __init__(self, data: Path | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0
        self._data = data
        if data is not None:
            data.write_bytes(b"")

    def const(self, name: str, value: Any, dtype: Any = None) -> str:
        array = np.asarray(value, dtype=dtype)
        if self._data is None or array.nbytes < EXTERNAL_MIN_BYTES:
            self.initializers.append(numpy_helper.from_array(array, name))
            return name
        tensor = onnx.TensorProto()
        tensor.name = name
        tensor.dims.extend(array.shape)
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        with open(self._data, "ab") as out:
            offset = -out.tell() % EXTERNAL_ALIGN + out.tell()
            out.write(b"\0" * (offset - out.tell()))
            np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tofile(out)
        tensor.data_location = TensorProto.EXTERNAL  # no raw_data: onnx.save writes nothing
        for key, entry in (
            ("location", self._data.name),
            ("offset", offset),
            ("length", array.nbytes),
        ):
            tensor.external_data.add(key=key, value=str(entry))
        self.initializers.append(tensor)
        return name

    def op(
        self,
        op_type: str,
        inputs: list[str],
        n_out: int = 1,
        *,
        name: str | None = None,
        outputs: list[str] | None = None,
        **attrs: Any,
    ) -> Any:
        """Append a node; returns its output name, or a list of `n_out` names. A named node's
        single output takes its name; `outputs` names them (the graph's outputs)."""
        self._count += 1
        stem = name or f"{op_type.lower()}_{self._count}"
        if outputs is None:
            outputs = [stem] if name and n_out == 1 else [f"{stem}:{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=stem, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs


def _weight(linear: torch.nn.Linear) -> np.ndarray:
    """A Linear's weight as the (K, N) right operand of x @ W."""
    return linear.weight.detach().float().numpy().T.copy()


def _rms_norm(g: _Graph, x: str, name: str, norm: RMSNorm, eps: float) -> str:
    """One RMSNormalization (float32 inside) of x's last axis, the norm's scale (Gemma's 1 + w
    included) stored as name.weight."""
    return g.op(
        "RMSNormalization", [x, g.const(f"{name}.weight", _scale(norm))],
        axis=-1, epsilon=eps, stash_type=1, name=name,
    )  # fmt: skip


def _scale(norm: RMSNorm) -> np.ndarray:
    """What a norm multiplies the normalized x by, float32 (1 + w for Gemma's)."""
    return norm.scale().detach().float().numpy()


def _bias(linear: torch.nn.Linear) -> np.ndarray | None:
    return None if linear.bias is None else linear.bias.detach().float().numpy().copy()


def _qkv(g: _Graph, attn: GroupedQueryAttention, p: str, h: str, *, q_scale: float = 1.0) -> str:
    """The fused q/k/v product of `h` (B, T, C) -> (B, T, (H + 2 Hkv) D), with its biases;
    `q_scale` multiplies q's weights and bias."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    scales = (q_scale, 1.0, 1.0)
    w = np.concatenate([_weight(m) * s for m, s in zip(projections, scales, strict=True)], axis=1)
    qkv = g.op("MatMul", [h, g.const(f"{p}.qkv_proj.weight", w)], name=f"{p}.qkv_proj")
    biases = [_bias(m) for m in projections]
    if all(b is None for b in biases):
        return qkv
    b = np.concatenate(
        [
            np.zeros(m.out_features, np.float32) if bias is None else bias * s
            for m, bias, s in zip(projections, biases, scales, strict=True)
        ]
    )
    return g.op("Add", [qkv, g.const(f"{p}.qkv_proj.bias", b)])


def _out_proj(g: _Graph, attn: GroupedQueryAttention, p: str, x: str) -> str:
    """The attention's output projection of `x`, with its bias."""
    out = g.op(
        "MatMul", [x, g.const(f"{p}.o_proj.weight", _weight(attn.o_proj))], name=f"{p}.o_proj"
    )
    bias = _bias(attn.o_proj)
    return out if bias is None else g.op("Add", [out, g.const(f"{p}.o_proj.bias", bias)])


def _head_norm(
    g: _Graph, x: str, name: str, weight: np.ndarray, heads: int, d: int, eps: float
) -> str:
    """RMSNormalization of each head of x (B, T, heads * D), `weight` (D,)."""
    shaped = g.op("Reshape", [x, g.const(f"{name}.heads", [0, 0, heads, d], np.int64)])
    normed = g.op(
        "RMSNormalization", [shaped, g.const(f"{name}.weight", weight.astype(np.float32))],
        axis=-1, epsilon=eps, stash_type=1, name=name,
    )  # fmt: skip
    return g.op("Reshape", [normed, g.const(f"{name}.merged", [0, 0, heads * d], np.int64)])


def _qk_norms(
    g: _Graph,
    attn: GroupedQueryAttention,
    p: str,
    q: str,
    k: str,
    cfg: DecoderConfig,
    q_scale: float = 1.0,
) -> tuple[str, str]:
    """Qwen3's and Gemma 3's per-head norms of q and k (B, T, n * D); `q_scale` multiplies
    q's weight."""
    assert attn.q_norm is not None and attn.k_norm is not None
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    q_weight = _scale(attn.q_norm) * np.float32(q_scale)
    q = _head_norm(g, q, f"{p}.q_norm", q_weight, cfg.num_heads, d, eps)
    return q, _head_norm(g, k, f"{p}.k_norm", _scale(attn.k_norm), cfg.num_kv_heads, d, eps)


def _mlp(g: _Graph, layer: DecoderOnlyLayer, p: str, x: str, eps: float, split: str) -> str:
    """x + the layer's gated MLP of its normed x: gate and up one product, split after; silu
    as x * Sigmoid(x), Gemma's GELU as Gelu (tanh), and Gemma's norm of the output."""
    mlp = layer.mlp
    norm_name = "pre_feedforward_layernorm" if layer.sandwich else "post_attention_layernorm"
    h = _rms_norm(g, x, f"{p}.{norm_name}", layer.mlp_norm, eps)
    w_gate_up = np.concatenate([_weight(mlp.gate_proj), _weight(mlp.up_proj)], axis=1)
    gate_up = g.op(
        "MatMul", [h, g.const(f"{p}.gate_up_proj.weight", w_gate_up)], name=f"{p}.gate_up"
    )
    gate, up = g.op("Split", [gate_up, split], n_out=2, axis=-1)
    if mlp.activation == "silu":
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    else:
        act = g.op("Mul", [g.op("Gelu", [gate], approximate="tanh"), up])
    down = g.op(
        "MatMul", [act, g.const(f"{p}.down_proj.weight", _weight(mlp.down_proj))],
        name=f"{p}.down_proj",
    )  # fmt: skip
    post = layer.post_feedforward_layernorm if layer.sandwich else None
    return _residual(g, x, down, post, f"{p}.post_feedforward_layernorm", eps)


def _residual(g: _Graph, x: str, out: str, norm: RMSNorm | None, name: str, eps: float) -> str:
    """x + a branch's output, normed first by `norm` (Gemma's sandwich norms) when given."""
    if norm is not None:
        out = _rms_norm(g, out, name, norm, eps)
    return g.op("Add", [x, out])


def _head(g: _Graph, model: DecoderOnly, x: str) -> None:
    """The final norm and output projection of the positions `logit_positions` of `x`
    (B, T, C) into the graph output `logits` (R, V). A tied head reads the embedding table
    through a Transpose that ONNX Runtime folds when it loads the graph (the table is stored
    once)."""
    flat = g.op("Reshape", [x, g.const("rows_shape", [-1, model.config.hidden_size], np.int64)])
    kept = g.op("Gather", [flat, LOGIT_POSITIONS], axis=0, name="logit_rows")  # (R, C)
    normed = _rms_norm(g, kept, "norm", model.norm, model.config.rms_norm_eps)
    if model.lm_head.weight is model.embed_tokens.weight:  # tied (a smoothed copy unties it)
        head = g.op("Transpose", ["embed_tokens.weight"], perm=[1, 0], name="lm_head.t")
    else:
        head = g.const("lm_head.weight", _weight(model.lm_head))
    cap = model.config.final_logit_softcapping
    if cap is None:
        g.op("MatMul", [normed, head], name="lm_head", outputs=[LOGITS])
        return
    # Gemma's soft cap, cap * tanh(logits / cap), as the model computes it
    logits = g.op("MatMul", [normed, head], name="lm_head")
    cap_name = g.const("final_logit_softcap", np.float32(cap))
    capped = g.op("Tanh", [g.op("Div", [logits, cap_name])])
    g.op("Mul", [capped, cap_name], name="final_logit_softcapping", outputs=[LOGITS])


def _embed(g: _Graph, model: DecoderOnly, ids: str) -> str:
    """The token embedding of `ids` (B, T) -> (B, T, C), times sqrt(hidden_size) with
    `scale_embeddings` (Gemma; the float32 factor the model multiplies by)."""
    table = model.embed_tokens.weight.detach().float().numpy()
    x = g.op("Gather", [g.const("embed_tokens.weight", table), ids], axis=0, name="embed")
    if not model.config.scale_embeddings:
        return x
    factor = np.float32(torch.tensor(model.config.hidden_size**0.5).item())
    return g.op("Mul", [x, g.const("embed_scale", factor)], name="embed_scaled")


def _positions_input() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(LOGIT_POSITIONS, TensorProto.INT64, ["logit_rows"])


def _logits_output(vocab_size: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["logit_rows", vocab_size])


def _window_biases(
    g: _Graph,
    window: int,
    positions: str,
    past_mask: str,
    past_visible: str,
    causal_real: str,
    itself: str,
) -> tuple[str, str]:
    """The additive biases of a sliding window: past (B, 1, 1, T, W) and new tokens (B, 1, 1,
    T, T). A key is visible when it is visible without the window and fewer than `window`
    positions separate it from the query (a past column's position: the real columns before it;
    a padding query still sees itself)."""
    zero, low = "zero", "lowest"
    one = g.const("one_i64", 1, np.int64)
    past_positions = g.op(
        "Sub", [g.op("CumSum", [past_mask, "axis_1_scalar"]), one]
    )  # (B, W): each real column's position
    query = g.op("Unsqueeze", [positions, g.const("axis_2b", [2], np.int64)])  # (B, T, 1)
    limit = g.const(f"window_{window}", window, np.int64)
    axis_1 = "axis_1"
    in_past = g.op(
        "Less", [g.op("Sub", [query, g.op("Unsqueeze", [past_positions, axis_1])]), limit]
    )  # (B, T, W)
    past = g.op("And", [in_past, g.op("Unsqueeze", [past_visible, axis_1])])
    in_new = g.op(
        "Less", [g.op("Sub", [query, g.op("Unsqueeze", [positions, axis_1])]), limit]
    )  # (B, T, T)
    new = g.op("Or", [g.op("And", [causal_real, in_new]), itself])
    axes = "axes_12"
    return (
        g.op("Unsqueeze", [g.op("Where", [past, zero, low]), axes], name=f"past_bias_w{window}"),
        g.op("Unsqueeze", [g.op("Where", [new, zero, low]), axes], name=f"new_bias_w{window}"),
    )


def _row_frequencies(g: _Graph, cfg: DecoderConfig) -> str:
    """(B, 1, R/2) float32 frequencies of each row from the input `rope_lengths` (B,), as
    model/rope.py's `row_frequencies` computes them: LongRoPE's long or short ones, or dynamic
    NTK's base grown with the length (the initial frequencies up to the reference length)."""
    params = cfg.rope_scaling or {}
    original = int(params["original_max_position_embeddings"])
    lengths = g.op("Unsqueeze", [ROPE_LENGTHS, g.const("rope_axes", [1, 2], np.int64)])
    longer = g.op("Greater", [lengths, g.const("rope_original", original, np.int64)])  # (B,1,1)
    if params["rope_type"] == "longrope":
        short, long = (f.numpy() for f in longrope_frequencies(cfg))
        return g.op(
            "Where", [longer, g.const("inv_freq_long", long), g.const("inv_freq_short", short)],
            name="row_inv_freq",
        )  # fmt: skip
    d, factor, f32 = cfg.rope_dim, float(params["factor"]), np.float32
    initial, _ = inverse_frequencies(cfg)
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(f32) / f32(d)
    # theta * (factor * length / reference - (factor - 1)) ** (d / (d - 2)), in float32
    scaled = g.op(
        "Mul", [g.op("Cast", [lengths], to=TensorProto.FLOAT), g.const("ntk_factor", f32(factor))]
    )
    ratio = g.op("Div", [scaled, g.const("ntk_reference", f32(original))])
    shifted = g.op("Sub", [ratio, g.const("ntk_factor_minus_1", f32(factor - 1))])
    grown_by = g.op("Pow", [shifted, g.const("ntk_power", f32(d / (d - 2)))])
    base = g.op("Mul", [g.const("ntk_theta", f32(cfg.rope_theta)), grown_by])  # (B, 1, 1)
    powers = g.op("Pow", [base, g.const("ntk_exponents", exponents.astype(f32))])
    grown = g.op("Reciprocal", [powers])  # (B, 1, R/2)
    return g.op("Where", [longer, grown, g.const("inv_freq", initial)], name="row_inv_freq")


def _cos_sin(g: _Graph, cfg: DecoderConfig, positions: str, *, local: bool) -> tuple[str, str]:
    """cos and sin (B, T, R/2) of the angles of `positions` (B, T, 1) float, as `rotary_cos_sin`
    computes them: the positions times the frequencies, times YaRN's or LongRoPE's attention
    factor. The global layers' frequencies are the same for every row, or each row's own (a
    length-dependent scaling); with `local`, the sliding-window layers' own (Gemma 3: plain)."""
    inv_freq, rope_factor = inverse_frequencies(cfg, local)
    stem = "rotary_local" if local else "rotary"
    if length_dependent(cfg) and not local:
        frequencies = _row_frequencies(g, cfg)  # (B, 1, R/2)
    else:
        frequencies = g.const(f"{stem}_inv_freq", inv_freq)  # (R/2,)
    angles = g.op("Mul", [positions, frequencies])  # (B, T, R/2)
    cos_name = g.op("Cos", [angles], name=f"{stem}_cos")
    sin_name = g.op("Sin", [angles], name=f"{stem}_sin")
    if rope_factor != 1.0:  # YaRN's or LongRoPE's attention factor
        factor = g.const(f"{stem}_factor", np.float32(rope_factor))
        cos_name, sin_name = g.op("Mul", [cos_name, factor]), g.op("Mul", [sin_name, factor])
    return cos_name, sin_name


def _rotations(g: _Graph, cfg: DecoderConfig, positions: str) -> dict[bool, tuple[str, str]]:
    """cos and sin (B, T, R/2) of `positions` (B, T) int64 for the layers of each rotary base,
    keyed by `cfg.local_rope(layer)`: the global layers' pair, and a second one for Gemma 3's
    sliding-window layers' own base."""
    angle_positions = g.op(
        "Unsqueeze",
        [g.op("Cast", [positions], to=TensorProto.FLOAT), g.const("axis_last", [-1], np.int64)],
    )  # (B, T, 1)
    rotations = {False: _cos_sin(g, cfg, angle_positions, local=False)}
    if cfg.local_rope_theta is not None:
        rotations[True] = _cos_sin(g, cfg, angle_positions, local=True)
    return rotations


def _rotate(g: _Graph, cfg: DecoderConfig, x: str, cos: str, sin: str, heads: int) -> str:
    """One RotaryEmbedding of x (B, T, heads * D), rotate-half, over the first R channels of
    each head (the rest pass through)."""
    partial: dict[str, Any] = {}
    if cfg.rope_dim != cfg.head_dim:
        partial["rotary_embedding_dim"] = cfg.rope_dim
    rotated: str = g.op("RotaryEmbedding", [x, cos, sin], interleaved=0, num_heads=heads, **partial)
    return rotated


def _rope_lengths_input(cfg: DecoderConfig) -> list[onnx.ValueInfoProto]:
    """The `rope_lengths` input, for a model whose frequencies depend on a row's length."""
    if not length_dependent(cfg):
        return []
    return [helper.make_tensor_value_info(ROPE_LENGTHS, TensorProto.INT64, ["batch"])]


def _capped(g: _Graph, scores: str, cap: str | None) -> str:
    """cap * tanh(scores) of scores already divided by the cap (folded into q), before the
    mask (Gemma 2's attention soft cap); the scores themselves without one."""
    return scores if cap is None else g.op("Mul", [g.op("Tanh", [scores]), cap])


def build_lm_graph(
    model: DecoderOnly,
    *,
    opset: int = LM_OPSET,
    attention: str = LM_PLAIN,
    external_data: Path | None = None,
) -> onnx.ModelProto:
    """The step graph of `model` (float32), its attention `plain` or `gqa`; with
    `external_data`, its weights written to that file as they are made (save the graph
    beside it)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r}: choose from {', '.join(ATTENTIONS)}")
    if attention == LM_GQA:
        return _build_gqa_graph(model, opset, external_data)
    cfg = model.config
    n, heads, kv, d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    groups, eps = heads // kv, cfg.rms_norm_eps
    lowest = float(np.finfo(np.float32).min)
    g = _Graph(external_data)
    past_names, new_names = lm_past_names(n), lm_new_names(n)

    # positions (B, T): real past columns plus real tokens earlier in the chunk
    ids, mask, past_mask = LM_INPUTS
    one_axis = g.const("axis_1", [1], np.int64)
    past_len = g.op("ReduceSum", [past_mask, one_axis], keepdims=1)  # (B, 1)
    before = g.op("Sub", [g.op("CumSum", [mask, g.const("axis_1_scalar", 1, np.int64)]), mask])
    positions = g.op("Add", [past_len, before], name="positions")

    # additive biases: past (B, 1, 1, 1, W); new tokens (B, 1, 1, T, T), causal over real
    # tokens, and a padding token sees itself (no query row is fully masked)
    zero = g.const("zero", np.float32(0.0))
    low = g.const("lowest", np.float32(lowest))
    past_visible = g.op("Cast", [past_mask], to=TensorProto.BOOL)
    past_bias = g.op(
        "Unsqueeze",
        [g.op("Where", [past_visible, zero, low]), g.const("axes_123", [1, 2, 3], np.int64)],
        name="past_bias",
    )
    shape_ids = g.op("Shape", [ids])
    t = g.op("Gather", [shape_ids, g.const("index_1", 1, np.int64)], axis=0)  # scalar T
    steps = g.op("Range", [g.const("start_0", 0, np.int64), t, g.const("delta_1", 1, np.int64)])
    key_row = g.op("Unsqueeze", [steps, g.const("axis_0", [0], np.int64)])  # (1, T)
    query_col = g.op("Unsqueeze", [steps, one_axis])  # (T, 1)
    causal = g.op("LessOrEqual", [key_row, query_col])  # (T, T): key <= query
    itself = g.op("Equal", [key_row, query_col])
    real = g.op("Unsqueeze", [g.op("Cast", [mask], to=TensorProto.BOOL), one_axis])  # (B, 1, T)
    causal_real = g.op("And", [causal, real])  # (B, T, T)
    new_visible = g.op("Or", [causal_real, itself])
    new_bias = g.op(
        "Unsqueeze",
        [g.op("Where", [new_visible, zero, low]), g.const("axes_12", [1, 2], np.int64)],
        name="new_bias",
    )
    biases: dict[int | None, tuple[str, str]] = {None: (past_bias, new_bias)}
    if cfg.sliding_window is not None:  # the window's own pair, for the layers it covers
        biases[cfg.sliding_window] = _window_biases(
            g, cfg.sliding_window, positions, past_mask, past_visible, causal_real, itself
        )
    # the softmax's split: W past columns, then T new ones
    width = g.op("Slice", [g.op("Shape", [past_mask]), one_axis, g.const("end_2", [2], np.int64)])
    t_1d = g.op("Unsqueeze", [t, g.const("axis_0b", [0], np.int64)])
    split_wt = g.op("Concat", [width, t_1d], axis=0, name="split_past_new")

    # rotary angles' cos/sin (B, T, R/2) of this step's positions; a second pair for the
    # sliding-window layers' own base (Gemma 3)
    rotations = _rotations(g, cfg, positions)
    q_shape = g.const("q_shape", [0, 0, kv, groups, d], np.int64)
    kv_shape = g.const("kv_shape", [0, 0, kv, d], np.int64)
    merged_shape = g.const("merged_shape", [0, 0, heads * d], np.int64)
    axis_2 = g.const("axis_2", [2], np.int64)
    split_qkv = g.const("split_qkv", [heads * d, kv * d, kv * d], np.int64)
    split_mlp = g.const("split_gate_up", [cfg.intermediate_size] * 2, np.int64)

    x = _embed(g, model, ids)
    softcap = cfg.attn_logit_softcapping
    cap = None if softcap is None else g.const("attn_logit_softcap", np.float32(softcap))
    for i, module in enumerate(model.layers):
        layer: DecoderOnlyLayer = module  # type: ignore[assignment]
        attn = layer.self_attn
        p = f"layers.{i}"
        h = _rms_norm(g, x, f"{p}.input_layernorm", layer.input_layernorm, eps)
        # the attention scale (and a soft cap's 1 / cap) in q's projection, or in its norm
        # (which would undo it there)
        scale = cfg.attention_scale / (1.0 if softcap is None else softcap)
        qkv = _qkv(g, attn, p, h, q_scale=1.0 if cfg.qk_norm else scale)
        q, k, v = g.op("Split", [qkv, split_qkv], n_out=3, axis=-1)
        if cfg.qk_norm:
            q, k = _qk_norms(g, attn, p, q, k, cfg, q_scale=scale)
        past_bias, new_bias = biases[cfg.window(i)]
        cos_name, sin_name = rotations[cfg.local_rope(i)]
        q = _rotate(g, cfg, q, cos_name, sin_name, heads)
        k = _rotate(g, cfg, k, cos_name, sin_name, kv)
        q5 = g.op("Transpose", [g.op("Reshape", [q, q_shape])], perm=[0, 2, 3, 1, 4])
        for value, out_name in ((k, new_names[2 * i]), (v, new_names[2 * i + 1])):
            reshaped = g.op("Reshape", [value, kv_shape])
            g.op("Transpose", [reshaped], outputs=[out_name], perm=[0, 2, 1, 3])
        past_k5 = g.op("Unsqueeze", [past_names[2 * i], axis_2])  # (B, Hkv, 1, W, D)
        past_v5 = g.op("Unsqueeze", [past_names[2 * i + 1], axis_2])
        new_k5 = g.op("Unsqueeze", [new_names[2 * i], axis_2])  # (B, Hkv, 1, T, D)
        new_v5 = g.op("Unsqueeze", [new_names[2 * i + 1], axis_2])
        qk_past = g.op("MatMul", [q5, g.op("Transpose", [past_k5], perm=[0, 1, 2, 4, 3])])
        qk_new = g.op("MatMul", [q5, g.op("Transpose", [new_k5], perm=[0, 1, 2, 4, 3])])
        scores_past = g.op("Add", [_capped(g, qk_past, cap), past_bias])  # (B, Hkv, G, T, W)
        scores_new = g.op("Add", [_capped(g, qk_new, cap), new_bias])  # (B, Hkv, G, T, T)
        probs = g.op("Softmax", [g.op("Concat", [scores_past, scores_new], axis=-1)], axis=-1)
        p_past, p_new = g.op("Split", [probs, split_wt], n_out=2, axis=-1)
        out = g.op(
            "Add", [g.op("MatMul", [p_past, past_v5]), g.op("MatMul", [p_new, new_v5])]
        )  # (B, Hkv, G, T, D)
        out = g.op(
            "Reshape", [g.op("Transpose", [out], perm=[0, 3, 1, 2, 4]), merged_shape]
        )  # (B, T, H * D)
        attended = _out_proj(g, attn, p, out)
        post = layer.post_attention_layernorm if layer.sandwich else None
        x = _residual(g, x, attended, post, f"{p}.post_attention_layernorm", eps)
        x = _mlp(g, layer, p, x, eps, split_mlp)

    _head(g, model, x)

    past_shape: list[str | int | None] = ["batch", kv, "past", d]
    new_shape: list[str | int | None] = ["batch", kv, "chunk", d]
    inputs = [
        helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "chunk"]),
        helper.make_tensor_value_info(mask, TensorProto.INT64, ["batch", "chunk"]),
        helper.make_tensor_value_info(past_mask, TensorProto.INT64, ["batch", "past"]),
        *(helper.make_tensor_value_info(nm, TensorProto.FLOAT, past_shape) for nm in past_names),
        _positions_input(),
        *_rope_lengths_input(cfg),
    ]
    outputs = [
        _logits_output(cfg.vocab_size),
        *(helper.make_tensor_value_info(nm, TensorProto.FLOAT, new_shape) for nm in new_names),
    ]
    graph = helper.make_graph(g.nodes, "attnserve_lm_step", inputs, outputs, g.initializers)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset)],
        producer_name="attnserve",
        ir_version=LM_IR_VERSION,
    )


def _gqa_positions(g: _Graph, ids: str, seqlens: str, total: str) -> str:
    """(B, T) int64 positions of a GroupQueryAttention step's tokens, as the node places them:
    t in a first prompt (T == total_sequence_length: rows from column 0), else
    seqlens_k + 1 - T + t (the row's cached tokens before them)."""
    t = g.op("Gather", [g.op("Shape", [ids]), g.const("index_1", 1, np.int64)], axis=0)
    steps = g.op("Range", [g.const("start_0", 0, np.int64), t, g.const("delta_1", 1, np.int64)])
    first = g.op("Equal", [g.op("Cast", [total], to=TensorProto.INT64), t])
    lengths = g.op("Cast", [seqlens], to=TensorProto.INT64)  # (B,) each row's, minus one
    past = g.op("Sub", [g.op("Add", [lengths, g.const("one_i64", 1, np.int64)]), t])
    offset = g.op("Where", [first, g.const("zero_i64", 0, np.int64), past])
    column = g.op("Unsqueeze", [offset, g.const("axis_1", [1], np.int64)])  # (B, 1)
    return g.op("Add", [column, g.op("Unsqueeze", [steps, g.const("axis_0", [0], np.int64)])])


def _rotary_tables(g: _Graph, cfg: DecoderConfig, *, local: bool) -> tuple[str, str]:
    """GroupQueryAttention's cos and sin tables (P, D/2) of every position, as
    `rotary_cos_sin` computes them; with `local` the sliding-window layers' own."""
    inv_freq, rope_factor = inverse_frequencies(cfg, local)
    angles = np.outer(np.arange(cfg.max_positions, dtype=np.float32), inv_freq).astype(
        np.float32
    )  # (P, D/2)
    stem = "rotary_local" if local else "rotary"
    return (
        g.const(f"{stem}_cos_cache", np.cos(angles) * np.float32(rope_factor)),
        g.const(f"{stem}_sin_cache", np.sin(angles) * np.float32(rope_factor)),
    )


def _build_gqa_graph(
    model: DecoderOnly, opset: int, external_data: Path | None = None
) -> onnx.ModelProto:
    """The step graph with ONNX Runtime's GroupQueryAttention (com.microsoft) in each layer.

    GroupQueryAttention keeps each row's cache at columns 0..length-1 of a buffer of any width
    (the free columns after them) and writes the new tokens' K/V into it itself: with `past` and
    `present` bound to the same memory the cache grows in place. A row's positions are its
    cached columns, so rows of any age share a batch with no mask. It rotates q and k
    (rotate-half, cos/sin tables of `max_positions` rows), and runs scores, softmax and the
    product with V per (row, head), causal within the new tokens. Its three cases: a first
    prompt (`total_sequence_length` = T, rows right-padded, `seqlens_k` = real length - 1), one
    token a row (T = 1, `seqlens_k` = the row's cached length), a later chunk of one row's
    prompt (batch 1, all T tokens real).

    Inputs `input_ids` (B, T), `seqlens_k` (B,) int32 (each row's length after this step,
    minus 1), `total_sequence_length` () int32, `past.{i}.key/value` (B, Hkv, P, D),
    `logit_positions` (R,) int64 (flat indices b * T + t; a first prompt's rows are
    right-padded, so a row's last real token is at t = its length - 1); outputs `logits`
    (R, V) and `present.{i}.key/value` (B, Hkv, max(P, total), D).
    """
    cfg = model.config
    heads, kv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    g = _Graph(external_data)
    past_names, present_names = lm_past_names(cfg.num_layers), lm_present_names(cfg.num_layers)
    ids, seqlens, total = LM_GQA_INPUTS

    outside = rotates_outside(cfg)
    rotations: dict[bool, tuple[str, str]] = {}
    tables: dict[bool, tuple[str, str]] = {}
    if outside:  # q and k rotated before the node: each row's cos/sin (B, T, R/2)
        rotations = _rotations(g, cfg, _gqa_positions(g, ids, seqlens, total))
    else:  # the node rotates, from tables of the context's positions
        tables[False] = _rotary_tables(g, cfg, local=False)
        if cfg.local_rope_theta is not None:  # the sliding-window layers' own base (Gemma 3)
            tables[True] = _rotary_tables(g, cfg, local=True)
    split_qkv = g.const("split_qkv", [heads * d, kv * d, kv * d], np.int64)
    split_mlp = g.const("split_gate_up", [cfg.intermediate_size] * 2, np.int64)

    x = _embed(g, model, ids)
    # the node's scale stays 1/sqrt(D) (attnserve's kernel computes that one); another
    # (query_pre_attn_scalar) is folded into q's projection or norm, by their ratio
    q_scale = 1.0
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != d:
        q_scale = cfg.attention_scale * math.sqrt(d)
    softcap: dict[str, Any] = {}
    if cfg.attn_logit_softcapping is not None:  # attnserve's kernel has none: ORT's node stays
        softcap["softcap"] = cfg.attn_logit_softcapping
    for i, module in enumerate(model.layers):
        layer: DecoderOnlyLayer = module  # type: ignore[assignment]
        attn, p = layer.self_attn, f"layers.{i}"
        h = _rms_norm(g, x, f"{p}.input_layernorm", layer.input_layernorm, eps)
        qkv = _qkv(g, attn, p, h, q_scale=1.0 if cfg.qk_norm else q_scale)
        if cfg.qk_norm or outside:  # q and k normed / rotated, packed again: the attention
            q, k, v = g.op("Split", [qkv, split_qkv], n_out=3, axis=-1)  # reads one tensor
            if cfg.qk_norm:
                q, k = _qk_norms(g, attn, p, q, k, cfg, q_scale=q_scale)
            if outside:
                cos_name, sin_name = rotations[cfg.local_rope(i)]
                q = _rotate(g, cfg, q, cos_name, sin_name, heads)
                k = _rotate(g, cfg, k, cos_name, sin_name, kv)
            qkv = g.op("Concat", [q, k, v], axis=-1)
        rotary = [] if outside else list(tables[cfg.local_rope(i)])  # the node's cos/sin tables
        # GroupQueryAttention's local_window_size counts the query's own key, as ours does
        # (measured against the torch model: window - 1 and window + 1 both differ)
        window = cfg.window(i)
        out, _, _ = g.op(
            "GroupQueryAttention",
            [qkv, "", "", past_names[2 * i], past_names[2 * i + 1], seqlens, total, *rotary],
            outputs=[f"{p}.attention", present_names[2 * i], present_names[2 * i + 1]],
            domain=MS_DOMAIN, num_heads=heads, kv_num_heads=kv, do_rotary=int(not outside),
            rotary_interleaved=0, scale=1.0 / math.sqrt(d), name=f"{p}.self_attn",
            **({} if window is None else {"local_window_size": window}), **softcap,
        )  # fmt: skip
        attended = _out_proj(g, attn, p, out)
        post = layer.post_attention_layernorm if layer.sandwich else None
        x = _residual(g, x, attended, post, f"{p}.post_attention_layernorm", eps)
        x = _mlp(g, layer, p, x, eps, split_mlp)

    _head(g, model, x)

    past_shape: list[str | int | None] = ["batch", kv, "past", d]
    present_shape: list[str | int | None] = ["batch", kv, "present", d]
    inputs = [
        helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "chunk"]),
        helper.make_tensor_value_info(seqlens, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(total, TensorProto.INT32, []),
        *(helper.make_tensor_value_info(nm, TensorProto.FLOAT, past_shape) for nm in past_names),
        _positions_input(),
        *_rope_lengths_input(cfg),
    ]
    outputs = [
        _logits_output(cfg.vocab_size),
        *(
            helper.make_tensor_value_info(nm, TensorProto.FLOAT, present_shape)
            for nm in present_names
        ),
    ]
    graph = helper.make_graph(g.nodes, "attnserve_lm_step_gqa", inputs, outputs, g.initializers)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="attnserve",
        ir_version=LM_IR_VERSION,
    )
