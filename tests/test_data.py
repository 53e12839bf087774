"""Data: loading and validating prompt sources, chat templates, columns, the resumable batch stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpokit.data import DataError, PromptStream, columns_of, load_prompts, prompt_batches, render_prompt

ROWS = [
    {"prompt": "1+1=", "answer": "2", "level": 1},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
     "answer": "4", "level": 2},
    {"prompt": "3+3=", "answer": "6", "level": 3},
]
FLAT = [r for r in ROWS if isinstance(r["prompt"], str)]


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------ round trips


def test_jsonl_round_trip_keeps_types_and_skips_blank_lines(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]), json.dumps(ROWS[2])])
    assert load_prompts(path) == ROWS
    assert load_prompts(str(path)) == ROWS


def test_json_list_and_json_lines_under_json_name(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "b.json").write_text(json.dumps({"data": ROWS}))
    (tmp_path / "c.json").write_text("\n".join(json.dumps(r) for r in ROWS))
    for name in ("a.json", "b.json", "c.json"):
        assert load_prompts(tmp_path / name) == ROWS


def test_csv_round_trip(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt,answer,note\n1+1=,2,x\n\"a, b\",3,\n")
    # `datasets` infers column types: a numeric column comes back as numbers, an empty cell as None.
    assert load_prompts(path) == [{"prompt": "1+1=", "answer": 2, "note": "x"},
                                  {"prompt": "a, b", "answer": 3, "note": None}]


def test_parquet_and_saved_folder_round_trip(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(FLAT)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    assert load_prompts(tmp_path / "p.parquet") == FLAT
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_prompts(tmp_path / "saved") == FLAT
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert load_prompts(tmp_path / "dd", split="test") == FLAT[:1]
    with pytest.raises(DataError, match=r"dd: has no split 'validation'; its splits are \['test', 'train'\]"):
        load_prompts(tmp_path / "dd", split="validation")
    in_memory = datasets.DatasetDict({"train": ds, "test": ds.select([1])})
    assert load_prompts(in_memory, split="test") == FLAT[1:2]
    with pytest.raises(DataError, match=r"DatasetDict has no split 'dev'"):
        load_prompts(in_memory, split="dev")


def test_python_rows_do_not_import_datasets():
    """A list of dicts needs neither datasets nor pandas/pyarrow (about 100 MB resident)."""
    import subprocess
    import sys

    code = ("import sys; from grpokit.data import load_prompts; load_prompts([{'prompt': 'x'}]); "
            "print('datasets' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_iterables_of_dicts_and_prompt_column_rename():
    assert load_prompts(iter(ROWS)) == ROWS
    rows = load_prompts([{"question": "q1", "answer": "a"}], prompt_column="question")
    assert rows == [{"prompt": "q1", "answer": "a"}]


def test_bundled_example_loads():
    rows = load_prompts(Path(__file__).parents[1] / "examples" / "data" / "arith.jsonl")
    assert len(rows) >= 150
    assert all(set(r) == {"prompt", "answer"} and all(32 <= ord(ch) < 127 for ch in r["prompt"]) for r in rows)
    a, b = rows[0]["prompt"].rstrip("=").split("*")
    assert int(rows[0]["answer"]) == int(a) * int(b)


# ------------------------------------------------------------------ errors


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found .*fix the path"):
        load_prompts(tmp_path / "nope.jsonl")


def test_malformed_json_line_names_the_line(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [json.dumps(ROWS[0]), "", '{"prompt": "x", "answer": }'])
    with pytest.raises(DataError, match=r"bad\.jsonl: line 3 is not valid JSON \(Expecting value at column 27\)"):
        load_prompts(path)


def test_non_object_json_line(tmp_path):
    path = _jsonl(tmp_path / "arr.jsonl", [json.dumps(ROWS[0]), "[1, 2]"])
    with pytest.raises(DataError, match=r"arr\.jsonl: line 2 is a JSON list, not an object"):
        load_prompts(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_non_utf8_bytes_name_the_line(tmp_path, suffix):
    path = tmp_path / f"latin{suffix}"
    first = b'{"prompt": "ok"}' if suffix == ".jsonl" else b"prompt"
    path.write_bytes(first + b"\n" + (b'{"prompt": "caf\xe9"}' if suffix == ".jsonl" else b"caf\xe9") + b"\n")
    with pytest.raises(DataError, match=rf"latin\{suffix}: line 2 is not valid UTF-8 \(byte 0xe9.*re-save"):
        load_prompts(path)


def test_missing_prompt_column_lists_the_columns(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", [json.dumps({"question": "a", "answer": "1"})] * 2)
    with pytest.raises(DataError, match=r"q\.jsonl: no column 'prompt'; the columns are \['question', 'answer'\]"
                                        r".*prompt_column="):
        load_prompts(path)


def test_row_without_prompt_names_the_line(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [json.dumps(ROWS[0]), json.dumps({"answer": "1"})])
    with pytest.raises(DataError, match=r"r\.jsonl: line 2: has no 'prompt' \(its keys: \['answer'\]\)"):
        load_prompts(path)


@pytest.mark.parametrize("prompt", ["", "   ", [], None])
def test_empty_prompt_names_the_line(tmp_path, prompt):
    path = _jsonl(tmp_path / "e.jsonl", [json.dumps(ROWS[0]), "", json.dumps({"prompt": prompt})])
    with pytest.raises(DataError, match=r"e\.jsonl: line 3: empty 'prompt'"):
        load_prompts(path)


def test_empty_prompt_in_csv_names_the_row(tmp_path):
    path = tmp_path / "e.csv"
    path.write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(DataError, match=r"e\.csv: row 2: empty 'prompt'"):
        load_prompts(path)


@pytest.mark.parametrize("prompt, pattern", [
    (5, r"'prompt' is a int \(5\); a prompt is a string or a list"),
    ({"role": "user"}, r"'prompt' is a dict"),
    ([{"role": "user"}], r"'prompt' message 0 is \{'role': 'user'\}; a conversational prompt is a list"),
    (["hi"], r"'prompt' message 0 is 'hi'"),
])
def test_prompt_of_the_wrong_shape(prompt, pattern):
    with pytest.raises(DataError, match=r"<rows>: row 2: " + pattern):
        load_prompts([ROWS[0], {"prompt": prompt}])


def test_empty_sources(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no rows; the dataset is empty"):
        load_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match=r"<rows>: no rows"):
        load_prompts([])


def test_unsupported_sources(tmp_path):
    (tmp_path / "p.txt").write_text("hi")
    with pytest.raises(DataError, match=r"p\.txt: unsupported file type \.txt; use one of \.jsonl, \.json"):
        load_prompts(tmp_path / "p.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder: is a folder but not one written by Dataset\.save_to_disk"):
        load_prompts(tmp_path / "folder")
    with pytest.raises(DataError, match=r"iterable of dicts, got dict"):
        load_prompts({"prompt": "x"})
    with pytest.raises(DataError, match=r"<rows>: row 1 is a str, not a dict"):
        load_prompts(["just a string"])
    with pytest.raises(DataError, match=r"both 'prompt' and prompt_column='q'"):
        load_prompts([{"q": "a", "prompt": "b"}], prompt_column="q")


# ------------------------------------------------------------------ rendering and columns


def test_render_prompt_with_the_tiny_chat_template():
    from grpokit.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    assert render_prompt(tok, "12+34=") == "12+34="
    text = render_prompt(tok, ROWS[1]["prompt"])
    assert text == "system: Be brief.\nuser: 2+2?\nassistant: "
    tok.chat_template = None
    with pytest.raises(DataError, match=r"need a chat template, but the tokenizer \w+ \(unnamed\) has none"
                                        r".*set tokenizer\.chat_template or give plain-string prompts"):
        render_prompt(tok, ROWS[1]["prompt"])
    assert render_prompt(tok, "plain") == "plain"


def test_columns_of_repeats_and_fills_missing():
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "extra": "x"}]
    assert columns_of(rows) == {"answer": [1, None], "extra": [None, "x"]}
    assert columns_of(rows, repeat=2) == {"answer": [1, 1, None, None], "extra": [None, None, "x", "x"]}


# ------------------------------------------------------------------ batch stream


ROWS10 = [{"prompt": str(i)} for i in range(10)]


def _ids(batch):
    return [int(r["prompt"]) for r in batch]


def test_stream_is_deterministic_covers_each_epoch_and_reshuffles():
    a = [_ids(PromptStream(ROWS10, 5, seed=3).next_batch()) for _ in range(2)]
    assert a[0] == a[1]
    s = PromptStream(ROWS10, 5, seed=3)
    e0 = _ids(s.next_batch()) + _ids(s.next_batch())
    e1 = _ids(s.next_batch()) + _ids(s.next_batch())
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1  # reshuffled per epoch
    assert e0 != _ids(PromptStream(ROWS10, 10, seed=4).next_batch())  # the seed matters
    assert _ids(PromptStream(ROWS10, 10, seed=3, shuffle=False).next_batch()) == list(range(10))


def test_batches_span_epochs_and_stay_full():
    s = prompt_batches(ROWS10, 4, seed=0)
    batches = [_ids(s.next_batch()) for _ in range(5)]  # 20 rows = exactly 2 epochs
    assert all(len(b) == 4 for b in batches)
    flat = sum(batches, [])
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10))
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["index"] == 10
    big = PromptStream(ROWS10[:3], 7, seed=0).next_batch()  # larger than the dataset
    assert len(big) == 7


def test_resume_from_state_dict_gives_the_same_next_batches():
    ref = PromptStream(ROWS10, 3, seed=11)
    for _ in range(4):
        ref.next_batch()
    state = ref.state_dict()
    expected = [_ids(ref.next_batch()) for _ in range(6)]
    resumed = PromptStream(ROWS10, 3, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert [_ids(resumed.next_batch()) for _ in range(6)] == expected
    it = iter(PromptStream(ROWS10, 3, seed=11))
    assert [_ids(next(it)) for _ in range(2)] == [_ids(b) for b in [PromptStream(ROWS10, 3, seed=11).next_batch()]] + \
        [_ids(PromptStream(ROWS10, 6, seed=11).next_batch())[3:]]


def test_resume_refuses_a_different_dataset_or_seed():
    state = PromptStream(ROWS10, 3, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"checkpoint has num_rows=10 but this run has 9; resume with the same data"):
        PromptStream(ROWS10[:9], 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"checkpoint has seed=1 but this run has 2"):
        PromptStream(ROWS10, 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="bad position"):
        PromptStream(ROWS10, 3, seed=1).load_state_dict({"epoch": 0, "index": 11})


def test_stream_argument_errors():
    with pytest.raises(DataError, match="at least one row"):
        PromptStream([], 2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        PromptStream(ROWS10, 0)
