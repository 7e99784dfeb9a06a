"""`attnserve bench`: prepare the model files, start the runners, time them, write the report.

Models: `--model DIR` (an attnserve model directory; a missing ONNX variant is exported first),
`--preset NAME` (random weights of a preset, exported to a temporary directory) or `--hf-dir DIR`
(a Hugging Face directory of a family `attnserve import` reads, imported and exported). Peers
(hf, ct2-fp32, ct2-int8) need a Hugging Face directory: `--hf-dir`, or `--preset` with a peer,
which writes a random model of the preset's shape first so that every runtime decodes the same
weights: an M2M100 (NLLB) model for presets with fairseq's positions (`nllb-600m`), else a
MarianMTModel (Marian's conventions: swish, final logits bias).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnserve.bench.offline import BenchConfig, InProcess, Timed, random_sources, run_interleaved
from attnserve.bench.peers import PEERS, available
from attnserve.bench.workers import RunnerSpec, WorkerRunner, build_runner
from attnserve.defaults import DEFAULT_VARIANT

log = logging.getLogger(__name__)


def _preset_config(args: argparse.Namespace) -> Any:
    from attnserve.model.config import ModelConfig

    overrides = json.loads(args.preset_overrides) if args.preset_overrides else {}
    return ModelConfig.preset(args.preset, **overrides)


def _random_model_dir(config: Any, out: Path, seed: int = 0) -> tuple[Path, Any]:
    """config.json + model.safetensors of a seeded random EncoderDecoder (no tokenizer)."""
    import torch
    from safetensors.torch import save_file

    from attnserve.model.checkpoint import alias_names
    from attnserve.model.transformer import EncoderDecoder

    torch.manual_seed(seed)
    model = EncoderDecoder(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.json")
    skip = alias_names(config)
    tensors = {k: t.contiguous() for k, t in model.state_dict().items() if k not in skip}
    save_file(tensors, str(out / "model.safetensors"))
    return out, model


def _onnx_variants(backends: Sequence[str]) -> list[str]:
    return sorted(
        {b.partition("-")[2] or DEFAULT_VARIANT for b in backends if b.startswith("onnx")}
    )


def prepare(
    args: argparse.Namespace, names: list[str], workdir: Path
) -> tuple[Path, dict[str, Path]]:
    """The attnserve model directory to run, and the directory of every peer."""
    from attnserve.bench.peers import convert_ct2, write_random_peer_model

    peers = [n for n in names if n in PEERS]
    variants = _onnx_variants(names)
    hf_dir: Path | None = args.hf_dir
    if args.preset and peers:
        hf_dir = write_random_peer_model(workdir / "hf", _preset_config(args))
    model = None
    if hf_dir is not None:
        from attnserve.convert import import_model

        model_dir = workdir / "attnserve"
        import_model(hf_dir, model_dir)
    elif args.preset:
        model_dir, model = _random_model_dir(_preset_config(args), workdir / "attnserve")
    else:
        from attnserve.provision import Runtime, ensure_model_dir, provision

        model_dir = ensure_model_dir(args.model)
        if peers:
            raise ValueError("peers need a Marian model: use --hf-dir DIR or --preset NAME")
        for variant in variants:  # exported on first use, as `attnserve translate` does
            provision(model_dir, Runtime(variant=variant))
    if variants and (hf_dir is not None or args.preset):
        from attnserve.engine.onnx.layout import stamp_weights
        from attnserve.export.onnx_export import export_model, export_variants

        if model is not None:  # the directory's weights, in memory
            written = export_variants(model, model_dir / "onnx", variants, verify=False)
            stamp_weights(model_dir, written.values())
        else:
            export_model(model_dir, variants, verify=False)
    peer_dirs: dict[str, Path] = {}
    for name in peers:
        assert hf_dir is not None
        if name == "hf":
            peer_dirs[name] = hf_dir
        else:
            quantization = "int8" if name == "ct2-int8" else "float32"
            peer_dirs[name] = convert_ct2(hf_dir, workdir / name, quantization)
    return model_dir, peer_dirs


def _usable(names: list[str], provider: str) -> list[str]:
    """Drop peers that are not installed and fp16 without a CUDA provider (warning)."""
    kept = []
    for name in names:
        if name in PEERS and not available(name):
            log.warning("skipping %s: its package is not installed", name)
        elif name == "onnx-fp16" and not _has_cuda(provider):
            log.warning("skipping onnx-fp16: it needs onnxruntime's CUDA provider (a GPU)")
        else:
            kept.append(name)
    return kept


def _onnx_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ONNX backends' load options: provider, and IO binding where the flag sets it."""
    options: dict[str, Any] = {"provider": args.provider}
    if getattr(args, "io_binding", None) is not None:
        options["io_binding"] = args.io_binding
    return options


def _has_cuda(provider: str) -> bool:
    import onnxruntime as ort

    return provider != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers()


def cmd_bench(args: argparse.Namespace) -> int:
    from attnserve.model.checkpoint import read_model_config

    names = _usable([b.strip() for b in args.backends.split(",") if b.strip()], args.provider)
    if not names:
        raise ValueError("no backend to run")
    configs = [
        BenchConfig(int(k), int(b), args.new_tokens)
        for k in args.beam_sizes.split(",")
        for b in args.batch_sizes.split(",")
    ]
    with tempfile.TemporaryDirectory(prefix="attnserve-bench-") as tmp:
        model_dir, peer_dirs = prepare(args, names, Path(tmp))
        config = read_model_config(model_dir)
        specials = {config.pad_id, config.start_id, config.eos_id, config.unk_id}
        sources = random_sources(
            args.sentences, config.vocab_size, eos_id=config.eos_id, exclude=specials
        )
        specs = [
            RunnerSpec(
                name,
                name,
                str(peer_dirs.get(name, model_dir)),
                args.threads,
                {} if name in PEERS or name == "torch" else _onnx_options(args),
            )
            for name in names
        ]
        runners: dict[str, Timed] = {}
        try:
            for spec in specs:
                log.info("loading %s", spec.name)
                runners[spec.name] = (
                    WorkerRunner(spec, sources)
                    if args.isolate
                    else InProcess(build_runner(spec), sources)
                )
            results = run_interleaved(
                runners,
                configs,
                sentences=len(sources),
                repeats=args.repeats,
                threads=args.threads,
                isolated=args.isolate,
                progress=log.info,
            )
        finally:
            for runner in runners.values():
                if isinstance(runner, WorkerRunner):
                    runner.close()
    for result in results:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    if args.output_dir is not None:
        from attnserve.bench.report import write_report

        title = args.title or _describe(args, config, names)
        for path in write_report(results, args.output_dir, args.name, model=title):
            log.info("wrote %s", path)
    return 0


def _describe(args: argparse.Namespace, config: Any, names: Sequence[str]) -> str:
    """e.g. 'preset small (d256, 6+3 layers, ffn 1024, vocab 8000), random weights, ...'."""
    shape = (
        f"d{config.d_model}, {config.encoder_layers}+{config.decoder_layers} layers, "
        f"ffn {config.ffn_dim}, vocab {config.target_vocab_size}"
    )
    if args.preset and any(n in PEERS for n in names):
        family = "M2M100" if config.positions == "sinusoidal_fairseq" else "MarianMTModel"
        source = f"random {family} of the {args.preset} shape ({shape}), imported"
    elif args.preset:
        source = f"preset {args.preset} ({shape}), random weights"
    else:
        source = f"{args.hf_dir or args.model} ({shape})"
    threads = f"{args.threads} thread(s)" if args.threads else "default threads"
    return f"{source}, {args.new_tokens} new tokens, {threads}"
