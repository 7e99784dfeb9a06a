"""Graph rewrites onto the float ops, each adding the ops' functions to the model: a decoder's
attention products (AttnScores, AttnMix and their half-cache forms), its log-softmax and TopK
(LogSoftmaxTopK), and a language model's GroupQueryAttention (CausalGroupAttention), residual
add with RMSNormalization (AddRMSNorm) and SwiGLU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attnserve.kernels.functions import declare
from attnserve.kernels.graph import (
    _consumers,
    _drop_unread,
    _is,
    _set_nodes,
    _small_constant,
    _wiring,
)
from attnserve.kernels.ops import (
    ADD_NORM,
    CAUSAL,
    DOMAIN,
    MIX,
    MIX_HALF,
    MS_DOMAIN,
    SCORES,
    SCORES_HALF,
    SWIGLU,
    VOCAB,
)

if TYPE_CHECKING:
    import onnx


def use_attention_kernels(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: every MatMul of two rank-4 activations becomes AttnScores (when
    its right operand is a Transpose swapping the last two axes: the Transpose is read through)
    or AttnMix; the functions are added. A right operand that is a float16 tensor Cast to float
    (a half cache) is read through too, by AttnScoresHalf / AttnMixHalf. Returns how many
    products were rewritten (0: the model is unchanged)."""
    import onnx

    ours = (SCORES, MIX, SCORES_HALF, MIX_HALF)
    if any(n.domain == DOMAIN and n.op_type in ours for n in model.graph.node):
        return 0  # rewritten already
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    ranks: dict[str, int] = {}
    halves: set[str] = set()
    for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape") and tensor.elem_type == onnx.TensorProto.FLOAT:
            ranks[info.name] = len(tensor.shape.dim)
        if tensor.elem_type == onnx.TensorProto.FLOAT16:
            halves.add(info.name)
    graph = model.graph
    constants = {i.name for i in graph.initializer}
    producers, _ = _wiring(graph)
    rewritten = 0
    read_through: set[str] = set()  # outputs of Transposes and Casts read through
    for node in graph.node:
        if not _is(node, "MatMul"):
            continue
        a, b = node.input
        if a in constants or b in constants or ranks.get(a) != 4 or ranks.get(b) != 4:
            continue
        source = producers.get(b)
        swaps = (
            source is not None
            and _is(source, "Transpose")
            and [list(attr.ints) for attr in source.attribute if attr.name == "perm"]
            == [[0, 1, 3, 2]]
        )
        if swaps:
            assert source is not None
            node.op_type, node.domain = SCORES, DOMAIN
            node.input[1] = source.input[0]
            read_through.add(source.output[0])
        else:
            node.op_type, node.domain = MIX, DOMAIN
        widened = producers.get(node.input[1])
        if (
            widened is not None
            and _is(widened, "Cast")
            and widened.input[0] in halves
            and [a.i for a in widened.attribute if a.name == "to"] == [onnx.TensorProto.FLOAT]
        ):
            node.op_type = SCORES_HALF if node.op_type == SCORES else MIX_HALF
            node.input[1] = widened.input[0]
            read_through.add(widened.output[0])
        rewritten += 1
    if not rewritten:
        return 0
    # The Transposes and Casts read through, where nothing else reads them (Casts after the
    # Transposes they fed).
    for _ in range(2):
        _, readers = _wiring(graph)
        unread = {name for name in read_through if not readers.get(name)}
        _set_nodes(graph, [n for n in graph.node if n.output[0] not in unread])
    declare(model)
    return rewritten


