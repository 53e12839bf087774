"""A vLLM server's full weights over vLLM's NCCL weight-transfer API (GPU): `NcclTransfer`, and whether it can run.

The server is started with `VLLM_SERVER_DEV_MODE=1` and `--weight-transfer-config '{"backend": "nccl"}'`
(`grpokit serve` does both on a GPU). `can_run_nccl` says why a trainer and a server cannot use it (no CUDA on
either side, a server started without it, a vLLM older than 0.28 beside the trainer); vllm/weights.py's
`choose_server_transport` then takes the folder transport instead.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

from grpokit.errors import RolloutWorkerError, UserError
from grpokit.models.weight_sync import WeightPublisher
from grpokit.rollout.vllm.tensors import named_weights_for_sync, sync_tensors


def _vllm_transfer():
    """vLLM's trainer side of its NCCL weight transfer (imported on the trainer only: the worker sends HTTP), in
    the layout of vLLM 0.28 and later (`packed` in the init info; 0.25-0.27 had these helpers but refuse it)."""
    problem = nccl_api_problem()
    if problem:
        raise UserError(f"rollout.vllm.weight_transfer = \"nccl\": {problem}; install vLLM >= 0.28 beside the "
                        "trainer, or use rollout.vllm.weight_transfer = \"folder\"")
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer as send
    from vllm.utils.network_utils import get_ip, get_open_port

    return SimpleNamespace(trainer_init=trainer_init, send=send, get_ip=get_ip, get_open_port=get_open_port)


def nccl_api_problem() -> str | None:
    """Why this process cannot drive vLLM's NCCL weight transfer (0.28's API), or None."""
    try:
        from vllm.distributed.weight_transfer import nccl_common
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer  # noqa: F401
    except ImportError as e:
        return f"this process has no vLLM weight-transfer API ({e})"
    info = getattr(nccl_common, "NCCLWeightTransferInitInfo", None)
    if info is not None and "packed" not in getattr(info, "__dataclass_fields__", {"packed": None}):
        return "this vLLM's transfer takes no `packed` init info (vLLM 0.25-0.27)"
    return None


class NcclTransfer(WeightPublisher):
    """A server's full weights through vLLM's weight-transfer API (the server started with `VLLM_SERVER_DEV_MODE=1`
    and `--weight-transfer-config '{"backend": "nccl"}'`): the trainer opens an NCCL group with the server's
    workers once (`/init_weight_transfer_engine`), then per push `/pause` -> `/start_weight_update` -> the tensors
    broadcast from the trainer while `/update_weights` receives them -> `/finish_weight_update` -> `/resume`. The
    broadcast runs on a thread of its own: NCCL has no timeout, the HTTP call has one."""

    def __init__(self, client):
        self.client, self._transfer, self._group = client, None, None

    def publish(self, model, step: int) -> float:
        t0 = time.perf_counter()
        if self._group is None:
            self._open()
        manifest = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in sync_tensors(model)]
        info = {"names": [m[0] for m in manifest], "dtype_names": [m[1] for m in manifest],
                "shapes": [m[2] for m in manifest]}
        with self.client.paused():  # resumed on every way out, a Ctrl-C included
            self.client.call("POST", "/start_weight_update", json={"is_checkpoint_format": True})
            stream = named_weights_for_sync(model)  # FSDP: each tensor gathered as it is sent
            try:
                self._while_sending(lambda: self._transfer.send(iterator=stream, group=self._group, src=0,
                                                                post_iter_func=lambda item: item[1]),
                                    lambda: self.client.call("POST", "/update_weights", json={"update_info": info}))
            except RolloutWorkerError as e:  # the transfer's own error is the one to say; the clean-up is brief
                with contextlib.suppress(RolloutWorkerError):
                    self.client.call("POST", "/finish_weight_update", timeout_s=10)
                raise RolloutWorkerError(f"{e}. The server may hold half-received weights: restart it before "
                                         "resuming (a resumed run pushes every weight again)") from None
            self.client.call("POST", "/finish_weight_update")
        return time.perf_counter() - t0

    def _open(self) -> None:
        t = self._transfer = _vllm_transfer()
        reply = self.client.call("GET", "/get_world_size")
        try:
            size = 1 + int(reply["world_size"])
        except (KeyError, TypeError, ValueError):
            raise self.client.not_vllm("/get_world_size", reply) from None
        info = {"master_address": t.get_ip(), "master_port": t.get_open_port(), "rank_offset": 1,
                "world_size": size, "packed": True}
        self._while_sending(lambda: setattr(self, "_group", t.trainer_init(info)),
                            lambda: self.client.call("POST", "/init_weight_transfer_engine",
                                                     json={"init_info": info}))

    def _while_sending(self, send, drive) -> None:
        """Run `send` (a collective without a timeout) on a thread while `drive` (the HTTP call that makes the
        server take part, with one) runs here: a server that fails answers the call, never hangs the trainer."""
        failed: list[BaseException] = []
        thread = threading.Thread(target=lambda: _noting(send, failed), daemon=True, name="vllm-weight-transfer")
        thread.start()
        drive()
        thread.join(self.client.timeout_s)  # the server said it received: the sending side ends soon after
        if thread.is_alive():
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.client.url} answered, but the "
                                     f"weight transfer did not end within rollout.vllm.server_timeout_s = "
                                     f"{self.client.timeout_s:g} s; {self.client.fix}")
        if failed:
            raise RolloutWorkerError(f"rollout.vllm.server: the weight transfer to the vLLM server failed "
                                     f"({type(failed[0]).__name__}: {failed[0]})") from failed[0]


def _noting(fn, failed: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - said by the caller's thread
        failed.append(e)


def can_run_nccl(server_info: dict) -> str | None:
    """Why vLLM's weight transfer cannot run between this trainer and the server, or None. Its built-in backend,
    NCCL, needs CUDA on both sides; a backend registered in vLLM's weight-transfer registry
    (`register_weight_transfer_engine`: a plugin's, or tests/fake_vllm's gloo) says for itself where it runs, so
    only the server's start flag and this vLLM's API are checked for it."""
    import torch

    config = server_info.get("vllm_config") or {}
    transfer = config.get("weight_transfer_config")
    if str((transfer or {}).get("backend", "nccl")) == "nccl":  # the first reason a user can act on
        if not torch.cuda.is_available():
            return "the trainer has no CUDA device"
        if str((config.get("device_config") or {}).get("device", "cuda")) == "cpu":
            return "the server runs on CPU"
    if "weight_transfer_config" in config and not transfer:
        return "the server was started without --weight-transfer-config"
    return nccl_api_problem()
