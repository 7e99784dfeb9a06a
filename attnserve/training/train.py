"""Training one model for both directions: teacher forcing, label smoothing, AdamW + inverse-sqrt.

A run directory holds `checkpoint.pt` (everything `resume` needs: model, optimizer, scheduler,
step, data position, RNG states), `best.pt` (the weights with the best dev BLEU) and `train.log`.

bf16 autocast is on where the CPU computes bf16 natively (AMX or AVX-512 bf16; `bf16=None`), where
it is faster at no measurable cost in loss; AdamW uses its fused kernel. `compile=True` wraps the
forward pass in `torch.compile` (dynamic shapes: batches vary in length). What each measured is in
docs/BENCHMARKS.md ("Tried and not kept") and the model card.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch
import torch.nn.functional as F

from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import Tokenizer
from attnserve.model.transformer import EncoderDecoder
from attnserve.training.batching import (
    Batch,
    Examples,
    collate,
    load_train_examples,
    make_batches,
    read_lines,
)
from attnserve.training.config import TrainConfig
from attnserve.training.data import Manifest
from attnserve.training.distributed import ALONE, Group, pin, rank_seed, workers
from attnserve.training.evaluate import dev_bleu
from attnserve.training.vocab import same_pieces, transfer_state_dict, vocabulary_map

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
SNAPSHOTS = "snapshots"  # the weights at the last dev evaluations: step-00012000.pt
# Model config fields `--init-from` lets differ from the packaged model's.
DROPOUT_FIELDS = ("dropout", "attention_dropout", "activation_dropout")
# ... and the depths it may grow (new layers on top start as the identity: `grow_layers`).
LAYER_FIELDS = ("encoder_layers", "decoder_layers")
# A pre-LN layer's sublayer outputs: zeroed, the layer passes its input through unchanged.
SUBLAYER_OUTPUTS = ("self_attn.out_proj.", "encoder_attn.out_proj.", "ffn.fc2.")


# A step longer than this means the process was stopped (SIGSTOP, a suspended machine).
MAX_STEP_SECONDS = 120.0


@dataclass
class TrainState:
    """Progress that a checkpoint restores besides the tensors."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    tokens: int = 0
    seconds: float = 0.0
    best_bleu: float = -1.0
    history: list[dict[str, float]] = field(default_factory=list)
    # A warm start's source (`init_from`): its path, updates, hours and dev history, recorded
    # when its weights were copied, so that packaging continues its history.
    warm_start: dict[str, Any] | None = None


def inverse_sqrt(warmup_steps: int, offset: int = 0, end: int = 0, cooldown: int = 0) -> Any:
    """LR multiplier: linear warmup to 1 at `warmup_steps`, then sqrt(warmup / step).

    With an `offset` the decay goes on from update `offset` (a warm start from weights trained
    that far): the fresh optimizer warms up over `warmup_steps` to the rate of update
    `offset + warmup_steps` instead of to the peak, then decays as the first run would have.
    With a `cooldown` the last `cooldown` updates up to update `end` take the rate linearly
    down towards zero: N/(N+1) of the schedule's rate for the first, 1/(N+1) for the last (the
    optimizer takes the factor of update k - 1 for update k)."""
    if cooldown and not 0 < cooldown <= end:
        raise ValueError(f"a cool-down of {cooldown} updates needs an end at or after it")

    def factor(step: int) -> float:
        step = max(step, 1)
        rate = min(step / warmup_steps, 1.0) * math.sqrt(
            warmup_steps / max(step + offset, warmup_steps)
        )
        if cooldown:
            rate *= min(max(end - step, 0) / (cooldown + 1), 1.0)
        return rate

    return factor


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AMX or AVX-512 bf16; Linux /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset with overrides, its vocabulary sized to the SentencePiece model."""
    return ModelConfig.preset(cfg.preset, **{**cfg.model_overrides, "vocab_size": vocab_size})


def loss_sum(
    model: Any, batch: Batch, label_smoothing: float, bf16: bool, pad_id: int
) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over the batch's target tokens.

    `model` is an EncoderDecoder or its torch.compile wrapper.
    """
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(batch.src_ids, batch.src_mask, batch.tgt_in, batch.tgt_mask)
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        batch.labels.flatten(),
        ignore_index=pad_id,
        label_smoothing=label_smoothing,
        reduction="sum",
    )


