"""ParallelState (this rank's place and its collectives), joining and leaving the process group."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class ParallelState:
    """Where this process sits: its TP rank within its stage, its stage, and the groups to talk over."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's ranks (None when tp_size == 1)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # bytes this rank put into each kind of communication (its payloads, not the wire's overhead)
    expert_parallel: bool = False  # MoE layers shard experts across the TP ranks (enable_expert_parallel)
    bytes_all_reduced: int = 0
    bytes_gathered: int = 0
    bytes_sent: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and reports the step's output."""
        return self.is_last_stage and self.tp_rank == 0

    @staticmethod
    def driver_rank(tp_size: int, pp_size: int) -> int:
        return (pp_size - 1) * tp_size

    # -- tensor parallel --------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over this stage's TP ranks, in place (the row-parallel linears' partial products)."""
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
            self.bytes_all_reduced += x.numel() * x.element_size()
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Concatenate the TP ranks' vocabulary shards of the logits on the stage's first rank (the
        others get None: sampling happens once)."""
        if self.tp_size == 1:
            return local[:, :vocab_size]
        dst = self.pp_rank * self.tp_size
        parts = [torch.empty_like(local) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        torch.distributed.gather(local.contiguous(), parts, dst=dst, group=self.tp_group)
        self.bytes_gathered += local.numel() * local.element_size()
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]

    # -- pipeline parallel ------------------------------------------------------
    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Each rank sends to the rank with its TP rank in the next stage (their activations are replicated)."""
        dst = self.rank + self.tp_size
        for t in tensors:
            torch.distributed.send(t.contiguous(), dst)
            self.bytes_sent += t.numel() * t.element_size()

    def recv_from_prev_stage(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        src = self.rank - self.tp_size
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            torch.distributed.recv(t, src)
            out.append(t)
        return out


def init_distributed(
    tp_size: int, pp_size: int, rank: int, init_method: str, device: torch.device, timeout_s: float = 600.0
) -> ParallelState:
    """Join the process group (``init_method`` is ``tcp://host:port`` of rank 0) and build the TP groups."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    world = tp_size * pp_size
    dist.init_process_group(
        backend, init_method=init_method, world_size=world, rank=rank, timeout=datetime.timedelta(seconds=timeout_s)
    )
    tp_group = None
    for stage in range(pp_size):  # every rank must create every group, in the same order
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    return ParallelState(tp_size, pp_size, rank, tp_group, device)


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def get_open_port(host: str = "127.0.0.1") -> int:
    """A port free now, chosen by the OS (never a fixed one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
