"""`grpokit train | config | eval | sft | demo | report | explain | tiny-model` — the command line.

User errors (a bad config field, a missing file, a failing reward function) end
with one `error: ...` line that names the field or row and the fix, and exit
code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys

from grpokit.errors import ConfigError, UserError, say


def _key_values(items: list[str]) -> dict:
    from grpokit.config.loading import parse_override

    if bad := next((i for i in items or [] if "=" not in i or "." in i.split("=", 1)[0]), None):  # --task-arg
        raise ConfigError(f"--task-arg {bad!r}: expected KEY=VALUE, e.g. --task-arg digits=3")
    return {path[1]: value for path, value in (parse_override(f"arg.{item}") for item in items or [])}


def cmd_train(args) -> int:
    from grpokit.config.loading import load_config

    config = load_config(args.config, args.set)  # a bad field fails here, before torch is imported
    launcher = (args.nproc_per_node, args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    if launcher != (None,) * 4 and "LOCAL_RANK" not in os.environ:  # this machine's processes of the run
        from grpokit.models.parallel import launch  # (each says its error; torchrun's traceback is not shown)
        command = _train_command(args)  # the processes get it whole: their "continue with" is the one to run again
        nproc = 1 if args.nproc_per_node is None else args.nproc_per_node
        return launch(nproc, shlex.split(command)[1:], rendezvous=_rendezvous(args),
                      lost=lambda what: _lost(what, config.output.dir, command))
    from grpokit.training.loop import train
    from grpokit.training.safekeeping import lost_process_error
    from grpokit.training.stopping import continue_command

    try:
        run_dir = train(config, resume=args.resume, command=_train_command(args))
    except RuntimeError as e:  # another torchrun process lost outside the steps (setup): one line, as in them
        hint = continue_command(_train_command(args))
        if isinstance(e, UserError) or not (lost := lost_process_error(e, config.output.dir, hint)):
            raise
        raise lost from None
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        print(f"run folder: {run_dir}")
    return 0


def _rendezvous(args) -> list[str] | None:
    """torchrun's words for `--nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]` (c10d: the launcher whose host is
    HOST keeps the rendezvous's store at PORT; the others join it); None on one machine (`--standalone`)."""
    if args.nnodes is None:
        if args.rdzv_endpoint or args.rdzv_id:
            raise ConfigError("--rdzv-endpoint and --rdzv-id belong to a run over several machines: add --nnodes N "
                              "(the same command on each machine)")
        return None
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError(f"--nnodes {args.nnodes}: the machines meet at a rendezvous; add --rdzv-endpoint HOST:PORT "
                          "(a free port on one of them, e.g. the first machine's host name and 29500), the same on "
                          "every machine")
    if args.nnodes == 1 and not args.rdzv_endpoint:
        return None
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT: give a host name or address of "
                          "one of the machines and a free port on it (1-65535), e.g. --rdzv-endpoint node1:29500")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except OSError as e:  # torch's c10d retries an unknown host for minutes, in C++ warnings
        raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint}: the host {host!r} cannot be resolved ({e}); give "
                          "a host name or address every machine can reach") from None
    return ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
            "--rdzv-id", args.rdzv_id or "grpokit"]


def _lost(what: str, run_dir: str, command: str) -> str:
    """The launcher's line for `what` happened to a process it started: the run folder's state, the command that
    continues (training/safekeeping.py)."""
    from grpokit.training.safekeeping import lost_message
    from grpokit.training.stopping import continue_command

    return lost_message(what, run_dir, continue_command(command))


def cmd_config(args) -> int:
    from grpokit.config.loading import load_config, to_toml

    config = load_config(args.config, args.set)  # every check of `train` that needs no model or data
    sys.stdout.write(json.dumps(config.to_dict(), indent=2, ensure_ascii=False) + "\n" if args.json else
                     to_toml(config))
    return 0