def dev_loss(model: EncoderDecoder, examples: Examples, max_tokens: int, bf16: bool) -> float:
    """Teacher-forced cross-entropy (nats per target token, no smoothing) of `examples`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for indices in make_batches(examples, max_tokens, seed=0, epoch=0):
                m = model.config
                batch = collate(examples, indices, m.pad_id, m.start_id)
                total += float(loss_sum(model, batch, 0.0, bf16, m.pad_id))
                count += batch.num_target_tokens
    finally:
        model.train(was_training)
    return total / max(count, 1)


# Dev splits evaluated during training: the Bible's, and the modern text's where the data has it
# (`attnserve data build` with the modern sources), its scores' keys suffixed `_modern`.
DEV_SPLITS = (("dev", ""), ("modern-dev", "_modern"))


def dev_splits(data_dir: Path) -> list[tuple[str, str]]:
    return [(s, x) for s, x in DEV_SPLITS if (data_dir / f"{s}.en").is_file()]


def dev_examples(data_dir: Path, tokenizer: Tokenizer, max_len: int) -> dict[str, Examples]:
    """The dev splits as examples, one set per direction (`ende`, `deen`, `ende_modern`...)."""
    examples: dict[str, Examples] = {}
    for split, suffix in dev_splits(data_dir):
        for src, tgt in (("en", "de"), ("de", "en")):
            ex = Examples()
            ex.add(
                tokenizer,
                read_lines(data_dir / f"{split}.{src}"),
                read_lines(data_dir / f"{split}.{tgt}"),
                tgt,
                max_len,
            )
            examples[src + tgt + suffix] = ex
    return examples


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Trainer:
    """Owns the model, optimizer, scheduler, data and progress of one run."""

    def __init__(self, cfg: TrainConfig, group: Group = ALONE) -> None:
        self.cfg = cfg
        self.group = group
        self.bf16 = cpu_has_bf16() if cfg.bf16 is None else cfg.bf16
        self.run_dir = Path(cfg.run_dir)
        self.tokenizer = Tokenizer.from_spm(cfg.spm_model)
        self.model_config = model_config(cfg, self.tokenizer.vocab_size)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.model = EncoderDecoder(self.model_config)
        warm: dict[str, Any] | None = None
        if cfg.init_from and not self.checkpoint_path.exists():  # a resumed run has its own
            transfer, grown = self._init_from(Path(cfg.init_from))
            warm = source_training(cfg.init_from)
            if transfer is not None:
                warm["vocabulary"] = transfer
            if grown is not None:
                warm["layers"] = grown
        group.share_weights(self.model)
        if not group.leader:  # dropout masks of its own
            torch.manual_seed(rank_seed(cfg.seed, 0, group.rank))
        self.forward = torch.compile(self.model, dynamic=True) if cfg.compile else self.model
        decay = [p for n, p in self.model.named_parameters() if p.dim() > 1 and "embed" not in n]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() <= 1 or "embed" in n]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(0.9, 0.98),
            eps=1e-9,
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            inverse_sqrt(cfg.warmup_steps, cfg.schedule_offset, cfg.max_steps, cfg.cooldown_steps),
        )
        self.state = TrainState(warm_start=warm)
        self.dev_examples: dict[str, Examples] | None = None
        manifest = Manifest.load(Path(cfg.data_dir) / "manifest.json")
        self.examples: Examples = load_train_examples(
            Path(cfg.data_dir), self.tokenizer, manifest.train_sets, cfg.max_len, cfg.set_weights
        )
        log.info(
            "%d training examples (%d too long skipped); model %s, %.1fM parameters",
            len(self.examples), self.examples.skipped_too_long, cfg.preset,
            self.model.num_parameters() / 1e6,
        )  # fmt: skip

    def _init_from(
        self, directory: Path
    ) -> tuple[dict[str, int] | None, dict[str, list[int]] | None]:
        """Copy the weights of a model directory into the fresh model (same architecture;
        the dropout rates may differ: they are not weights, and fine-tuning often changes them).
        A run with another SentencePiece model gets the source's vocabulary tables moved to its
        own (training/vocab.py); a deeper run (more encoder or decoder layers, pre-LN) gets
        the source's layers and new ones on top that start as the identity (`grow_layers`).
        Returns how the vocabulary rows were made and which depths grew (None where not)."""
        from attnserve.model.checkpoint import load_model_dir

        source, _ = load_model_dir(directory)
        theirs, ours = source.config.to_dict(), self.model_config.to_dict()
        depths = {name: (theirs[name], ours[name]) for name in LAYER_FIELDS}
        for config in (theirs, ours):
            for name in (*DROPOUT_FIELDS, *LAYER_FIELDS, "vocab_size"):
                config.pop(name, None)
        if theirs != ours:
            raise ValueError(f"{directory}: config.json differs from this run's model config")
        grown = {name: [old, new] for name, (old, new) in depths.items() if old != new}
        if any(new < old for old, new in grown.values()):
            raise ValueError(f"{directory}: has more layers than this run's model ({grown})")
        if grown and self.model_config.norm_placement != "pre":
            raise ValueError(
                f"{directory}: new layers start as the identity only in a pre-LN model"
            )
        state = source.state_dict()
        old_spm, new_spm = directory / "spm.model", Path(self.cfg.spm_model)
        if not old_spm.exists():
            raise ValueError(f"{directory}: no spm.model to compare this run's vocabulary with")
        old_pieces = spm.SentencePieceProcessor(model_file=str(old_spm))
        new_pieces = spm.SentencePieceProcessor(model_file=str(new_spm))
        if not same_pieces(old_pieces, new_pieces):
            if theirs.get("tgt_vocab_size") is not None:
                raise ValueError(f"{directory}: a new vocabulary needs a joint one")
            mapping = vocabulary_map(old_pieces, new_pieces)
            state = transfer_state_dict(state, mapping)
            transfer = mapping.summary()
            log.info(
                "new vocabulary (%d -> %d pieces): rows %s", source.config.vocab_size,
                self.model_config.vocab_size, transfer,
            )  # fmt: skip
        else:
            transfer = None
        if grown:
            state = grow_layers(state, self.model.state_dict(), grown)
            log.info("layers grown (new ones on top, as the identity): %s", grown)
        self.model.load_state_dict(state)
        log.info("weights initialised from %s", directory)
        return transfer, grown or None

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_NAME

    def save_checkpoint(self) -> None:
        """Everything needed to continue exactly where this run is now (every worker calls it;
        the leader writes it, with each worker's random state)."""
        rng = self.group.gather(_rng_state())
        self.group.check_in_step(self.model)
        if not self.group.leader:
            return
        _atomic_save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "state": dataclasses.asdict(self.state),
                "rng": rng[0],
                "rng_workers": rng,
                "train_config": dataclasses.asdict(self.cfg),
                "model_config": self.model_config.to_dict(),
            },
            self.checkpoint_path,
        )
        log.info("checkpoint at step %d -> %s", self.state.step, self.checkpoint_path)

    def load_checkpoint(self) -> None:
        ckpt = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        # Through ModelConfig: a checkpoint of older code lacks fields added since (defaults).
        if ModelConfig.from_dict(ckpt["model_config"]).to_dict() != self.model_config.to_dict():
            raise ValueError("checkpoint model config differs from this run's")
        # The saved data position (epoch, batch) indexes batches of the same example list only.
        saved_weights = ckpt["train_config"].get("set_weights") or {}
        if saved_weights != self.cfg.set_weights:
            raise ValueError(
                f"the run was trained with --set-weights {json.dumps(saved_weights)}, not "
                f"{json.dumps(self.cfg.set_weights)}: resume it with the same weights, or "
                "start a new run from its weights (package it, then --init-from)"
            )
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        # The next update's rate from this run's schedule, not the saved one's (a resume may
        # add a cool-down); the same number where the schedule did not change.
        for group, base, factor in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas,
            strict=True,
        ):  # fmt: skip
            group["lr"] = base * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.state = TrainState(**ckpt["state"])
        saved = ckpt.get("rng_workers") or [ckpt["rng"]]  # each worker's, in rank order
        if self.group.rank < len(saved):
            _set_rng_state(saved[self.group.rank])
        else:  # a worker more than the run had when it saved
            torch.manual_seed(rank_seed(self.cfg.seed, self.state.step, self.group.rank))
        log.info(
            "resumed from step %d (epoch %d, batch %d)",
            self.state.step,
            self.state.epoch,
            self.state.batch_in_epoch,
        )

    def save_best(self, scores: dict[str, float]) -> None:
        _atomic_save(
            {
                "model": self.model.state_dict(),
                "model_config": self.model_config.to_dict(),
                "dev": scores,
                # Where the weights are from (packaging reads these, not the latest checkpoint's).
                "step": self.state.step,
                "seconds": self.state.seconds,
                "history": list(self.state.history),
            },
            self.run_dir / "best.pt",
        )

    def micro_batches(self) -> Any:
        """Yield (epoch, batch index, example indices) from the saved data position onwards,
        forever (the whole batch: every worker reads the same stream)."""
        cfg, st = self.cfg, self.state
        epoch, first = st.epoch, st.batch_in_epoch
        while True:
            batches = make_batches(self.examples, cfg.max_tokens, cfg.seed, epoch)
            for i in range(first, len(batches)):
                yield epoch, i, batches[i]
            epoch, first = epoch + 1, 0

    def train_step(self, batches: list[np.ndarray]) -> float:
        """One optimizer step over `accum_steps` micro-batches (example indices; this worker
        trains on its rows of each); returns the loss per target token of the whole update."""
        n_target = sum(self.examples.target_tokens(indices) for indices in batches)
        m = self.model_config
        total = 0.0
        for indices in batches:
            rows = self.group.rows(indices)
            if not len(rows):
                continue
            batch = collate(self.examples, rows, m.pad_id, m.start_id)
            loss = loss_sum(self.forward, batch, self.cfg.label_smoothing, self.bf16, m.pad_id)
            loss = loss / n_target
            loss.backward()
            total += float(loss.detach())
        total = self.group.sum_gradients(self.model, total)
        if self.cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def evaluate(self) -> None:
        scores: dict[str, Any] = {}
        for split, suffix in dev_splits(Path(self.cfg.data_dir)):
            scores |= dev_bleu(
                self.model, self.tokenizer, Path(self.cfg.data_dir), self.cfg.dev_sentences,
                split, suffix,
            )  # fmt: skip
        if self.dev_examples is None:
            self.dev_examples = dev_examples(
                Path(self.cfg.data_dir), self.tokenizer, self.cfg.max_len
            )
        for direction, examples in self.dev_examples.items():
            loss = dev_loss(self.model, examples, self.cfg.max_tokens, self.bf16)
            scores[f"loss_{direction}"] = round(loss, 4)
        record = {"step": self.state.step, "hours": round(self.state.seconds / 3600, 3), **scores}
        self.state.history.append(record)
        bleus = [v for k, v in scores.items() if k.startswith("bleu_")]
        mean = sum(bleus) / len(bleus)
        if mean > self.state.best_bleu:
            self.state.best_bleu = mean
            self.save_best(scores)
        self.save_snapshot(record)
        log.info("dev %s (best mean %.2f)", json.dumps(record), self.state.best_bleu)

    def save_snapshot(self, record: dict[str, Any]) -> None:
        """The weights now and their dev `record`, as RUN/snapshots/step-N.pt; only the newest
        `keep_snapshots` stay."""
        if self.cfg.keep_snapshots <= 0:
            return
        directory = self.run_dir / SNAPSHOTS
        directory.mkdir(exist_ok=True)
        _atomic_save(
            {"model": self.model.state_dict(), "step": self.state.step, "dev": record},
            directory / f"step-{self.state.step:08d}.pt",
        )
        for old in snapshot_paths(self.run_dir)[: -self.cfg.keep_snapshots]:
            old.unlink()

    def run(self) -> TrainState:
        cfg, st = self.cfg, self.state
        self.model.train()
        stream = self.micro_batches()
        started = last_ckpt = last_log = step_start = time.monotonic()
        tokens_at_log, losses = st.tokens, []
        while not cfg.max_steps or st.step < cfg.max_steps:
            batches = []
            for _ in range(cfg.accum_steps):
                st.epoch, i, batch = next(stream)
                st.batch_in_epoch = i + 1
                batches.append(batch)
            losses.append(self.train_step(batches))
            st.step += 1
            st.tokens += sum(self.examples.tokens(indices) for indices in batches)
            now = time.monotonic()
            # Training time: the steps alone (dev evaluations and checkpoints are not counted),
            # and a step that took longer than MAX_STEP_SECONDS (the process was stopped) counts
            # for that much only.
            st.seconds += min(now - step_start, MAX_STEP_SECONDS)
            if st.step % cfg.log_every == 0:
                tok_s = (st.tokens - tokens_at_log) / max(now - last_log, 1e-9)
                log.info(
                    "step %d | epoch %d | loss %.3f | lr %.2e | %.0f tok/s | %.2f h",
                    st.step, st.epoch, sum(losses) / len(losses), self.scheduler.get_last_lr()[0],
                    tok_s, st.seconds / 3600,
                )  # fmt: skip
                last_log, tokens_at_log, losses = now, st.tokens, []
            if cfg.eval_every and st.step % cfg.eval_every == 0 and self.group.leader:
                self.evaluate()
                last_log += time.monotonic() - now  # keep evaluation out of tokens/s
            # On the leader's clock: every worker checkpoints and stops with it.
            checkpoint, stop = self.group.decide(
                now - last_ckpt >= cfg.checkpoint_minutes * 60,
                bool(cfg.max_hours) and now - started >= cfg.max_hours * 3600,
            )
            if checkpoint:
                self.save_checkpoint()
                last_ckpt = time.monotonic()
            if stop:
                log.info("time limit of %.2f h reached", cfg.max_hours)
                break
            step_start = time.monotonic()
        self.save_checkpoint()
        return st


