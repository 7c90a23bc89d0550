"""FeatCal statistics across processes with torch.distributed (torchrun; gloo on CPU, nccl on GPU).

Every rank holds all the models and the same calibration batches, and runs its share of them:
batch b of every task goes to rank b mod W. Statistics are sums, so per task the ranks' raw
`TaskSums` are all-reduced (SUM) BEFORE the task is normalised by st = ‖Ct‖_F (which needs the full
task moments). Drift sums and token counts are all-reduced the same way. Every rank then solves the
same float64 systems; rank 0's solution is broadcast so that every rank holds bit-identical weights
whatever its hardware, and only rank 0 writes outputs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from featcal.calibration.maths.statistics import TaskSums
from featcal.errors import CalibrationDataError, FeatCalError

log = logging.getLogger("featcal.calibration")

_FIELDS = {"grams": ("sw", "sx", "sxx"), "cross": ("sxe", "sxxe"), "linears": ("sxy", "sy"), "norms": ("sw", "sz", "szz")}


@dataclass(frozen=True)
class RankGroup:
    """This process's place among the calibration ranks (world 1: a plain single process)."""

    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n_batches: int, task: str) -> list[int]:
        """Batch indices of one task that this rank runs (round robin)."""
        if self.active and n_batches < self.world:
            raise CalibrationDataError(
                f"task {task!r} has {n_batches} calibration batch(es) for {self.world} ranks: every rank needs at "
                "least one batch of every task; use fewer processes or a smaller --calibration-batch-size"
            )
        return list(range(self.rank, n_batches, self.world))

    @staticmethod
    def comm_device() -> torch.device:
        """Where collectives run: this rank's GPU under nccl (which only moves CUDA tensors), else the CPU."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_gather(self, obj):
        if not self.active:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def reduce_task_sums(self, sums: TaskSums, task: str) -> None:
        """Sum a task's raw statistics over the ranks, in place (one flat float32 all-reduce)."""
        if not self.active:
            return
        tensors = _sum_tensors(sums)
        signature = [(name, tuple(t.shape)) for name, t in tensors]
        if any(s != signature for s in self.all_gather(signature)):
            raise FeatCalError(f"task {task!r}: the ranks gathered different statistics (a model differs between ranks?)")
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for _, t in tensors]).to(self.comm_device())
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat = flat.to(tensors[0][1].device)
        offset = 0
        for _, t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def reduce_values(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 tensor (drift sums and counts) over the ranks."""
        if self.active:
            moved = values.to(self.comm_device())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            values = moved.to(values.device)
        return values

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite `tensors` on every rank with rank 0's values."""
        if self.active:
            device = self.comm_device()
            for t in tensors:
                moved = t.to(device)
                dist.broadcast(moved, src=0)
                if moved is not t:
                    t.copy_(moved)


def _sum_tensors(sums: TaskSums) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of `sums`, named and in a canonical order (the same on every rank)."""
    out = []
    for kind, fields in _FIELDS.items():
        table = getattr(sums, kind)
        for key in sorted(table):
            for f in fields:
                t = getattr(table[key], f)
                if t is not None:
                    out.append((f"{kind}.{key}.{f}", t))
    return out


def current_group() -> RankGroup:
    """The default process group's rank and size, or a single-process group when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return RankGroup(dist.get_rank(), dist.get_world_size())
    return RankGroup()


def init_from_env(device: str = "cpu") -> RankGroup:
    """Under torchrun (WORLD_SIZE > 1), initialise the default group: nccl for CUDA, gloo otherwise.

    Each rank's CUDA device is its LOCAL_RANK, so `device="cuda"` means this rank's GPU. Ranks other
    than 0 log warnings only. A process group the caller already initialised is used as it is.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available():
        return current_group()
    if not dist.is_initialized():
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    group = current_group()
    if not group.is_main:
        logging.getLogger("featcal").setLevel(logging.WARNING)
    log.info("featcal: rank %d of %d (%s backend)", group.rank, group.world, dist.get_backend())
    return group


def shutdown() -> None:
    """Tear the default group down if it is up (end of a torchrun command)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
