"""Exports on attnserve's kernels: every decoder attention product, the vocabulary's log-softmax
and TopK, and per-row int8's quantization and products; decoding on them gives the stock graph's
tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from attnserve import kernels
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.onnx.layout import (
    BODIES_VERSION,
    KERNEL_NODES,
    KERNELS_VERSION,
    read_manifest,
)
from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import decode_batch
from attnserve.export.onnx_export import export_model
from attnserve.model.checkpoint import read_model_config
from tests.kernels.helpers import (
    BUILT,
)


@pytest.mark.slow
def test_the_export_puts_every_decoder_attention_product_on_the_kernels(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    """fp32 and int8 decoders run their 4 attention products a layer and their log-softmax with
    its TopK on the kernels (the manifest says how many nodes); decoding beam 4 with n-best
    gives the tokens the stock graph gives, with scores equal to float rounding, and int8 gives
    each source in a batch the bits it gets alone."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model_dir)
    shutil.rmtree(model_dir / "onnx")
    export_model(model_dir, ["fp32", "int8"], verify=False)
    config = read_model_config(model_dir)
    eos = config.eos_id
    sources = [[5, 6, 7, eos], [9, 8, 4, 3, 12, 11, 10, eos], [4, eos]]
    options = [DecodingOptions(beam_size=4, num_hypotheses=3, max_new_tokens=10)] * len(sources)
    for variant in ("fp32", "int8"):
        graphs = model_dir / "onnx" / variant
        decoder = onnx.load(str(graphs / "decoder.onnx"), load_external_data=False)
        ops = [n.op_type for n in decoder.graph.node]
        # int8 keeps its cache in float16: the kernels read the halves
        half = "Half" if variant == "int8" else ""
        assert ops.count(kernels.SCORES + half) == 2 * config.decoder_layers
        assert ops.count(kernels.MIX + half) == 2 * config.decoder_layers
        assert "MatMul" not in ops or variant == "fp32"  # int8: every weight product is integer
        assert ops.count(kernels.VOCAB) == 1 and "LogSoftmax" not in ops and "TopK" not in ops
        on_kernels = sum(
            n.domain == kernels.DOMAIN
            for g in ("encoder.onnx", "decoder.onnx")
            for n in onnx.load(str(graphs / g), load_external_data=False).graph.node
        )
        assert read_manifest(graphs)["options"][KERNEL_NODES] == on_kernels
        assert read_manifest(graphs)["options"][KERNELS_VERSION] == kernels.VERSION
        assert read_manifest(graphs)["options"][BODIES_VERSION] == kernels.BODIES
        if variant == "fp32":  # no int8 activations to quantize
            assert on_kernels == 4 * config.decoder_layers + 1
        else:
            assert ops.count(kernels.ROW_QUANTIZE) > 0
        stock = OnnxBackend(config, graphs, provider="cpu", threads=1, kernels=False)
        assert not stock.kernels
        want = decode_batch(stock, sources, options)
        if not BUILT:
            continue
        fast = OnnxBackend(config, graphs, provider="cpu", threads=1)
        assert fast.kernels
        got = decode_batch(fast, sources, options)
        for hyps, ref in zip(got, want, strict=True):
            assert [h.tokens for h in hyps] == [h.tokens for h in ref]
            np.testing.assert_allclose(
                [h.score for h in hyps], [h.score for h in ref], rtol=1e-5, atol=1e-5
            )
        # candidates (the kernel's TopK, the row not written) choose as whole rows do, bit for bit
        fast.candidates = False
        assert decode_batch(fast, sources, options) == got
        fast.candidates = True
        if variant != "int8":
            continue  # float32 products are not batch-invariant in ONNX Runtime's MLAS either
        for i, source in enumerate(sources):
            [alone] = decode_batch(fast, [source], options[:1])
            assert [(h.tokens, h.score) for h in alone] == [(h.tokens, h.score) for h in got[i]]


def test_int8_exports_quantize_every_activation_on_the_kernel(tiny_onnx_import: Path) -> None:
    graphs = tiny_onnx_import / "onnx" / "int8"
    for name in ("encoder.onnx", "decoder.onnx"):
        ops = [
            n.op_type for n in onnx.load(str(graphs / name), load_external_data=False).graph.node
        ]
        assert ops.count(kernels.ROW_QUANTIZE) > 0
        assert not {"QuantizeLinear", "Abs", "ReduceMax"} & set(ops), name


def test_int8_exports_run_every_product_on_the_kernel(tiny_onnx_import: Path) -> None:
    graphs = tiny_onnx_import / "onnx" / "int8"
    for name in ("encoder.onnx", "decoder.onnx"):
        ops = [
            n.op_type for n in onnx.load(str(graphs / name), load_external_data=False).graph.node
        ]
        products = [kernels.QMATMUL_BIAS, kernels.PACKED_QMATMUL_BIAS]
        assert sum(ops.count(op) for op in products) > 0, name
        assert "MatMulIntegerToFloat" not in ops, name