def train(cfg: TrainConfig) -> TrainState:
    """Train (or with `cfg.resume`, continue) the run in `cfg.run_dir`; returns its final state."""
    run_dir = Path(cfg.run_dir)
    if cfg.cooldown_steps < 0 or cfg.cooldown_steps > cfg.max_steps:
        raise ValueError(
            f"--cooldown-steps {cfg.cooldown_steps}: give 0 (none) or a number of updates up to "
            f"--max-steps ({cfg.max_steps}), the update the cool-down ends on"
        )
    if cfg.workers < 1:
        raise ValueError(f"--workers {cfg.workers}: give 1 (one process) or more")
    if (run_dir / CHECKPOINT_NAME).exists() and not cfg.resume:
        raise FileExistsError(
            f"{run_dir / CHECKPOINT_NAME} exists; resume it or pick a new run_dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    package_log = logging.getLogger("attnserve")
    old_level = package_log.level
    if not package_log.isEnabledFor(logging.INFO):
        package_log.setLevel(logging.INFO)
    package_log.addHandler(handler)
    try:
        with workers(cfg) as group:
            return train_worker(cfg, group)
    finally:
        package_log.removeHandler(handler)
        package_log.setLevel(old_level)
        handler.close()


def train_worker(cfg: TrainConfig, group: Group = ALONE) -> TrainState:
    """This process's part of the run: all of it alone, or one worker's of `cfg.workers`."""
    cpus, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        threads = pin(group, cfg.threads)
        if threads:
            torch.set_num_threads(threads)
        trainer = Trainer(cfg, group)
        if trainer.checkpoint_path.exists():
            trainer.load_checkpoint()
        log.info(
            "config %s (bf16 autocast: %s, %d worker(s) of %d thread(s))",
            json.dumps(dataclasses.asdict(cfg)), trainer.bf16, group.size, torch.get_num_threads(),
        )  # fmt: skip
        return trainer.run()
    finally:  # the calling process as it was (a benchmark or a test trains several runs)
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads_before)


