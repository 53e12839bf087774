"""The GRPO variants side by side on the built-in tasks, on a CPU: `docs/VARIANTS.md`'s evidence.

    .venv/bin/python bench/variants_study.py --out docs/variants          # the study (~1 h on 1 core; see VARIANTS.md)
    .venv/bin/python bench/variants_study.py --out /tmp/v --quick        # a smoke run (~30 s)

For each task (2-digit addition; countdown with 3 numbers) it builds ONE warm start: a tiny
Qwen2-architecture model from `grpokit.models.tiny`, SFT on the task where a share of the targets is
deliberately wrong by a little (addition: off by 1, 2 or 10, as `grpokit demo`; countdown: one
operator or number swapped), so the right answer is often among the samples but a single sample
is right much less often. Then every preset (`algorithm.preset`, see `grpokit.config.presets`) trains
from that same warm start, with the same budget of steps, for each seed, and every
`--eval-every` steps the policy is scored on the same held-out prompts (answers sampled at the
training temperature): sampled accuracy, pass@k, the length of all, right and wrong answers.

Everything except the preset is shared: B prompts x G answers per step, the learning rate, and two
optimizer steps per generation batch (`train.minibatch_size` = half of it), so the second half is
off-policy and each preset's clipping is exercised (with one, every ratio is 1 and GSPO is GRPO).
DAPO's dynamic sampling draws more prompts per step than the others: the table counts answers
sampled per step, and its training reward is over the groups it kept (the held-out curves are the
like-for-like comparison).

The mismatch arms (`mm:*`) study the correction for a sampler whose log-probs are not the trainer's
(vLLM's situation) on a CPU: the built-in engine samples at temperature MISMATCH["sampler_temperature"]
while the trainer scores at 1.0, and each arm trains the same objective (dapo's loss without dynamic
sampling) with `algorithm.is_correction` none / token_truncate / token_mask / sequence_truncate /
sequence_mask at TRL's default bound (is_cap_max = 3, no lower bound); `mm:matched` is the same objective
with no mismatch, the ceiling.

Outputs under --out: `<task>_<metric>.svg` charts of the presets and `<task>_mismatch_<metric>.svg` of the
mismatch arms (mean over seeds), `table.md`, `results.json`. Runs are cached under --work
(`summary.json` per run), so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from grpokit.config.loading import config_from_dict  # noqa: E402
from grpokit.config.presets import PRESETS  # noqa: E402
from grpokit.demo import noisy_pair_sampler  # noqa: E402
from grpokit.evaluate import pass_at_k  # noqa: E402
from grpokit.models.loading import load_model_and_tokenizer  # noqa: E402
from grpokit.models.tiny import build_tiny_model  # noqa: E402
from grpokit.observe.charts import svg_chart  # noqa: E402
from grpokit.observe.tracking import read_metrics  # noqa: E402
from grpokit.rollout.decode import sample_groups  # noqa: E402
from grpokit.rollout.engines import HFEngine  # noqa: E402
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams  # noqa: E402
from grpokit.sft import sft  # noqa: E402
from grpokit.tasks import get_task  # noqa: E402
from grpokit.training.loop import train  # noqa: E402

TASKS = {
    "addition": dict(task_args={"digits": 2}, model=dict(hidden_size=64, num_layers=2), sft_steps=2000,
                     wrong_fraction=0.7, max_new_tokens=6),
    "countdown": dict(task_args={"num_numbers": 3, "max_number": 9, "max_target": 30},
                      model=dict(hidden_size=64, num_layers=2), sft_steps=3000, wrong_fraction=0.5, max_new_tokens=12),
}
GRPO = dict(prompts_per_step=16, group_size=8, learning_rate=1e-4, warmup_steps=10)
EVAL = dict(num_prompts=256, samples=8, seed=1234)
QUICK = dict(sft_steps=40, steps=6, eval_every=3, seeds=[0], num_prompts=16)
MISMATCH = dict(sampler_temperature=1.3, base={"loss_type": "dapo", "epsilon_high": 0.28}, is_cap_max=3.0)
MISMATCH_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def arms(presets: list[str], mismatch: bool) -> dict[str, dict]:
    """Arm name -> {"algorithm": fields, "sampler_temperature": the engine's own (None: the trainer's)}."""
    out = {p: {"algorithm": {"preset": p}, "sampler_temperature": None} for p in presets}
    if mismatch:
        base = MISMATCH["base"]
        out["mm:matched"] = {"algorithm": base, "sampler_temperature": None}
        for mode in MISMATCH_MODES:
            correction = {} if mode == "none" else {"is_correction": mode, "is_cap_max": MISMATCH["is_cap_max"]}
            out[f"mm:{mode}"] = {"algorithm": {**base, **correction},
                                 "sampler_temperature": MISMATCH["sampler_temperature"]}
    return out


class MismatchedEngine(HFEngine):
    """The built-in engine sampling at its own temperature: its log-probs are not the trainer's."""

    def __init__(self, model, tokenizer, temperature: float):
        super().__init__(model, tokenizer)
        self.temperature = temperature

    def generate(self, request: RolloutRequest) -> RolloutResult:
        sampling = dataclasses.replace(request.sampling, temperature=self.temperature)
        return super().generate(dataclasses.replace(request, sampling=sampling))