def _train_command(args) -> str:
    """The command line of this run as the user typed it (for "continue with: ..." messages)."""
    prog = sys.argv[0] if os.path.basename(sys.argv[0]) == "grpokit" else "grpokit"
    words = [prog, "train", args.config, *[w for item in args.set for w in ("--set", item)]]
    launched = [w for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes),
                                      ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-id", args.rdzv_id))
                if value is not None for w in (flag, str(value))]  # how it was launched: the same again
    return shlex.join(words + launched + (["--resume"] if args.resume else []))


def cmd_eval(args) -> int:
    import math

    for flag, value in (("--num-prompts", args.num_prompts), ("--samples", args.samples),
                        ("--max-new-tokens", args.max_new_tokens), ("--max-tool-calls", args.max_tool_calls)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(args.tool_timeout) and args.tool_timeout > 0):
        raise ConfigError(f"--tool-timeout must be a number of seconds > 0, got {args.tool_timeout}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ConfigError(f"--temperature must be a number > 0 (sampling divides the logits by it), got "
                          f"{args.temperature}; for greedy answers read greedy_accuracy (the greedy pass runs unless "
                          "--no-greedy)")
    if args.no_tools and args.tool:
        raise ConfigError("--no-tools and --tool contradict each other; give one")
    from grpokit.evaluate import check_context, eval_prompts, eval_rows_and_specs, eval_tools, evaluate, load_eval_model
    from grpokit.rollout.vision import tool_images_for

    rows, specs, prompt_column, task = eval_rows_and_specs(
        task=args.task, task_args=_key_values(args.task_arg), data=args.data, prompt_column=args.prompt_column,
        rewards=args.reward, num_prompts=args.num_prompts, seed=args.data_seed)
    model, tokenizer, vision = load_eval_model(args.model, rows, data=args.data, dtype=args.dtype, device=args.device,
                                               tools=bool(args.tool))  # tools: a model they cannot run, refused
    tools = eval_tools(task=None if args.no_tools else task, tools=args.tool, timeout_s=args.tool_timeout,
                       tokenizer=tokenizer)
    ids, media = eval_prompts(tokenizer, rows, prompt_column, tools, vision)  # image rows: their pixels too
    max_new_tokens = args.max_new_tokens or (128 if tools else 32)
    check_context(model, ids, max_new_tokens)
    result = evaluate(model, tokenizer, rows, ids, specs, samples_per_prompt=args.samples, temperature=args.temperature,
                      max_new_tokens=max_new_tokens, seed=args.seed, prompt_column=prompt_column,
                      greedy=not args.no_greedy, tools=tools, max_tool_turns=args.max_tool_calls, media=media,
                      tool_images=tool_images_for(model, args.model) if tools else None)
    result["model"] = args.model
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:>18}: {value}")
    return 0


