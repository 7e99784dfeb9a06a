"""The weight bytes a decoding step reads (attnserve/bench/lm_bytes.py): tables only looked up
are left out, a table the head also reads is counted, and a tied GGUF's embedding is its head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnserve.bench.lm_bytes import gguf_step_bytes, machine_read_rate, onnx_step_bytes


def test_onnx_counts_what_a_product_reads(tmp_path: Path) -> None:
    table = numpy_helper.from_array(np.zeros((100, 8), np.float32), "table")  # lookup only
    shared = numpy_helper.from_array(np.zeros((8, 100), np.float32), "shared")  # lookup + head
    weight = numpy_helper.from_array(np.zeros((8, 8), np.float32), "weight")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["x"]),
        helper.make_node("MatMul", ["x", "weight"], ["h"]),
        helper.make_node("MatMul", ["h", "shared"], ["logits"]),
        helper.make_node("Gather", ["shared", "ids"], ["unused"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [table, shared, weight],
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert onnx_step_bytes(path) == (8 * 100 + 8 * 8) * 4
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, size_threshold=0)
    assert onnx_step_bytes(path) == (8 * 100 + 8 * 8) * 4  # weights beside the graph


def test_gguf_leaves_out_the_embedding_only_beside_its_own_head(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")

    def write(name: str, tensors: dict[str, np.ndarray]) -> Path:
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), "llama")
        for key, array in tensors.items():
            writer.add_tensor(key, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    embedding, layer = np.zeros((50, 8), np.float32), np.zeros((8, 8), np.float32)
    tied = write("tied.gguf", {"token_embd.weight": embedding, "blk.0.w": layer})
    assert gguf_step_bytes(tied) == (50 * 8 + 8 * 8) * 4
    untied = write(
        "untied.gguf",
        {"token_embd.weight": embedding, "blk.0.w": layer, "output.weight": embedding},
    )
    assert gguf_step_bytes(untied) == (50 * 8 + 8 * 8) * 4


@pytest.mark.parametrize("threads", [1, 2])
def test_machine_read_rate_reads_every_byte(threads: int) -> None:
    """A positive rate from threads that each read their share (the sums are checked)."""
    assert machine_read_rate(threads, megabytes=16, repeats=2) > 0


def test_machine_read_rate_notices_a_thread_that_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeat whose thread raised (threading swallows it) is an error, not a fast rate."""
    import threading

    start = threading.Thread.start
    calls = iter(range(100))

    def flaky_start(self: threading.Thread) -> None:
        if next(calls) == 2:  # the second repeat's first thread
            self._target = lambda *_: None  # type: ignore[attr-defined]
        start(self)

    monkeypatch.setattr(threading.Thread, "start", flaky_start)
    with pytest.raises(RuntimeError, match="did not read its share"):
        machine_read_rate(2, megabytes=8, repeats=3)


def test_machine_read_rate_refuses_nothing_to_read() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        machine_read_rate(0)
    with pytest.raises(ValueError, match=">= 1"):
        machine_read_rate(1, megabytes=0)