# ---- warm starts ------------------------------------------------------------------------


def noisy_countdown_sampler(task, rows, wrong_fraction: float):
    """(prompt, expression) pairs; in `wrong_fraction` of them one operator or one number is swapped."""

    def sample(rng: random.Random) -> tuple[str, str]:
        row = rng.choice(rows)
        target = task.sft_target(row, rng)
        if rng.random() < wrong_fraction:
            spots = [i for i, ch in enumerate(target) if ch in "+-*/"]
            i = rng.choice(spots)
            target = target[:i] + rng.choice([op for op in "+-*" if op != target[i]]) + target[i + 1:]
        return row["prompt"], target

    return sample


def warm_start(name: str, work: Path, sft_steps: int) -> Path:
    spec = TASKS[name]
    out = work / name / "warm_start"
    stamp = {"sft_steps": sft_steps, **{k: v for k, v in spec.items() if k != "max_new_tokens"}}
    if (out / "stamp.json").is_file() and json.loads((out / "stamp.json").read_text()) == stamp:
        return out
    task = get_task(name, **spec["task_args"])
    rows = task.generate(5000, seed=0, split="train")
    sampler = (noisy_pair_sampler if name == "addition" else noisy_countdown_sampler)(task, rows,
                                                                                      spec["wrong_fraction"])
    model, tokenizer = build_tiny_model(None, **spec["model"], num_heads=4, num_kv_heads=2, seed=0)
    t0 = time.perf_counter()
    sft(model, tokenizer, sampler, steps=sft_steps, batch_size=64, learning_rate=3e-3, seed=0)
    print(f"[{name}] warm start: {sft_steps} SFT steps in {time.perf_counter() - t0:.0f} s", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "stamp.json").write_text(json.dumps(stamp))
    return out


# ---- held-out evaluation ----------------------------------------------------------------


@torch.no_grad()
def score(model, tokenizer, task, rows, max_new_tokens: int, samples: int, seed: int) -> dict:
    """Sampled accuracy, pass@k and answer lengths (tokens, EOS included) on `rows`."""
    model.eval()
    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    gen = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(max_new_tokens, (tokenizer.eos_token_id,), tokenizer.pad_token_id, temperature=1.0)
    correct, lengths, truncated = [], [], []
    for start in range(0, len(rows), 64):
        ro = sample_groups(model, RolloutRequest(ids[start:start + 64], samples, sampling, gen))
        texts = tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(ro.completion_ids, ro.completion_mask)],
                                       skip_special_tokens=True)
        chunk = rows[start:start + 64]
        correct += [task.is_correct(t, chunk[i // samples]) for i, t in enumerate(texts)]
        lengths += ro.completion_lengths.tolist()
        truncated += ro.truncated.tolist()
    right = [n for n, c in zip(lengths, correct) if c]
    wrong = [n for n, c in zip(lengths, correct) if not c]
    per_prompt = [sum(correct[i:i + samples]) for i in range(0, len(correct), samples)]
    return {"accuracy": sum(correct) / len(correct),
            f"pass@{samples}": sum(pass_at_k(samples, c, samples) for c in per_prompt) / len(per_prompt),
            "length": statistics.fmean(lengths), "right_length": statistics.fmean(right) if right else None,
            "wrong_length": statistics.fmean(wrong) if wrong else None,
            "truncated": sum(truncated) / len(truncated)}


# ---- one run ----------------------------------------------------------------------------


def run_one(name: str, preset: str, arm: dict, seed: int, model_dir: Path, work: Path, steps: int, eval_every: int,
            held_out: list[dict]) -> dict:
    spec = TASKS[name]
    run_dir = work / name / preset.replace(":", "_") / f"seed{seed}"
    summary_path = run_dir / "summary.json"
    key = {"steps": steps, "eval_every": eval_every, "grpo": GRPO, "eval": EVAL, "task": spec, "arm": arm,
           "warm_start": json.loads((model_dir / "stamp.json").read_text())}
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if summary.get("key") == json.loads(json.dumps(key)):
            return summary
    G, B = GRPO["group_size"], GRPO["prompts_per_step"]
    config = config_from_dict({
        "model": {"path": str(model_dir)},
        "data": {"task": name, "task_args": spec["task_args"], "seed": seed},
        "rollout": {"group_size": G, "max_new_tokens": spec["max_new_tokens"], "temperature": 1.0},
        "algorithm": arm["algorithm"],
        "train": {"steps": steps, "prompts_per_step": B, "minibatch_size": B * G // 2, "seed": seed,
                  "num_threads": torch.get_num_threads(),  # --threads: the trainer would take every core
                  "learning_rate": GRPO["learning_rate"], "warmup_steps": GRPO["warmup_steps"]},
        "output": {"dir": str(run_dir), "overwrite": True, "console": False, "save_every": eval_every,
                   "keep_last": steps // eval_every + 1},
    })
    hot = arm["sampler_temperature"]
    engine = None if hot is None else (lambda config, model, tokenizer: MismatchedEngine(model, tokenizer, hot))
    t0 = time.perf_counter()
    train(config, engine=engine)
    seconds = time.perf_counter() - t0
    task = get_task(name, **spec["task_args"])
    evals = []
    for ckpt in sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        model, tokenizer = load_model_and_tokenizer(ckpt, device="cpu")
        evals.append({"step": int(ckpt.name.split("-")[1]),
                      **score(model, tokenizer, task, held_out, spec["max_new_tokens"], EVAL["samples"], EVAL["seed"])})
        shutil.rmtree(ckpt)
    keep = ("reward", "frac_reward_zero_std", "completions/mean_length", "entropy", "clip_ratio/region_mean",
            "kl", "dynamic_sampling/draws", "time/step", "sampling/logprob_gap_mean", "sampling/is_ratio_mean",
            "sampling/is_masked_share", "sampling/is_truncated_share", "vespo/phi_seq_mean")
    metrics = [{k: m[k] for k in ("step", *keep) if k in m} for m in read_metrics(run_dir)]
    summary = {"task": name, "preset": preset, "seed": seed, "steps": steps, "eval_every": eval_every, "key": key,
               "seconds": seconds, "evals": evals, "metrics": metrics}
    summary_path.write_text(json.dumps(summary))
    print(f"[{name}] {preset:20s} seed {seed}: {seconds:5.0f} s, held-out accuracy "
          f"{evals[-1]['accuracy']:.3f}", flush=True)
    return summary


# ---- aggregation, charts, table ---------------------------------------------------------


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _curve(runs, key, source):
    """Mean over seeds of `key` at each step (runs share their steps)."""
    by_step: dict[int, list] = {}
    for run in runs:
        for row in run[source]:
            by_step.setdefault(row["step"], []).append(row.get(key))
    return [(step, _mean(v)) for step, v in sorted(by_step.items())]


CHARTS = [  # (file suffix, title, key, source)
    ("accuracy", "held-out sampled accuracy (pass@1)", "accuracy", "evals"),
    ("pass_at_k", "held-out pass@8", "pass@8", "evals"),
    ("reward", "training reward (DAPO: over the groups it kept)", "reward", "metrics"),
    ("length", "held-out answer length (tokens)", "length", "evals"),
    ("wrong_length", "held-out length of wrong answers (tokens)", "wrong_length", "evals"),
    ("zero_std", "share of groups with no signal (all rewards equal)", "frac_reward_zero_std", "metrics"),
    ("clip", "clipped share of tokens (clip_ratio/region_mean)", "clip_ratio/region_mean", "metrics"),
    ("entropy", "token entropy", "entropy", "metrics"),
]


def _families(by_arm: dict) -> dict[str, dict]:
    """The presets and the mismatch arms, charted apart ("" and "mismatch_" in the file names)."""
    out = {"": {a: r for a, r in by_arm.items() if not a.startswith("mm:")},
           "mismatch_": {a: r for a, r in by_arm.items() if a.startswith("mm:")}}
    return {prefix: arms for prefix, arms in out.items() if arms}


def charts(results: dict, base: dict, out: Path) -> list[str]:
    files = []
    for name, by_arm in results.items():
        for prefix, by_preset in _families(by_arm).items():
            files += _family_charts(name, prefix, by_preset, base, out)
    return files


def _family_charts(name: str, prefix: str, by_preset: dict, base: dict, out: Path) -> list[str]:
    files = []
    for suffix, title, key, source in CHARTS:
        series = {}
        for preset, runs in by_preset.items():
            points = _curve(runs, key, source)
            if source == "evals" and key in base[name]:
                points = [(0, base[name][key])] + points
            series[preset] = points
        path = out / f"{name}_{prefix}{suffix}.svg"
        path.write_text(svg_chart(f"{name}: {title}, mean of {len(next(iter(by_preset.values())))} seeds",
                                  series, width=620, height=260))
        files.append(path.name)
    # the same held-out accuracy against the answers each preset sampled (DAPO samples more per step)
    series = {preset: [(0, base[name]["accuracy"])] + _accuracy_by_samples(runs)
              for preset, runs in by_preset.items()}
    svg = svg_chart(f"{name}: held-out accuracy against answers sampled (thousands)", series, width=620, height=260)
    path = out / f"{name}_{prefix}accuracy_vs_samples.svg"
    path.write_text(svg.replace(">step</text>", ">answers sampled (thousands)</text>"))
    files.append(path.name)
    return files


def _accuracy_by_samples(runs) -> list[tuple[float, float]]:
    B, G = GRPO["prompts_per_step"], GRPO["group_size"]
    points = []
    for i, step in enumerate(e["step"] for e in runs[0]["evals"]):
        sampled = [sum(m.get("dynamic_sampling/draws", 1) * B * G for m in r["metrics"] if m["step"] <= step) / 1000
                   for r in runs]
        points.append((statistics.fmean(sampled), statistics.fmean(r["evals"][i]["accuracy"] for r in runs)))
    return points


def _fmt(values, digits=3):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(results: dict, base: dict) -> str:
    G, B = GRPO["group_size"], GRPO["prompts_per_step"]
    lines = []
    for name, by_arm in results.items():
        by_preset = _families(by_arm).get("", {})
        b = base[name]
        lines += [f"**{name}** — warm start: held-out accuracy {b['accuracy']:.3f}, pass@8 {b['pass@8']:.3f}, "
                  f"answer length {b['length']:.2f}, wrong-answer length {b['wrong_length']:.2f}", "",
                  "| preset | accuracy (final) | best accuracy | pass@8 (final) | length | wrong-answer length "
                  "| no-signal groups | clipped tokens | answers sampled / step | s / run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for preset, runs in by_preset.items():
            final = [r["evals"][-1] for r in runs]
            half = lambda r, k: [m.get(k) for m in r["metrics"][len(r["metrics"]) // 2:]]  # noqa: E731
            draws = [_mean([m.get("dynamic_sampling/draws", 1) for m in r["metrics"]]) for r in runs]
            lines.append(
                f"| {preset} | {_fmt([e['accuracy'] for e in final])} "
                f"| {_fmt([max(e['accuracy'] for e in r['evals']) for r in runs])} "
                f"| {_fmt([e['pass@8'] for e in final])} | {_fmt([e['length'] for e in final], 2)} "
                f"| {_fmt([e['wrong_length'] for e in final], 2)} "
                f"| {_fmt([_mean(half(r, 'frac_reward_zero_std')) for r in runs], 2)} "
                f"| {_fmt([_mean(half(r, 'clip_ratio/region_mean')) for r in runs], 4)} "
                f"| {_mean(draws) * B * G:.0f} | {_fmt([r['seconds'] for r in runs], 0)} |")
        lines.append("")
        lines += _mismatch_table(name, _families(by_arm).get("mismatch_", {}))
    lines.append("Means ± standard deviations over seeds; length in tokens (one per character, EOS included); "
                 "accuracy and pass@8 on the held-out prompts at the last step; 'no-signal groups' and 'clipped "
                 "tokens' averaged over the second half of training; 'best accuracy' is each seed's best "
                 "evaluation.")
    return "\n".join(lines) + "\n"


def _mismatch_table(name: str, by_arm: dict) -> list[str]:
    if not by_arm:
        return []
    lines = [f"**{name}, sampler at temperature {MISMATCH['sampler_temperature']} vs trainer at 1.0** "
             f"(dapo loss, no dynamic sampling; is_cap_max = {MISMATCH['is_cap_max']:g}, no lower bound)", "",
             "| arm | accuracy (final) | best accuracy | pass@8 (final) | log-prob gap | mean weight "
             "| masked / truncated | s / run |", "|---|---|---|---|---|---|---|---|"]
    for arm, runs in by_arm.items():
        final = [r["evals"][-1] for r in runs]
        over = lambda k: [_mean([m.get(k) for m in r["metrics"]]) for r in runs]  # noqa: E731
        cut = [_mean([m.get("sampling/is_masked_share", m.get("sampling/is_truncated_share")) for m in r["metrics"]])
               for r in runs]
        lines.append(f"| {arm} | {_fmt([e['accuracy'] for e in final])} "
                     f"| {_fmt([max(e['accuracy'] for e in r['evals']) for r in runs])} "
                     f"| {_fmt([e['pass@8'] for e in final])} | {_fmt(over('sampling/logprob_gap_mean'), 3)} "
                     f"| {_fmt(over('sampling/is_ratio_mean'), 3)} | {_fmt(cut, 4)} "
                     f"| {_fmt([r['seconds'] for r in runs], 0)} |")
    return lines + [""]


def compact(results: dict) -> dict:
    """results.json: each run's evaluations and time, and the seed-mean training curves (not every row)."""
    out = {}
    for name, by_preset in results.items():
        out[name] = {}
        for preset, runs in by_preset.items():
            curves = {key: [(step, None if v is None else round(v, 4)) for step, v in _curve(runs, key, "metrics")]
                      for _, _, key, source in CHARTS if source == "metrics"}
            out[name][preset] = {"runs": [{k: r[k] for k in ("seed", "seconds", "evals")} for r in runs],
                                 "mean_curves": curves}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/variants", help="charts, table.md, results.json")
    p.add_argument("--work", default="runs/variants", help="warm starts and run folders (cached)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--no-mismatch", action="store_true", help="leave out the mismatch-correction arms (mm:*)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--lr", type=float, default=GRPO["learning_rate"], help="GRPO learning rate (all presets)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the tiny model gains little from more)")
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, one seed")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    GRPO["learning_rate"] = args.lr
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.quick:
        args.steps, args.eval_every, args.seeds = QUICK["steps"], QUICK["eval_every"], QUICK["seeds"]
        EVAL["num_prompts"] = QUICK["num_prompts"]
    out, work = Path(args.out), Path(args.work) / ("quick" if args.quick else "full")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results, base = {}, {}
    for name in args.tasks:
        spec = TASKS[name]
        model_dir = warm_start(name, work, QUICK["sft_steps"] if args.quick else spec["sft_steps"])
        task = get_task(name, **spec["task_args"])
        held_out = task.generate(EVAL["num_prompts"], seed=EVAL["seed"], split="eval")
        model, tokenizer = load_model_and_tokenizer(model_dir, device="cpu")
        base[name] = score(model, tokenizer, task, held_out, spec["max_new_tokens"], EVAL["samples"], EVAL["seed"])
        print(f"[{name}] warm start held-out: {json.dumps({k: round(v, 3) for k, v in base[name].items() if v})}",
              flush=True)
        results[name] = {arm: [run_one(name, arm, spec_, seed, model_dir, work, args.steps, args.eval_every, held_out)
                               for seed in args.seeds]
                         for arm, spec_ in arms(args.presets, not args.no_mismatch).items()}
    files = charts(results, base, out)
    (out / "table.md").write_text(table(results, base))
    settings = {"grpo": GRPO, "eval": EVAL, "tasks": TASKS, "steps": args.steps, "eval_every": args.eval_every,
                "seeds": args.seeds, "minibatches_per_generation_batch": 2, "threads": args.threads,
                "mismatch": None if args.no_mismatch else MISMATCH}
    (out / "results.json").write_text(json.dumps({"settings": settings, "warm_start": base, "runs": compact(results)}))
    print(f"study finished in {time.perf_counter() - started:.0f} s; charts: {', '.join(files)}; "
          f"table: {out / 'table.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