def use_vocabulary_kernel(
    model: onnx.ModelProto, log_probs: str, candidates: str, full: str
) -> bool:
    """Rewrite `model` in place: the `LogSoftmax` that makes the graph output `log_probs` and
    the `TopK` over it (k from the graph input `candidates`) become one LogSoftmaxTopK node, and
    the graph gets the input `full` (int64 (1,)): 0 lets the kernel skip writing log_probs (it
    is then (..., 0)), 1 writes them. False when the graph has no such pair."""
    from onnx import TensorProto, helper

    graph = model.graph
    if any(i.name == full for i in graph.input):
        return False  # rewritten already

    softmax = next(
        (n for n in graph.node if _is(n, "LogSoftmax") and list(n.output) == [log_probs]), None
    )
    readers = [n for n in graph.node if log_probs in n.input]
    topk = readers[0] if len(readers) == 1 else None  # anything else reading the row: leave it
    if softmax is None or topk is None or not _is(topk, "TopK"):
        return False
    if list(topk.input) != [log_probs, candidates]:
        return False
    soft = {a.name: a.i for a in softmax.attribute}
    top = {a.name: a.i for a in topk.attribute}
    if soft.get("axis", -1) != -1 or top.get("axis", -1) != -1:
        return False
    if top.get("largest", 1) != 1 or top.get("sorted", 1) != 1:
        return False
    fused = helper.make_node(
        VOCAB,
        [softmax.input[0], candidates, full],
        [log_probs, *topk.output],
        name="log_softmax_top_k",
        domain=DOMAIN,
    )
    # the fused node where the LogSoftmax was (topological order)
    _set_nodes(graph, [fused if n is softmax else n for n in graph.node if n is not topk])
    graph.input.append(helper.make_tensor_value_info(full, TensorProto.INT64, [1]))
    for output in graph.output:  # the kernel may leave it empty: its last axis is symbolic
        dims = output.type.tensor_type.shape.dim
        if output.name == log_probs and len(dims) > 0:
            dims[-1].dim_param = "log_prob_columns"
    declare(model)
    return True


# GroupQueryAttention's attributes as CausalGroupAttention computes them (ONNX Runtime's
# offline optimizer writes every default out): the values each may have.
CAUSAL_NEUTRAL: dict[str, tuple[object, ...]] = {
    "do_rotary": (1,),
    "rotary_interleaved": (0,),
    "causal": (1,),
    "softcap": (0.0,),
    "local_window_size": (-1,),
    "smooth_softmax": (-1, 0),
    "sliding_window_cache": (0,),
    "qk_output": (0,),
    "qk_norm_epsilon": (float(np.float32(1e-6)),),  # no q/k norm inputs
    "k_quant_type": (b"NONE",),
    "v_quant_type": (b"NONE",),
}


