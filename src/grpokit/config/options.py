"""Checks of the table-valued options, `rollout.vllm = {...}` and `model.lora = {...}`: each key's
type and range, with the field named in the error (their sections live in schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from grpokit.config.checks import check, checked_value, installed, one_of
from grpokit.config.variants import ROLLOUT_MODES

WEIGHT_TRANSFERS = ("auto", "nccl", "folder")  # how full weights reach a server: "auto" = NCCL where it can run


def _option(default, example: str, applies: str = "both"):
    """A `rollout.vllm` key: its default, an example for errors, and which engine it applies to ("colocated":
    a server is started with its own settings, `grpokit serve --gpu-memory-utilization ...`; "server": how full
    weights reach a server, rollout/vllm/weights.py; "both")."""
    return field(default=default, metadata={"example": example, "applies": applies})


@dataclass(frozen=True)
class VLLMOptions:
    """`rollout.vllm = {...}` typed, with its defaults (`RolloutConfig.vllm_options`; the TOML keeps the table the
    user wrote, and every key it may hold is a field here). `server` set: vLLM samples as a server over HTTP
    (rollout/vllm/server.py); unset: a `vllm.LLM` colocated in the training process (rollout/vllm/colocated.py)."""

    gpu_memory_utilization: float = _option(0.3, "0.3", "colocated")
    enable_sleep_mode: bool = _option(False, "true", "colocated")
    kv_cache_gib: int = _option(1, "1", "colocated")  # vLLM's CPU build: its KV cache in GiB of RAM
    max_model_len: int | None = _option(None, "4096", "colocated")
    enforce_eager: bool = _option(False, "true", "colocated")
    dtype: str | None = _option(None, '"bfloat16"', "colocated")  # None: model.dtype
    # a vLLM server (grpokit serve), or a list of several (requests spread by load); None: colocated
    server: str | tuple[str, ...] | None = _option(None, '"http://localhost:8000"')
    server_timeout_s: float = _option(600.0, "600")  # every call to the server waits at most this long
    weight_transfer: str = _option("auto", '"folder"', "server")  # WEIGHT_TRANSFERS
    weight_folder: str | None = _option(None, '"/shared/grpokit-weights"', "server")  # default: under TMPDIR
    sync_bucket_mb: float = _option(512, "512", "server")  # the folder's safetensors shards, MB each

    @classmethod
    def of(cls, table: dict) -> "VLLMOptions":
        """The `rollout.vllm` table typed (check_vllm refuses an unknown key and a value of another type; the
        checks that run before it read the known keys only)."""
        return cls(**{k: v for k, v in table.items() if k in cls.__dataclass_fields__})

    @property
    def servers(self) -> tuple[str, ...]:
        """The server addresses, one or several, each without a trailing slash (empty: colocated)."""
        if self.server is None:
            return ()
        return tuple(url.rstrip("/") for url in ((self.server,) if isinstance(self.server, str) else self.server))


_TYPES = {"float": float, "int": int, "bool": bool, "str": str}
# each key's type (its annotation's first type) and example, in the order the config reference lists them
VLLM_OPTIONS = {f.name: (_TYPES[f.type.split("|")[0].strip()], f.metadata["example"]) for f in fields(VLLMOptions)}
COLOCATED_ONLY = tuple(f.name for f in fields(VLLMOptions) if f.metadata["applies"] == "colocated")
SERVER_ONLY = tuple(f.name for f in fields(VLLMOptions) if f.metadata["applies"] == "server")


def server_address_problem(url: str) -> str | None:
    """What is wrong with a vLLM server's address, or None: http(s), a host, a port 1-65535, no path (the
    OpenAI habit of ending it in /v1 would send every call to /v1/v1/...)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{url!r} is not an address ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        return f"{url!r} is not an http(s) address with a host"
    if port is not None and not 1 <= port <= 65535:
        return f"{url!r} has port {port}"
    extra = [(what, part) for what, part in (("a path", parts.path.rstrip("/")), ("a query", parts.query),
                                             ("a fragment", parts.fragment)) if part]
    if extra:
        return f"{url!r} has {extra[0][0]} ({extra[0][1]}); the address alone is wanted (no /v1)"
    return None


