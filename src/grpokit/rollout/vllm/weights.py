"""The weight transports to vLLM: implementations of `models.weight_sync.WeightPublisher.publish(model, step)`.

    colocated engine            InProcessReload    vLLM's `reload_weights` with the trainer's tensors, streamed
    server, full weights, GPU   NcclTransfer       vLLM's NCCL weight-transfer API (/init_weight_transfer_engine ...)
    server, full weights, any   FolderReload       safetensors shards in a folder both sides see, then the server's
                                                   `reload_weights` from it (POST /collective_rpc)
    LoRA, colocated or server   AdapterFolders     the adapter alone, saved to a folder and loaded as <prefix>-v<step>

`vllm_publisher` chooses one from the config, once per run; a server's (or several servers': each transport reaches
every one of them, vllm/servers.py) is wrapped in `ServerPush` (each server still the one pushed to, the probe after
the first push) and `RankZero` (vllm/ranks.py: under torchrun rank 0 pushes for all ranks, FSDP shards gathered by
all), and in asynchronous rollout in `LockedPublisher` (no push lands inside a batch its worker samples; the
worker's end is `ServerSubscriber`). A transport never calls into the engine: it sets the engine's `ServedWeights`
(the step the sampler holds, the adapter to name), which the engine reads. `choose_server_transport` picks NCCL
where it can run (a CUDA trainer and a server started with vLLM's NCCL weight transfer) and the folder otherwise,
with one note saying which. Every transport reloads the weights in vLLM's checkpoint format, so vLLM repacks them
for its kernels itself (its CPU linear layers keep their weights in a packed layout: writing into the live
parameters, as `load_weights` does, broke them).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path

from grpokit.errors import RolloutWorkerError, UserError
from grpokit.models.lora import adapter_of
from grpokit.models.parallel import buckets
from grpokit.models.weight_sync import WeightPublisher
from grpokit.rollout.vllm import leftovers
from grpokit.rollout.vllm.engine import CompletionParams, ServedWeights, adapter_name
from grpokit.rollout.vllm.lease import release
from grpokit.rollout.vllm.nccl import NcclTransfer, can_run_nccl, nccl_api_problem  # noqa: F401 - re-exported
from grpokit.rollout.vllm.ranks import RankZero
from grpokit.rollout.vllm.servers import on_every, servers_of
from grpokit.rollout.vllm.tensors import named_weights_for_sync, sync_tensors  # noqa: F401 - re-exported


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class InProcessReload(WeightPublisher):
    """A colocated `vllm.LLM` (its engine in this process, vllm/colocated.py): `reload_weights` with the trainer's
    tensors, one at a time (FSDP gathers each as it goes), then the prefix cache dropped (its KV was computed with
    the old ones). Sleep mode: the weights are woken first."""

    def __init__(self, colocated, served: ServedWeights):
        self.colocated, self.served = colocated, served

    def publish(self, model, step: int) -> float:
        def reload():
            self.colocated.wake_weights()
            llm = self.colocated.llm
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_weights_for_sync(model),
                                                             "is_checkpoint_format": True})
            except (ValueError, KeyError, RuntimeError) as e:  # vLLM's loader: a name or shape it does not take
                raise RolloutWorkerError(f"rollout.engine = \"vllm\": vLLM could not load the trainer's weights "
                                         f"({type(e).__name__}: {e}); this model's architecture may load differently"
                                         " in vLLM: try rollout.engine = \"hf\", or a vLLM server (grpokit serve)"
                                         ) from None
            llm.reset_prefix_cache()
            self.served.step = step
        return _timed(reload)


class AdapterFolders(WeightPublisher):
    """LoRA: the adapter alone, saved to a folder of its own per step and loaded as `<prefix>-v<step>` by the
    `backend` (a colocated LLM's LoRARequest, or a server's /v1/load_lora_adapter: vllm/colocated.py,
    vllm/server.py); the previous one unloaded and its folder removed. The folder must be one the sampler reads."""

    def __init__(self, backend, served: ServedWeights, folder: str | None = None):
        self.backend, self.served, self.folder = backend, served, folder
        self.root: str | None = None  # made at the first push (a torchrun rank that never pushes makes none)
        self.loads = 0  # adapters this process loaded: vLLM numbers them from 1

    def publish(self, model, step: int) -> float:
        t0 = time.perf_counter()
        previous, name = self.served.adapter, adapter_name(self.served.adapter_prefix, step)
        if previous is not None and previous.lora_name == name:  # already there (the start's push, again)
            return 0.0
        if self.root is None:  # what killed runs left on the server(s) (leftovers.py)
            for backend in servers_of(self.backend):
                leftovers.unload_dead_adapters(backend)
            self.root = _run_folder(self, "grpokit-lora-", self.folder)
        folder = _next_folder(self.root)
        _writing(folder, lambda: adapter_of(model).save_pretrained(str(folder)), "the LoRA adapter")
        self.backend.wake_weights()  # sleep mode: the previous adapter is removed from an awake engine
        self.loads += 1
        self.served.adapter, self.served.step = self.backend.load_adapter(name, self.loads, str(folder)), step
        if previous is not None:
            self.backend.unload_adapter(previous)
            if previous.lora_path:
                shutil.rmtree(previous.lora_path, ignore_errors=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        """The run ended, or was refused after its first push: a server outlives it, so the adapter this process
        loaded there is unloaded (its folder goes next: left registered, it could not be reloaded anyway), within
        10 s at most (a server that is down or frozen has nothing to free); then the folders go."""
        loaded = self.served.adapter
        if loaded is not None and loaded.lora_path:  # loaded by this process: an async worker's `use` has no path
            self.backend.unload_adapter(loaded, timeout_s=10.0)
            self.served.adapter = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _run_folder(owner, prefix: str, folder: str | None) -> str:
    """A new folder of this run's under `folder` (TMPDIR by default), removed with `owner` (or its `close()`);
    a place that cannot hold one is one error naming rollout.vllm.weight_folder."""
    field = "rollout.vllm.weight_folder" if folder else "TMPDIR"
    try:
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
        leftovers.remove_dead_folders(folder or tempfile.gettempdir())  # killed runs' folders (leftovers.py)
        root = tempfile.mkdtemp(prefix=leftovers.owned(prefix), dir=folder)  # pid, pid namespace, host: whose
    except OSError as e:
        raise UserError(f"{field}: {folder or tempfile.gettempdir()} cannot hold the run's weight folders "
                        f"({e.strerror or e}); give a folder the trainer can write and the sampler can read") from None
    weakref.finalize(owner, shutil.rmtree, root, True)
    return root


def _next_folder(root: str) -> Path:
    """A new folder's path under `root`, one per push (a version may be pushed twice: the start's, a resume's)."""
    count = len(list(Path(root).iterdir())) if Path(root).is_dir() else 0
    while (Path(root) / f"push-{count}").exists():
        count += 1
    return Path(root) / f"push-{count}"


