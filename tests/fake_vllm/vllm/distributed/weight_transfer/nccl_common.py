"""vLLM's trainer_init, on gloo (CPU stand-in): the trainer is rank 0 of the transfer group."""

from vllm.distributed.weight_transfer.gloo_group import open_group


def trainer_init(init_info: dict):
    return open_group(init_info, 0)