def same_server(url: str) -> str:
    """An address as a key that two spellings of one server share: scheme and host in lower case, the scheme's
    default port written out, no trailing slash (localhost and 127.0.0.1 stay two: a name may resolve elsewhere)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url.rstrip("/"))
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{port}"


def _checked_servers(value) -> str | tuple[str, ...]:
    """`rollout.vllm.server`: one address, or a list of several, each checked; a server listed twice refused."""
    name, example = "rollout.vllm.server", '"http://localhost:8000" or ["http://localhost:8000", "http://localhost:8001"]'
    if not isinstance(value, (list, tuple)):
        return checked_value(name, str, value, example)
    urls = checked_value(name, tuple[str, ...], value, example)
    check(len(urls) >= 1, name, f"is an empty list: give one server's address or several; e.g. {name} = {example}")
    seen: dict[str, str] = {}
    for url in urls:
        problem = server_address_problem(url)
        check(problem is None, name, f"{problem}: give each server's address, e.g. \"http://localhost:8000\"")
        check(same_server(url) not in seen, name,
              f"lists the server {url} twice ({seen.get(same_server(url))!r} and {url!r}): each server once; two "
              "entries would spread requests over one server and push every update into it twice")
        seen[same_server(url)] = url
    return urls


def check_vllm(rollout) -> None:
    unknown = set(rollout.vllm) - set(VLLM_OPTIONS)
    check(not unknown, "rollout.vllm",
           f"unknown option(s) {', '.join(sorted(map(str, unknown)))}; known: {', '.join(VLLM_OPTIONS)}")
    options = {k: _checked_servers(v) if k == "server" else
               checked_value(f"rollout.vllm.{k}", VLLM_OPTIONS[k][0], v, VLLM_OPTIONS[k][1])
               for k, v in rollout.vllm.items()}
    object.__setattr__(rollout, "vllm", options)
    check(0 < options.get("gpu_memory_utilization", 0.3) <= 1, "rollout.vllm.gpu_memory_utilization",
           "must be in (0, 1]: the share of the GPU's memory vLLM may take")
    check(options.get("sync_bucket_mb", 512) > 0, "rollout.vllm.sync_bucket_mb", "must be > 0 (MB per shard)")
    check(options.get("kv_cache_gib", 1) >= 1, "rollout.vllm.kv_cache_gib", "must be >= 1 (GiB of RAM, whole)")
    one_of(options.get("weight_transfer", "auto"), WEIGHT_TRANSFERS, "rollout.vllm.weight_transfer")
    check(options.get("max_model_len", 1) >= 1, "rollout.vllm.max_model_len", "must be >= 1")
    one_of(options.get("dtype", "auto"), ("auto", "float32", "bfloat16", "float16"), "rollout.vllm.dtype")
    if "server" in options:
        server = options["server"]
        problem = server_address_problem(server) if isinstance(server, str) else None  # a list's: checked above
        check(problem is None, "rollout.vllm.server",
               f"{problem}: give the server's address, e.g. \"http://localhost:8000\"")
        check(isinstance(server, str) or len(server) == 1 or options.get("weight_transfer") != "nccl",
               "rollout.vllm.weight_transfer",
               f"is \"nccl\", and NCCL to several servers ({len(server)} in rollout.vllm.server) is not built yet "
               "(one NCCL group per server): use \"folder\" (one folder every server reloads; on one host or a shared "
               "filesystem) or \"auto\", or one server")
        given = [k for k in COLOCATED_ONLY if k in options]
        check(not given, f"rollout.vllm.{given[0] if given else ''}",
               "applies to the colocated engine only: a server's settings are given where it starts (grpokit "
               "serve MODEL --gpu-memory-utilization ... --dtype ...); remove it, or remove rollout.vllm.server")
    else:
        given = [k for k in SERVER_ONLY if k in options]
        check(not given, f"rollout.vllm.{given[0] if given else ''}",
               "is how full weights reach a vLLM server (a colocated engine reloads them in process): set "
               "rollout.vllm.server too, or remove it")
    check("server_timeout_s" not in options or "server" in options, "rollout.vllm.server_timeout_s",
           "is how long to wait for rollout.vllm.server: set the server too")
    check(options.get("server_timeout_s", 1) > 0, "rollout.vllm.server_timeout_s", "must be > 0")


def check_lora(lora) -> None:
    check(isinstance(lora, dict), "model.lora", "must be a table, e.g. {r = 8, alpha = 16}")
    unknown = set(lora) - {"r", "alpha", "target_modules"}
    check(not unknown, "model.lora", f"unknown key(s) {', '.join(sorted(unknown))}; known: r, alpha, target_modules")
    check(checked_value("model.lora.r", int, lora.get("r", 8), "8") >= 1, "model.lora.r", "must be an integer >= 1")
    check(checked_value("model.lora.alpha", float, lora.get("alpha", 16), "16") > 0, "model.lora.alpha", "must be > 0")
    targets = lora.get("target_modules", "all-linear")
    if not isinstance(targets, str):
        checked_value("model.lora.target_modules", tuple[str, ...], targets, '["q_proj", "v_proj"] or "all-linear"')
    check(not lora or installed("peft"), "model.lora", "needs the peft package: pip install 'grpokit[peft]'")


def check_async(rollout) -> None:
    """`rollout.mode` and the asynchronous rollout's knobs (training/rollout_source.py)."""
    one_of(rollout.mode, ROLLOUT_MODES, "rollout.mode")
    for name in ("max_staleness", "weight_sync_every", "workers", "worker_threads"):
        value = getattr(rollout, name)
        check(isinstance(value, int) and not isinstance(value, bool), f"rollout.{name}",
               f"must be an integer, got {value!r}")
    check(rollout.max_staleness >= 0, "rollout.max_staleness",
           "must be >= 0 (0 = every answer sampled with the newest weights; TRL's default is 4)")
    check(rollout.weight_sync_every >= 1, "rollout.weight_sync_every", "must be >= 1 (1 = after every step)")
    check(rollout.workers >= 1, "rollout.workers", "must be >= 1")
    check(rollout.worker_threads >= 0, "rollout.worker_threads", "must be >= 0 (0 = split the cores)")
    check(rollout.worker_timeout_s > 0, "rollout.worker_timeout_s", "must be > 0 seconds")
    check(not rollout.worker_devices or len(rollout.worker_devices) == rollout.workers, "rollout.worker_devices",
           f"lists {len(rollout.worker_devices)} devices for rollout.workers = {rollout.workers}: give one per worker "
           "(e.g. [\"cuda:1\"]), or none to put every worker on model.device")
    # the workers hold only every weight_sync_every-th version: a bound tighter than that could never be met
    check(rollout.mode == "sync" or rollout.max_staleness >= rollout.weight_sync_every - 1, "rollout.max_staleness",
           f"is {rollout.max_staleness}, but with rollout.weight_sync_every = {rollout.weight_sync_every} the workers "
           f"hold weights up to {rollout.weight_sync_every - 1} steps old: raise max_staleness to at least "
           f"{rollout.weight_sync_every - 1} or lower weight_sync_every")
    server = VLLMOptions.of(rollout.vllm).server is not None
    check(rollout.mode == "sync" or rollout.engine == "hf" or server, "rollout.engine",
           "rollout.mode = \"async\" samples in processes of its own: the built-in sampler (engine = \"hf\") in "
           "worker processes, or a vLLM server (rollout.vllm = {server = \"http://...\"}, started with grpokit "
           "serve); a colocated vLLM shares the trainer's GPU: use one of those, or mode = \"sync\"")
    check(not (server and rollout.mode == "async" and rollout.workers > 1), "rollout.workers",
           f"is {rollout.workers}, but one worker drives a vLLM server (the server batches its requests itself): "
           "set rollout.workers = 1")
    check(not (server and rollout.worker_devices), "rollout.worker_devices",
           "a vLLM server samples on the devices it was started on (grpokit serve --devices): leave it empty")
