"""The one rule for a missing ONNX variant, shared by `serve`, `translate` and `eval`.

A model directory without `onnx/<variant>/` (or with a file its manifest lists missing, such as
the shared weights, or graphs that carry older stock bodies of attnserve's ops than this version
writes) is exported on first use unless the caller refuses (`--no-auto-export`); then the error
names the command to run. Checking costs no torch import; exporting imports torch once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from attnserve.engine.onnx.layout import (
    BODIES_VERSION,
    DECODER_NAME,
    ENCODER_NAME,
    KERNEL_NODES,
    LM_STEP_NAME,
    MANIFEST_NAME,
    WEIGHTS_KEY,
    read_manifest,
    variant_dir,
    weights_fingerprint,
)
from attnserve.kernels.ops import BODIES, BODIES_CHANGES
from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family

log = logging.getLogger(__name__)


class NotExportedError(FileNotFoundError):
    """The variant's graphs are missing and exporting them was refused."""


def stale_bodies(manifest: dict[str, Any]) -> str | None:
    """Why the variant's graphs must be exported again for the stock bodies of attnserve's ops
    they carry (what runs where the kernels do not), or None: they are older than a version that
    changed this variant (attnserve.kernels.BODIES_CHANGES)."""
    options = manifest.get("options", {})
    if not options.get(KERNEL_NODES) or options.get("activation_scales") == "tensor":
        return None  # no attnserve ops, or int8 without them (ONNX Runtime's own quantization)
    have = int(options.get(BODIES_VERSION, 1))
    for version in range(have + 1, BODIES + 1):
        variants, change = BODIES_CHANGES.get(version, ((), ""))
        if manifest.get("variant") in variants:
            return f"carries older bodies of attnserve's ops (version {have}): {change}"
    return None


def stale_weights(directory: Path, manifest: dict[str, Any]) -> str | None:
    """Why the variant's graphs are not of the directory's weights, or None: exported from
    other weights (the fingerprint differs), or before exports recorded theirs."""
    current = weights_fingerprint(directory, manifest)
    if not current or manifest.get(WEIGHTS_KEY) == current:
        return None
    if WEIGHTS_KEY not in manifest:
        return "records no fingerprint of the weights it was exported from"
    return "was exported from other weights than the directory's"


def is_exported(directory: Path, variant: str) -> bool:
    """The variant's graphs are there, and every file its manifest lists (weights beside the
    graphs, the weights they share), of the directory's weights, and their ops' bodies are
    current: a variant missing one, of replaced weights, or with stale bodies, is exported
    again."""
    graphs = variant_dir(directory, variant)
    names: tuple[str, ...] = (ENCODER_NAME, DECODER_NAME)
    if directory_family(directory) != ENCODER_DECODER:
        names = (LM_STEP_NAME,)
    manifest = read_manifest(graphs)  # {} without a manifest
    listed = tuple(manifest.get("files", {}))
    present = all((graphs / name).is_file() for name in (*names, *listed))
    return present and stale_bodies(manifest) is None and stale_weights(directory, manifest) is None


def ensure_exported(directory: str | Path, variant: str, *, allow: bool) -> bool:
    """Export `variant` of `directory` when it is missing and `allow`; True if it exported."""
    directory = Path(directory)
    if is_exported(directory, variant):
        return False
    graphs = variant_dir(directory, variant)
    command = f"attnserve export {directory} --variants {variant}"
    manifest = read_manifest(graphs)
    stale = stale_bodies(manifest) or stale_weights(directory, manifest)
    if not (graphs / MANIFEST_NAME).is_file():
        what = "has no ONNX graphs"
    elif stale is not None:
        what = stale
    else:
        what = "is missing files its manifest lists"
    if not allow:
        raise NotExportedError(
            f"{graphs} {what}: run `{command}`, or allow exporting on first use "
            "(--auto-export, ATTNSERVE_AUTO_EXPORT)"
        )
    log.info("%s %s: exporting the model to ONNX (`%s`)", graphs, what, command)
    if directory_family(directory) != ENCODER_DECODER:
        from attnserve.export.lm_export import export_lm_model

        export_lm_model(directory, [variant])
    else:
        from attnserve.export.onnx_export import export_model

        export_model(directory, [variant])
    log.info("exported %s", graphs)
    return True