def _writing(folder: Path, write, what: str, field: str = "TMPDIR") -> None:
    """`write()` into a new `folder`; a full disk (or any other write error) removes what was written and is one
    error. safetensors reports its I/O errors as its own type, with the OS error in the text."""
    from safetensors import SafetensorError

    try:
        folder.mkdir(parents=True, exist_ok=False)
        write()
    except (OSError, SafetensorError) as e:
        shutil.rmtree(folder, ignore_errors=True)
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "os error 28" in str(e)
        reason = "No space left on device" if full else (getattr(e, "strerror", None) or str(e))
        raise RolloutWorkerError(f"{field}: writing {what} to {folder} failed ({reason}); "
                                 + ("free space there or point it at a disk with room" if full else
                                    "check that the folder is writable")) from None


class FolderReload(WeightPublisher):
    """A server's full weights through a folder both sides see: the trainer writes them as safetensors shards of
    about `shard_mb` (FSDP: gathered one tensor at a time), the server reloads them in place (`POST /collective_rpc
    reload_weights`, paused, its prefix cache reset), then the previous version's folder goes. No NCCL: on CPU, or
    a cluster where trainer and server cannot open an NCCL connection but share a filesystem. `client`: one
    server's ServerClient, or a list of several: the folder is written once and every server reloads it,
    concurrently; one that fails is the push's error (naming it), the others' reloads having ended."""

    def __init__(self, client, folder: str | None = None, shard_mb: float = 512, note: str | None = None):
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.shard_bytes, self.folder, self.note = int(shard_mb * 2 ** 20), folder, note
        self.field = "rollout.vllm.weight_folder" if folder else "TMPDIR (or rollout.vllm.weight_folder)"
        self.root: str | None = None  # made at the first push: an async worker's engine or a torchrun rank never does
        self.previous: Path | None = None

    def publish(self, model, step: int) -> float:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        if self.root is None:
            self.root = _run_folder(self, "grpokit-weights-", self.folder)
            if self.note:  # why not NCCL: said once, by the process that pushes
                print(self.note, file=sys.stderr, flush=True)
        folder = _next_folder(self.root)

        def write():
            for k, bucket in enumerate(buckets(named_weights_for_sync(model), self.shard_bytes)):
                save_file({n: t.cpu().contiguous() for n, t in bucket}, str(folder / f"model-{k:05d}.safetensors"))

        _writing(folder, write, "the weights", self.field)
        on_every(lambda client: self._reload_on(client, folder), self.clients)
        if self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = folder
        return time.perf_counter() - t0

    def _reload_on(self, client, folder: Path) -> None:
        """One server reloads `folder`, paused (resumed on every way out, a Ctrl-C included)."""
        with client.paused():
            try:
                self._reload(client, folder)
            except RolloutWorkerError as e:  # never a half-loaded server: the weights it held before, again
                raise RolloutWorkerError(f"{e}. {self._restore(client)}") from None
            client.call("POST", "/reset_prefix_cache")

    @staticmethod
    def _reload(client, folder) -> None:
        client.call("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {
            "weights_path": str(folder), "is_checkpoint_format": True}})

    def _restore(self, client) -> str:
        """After a failed reload, the server's previous weights loaded again (this run's last push, else the
        model the server started on), so it is left whole for the runs after; what happened, in words."""
        try:  # vLLM's own model path now names the folder that failed: the served model's root is the start's
            self._reload(client, self.previous or client.call("GET", "/v1/models")["data"][0]["root"])
        except (RolloutWorkerError, KeyError, IndexError, TypeError):
            return "Its previous weights could not be loaded back either: restart the server before any run uses it"
        return "The server holds its previous weights again"

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def check_serves(server, model, lora_request, tokens: int = 16) -> None:
    """One answer sampled by the server, its log-probs recomputed by the trainer: far apart, the server serves
    another model (or another base under LoRA, e.g. weights an earlier run pushed), and the run would learn from
    a sampler that is not its policy. One error, at the start."""
    import torch

    client = server.client
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prompt = [i % vocab for i in range(1, 9)]
    params = CompletionParams(n=1, max_tokens=tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0, stop_token_ids=[],
                              ignore_eos=True)
    out = server.complete([{"prompt_token_ids": prompt}], params, lora_request)[0].outputs[0]
    ids = list(out.token_ids)
    served = torch.tensor([next(iter(lp.values())) for lp in out.logprobs], dtype=torch.float64)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1:-1]
        ours = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids, device=device)[:, None])[:, 0]
    gap = float((served - ours.cpu()).abs().mean())
    ours_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    # float32 on both sides: kernels differ by ~1e-6; in bf16 a token's gap is ~0.01-0.05 on real models, while
    # another model (or base) is off by much more than 0.25 a token
    limit = 0.02 if client.dtype == ours_dtype == "float32" else 0.25
    if gap > limit:
        what = "the adapter's base model" if lora_request is not None else "the weights just pushed"
        raise UserError(f"rollout.vllm.server: the vLLM server at {client.url} does not serve {what}: its log-probs "
                        f"of a probe answer differ from the trainer's by {gap:.3f} nats a token on average (at most "
                        f"{limit:g} expected). It was started on another model, or holds weights an earlier run "
                        "pushed: restart it with `grpokit serve MODEL` on model.path")


