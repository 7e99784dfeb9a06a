"""Training on a tiny synthetic corpus: the loss falls, resume continues exactly, export loads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import Translator
from attnserve.model.tokenizer import Tokenizer
from attnserve.training.batching import Examples, collate, make_batches
from attnserve.training.data import Pairing, build_corpus
from attnserve.training.spm import train_sentencepiece
from attnserve.training.train import (
    TrainConfig,
    Trainer,
    export_model_dir,
    inverse_sqrt,
    train,
)
from tests.training.tiny_corpus import write_synthetic_bible


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A built corpus (no Ding) and a joint spm trained on its training split."""
    root = tmp_path_factory.mktemp("corpus")
    db = write_synthetic_bible(root / "bible.db")
    data = root / "data"
    build_corpus(data, bible_db=db, ding_path=None, pairings=(Pairing("k", "e"),))
    spm_model = train_sentencepiece(
        [data / "train.en", data / "train.de"], data / "spm", 80, hard_vocab_limit=False, threads=1
    )
    return data, spm_model


def config(data: Path, spm_model: Path, run_dir: Path, **changes: object) -> TrainConfig:
    base = TrainConfig(
        data_dir=str(data), spm_model=str(spm_model), run_dir=str(run_dir), preset="tiny",
        max_tokens=400, lr=3e-3, warmup_steps=10, max_len=60, max_steps=6, eval_every=0,
        log_every=1, checkpoint_minutes=60.0, threads=1, bf16=False,
    )  # fmt: skip
    return TrainConfig(**{**base.__dict__, **changes})


def logged_losses(run_dir: Path) -> list[float]:
    text = (run_dir / "train.log").read_text()
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", text)]


def test_examples_and_batches(tiny_data: tuple[Path, Path]) -> None:
    _, spm_model = tiny_data
    tok = Tokenizer.from_spm(spm_model)
    examples = Examples()
    examples.add(tok, ["The man sees a house."], ["der Mann sieht ein Haus."], "de", max_len=60)
    assert examples.src[0][0] == tok.encode_source("x", "de")[0]  # the >>de<< tag comes first
    assert examples.src[0][-1] == tok.eos_id and examples.tgt[0][-1] == tok.eos_id
    batch = collate(
        examples, make_batches(examples, 100, seed=1, epoch=0)[0], tok.pad_id, tok.pad_id
    )
    assert batch.tgt_in[0, 0] == tok.pad_id  # decoder start = pad
    assert batch.tgt_in[0, 1:].tolist() == batch.labels[0, :-1].tolist()
    assert batch.labels[0, -1] == tok.eos_id


