"""attnserve's own ONNX Runtime kernels (C++, `ortops.cc`), and the graph rewrite that uses them.

A decoding step multiplies each row's one new query by that row's cached keys and values. ONNX
Runtime's MatMul runs such a batched product as one GEMM call per (row, head): at beam 4 x 32
sources x 8 heads that is 1,024 calls of a (1 x 64) by (64 x T) product per layer and product,
and the calls, not the arithmetic, take the time. The two kernels here loop over (row, head)
with the query (or the output row) held in AVX-512 registers:

    ai.attnserve.AttnScores(q (B, H, M, D), k (B, H, N, D)) -> q @ k^T      (B, H, M, N)
    ai.attnserve.AttnMix(p (B, H, M, N), v (B, H, N, D))    -> p @ v        (B, H, M, D)

**Portable graphs.** `use_attention_kernels` rewrites a graph's attention products into these
nodes *and* puts each op's definition in the model as an ONNX function whose body is the stock
Transpose + MatMul. A runtime with the library registered runs the kernel; any other ONNX
Runtime (or another runtime that reads ONNX functions) inlines the body and runs exactly the
graph it would have run before the rewrite. The exported files stay loadable everywhere.

**Batch invariance.** Each (row, head) is computed alone, in a fixed order, so a row's result
never depends on the rest of the batch. The kernels' sums run in another order than MLAS's, so
their float results differ from the stock graph's in the last bits (as two BLAS libraries do).

**Build.** `pip install` compiles the library with the machine's C++ compiler (setup.py; the
extension is optional: without a compiler the install succeeds and graphs run their stock
bodies). The library is found beside this file; `ATTNSERVE_KERNELS=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # onnx is needed to rewrite graphs (at export), not to run them
    import onnx

log = logging.getLogger(__name__)

DOMAIN = "ai.attnserve"
VERSION = 1  # the library's `attnserve_kernels_version`; a stale build is not registered
SCORES = "AttnScores"
MIX = "AttnMix"
ENV_SWITCH = "ATTNSERVE_KERNELS"
_BODY_OPSET = 13  # Transpose and MatMul have not changed since


def functions() -> list[onnx.FunctionProto]:
    """The ops' definitions as ONNX functions: what a runtime without the library runs."""
    from onnx import helper

    opset = [helper.make_opsetid("", _BODY_OPSET)]
    scores = helper.make_function(
        DOMAIN,
        SCORES,
        ["q", "k"],
        ["scores"],
        [
            helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        ],
        opset,
        doc_string="q @ k^T over rank-4 (B, H, M, D) and (B, H, N, D)",
    )
    mix = helper.make_function(
        DOMAIN,
        MIX,
        ["p", "v"],
        ["mixed"],
        [helper.make_node("MatMul", ["p", "v"], ["mixed"])],
        opset,
        doc_string="p @ v over rank-4 (B, H, M, N) and (B, H, N, D)",
    )
    return [scores, mix]


def use_attention_kernels(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: every MatMul of two rank-4 activations becomes AttnScores (when
    its right operand is a Transpose swapping the last two axes: the Transpose is read through)
    or AttnMix; the functions are added. Returns how many products were rewritten (0: the model
    is unchanged)."""
    import onnx
    from onnx import helper

    if any(f.domain == DOMAIN for f in model.functions):
        return 0  # rewritten already
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    ranks: dict[str, int] = {}
    for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape") and tensor.elem_type == onnx.TensorProto.FLOAT:
            ranks[info.name] = len(tensor.shape.dim)
    graph = model.graph
    constants = {i.name for i in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for out in graph.output:
        readers[out.name] = readers.get(out.name, 0) + 1
    rewritten = 0
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        a, b = node.input
        if a in constants or b in constants or ranks.get(a) != 4 or ranks.get(b) != 4:
            continue
        source = producers.get(b)
        swaps = (
            source is not None
            and source.op_type == "Transpose"
            and [list(attr.ints) for attr in source.attribute if attr.name == "perm"]
            == [[0, 1, 3, 2]]
        )
        if swaps:
            assert source is not None
            node.op_type, node.domain = SCORES, DOMAIN
            node.input[1] = source.input[0]
            readers[b] -= 1
            if readers[b] == 0:
                dropped.add(id(source))
        else:
            node.op_type, node.domain = MIX, DOMAIN
        rewritten += 1
    if not rewritten:
        return 0
    kept = [node for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    model.functions.extend(functions())
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return rewritten


def library_path() -> Path | None:
    """The built library beside this file, or None (not built, or turned off)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return _built_library()


@lru_cache(maxsize=1)
def _built_library() -> Path | None:
    here = Path(__file__).parent
    for path in sorted(here.glob("_ortops*.so")):
        try:
            version = ctypes.CDLL(str(path)).attnserve_kernels_version()
        except (OSError, AttributeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
            continue
        if version == VERSION:
            return path
        log.warning(
            "ignoring %s: built from another version of attnserve (re-run `make venv` or "
            "`pip install -e .`)",
            path,
        )
    return None


def register(options: object) -> bool:
    """Register the library with an onnxruntime.SessionOptions; False when there is none (the
    graphs then run their functions' stock bodies)."""
    path = library_path()
    if path is None:
        return False
    options.register_custom_ops_library(str(path))  # type: ignore[attr-defined]
    return True