class ServerPush(WeightPublisher):
    """A push to a vLLM server, or to several (`server`: a ServerLLM or a ServerPool, vllm/servers.py): each server
    still the one pushed to before (a restarted one lost the weights), a note when its dtype is not the trainer's,
    then the transport's push (to every server), and after the first push the probe on each (`check_serves`: each
    server serves what the trainer trains; one that does not is named). Rank 0 only (`RankZero`)."""

    def __init__(self, inner: WeightPublisher, server, served: ServedWeights):
        self.inner, self.servers, self.served, self.checked = inner, servers_of(server), served, False

    def publish(self, model, step: int) -> float:
        t0 = time.perf_counter()
        for server in self.servers:
            server.client.check_not_restarted()
        if not self.checked and not isinstance(self.inner, AdapterFolders):
            ours = str(next(model.parameters()).dtype).removeprefix("torch.")
            for client in (s.client for s in self.servers):
                if client.dtype not in (None, ours):  # as TRL: said once, the correction covers the gap
                    print(f"note: the vLLM server at {client.url} holds {client.dtype} weights, the trainer "
                          f"{ours}: the sampler's log-probs will differ more (algorithm.is_correction corrects for "
                          f"it); `grpokit serve --dtype {ours}` or model.dtype = \"{client.dtype}\" aligns "
                          "them", file=sys.stderr, flush=True)
        self.inner.publish(model, step)
        self.served.step = step
        if not self.checked:
            self.checked = True
            for server in self.servers:  # one at a time: the trainer's model scores each probe
                check_serves(server, model, self.served.adapter)
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            for server in self.servers:
                release(server.client.url)  # the server is free for the next run


