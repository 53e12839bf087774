"""Damaged data files through the real CLI: one `error:` line naming the file and the line, exit 2, no run folder.

Each case is `grpokit train CFG` in a subprocess (a few seconds each: the CLI imports torch), so the
table holds one file per kind of damage; the variations are unit tests in test_data.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fault_harness import assert_clean_exit, assert_user_error, run_cli, snapshot, write_train_config

pytestmark = pytest.mark.faults

BOM = b"\xef\xbb\xbf"
GOOD_JSONL = b'{"prompt": "1+1=", "answer": "2"}\n'

# name, file contents, what the error line must say besides the file's path
CASES = [
    ("few_fields.csv", b"prompt,answer\n1+1=,2\n2+2=\n3+3=,6\n",
     ["line 3 has 1 field, expected 2", "add the missing fields"]),
    ("many_fields.csv", b"prompt,answer\n1+1=,2\nwhat is 1,000+1?,1001\n",
     ["line 3 has 3 fields, expected 2", "double quotes around each field that contains a comma"]),
    ("duplicate_header.csv", b"prompt,answer,answer\n1+1=,2,2\n", ["line 1", "'answer' twice", "rename one"]),
    ("unclosed_quote.csv", b'prompt,answer\n1+1=,"2\n2+2=,4\n', ["line 2", "quoted field is never closed"]),
    # Excel's "CSV UTF-8": a BOM, CRLF line ends; a blank line (3) is skipped but counted
    ("excel_empty_prompt.csv", BOM + b"prompt,answer\r\n1+1=,2\r\n\r\n,4\r\n", ["line 4: empty 'prompt'"]),
    ("header_only.csv", BOM + b"prompt,answer\r\n", ["no rows"]),
    ("truncated.jsonl", GOOD_JSONL + b'{"prompt": "2+2=", "ans', ["line 2 is not valid JSON", "Unterminated"]),
    ("not_object.jsonl", GOOD_JSONL + b'["2+2=", "4"]\n', ["line 2 is a JSON list, not an object"]),
    ("nul_bytes.jsonl", GOOD_JSONL + b"\x00" * 16 + b"\n", ["line 2 contains a NUL byte", "re-save"]),
    ("empty.jsonl", b"", ["no rows"]),
]


def _config(tmp_path: Path, model: Path, data: Path) -> Path:
    return write_train_config(tmp_path, model, tmp_path / "run", steps=1, data_path=data, rewards=["numeric_match"])


@pytest.mark.parametrize("name, contents, mentions", CASES, ids=[c[0] for c in CASES])
def test_damaged_data_file_is_one_error_line(tiny_model_dir, tmp_path, name, contents, mentions):
    data = tmp_path / "data" / name
    data.parent.mkdir()
    data.write_bytes(contents)
    before = snapshot(data.parent)
    result = run_cli("train", _config(tmp_path, tiny_model_dir, data))
    line = assert_user_error(result, str(data), *mentions)
    assert line.startswith(f"error: {data}: "), line
    assert not (tmp_path / "run").exists(), result.describe()
    assert snapshot(data.parent) == before  # the data file is only read


def test_csv_answers_stay_strings_and_train(tiny_model_dir, tmp_path):
    """"02" and an empty cell: strings and None reach the rewards (not 2 and 2.0), and one step trains."""
    from grpokit.data.files import load_prompts
    from grpokit.data.prompts import columns_of
    from grpokit.rewards.graders import numeric_match

    data = tmp_path / "answers.csv"
    data.write_bytes(BOM + b"prompt,answer\r\n1+1=,02\r\n2+2=,\r\n3+3=,6\r\n4+4=,8\r\n")
    answers = columns_of(load_prompts(data))["answer"]
    assert answers == ["02", None, "6", "8"]
    assert numeric_match(["2", "4", "6", "9"], answers) == [1.0, None, 1.0, 0.0]  # no answer: skipped, not 0
    result = run_cli("train", _config(tmp_path, tiny_model_dir, data))
    assert_clean_exit(result)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1], result.describe()
