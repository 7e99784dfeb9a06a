"""Each benchmarked runtime in its own process, so that its peak RSS is its own.

`RunnerSpec` says what to load (picklable); `build_runner` loads it (heavy imports happen here,
in the worker). `WorkerRunner` starts a spawned process per spec and asks it, over a pipe, to
decode the benchmark sources once; the parent interleaves the workers (bench.run_interleaved),
and only one of them runs at a time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from attnserve.bench.offline import BackendRunner, BenchConfig, Runner, Sources, peak_rss_mb
from attnserve.defaults import DEFAULT_VARIANT

log = logging.getLogger(__name__)


class BenchError(RuntimeError):
    """A runner failed to load or to decode (the worker's traceback is in the message)."""


@dataclass(frozen=True)
class RunnerSpec:
    """What a worker loads: an attnserve backend name ("torch", "onnx-int8", ...) over an
    attnserve model directory, or a peer ("hf", "ct2-fp32", "ct2-int8") over its own directory.
    """

    name: str  # the label in results
    kind: str  # an attnserve backend name or a peer name
    path: str
    threads: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # e.g. provider for ONNX


def _torch_runner(model_dir: Path, threads: int | None) -> Runner:
    """TorchBackend over config.json + model.safetensors (no tokenizer needed)."""
    import torch

    from attnserve.engine.torch_backend import TorchBackend
    from attnserve.model.checkpoint import alias_names, load_state_dict, read_model_config
    from attnserve.model.transformer import EncoderDecoder

    config = read_model_config(model_dir)
    with torch.device("cpu"):
        model = EncoderDecoder(config)
    tensors = load_state_dict(model_dir)
    missing = set(model.state_dict()) - set(tensors) - alias_names(config)
    if missing:
        raise BenchError(f"{model_dir}: model.safetensors lacks {sorted(missing)[:5]}")
    model.load_state_dict(tensors, strict=False)
    return BackendRunner(TorchBackend(model, threads=threads), [model_dir / "model.safetensors"])


def build_runner(spec: RunnerSpec) -> Runner:
    """Load the runtime a spec names (in the calling process)."""
    from attnserve.bench.peers import PEERS, build_peer

    path = Path(spec.path)
    if spec.kind in PEERS:
        runner: Runner = build_peer(spec.kind, path, spec.threads)
        return runner
    if spec.kind == "torch":
        return _torch_runner(path, spec.threads)
    from attnserve.engine.loading import load_backend, parse_backend_name
    from attnserve.engine.onnx.layout import read_manifest, variant_dir

    backend = load_backend(path, spec.kind, threads=spec.threads, **spec.options)
    variant = parse_backend_name(spec.kind)[1] or str(spec.options.get("variant", DEFAULT_VARIANT))
    # What the export wrote and hashed: the graphs, their weights files, the shared weights.
    graphs = variant_dir(path, variant)
    files = read_manifest(graphs).get("files", {})
    return BackendRunner(backend, [graphs / name for name in files])


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.WARNING)


def _serve(conn: Connection, spec: RunnerSpec, sources: list[list[int]]) -> None:
    """Worker process: load, answer ("decode", config) / ("rss",) until ("stop",)."""
    _quiet_libraries()
    try:
        runner = build_runner(spec)
        conn.send(("ok", runner.model_size_mb()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        request = conn.recv()
        try:
            if request[0] == "stop":
                break
            if request[0] == "rss":
                conn.send(("ok", peak_rss_mb()))
            else:
                start = time.perf_counter()
                tokens = runner.decode(sources, request[1])
                conn.send(("ok", (tokens, time.perf_counter() - start)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class WorkerRunner:
    """A runner in a spawned process (bench.Timed): decodes `sources` when asked."""

    def __init__(self, spec: RunnerSpec, sources: Sources) -> None:
        self.spec = spec
        context = mp.get_context("spawn")  # no inherited threads, runtimes or memory
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, spec, [list(s) for s in sources]), daemon=True
        )
        self._process.start()
        child.close()
        self._size: float | None = self._receive()

    def _receive(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise BenchError(f"{self.spec.name}: the worker process died") from None
        if status != "ok":
            raise BenchError(f"{self.spec.name} failed:\n{value}")
        return value

    def timed_decode(self, config: BenchConfig) -> tuple[int, float]:
        self._conn.send(("decode", config))
        tokens, seconds = self._receive()
        return int(tokens), float(seconds)

    def peak_rss_mb(self) -> float:
        self._conn.send(("rss",))
        return float(self._receive())

    def model_size_mb(self) -> float | None:
        return self._size

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("stop",))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
        self._conn.close()