def choose_server_transport(client, choice: str, folder: str | None, shard_mb: float):
    """The full-weight transport `rollout.vllm.weight_transfer` names ("auto": NCCL where it can run, else the
    folder, said once). `client`: one server's, or a list of several servers' (NCCL to several is not built: the
    folder, every server reloading it; "nccl" is refused, also by the config's checks)."""
    clients = list(client) if isinstance(client, (list, tuple)) else [client]
    if choice == "folder":
        return FolderReload(clients, folder, shard_mb)
    why = can_run_nccl(clients[0].info) if len(clients) == 1 else \
        f"NCCL to several servers ({len(clients)}) is not built yet"
    if choice == "nccl" and why is not None:
        raise UserError(f"rollout.vllm.weight_transfer = \"nccl\" cannot run: {why}; use \"folder\" (a folder "
                        "the server can read, rollout.vllm.weight_folder) or \"auto\"")
    if why is None:
        return NcclTransfer(clients[0])
    where = f"the vLLM server at {clients[0].url}" if len(clients) == 1 else \
        f"the vLLM servers at {', '.join(c.url for c in clients)}"
    return FolderReload(clients, folder, shard_mb, note=f"note: weights go to {where} through a folder ("
                        f"{folder or 'under TMPDIR'}; rollout.vllm.weight_folder), not NCCL: {why}")


