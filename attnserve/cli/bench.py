"""`attnserve bench | bench-http | loadtest`: offline speed, the service at saturation, locust;
`bench-documents`, `bench-train` (training throughput)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from attnserve.defaults import (
    DEFAULT_PROVIDER,
    DEFAULT_VARIANT,
    PROVIDERS,
    default_lm_dir,
    default_model_dir,
)

SERVERS_DEFAULT = "attnserve,llama-server,llama-cpp-python"


def register(sub: Any) -> None:
    from attnserve.bench import documents, training

    _add_bench(sub)
    _add_bench_lm(sub)
    _add_bench_http(sub)
    documents.register(sub)
    training.register(sub)
    _add_loadtest(sub)


def _add_bench(sub: Any) -> None:
    from attnserve.bench.peers import PEERS
    from attnserve.bench.runner import cmd_bench

    p = sub.add_parser("bench", help="offline decoding speed (target tokens/s, peak RSS, size)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, default=default_model_dir(), help="model directory")
    model.add_argument("--preset", default=None, help="random weights of a preset (tiny, small..)")
    model.add_argument(
        "--hf-dir",
        type=Path,
        default=None,
        help="Hugging Face directory (a family attnserve import reads)",
    )
    p.add_argument(
        "--preset-overrides",
        default=None,
        help='JSON ModelConfig overrides, e.g. {"vocab_size": 8000}',
    )
    p.add_argument(
        "--backends",
        default="torch,onnx-fp32,onnx-int8",
        help="comma-separated: torch, onnx-fp32, onnx-int8, onnx-fp16 (CUDA only), "
        f"and peers {', '.join(PEERS)} (skipped when not installed)",
    )
    p.add_argument("--provider", choices=list(PROVIDERS), default=DEFAULT_PROVIDER, help="ORT")
    p.add_argument(
        "--io-binding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ONNX backends: keep the cache on the device with IO binding (default: on CUDA)",
    )
    p.add_argument("--beam-sizes", default="1,4")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="fixed output length")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads of every runtime")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one process per backend, so peak RSS is per backend (default: on)",
    )
    p.add_argument("--output-dir", type=Path, default=None, help="write NAME.jsonl/.md/.png here")
    p.add_argument("--name", default="bench", help="file name stem in --output-dir")
    p.add_argument("--title", default=None, help="model description in the report")
    p.set_defaults(func=cmd_bench)


def _add_bench_lm(sub: Any) -> None:
    from attnserve.bench.lm_shapes import SHAPES

    p = sub.add_parser(
        "bench-lm",
        help="a language model's single-stream decode and long-prompt prefill, per ONNX variant "
        "and peer",
    )
    p.add_argument("--model", type=Path, default=default_lm_dir(), help="language model dir")
    p.add_argument(
        "--shape",
        default=None,
        choices=sorted(SHAPES),
        help="instead of --model: random weights in this released model's shape, written "
        "(Hugging Face directory, import, --variants' export) into --shape-dir when missing",
    )
    p.add_argument(
        "--shape-dir", type=Path, default=None, help="--shape: its files (default models/SHAPE)"
    )
    p.add_argument(
        "--llama-cpp-src",
        type=Path,
        default=None,
        help="a llama.cpp source tree (e.g. the llama-cpp-python sdist's vendor/llama.cpp): "
        "its converter makes the llama.cpp-<type> peers' GGUF files, its vocabulary files "
        "--shape's tokenizer",
    )
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="make the model's variants and the peers' files, time nothing",
    )
    p.add_argument("--variants", default="fp32,int8,int4", help="comma-separated ONNX variants")
    p.add_argument(
        "--peers",
        default="",
        help="comma-separated peers on the same weights, timed beside the variants: "
        "ort-genai-fp32, ort-genai-int8, ort-genai-int4 (ONNX Runtime GenAI), llama.cpp "
        "(llama-cpp-python on the model's GGUF source), llama.cpp-q8_0, llama.cpp-q4_0, "
        "llama.cpp-q4_1 (a GGUF made by llama.cpp's converter, --llama-cpp-src); optional "
        "packages",
    )
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens per stream")
    p.add_argument("--prefill-tokens", type=int, default=500, help="long prompt's tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument(
        "--spinning",
        action="store_true",
        help="attnserve's ONNX Runtime threads spin between nodes (as GenAI's do by default)",
    )
    p.add_argument(
        "--read-rate-mb",
        type=int,
        default=512,
        help="MB that --threads threads read to measure the machine's memory read rate, which "
        "the report sets each runtime's decode GB/s against (0: not measured)",
    )
    p.add_argument("--output-dir", type=Path, default=None, help="write NAME.json/.md here")
    p.add_argument("--name", default="bench-lm", help="file name stem in --output-dir")
    p.add_argument(
        "--workload",
        action="store_true",
        help="instead: a mixed closed-loop workload through the scheduler per batching mode",
    )
    p.add_argument("--modes", default="static,continuous", help="--workload: batching modes")
    p.add_argument(
        "--clients",
        default=None,
        help="--workload, --http: concurrent requests (default 16,64); --json-schema: 1,16",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="--workload: per setting")
    p.add_argument(
        "--variant",
        default=DEFAULT_VARIANT,
        help="--workload, --http, --attention, --json-schema: ONNX variant",
    )
    p.add_argument(
        "--http",
        action="store_true",
        help="instead: streaming chat through HTTP per server (--servers) and client count",
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="instead: --variant's step graph with ONNX Runtime's GroupQueryAttention against "
        "plain attention over a padded cache (decoding steps at --rows, and the prefill)",
    )
    p.add_argument("--rows", default="1,16,64", help="--attention: rows a step")
    p.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="instead: chat requests through the scheduler under this JSON schema's grammar "
        "and, on the same prompts with as many tokens, free, at --clients (--max-tokens each)",
    )
    p.add_argument("--requests", type=int, default=None, help="--json-schema: requests per run")
    p.add_argument(
        "--servers",
        default=SERVERS_DEFAULT,
        help="--http: servers to start in turn: attnserve, attnserve-ray (--threads replicas of "
        "one thread on Ray Serve), attnserve-ray-one (one replica behind Serve's proxy), "
        "llama-server, llama-cpp-python (llama.cpp's run the model's GGUF source); "
        "--conversations: default attnserve,attnserve-no-cache",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="--http: max_tokens per request; --json-schema: max_new_tokens",
    )
    p.add_argument("--server-bin", type=Path, default=None, help="--http: llama-server binary")
    p.add_argument(
        "--conversations",
        action="store_true",
        help="--http: instead, --users conversations of --turns turns behind one system prompt "
        "of --system-tokens (servers: attnserve, attnserve-no-cache, llama-server)",
    )
    p.add_argument("--users", type=int, default=16, help="--conversations: concurrent users")
    p.add_argument("--turns", type=int, default=4, help="--conversations: turns per user")
    p.add_argument(
        "--system-tokens", type=int, default=1000, help="--conversations: system prompt's tokens"
    )
    p.add_argument(
        "--work-dir", type=Path, default=None,
        help="--http: servers' logs (default loadtest/results/bench-lm-http); --attention: the "
        "graph with the attention the model was not exported with (default MODEL/bench)",
    )  # fmt: skip
    p.set_defaults(func=cmd_bench_lm)


def cmd_bench_lm(args: argparse.Namespace) -> int:
    import sys

    from attnserve.bench.lm import bench_lm, markdown, write_report
    from attnserve.provision import ensure_model_dir
    from attnserve.training.perplexity import held_out_chapters

    if args.shape is not None:
        args.model = _shape_model(args)
    ensure_model_dir(args.model)  # the default language model imported on first use
    if args.prepare_only:
        return _prepare_peers(args)
    if args.workload:
        return _workload(args)
    if args.http and args.conversations:
        return _conversations(args)
    if args.http:
        return _chat_http(args)
    if args.attention:
        return _attention(args)
    if args.json_schema is not None:
        return _structured(args)
    results = bench_lm(
        args.model,
        [v.strip() for v in args.variants.split(",") if v.strip()],
        peers=[v.strip() for v in args.peers.split(",") if v.strip()],
        new_tokens=args.new_tokens,
        prefill_tokens=args.prefill_tokens,
        repeats=args.repeats,
        threads=args.threads,
        spinning=args.spinning,
        long_text=" ".join(held_out_chapters()),
        llama_cpp_src=args.llama_cpp_src,
        read_rate_megabytes=args.read_rate_mb,
    )
    sys.stdout.write(markdown(results))
    if args.output_dir is not None:
        spin = ", spinning" if args.spinning else ""
        model_name = f"{args.shape} shape" if args.shape is not None else args.model.name
        title = (
            f"{model_name}: {args.new_tokens} greedy tokens after a chat prompt, "
            f"{args.threads} thread(s){spin}, median of {args.repeats}"
        )
        write_report(results, args.output_dir, args.name, title)
    return 0


def _shape_model(args: argparse.Namespace) -> Path:
    """--shape's model directory, made when missing (attnserve/bench/lm_shapes.py)."""
    from attnserve.bench.lm_shapes import get_shape, prepare_shape

    root = (args.shape_dir or Path("models") / args.shape).resolve()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.workload or args.http or args.attention or args.json_schema is not None:
        variants = [args.variant]
    return prepare_shape(get_shape(args.shape), root, variants, llama_cpp_src=args.llama_cpp_src)


