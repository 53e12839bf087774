"""Remote graders and reward models as entries of `rewards.functions` in a real run (config, CLI, Python).

The units are tested in test_remote_grader.py and test_reward_model.py; here: the registry routes an
entry to them, their scores are logged under their names like any function's, a grader that fails for
good either stops the run with its one line or (rewards.on_error = "skip") leaves answers ungraded and
counted, and a grader that refuses connections fails before the model loads (CLI: one error line, exit 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import make_config, parity
from grpokit.config.schema import RewardConfig
from grpokit.errors import RewardError, RewardLoadError
from grpokit.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


class _Grader(BaseHTTPRequestHandler):
    """/len: 1.0 for an answer of 3+ characters; /fail: 500 always."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        if self.path == "/fail":
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"scores": [float(len(c) >= 3) for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def grader():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grader)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _with_rewards(config, **fields):
    from dataclasses import replace

    return replace(config, rewards=RewardConfig(**fields))


def test_a_grader_url_grades_the_run_and_its_columns_reach_it(grader, tiny_model_dir, tmp_path):
    url = _url(grader, "/len")
    config = _with_rewards(make_config(tiny_model_dir, tmp_path / "run"), functions=(url, "addition"))
    run = train(config)
    name = f"127.0.0.1_{grader.server_address[1]}_len"
    rows = _metrics(run)
    assert all(f"rewards/{name}/mean" in r and "rewards/addition/mean" in r for r in rows)
    body = grader.seen[-1]
    assert len(body["completions"]) == 16 and "answer" in body  # 4 prompts x 4 answers, with the task's column


def test_a_failing_grader_stops_the_run_or_with_skip_leaves_answers_ungraded(grader, tiny_model_dir, tmp_path):
    url = _url(grader, "/fail")
    args = {url: {"retries": 1, "backoff_s": 0.01}}
    config = make_config(tiny_model_dir, tmp_path / "raise")
    with pytest.raises(RewardError, match=f"{url}.*2 time"):
        train(_with_rewards(config, functions=(url,), args=args))

    config = make_config(tiny_model_dir, tmp_path / "skip", steps=2)
    run = train(_with_rewards(config, functions=(url, "addition"), args=args, on_error="skip"))
    name = f"127.0.0.1_{grader.server_address[1]}_fail"
    for row in _metrics(run):
        assert row[f"rewards/{name}/ungraded"] == 16  # every answer of the step
        assert row["rewards/addition/mean"] == row["rewards/addition/mean"]  # the other reward still graded


def test_python_reward_functions_may_name_a_grader_beside_callables(grader, tiny_model_dir, tmp_path):
    run = train(make_config(tiny_model_dir, tmp_path / "run", steps=1),
                reward_functions=[parity, _url(grader, "/len")])
    row = _metrics(run)[0]
    assert "rewards/parity/mean" in row and f"rewards/127.0.0.1_{grader.server_address[1]}_len/mean" in row


def test_a_grader_that_refuses_connections_fails_before_the_model_loads(tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    config = _with_rewards(make_config(tiny_model_dir, tmp_path / "run"), functions=(url,))
    with pytest.raises(RewardLoadError, match=f"{url}"):
        train(config)
    assert not (tmp_path / "run").exists()

    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\npath = "{tiny_model_dir}"\n[data]\ntask = "addition"\n'
                    f'[rewards]\nfunctions = ["{url}"]\n[output]\ndir = "{tmp_path / "cli"}"\n')
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and url in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "cli").exists()


def test_unknown_grader_arguments_are_one_line_naming_what_it_accepts(grader, tiny_model_dir, tmp_path):
    url = _url(grader, "/len")
    config = make_config(tiny_model_dir, tmp_path / "run")
    with pytest.raises(RewardLoadError, match="concurency.*it accepts: .*concurrency"):
        train(_with_rewards(config, functions=(url,), args={url: {"concurency": 8}}))
    with pytest.raises(RewardLoadError, match="unknown URL scheme 'htp'"):
        train(_with_rewards(config, functions=("htp://127.0.0.1:1/score",)))
    with pytest.raises(RewardLoadError, match="url is set by grpokit"):
        train(_with_rewards(config, functions=(url,), args={url: {"url": "http://x"}}))


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """examples/make_reward_model.py's reward model: +1 for a text ending in a digit, else -1."""
    folder = tmp_path_factory.mktemp("rm") / "digit-rm"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "make_reward_model.py"), str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return folder


