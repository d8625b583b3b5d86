"""Collectives for tensor and pipeline parallelism, on torch.distributed (gloo on CPU, NCCL on CUDA).

Ranks are laid out as vLLM lays them out: ``rank = pp_rank * tp_size + tp_rank``,
so one pipeline stage is ``tp_size`` consecutive ranks. The *driver* is the
first rank of the last stage: it gathers the logits and samples, once, and its
ModelRunnerOutput is the step's result. Every model and runner reads its rank
from the :class:`ParallelState` it was given; nothing here is a global.

::

    pp_rank 0:  rank 0 .. tp-1        embeds, runs layers [0, L0)        sends (hidden, residual) ->
    pp_rank 1:  rank tp .. 2tp-1      runs layers [L0, L), norm, head   rank tp = driver: samples
"""

from pagedllm.distributed.parallel_state import ParallelState, destroy_distributed, get_open_port, init_distributed
from pagedllm.distributed.partition import check_parallel_fits, stage_layers

__all__ = [
    "ParallelState",
    "check_parallel_fits",
    "destroy_distributed",
    "get_open_port",
    "init_distributed",
    "stage_layers",
]
