"""Several vLLM servers as one sampler: `rollout.vllm.server = ["http://host:8000", "http://host:8001"]`.

    backend = connect_servers(options)    # one address: a ServerLLM (vllm/server.py); several: a ServerPool
    servers_of(backend)                   # [ServerLLM, ...]: what the checks and the weight transports go over

A `ServerPool` is a `VLLMEngine` backend (vllm/engine.py) like one `ServerLLM`: `complete(prompts, ...)` is still
one `/v1/completions` request per prompt, sent concurrently, each to the server with the fewest answers of this
process's in flight when it is sent (a request counts its `n` answers; ties go to the server sent fewer so far).
A batch of up to 256 prompts goes out at once (each server batches what it holds), so its counts tie: B prompts
over k servers are B/k each, and a slower server sets the batch's time; only the requests sent once others have
come back (past 256, or beside other open requests) go to the less busy server. A
multi-turn rollout is one `complete` per turn, spread anew: a conversation's next turn may go to another server
than its last, which then computes the shared prefix again (each server's prefix cache is its own); nothing
pins a conversation to a server. Every request's seed is its prompt's, whichever server takes it.

Each server keeps its own `ServerClient` (its timeout, its watch of a long call, its start time, its lease), so a
fault is said as with one server, naming the address of the one at fault: one that is down, frozen or restarted
ends the batch with its error (the others' requests in flight are left to finish on daemon threads). The weights
reach every server (vllm/weights.py): one folder written once and reloaded by all of them concurrently, the LoRA
adapter loaded on each and unloaded from each; NCCL to several servers is refused at the start (config/options.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from types import SimpleNamespace

from grpokit.errors import RolloutWorkerError
from grpokit.rollout.vllm.server import ServerLLM, _concurrently


def on_every(fn, servers: list) -> list:
    """`[fn(s) for s in servers]`, concurrently, waiting for every one to end: a weight push pauses and resumes
    each server, so none is left half-way when another fails. The first failure (in the servers' order) is
    raised once all ended; one on another server too is named in it (each error names its own address)."""
    if len(servers) == 1:
        return [fn(servers[0])]
    out, failed = [None] * len(servers), [None] * len(servers)

    def run(k: int) -> None:
        try:
            out[k] = fn(servers[k])
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failed[k] = e

    threads = [threading.Thread(target=run, args=(k,), daemon=True, name="vllm-each-server")
               for k in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # a Ctrl-C still reaches this thread
            t.join(0.5)
    errors = [e for e in failed if e is not None]
    if not errors:
        return out
    first = errors[0]
    if len(errors) > 1 and isinstance(first, RolloutWorkerError):
        others = "; ".join(str(e) for e in errors[1:])
        raise RolloutWorkerError(f"{first} (and on another server: {others})") from None
    raise first


class ServerPool:
    """Several vLLM servers behind one `VLLMEngine` (see the module docstring). `sent[k]`: requests sent to
    server k so far (what a test or a log can read to see the spread)."""

    def __init__(self, servers: list[ServerLLM]):
        self.servers = list(servers)
        self.in_flight = [0] * len(self.servers)  # answers (n per request) each server is sampling for us now
        self.sent = [0] * len(self.servers)
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, options) -> "ServerPool":
        """Every server of `options.servers`, each once it answers and with its setup checked (concurrently: each
        may wait up to server_timeout_s); one that does not answer is one error naming it."""
        return cls(on_every(lambda url: ServerLLM.connect(dataclasses.replace(options, server=url)),
                            list(options.servers)))

    @property
    def urls(self) -> list[str]:
        return [s.client.url for s in self.servers]

    def complete(self, prompts: list[dict], params, adapter=None) -> list:
        on_every(lambda s: s.client.check_not_restarted(), self.servers)  # once per call (multi-turn: per turn)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        return _concurrently(lambda *args: self._routed(adapter, *args),
                             list(zip(prompts, per_prompt, range(len(prompts)))), width=min(256, len(prompts)))

    def _routed(self, adapter, prompt: dict, p, index: int):
        """One prompt's request, on the server with the fewest answers in flight."""
        with self._lock:
            k = min(range(len(self.servers)), key=lambda i: (self.in_flight[i], self.sent[i]))
            self.in_flight[k] += p.n
            self.sent[k] += 1
        server = self.servers[k]
        try:
            return server._one(adapter.lora_name if adapter is not None else server.model, prompt, p, index)
        finally:
            with self._lock:
                self.in_flight[k] -= p.n

    def serving(self):
        """Nothing to wake: the servers are always up."""
        return contextlib.nullcontext()

    def wake_weights(self) -> None:
        """Nothing asleep: the servers are always up."""

    # ---- LoRA adapters (vllm/weights.py AdapterFolders): the same adapter on every server ---------------------

    def load_adapter(self, name: str, number: int, folder: str):
        """`folder`'s adapter loaded as `name` on every server; where one fails, unloaded again from the others
        (left there, it would hold a slot of theirs until a later run's sweep), then the failure raised."""
        try:
            on_every(lambda s: s.load_adapter(name, number, folder), self.servers)
        except BaseException:
            self.unload_adapter(SimpleNamespace(lora_name=name), timeout_s=10.0)
            raise
        return SimpleNamespace(lora_name=name, lora_int_id=number, lora_path=folder)

    def unload_adapter(self, previous, timeout_s: float | None = None) -> None:
        on_every(lambda s: s.unload_adapter(previous, timeout_s), self.servers)  # each suppresses its own failure


def connect_servers(options):
    """The backend `options.servers` names: a `ServerLLM` for one address, a `ServerPool` for several."""
    if len(options.servers) > 1:
        return ServerPool.connect(options)
    return ServerLLM.connect(options)


def servers_of(backend) -> list:
    """The servers behind a backend: a pool's, or the one server itself (a colocated backend: itself, which the
    callers' own checks pass over)."""
    return backend.servers if isinstance(backend, ServerPool) else [backend]