def _prepare_peers(args: argparse.Namespace) -> int:
    """--prepare-only: each of --peers' files made (or found), one line each."""
    import logging

    from attnserve.bench.lm_peers import PeerUnavailable, peer_path

    for name in (p.strip() for p in args.peers.split(",") if p.strip()):
        try:
            print(f"{name}: {peer_path(args.model, name, args.llama_cpp_src)}")
        except PeerUnavailable as exc:
            logging.getLogger(__name__).warning("%s: %s", name, exc)
    print(f"attnserve: {args.model}")
    return 0


def _clients(args: argparse.Namespace, default: str) -> list[int]:
    return [int(c) for c in (args.clients or default).split(",") if c.strip()]


def _structured(args: argparse.Namespace) -> int:
    import sys

    from attnserve.bench.lm_structured import (
        bench_structured,
        read_schema,
        structured_markdown,
        write_structured_report,
    )

    results = bench_structured(
        args.model,
        read_schema(args.json_schema),
        _clients(args, "1,16"),
        requests=args.requests,
        max_new_tokens=args.max_tokens,
        repeats=args.repeats,
        variant=args.variant,
        threads=args.threads,
    )
    sys.stdout.write(structured_markdown(results))
    if args.output_dir is not None:
        write_structured_report(results, args.output_dir, args.name)
    return 0