def cmd_sft(args) -> int:
    import math
    from pathlib import Path

    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ConfigError(f"--lr must be a number > 0, got {args.lr}; e.g. --lr 1e-3")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out!r} is a file; sft saves a model folder there: give a folder path")
    model_files = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "tokenizer.json", "tokenizer_config.json")
    held = next((name for name in model_files if (out / name).exists()), None) if out.is_dir() else None
    if held and not args.overwrite:
        raise ConfigError(f"--out {args.out!r} already holds a model ({held}); choose another folder, or pass "
                          "--overwrite to replace its files")
    base = next(a for a in (out, *out.absolute().parents) if a.exists())  # the folder mkdir would start from
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {args.out!r} cannot be created: {str(base)!r} is "
                          f"{'a file' if not base.is_dir() else 'not writable'}; choose another folder")
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.sft import sft, sft_pair_sampler

    sample_pair = sft_pair_sampler(task=args.task, task_args=_key_values(args.task_arg), data=args.data,
                                   prompt_column=args.prompt_column, completion_column=args.completion_column)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=args.device, field="--model")
    every = max(1, args.steps // 10)
    sft(model, tokenizer, sample_pair, steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
        seed=args.seed,
        on_step=lambda s, loss: print(f"sft step {s}/{args.steps} loss {loss:.4f}") if s % every == 0 else None)
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
    except OSError as e:
        raise ConfigError(f"--out {args.out!r}: saving the model failed ({e.strerror or e}); free space or choose "
                          "another folder") from e
    if not (out / "config.json").is_file():  # save_pretrained logs, rather than raises, some failures
        raise ConfigError(f"--out {args.out!r}: the model was not saved there; choose another folder")
    print(f"saved: {args.out}")
    return 0


def cmd_demo(args) -> int:
    from grpokit.demo import run_demo
    from grpokit.demo_tools import run_tool_demo
    from grpokit.demo_vision import run_vision_demo

    run, folder = {"addition": (run_demo, "demo_run"), "tools": (run_tool_demo, "demo_tools_run"),
                   "vision": (run_vision_demo, "demo_vision_run")}[args.task]
    run(args.out or folder, quick=args.quick, seed=args.seed)
    return 0


def cmd_report(args) -> int:
    from grpokit.observe.report import build_report

    out = build_report(args.run_dir, args.out, groups_per_step=args.groups, max_steps=args.steps)
    print(f"report: {out}")
    return 0


def cmd_explain(args) -> int:
    from grpokit.models.loading import check_model_folder, load_model, load_tokenizer
    from grpokit.observe.explain import TrustRegion, explain, format_explanation

    check_model_folder(args.old, field="--old")  # both folders before either model loads
    check_model_folder(args.new, field="--new")
    tokenizer = load_tokenizer(args.old, field="--old")
    old = load_model(args.old, dtype=args.dtype, device=args.device, field="--old").eval()
    new = load_model(args.new, dtype=args.dtype, device=args.device, field="--new").eval()
    result = explain(old, new, tokenizer, args.prompt, args.answer, chat=args.chat, temperature=args.temperature,
                     top_k=args.top_k, trust_region=TrustRegion(args.epsilon, args.epsilon_high),
                     advantage=args.advantage)
    print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else format_explanation(result))
    return 0


def cmd_tiny_model(args) -> int:
    from pathlib import Path

    if args.hidden_size < 8 or args.hidden_size % 8:
        raise ConfigError(f"--hidden-size must be a multiple of 8 (4 attention heads of an even size), got "
                          f"{args.hidden_size}; e.g. --hidden-size 128")
    if args.layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {args.layers}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT {args.out!r} is a file; tiny-model writes a model folder: give a new folder path")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"OUT {args.out!r} is a folder that is not empty; tiny-model does not overwrite: give a "
                          "new or empty folder")
    base = next(a for a in (out, *out.absolute().parents) if a.exists())
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"OUT {args.out!r} cannot be created: {str(base)!r} is "
                          f"{'a file' if not base.is_dir() else 'not writable'}; choose another folder")
    from grpokit.models.tiny import build_tool_tokenizer
    from grpokit.models.tiny_vision import build_tiny_any

    build_tiny_any(args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.seed,
                   tokenizer=build_tool_tokenizer() if args.tools else None)
    print(f"saved: {args.out}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpokit")
    except PackageNotFoundError:  # run from a source tree that is not installed: the package's own
        return getattr(sys.modules.get("grpokit"), "__version__", "unknown")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        empty = action.default is None or action.default is False or action.default in ([], "", argparse.SUPPRESS)
        if action.option_strings and not empty and "(default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a missing flag, a bad choice) as the CLI's other errors: one `error:` line, exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


def _add_choice(p, flag: str, choices: tuple[str, ...], **kwargs) -> None:
    """An option whose help lists `choices`; a typo names the closest one and lists them all."""

    def parse(text: str) -> str:
        if text not in choices:
            from grpokit.config.checks import did_you_mean

            raise argparse.ArgumentTypeError(f"{text!r}{did_you_mean(text, choices)} is not supported; choose "
                                             f"one of {', '.join(choices)}")
        return text

    p.add_argument(flag, type=parse, choices=choices, metavar="{" + ",".join(choices) + "}", **kwargs)


