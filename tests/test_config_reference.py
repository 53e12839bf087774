"""docs/CONFIG.md is generated from the config dataclasses (grpokit.config.reference) and kept up to date."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from grpokit.config import reference
from grpokit.config.schema import SECTIONS
from grpokit.config.variants import LOSS_TYPES, PRESET_NAMES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "CONFIG.md"


def test_docs_config_md_is_up_to_date():
    assert DOC.is_file(), f"docs/CONFIG.md is missing; write it with: {reference.REGENERATE}"
    assert DOC.read_text(encoding="utf-8") == reference.markdown(), (
        f"docs/CONFIG.md is out of date with src/grpokit/config/schema.py; regenerate it with: {reference.REGENERATE}")


def _rows(text: str) -> dict[str, list[str]]:
    """`section.field` -> the cells of its table row."""
    rows, section = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[4:-1] if line.startswith("## [") else None
        elif section and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[f"{section}.{cells[0].strip('`')}"] = cells
    return rows


def test_every_field_of_every_section_has_a_row_with_type_default_and_meaning():
    rows = _rows(reference.markdown())
    expected = [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert list(rows) == expected
    for key, (_, kind, default, _, meaning, _) in rows.items():
        assert kind and default.startswith("`") and meaning, f"{key}: {rows[key]}"


def test_meanings_come_from_the_source_comments():
    rows = _rows(reference.markdown())
    assert rows["rollout.group_size"][4] == "G answers per prompt"  # a trailing comment
    assert rows["rewards.functions"][4].startswith("Names of built-in rewards")  # the block above the field
    assert rows["rollout.shared_prefill"][4] == "see `sampler`"  # one block for several fields
    assert rows["tools.max_calls"][5] == "`max_tool_calling_iterations`"


def test_allowed_values_and_checks_come_from_the_checks():
    rows = _rows(reference.markdown())
    assert rows["algorithm.loss_type"][3] == "one of " + ", ".join(f'`"{n}"`' for n in LOSS_TYPES)
    assert all(f'`"{n}"`' in rows["algorithm.preset"][3] for n in PRESET_NAMES)
    assert rows["model.dtype"][3] == 'one of `"float32"`, `"bfloat16"`, `"float16"`'
    assert rows["rollout.group_size"][3].startswith("must be >= 2")
    assert rows["algorithm.top_entropy_quantile"][3].endswith("highest-entropy tokens)")  # `;` inside () kept


def test_the_fallback_meanings_are_only_for_fields_without_a_comment():
    """An entry of `_MEANINGS` is for a field schema.py does not comment; once it does, drop the entry."""
    commented = {f"{name}.{field}" for name, cls in SECTIONS.items() for field in reference.source_comments(cls)}
    known = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert not set(reference._MEANINGS) & commented, "schema.py now comments these: delete them from _MEANINGS"
    assert set(reference._MEANINGS) <= known
    assert set(reference.TRL_NAMES) | set(reference.TRL_TRAINER_ARGS) <= known


def test_trl_names_are_real_grpo_config_fields_and_trainer_arguments():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert reference.trl_field_names() <= fields, reference.trl_field_names() - fields
    params = set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    assert set(reference.TRL_TRAINER_ARGS.values()) <= params


def test_a_new_field_appears_without_editing_the_generator():
    """The generator reads the dataclasses at run time: a field another change adds is documented."""
    @dataclasses.dataclass(frozen=True)
    class Extra:
        name: str = "x"  # the dataset's name

    assert reference.source_comments(Extra) == {}  # not in schema.py: its type and default still show
    assert "| `name` | string | `\"x\"` |" in "\n".join(reference._section_table("extra", Extra))