def _chat_http(args: argparse.Namespace) -> int:
    import sys

    from attnserve.bench.lm_http import bench_chat_http, chat_markdown, write_chat_report

    results = bench_chat_http(
        args.model,
        [s.strip() for s in args.servers.split(",") if s.strip()],
        _clients(args, "16,64"),
        threads=args.threads,
        seconds=args.seconds,
        max_tokens=args.max_tokens,
        server_bin=args.server_bin,
        variant=args.variant,
        spinning=args.spinning,
        work_dir=args.work_dir or Path("loadtest/results/bench-lm-http"),
    )
    sys.stdout.write(chat_markdown(results))
    if args.output_dir is not None:
        title = (
            f"{args.model.name}: streaming chat, max_tokens {args.max_tokens}, "
            f"{args.threads} thread(s) per server, {args.seconds:.0f} s per setting"
        )
        write_chat_report(results, args.output_dir, args.name, title)
    return 0


def _conversations(args: argparse.Namespace) -> int:
    import sys

    from attnserve.bench.lm_conversations import (
        bench_conversations,
        conversations_markdown,
        write_conversations_report,
    )

    servers = args.servers if args.servers != SERVERS_DEFAULT else "attnserve,attnserve-no-cache"
    results = bench_conversations(
        args.model,
        [s.strip() for s in servers.split(",") if s.strip()],
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
        threads=args.threads,
        server_bin=args.server_bin,
        variant=args.variant,
        work_dir=args.work_dir or Path("loadtest/results/bench-lm-conversations"),
    )
    sys.stdout.write(conversations_markdown(results))
    if args.output_dir is not None:
        write_conversations_report(results, args.output_dir, args.name)
    return 0


def _attention(args: argparse.Namespace) -> int:
    import sys

    from attnserve.bench.lm_attention import (
        attention_markdown,
        compare_attention,
        write_attention_report,
    )
    from attnserve.provision import Runtime, provision

    provision(args.model, Runtime(variant=args.variant))  # the graph compared with its twin

    results = compare_attention(
        args.model,
        args.variant,
        args.work_dir or args.model / "bench",
        rows=[int(r) for r in args.rows.split(",") if r.strip()],
        prefill_tokens=args.prefill_tokens,
        threads=args.threads,
        repeats=args.repeats,
    )
    sys.stdout.write(attention_markdown(results))
    if args.output_dir is not None:
        write_attention_report(results, args.output_dir, args.name)
    return 0


