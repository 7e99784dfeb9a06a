"""`TrainConfig`: everything a training run depends on, and its command-line flags (no torch)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainConfig:
    """Everything a training run depends on (saved in its checkpoint)."""

    data_dir: str = "data"
    spm_model: str = "data/spm.model"
    run_dir: str = "runs/ende-small"
    preset: str = "small"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 4096  # padded tokens per micro-batch: rows * max(source, target) length
    accum_steps: int = 1
    lr: float = 7e-4
    warmup_steps: int = 2000
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    max_len: int = 160  # longer examples (in pieces) are skipped
    max_steps: int = 0  # 0: no step limit
    max_hours: float = 0.0  # 0: no time limit for this invocation
    checkpoint_minutes: float = 10.0
    eval_every: int = 1000  # steps between dev BLEU evaluations; 0: never
    dev_sentences: int = 100  # per direction
    log_every: int = 50
    bf16: bool | None = None  # None: autocast to bf16 where the CPU computes bf16 natively
    threads: int = 0  # per worker; 0: torch's default (one worker), the CPUs shared out (more)
    # Processes training the model data-parallel (training/distributed.py): each takes every
    # N-th row of each batch, so an update is the same whatever N (dropout's masks aside).
    workers: int = 1
    seed: int = 1
    resume: bool = False
    # Warm start: a model directory (config.json + model.safetensors + spm.model) whose weights
    # replace the initialisation; the optimizer and schedule start fresh. Its config must match
    # this run's but for the vocabulary size, the dropout rates and, in a pre-LN model, more
    # encoder / decoder layers: a source on other pieces has its vocabulary tables moved to this
    # run's (vocab.py); new layers go on top and start as the identity (train.grow_layers).
    init_from: str = ""
    # The learning-rate schedule goes on as if this many updates had been made already (with
    # --init-from, the step of those weights): the warmup rises to the rate of update
    # offset + warmup, not to the peak.
    schedule_offset: int = 0
    # The last N updates up to --max-steps take the learning rate linearly down towards zero
    # (a cool-down: a run resumed with --max-steps and --cooldown-steps ends on it); 0: none.
    cooldown_steps: int = 0
    compile: bool = False  # torch.compile the training forward pass
    # How often each training set's examples are in an epoch, by the manifest's set name
    # (`train`: the Bible and Ding phrases; `train.en-de`: extra English versions;
    # `modern-train`; `phrases`: a course's everyday phrases; `ding-terms`): 1 where not
    # named; the fraction of a weight draws a new seeded subset of the set each epoch. Fixed
    # for a run (a resume refuses others).
    set_weights: dict[str, float] = field(default_factory=dict)
    # The weights at each of the last N dev evaluations (RUN/snapshots/), for `attnserve
    # package --average N`; 0: none.
    keep_snapshots: int = 5


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per TrainConfig field (`--model-overrides` takes JSON)."""
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(TrainConfig(), f.name)
        if isinstance(default, bool) or "bool" in str(f.type):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, dict):
            parser.add_argument(flag, type=json.loads, default=default, help="JSON object")
        else:
            parser.add_argument(flag, type=type(default), default=default)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that `add_train_arguments` flags describe."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