def use_causal_attention_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: every GroupQueryAttention that CausalGroupAttention computes
    (packed qkv, rotary on (`do_rotary` 1: absent is off) with rotate-half over the whole head,
    cos/sin constant (P, D/2) tables; the default scale or 1/sqrt(D); no softcap, local window
    or smoothing; the caches graph inputs) becomes one; returns how many (0: the model is
    unchanged)."""
    from onnx import helper

    depth: dict[str, int] = {}  # the caches' head size, from the graph's inputs
    for info in model.graph.input:
        dims = info.type.tensor_type.shape.dim
        if len(dims) == 4 and dims[3].HasField("dim_value"):
            depth[info.name] = dims[3].dim_value
    tables = {i.name: list(i.dims) for i in model.graph.initializer}
    rewritten = 0
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * (9 - len(node.input))
        d = depth.get(inputs[3])
        neutral = {**CAUSAL_NEUTRAL, "scale": (0.0, float(np.float32(1.0 / np.sqrt(d or 1))))}
        whole_head = d is not None and all(
            len(tables.get(t, [])) == 2 and tables[t][1] * 2 == d for t in inputs[7:9]
        )  # a narrower table rotates part of the head, which the kernel does not
        if (
            not whole_head
            or attrs.get("do_rotary") != 1
            or inputs[1] or inputs[2] or not all(inputs[3:9]) or len(node.input) > 9
            or len(node.output) != 3
            or any(
                name not in ("num_heads", "kv_num_heads") and value not in neutral.get(name, ())
                for name, value in attrs.items()
            )
        ):  # fmt: skip
            continue
        del node.input[:]
        node.input.extend([inputs[0], *inputs[3:9]])
        kept = [a for a in node.attribute if a.name in ("num_heads", "kv_num_heads")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.op_type, node.domain = CAUSAL, DOMAIN
        rewritten += 1
    if rewritten:
        declare(model)
    return rewritten


def use_elementwise_kernels(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: a residual Add whose sum an RMSNormalization (last axis, float32,
    a constant 1-D scale) normalizes becomes one AddRMSNorm (both its outputs read as before),
    where the Add adds two computed values (no constant: a bias or a position table would
    broadcast, which the kernel does not) of the same shape as far as the model records it; a
    Split of the last axis in halves whose first half goes through x * Sigmoid(x) into a
    product with the second becomes one SwiGLU; returns how many nodes were written (0: the
    model is unchanged)."""
    import onnx
    from onnx import helper

    graph = model.graph
    constants = {i.name: list(i.dims) for i in graph.initializer}
    producers, readers = _wiring(graph)
    shapes = {
        info.name: [d.dim_value or d.dim_param or None for d in info.type.tensor_type.shape.dim]
        for info in [*graph.input, *graph.output, *graph.value_info]
        if info.type.tensor_type.HasField("shape")
    }

    def computed(name: str) -> bool:
        source = producers.get(name)
        return name not in constants and not (source is not None and _is(source, "Constant"))

    def alike(a: str, b: str) -> bool:  # the same shape where both are recorded
        return a not in shapes or b not in shapes or shapes[a] == shapes[b] != []

    consumers = _consumers(graph)
    replaced: dict[int, onnx.NodeProto | None] = {}  # id(node) -> its replacement (None: gone)
    epsilons: dict[float, str] = {}
    written = 0
    for node in graph.node:
        if not _is(node, "RMSNormalization") or id(node) in replaced:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        add = producers.get(node.input[0])
        if (
            len(node.input) != 2 or len(constants.get(node.input[1], [])) != 1
            or len(node.output) != 1
            or attrs.get("axis", -1) != -1 or attrs.get("stash_type", 1) != 1
            or add is None or not _is(add, "Add") or id(add) in replaced
            or not all(computed(x) for x in add.input) or not alike(*add.input)
        ):  # fmt: skip
            continue
        epsilon = float(np.float32(attrs.get("epsilon", 1e-5)))
        if epsilon not in epsilons:
            epsilons[epsilon] = f"add_rms_norm_epsilon_{len(epsilons)}"
            graph.initializer.append(
                onnx.numpy_helper.from_array(np.array(epsilon, np.float32), epsilons[epsilon])
            )
        fused = helper.make_node(
            ADD_NORM, [*add.input, node.input[1], epsilons[epsilon]],
            [add.output[0], node.output[0]], name=f"{node.name}_{ADD_NORM}", domain=DOMAIN,
        )  # fmt: skip
        replaced[id(add)], replaced[id(node)] = fused, None  # where the sum was made
        written += 1
    initializers = {i.name: i for i in graph.initializer}
    for split in graph.node:
        halves = _small_constant(initializers, split.input[1]) if (
            _is(split, "Split") and len(split.input) == 2 and len(split.output) == 2
        ) else None  # fmt: skip
        axis = [a.i for a in split.attribute if a.name == "axis"]
        if halves is None or halves.shape != (2,) or halves[0] != halves[1] or axis not in ([-1],):
            continue
        gate, up = split.output
        chain = _swiglu_chain(gate, up, consumers, readers)
        if chain is None or any(id(n) in replaced for n in chain):
            continue
        sigmoid, silu, product = chain
        fused = helper.make_node(
            SWIGLU, [split.input[0]], [product.output[0]], name=f"{split.name}_{SWIGLU}",
            domain=DOMAIN,
        )  # fmt: skip
        replaced[id(split)] = fused
        for gone in (sigmoid, silu, product):
            replaced[id(gone)] = None
        written += 1
    if not written:
        return 0
    nodes = [replaced.get(id(n), n) for n in graph.node]
    _set_nodes(graph, [n for n in nodes if n is not None])
    _drop_unread(graph, readers)  # the Splits' sizes
    declare(model)
    return written


def _swiglu_chain(
    gate: str, up: str, consumers: dict[str, list[onnx.NodeProto]], readers: dict[str, int]
) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto] | None:
    """Sigmoid(gate), gate * it, that * up: the nodes, when nothing else reads gate, up or the
    intermediate values."""
    if readers.get(gate) != 2 or readers.get(up) != 1:
        return None
    sigmoid = next((n for n in consumers.get(gate, []) if _is(n, "Sigmoid")), None)
    silu = next((n for n in consumers.get(gate, []) if _is(n, "Mul")), None)
    if sigmoid is None or silu is None or set(silu.input) != {gate, sigmoid.output[0]}:
        return None
    if readers.get(sigmoid.output[0]) != 1 or readers.get(silu.output[0]) != 1:
        return None
    product = consumers[silu.output[0]][0]
    if not _is(product, "Mul") or set(product.input) != {silu.output[0], up}:
        return None
    return sigmoid, silu, product