def _add_load_args(p, models: str = "the model") -> None:
    _add_choice(p, "--dtype", ("float32", "bfloat16", "float16"), default="float32", help=f"dtype {models} load in")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps or xpu")


def _add_model_args(p) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    _add_load_args(p)


def _add_config_args(p) -> None:
    p.add_argument("config", help="TOML config file (every field: docs/CONFIG.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config field (repeatable), e.g. --set train.steps=10")


def _add_data_args(p, rows: str) -> None:
    from grpokit.config.variants import TASK_NAMES

    p.add_argument("--task", help=f"built-in task: {', '.join(TASK_NAMES)} (or --data)")
    p.add_argument("--task-arg", action="append", metavar="KEY=VALUE", help="task option (repeatable), e.g. digits=3")
    p.add_argument("--data", help=f"{rows}: a JSONL / JSON / CSV / Parquet file or a datasets save_to_disk "
                                  "folder (instead of --task)")
    p.add_argument("--prompt-column", default="prompt", help="prompt column (with --data)")


def build_parser() -> argparse.ArgumentParser:
    """`grpokit`'s parser: one sub-parser per command, in the order `grpokit --help` lists them."""
    parser = _Parser(prog="grpokit", description="GRPO fine-tuning of Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"grpokit {_version()}",
                        help="print grpokit's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from grpokit.serve import add_parser as add_serve_parser

    for add in (_add_train_parser, _add_config_parser, _add_eval_parser, _add_sft_parser, _add_demo_parser,
                _add_report_parser, _add_explain_parser, _add_tiny_model_parser, add_serve_parser):
        add(sub)
    return parser


def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="run GRPO from a TOML config")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="start N torchrun processes on this machine")
    p.add_argument("--nnodes", type=int, metavar="N", help="a run over N machines: this command on each (torchrun's "
                                                           "c10d rendezvous; --nproc-per-node defaults to 1)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="with --nnodes: where the machines meet (a free port "
                                                                "on one of them; its launcher keeps the store)")
    p.add_argument("--rdzv-id", metavar="ID", help="with --nnodes: the run's name at the rendezvous (default grpokit)")
    p.set_defaults(func=cmd_train)


def _add_config_parser(sub) -> None:
    p = sub.add_parser("config", help="print the resolved config (defaults and preset filled in) and check it",
                       description="Print the resolved config (defaults and the preset filled in, --set applied) "
                                   "as TOML or JSON, and check it without loading a model. Every field: "
                                   "docs/CONFIG.md.")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(func=cmd_config)


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="sampled accuracy, pass@k and mean reward on held-out prompts")
    _add_model_args(p)
    _add_data_args(p, "prompts")
    p.add_argument("--reward", action="append", default=[],
                   help="reward: a built-in name, file.py:function, a reward-model folder or an http(s):// grader "
                        "URL (repeatable; needed with --data, replaces a --task's own)")
    p.add_argument("--num-prompts", type=int, default=200, help="prompts evaluated, >= 1")
    p.add_argument("--data-seed", type=int, default=12345, help="seed of generated task prompts (held out by default)")
    p.add_argument("--samples", type=int, default=8, help="answers per prompt (k of pass@k), >= 1")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per answer, >= 1 (default: 32; with tools 128, counting the tool results)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    p.add_argument("--tool", action="append", default=[],
                   help="a tool the model may call, file.py:function (repeatable); a task with its own tool "
                        "(multiplication) brings it")
    p.add_argument("--no-tools", action="store_true", help="evaluate a tool task (multiplication) without its tool")
    p.add_argument("--max-tool-calls", type=int, default=8, help="tool-calling turns per answer (default: 8), >= 1")
    p.add_argument("--tool-timeout", type=float, default=30.0, help="seconds per tool call (default: 30)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_eval)


def _add_sft_parser(sub) -> None:
    p = sub.add_parser("sft", help="short supervised warm start before RL")
    _add_model_args(p)
    _add_data_args(p, "prompt/completion pairs")
    p.add_argument("--completion-column", default="completion", help="target column (with --data)")
    p.add_argument("--out", required=True, help="folder the trained model is saved to (a new folder)")
    p.add_argument("--overwrite", action="store_true", help="replace the model files already in --out")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps, >= 1")
    p.add_argument("--batch-size", type=int, default=64, help="examples per step, >= 1")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate, > 0")
    p.add_argument("--seed", type=int, default=0, help="seed of the examples' order and initialisation")
    p.set_defaults(func=cmd_sft)


def _add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="build a tiny model, warm-start it, run GRPO, show before/after")
    _add_choice(p, "--task", ("addition", "tools", "vision"), default="addition",
                help="addition: 2-digit addition; tools: 2-digit multiplication with a calculator tool called inside "
                     "each rollout; vision: a tiny Qwen2-VL counts the shapes of one colour in an image")
    p.add_argument("--out", default="", help="run folder (default: demo_run, demo_tools_run, demo_vision_run)")
    p.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    p.add_argument("--seed", type=int, default=0, help="seed of the whole demo (model, data, sampling)")
    p.set_defaults(func=cmd_demo)