def test_set_weights_repeat_or_subsample_a_training_set(
    tiny_data: tuple[Path, Path], tmp_path: Path
) -> None:
    """--set-weights: 2 puts a set's examples in each epoch twice, 0.5 a seeded half drawn anew
    each epoch (the same for the same seed and epoch: a resume replays it); unnamed sets once;
    weight 1 is the unweighted order; an unknown set name or a weight <= 0 is refused."""
    from attnserve.training.batching import load_train_examples
    from attnserve.training.data import Manifest

    data, spm_model = tiny_data
    tok = Tokenizer.from_spm(spm_model)
    sets = Manifest.load(data / "manifest.json").train_sets
    n_first = len(load_train_examples(data, tok, sets, 60))

    def epoch(weights: dict[str, float], seed: int, epoch: int) -> list[int]:
        examples = load_train_examples(data, tok, sets, 60, weights)
        return sorted(examples.epoch_indices(seed, epoch).tolist())

    assert epoch({"train": 2.0}, 1, 0) == sorted(list(range(n_first)) * 2)
    half = epoch({"train": 0.5}, 1, 0)
    assert len(half) == round(n_first / 2) and len(set(half)) == len(half)
    assert half == epoch({"train": 0.5}, 1, 0)  # replayed
    assert half != epoch({"train": 0.5}, 1, 1)  # the next epoch draws another half
    assert half != epoch({"train": 0.5}, 2, 0)
    more = epoch({"train": 1.5}, 1, 0)
    assert len(more) == n_first + round(n_first / 2) and set(more) == set(range(n_first))
    one = load_train_examples(data, tok, sets, 60, {"train": 1.0})
    assert one.weights == [] and make_batches(one, 400, 1, 0)[0].tolist() == (
        make_batches(load_train_examples(data, tok, sets, 60), 400, 1, 0)[0].tolist()
    )
    # Two sets: only the named one is weighted, and batches hold each epoch's examples.
    for lang in ("en", "de"):
        lines = (data / f"train.{lang}").read_text(encoding="utf-8").splitlines()
        (tmp_path / f"train.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (tmp_path / f"extra.{lang}").write_text("\n".join(lines[:10]) + "\n", encoding="utf-8")
    two = [*sets, {"name": "extra", "directions": ["en-de"], "pairs": 10}]
    weighted = load_train_examples(tmp_path, tok, two, 60, {"extra": 2.5})
    assert weighted.weights == [(n_first, n_first + 10, 2.5)]
    batches = make_batches(weighted, 400, seed=1, epoch=0)
    drawn = sorted(np.concatenate(batches).tolist())
    extra = [i for i in drawn if i >= n_first]
    assert drawn[:n_first] == list(range(n_first)) and len(extra) == 25
    assert all(extra.count(i) in (2, 3) for i in range(n_first, n_first + 10))
    with pytest.raises(ValueError, match="training sets are"):
        load_train_examples(data, tok, sets, 60, {"modern-train": 2.0})
    with pytest.raises(ValueError, match="positive"):
        load_train_examples(data, tok, sets, 60, {"train": 0.0})


def test_a_resume_keeps_the_set_weights(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """The saved data position indexes one example list: other --set-weights are refused."""
    from attnserve.training.train import Trainer

    data, spm_model = tiny_data
    train(config(data, spm_model, tmp_path / "run", max_steps=2, set_weights={"train": 2.0}))
    with pytest.raises(ValueError, match="resume it with the same weights"):
        Trainer(config(data, spm_model, tmp_path / "run", resume=True)).load_checkpoint()
    again = Trainer(
        config(data, spm_model, tmp_path / "run", resume=True, set_weights={"train": 2.0})
    )
    again.load_checkpoint()
    assert again.state.step == 2


def test_batches_respect_the_token_budget_and_cover_every_example(
    tiny_data: tuple[Path, Path],
) -> None:
    data, spm_model = tiny_data
    tok = Tokenizer.from_spm(spm_model)
    examples = Examples()
    src = (data / "train.en").read_text().splitlines()
    tgt = (data / "train.de").read_text().splitlines()
    examples.add(tok, src, tgt, "de", max_len=60)
    batches = make_batches(examples, 200, seed=3, epoch=2)
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    for b in batches:
        longest = max(max(len(examples.src[i]), len(examples.tgt[i])) for i in b)
        assert len(b) == 1 or longest * len(b) <= 200
    again = make_batches(examples, 200, seed=3, epoch=2)
    assert all((a == b).all() for a, b in zip(batches, again, strict=True))


def test_inverse_sqrt_schedule() -> None:
    f = inverse_sqrt(100)
    assert f(50) == pytest.approx(0.5) and f(100) == 1.0 and f(400) == pytest.approx(0.5)
    # Continued from update 300: warms up to update 400's rate, then decays as from there on.
    g = inverse_sqrt(100, offset=300)
    assert g(50) == pytest.approx(0.5 * f(350)) and g(100) == pytest.approx(0.5)
    assert g(1200) == pytest.approx(f(1500))


def test_cooldown_lowers_the_rate_of_the_last_updates() -> None:
    f, g = inverse_sqrt(100, offset=300), inverse_sqrt(100, offset=300, end=1000, cooldown=199)
    assert all(g(s) == f(s) for s in (1, 50, 100, 500, 800))  # update s + 1's rate
    assert g(801) == pytest.approx(199 / 200 * f(801)) and g(999) == pytest.approx(f(999) / 200)
    assert g(1000) == 0.0 and g(1100) == 0.0
    for cooldown, end in ((100, 0), (100, 50)):
        with pytest.raises(ValueError, match="cool-down"):
            inverse_sqrt(100, end=end, cooldown=cooldown)


def update_rates(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The learning rate each update of the runs that follow takes (appended in order)."""
    rates: list[float] = []
    step = Trainer.train_step

    def recording(self: Trainer, batches: list[Any]) -> float:
        rates.append(self.optimizer.param_groups[0]["lr"])
        return step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", recording)
    return rates


def test_a_resumed_run_ends_on_a_cooldown(
    tiny_data: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped without one is resumed inside its cool-down (--max-steps and
    --cooldown-steps): each update after the resume takes the cooled rate, falling linearly."""
    data, spm_model = tiny_data
    rates, schedule = update_rates(monkeypatch), inverse_sqrt(10)
    train(config(data, spm_model, tmp_path / "run", max_steps=5))
    train(config(data, spm_model, tmp_path / "run", max_steps=7, cooldown_steps=3, resume=True))
    peak = [3e-3 * schedule(k) for k in range(7)]  # update k + 1's rate without a cool-down
    assert rates == pytest.approx([*peak[:5], peak[5] * 2 / 4, peak[6] / 4])
    rates.clear()  # the same cool-down in one go
    train(config(data, spm_model, tmp_path / "straight", max_steps=7, cooldown_steps=3))
    assert rates == pytest.approx([*peak[:4], peak[4] * 3 / 4, peak[5] * 2 / 4, peak[6] / 4])
    for steps, cooldown in ((0, 2), (4, 5), (4, -1)):
        with pytest.raises(ValueError, match=f"--cooldown-steps {cooldown}: give 0"):
            train(config(data, spm_model, tmp_path / "refused", max_steps=steps,
                         cooldown_steps=cooldown))  # fmt: skip
    assert not (tmp_path / "refused").exists()


def test_training_lowers_the_loss(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    data, spm_model = tiny_data
    state = train(config(data, spm_model, tmp_path / "run", max_steps=40))
    losses = logged_losses(tmp_path / "run")
    assert state.step == 40 and len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0


def test_resumed_run_continues_from_the_same_step(
    tiny_data: tuple[Path, Path], tmp_path: Path
) -> None:
    data, spm_model = tiny_data
    straight = train(config(data, spm_model, tmp_path / "a", max_steps=6, bf16=True))
    train(config(data, spm_model, tmp_path / "b", max_steps=3, bf16=True))
    with pytest.raises(FileExistsError):
        train(config(data, spm_model, tmp_path / "b", max_steps=6, bf16=True))
    resumed = train(config(data, spm_model, tmp_path / "b", max_steps=6, bf16=True, resume=True))
    assert "resumed from step 3" in (tmp_path / "b" / "train.log").read_text()
    assert resumed.step == straight.step == 6
    assert (resumed.epoch, resumed.batch_in_epoch) == (straight.epoch, straight.batch_in_epoch)
    assert logged_losses(tmp_path / "b") == pytest.approx(logged_losses(tmp_path / "a"))
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_of_older_code_resumes(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """A checkpoint written before ModelConfig gained fields (their defaults) still resumes;
    a different architecture is still refused."""
    data, spm_model = tiny_data
    run = tmp_path / "run"
    train(config(data, spm_model, run, max_steps=2))
    path = run / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=False)
    for name in ("positions", "norm", "linear_bias", "kv_dim"):  # added for other families
        del ckpt["model_config"][name]
    torch.save(ckpt, path)
    assert train(config(data, spm_model, run, max_steps=4, resume=True)).step == 4
    with pytest.raises(ValueError, match="model config differs"):
        train(
            config(data, spm_model, run, max_steps=6, resume=True, model_overrides={"d_model": 64})
        )


def test_training_time_leaves_out_evaluations_and_pauses(
    tiny_data: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hours on the learning curve are training hours: no dev evaluation, and a stopped
    process (SIGSTOP) counts for at most MAX_STEP_SECONDS."""
    import time

    from attnserve.training import train as train_module

    data, spm_model = tiny_data
    real_step = train_module.Trainer.train_step
    calls = {"n": 0}

    def paused_step(self: object, batches: object) -> float:
        calls["n"] += 1
        if calls["n"] == 2:
            time.sleep(1.0)  # the process "stopped" during this step
        return real_step(self, batches)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "MAX_STEP_SECONDS", 0.3)
    monkeypatch.setattr(train_module.Trainer, "train_step", paused_step)
    monkeypatch.setattr(train_module.Trainer, "evaluate", lambda self: time.sleep(1.0))
    started = time.monotonic()
    state = train(config(data, spm_model, tmp_path / "run", max_steps=4, eval_every=2))
    wall = time.monotonic() - started
    # 2 s of evaluations left out entirely, and the 1 s pause counted as 0.3 s at most.
    assert state.seconds <= wall - 2.0 - 0.7 + 0.05


def test_dev_bleu_best_weights_and_export(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    from attnserve.model.checkpoint import load_model_dir

    data, spm_model = tiny_data
    run = tmp_path / "run"
    state = train(config(data, spm_model, run, max_steps=4, eval_every=2, dev_sentences=4))
    assert [h["step"] for h in state.history] == [2, 4]
    assert {"bleu_ende", "bleu_deen"} <= set(state.history[0])
    model_dir = export_model_dir(run, tmp_path / "model")
    # The metadata describes the weights written (best.pt's step), not the latest checkpoint.
    best = torch.load(run / "best.pt", map_location="cpu", weights_only=False)
    meta = json.loads((model_dir / "metadata.json").read_text())
    assert meta["steps"] == best["step"] and meta["dev"] == best["dev"]
    assert meta["dev_history"][-1]["step"] == best["step"]
    model, tokenizer = load_model_dir(model_dir)
    translator = Translator(TorchBackend(model), tokenizer)
    out = translator.translate(
        ["The king loves the city."], DecodingOptions(max_new_tokens=8), target_lang="de"
    )
    assert len(out) == 1 and isinstance(out[0].text, str)


def test_snapshots_and_averaged_packaging(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """Each dev evaluation keeps the weights (the newest `keep_snapshots`); `package --average
    N` writes the mean of the newest N, and names their steps in the metadata."""
    from attnserve.cli import main
    from attnserve.model.checkpoint import load_model_dir
    from attnserve.training.train import snapshot_paths

    data, spm_model = tiny_data
    run = tmp_path / "run"
    train(
        config(data, spm_model, run, max_steps=8, eval_every=2, dev_sentences=2, keep_snapshots=3)
    )
    paths = snapshot_paths(run)
    assert [p.name for p in paths] == ["step-00000004.pt", "step-00000006.pt", "step-00000008.pt"]
    last = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    assert all(torch.equal(v, torch.load(paths[-1])["model"][k]) for k, v in last.items())
    assert main(["package", str(run), str(tmp_path / "avg"), "--average", "2"]) == 0
    model, _ = load_model_dir(tmp_path / "avg")
    a, b = (torch.load(p)["model"] for p in paths[-2:])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, (a[name] + b[name]) / 2)
    assert not torch.equal(
        a["encoder_layers.0.ffn.fc1.weight"], b["encoder_layers.0.ffn.fc1.weight"]
    )
    meta = json.loads((tmp_path / "avg" / "metadata.json").read_text())
    assert meta["averaged_steps"] == [6, 8] and meta["steps"] == 8 and meta["dev"] is None
    # A snapshot newer than the checkpoint's history (a dev evaluation after the last
    # checkpoint): the snapshot's own dev record.
    checkpoint = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
    at_eight = checkpoint["state"]["history"][-1]
    assert at_eight["step"] == 8
    checkpoint["state"]["history"].pop()
    torch.save(checkpoint, run / "checkpoint.pt")
    assert main(["package", str(run), str(tmp_path / "eight"), "--average", "1"]) == 0
    meta = json.loads((tmp_path / "eight" / "metadata.json").read_text())
    assert meta["steps"] == 8 and meta["dev"] == at_eight and meta["dev_history"][-1] == at_eight
    # Snapshots older than the checkpoint: the metadata is the newest snapshot's, not the run's.
    paths[-1].unlink()
    assert main(["package", str(run), str(tmp_path / "six"), "--average", "1"]) == 0
    meta = json.loads((tmp_path / "six" / "metadata.json").read_text())
    at_six = next(h for h in meta["dev_history"] if h["step"] == 6)
    assert meta["averaged_steps"] == [6] and meta["steps"] == 6 and meta["dev"] == at_six
    assert meta["train_hours"] == at_six["hours"] and meta["dev_history"][-1] == at_six
    with pytest.raises(ValueError, match="2 snapshots"):
        export_model_dir(run, tmp_path / "too-many", average=4)


def test_cli_package_and_eval(
    tiny_data: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`attnserve package` + `attnserve eval` report BLEU/chrF for both test directions."""
    import json

    from attnserve.cli import main

    data, spm_model = tiny_data
    run = tmp_path / "run"
    train(config(data, spm_model, run, max_steps=4, eval_every=2, dev_sentences=4))
    curve = tmp_path / "curve.png"
    assert main(["package", str(run), str(tmp_path / "model"), "--curve", str(curve)]) == 0
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| step | hours |") and [
        r.split("|")[1].strip() for r in table[2:]
    ] == [
        "2",
        "4",
    ]
    hyps = tmp_path / "hyps"
    code = main(
        ["eval", "--model", str(tmp_path / "model"), "--backend", "torch", "--data-dir",
         str(data), "--beam-size", "2", "--limit", "5", "--hypotheses-dir", str(hyps)]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["direction"] for s in report["scores"]] == ["en-de", "de-en"]
    for score in report["scores"]:
        assert score["sentences"] == 5
        assert 0.0 <= score["bleu"] <= 100.0 and 0.0 <= score["chrf"] <= 100.0
        assert score["target_tokens"] > 0 and score["bleu_signature"].startswith("nrefs:1")
    assert len((hyps / "test.en-de.hyp").read_text().splitlines()) == 5
    # The fixed everyday sentences: no data directory, every output in a table.
    code = main(
        ["eval", "--model", str(tmp_path / "model"), "--backend", "torch", "--data-dir",
         str(tmp_path / "absent"), "--split", "everyday", "--beam-size", "2", "--limit", "2",
         "--hypotheses-dir", str(hyps)]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [(s["direction"], s["sentences"]) for s in report["scores"]] == [
        ("en-de", 2),
        ("de-en", 2),
    ]
    table = (hyps / "everyday.md").read_text().splitlines()
    assert len(table) == 2 + 4 and "The meeting has been moved to Tuesday afternoon." in table[2]
    assert "Der Zug nach Berlin fällt heute aus." in table[4]
    # A split whose .tsv names each line's package (as modern-test's does): scores by package.
    import sacrebleu

    held_out = tmp_path / "held-out"
    held_out.mkdir()
    text = {lang: (data / f"test.{lang}").read_text().splitlines()[:5] for lang in ("en", "de")}
    packages = ["shop", "chat", "shop", "chat", "shop"]
    for lang, lines in text.items():
        (held_out / f"modern-test.{lang}").write_text("\n".join(lines) + "\n")
    columns = zip(packages, text["en"], text["de"], strict=True)
    rows = ["package\ten\tde", *("\t".join(row) for row in columns)]
    (held_out / "modern-test.tsv").write_text("\n".join(rows) + "\n")
    code = main(
        ["eval", "--model", str(tmp_path / "model"), "--backend", "torch", "--data-dir",
         str(held_out), "--split", "modern-test", "--beam-size", "2", "--limit", "4",
         "--hypotheses-dir", str(hyps)]
    )  # fmt: skip
    assert code == 0
    en_de = json.loads(capsys.readouterr().out)["scores"][0]
    out = (hyps / "modern-test.en-de.hyp").read_text().splitlines()
    refs = text["de"][:4]

    def scores(lines: slice) -> dict[str, float]:
        h, r = out[lines], [refs[lines]]
        bleu, chrf = sacrebleu.corpus_bleu(h, r).score, sacrebleu.corpus_chrf(h, r).score
        return {"sentences": 2, "bleu": round(bleu, 2), "chrf": round(chrf, 2)}

    assert en_de["by_package"] == {"chat": scores(slice(1, 4, 2)), "shop": scores(slice(0, 4, 2))}
    assert report["scores"][0].get("by_package") is None  # everyday: no packages


def test_warm_start_grows_layers(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """--init-from into a deeper pre-LN model: the source's layers where they were, new layers
    on top that start as the identity (the grown model's logits are the source's), trained from
    the first update; packaged, the metadata says which depths grew. Fewer layers, or growing a
    post-LN model (where a zeroed sublayer is not the identity), are refused."""
    from attnserve.model.checkpoint import load_model_dir
    from attnserve.training.train import Trainer

    data, spm_model = tiny_data
    pre = {"norm_placement": "pre"}
    train(config(data, spm_model, tmp_path / "a", max_steps=3, model_overrides=pre))
    packaged = export_model_dir(tmp_path / "a", tmp_path / "model", which="checkpoint")
    source, _ = load_model_dir(packaged)
    deeper = {**pre, "encoder_layers": 3, "decoder_layers": 4}
    grown = Trainer(
        config(data, spm_model, tmp_path / "b", init_from=str(packaged), model_overrides=deeper)
    )
    state, before = grown.model.state_dict(), source.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    new = {k: v for k, v in state.items() if k not in before}
    assert {k.split(".")[1] for k in new if k.startswith("decoder_layers.")} == {"2", "3"}
    assert {k.split(".")[1] for k in new if k.startswith("encoder_layers.")} == {"2"}
    outputs = [
        k
        for k in new
        if k.split(".", 2)[2].startswith(("self_attn.out_proj", "encoder_attn.out_proj", "ffn.fc2"))
    ]
    assert len(outputs) == 2 * (2 + 3 + 3) and all(not new[k].any() for k in outputs)
    assert all(new[k].any() for k in new if k.endswith("q_proj.weight"))  # random, not zero
    examples, pad = grown.examples, grown.tokenizer.pad_id
    batch = collate(examples, make_batches(examples, 200, seed=1, epoch=0)[0], pad, pad)
    args = (batch.src_ids, batch.src_mask, batch.tgt_in, batch.tgt_mask)
    with torch.no_grad():
        torch.testing.assert_close(
            grown.model.eval()(*args), source.eval()(*args), atol=1e-5, rtol=1e-5
        )
    run = train(
        config(data, spm_model, tmp_path / "b", init_from=str(packaged), model_overrides=deeper)
    )
    assert run.step == 6
    trained = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    assert all(trained[k].any() for k in outputs if k.endswith("weight"))
    assert not torch.equal(
        trained["decoder_layers.3.self_attn.q_proj.weight"],
        new["decoder_layers.3.self_attn.q_proj.weight"],
    )
    meta = json.loads(
        (export_model_dir(tmp_path / "b", tmp_path / "b-model", which="checkpoint")
         / "metadata.json").read_text()
    )  # fmt: skip
    layers = {"encoder_layers": [2, 3], "decoder_layers": [2, 4]}
    assert meta["warm_start"]["layers"] == layers
    assert meta["layer_changes"] == [{"step": 3, "hours": meta["warm_start"]["hours"], **layers}]
    # A run warm-started from the grown model keeps the growth in its own package.
    packaged_grown = tmp_path / "b-model"
    again = train(
        config(
            data, spm_model, tmp_path / "e", init_from=str(packaged_grown), max_steps=1,
            model_overrides=deeper,
        )
    )  # fmt: skip
    assert again.step == 1
    later = json.loads(
        (export_model_dir(tmp_path / "e", tmp_path / "e-model", which="checkpoint")
         / "metadata.json").read_text()
    )  # fmt: skip
    assert later["layer_changes"] == meta["layer_changes"] and "layers" not in later["warm_start"]
    with pytest.raises(ValueError, match="more layers than this run's"):
        Trainer(
            config(
                data, spm_model, tmp_path / "c", init_from=str(packaged),
                model_overrides={**pre, "decoder_layers": 1},
            )
        )  # fmt: skip
    train(config(data, spm_model, tmp_path / "post", max_steps=1))
    post = export_model_dir(tmp_path / "post", tmp_path / "post-model", which="checkpoint")
    with pytest.raises(ValueError, match="only in a pre-LN model"):
        Trainer(
            config(
                data, spm_model, tmp_path / "d", init_from=str(post),
                model_overrides={"decoder_layers": 3},
            )
        )  # fmt: skip


def test_warm_start_from_a_model_directory(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """--init-from copies a packaged model's weights (fresh optimizer); a different architecture
    is refused, other dropout rates are not; a resumed run keeps its checkpoint's weights; dev
    losses are logged per direction."""
    from attnserve.training.train import Trainer

    data, spm_model = tiny_data
    train(config(data, spm_model, tmp_path / "a", max_steps=3, eval_every=3, dev_sentences=4))
    packaged = export_model_dir(tmp_path / "a", tmp_path / "model", which="checkpoint")
    saved = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    warm = Trainer(config(data, spm_model, tmp_path / "b", init_from=str(packaged)))
    assert all(torch.equal(v, saved[k]) for k, v in warm.model.state_dict().items())
    assert warm.state.step == 0
    state = train(config(data, spm_model, tmp_path / "b", init_from=str(packaged), eval_every=3))
    assert {"loss_ende", "loss_deen"} <= set(state.history[-1])
    assert all(0.0 < state.history[-1][k] < 20.0 for k in ("loss_ende", "loss_deen"))
    # Packaged, the warm-started run goes on from its source: updates, hours, dev history.
    source = json.loads((packaged / "metadata.json").read_text())
    meta = json.loads(
        (export_model_dir(tmp_path / "b", tmp_path / "b-model", which="checkpoint")
         / "metadata.json").read_text()
    )  # fmt: skip
    assert source["steps"] == 3 and meta["steps"] == 3 + 6
    assert meta["train_hours"] == pytest.approx(
        source["train_hours"] + state.seconds / 3600, abs=2e-3
    )
    assert meta["warm_start"] == {
        "from": str(packaged), "steps": 3, "hours": source["train_hours"]
    }  # fmt: skip
    assert meta["dev_history"][: len(source["dev_history"])] == source["dev_history"]
    assert [h["step"] for h in meta["dev_history"]] == [3, 6, 9]
    assert meta["dev_history"][-1]["hours"] == pytest.approx(meta["train_hours"], abs=2e-3)
    assert source["warm_start"] is None
    # The run recorded its source's training when it started: packaging needs no source
    # directory (here moved away), and best.pt (the default) continues the history too.
    packaged.rename(tmp_path / "moved")
    best = json.loads(
        (export_model_dir(tmp_path / "b", tmp_path / "b-best") / "metadata.json").read_text()
    )
    best_pt = torch.load(tmp_path / "b" / "best.pt", map_location="cpu", weights_only=False)
    assert best["steps"] == 3 + best_pt["step"] and best["warm_start"]["steps"] == 3
    assert best["dev"] == best_pt["dev"]
    assert best["dev_history"][0] == source["dev_history"][0]
    assert best["dev_history"][-1]["step"] == 3 + best_pt["step"]
    # A run of older code, which did not record it, reads the source where init_from points.
    checkpoint = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    del checkpoint["state"]["warm_start"]
    torch.save(checkpoint, tmp_path / "b" / "checkpoint.pt")
    with pytest.raises(FileNotFoundError, match="did not record"):
        export_model_dir(tmp_path / "b", tmp_path / "b-old", which="checkpoint")
    (tmp_path / "moved").rename(packaged)
    old = json.loads(
        (export_model_dir(tmp_path / "b", tmp_path / "b-old", which="checkpoint")
         / "metadata.json").read_text()
    )  # fmt: skip
    assert old["steps"] == meta["steps"] and old["dev_history"] == meta["dev_history"]
    with pytest.raises(ValueError, match="differs from this run's model config"):
        Trainer(
            config(
                data, spm_model, tmp_path / "c", init_from=str(packaged),
                model_overrides={"ffn_dim": 128},
            )
        )  # fmt: skip
    # Dropout is not a weight: fine-tuning may change it.
    regularized = Trainer(
        config(
            data, spm_model, tmp_path / "d", init_from=str(packaged),
            model_overrides={"dropout": 0.3, "attention_dropout": 0.1},
        )
    )  # fmt: skip
    assert regularized.model_config.dropout == 0.3
    assert all(torch.equal(v, saved[k]) for k, v in regularized.model.state_dict().items())
