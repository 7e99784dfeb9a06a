"""The offline translator and `attnserve translate` on awkward input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.translator import Translator, length_sorted_batches

CLI = [sys.executable, "-m", "attnserve.cli"]


@pytest.fixture(scope="module")
def translator(tiny_marian_import: Path) -> Translator:
    return Translator.from_model_dir(tiny_marian_import, backend="torch")


def test_model_defaults_come_from_its_generation_config(translator: Translator) -> None:
    assert translator.defaults.beam_size == 4  # the tiny Marian dir says num_beams=4


def test_empty_lines_give_empty_translations_in_place(translator: Translator) -> None:
    opts = DecodingOptions(max_new_tokens=8)
    out = translator.translate(["Ka ro.", "", "   ", "Zo re."], opts)
    assert [r.text for r in out][1:3] == ["", ""]
    assert out[1].output_tokens == 0 and out[1].input_tokens == 0
    assert out[0].input_tokens > 0 and out[3].input_tokens > 0


def test_outputs_keep_input_order_across_length_sorted_batches(translator: Translator) -> None:
    texts = ["Ka.", "Ka ro zo re ta mi.", "Zo.", "Ka ro zo re ta mi ka ro zo re.", "Re ta."]
    opts = DecodingOptions(max_new_tokens=8)
    alone = [translator.translate([t], opts)[0].text for t in texts]
    batched = [r.text for r in translator.translate(texts, opts, max_batch_size=2)]
    assert batched == alone
    assert list(length_sorted_batches([1, 5, 3, 9], 3)) == [[3, 1, 2], [0]]


def test_batches_hold_at_most_max_batch_rows_decoder_rows(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch holds at most max_batch_size sentences and max_batch_rows rows (sentences x beam
    size), and the outputs do not depend on the batching."""
    import attnserve.engine.translator as module

    sizes: list[int] = []
    real = module.decode_batch

    def spy(backend, sources, options):  # type: ignore[no-untyped-def]
        sizes.append(len(sources))
        return real(backend, sources, options)

    monkeypatch.setattr(module, "decode_batch", spy)
    texts = ["Ka.", "Ka ro zo re ta mi.", "Zo.", "Ka ro zo re ta mi ka ro zo re.", "Re ta."]
    beam = DecodingOptions(beam_size=4, max_new_tokens=6)
    one_batch = [r.text for r in translator.translate(texts, beam, max_batch_rows=20)]
    assert sizes == [5]
    sizes.clear()
    rows_bound = [r.text for r in translator.translate(texts, beam, max_batch_rows=8)]
    assert sizes == [2, 2, 1] and rows_bound == one_batch  # 8 rows: 2 beam-4 sentences
    sizes.clear()
    translator.translate(texts, beam, max_batch_size=1, max_batch_rows=64)
    assert sizes == [1] * 5  # the sentence limit is the smaller one here
    sizes.clear()
    translator.translate(texts, DecodingOptions(beam_size=8, max_new_tokens=2), max_batch_rows=4)
    assert sizes == [1] * 5  # a beam wider than the budget still decodes, one at a time


def test_lines_longer_than_max_positions_are_truncated(translator: Translator) -> None:
    limit = translator.backend.spec.max_positions
    long_text = " ".join(["kamo"] * (limit * 2))
    ids = translator.encode(long_text)
    assert len(ids) == limit and ids[-1] == translator.tokenizer.eos_id
    [result] = translator.translate([long_text], DecodingOptions(max_new_tokens=4))
    assert result.input_tokens == limit


def test_unknown_characters_map_to_unk(translator: Translator) -> None:
    ids = translator.encode("漢字 🙂 ⟂")
    assert translator.tokenizer.unk_id in ids
    [result] = translator.translate(["漢字 🙂 ⟂"], DecodingOptions(max_new_tokens=4))
    assert isinstance(result.text, str)


def test_max_new_tokens_above_max_positions_is_rejected(translator: Translator) -> None:
    too_many = translator.backend.spec.max_positions + 1
    with pytest.raises(InvalidOption, match="max_new_tokens"):
        translator.translate(["Ka."], DecodingOptions(max_new_tokens=too_many))


def test_nbest_output_and_summary_line(tiny_marian_import: Path) -> None:
    proc = subprocess.run(
        [*CLI, "translate", "--model", str(tiny_marian_import), "--backend", "torch",
         "--beam-size", "3", "--num-hypotheses", "2", "--max-new-tokens", "6"],
        input="Ka ro.\n\nZo re.\n", capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = proc.stdout.split("\n")
    assert len(lines) == 4 and lines[3] == ""  # three outputs, the empty line kept
    assert lines[0].count(" ||| ") == 1
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert set(summary) >= {"sentences", "target_tokens", "seconds", "tokens_per_second"}
    assert summary["lines"] == 3 and summary["sentences"] == 2


def _translate_lines(model: Path, text: str, *flags: str) -> tuple[list[str], dict[str, Any]]:
    proc = subprocess.run(
        [*CLI, "translate", "--model", str(model), "--backend", "torch", "--max-new-tokens", "8",
         *flags],
        input=text, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stdout.split("\n")[:-1], json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_line_of_sentences_is_its_sentences_alone(tiny_marian_import: Path) -> None:
    alone, _ = _translate_lines(tiny_marian_import, "Ka ro.\nZo re!\nTe ka?\n")
    (line,), summary = _translate_lines(tiny_marian_import, "  Ka ro. Zo re!\tTe ka?\n")
    assert line == f"  {alone[0]} {alone[1]}\t{alone[2]}"
    assert summary["sentences"] == 3
    _, summary = _translate_lines(tiny_marian_import, "Ka ro. Zo re!\n", "--no-split-sentences")
    assert summary["sentences"] == 1


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_error_names_the_file(
    tiny_marian_import: Path, tmp_path: Path, missing: str
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_marian_import, broken)
    (broken / missing).unlink()
    proc = subprocess.run(
        [*CLI, "translate", "--model", str(broken), "--backend", "torch"],
        input="Ka.\n",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert missing in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_option_is_a_clean_error(tiny_marian_import: Path) -> None:
    proc = subprocess.run(
        [*CLI, "translate", "--model", str(tiny_marian_import), "--backend", "torch", "--top-p",
         "1.5", "--sampling"],
        input="Ka.\n", capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr
