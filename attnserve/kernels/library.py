"""The built library: found beside this file (a stale build refused), registered with an ONNX
Runtime session, and asked for its integer products and its own threads."""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

from attnserve.kernels.ops import VERSION

log = logging.getLogger(__name__)

ENV_SWITCH = "ATTNSERVE_KERNELS"


def library_path() -> Path | None:
    """The built library beside this file, or None (not built, or turned off)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return _built_library()


def _library() -> ctypes.CDLL | None:
    """The built library, loaded (None: not built, or turned off)."""
    path = library_path()
    try:
        return None if path is None else ctypes.CDLL(str(path))
    except OSError:
        return None


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


# How long the kernels' own threads spin after a call before they sleep (microseconds): the
# gaps between a decoding step's products are a few microseconds, between steps a few hundred
# (the engine's Python); `spinning` sessions keep them awake between steps too.
SPIN_US = 100
SPINNING_US = 5000


def physical_cores() -> int:
    """The physical cores this process may run on (ONNX Runtime's default thread count): its
    CPUs, hyperthreads of one core counted once (Linux' topology files; elsewhere all CPUs)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def use_threads(threads: int, *, spinning: bool = False) -> bool:
    """Run the kernels' tasks on `threads` threads of the library's own (the calling one and
    threads - 1 workers; 1: ONNX Runtime's threads, as before) for the whole process, so that a
    session with one ONNX Runtime thread still runs its products on all of them. For a
    language model's step, whose ~120 small products each pay ONNX Runtime's hand-over to its
    threads, the kernels' own threads take each thread's share as one contiguous stream. Call
    it before the session's first run; False without the library."""
    library = _library()
    if library is None:
        return False
    library.attnserve_kernels_threads(
        ctypes.c_int(max(1, int(threads))), ctypes.c_int(SPINNING_US if spinning else SPIN_US)
    )
    return True


def thread_runs() -> int:
    """How many kernel calls have run on the kernels' own threads in this process (0 without
    the library)."""
    library = _library()
    if library is None:
        return 0
    library.attnserve_kernels_thread_runs.restype = ctypes.c_uint64
    return int(library.attnserve_kernels_thread_runs())


def register(options: object) -> bool:
    """Register the library with an onnxruntime.SessionOptions; False when there is none (the
    graphs then run their functions' stock bodies)."""
    path = library_path()
    if path is None:
        return False
    try:
        options.register_custom_ops_library(str(path))  # type: ignore[attr-defined]
    except Exception as exc:  # e.g. an ONNX Runtime older than the library needs
        log.warning("not using attnserve's kernels (%s): the graphs run their stock bodies", exc)
        return False
    return True


# The instruction sets the kernels' loops choose between (the library's `Isa`), best last; the
# environment's ATTNSERVE_KERNELS_ISA caps them for a whole process.
ISAS = ("portable", "avx2", "avx512")
ENV_ISA = "ATTNSERVE_KERNELS_ISA"


def isa(cap: str | None = None) -> str | None:
    """The instruction sets the kernels' loops use in this process (`ISAS`: the CPU's best, at
    most ATTNSERVE_KERNELS_ISA); with `cap`, at most that from now on (tests and benchmarks run
    another CPU's loops; below avx512, sessions registered from then on go without the integer
    products, as on a CPU without VNNI, and `integer_products()` says so). None without the
    library."""
    if cap is not None and cap not in ISAS:
        raise ValueError(f"unknown instruction sets {cap!r}; choose from {', '.join(ISAS)}")
    library = _library()
    if library is None:
        return None
    return ISAS[
        int(library.attnserve_kernels_isa(ctypes.c_int(-1 if cap is None else ISAS.index(cap))))
    ]


def block_products() -> bool:
    """Whether the library registers its block products (BlockQ4MatMul, BlockQ8MatMul) here: a
    CPU with AVX-512 VNNI or AVX2, the library built and not switched off (nor its products,
    ATTNSERVE_KERNELS_QMATMUL)."""
    library = _library()
    try:
        return library is not None and bool(library.attnserve_kernels_block_products())
    except AttributeError:
        return False


def integer_products() -> bool:
    """Whether the library registers its per-row int8 products (QMatMul..., RowQMatMul) here: a
    CPU with AVX-512 VNNI, the library built and not switched off, its loops not capped below
    avx512 (`isa`)."""
    library = _library()
    try:
        return library is not None and bool(library.attnserve_kernels_integer_products())
    except AttributeError:
        return False
