"""The step graph's builder (attnserve/export/lm_graph.py): scalar constants stay 0-d, and with
`external_data` the weights go to a file beside the graph as they are made, aligned, and the
graph computes exactly what the in-memory one does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from attnserve.engine.onnx.layout import LM_GQA, LM_PLAIN
from attnserve.export.lm_graph import (
    EXTERNAL_ALIGN,
    EXTERNAL_MIN_BYTES,
    _Graph,
    build_lm_graph,
)
from tests.export.lm_steps import run_step, tiny_lm


def dims(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.dims) for t in model.graph.initializer}


@pytest.mark.parametrize("beside", [False, True])
def test_a_scalar_constant_stays_scalar(beside: bool, tmp_path: Path) -> None:
    g = _Graph(tmp_path / "w.data" if beside else None)
    g.const("f", np.float32(0.5))
    g.const("i", 1, np.int64)
    g.const("v", [1], np.int64)
    g.const("big", np.ones(EXTERNAL_MIN_BYTES // 4, np.float32))
    shapes = {t.name: tuple(t.dims) for t in g.initializers}
    assert shapes == {"f": (), "i": (), "v": (1,), "big": (EXTERNAL_MIN_BYTES // 4,)}
    external = {t.name for t in g.initializers if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external == ({"big"} if beside else set())


@pytest.mark.parametrize("attention", [LM_PLAIN, LM_GQA])
def test_weights_beside_the_graph_are_the_same_graph(attention: str, tmp_path: Path) -> None:
    """Every initializer keeps its shape (0-d ones stay inline), the large ones sit in the file
    at page-aligned offsets, and ONNX Runtime gives the in-memory graph's logits exactly."""
    model = tiny_lm()
    inline = build_lm_graph(model, attention=attention)
    data = tmp_path / "step.onnx.data"
    beside = build_lm_graph(model, attention=attention, external_data=data)
    onnx.save(beside, str(tmp_path / "step.onnx"))
    onnx.checker.check_model(str(tmp_path / "step.onnx"))

    assert dims(beside) == dims(inline)
    if attention == LM_PLAIN:  # its masks' scalars (a 1-D one failed to load)
        assert dims(beside)["zero"] == dims(beside)["lowest"] == ()
    for t in beside.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            assert onnx.numpy_helper.to_array(t).nbytes < EXTERNAL_MIN_BYTES, t.name
            continue
        entry = {e.key: e.value for e in t.external_data}
        assert entry["location"] == data.name
        assert int(entry["offset"]) % EXTERNAL_ALIGN == 0, t.name
    assert (tmp_path / "step.onnx").stat().st_size < data.stat().st_size / 10
    loaded = onnx.load(str(tmp_path / "step.onnx"))
    by_name = {t.name: onnx.numpy_helper.to_array(t) for t in loaded.graph.initializer}
    for t in inline.graph.initializer:
        np.testing.assert_array_equal(by_name[t.name], onnx.numpy_helper.to_array(t), t.name)

    a = run_step(inline.SerializeToString(), model.config, attention)
    b = run_step(tmp_path / "step.onnx", model.config, attention)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
