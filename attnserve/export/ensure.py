"""The one rule for a missing ONNX variant, shared by `serve`, `translate` and `eval`.

A model directory without `onnx/<variant>/` is exported on first use unless the caller refuses
(`--no-auto-export`); then the error names the command to run. Checking costs no torch import;
exporting imports torch once.
"""

from __future__ import annotations

import logging
from pathlib import Path

from attnserve.engine.onnx.layout import (
    DECODER_NAME,
    ENCODER_NAME,
    LM_STEP_NAME,
    variant_dir,
)
from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family

log = logging.getLogger(__name__)


class NotExportedError(FileNotFoundError):
    """The variant's graphs are missing and exporting them was refused."""


def is_exported(directory: Path, variant: str) -> bool:
    graphs = variant_dir(directory, variant)
    names: tuple[str, ...] = (ENCODER_NAME, DECODER_NAME)
    if directory_family(directory) != ENCODER_DECODER:
        names = (LM_STEP_NAME,)
    return all((graphs / name).is_file() for name in names)


def ensure_exported(directory: str | Path, variant: str, *, allow: bool) -> bool:
    """Export `variant` of `directory` when it is missing and `allow`; True if it exported."""
    directory = Path(directory)
    if is_exported(directory, variant):
        return False
    graphs = variant_dir(directory, variant)
    command = f"attnserve export {directory} --variants {variant}"
    if not allow:
        raise NotExportedError(
            f"{graphs} has no ONNX graphs: run `{command}`, or allow exporting on first use "
            "(--auto-export, ATTNSERVE_AUTO_EXPORT)"
        )
    log.info("%s is missing: exporting the model to ONNX (`%s`)", graphs, command)
    if directory_family(directory) != ENCODER_DECODER:
        from attnserve.export.lm_export import export_lm_model

        export_lm_model(directory, [variant])
    else:
        from attnserve.export.onnx_export import export_model

        export_model(directory, [variant])
    log.info("exported %s", graphs)
    return True