def _workload(args: argparse.Namespace) -> int:
    import json
    import sys
    from dataclasses import asdict

    from attnserve.bench.lm import mixed_workload, workload_markdown, write_workload_chart
    from attnserve.bench.report import write_table

    results = []
    for clients in _clients(args, "16,64"):
        for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
            result = mixed_workload(
                args.model, mode, clients, variant=args.variant, seconds=args.seconds,
                threads=args.threads,
            )  # fmt: skip
            print(json.dumps(asdict(result)), file=sys.stderr)
            results.append(result)
    sys.stdout.write(workload_markdown(results))
    if args.output_dir is not None:
        rows = [asdict(r) for r in results]
        write_table(args.output_dir, args.name, rows, workload_markdown(results))
        title = f"{Path(args.model).name} {args.variant}: mixed workload, batching modes"
        write_workload_chart(results, Path(args.output_dir) / f"{args.name}.png", title)
    return 0


def _add_bench_http(sub: Any) -> None:
    from attnserve.bench.http import cmd_bench_http, concurrency_levels

    p = sub.add_parser(
        "bench-http",
        help="the service at saturation vs offline translate, continuous vs request batching",
    )
    p.add_argument("--model", type=Path, default=default_model_dir())
    p.add_argument("--variant", default=DEFAULT_VARIANT)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (both sides)")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de", help="(multi-target models)")
    p.add_argument("--sentences", type=int, default=256, help="sentences per pass")
    p.add_argument("--mixed", action="store_true", help="alternate short and long sentences")
    p.add_argument("--max-chars", type=int, default=0, help="skip longer sentences (0: none)")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="offline sentences per batch")
    p.add_argument(
        "--concurrency",
        type=concurrency_levels,
        default=[64],
        help="clients with a request out; a ladder: 4,8,16,64 (each level runs every repeat)",
    )
    p.add_argument(
        "--modes",
        default="continuous,request",
        help="servers to compare: continuous, request, static, or LABEL=SERVE FLAGS (e.g. "
        "'always=--max-join-padding 100000')",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more `attnserve serve` flags, quoted")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="drive each mode's scheduler directly (no HTTP, no server processes) on the "
        "offline backend (--variant, --threads); the modes' scheduler flags apply, backend "
        "flags do not",
    )
    p.add_argument("--output-dir", type=Path, default=None, help="write NAME.jsonl and NAME.md")
    p.add_argument("--name", default="http")
    p.set_defaults(func=cmd_bench_http)


def _add_loadtest(sub: Any) -> None:
    from attnserve.loadtest.runner import cmd_loadtest
    from attnserve.loadtest.traffic import DEFAULT_BEAMS, DEFAULT_WEIGHTS, MIXES, TrafficConfig

    p = sub.add_parser(
        "loadtest", help="HTTP load test with locust: a ladder of user counts, report and plots"
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--model",
        type=Path,
        default=default_model_dir(),
        help="model directories to serve, comma-separated (a language model gets chat traffic)",
    )
    target.add_argument("--host", default=None, help="a running server, e.g. http://host:8000")
    p.add_argument("--users", default="1,2,4,8,16,32", help="the ladder of concurrent users")
    p.add_argument("--stage-seconds", type=float, default=30.0, help="locust run time per stage")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"), help="results root")
    p.add_argument(
        "--variant", default=DEFAULT_VARIANT, help="served ONNX variant (without --host)"
    )
    p.add_argument("--threads", type=int, default=None, help="server intra-op threads")
    p.add_argument("--serve-args", default="", help="more `attnserve serve` flags, quoted")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /readyz")
    defaults = TrafficConfig()
    p.add_argument("--weights", default="", help=f"users per shape, default {DEFAULT_WEIGHTS}")
    p.add_argument("--beams", default="", help=f"beam size per shape, default {DEFAULT_BEAMS}")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="texts per batch")
    p.add_argument("--deadline-ms", type=int, default=defaults.deadline_ms, help="timeout_ms")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--sentences", type=Path, default=None, help="TSV with en/de columns")
    p.add_argument("--max-chars", type=int, default=0, help="skip longer sentences (0: none)")
    p.add_argument("--wait-seconds", type=float, default=0.0, help="think time 0..N per user")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mix",
        choices=MIXES,
        default="requests",
        help="requests: each request's shape drawn by the weights (every stage sends the same "
        "mix); users: one shape per user, users split by weight",
    )
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="accept empty translations (random test models may end at once)",
    )
    p.add_argument("--title", default=None, help="what was tested, for the plots")
    p.set_defaults(func=cmd_loadtest)
