"""Scale-out over ``torch.distributed``: tensor parallelism (heads), pipeline parallelism (layers), and moving a
request's pages between caches (disaggregated prefill -> decode). Any backend: NCCL on GPUs, gloo on CPUs."""

from cute_kv.distributed.pipeline import PipelineStage
from cute_kv.distributed.steps import assert_same_pages, broadcast_step
from cute_kv.distributed.tensor_parallel import TensorParallelAttention, head_range
from cute_kv.distributed.transfer import recv_request, send_request

__all__ = ["PipelineStage", "TensorParallelAttention", "assert_same_pages", "broadcast_step", "head_range",
           "recv_request", "send_request"]
