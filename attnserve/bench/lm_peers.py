"""Language-model peers on the same weights: ONNX Runtime GenAI and llama.cpp.

Both are optional benchmark extras (`pip install attnserve[bench]`; llama-cpp-python builds
llama.cpp from source), never runtime dependencies, imported only here and inside functions.

* ``ort-genai-<precision>`` (fp32, int8, int4): ONNX Runtime GenAI's model builder
  (`onnxruntime_genai.models.builder`, CPU) run on a Hugging Face copy of the model's float32
  weights in its family's class (`LlamaForCausalLM`, ...; Phi-3's projections fused again:
  `write_hf_llama`), with the builder's defaults for that precision (int8 / int4: MatMulNBits,
  blocks of 32, accuracy level 4, the output head 8-bit). Built once into MODEL/peers/
  (git-ignored, as the model is).
* ``llama.cpp``: llama-cpp-python on the GGUF file the model was imported from (metadata.json's
  `source`; SmolLM2's wheel ships a Q4_1 file), so it runs the very blocks attnserve's int4
  keeps.
* ``llama.cpp-<type>`` (q8_0, q4_0, q4_1): llama-cpp-python on MODEL/peers/llama.cpp-TYPE.gguf,
  made from the Hugging Face directory the model was imported from by llama.cpp's own
  converter (convert_hf_to_gguf.py of a llama.cpp source tree, `llama_cpp_src`; bfloat16 out),
  then quantized to TYPE by llama.cpp (`llama_model_quantize`, its default mix: the output
  projection of a Q4 file in Q6_K, or Q8_0 where rows are no multiple of 256).

GenAI's builder and llama.cpp's converter read the Hugging Face directory a model was imported
from (metadata.json's `source`) where it is still there, else the copy `write_hf_llama` makes.

Every runner takes prompt token ids from attnserve's tokenizer (the same ids for all) and is
timed as `attnserve.bench.lm` times attnserve: decode tokens/s of one greedy stream after the
prompt (exactly `new` tokens, end-of-sequence ignored), and the seconds to prefill a prompt.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.model.checkpoint import read_metadata

log = logging.getLogger(__name__)

GENAI_PRECISIONS = ("fp32", "int8", "int4")
# llama.cpp's quantization types a converter-made GGUF is offered in (llama_ftype values)
LLAMA_CPP_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7}
LM_PEERS = (
    *(f"ort-genai-{p}" for p in GENAI_PRECISIONS),
    "llama.cpp",
    *(f"llama.cpp-{t}" for t in LLAMA_CPP_TYPES),
)
PEERS_DIR = "peers"
HF_COPY = "hf"
# llama.cpp's context and batch: the prefill prompt goes in one batch, as attnserve's one chunk.
LLAMA_CPP_CONTEXT = 2048
LLAMA_CPP_BATCH = 512


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (package missing, no GGUF source); the message says why."""


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise PeerUnavailable(f"{module} is not installed ({extra})")


def write_hf_llama(model_dir: str | Path, out: str | Path) -> Path:
    """A Hugging Face directory of the model's family (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
    ...) holding its float32 weights: config.json, model.safetensors (our names with HF's
    `model.` prefix), tokenizer files. ValueError for a model whose switches that config
    cannot state (it is read back with attnserve's importer and must give the same config)."""
    import torch
    from safetensors.torch import save_file

    from attnserve.convert.hf_decoder import FAMILIES, FUSED, decoder_config_from_hf
    from attnserve.model.decoder_checkpoint import load_decoder_dir

    model = load_decoder_dir(model_dir)
    cfg = model.config
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.rotary_dim is not None:
        rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    hf_config: dict[str, Any] = {
        "architectures": [FAMILIES[cfg.family].architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": list(cfg.eos_ids),
        "pad_token_id": cfg.pad_id,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "sliding_window": cfg.sliding_window,
        "layer_types": [
            "full_attention" if cfg.window(i) is None else "sliding_attention"
            for i in range(cfg.num_layers)
        ],
        "torch_dtype": "float32",
    }
    if "original_max_position_embeddings" in rope and cfg.family == "phi3":  # Phi-3's place
        hf_config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if decoder_config_from_hf(hf_config) != cfg:
        raise ValueError(f"{model_dir}: a {cfg.family} config cannot state this model's switches")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    aliases = model.alias_names()
    state = {
        (name if name.startswith("lm_head.") else f"model.{name}"): tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if name not in aliases
    }
    if cfg.family == "phi3":  # Phi3ForCausalLM's fused projections
        for fused, parts in FUSED.items():
            for i in range(cfg.num_layers):
                names = [f"model.layers.{i}.{part}.weight" for part in parts]
                stacked = torch.cat([state.pop(name) for name in names])
                state[f"model.layers.{i}.{fused}.weight"] = stacked
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, out / name)
    return out


