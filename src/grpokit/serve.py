"""`grpokit serve MODEL`: vLLM's own OpenAI-compatible server, started with what the trainer needs from it.

The trainer then samples through it (`rollout.engine = "vllm"`, `rollout.vllm = {server = "http://HOST:PORT"}`,
rollout/vllm_server.py). This is `vllm serve` with four things set: the log-probs of the sampling
distribution (`--logprobs-mode processed_logprobs`, as the colocated engine), vLLM's NCCL weight transfer
(`--weight-transfer-config`) and the endpoints that drive it (`VLLM_SERVER_DEV_MODE=1`), and with `--lora-rank`
adapters loaded at run time (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`). The process becomes vLLM's
(exec): its logs, its signals, its exit code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import sys

from grpokit.errors import UserError

# what grpokit serve sets itself, and the flag of its own that sets it
OWN_FLAGS = {"--host": "--host", "--port": "--port", "--dtype": "--dtype", "--tensor-parallel-size":
             "--tensor-parallel-size", "-tp": "--tensor-parallel-size", "--gpu-memory-utilization":
             "--gpu-memory-utilization", "--max-model-len": "--max-model-len", "--enable-lora": "--lora-rank",
             "--max-lora-rank": "--lora-rank", "--logprobs-mode": "always processed_logprobs, the trainer's",
             "--weight-transfer-config": "always NCCL, what the trainer sends with"}


def serve_command(args) -> tuple[list[str], dict]:
    """The vLLM command line and its environment for `args` (checked first: one error naming the flag)."""
    if args.devices and not re.fullmatch(r"\d+(,\d+)*", args.devices):
        raise UserError(f"--devices: {args.devices!r} is not a list of GPU indices such as 1 or 2,3")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError("--gpu-memory-utilization: must be in (0, 1]")
    from grpokit.rollout.vllm import VLLM_LORA_RANKS

    if args.lora_rank is not None and not 1 <= args.lora_rank <= VLLM_LORA_RANKS[-1]:
        raise UserError(f"--lora-rank: must be in 1-{VLLM_LORA_RANKS[-1]} (the adapter's r; vLLM serves no larger)")
    for flag, value, low in (("--port", args.port, 1), ("--tensor-parallel-size", args.tensor_parallel_size, 1),
                             ("--max-model-len", args.max_model_len, 0)):
        if value < low or (flag == "--port" and value > 65535):
            raise UserError(f"{flag}: {value} is out of range ({'1-65535' if flag == '--port' else f'>= {low}'})")
    devices = [int(d) for d in args.devices.split(",")] if args.devices else []
    if len(set(devices)) != len(devices):
        raise UserError(f"--devices: {args.devices} names a GPU twice")
    if devices and args.tensor_parallel_size > len(devices):
        raise UserError(f"--tensor-parallel-size: {args.tensor_parallel_size} GPUs, but --devices gives "
                        f"{len(devices)} ({args.devices})")
    try:
        extra = shlex.split(args.vllm_args)
    except ValueError as e:
        raise UserError(f"--vllm-args: {args.vllm_args!r} cannot be read as flags ({e})") from None
    for flag in extra:
        name = flag.split("=", 1)[0].replace("_", "-")
        if name in OWN_FLAGS:
            raise UserError(f"--vllm-args: {name} is grpokit serve's own ({OWN_FLAGS[name]}); leave it out of "
                            "--vllm-args")
    if os.path.exists(args.model) and not os.path.isdir(args.model):
        raise UserError(f"MODEL: {args.model} is a file; give a model folder or a Hub name")
    folder = os.path.expanduser(args.model)
    if args.model.startswith(("/", "./", "../", "~")) and not os.path.isdir(folder):
        raise UserError(f"MODEL: there is no folder {args.model}; give a model folder or a Hub name (org/name)")
    if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(f"MODEL: {args.model} has no config.json; give a Hugging Face model folder")
    try:
        family, _, _, _, address = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--host: {args.host} is not an address of this machine ({e.strerror})") from None
    with socket.socket(family, socket.SOCK_STREAM) as s:  # now, not after vLLM has spent a minute loading
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME-WAIT is no obstacle
        try:
            s.bind(address)
        except OSError as e:
            raise UserError(f"--port: {args.host}:{args.port} cannot be used ({e.strerror}); choose another port, "
                            "or check --host") from None
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--host", args.host,
            "--port", str(args.port), "--dtype", args.dtype, "--gpu-memory-utilization",
            str(args.gpu_memory_utilization), "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if args.lora_rank is not None:  # vLLM accepts only some ranks as its maximum: the smallest that holds r
        argv += ["--enable-lora", "--max-lora-rank", str(next((k for k in VLLM_LORA_RANKS if k >= args.lora_rank),
                                                              args.lora_rank))]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if args.devices:
        env["CUDA_VISIBLE_DEVICES"] = args.devices
    return argv + extra, env


def server_url(host: str, port: int) -> str:
    """The address the trainer gives as rollout.vllm.server for a server listening on host:port."""
    host = "localhost" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host  # IPv6 in brackets
    return f"http://{host}:{port}"


def cmd_serve(args) -> int:
    argv, env = serve_command(args)
    if importlib.util.find_spec("vllm") is None:
        raise UserError("grpokit serve starts vLLM, which is not installed: pip install 'grpokit[vllm]' on a CUDA "
                        "machine")
    print(f"starting: {shlex.join(argv)}\nthen train with: rollout.engine = \"vllm\" and "
          f"rollout.vllm = {{server = \"{server_url(args.host, args.port)}\"}}", flush=True)
    os.execve(argv[0], argv, env)
    return 0  # not reached


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start vLLM as a server for rollout.vllm.server (generation on its own GPUs)")
    p.add_argument("model", help="a model folder or Hub name (the policy's starting weights)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--devices", default="", help="GPU indices for vLLM, e.g. 1 or 2,3 (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one model is split over")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the served weights' dtype")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU vLLM may take")
    p.add_argument("--max-model-len", type=int, default=0, help="prompt + answer tokens (0: the model's)")
    p.add_argument("--lora-rank", type=int, default=None, help="serve LoRA adapters of this rank (model.lora.r)")
    p.add_argument("--vllm-args", default="", help="more `vllm serve` flags, in one string: "
                   "--vllm-args=\"--enforce-eager --seed 1\" (with =)")
    p.set_defaults(func=cmd_serve)
