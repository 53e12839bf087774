"""Per-turn credit on the gridworld task, on a CPU: outcome-only GRPO against GiGPO and MT-GRPO.

    nice -n 10 .venv/bin/python bench/turn_credit_study.py                 # the study (docs/AGENTS.md)
    nice -n 10 .venv/bin/python bench/turn_credit_study.py --quick         # a smoke run (~1 min)

One warm start for every arm: a tiny Qwen2-architecture model (grpokit.models.tiny) with a character
tokenizer and the tool chat template, SFT on gridworld walks (`GridWorldTask.tool_trace`) where a share
of the moves goes the wrong way, so the model calls `move` and often arrives, but with detours that cost
moves (`tools.max_calls`). From that same checkpoint each arm trains with the same budget and seed, and
only `algorithm.turn_advantage` differs: "none" (the outcome only: every turn gets its answer's
advantage), "gigpo" (step groups by cell) and "mt_grpo" (turn rewards by turn index). The step reward is
the move's progress toward the goal, the outcome reaching it.

Held-out success (`eval/accuracy`: the share of sampled walks that end on the goal, on the task's eval
split) is measured before training and every `--eval-every` steps, with the wall time of each run.
Results: `bench/out/turn_credit_study.json` (every run's curve and settings, the machine); the warm
start is cached under --work, so a rerun of the arms skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=256)
TASK = dict(size=4, min_distance=2, max_distance=4)
SFT = dict(steps=800, batch_size=32, learning_rate=3e-3, wrong_move=0.3)
GRPO = dict(steps=80, prompts_per_step=4, group_size=8, learning_rate=1e-3, max_new_tokens=128, max_calls=6)
EVAL = dict(every=10, num_prompts=32, samples_per_prompt=4, temperature=1.0)
ARMS = ("none", "gigpo", "mt_grpo")
SEEDS = (0, 1, 2)
QUICK = dict(sft_steps=30, grpo_steps=2, eval_every=1, eval_prompts=4, seeds=(0,))

# Single tokens beside the characters, as a real tokenizer's vocabulary has them (see demo_tools.WORDS): a
# move is then 6 sampled tokens (the tags, the call's opening, the direction, the closing, EOS).
CALL_OPENING = '{"name": "move", "arguments": {"direction": "'
WORDS = (CALL_OPENING, '"}}', "\ntool: ", "\nassistant: ", "user: ", "tools: ", "right", "left", "up", "down")


def trace_sampler(task, rows, tokenizer, tools):
    """(prompt text, target segments) pairs for `sft`: each move's call trained, its tool result (the
    tokens the rollout appends) untrained, the final answer trained."""
    from grpokit.data.prompts import render_prompt
    from grpokit.rollout.tools import ToolResult, tool_suffix_ids
    from grpokit.tasks.multiplication import call_text

    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def sample(rng: random.Random):
        row = rng.choice(rows)
        messages, answer = task.tool_trace(row, rng, wrong_move=SFT["wrong_move"], max_moves=GRPO["max_calls"])
        segments = []
        for call, result in zip(messages[::2], messages[1::2]):
            segments += [(encode(call_text([call])) + [eos], True),
                         (tool_suffix_ids(tokenizer, [ToolResult("move", result["content"], False)]), False)]
        return render_prompt(tokenizer, row["prompt"], tools=tools.schemas), segments + [(encode(answer) + [eos], True)]

    return sample


def warm_start(work: Path, sft_steps: int, seed: int = 0) -> Path:
    """The SFT checkpoint every arm starts from (built once; cached in `work/sft`)."""
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.models.tiny import TOOL_CHAT_TEMPLATE, TOOL_WORDS, build_char_tokenizer, build_tiny_model
    from grpokit.rollout.tools import ToolBox
    from grpokit.sft import sft
    from grpokit.tasks import get_task

    done = work / "sft"
    if (done / "config.json").exists():
        return done
    task = get_task("gridworld", **TASK)
    tokenizer = build_char_tokenizer(words=TOOL_WORDS + WORDS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    build_tiny_model(work / "base", tokenizer=tokenizer, **MODEL, seed=seed)
    model, tokenizer = load_model_and_tokenizer(work / "base")
    tools = ToolBox([task.environment()().move])
    sample = trace_sampler(task, task.generate(2000, seed=seed, split="train"), tokenizer, tools)
    t0 = time.perf_counter()
    sft(model, tokenizer, sample, steps=sft_steps, batch_size=SFT["batch_size"], learning_rate=SFT["learning_rate"],
        seed=seed, on_step=lambda s, loss: print(f"  sft step {s}/{sft_steps} loss {loss:.3f}", flush=True)
        if s % max(1, sft_steps // 5) == 0 else None)
    model.save_pretrained(done)
    tokenizer.save_pretrained(done)
    (work / "sft_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return done


def evaluate_warm_start(model_dir: Path, eval_prompts: int) -> dict:
    """Held-out success of the warm start, with the settings `[eval]` uses during the runs."""
    from grpokit.data.prompts import render_prompt
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.rollout.environments import Environments
    from grpokit.rollout.request import SamplingParams
    from grpokit.tasks import get_task
    from grpokit.training.evaluation import EvalSettings, ToolUse, evaluate

    task = get_task("gridworld", **TASK)
    model, tokenizer = load_model_and_tokenizer(model_dir)
    environments = Environments(task.environment())
    rows = task.generate(eval_prompts, seed=0, split="eval")
    ids = [tokenizer(render_prompt(tokenizer, r["prompt"], tools=environments.toolbox.schemas),
                     add_special_tokens=False)["input_ids"] for r in rows]
    sampling = SamplingParams(GRPO["max_new_tokens"], pad_token_id=tokenizer.pad_token_id,
                              temperature=EVAL["temperature"])
    result = evaluate(model.eval(), tokenizer, rows, ids, environments.reward_specs(),
                      EvalSettings(sampling, samples_per_prompt=EVAL["samples_per_prompt"], seed=0),
                      tool_use=ToolUse(environments.toolbox, GRPO["max_calls"], environments))
    return {k: float(v) for k, v in result.items()}


def walk_quality(model_dir: Path, eval_prompts: int, seed: int = 0) -> dict:
    """How the policy in `model_dir` walks on the held-out prompts (EVAL's samples, temperature, seed): the
    share of walks that end on the goal, the share of moves that did not lead closer (a step away, the wall,
    an unknown direction), and the moves a successful walk makes beyond the shortest path."""
    import torch

    from grpokit.data.prompts import render_prompt
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.rollout.multiturn import sample_conversations
    from grpokit.rollout.request import RolloutRequest, SamplingParams
    from grpokit.rollout.tools import ToolBox
    from grpokit.tasks import get_task
    from grpokit.tasks.gridworld import distance, walk

    task = get_task("gridworld", **TASK)
    model, tokenizer = load_model_and_tokenizer(model_dir)
    rows = task.generate(eval_prompts, seed=0, split="eval")
    K = EVAL["samples_per_prompt"]
    envs = [task.environment()() for _ in range(len(rows) * K)]
    for i, env in enumerate(envs):
        env.reset(**rows[i // K])
    boxes = [ToolBox([env.move]) for env in envs]
    ids = [tokenizer(render_prompt(tokenizer, r["prompt"], tools=boxes[0].schemas), add_special_tokens=False)
           ["input_ids"] for r in rows]
    sampling = SamplingParams(GRPO["max_new_tokens"], (tokenizer.eos_token_id,), tokenizer.pad_token_id,
                              EVAL["temperature"])
    request = RolloutRequest(ids, K, sampling, torch.Generator().manual_seed(seed), tools=boxes)
    sample_conversations(model.eval(), request, tokenizer=tokenizer, max_tool_turns=GRPO["max_calls"])
    wrong = moves = 0
    excess, success = [], []
    for env in envs:
        start, goal = env.start, env.goal
        cells = walk(start, env.moves, task.size)
        wrong += sum(distance(b, goal) >= distance(a, goal) for a, b in zip(cells, cells[1:]))
        moves += len(env.moves)
        success.append(env.get_reward())
        if env.get_reward() == 1.0:
            excess.append(len(env.moves) - distance(start, goal))
    return {"success": statistics.mean(success), "wrong_move_share": wrong / max(moves, 1),
            "moves_per_walk": moves / len(envs),
            "excess_moves_when_solved": statistics.mean(excess) if excess else None}


def run_arm(model_dir: Path, out: Path, arm: str, seed: int, steps: int, eval_every: int, eval_prompts: int) -> dict:
    from grpokit.config.schema import (
        AlgorithmConfig,
        Config,
        DataConfig,
        EvalConfig,
        ModelConfig,
        OutputConfig,
        RolloutConfig,
        ToolsConfig,
        TrainConfig,
    )
    from grpokit.observe.tracking import read_metrics
    from grpokit.training.loop import train

    config = Config(
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(task="gridworld", task_args=dict(TASK), num_prompts=2000, seed=seed),
        rollout=RolloutConfig(group_size=GRPO["group_size"], max_new_tokens=GRPO["max_new_tokens"], temperature=1.0),
        algorithm=AlgorithmConfig(loss_type="dapo", beta=0.0, turn_advantage=arm),
        train=TrainConfig(steps=steps, prompts_per_step=GRPO["prompts_per_step"], learning_rate=GRPO["learning_rate"],
                          warmup_steps=0, seed=seed, num_threads=1),
        tools=ToolsConfig(max_calls=GRPO["max_calls"]),
        eval=EvalConfig(every=eval_every, num_prompts=eval_prompts, samples_per_prompt=EVAL["samples_per_prompt"],
                        temperature=EVAL["temperature"], seed=0),
        output=OutputConfig(dir=str(out), overwrite=True, console=False, save_every=0),
    )
    t0 = time.perf_counter()
    run_dir = train(config)
    seconds = time.perf_counter() - t0
    metrics = read_metrics(run_dir)
    keys = ("eval/accuracy", "eval/tool_call_share", "eval/reward_mean")
    elapsed, curve = 0.0, []  # seconds of training steps so far (time/step: evaluations not counted)
    for m in metrics:
        elapsed += m.get("time/step") or 0.0
        if "eval/accuracy" in m:
            curve.append({"step": m["step"], "train_seconds": round(elapsed, 2), **{k: m[k] for k in keys if k in m}})
    train_curve = [{"step": m["step"], "reward": m.get("reward"), "calls": m.get("tools/call_frequency"),
                    "progress": move_progress(m), "step_group_size": m.get("turns/step_group_size"),
                    "step_seconds": m.get("time/step")} for m in metrics]
    from grpokit.training.checkpoint import list_checkpoints

    quality = walk_quality(list_checkpoints(run_dir)[-1], eval_prompts)
    return {"arm": arm, "seed": seed, "seconds": seconds, "eval": curve, "train": train_curve, "walks": quality}


def move_progress(m: dict) -> float | None:
    """The mean step reward of the sampled moves of the first turns (1.0: every move led closer; -1: away)."""
    values = [m[f"turns/{k}/reward_mean"] for k in range(4) if f"turns/{k}/reward_mean" in m]
    return statistics.mean(values) if values else None


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": sys.version.split()[0], "torch": __import__("torch").__version__,
            "threads": __import__("torch").get_num_threads()}


def summarise(runs: list[dict], before: dict) -> list[dict]:
    """Per arm: held-out success at the last evaluation (mean and each seed) and seconds per run."""
    table = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        final = [r["eval"][-1]["eval/accuracy"] for r in mine]
        curve = [statistics.mean(r["eval"][i]["eval/accuracy"] for r in mine) for i in range(len(mine[0]["eval"]))]
        walks = {k: [r["walks"][k] for r in mine] for k in mine[0]["walks"]}
        table.append({"arm": arm, "before": before.get("accuracy"), "final_mean": statistics.mean(final),
                      "final_per_seed": final, "curve_mean": curve,
                      "curve_steps": [e["step"] for e in mine[0]["eval"]],
                      "walks_mean": {k: statistics.mean(v) for k, v in walks.items() if None not in v},
                      "walks_per_seed": walks,
                      "seconds_mean": statistics.mean(r["seconds"] for r in mine)})
    return table


def markdown(report: dict) -> str:
    """docs/AGENTS.md's table from a results file: held-out success per evaluation step (mean over seeds),
    the final success per seed, and how the final policies walk."""
    steps = report["table"][0]["curve_steps"]
    before = report["before"]
    head = ["arm", "step 0", *[f"step {s}" for s in steps], "final, per seed", "wrong moves", "extra moves (solved)",
            "s / run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    w = before["walks"]
    lines.append(f"| warm start | {before['accuracy']:.3f} | " + " | ".join("" for _ in steps) +
                 f" | | {w['wrong_move_share']:.3f} | {w['excess_moves_when_solved']:.2f} | |")
    for row in report["table"]:
        walks, per_seed = row["walks_mean"], " / ".join(f"{v:.3f}" for v in row["final_per_seed"])
        lines.append(f"| `{row['arm']}` | {row['before']:.3f} | " + " | ".join(f"{v:.3f}" for v in row["curve_mean"]) +
                     f" | {per_seed} | {walks['wrong_move_share']:.3f} | "
                     f"{walks.get('excess_moves_when_solved', float('nan')):.2f} | {row['seconds_mean']:.0f} |")
    return "\n".join(lines)


def figures(report: dict, folder: Path) -> list[Path]:
    """Held-out success (mean over seeds) against steps and against training seconds, as SVG charts."""
    from grpokit.observe.charts import svg_chart

    folder.mkdir(parents=True, exist_ok=True)
    start = report["before"]["accuracy"]
    by_arm = {arm: [r for r in report["runs"] if r["arm"] == arm] for arm in ARMS}
    by_arm = {arm: runs for arm, runs in by_arm.items() if runs}

    def mean_curve(runs, x_key):
        n = min(len(r["eval"]) for r in runs)
        return [(0.0, start)] + [(statistics.mean(r["eval"][i][x_key] for r in runs),
                                  statistics.mean(r["eval"][i]["eval/accuracy"] for r in runs)) for i in range(n)]

    seeds = len(next(iter(by_arm.values())))
    paths = []
    for x_key, name, label in (("step", "success_vs_steps.svg", "step"),
                               ("train_seconds", "success_vs_seconds.svg", "training seconds")):
        svg = svg_chart(f"gridworld: held-out success against {label}, mean of {seeds} seeds",
                        {arm: mean_curve(runs, x_key) for arm, runs in by_arm.items()}, width=620, height=260)
        paths.append(folder / name)
        paths[-1].write_text(svg.replace(">step</text>", f">{label}</text>"))
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/grpokit-turn-credit", help="warm start and run folders")
    p.add_argument("--out", default="bench/out/turn_credit_study.json")
    p.add_argument("--steps", type=int, default=GRPO["steps"])
    p.add_argument("--eval-every", type=int, default=EVAL["every"])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and stop")
    p.add_argument("--figures", default="", help="write the SVG charts of --out into this folder and stop")
    args = p.parse_args(argv)
    if args.table or args.figures:
        report = json.loads(Path(args.out).read_text())
        print(markdown(report) if args.table else "\n".join(map(str, figures(report, Path(args.figures)))))
        return
    work = Path(args.work) / ("quick" if args.quick else "study")
    work.mkdir(parents=True, exist_ok=True)
    sft_steps = QUICK["sft_steps"] if args.quick else SFT["steps"]
    steps = QUICK["grpo_steps"] if args.quick else args.steps
    eval_every = QUICK["eval_every"] if args.quick else args.eval_every
    eval_prompts = QUICK["eval_prompts"] if args.quick else EVAL["num_prompts"]
    seeds = QUICK["seeds"] if args.quick else tuple(int(s) for s in args.seeds.split(","))
    __import__("torch").set_num_threads(1)  # one core: the machine is shared (runs take train.num_threads = 1 too)
    model_dir = warm_start(work, sft_steps)
    before = evaluate_warm_start(model_dir, eval_prompts)
    before["walks"] = walk_quality(model_dir, eval_prompts)
    print(f"warm start: held-out success {before['accuracy']:.3f}, walks {before['walks']}", flush=True)
    out = Path(args.out)
    settings = {"model": MODEL, "task": TASK, "sft": {**SFT, "steps": sft_steps}, "grpo": {**GRPO, "steps": steps},
                "eval": {**EVAL, "every": eval_every, "num_prompts": eval_prompts}}
    previous = json.loads(out.read_text()) if out.exists() and not args.quick else {}
    runs = previous.get("runs", []) if previous.get("settings") == settings else []  # resume: keep finished runs
    for seed in seeds:
        for arm in args.arms.split(","):
            if any(r["arm"] == arm and r["seed"] == seed for r in runs):
                continue
            result = run_arm(model_dir, work / f"{arm}-{seed}", arm, seed, steps, eval_every, eval_prompts)
            runs.append(result)
            print(f"{arm:8s} seed {seed}: held-out success {[round(e['eval/accuracy'], 3) for e in result['eval']]} "
                  f"in {result['seconds']:.0f} s", flush=True)
            report = {"settings": settings, "machine": machine(), "before": before, "runs": runs,
                      "table": summarise(runs, before),
                      "sft_seconds": (work / "sft_seconds.txt").read_text().strip()
                      if (work / "sft_seconds.txt").exists() else None}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1))
    for row in summarise(runs, before):
        print(f"{row['arm']:8s} before {row['before']:.3f} -> {[round(v, 3) for v in row['curve_mean']]} "
              f"{[round(v, 3) for v in row['final_per_seed']]}  walks {row['walks_mean']}  "
              f"{row['seconds_mean']:.0f} s a run")


if __name__ == "__main__":
    main()