def hf_source(model_dir: str | Path) -> Path | None:
    """The Hugging Face directory the model was imported from, if it is still there."""
    meta = read_metadata(model_dir)
    source = Path(str(meta.get("source", "")))
    if meta.get("format") == "huggingface" and (source / "config.json").is_file():
        return source
    return None


def hf_dir(model_dir: str | Path) -> Path:
    """The model's Hugging Face source directory, else MODEL/peers/hf (written when missing)."""
    source = hf_source(model_dir)
    if source is not None:
        return source
    hf = Path(model_dir) / PEERS_DIR / HF_COPY
    if not (hf / "model.safetensors").is_file():
        log.info("writing a Hugging Face copy of %s into %s", model_dir, hf)
        write_hf_llama(model_dir, hf)
    return hf


def genai_dir(model_dir: str | Path, precision: str) -> Path:
    """MODEL/peers/ort-genai-PRECISION, built with GenAI's model builder when missing."""
    if precision not in GENAI_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {GENAI_PRECISIONS}")
    _require("onnxruntime_genai", "pip install onnxruntime-genai")
    peers = Path(model_dir) / PEERS_DIR
    out = peers / f"ort-genai-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    hf = hf_dir(model_dir)
    staged = peers / f".staged-ort-genai-{precision}"
    shutil.rmtree(staged, ignore_errors=True)
    command = [
        sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
        str(staged), "-p", precision, "-e", "cpu", "-c", str(peers / ".genai-cache"),
    ]  # fmt: skip
    log.info("building the ONNX Runtime GenAI %s model: %s", precision, " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (staged / "genai_config.json").is_file():
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"GenAI's model builder failed ({done.returncode}): {tail}")
    shutil.rmtree(peers / ".genai-cache", ignore_errors=True)
    staged.rename(out)
    return out


def gguf_source(model_dir: str | Path) -> Path:
    """The GGUF file a model directory was imported from (metadata.json), PeerUnavailable
    when it came from elsewhere or the file is gone."""
    meta = read_metadata(model_dir)
    source = Path(str(meta.get("source", "")))
    if meta.get("format") != "gguf" or not source.is_file():
        raise PeerUnavailable(f"{model_dir} was not imported from a GGUF file that is still there")
    return source


def _run(command: list[str], what: str, env: dict[str, str] | None = None) -> None:
    log.info("%s: %s", what, " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"{what} failed ({done.returncode}): {tail}")


def convert_with_llama_cpp(hf: Path, out: Path, llama_cpp_src: Path) -> Path:
    """A bfloat16 GGUF of a Hugging Face directory by llama.cpp's convert_hf_to_gguf.py (run
    with the source tree's own gguf-py)."""
    script = Path(llama_cpp_src) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise PeerUnavailable(f"{script} is missing (llama_cpp_src: a llama.cpp source tree)")
    env = dict(os.environ)
    gguf_py = str(Path(llama_cpp_src) / "gguf-py")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (gguf_py, env.get("PYTHONPATH")) if p)
    staged = out.with_name(f".staged-{out.name}")
    command = [sys.executable, str(script), str(hf), "--outtype", "bf16", "--outfile", str(staged)]
    _run(command, "llama.cpp's converter", env)
    staged.rename(out)
    return out


def quantize_with_llama_cpp(src: Path, out: Path, kind: str, threads: int | None = None) -> Path:
    """`src` (a GGUF) quantized to llama.cpp type `kind` (LLAMA_CPP_TYPES) by llama.cpp's
    quantizer, in a child process (it logs to the terminal and may abort)."""
    staged = out.with_name(f".staged-{out.name}")
    code = (
        "import ctypes, sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = int(sys.argv[3]); p.nthread = int(sys.argv[4])\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
        "ctypes.byref(p)))\n"
    )
    command = [
        sys.executable, "-c", code, str(src), str(staged), str(LLAMA_CPP_TYPES[kind]),
        str(threads or os.cpu_count() or 1),
    ]  # fmt: skip
    _run(command, f"llama.cpp's quantizer ({kind})")
    staged.rename(out)
    return out


