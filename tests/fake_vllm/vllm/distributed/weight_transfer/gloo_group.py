"""The stand-in's transfer group: gloo on the host where vLLM opens NCCL between GPUs (same rendezvous fields)."""

import datetime
from types import SimpleNamespace

import torch
import torch.distributed as tdist


def open_group(info: dict, rank: int):
    timeout = datetime.timedelta(seconds=60)
    store = tdist.TCPStore(info["master_address"], info["master_port"], info["world_size"], rank == 0,
                           timeout=timeout)
    return SimpleNamespace(group=tdist.ProcessGroupGloo(store, rank, info["world_size"], timeout), store=store)


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    options = tdist.BroadcastOptions()
    options.rootRank = src
    group.group.broadcast([tensor], options).wait()