def snapshot_paths(run_dir: str | Path) -> list[Path]:
    """A run's weight snapshots, oldest first."""
    return sorted((Path(run_dir) / SNAPSHOTS).glob("step-*.pt"))


def average_snapshots(
    run_dir: str | Path, count: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The mean of the newest `count` snapshots' weights (float32), and their dev records
    (``{"step": N}`` alone for snapshots of older runs, which saved none), oldest first."""
    paths = snapshot_paths(run_dir)[-count:]
    if count < 1 or len(paths) < count:
        raise ValueError(f"{run_dir}: {len(paths)} snapshots in {SNAPSHOTS}/, {count} wanted")
    total: dict[str, torch.Tensor] = {}
    records = []
    for path in paths:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
        records.append(snapshot.get("dev") or {"step": int(snapshot["step"])})
        for name, tensor in snapshot["model"].items():
            total[name] = total.get(name, 0) + tensor.double()
    return {name: (t / len(paths)).float() for name, t in total.items()}, records


def export_model_dir(
    run_dir: str | Path, out_dir: str | Path, which: str = "best", average: int = 0
) -> Path:
    """Write `best.pt` (or `which="checkpoint"`) of a run as a model directory; `average` N:
    the mean of the weights at the last N dev evaluations (snapshots) instead.

    A warm-started run (`init_from`) goes on from its source model's training: the metadata
    counts the source's updates and hours before the run's own, and its dev history comes
    after the source's. The run records its source's training when it starts; for a run that
    did not (older code), the source's metadata.json is read where `init_from` points
    (relative paths from the current directory)."""
    from attnserve.model.checkpoint import save_model_dir

    run = Path(run_dir)
    ckpt = torch.load(run / CHECKPOINT_NAME, map_location="cpu", weights_only=False)
    saved = (
        ckpt if average else torch.load(run / f"{which}.pt", map_location="cpu", weights_only=False)
    )
    model = EncoderDecoder(ModelConfig.from_dict(saved["model_config"]))
    averaged: list[dict[str, Any]] = []
    if average:
        weights, averaged = average_snapshots(run, average)
        model.load_state_dict(weights)
    else:
        model.load_state_dict(saved["model"])
    # The step, time and dev history of the weights written: best.pt records its own (older
    # best.pt files do not: then the latest checkpoint's, which may be later than the weights);
    # snapshots: the newest one's dev record (the dev scores only for one snapshot: a mean of
    # several was not evaluated in training), completing the checkpoint's history, which may
    # be older.
    state = saved if "step" in saved else ckpt["state"]
    steps, hours = state["step"], round(state["seconds"] / 3600, 3)
    history, dev = state["history"], saved.get("dev")
    averaged_steps = [int(r["step"]) for r in averaged]
    if averaged:
        newest = averaged[-1]
        steps = averaged_steps[-1]
        history = [h for h in history if h["step"] < steps]
        at = (
            newest
            if "hours" in newest
            else next((h for h in state["history"] if h["step"] == steps), None)
        )
        if at is not None:
            history.append(at)
            hours = at["hours"]
        dev = at if at is not None and len(averaged) == 1 else None
    warm = ckpt["state"].get("warm_start") or warm_start(ckpt["train_config"])
    if warm is not None:
        steps += warm["steps"]
        hours = round(hours + warm["hours"], 3)
        history = warm["dev_history"] + [_after(record, warm) for record in history]
        dev = _after(dev, warm) if dev is not None else None
        averaged_steps = [step + warm["steps"] for step in averaged_steps]
    metadata = {
        "train_config": ckpt["train_config"],
        "steps": steps,
        "train_hours": hours,
        "dev_history": history,
        "dev": dev,
        "averaged_steps": averaged_steps,
        "warm_start": None
        if warm is None
        else {k: warm[k] for k in ("from", "steps", "hours", "vocabulary", "layers") if k in warm},
        "vocabulary_changes": warm_changes(warm, "vocabulary_changes", "vocabulary"),
        "layer_changes": warm_changes(warm, "layer_changes", "layers"),
        # Serving defaults (Hugging Face generation-config keys): beam 4, as the model card's
        # scores are measured.
        "generation": {"num_beams": 4},
    }
    tokenizer = Tokenizer.from_spm(ckpt["train_config"]["spm_model"])
    return save_model_dir(model.eval(), tokenizer, out_dir, extra_metadata=metadata)


def grow_layers(
    source: dict[str, torch.Tensor],
    fresh: dict[str, torch.Tensor],
    grown: dict[str, list[int]],
) -> dict[str, torch.Tensor]:
    """A deeper model's weights from a shallower one's: the source's layers where they were,
    the new layers on top with the fresh model's random weights except their sublayers' output
    projections, zeroed. In a pre-LN layer (x + f(norm(x))) those make every sublayer add zero,
    so the grown model computes exactly what the source did, and training starts from there
    (the zeroed projections get gradients at once; the rest of a new layer from the update
    after). `grown` maps a depth field ("decoder_layers") to [old, new] layer counts."""
    state = dict(source)
    for stack, (old, new) in grown.items():  # the model's layer lists bear the fields' names
        for index in range(old, new):
            prefix = f"{stack}.{index}."
            layer = {k: v for k, v in fresh.items() if k.startswith(prefix)}
            if not layer:
                raise ValueError(f"the model has no {prefix[:-1]} to grow into")
            for name, tensor in layer.items():
                sublayer = name[len(prefix) :]
                zero = any(sublayer.startswith(out) for out in SUBLAYER_OUTPUTS)
                state[name] = torch.zeros_like(tensor) if zero else tensor.clone()
    return state


def source_training(source: str | Path) -> dict[str, Any]:
    """What a model directory's metadata.json says of its training: updates, hours, dev
    history (zeros and none, with a warning, where it has no metadata: e.g. an imported model)."""
    from attnserve.model.checkpoint import read_metadata

    meta = read_metadata(source)
    if not meta:
        log.warning("%s has no training metadata: its updates and hours count as 0", source)
    return {
        "from": str(source),
        "steps": int(meta.get("steps") or 0),
        "hours": float(meta.get("train_hours") or 0.0),
        "dev_history": list(meta.get("dev_history") or []),
        "vocabulary_changes": list(meta.get("vocabulary_changes") or []),
        "layer_changes": list(meta.get("layer_changes") or []),
    }


def warm_changes(warm: dict[str, Any] | None, recorded: str, own: str) -> list[dict[str, Any]]:
    """Where the model's training changed it, with the update and hour: its sources' changes
    (metadata key `recorded`: "vocabulary_changes", a move to other pieces with how the rows
    were made; "layer_changes", a growth with each depth's [old, new] layer counts), then its
    own run's (warm-start key `own`: "vocabulary", "layers")."""
    if warm is None:
        return []
    changes = list(warm.get(recorded) or [])
    if warm.get(own):
        changes.append({"step": warm["steps"], "hours": warm["hours"], **warm[own]})
    return changes


def warm_start(train_config: dict[str, Any]) -> dict[str, Any] | None:
    """The training of the model a run was warm-started from (`init_from`), read now (for runs
    that did not record it when they started); None for a run from scratch."""
    source = train_config.get("init_from") or ""
    if not source:
        return None
    if not Path(source).is_dir():
        raise FileNotFoundError(
            f"{source}: the run was warm-started from it and did not record its training; "
            "package the run from the directory it was started in"
        )
    return source_training(source)


def _after(record: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """A dev record of a warm-started run, on the source's step and hour scale (best.pt's dev
    scores have no step or hours: they stay as they are)."""
    shifted = dict(record)
    if "step" in record:
        shifted["step"] = int(record["step"]) + warm["steps"]
    if "hours" in record:
        shifted["hours"] = round(float(record["hours"]) + warm["hours"], 3)
    return shifted