def test_a_reward_model_folder_grades_the_run_under_its_name(reward_model, tiny_model_dir, tmp_path):
    config = _with_rewards(make_config(tiny_model_dir, tmp_path / "run", steps=1), functions=(str(reward_model),),
                           args={str(reward_model): {"batch_size": 3}})
    rows = _metrics(train(config))
    assert -1 <= rows[0]["rewards/digit-rm/mean"] <= 1
    completions = tmp_path / "c"
    run = train(make_config(tiny_model_dir, completions, steps=1, output={"completions_every": 1}),
                reward_functions=[parity, str(reward_model)])
    for line in (run / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        ends_in_digit = row["completion"][-1:].isdigit()
        assert row["rewards"]["digit-rm"] == pytest.approx(1.0 if ends_in_digit else -1.0, abs=1e-5), row


def test_a_folder_that_is_no_reward_model_fails_before_the_policy_loads(tiny_model_dir, tmp_path):
    config = _with_rewards(make_config(tiny_model_dir, tmp_path / "run"), functions=(str(tiny_model_dir),))
    with pytest.raises(RewardLoadError, match="is a causal LM"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_the_code_sandbox_in_force_is_said_once_at_start_up(tiny_model_dir, tmp_path, capsys):
    from dataclasses import replace

    config = make_config(tiny_model_dir, tmp_path / "run", steps=1, prompts_per_step=2)
    config = replace(config, data=replace(config.data, task="", path=str(ROOT / "examples/data/code_tests.jsonl")),
                     rewards=RewardConfig(functions=("code_execution",), args={"code_execution": {"workers": 2}}))
    run = train(config)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("code_execution:")]
    assert len(said) == 1 and ("bubblewrap" in said[0] or "uid 65534" in said[0] or "rlimits" in said[0])
    assert _metrics(run)[0]["rewards/code_execution/mean"] == 0.0  # a random model writes no passing code


def test_names_among_python_callables_get_their_config_arguments(tiny_model_dir, tmp_path):
    args = {"format": {"pattern": r"^\d+$"},
            "soft_overlong_penalty": {"max_completion_length": 5, "overlong_buffer": 2}}
    config = _with_rewards(make_config(tiny_model_dir, tmp_path / "run", steps=1), args=args)
    row = _metrics(train(config, reward_functions=["format", "soft_overlong_penalty", parity]))[0]
    assert {"rewards/format/mean", "rewards/soft_overlong_penalty/mean", "rewards/parity/mean"} <= set(row)


def test_a_graders_own_on_error_wins_over_rewards_on_error(grader, tiny_model_dir, tmp_path):
    """GRADING.md's per-grader option: `rewards.args = {URL = {on_error = ...}}` (it raised a TypeError)."""
    url = _url(grader, "/fail")
    name = f"127.0.0.1_{grader.server_address[1]}_fail"
    config = make_config(tiny_model_dir, tmp_path / "skip", steps=1)  # rewards.on_error: "raise"
    run = train(_with_rewards(config, functions=(url, "addition"), args={url: {"on_error": "skip", "retries": 0}}))
    assert _metrics(run)[0][f"rewards/{name}/ungraded"] == 16
    config = make_config(tiny_model_dir, tmp_path / "raise", steps=1)
    with pytest.raises(RewardError, match=f"{url} failed 1 time"):
        train(_with_rewards(config, functions=(url,), args={url: {"on_error": "raise", "retries": 0}},
                            on_error="skip"))
    # grpokit's own names in another entry's arguments: that entry's one line, not a clash in the call
    config = make_config(tiny_model_dir, tmp_path / "format", steps=1)
    with pytest.raises(RewardLoadError, match=r"reward 'format' got arguments \['on_error'\].*it accepts: pattern"):
        train(_with_rewards(config, functions=("format",), args={"format": {"on_error": "skip"}}))
    assert not (tmp_path / "format").exists()


def test_reward_functions_take_one_entry_or_a_list_as_trl_does(reward_model, tiny_model_dir, tmp_path):
    """A callable, a string or a loaded reward model alone (TRL's rule), a PreTrainedModel among them (scored
    as its folder), and what is none of these: one line naming its position, before the model loads."""
    import torch
    from transformers import AutoModelForSequenceClassification

    run = train(make_config(tiny_model_dir, tmp_path / "fn", steps=1), reward_functions=parity)
    assert "rewards/parity/mean" in _metrics(run)[0]
    run = train(make_config(tiny_model_dir, tmp_path / "name", steps=1), reward_functions="addition")
    assert "rewards/addition/mean" in _metrics(run)[0]
    model = AutoModelForSequenceClassification.from_pretrained(str(reward_model))
    run = train(make_config(tiny_model_dir, tmp_path / "object", steps=1, output={"completions_every": 1}),
                reward_functions=model)
    for line in (run / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        ends_in_digit = row["completion"][-1:].isdigit()
        assert row["rewards"]["digit-rm"] == pytest.approx(1.0 if ends_in_digit else -1.0, abs=1e-5), row
    bad = make_config(tiny_model_dir, tmp_path / "bad")
    for functions, says in [
            ([3], r"^reward_functions\[0\]: 3 \(type int\) is not a reward function; give a callable"),
            ([parity, torch.nn.Linear(2, 1)], r"^reward_functions\[1\]: a Linear is a torch module but no")]:
        with pytest.raises(RewardLoadError, match=says):
            train(bad, reward_functions=functions)
    two = _with_rewards(bad, functions=("addition", "numeric_match"), weights=(1.0, 2.0))
    with pytest.raises(RewardLoadError, match="rewards.weights has 2 weights for the 3 reward functions"):
        train(two, reward_functions=[parity, "addition", "numeric_match"])
    assert not (tmp_path / "bad").exists()