def _add_report_parser(sub) -> None:
    p = sub.add_parser("report",
                       help="write a self-contained HTML report of a run folder (curves, groups, diagnostics)")
    p.add_argument("run_dir", help="a run folder (output.dir) with metrics.jsonl")
    p.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html)")
    p.add_argument("--groups", type=int, default=4, help="sampled groups shown per step")
    p.add_argument("--steps", type=int, default=3, help="steps whose sampled groups are shown (first, last, between)")
    p.set_defaults(func=cmd_report)


def _add_explain_parser(sub) -> None:
    p = sub.add_parser("explain", help="per-token probabilities and policy ratios of one answer under two checkpoints")
    p.add_argument("--old", required=True, help="model folder of the policy that sampled the answer")
    p.add_argument("--new", required=True, help="model folder after the update")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--answer", required=True, help="the answer text, scored after the prompt")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user message with the chat template")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampling temperature training scores with")
    p.add_argument("--top-k", type=int, default=5, help="tokens shown per step (of either model)")
    p.add_argument("--epsilon", type=float, default=0.2, help="lower clip: the trust region starts at 1 - epsilon")
    p.add_argument("--epsilon-high", type=float, default=None, help="upper clip (default: epsilon)")
    p.add_argument("--advantage", type=float, default=None, help="the answer's advantage: shows which tokens clip")
    _add_load_args(p, "both models")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_explain)


def _add_tiny_model_parser(sub) -> None:
    from grpokit.models.tiny import TINY_ARCHS, TINY_VLM_ARCHS

    p = sub.add_parser("tiny-model", help="write a tiny random-init model + char tokenizer to a folder")
    p.add_argument("out", help="a new (or empty) folder")
    _add_choice(p, "--arch", TINY_ARCHS + TINY_VLM_ARCHS, default="qwen2", help="architecture (HF model_type)")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size, a multiple of 8")
    p.add_argument("--layers", type=int, default=4, help="decoder layers, >= 1")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    p.add_argument("--tools", action="store_true", help="a chat template that lists tools and renders tool calls")
    p.set_defaults(func=cmd_tiny_model)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # our own progress bar is the one to watch
    if "transformers" in sys.modules:  # already imported (called from Python): the variable came too late
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except UserError as e:
        if not getattr(e, "quiet", False):  # quiet: another process says it (a lost one: models/parallel.py)
            say(e)  # under torchrun, a start-up error once per machine
        return e.exit_code
    except KeyboardInterrupt:
        print("stopped: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":  # a torchrun process leaves without the interpreter's teardown (models/parallel.py)
    sys.exit(main()) if int(os.environ.get("WORLD_SIZE", "1")) < 2 else __import__(
        "grpokit.models.parallel", fromlist=["exit_rank"]).exit_rank(main())
