"""What every fault case asserts, in one place: the CLI run in a subprocess, then its contract.

A user-reachable fault ends in exit code 2 and exactly one `error:` line that names the field or
file (and says the fix), with no traceback; a clean stop ends in exit code 0. Folders are compared
byte for byte before and after with `snapshot`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CliResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def describe(self) -> str:
        return (f"grpokit {' '.join(self.args)}\nexit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-3000:]}")


def run_cli(*args, cwd: Path = ROOT, env: dict | None = None, timeout: float = 300) -> CliResult:
    """`python -m grpokit.cli ARGS` in a fresh process (one torch thread: cases run side by side)."""
    args = [str(a) for a in args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", *args], cwd=cwd, env=full_env, capture_output=True,
                       text=True, timeout=timeout)
    return CliResult(args, r.returncode, r.stdout, r.stderr)


def assert_user_error(result: CliResult, *mentions: str) -> str:
    """Exit 2, one `error:` line, no traceback, and the line names each of `mentions`; returns the line."""
    assert result.returncode == 2, result.describe()
    assert "Traceback" not in result.stderr + result.stdout, result.describe()
    lines = result.error_lines
    assert len(lines) == 1, result.describe()
    for text in mentions:
        assert text in lines[0], f"{text!r} not in the error line\n{result.describe()}"
    return lines[0]


def assert_clean_exit(result: CliResult) -> None:
    assert result.returncode == 0, result.describe()
    assert "Traceback" not in result.stderr + result.stdout, result.describe()
    assert not result.error_lines, result.describe()


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (empty if it does not exist)."""
    folder = Path(folder)
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


PARITY_REWARD = '''
import os, time
from pathlib import Path

def parity(completions, **kwargs):
    """A reward with signal on a random model; test hooks (environment variables) make it fail on purpose."""
    step_file = Path(os.environ["FAULT_COUNTER"]) if "FAULT_COUNTER" in os.environ else None
    if step_file is not None and step_file.parent.is_dir():
        calls = int(step_file.read_text()) + 1 if step_file.exists() else 1
        step_file.write_text(str(calls))
        if os.environ.get("FAULT_RAISE_AT") == str(calls):
            raise ValueError("boom")
        if os.environ.get("FAULT_HANG_AT") == str(calls):
            time.sleep(3600)
        if os.environ.get("FAULT_FILL_AT") == str(calls):  # fill the disk, leaving FAULT_FILL_LEAVE bytes
            import shutil
            target = Path(os.environ["FAULT_FILL_PATH"])
            free = shutil.disk_usage(target.parent).free - int(os.environ.get("FAULT_FILL_LEAVE", "0"))
            with open(target, "wb") as f:
                while free > 0:
                    n = min(free, 1 << 20)
                    try:
                        f.write(b"\\0" * n); f.flush()
                    except OSError:
                        break
                    free -= n
    return [sum(ord(ch) % 2 == 0 for ch in c) / max(1, len(c)) for c in completions]
'''


def write_train_config(folder: Path, model_dir: Path, run: Path, *, steps: int = 3, data_path: Path | None = None,
                       rewards: list[str] | None = None, reward_source: str = PARITY_REWARD,
                       save_every: int | None = 1, keep_last: int | None = 10, extra: str = "") -> Path:
    """A small valid `grpokit train` config (2 prompts x 4 answers of <= 4 tokens, by default a checkpoint
    every step, 10 kept; None leaves `save_every`/`keep_last` to the config's defaults) written to
    `folder/run.toml`: the addition task (or the prompts in `data_path`), graded by `rewards` (default:
    the `parity` function in `reward_source`, the one above unless told, written next to it)."""
    import json
    import textwrap

    if rewards is None:
        (folder / "fault_rewards.py").write_text(reward_source)
        rewards = [str(folder / "fault_rewards.py") + ":parity"]
    data = f"path = {json.dumps(str(data_path))}" if data_path else 'task = "addition"\nnum_prompts = 16'
    checkpoints = "".join(f"{key} = {value}\n" for key, value in (("save_every", save_every), ("keep_last", keep_last))
                          if value is not None)
    cfg = folder / "run.toml"
    cfg.write_text(textwrap.dedent(f"""\
        [model]
        path = {json.dumps(str(model_dir))}
        [data]
        {{data}}
        [rewards]
        functions = {json.dumps(rewards)}
        [rollout]
        group_size = 4
        max_new_tokens = 4
        [train]
        steps = {steps}
        prompts_per_step = 2
        learning_rate = 1e-3
        [output]
        dir = {json.dumps(str(run))}
        console = false
        """).replace("{data}", data) + checkpoints + extra)
    return cfg


TOOL_CALL = '<tool_call>{"name": "t", "arguments": {}}</tool_call>'


def build_calling_model(path: Path, call: str = TOOL_CALL) -> Path:
    """A tiny model whose every assistant turn is `call` then EOS (so it calls the tool `t` at once, and again
    after each result), with the tiny tool chat template: hostile tools reached through `grpokit train`.

    The call is one token of the character tokenizer; the layers add nothing (o_proj, down_proj zero), so
    the logits depend on the current token only: after "assistant: "'s space the call, after the call EOS,
    each by a margin of hundreds of logits (sampling at any temperature gives them)."""
    import torch

    from grpokit.models.tiny import TOOL_CHAT_TEMPLATE, TOOL_WORDS, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(words=TOOL_WORDS + (call,))
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    model, tokenizer = build_tiny_model(None, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                        num_kv_heads=1)
    model.config.tie_word_embeddings = False
    space, token, eos = tokenizer.convert_tokens_to_ids(" "), tokenizer.convert_tokens_to_ids(call), \
        tokenizer.eos_token_id
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embed = model.get_input_embeddings().weight  # [V, 16]: a constant, "is the space", "is the call"
        embed.zero_()
        embed[:, 0], embed[space, 1], embed[token, 2] = 1, 1, 1
        head = torch.zeros_like(embed)
        head[eos, 0], head[eos, 1], head[token, 1] = 10, -30, 30
        model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