def llama_cpp_gguf(model_dir: str | Path, kind: str, llama_cpp_src: Path | None = None) -> Path:
    """MODEL/peers/llama.cpp-KIND.gguf, made when missing from the model's Hugging Face
    directory by llama.cpp's converter in `llama_cpp_src` (kept as llama.cpp-bf16.gguf) and
    quantizer; PeerUnavailable when it is missing and cannot be made."""
    if kind not in LLAMA_CPP_TYPES:
        raise ValueError(f"unknown llama.cpp type {kind!r}; choose from {tuple(LLAMA_CPP_TYPES)}")
    peers = Path(model_dir) / PEERS_DIR
    out = peers / f"llama.cpp-{kind}.gguf"
    if out.is_file():
        return out
    if llama_cpp_src is None:
        raise PeerUnavailable(f"{out} is missing: give a llama.cpp source tree to make it")
    _require("llama_cpp", "pip install llama-cpp-python")
    peers.mkdir(parents=True, exist_ok=True)
    full = peers / "llama.cpp-bf16.gguf"
    if not full.is_file():
        convert_with_llama_cpp(hf_dir(model_dir), full, llama_cpp_src)
    return quantize_with_llama_cpp(full, out, kind)


class GenAIRunner:
    """One ONNX Runtime GenAI model (`og.Model`), intra-op threads set in its genai_config."""

    def __init__(self, directory: Path, threads: int | None) -> None:
        import onnxruntime_genai as og

        path = directory / "genai_config.json"
        config = json.loads(path.read_text())
        options = config["model"]["decoder"].setdefault("session_options", {})
        options["intra_op_num_threads"] = threads or 0
        options["inter_op_num_threads"] = 1
        path.write_text(json.dumps(config, indent=2) + "\n")
        self._og = og
        self.model = og.Model(str(directory))
        self.graph = directory / str(config["model"]["decoder"].get("filename", "model.onnx"))

    def step_weight_bytes(self) -> int:
        from attnserve.bench.lm_bytes import onnx_step_bytes

        return onnx_step_bytes(self.graph)

    def _generator(self, total: int) -> Any:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        return self._og.Generator(self.model, params)

    def prefill_seconds(self, ids: Sequence[int]) -> float:
        generator = self._generator(len(ids) + 1)
        start = time.perf_counter()
        generator.append_tokens(list(ids))
        return time.perf_counter() - start

    def decode_tokens_per_second(self, prompt: Sequence[int], new: int) -> float:
        generator = self._generator(len(prompt) + new)
        generator.append_tokens(list(prompt))
        written = 0
        start = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
            written += 1
        seconds = time.perf_counter() - start
        if written != new:
            raise RuntimeError(f"ONNX Runtime GenAI wrote {written} tokens, not {new}")
        return new / seconds


class LlamaCppRunner:
    """llama-cpp-python's `Llama` on a GGUF file; greedy is the argmax of the last logits."""

    def __init__(self, gguf: Path, threads: int | None) -> None:
        from llama_cpp import Llama

        count = threads or 1
        self.gguf = gguf
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=LLAMA_CPP_CONTEXT,
            n_batch=LLAMA_CPP_BATCH,
            n_threads=count,
            n_threads_batch=count,
            verbose=False,
        )

    def step_weight_bytes(self) -> int:
        from attnserve.bench.lm_bytes import gguf_step_bytes

        return gguf_step_bytes(self.gguf)

    def prefill_seconds(self, ids: Sequence[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(list(ids))
        return time.perf_counter() - start

    def decode_tokens_per_second(self, prompt: Sequence[int], new: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(list(prompt))
        start = time.perf_counter()
        for _ in range(new - 1):  # the last token needs no forward pass
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([token])
        int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return new / (time.perf_counter() - start)


def peer_path(model_dir: str | Path, name: str, llama_cpp_src: Path | None = None) -> Path:
    """What peer `name` (one of LM_PEERS) runs, made when missing and possible: GenAI's model
    directory or llama.cpp's GGUF file; PeerUnavailable when it cannot be had here."""
    if name.startswith("ort-genai-"):
        return genai_dir(model_dir, name.removeprefix("ort-genai-"))
    if name == "llama.cpp":
        return gguf_source(model_dir)
    if name.startswith("llama.cpp-"):
        return llama_cpp_gguf(model_dir, name.removeprefix("llama.cpp-"), llama_cpp_src)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(LM_PEERS)}")


def peer_runner(
    model_dir: str | Path, name: str, threads: int | None, llama_cpp_src: Path | None = None
) -> Any:
    """A runner for peer `name` (one of LM_PEERS); PeerUnavailable when it cannot run here."""
    if name.startswith("llama.cpp"):
        _require("llama_cpp", "pip install llama-cpp-python")
    path = peer_path(model_dir, name, llama_cpp_src)
    if name.startswith("ort-genai-"):
        return GenAIRunner(path, threads)
    return LlamaCppRunner(path, threads)
