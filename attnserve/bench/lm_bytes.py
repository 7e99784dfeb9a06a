"""The weight bytes one decoding step of a language model reads, per runtime's files.

A single stream's decoding step reads every weight of every product once, so decode tokens/s
times these bytes is the rate at which a runtime streams its weights: the figure that says
whether it runs near the memory's speed, and that compares models of different sizes (the
bench's "GB/s" column). Tables read only by lookups (the token embedding where the head has its
own copy, rotary caches) are left out: a step reads one row of them.
"""

from __future__ import annotations

from pathlib import Path

# Ops that read a row or a few of a table, not the table.
LOOKUPS = frozenset(("Gather", "GatherBlockQuantized", "GatherElements", "GroupQueryAttention"))


def onnx_step_bytes(path: Path) -> int:
    """Bytes of the initializers of the ONNX graph at `path` that some node other than a
    lookup reads (weights beside the graph counted from their external-data lengths)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    total = 0
    for tensor in model.graph.initializer:
        if readers.get(tensor.name, set()) <= LOOKUPS:
            continue
        external = {e.key: e.value for e in tensor.external_data}
        total += int(external["length"]) if "length" in external else len(tensor.raw_data)
    return total


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors, the token embedding left out where the file has its
    own output projection (a tied model's embedding is its head, read at every step)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    return sum(
        int(t.n_bytes)
        for t in tensors
        if not (t.name == "token_embd.weight" and "output.weight" in names)
    )


def machine_read_rate(threads: int = 1, megabytes: int = 512, repeats: int = 7) -> float:
    """GB/s at which `threads` threads of this process read memory together: the median of
    `repeats` sums of a `megabytes` array of int64 (far larger than the caches), each thread
    summing its contiguous share (numpy's reductions release the GIL). numpy asks Linux for huge
    pages for such an array, as attnserve's weights are placed on them (engine/memory.py), so a
    decoding step's GB/s compares with it: a plain streaming read's rate, not a hard ceiling (a
    step with a few weights still in the cache, or a quieter moment, can pass it)."""
    import statistics
    import threading
    import time

    import numpy as np

    if threads < 1 or megabytes < 1 or repeats < 1:
        raise ValueError("machine_read_rate wants threads, megabytes and repeats >= 1")
    data = np.ones((megabytes << 20) // 8, dtype=np.int64)  # written: every page resident
    parts = np.array_split(data, threads)
    totals = [0] * threads

    def read(i: int) -> None:
        totals[i] = int(parts[i].sum())

    rates = []
    for _ in range(repeats):
        totals[:] = [-1] * threads  # a thread that fails leaves its -1
        workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        rates.append(data.nbytes / (time.perf_counter() - start) / 1e9)
        if sum(totals) != data.size:  # every element read, in this repeat
            raise RuntimeError("machine_read_rate: a thread did not read its share")
    return statistics.median(rates)
