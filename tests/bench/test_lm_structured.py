"""`attnserve bench-lm --json-schema` on the tiny byte-level language model: both arms run the
same prompts and generate the same tokens, the constrained arm's masks are timed, and the CLI
writes the report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnserve.bench.lm_structured import bench_structured, structured_markdown
from attnserve.cli import main
from attnserve.export.lm_export import export_lm_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "qty": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "qty"],
    "additionalProperties": False,
}
PROMPTS = ("an order", "another order")


@pytest.fixture(scope="module")
def byte_lm_dir(tiny_byte_lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-structured") / "tiny-byte-lm"
    shutil.copytree(tiny_byte_lm_dir, out)
    export_lm_model(out, ("fp32",), verify=False)
    return out


def test_both_arms_generate_the_same_tokens(byte_lm_dir: Path) -> None:
    results = bench_structured(
        byte_lm_dir, SCHEMA, [1, 2], max_new_tokens=40, repeats=2, variant="fp32",
        prompts=PROMPTS,
    )  # fmt: skip
    assert [(r.clients, r.arm) for r in results] == [
        (1, "free"), (1, "constrained"), (2, "free"), (2, "constrained"),
    ]  # fmt: skip
    for free, constrained in zip(results[::2], results[1::2], strict=True):
        assert free.output_tokens == constrained.output_tokens > 0
        assert free.requests == constrained.requests == 2 * free.clients  # >= the prompts
        assert len(free.runs) == len(constrained.runs) == 2
        assert free.masks == 0 and constrained.masks >= constrained.output_tokens
        assert 0 < constrained.mask_us_p50 <= constrained.mask_us_p99
        assert free.ms_per_step > 0 and constrained.ms_per_step > 0
    table = structured_markdown(results)
    assert "| 2 | constrained |" in table and table.count("\n") == 6
    assert "| 1 | free | " in table and "| 1.00 |" in table


def test_cli(byte_lm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    args = ["bench-lm", "--model", str(byte_lm_dir), "--json-schema", str(schema)]
    args += ["--variant", "fp32", "--clients", "2", "--requests", "2", "--max-tokens", "30"]
    args += ["--repeats", "1", "--output-dir", str(tmp_path), "--name", "structured"]
    assert main(args) == 0
    assert "| 2 | free |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "structured.json").read_text())
    assert [row["arm"] for row in rows] == ["free", "constrained"]
    assert rows[0]["requests"] == 2
