"""The one rule for a missing ONNX variant, shared by `serve`, `translate` and `eval`.

A model directory without `onnx/<variant>/` (or with a file its manifest lists missing, such as
the shared weights) is exported on first use unless the caller refuses (`--no-auto-export`);
then the error names the command to run. Checking costs no torch import;
exporting imports torch once.
"""

from __future__ import annotations

import logging
from pathlib import Path

from attnserve.engine.onnx.layout import (
    DECODER_NAME,
    ENCODER_NAME,
    LM_STEP_NAME,
    MANIFEST_NAME,
    read_manifest,
    variant_dir,
)
from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family

log = logging.getLogger(__name__)


class NotExportedError(FileNotFoundError):
    """The variant's graphs are missing and exporting them was refused."""


def is_exported(directory: Path, variant: str) -> bool:
    """The variant's graphs are there, and every file its manifest lists (weights beside the
    graphs, the weights they share): a variant missing one is exported again."""
    graphs = variant_dir(directory, variant)
    names: tuple[str, ...] = (ENCODER_NAME, DECODER_NAME)
    if directory_family(directory) != ENCODER_DECODER:
        names = (LM_STEP_NAME,)
    listed = tuple(read_manifest(graphs).get("files", {}))  # () without a manifest
    return all((graphs / name).is_file() for name in (*names, *listed))


def ensure_exported(directory: str | Path, variant: str, *, allow: bool) -> bool:
    """Export `variant` of `directory` when it is missing and `allow`; True if it exported."""
    directory = Path(directory)
    if is_exported(directory, variant):
        return False
    graphs = variant_dir(directory, variant)
    command = f"attnserve export {directory} --variants {variant}"
    partial = (graphs / MANIFEST_NAME).is_file()
    what = "is missing files its manifest lists" if partial else "has no ONNX graphs"
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
