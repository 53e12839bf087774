"""`grpokit demo --task tools`: GRPO teaches a tiny model to use a calculator.

1. Build a tiny Qwen2-architecture model and a character tokenizer whose chat template renders
   tools and Hermes-style `<tool_call>{json}</tool_call>` calls — nothing comes from a hub.
2. Warm-start it with `sft` on 2-digit multiplication conversations where the tool is used
   imperfectly: in part of them the model guesses without calling it, in part it calls it with an
   operand off by one (and reports the wrong result). The call and the answer are trained; the
   tool's result is context, masked out of the loss as in the GRPO update.
3. Evaluate on held-out prompts: accuracy, the share of answers that call the tool, the share of
   calls that fail. Run GRPO with the task's exact-match reward (the tool runs inside each
   rollout), evaluate again with the same sampling settings, and print before / after.

The model cannot multiply in its head: what GRPO can reinforce is calling the tool, with the
right expression, and copying its result.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

# Demo settings, chosen on a 2-core CPU (see docs/TOOLS.md "The demo" for the measured run).
MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=256)


TASK = dict(name="multiplication", digits=2)


SFT = dict(steps=1200, batch_size=32, learning_rate=3e-3, no_call=0.5, wrong_argument=0.2)


GRPO = dict(steps=150, prompts_per_step=8, group_size=8, learning_rate=1e-3, max_new_tokens=100, max_calls=2)


EVAL = dict(num_prompts=100, samples_per_prompt=4, temperature=1.0)


QUICK = dict(sft_steps=20, grpo_steps=2, eval_prompts=8)


# Single tokens beside the characters, as a real tokenizer's vocabulary has them: the tool-call tags (Qwen's
# added tokens), the call's JSON boilerplate and the template's role markers (a BPE vocabulary spends a few
# tokens on each; the character tokenizer would spend 52 on the call's opening alone). An answer that calls the
# tool is then 9 tokens for the call, 5 for the tool's result and 3-4 for the answer, instead of about 90.
CALL_OPENING = '{"name": "calculator", "arguments": {"expression": "'
WORDS = (CALL_OPENING, '"}}', "\ntool: ", "\nassistant: ", "user: ", "tools: ")


def trace_sampler(task, rows, tokenizer, tools, *, no_call: float, wrong_argument: float):
    """(prompt text, target segments) pairs for `sft`: the rendered prompt with the tool list; the
    call turn and the final answer trained, the tool results (as the chat template renders them,
    exactly the tokens the rollout appends) untrained."""
    from grpokit.data.prompts import render_prompt
    from grpokit.rollout.tools import ToolResult, tool_suffix_ids
    from grpokit.tasks.multiplication import call_text

    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def sample(rng: random.Random):
        row = rng.choice(rows)
        messages, answer = task.tool_trace(row, rng, no_call=no_call, wrong_argument=wrong_argument)
        prompt = render_prompt(tokenizer, row["prompt"], tools=tools.schemas)
        segments = []
        if messages:
            results = [ToolResult(m["name"], m["content"], False) for m in messages if m["role"] == "tool"]
            segments += [(encode(call_text(messages)) + [eos], True), (tool_suffix_ids(tokenizer, results), False)]
        return prompt, segments + [(encode(answer) + [eos], True)]

    return sample


def run_tool_demo(out: str | Path = "demo_tools_run", *, quick: bool = False, seed: int = 0,
                  rollout: dict | None = None) -> dict:
    from rich.console import Console

    from grpokit.config.schema import (
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        OutputConfig,
        RolloutConfig,
        ToolsConfig,
        TrainConfig,
    )
    from grpokit.data.prompts import render_prompt
    from grpokit.demo import before_after, prepare_demo_folder, sparkline, write_summary
    from grpokit.evaluate import EvalSettings, SamplingParams, ToolUse, evaluate
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.models.tiny import TOOL_CHAT_TEMPLATE, TOOL_WORDS, build_char_tokenizer, build_tiny_model
    from grpokit.observe.tracking import read_metrics
    from grpokit.rollout.tools import ToolBox
    from grpokit.sft import sft
    from grpokit.tasks import get_task
    from grpokit.training.checkpoint import list_checkpoints
    from grpokit.training.loop import train

    console = Console()
    out = prepare_demo_folder(out)
    started = time.perf_counter()
    task = get_task(TASK["name"], digits=TASK["digits"])
    tools = ToolBox(task.tools())
    held_out = task.generate(QUICK["eval_prompts"] if quick else EVAL["num_prompts"], seed=seed, split="eval")
    train_rows = task.generate(5000, seed=seed, split="train")  # disjoint from the held-out prompts

    console.rule("[bold]1. tiny Qwen2 model + character tokenizer with a tool chat template, built locally")
    tokenizer = build_char_tokenizer(words=TOOL_WORDS + WORDS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    build_tiny_model(out / "base", tokenizer=tokenizer, **MODEL, seed=seed)
    model, tokenizer = load_model_and_tokenizer(out / "base")
    console.print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; tools: "
                  f"{', '.join(tools.functions)}")

    console.rule("[bold]2. supervised warm start (the tool used imperfectly)")
    steps = QUICK["sft_steps"] if quick else SFT["steps"]
    sample = trace_sampler(task, train_rows, tokenizer, tools, no_call=SFT["no_call"],
                           wrong_argument=SFT["wrong_argument"])
    sft(model, tokenizer, sample, steps=steps, batch_size=SFT["batch_size"], learning_rate=SFT["learning_rate"],
        seed=seed, on_step=lambda s, loss: console.print(f"  sft step {s}/{steps}  loss {loss:.3f}")
        if s % max(1, steps // 6) == 0 else None)
    model.save_pretrained(out / "sft")
    tokenizer.save_pretrained(out / "sft")

    ids = [tokenizer(render_prompt(tokenizer, r["prompt"], tools=tools.schemas), add_special_tokens=False)["input_ids"]
           for r in held_out]
    settings = EvalSettings(SamplingParams(GRPO["max_new_tokens"], pad_token_id=tokenizer.pad_token_id,
                                           temperature=EVAL["temperature"]),
                            samples_per_prompt=EVAL["samples_per_prompt"], seed=seed)
    tool_use = ToolUse(tools, GRPO["max_calls"])
    specs = task.reward_functions()
    console.rule("[bold]3. held-out evaluation before GRPO")
    before = evaluate(model, tokenizer, held_out, ids, specs, settings, tool_use=tool_use)
    console.print(before)

    console.rule("[bold]4. GRPO (the calculator runs inside each rollout)")
    config = Config(
        model=ModelConfig(path=str(out / "sft")),
        data=DataConfig(task=TASK["name"], task_args={"digits": TASK["digits"]}, seed=seed),
        rollout=RolloutConfig(group_size=GRPO["group_size"], max_new_tokens=GRPO["max_new_tokens"], temperature=1.0,
                              **(rollout or {})),  # e.g. {"mode": "async"} (bench/async_rollout.py)
        algorithm=AlgorithmConfig(loss_type="dapo", beta=0.0),
        train=TrainConfig(steps=QUICK["grpo_steps"] if quick else GRPO["steps"],
                          prompts_per_step=GRPO["prompts_per_step"],
                          learning_rate=GRPO["learning_rate"], warmup_steps=5, seed=seed),
        tools=ToolsConfig(max_calls=GRPO["max_calls"]),
        output=OutputConfig(dir=str(out / "grpo"), overwrite=True, completions_every=25),
    )
    run_dir = train(config, rows=train_rows)
    model, tokenizer = load_model_and_tokenizer(list_checkpoints(run_dir)[-1])

    console.rule("[bold]5. held-out evaluation after GRPO (same sampling settings)")
    after = evaluate(model, tokenizer, held_out, ids, specs, settings, tool_use=tool_use)
    metrics = read_metrics(run_dir)
    summary = write_summary(out, before, after, started, config.train.steps, run_dir)
    k = EVAL["samples_per_prompt"]
    console.print(before_after(
        "held-out 2-digit multiplication with a calculator tool, sampled at temperature 1.0", before, after,
        [("accuracy", "sampled accuracy (pass@1)"), (f"pass@{k}", f"pass@{k}"), ("greedy_accuracy", "greedy_accuracy"),
         ("tool_call_share", "answers that call the tool"), ("tool_failure_rate", "tool calls that fail")]))
    console.print(f"reward per step: {sparkline([m['reward'] for m in metrics])}")
    console.print(f"tool calls per answer: {sparkline([m.get('tools/call_frequency') for m in metrics])}")
    console.print(f"demo finished in {summary['seconds']:.0f} s; metrics: {run_dir / 'metrics.jsonl'}; "
                  f"HTML report: grpokit report {run_dir}")
    return summary
