"""One lm-evaluation-harness loglikelihood task, two ways: through attnserve's /v1/completions
(the harness's `local-completions` model: token-id prompts, echo, logprobs 1, max_tokens 1) and
through the harness's `hf` model on a transformers copy of the same weights. Prints and writes
the accuracies, and how far apart the two runs' loglikelihoods of every choice are.

Runs in a venv of its own with lm-eval (README.md beside this file); attnserve runs in its own
environment (`--server-python`), started here on a free port, or is given (`--base-url`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASK = "attnserve_mc"
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], seconds: float = 900) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if server.poll() is not None:
            raise RuntimeError(f"attnserve serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("attnserve did not become ready")


def evaluate(model: str, model_args: dict[str, Any], tasks_dir: Path, limit: int | None) -> Any:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=limit,
        log_samples=True,
        batch_size=1,
    )


def loglikelihoods(result: Any) -> list[list[float]]:
    """Each question's choices' loglikelihoods, in question order."""
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the served model directory")
    parser.add_argument("--hf-dir", type=Path, required=True, help="a transformers copy of it")
    parser.add_argument("--server-python", help="the Python that runs attnserve")
    parser.add_argument("--base-url", help="a running attnserve instead (its root URL)")
    parser.add_argument(
        "--variants", default="int8", help="the ONNX variants served, one run each (a,b)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None, help="questions (default: all)")
    parser.add_argument("--output", type=Path, default=None, help="results JSON")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory(prefix="attnserve-lm-eval-") as tmp:
        tasks_dir = Path(tmp)
        data = HERE / "questions.jsonl"
        (tasks_dir / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
        runs = {}
        for variant in args.variants.split(","):
            runs[variant] = served_run(args, parser, variant, tasks_dir)
        started = time.perf_counter()
        hf = evaluate(
            "hf",
            {"pretrained": str(args.hf_dir), "dtype": "float32", "device": "cpu"},
            tasks_dir,
            args.limit,
        )
        hf_seconds = time.perf_counter() - started

    theirs = loglikelihoods(hf)
    report: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "task": TASK,
        "questions": len(theirs),
        "hf": {
            "acc": hf["results"][TASK]["acc,none"],
            "acc_norm": hf["results"][TASK]["acc_norm,none"],
            "seconds": round(hf_seconds, 1),
        },
        "command": " ".join(sys.argv),
    }
    for variant, (served, seconds) in runs.items():
        ours = loglikelihoods(served)
        pairs = list(zip(ours, theirs, strict=True))
        report[f"attnserve_{variant}"] = {
            "acc": served["results"][TASK]["acc,none"],
            "acc_norm": served["results"][TASK]["acc_norm,none"],
            "seconds": round(seconds, 1),
            "max_abs_loglikelihood_diff": max(
                abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True)
            ),
            "same_best_choice": sum(
                max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__)
                for x, y in pairs
            ),
        }
    print(json.dumps(report, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


def served_run(
    args: argparse.Namespace, parser: argparse.ArgumentParser, variant: str, tasks_dir: Path
) -> tuple[Any, float]:
    """The task through attnserve serving `variant` (started here unless --base-url)."""
    server = None
    url = args.base_url
    if url is None:
        if not args.server_python:
            parser.error("give --server-python (to start attnserve) or --base-url")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [
            args.server_python, "-m", "attnserve", "serve", "--model", str(args.model),
            "--variant", variant, "--port", str(port),
        ]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        server = subprocess.Popen(command)
    try:
        if server is not None:
            wait_ready(url, server)
        started = time.perf_counter()
        served = evaluate(
            "local-completions",
            {
                "base_url": f"{url}/v1/completions",
                "model": args.model.name,
                "tokenizer": str(args.hf_dir),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 1,
                "max_retries": 1,
            },
            tasks_dir,
            args.limit,
        )
        return served, time.perf_counter() - started
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