def shared_with_ranks(value: str) -> str:
    """Rank 0's `value` on every rank (torchrun: all ranks ask for the adapters rank 0 loads)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def run_prefix() -> str:
    """This run's adapter names' prefix (a server outlives runs: names of its own). Process id and second are
    not enough: two runs in one process within a second (a run refused at its start, then the next) would
    name their first adapters alike, and the server, answering "already loaded", would keep the first run's,
    whose folder is gone (vLLM's engine then dies loading it); a random part makes each run's its own."""
    return shared_with_ranks(f"grpokit-{os.getpid()}-{int(time.time())}-{uuid.uuid4().hex[:8]}")


class LockedPublisher(WeightPublisher):
    """Asynchronous rollout against a vLLM server, the trainer's end: the run's server publisher (`inner`) pushes
    under the lock the worker holds while it samples a batch, so each answer has one version; `version` (shared)
    tells the worker which step's weights the server holds. The server already holds `holds` (the start's push,
    made when the run was built): that step is announced, not pushed again.

    `in_flight` (`rollout.in_flight_updates`): no lock. The push itself pauses the server with `mode=keep`
    (`ServerClient.paused`: in-flight requests frozen with their KV cache, the weights reloaded, `/resume`
    continues them), so a push lands inside the worker's batch, as TRL's and PipelineRL's do."""

    def __init__(self, inner: WeightPublisher, timeout_s: float, lock, version, holds: int, in_flight: bool = False):
        self.inner, self.timeout_s, self.lock, self.version, self.holds = inner, timeout_s, lock, version, holds
        self.in_flight = in_flight

    def connect(self) -> None:
        """Nothing to join: the server is the subscriber."""

    port = 0  # no store for the workers to join

    def publish(self, model, step: int) -> float:
        t0 = time.perf_counter()
        held = contextlib.nullcontext(True) if self.in_flight else _acquired(self.lock, self.timeout_s)
        with held as got:
            if not got:
                raise RuntimeError(f"the rollout worker kept the vLLM server busy for more than {self.timeout_s:g} s")
            if step != self.holds:
                self.inner.publish(model, step)
            with self.version.get_lock():
                self.version.value = step
        return time.perf_counter() - t0

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def _acquired(lock, timeout_s: float):
    """`lock` held for the block, or False given to it when `timeout_s` passed first."""
    got = lock.acquire(timeout=timeout_s)
    try:
        yield got
    finally:
        if got:
            lock.release()


class ServerSubscriber:
    """Asynchronous rollout against a vLLM server, the worker's end (in place of `GlooSubscriber`): the step whose
    weights the server holds, set on the worker engine's `served` (with LoRA: that step's adapter name), and the
    lock under which a batch is sampled (no push lands inside it: each answer has one version). `adapter_prefix`:
    with LoRA, the names the trainer's adapters are loaded under (None: full weights). `in_flight`: no lock, pushes
    land inside the batch (`LockedPublisher`); `newest()` is then the version the server holds at the batch's end."""

    def __init__(self, lock, version, served: ServedWeights, adapter_prefix: str | None, in_flight: bool = False):
        self.lock, self.version, self.served, self.adapter_prefix = lock, version, served, adapter_prefix
        self.in_flight = in_flight

    def wait_for(self, step: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.version.value < step:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def apply(self) -> int:
        step = int(self.version.value)
        self.served.use(step, self.adapter_prefix)
        return step

    def newest(self) -> int:
        return int(self.version.value)

    def holding(self):
        return contextlib.nullcontext() if self.in_flight else self.lock


def vllm_publisher(config, engine) -> WeightPublisher:
    """The transport to `engine`'s vLLM (vllm/engine.py), as the config asks, chosen once per run: a colocated
    LLM reloads in process, a server takes the folder or NCCL (`rollout.vllm.weight_transfer`); with LoRA the
    adapter alone."""
    options, lora, served = config.rollout.vllm_options, bool(config.model.lora), engine.served
    if options.server is None:
        return AdapterFolders(engine.backend, served) if lora else InProcessReload(engine.backend, served)
    server = engine.backend
    if lora:  # this run's own adapter names (a server outlives runs); an async worker is told the prefix
        served.adapter_prefix = run_prefix()
        inner = AdapterFolders(server, served, options.weight_folder)
    else:
        inner = choose_server_transport([s.client for s in servers_of(server)], options.weight_transfer,
                                        options.weight_folder, options.sync_bucket_mb)
    return RankZero(ServerPush(inner, server, served), served, lora)
