"""`grpokit explain` reproduces seed 002's hand calculation on two real Hugging Face model folders whose
next-token probabilities are set to the seed's tables."""

from __future__ import annotations

import json

import pytest

from grpokit.cli import main
from grpokit.observe.explain import TrustRegion, build_last_token_model, explain_checkpoints

# seed 002: π(token | context) for the contexts P, PA, PAB (each ends in a different token)
OLD = {"P": {"A": 0.5, "B": 0.3, "C": 0.2}, "A": {"A": 0.2, "B": 0.6, "C": 0.2}, "B": {"A": 0.3, "B": 0.3, "C": 0.4}}
NEW = {"P": {"A": 0.6, "B": 0.2, "C": 0.2}, "A": {"A": 0.1, "B": 0.7, "C": 0.2}, "B": {"A": 0.2, "B": 0.2, "C": 0.6}}


@pytest.fixture(scope="module")
def seed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed002")
    build_last_token_model(root / "old", OLD, alphabet="PABC")
    build_last_token_model(root / "new", NEW, alphabet="PABC")
    return root / "old", root / "new"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["explain", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_matches_seed_002(seed_models, capsys):
    old, new = seed_models
    code, out, _ = run_cli(capsys, "--old", old, "--new", new, "--prompt", "P", "--answer", "ABC", "--device", "cpu",
                           "--json")
    assert code == 0
    result = json.loads(out)
    steps = result["steps"]
    assert [s["token"] for s in steps] == ["A", "B", "C"] and [s["context"] for s in steps] == ["P", "PA", "PAB"]
    for s, ctx in zip(steps, "PAB"):  # the full probability tables of each step
        assert {r["token"]: r["p_old"] for r in s["table"]} == pytest.approx(OLD[ctx], abs=1e-5)
        assert {r["token"]: r["p_new"] for r in s["table"]} == pytest.approx(NEW[ctx], abs=1e-5)
    assert [s["ratio"] for s in steps] == pytest.approx([1.2, 7 / 6, 1.5], abs=1e-3)
    assert [s["p_old"] for s in steps] == pytest.approx([0.5, 0.6, 0.4], abs=1e-5)
    seq = result["sequence"]
    assert seq["ratio"] == pytest.approx(2.1, abs=1e-3)
    assert seq["p_old"] == pytest.approx(0.12, abs=1e-5) and seq["p_new"] == pytest.approx(0.252, abs=1e-5)
    assert seq["ratio"] == pytest.approx(seq["p_new"] / seq["p_old"], rel=1e-6)
    assert seq["gspo_ratio"] == pytest.approx(2.1 ** (1 / 3), abs=1e-3)


def test_text_output_prints_the_tables_and_ratios(seed_models, capsys):
    old, new = seed_models
    code, out, _ = run_cli(capsys, "--old", old, "--new", new, "--prompt", "P", "--answer", "ABC", "--device", "cpu",
                           "--advantage", "1")
    assert code == 0
    for text in ("step 2: context 'PA' → y2 = 'B'", "'B' ◀      0.6000   0.7000", "sum shown   1.0000   1.0000",
                 "1.2000", "1.1667", "1.5000  outside [0.8, 1.2]; clipped for A = +1: no gradient",
                 "π_old(y|x) = 0.12, π_new(y|x) = 0.252", "sequence ratio = 1.2 × 1.1667 × 1.5 = 2.1000"):
        assert text in out, text


def test_clipping_depends_on_the_advantage_sign(seed_models):
    old, new = seed_models
    up = explain_checkpoints(old, new, "P", "ABC", device="cpu", advantage=1.0)
    down = explain_checkpoints(old, new, "P", "ABC", device="cpu", advantage=-1.0)
    assert [s["clipped"] for s in up["steps"]] == [False, False, True]  # 1.5 > 1 + ε, A > 0
    assert [s["clipped"] for s in down["steps"]] == [False, False, False]  # ratios above 1 never clip A < 0
    wide = explain_checkpoints(old, new, "P", "ABC", device="cpu", trust_region=TrustRegion(epsilon_high=0.28))
    assert [s["outside_trust_region"] for s in wide["steps"]] == [False, False, True]
    assert wide["trust_region"] == pytest.approx([0.8, 1.28])


def test_same_checkpoint_twice_gives_ratio_one_on_a_chat_prompt(tiny_model_dir):
    result = explain_checkpoints(tiny_model_dir, tiny_model_dir, "12+30=", "42", device="cpu", chat=True)
    assert result["prompt"].startswith("user: 12+30=") and result["prompt"].endswith("assistant: ")
    assert [s["ratio"] for s in result["steps"]] == pytest.approx([1.0, 1.0])
    assert result["sequence"]["ratio"] == pytest.approx(1.0)


def test_an_empty_answer_is_a_user_error(seed_models, capsys):
    old, new = seed_models
    code, _, err = run_cli(capsys, "--old", old, "--new", new, "--prompt", "P", "--answer", "", "--device", "cpu")
    assert code == 2 and "answer tokenizes to nothing" in err
