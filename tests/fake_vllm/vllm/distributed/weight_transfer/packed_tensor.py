"""vLLM's packed broadcast producer, tensor by tensor on gloo (CPU stand-in; the stand-in server receives in the
manifest's order, as vLLM does)."""

from vllm.distributed.weight_transfer.gloo_group import broadcast


def packed_nccl_broadcast_producer(iterator, group, src=0, post_iter_func=lambda item: item[1], **kwargs):
    for item in iterator:
        broadcast(group, post_iter_func(item).detach().cpu().contiguous(), src)
