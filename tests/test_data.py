"""Data: loading and validating prompt sources, chat templates, columns, the resumable batch stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpokit.data.files import load_prompts
from grpokit.data.prompts import PromptStream, columns_of, prompt_batches, render_prompt
from grpokit.errors import DataError

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
    # No type inference: every cell is its text; an empty cell is None, as a key a JSONL row lacks.
    assert load_prompts(path) == [{"prompt": "1+1=", "answer": "2", "note": "x"},
                                  {"prompt": "a, b", "answer": "3", "note": None}]


def test_csv_values_stay_strings_even_with_gaps(tmp_path):
    """pandas-style inference turned "02" into 2, and "2" into 2.0 once the column had an empty cell."""
    path = tmp_path / "z.csv"
    path.write_text("prompt,answer,id\nA=,02,007\nB=,,1\nC=,2,1e3\n")
    rows = load_prompts(path)
    assert [r["answer"] for r in rows] == ["02", None, "2"]
    assert [r["id"] for r in rows] == ["007", "1", "1e3"]
    assert columns_of(rows)["answer"] == ["02", None, "2"]


def test_csv_bom_crlf_blank_lines_and_quoted_newlines_keep_physical_line_numbers(tmp_path):
    path = tmp_path / "x.csv"
    text = "prompt,answer\r\n\"multi\r\nline\",2\r\n\r\nc=, 3 \r\n,,\r\n,4\r\n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())  # Excel's "CSV UTF-8": a BOM and CRLF
    with pytest.raises(DataError, match=r"x\.csv: line 7: empty 'prompt'"):  # header 1, record 2-3, blank 4
        load_prompts(path)
    path.write_bytes(b"\xef\xbb\xbf" + text.rsplit(",4", 1)[0].encode())
    assert load_prompts(path) == [{"prompt": "multi\r\nline", "answer": "2"}, {"prompt": "c=", "answer": " 3 "}]


def test_csv_header_names_are_stripped_and_a_long_field_is_fine(tmp_path):
    import csv

    path = tmp_path / "h.csv"
    path.write_text(f"\n prompt , answer\n{'x' * 200_000},1\n")
    limit = csv.field_size_limit()
    assert load_prompts(path) == [{"prompt": "x" * 200_000, "answer": "1"}]
    assert csv.field_size_limit() == limit  # restored


@pytest.mark.parametrize("body, pattern", [
    ("1+1=,2\n2+2=\n", r"line 3 has 1 field, expected 2 like the header \(line 1\); add the missing fields"),
    ("1+1=,2\nwhat is 1,000+1?,1001\n",
     r"line 3 has 3 fields, expected 2 like the header \(line 1\); put double quotes around each field that "
     r"contains a comma"),
    ("\"a\nb\",2\n\n\"c\nd\",3,4\n",
     r"line 5 \(a quoted field runs on to line 6\) has 3 fields, expected 2 like the header \(line 1\)"),
])
def test_csv_row_with_the_wrong_number_of_fields(tmp_path, body, pattern):
    path = tmp_path / "f.csv"
    path.write_text("prompt,answer\n" + body)
    with pytest.raises(DataError, match=r"f\.csv: " + pattern):
        load_prompts(path)


@pytest.mark.parametrize("text, pattern", [
    ("prompt,answer,answer\na,1,2\n", r"line 1: the header names column 'answer' twice \(columns 2 and 3\); "
                                       r"rename one"),
    ("prompt,answer,\na,1,\n", r"line 1: header column 3 has no name; name it \(e\.g\. answer\) or delete"),
    ("prompt;answer\na;1\n", r"line 1: the header is the one column 'prompt;answer'; the file looks separated "
                              r"by ';', not commas"),
    ("prompt,answer\n1+1=,\"2\n3+3=,6\n", r"line 2: a quoted field is never closed \(the file ends inside it\); "
                                          r"add the closing double quote"),
    ("prompt,answer\n1+1=,\"2\"x\n", r"line 2 is not valid CSV \(',' expected after '\"'\); put the whole field"),
])
def test_malformed_csv_names_the_line_and_the_fix(tmp_path, text, pattern):
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=r"m\.csv: " + pattern):
        load_prompts(path)


@pytest.mark.parametrize("text", ["", "\n\n", "prompt,answer\n", "\ufeffprompt,answer\r\n\r\n"])
def test_empty_or_header_only_csv_has_no_rows(tmp_path, text):
    path = tmp_path / "e.csv"
    path.write_bytes(text.encode())
    with pytest.raises(DataError, match=r"e\.csv: no rows; the dataset is empty"):
        load_prompts(path)


def test_csv_column_types_on_request(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('q,n,x,meta,s\n"[{""role"": ""user"", ""content"": ""hi""}]",02,2.5,"{""k"": [1]}",07\n'
                    '"""b=""",,,,\n')  # the JSON string "b="
    rows = load_prompts(path, prompt_column="q",
                        csv_column_types={"q": "json", "n": "int", "x": float, "meta": "json", "s": str})
    assert rows == [{"prompt": [{"role": "user", "content": "hi"}], "n": 2, "x": 2.5, "meta": {"k": [1]}, "s": "07"},
                    {"prompt": "b=", "n": None, "x": None, "meta": None, "s": None}]
    # a cell that does not convert names the line and the column
    with pytest.raises(DataError, match=r"t\.csv: line 2: column 'x' is '2\.5', not an int; fix the cell .*"
                                        r"csv_column_types\['x'\]"):
        load_prompts(path, prompt_column="q", csv_column_types={"x": "int"})
    with pytest.raises(DataError, match=r"t\.csv: line 2: column 's' is '07', not valid JSON \(Extra data\)"):
        load_prompts(path, prompt_column="q", csv_column_types={"s": "json"})
    with pytest.raises(DataError, match=r"t\.csv: csv_column_types names \['nope'\] but the header \(line 1\) has "
                                        r"only \['q', 'n', 'x', 'meta', 's'\]"):
        load_prompts(path, prompt_column="q", csv_column_types={"nope": "int"})
    with pytest.raises(DataError, match=r"csv_column_types\['n'\] is 'bool'; use one of 'int', 'float', 'str', 'json'"):
        load_prompts(path, prompt_column="q", csv_column_types={"n": bool})
    (tmp_path / "t.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"t\.jsonl: csv_column_types applies to \.csv files only"):
        load_prompts(tmp_path / "t.jsonl", csv_column_types={"n": "int"})
    with pytest.raises(DataError, match=r"csv_column_types applies to \.csv files only"):
        load_prompts([{"prompt": "a"}], csv_column_types={"n": "int"})


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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_iterables_of_dicts_and_prompt_column_rename():
    assert load_prompts(iter(ROWS)) == ROWS
    rows = load_prompts([{"question": "q1", "answer": "a"}], prompt_column="question")
    assert rows == [{"prompt": "q1", "answer": "a"}]


def test_bundled_example_loads():
    rows = load_prompts(Path(__file__).parents[1] / "examples" / "data" / "sums.jsonl")
    assert len(rows) >= 150
    assert all(set(r) == {"prompt", "answer"} and all(32 <= ord(ch) < 127 for ch in r["prompt"]) for r in rows)
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == int(a) + int(b)  # a JSON number: the example reward compares as text


# ------------------------------------------------------------------ errors


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found .*fix the path"):
        load_prompts(tmp_path / "nope.jsonl")


def test_malformed_json_line_names_the_line(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [json.dumps(ROWS[0]), "", '{"prompt": "x", "answer": }'])
    with pytest.raises(DataError, match=r"bad\.jsonl: line 3 is not valid JSON \(Expecting value at column 27\)"):
        load_prompts(path)


def test_truncated_last_json_line_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"prompt": "2+2=", "ans')  # a write cut short
    with pytest.raises(DataError, match=r"t\.jsonl: line 2 is not valid JSON \(Unterminated string starting at "
                                        r"column 20\)"):
        load_prompts(path)


def test_jsonl_with_a_bom_and_crlf_loads(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(ROWS[0]) + "\r\n" + json.dumps(ROWS[2]) + "\r\n").encode())
    assert load_prompts(path) == [ROWS[0], ROWS[2]]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_nul_bytes_name_the_line(tmp_path, suffix):
    path = tmp_path / f"z{suffix}"
    first = b'{"prompt": "ok"}' if suffix == ".jsonl" else b"prompt"
    path.write_bytes(first + b"\n\x00\x00\x00\n")  # a crash left zeroed blocks behind
    with pytest.raises(DataError, match=rf"z\{suffix}: line 2 contains a NUL byte \(column 1\); .*re-save"):
        load_prompts(path)
    path.write_bytes('{"prompt": "a"}\n'.encode("utf-16-le"))  # UTF-16 without a BOM decodes as UTF-8
    with pytest.raises(DataError, match=r"line 1 contains a NUL byte \(column 2\); .*\(UTF-16\?\)"):
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


def test_empty_prompt_in_csv_names_the_line(tmp_path):
    path = tmp_path / "e.csv"
    path.write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(DataError, match=r"e\.csv: line 3: empty 'prompt'"):  # the header is line 1
        load_prompts(path)


def test_bad_parquet_row_names_the_row(tmp_path):
    """Parquet has no lines: the 1-based row is the position a user can find."""
    import datasets

    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]).to_parquet(
        str(tmp_path / "p.parquet"))
    with pytest.raises(DataError, match=r"p\.parquet: row 2: empty 'prompt'"):
        load_prompts(tmp_path / "p.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all\n")
    with pytest.raises(DataError, match=r"junk\.parquet: cannot read as PARQUET"):
        load_prompts(tmp_path / "junk.parquet")


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
    from grpokit.models.tiny import build_char_tokenizer

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
