"""Weights that the graphs of one exported variant share, loaded once for all their sessions.

The export stores a tensor that several graphs hold with the same values (the token embedding
of the encoder and of the decoder) once, in ``shared.data`` beside the graphs, as ONNX external
data: each graph still loads on its own. Loaded that way, though, every ONNX Runtime session
reads its own copy (NLLB-600M's int8 embedding is 256 MB a copy). The manifest lists the shared
tensors (``options["shared_weights"]``: the file, and per tensor its dtype, shape, offset and its
name in each graph); `shared_initializers` maps the file once, read only, and gives every graph
the same `OrtValue` to add to its session's options (`SessionOptions.add_initializer`: ORT then
uses that memory as the initializer and does not read the graph's external copy).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from attnserve.engine.onnx.layout import SHARED_WEIGHTS


class SharedWeights:
    """The shared tensors of a variant directory: graph name -> [(initializer, value)]."""

    def __init__(self, by_graph: dict[str, list[tuple[str, ort.OrtValue]]]) -> None:
        self.by_graph = by_graph  # the OrtValues keep their (mapped) arrays alive

    @classmethod
    def load(cls, directory: Path, manifest: dict[str, Any]) -> SharedWeights:
        spec = manifest.get("options", {}).get(SHARED_WEIGHTS)
        by_graph: dict[str, list[tuple[str, ort.OrtValue]]] = defaultdict(list)
        if not spec:
            return cls({})
        path = directory / spec["file"]
        for tensor in spec["tensors"]:
            array = np.memmap(
                path,
                dtype=np.dtype(tensor["dtype"]),
                mode="r",
                offset=int(tensor["offset"]),
                shape=tuple(tensor["shape"]),
            )
            value = ort.OrtValue.ortvalue_from_numpy(array)
            for graph, name in tensor["names"].items():
                by_graph[graph].append((name, value))
        return cls(dict(by_graph))

    def add_to(self, options: ort.SessionOptions, graph: str) -> ort.SessionOptions:
        """Add `graph`'s shared tensors to `options` (one options object per graph: each graph
        names the tensors its own way)."""
        for name, value in self.by_graph.get(graph, []):
            options.add_initializer(name, value)
        return options

    @property
    def count(self) -> int:
        return len({id(v) for pairs in self.by_graph.values() for _, v in pairs})
