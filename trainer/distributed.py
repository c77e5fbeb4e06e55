"""Data-parallel training over torch.distributed: rank 0 in the calling process, ranks 1..N-1 spawned beside it.

Every rank holds the whole model and optimizer (DDP's layout). A step's samples are broadcast from rank 0; each
mini-batch is cut into `world_size` contiguous shards of near-equal tokens, each rank trains its shard's packed
micro-batches with the loss weights of the whole mini-batch, and the gradients are summed over ranks (all_reduce,
SUM), so every rank holds the gradient one process would have accumulated and takes the same optimizer step: world
size N gives the update of world size 1 up to float summation order. The gradients are reduced by hand rather than
by wrapping the model in DistributedDataParallel because ranks train different numbers of micro-batches (a short
step leaves some with none), which DDP's one-reduction-per-backward cannot express without dummy passes.

Ranks 1..N-1 take commands (train_step, save, load, close) over a pipe from rank 0 and answer each one; the data of
a step travels by broadcast_object_list. They exit when the pipe closes or their parent dies, so a killed worker
leaves no trainer ranks behind. Checkpoints are world-size independent (see Policy.save_checkpoint).
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from trainer.algorithms import Metrics
from trainer.config import TrainerConfig
from trainer.packing import micro_batches
from trainer.policy import Policy, minibatches
from trainer.samples import Sample

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""Longest wait in one collective: a rank waits for the slowest rank's share of a step, or a checkpoint write."""
START_TIMEOUT = timedelta(minutes=5)
"""Longest wait for the spawned ranks to join (process start and imports; seconds when the box is not loaded)."""
BUCKET_ELEMENTS = 1 << 24
"""Gradient elements per all_reduce (64 MB of float32): bounds the memory of the flattened copy."""
CLOSE_WAIT_S = 10.0
"""How long close() lets a step in progress finish, and ranks exit, before it kills them."""


def make_policy(model: nn.Module, config: TrainerConfig) -> Policy | "DistributedPolicy":
    """The trainer a run uses: one process at world_size 1, else rank 0 of a data-parallel group.

    On CPU the ranks share this process's cores: each rank (rank 0 included, until close()) gets an equal part of
    torch's threads, not all of them each, which would oversubscribe the cores world_size times."""
    if config.world_size == 1:
        return Policy(model, config)
    if next(model.parameters()).device.type == "cuda":
        return DistributedPolicy(model, config)
    return DistributedPolicy(model, config, threads=max(1, torch.get_num_threads() // config.world_size))


def shard(lengths: Sequence[int], world_size: int) -> list[range]:
    """Contiguous index ranges, one per rank, of near-equal total length (a rank's range may be empty)."""
    cumulative = list(itertools.accumulate(lengths, initial=0))  # (S + 1,)
    total = cumulative[-1]
    cuts = [0]
    for r in range(1, world_size):
        nearest = min(range(len(cumulative)), key=lambda i: (abs(cumulative[i] - total * r / world_size), -i))
        cuts.append(max(nearest, cuts[-1]))
    cuts.append(len(lengths))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


class ShardedPolicy(Policy):
    """One rank's Policy: trains its shard of each mini-batch and sums gradients and metrics over the group."""

    def __init__(self, model: nn.Module, config: TrainerConfig, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        super().__init__(model, config)

    def train_step(self, samples: Sequence[Sample], advantages: Sequence[float], rollouts: Sequence[int]
                   ) -> Metrics:
        metrics = super().train_step(samples, advantages, rollouts)
        # Each rank kept the logprobs of the samples it trained; rank 0 reports them all.
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(self.trained_logprobs, gathered, dst=0)
        if self.rank == 0:
            self.trained_logprobs = [next((row for row in rows if any(v is not None for v in row)), rows[0])
                                     for rows in zip(*gathered)]
        return metrics

    def _micro_batches(self, samples: Sequence[Sample]) -> list[list[int]]:
        own = shard([len(s.token_ids) for s in samples], self.world_size)[self.rank]
        mine = list(samples[own.start:own.stop])
        return [[own.start + i for i in indices] for indices in micro_batches(mine, self.micro_batch_positions)] \
            if mine else []

    def _old_logprobs(self, samples: Sequence[Sample]) -> list[Tensor | None] | None:
        """As Policy's, for the samples this rank trains only (the others stay None)."""
        if self.config.updates_per_step == 1:
            return None
        out: list[Tensor | None] = [None] * len(samples)
        for part in minibatches(len(samples), self.config.updates_per_step):
            chunk = [samples[i] for i in part]
            for indices in self._micro_batches(chunk):
                logp, _ = self.logprobs([chunk[i] for i in indices])  # (M,) in sample order
                for i, values in zip(indices, logp.split([sum(chunk[i].loss_mask[1:]) for i in indices])):
                    out[part[i]] = values
        return out

    def _all_parts(self, parts: list[tuple[Metrics, int]]) -> list[tuple[Metrics, int]]:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, parts)
        return [p for rank_parts in gathered for p in rank_parts]  # rank order = the mini-batch's order

    def _reduce_gradients(self) -> None:
        """Sum gradients over ranks. A parameter no rank touched keeps no gradient (AdamW then skips it, as in
        one process); one that only other ranks touched gets theirs."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        device = params[0].device
        touched = torch.tensor([float(p.grad is not None) for p in params], device=device)  # (P,)
        dist.all_reduce(touched)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for bucket in _buckets(grads, BUCKET_ELEMENTS):
            flat = torch.cat([g.flatten() for g in bucket])  # (sum of numel,)
            dist.all_reduce(flat)
            for g, values in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(values.view_as(g))
        for p, g, t in zip(params, grads, touched.tolist()):
            p.grad = g if t > 0 else None


def _buckets(tensors: list[Tensor], size: int) -> list[list[Tensor]]:
    buckets: list[list[Tensor]] = [[]]
    filled = 0
    for t in tensors:
        if buckets[-1] and filled + t.numel() > size:
            buckets.append([])
            filled = 0
        buckets[-1].append(t)
        filled += t.numel()
    return [b for b in buckets if b]


def _broadcast_module(model: nn.Module) -> None:
    """Rank 0's parameters and buffers (non-persistent ones too) to every rank: one starting point."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor.data, src=0)


class TrainerRankFailed(RuntimeError):
    """A rank of the distributed trainer failed or died; the message carries its traceback or exit code."""


class DistributedPolicy:
    """Rank 0 of a data-parallel trainer, with the interface of Policy the scheduler and the run use.

    `model` (rank 0's, the one weight sync sends to the engine) is rebuilt in each spawned rank from its class and
    config and overwritten with rank 0's weights. One per process at a time (torch.distributed's default group);
    call close() (or use it as a context manager) to stop the ranks.
    """

    def __init__(self, model: nn.Module, config: TrainerConfig, world_size: int | None = None,
                 threads: int | None = None):
        world = world_size or config.world_size
        if world < 2:
            raise ValueError(f"DistributedPolicy needs world_size >= 2, got {world}; use Policy for one process")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (another DistributedPolicy "
                               "is open?); close it first")
        parameter = next(model.parameters())
        backend = "nccl" if parameter.device.type == "cuda" else "gloo"
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=START_TIMEOUT)
        context = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.Process] = []
        self._closed = False
        self.world_size = world
        self._threads_before = None
        self.rank_threads = threads or torch.get_num_threads()
        """torch threads of ranks 1..N-1 (and of rank 0 while open, where `threads` was given on CPU)."""
        if threads is not None and backend == "gloo":  # rank 0 (this process) takes its part of the cores too
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            for rank in range(1, world):
                ours, theirs = context.Pipe()
                proc = context.Process(target=_rank_main, name=f"trainer-rank-{rank}", daemon=True, args=(
                    rank, world, store.port, backend, type(model), model.config, parameter.dtype, config,
                    self.rank_threads, theirs))
                proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
            dist.init_process_group(backend, store=store, rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT)
            _broadcast_module(model)
            self.policy = ShardedPolicy(model, config, 0, world)
            self._answers("start")
        except BaseException as exc:
            self._fail("start", exc)
        logger.info("distributed trainer up: %d ranks over %s (pids %s)", world, backend, self.pids)

    # ---- what the scheduler and the run read --------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        return self.policy.model

    @property
    def config(self) -> TrainerConfig:
        return self.policy.config

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.policy.optimizer

    @property
    def step(self) -> int:
        return self.policy.step

    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def trained_logprobs(self) -> list[list[float | None]]:
        return self.policy.trained_logprobs

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    def logprobs(self, samples: Sequence[Sample]) -> tuple[Tensor, Tensor]:
        return self.policy.logprobs(samples)  # rank 0's weights equal every rank's: no collective needed

    # ---- collective commands ------------------------------------------------------------------------------

    def train_step(self, samples: Sequence[Sample], advantages: Sequence[float], rollouts: Sequence[int]
                   ) -> Metrics:
        def step() -> Metrics:
            dist.broadcast_object_list([(list(samples), list(advantages), list(rollouts))], src=0)
            return self.policy.train_step(samples, advantages, rollouts)
        return self._command("train_step", None, step)

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        return self._command("save", str(path), lambda: self.policy.save_checkpoint(path))

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        self._command("load", str(path), lambda: self.policy.load_checkpoint(path))

    def _command(self, name: str, arg, run: Callable):
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the distributed trainer is closed; cannot {name}")
            try:
                for conn in self._conns:
                    conn.send((name, arg))
                result = run()
                self._answers(name)
                return result
            except BaseException as exc:
                self._fail(name, exc)

    def _fail(self, name: str, exc: BaseException):
        """Stop every rank (a failed collective leaves the group unusable) and raise, naming what the ranks said."""
        failures = "" if isinstance(exc, TrainerRankFailed) else self._failures()
        self._abort()
        if failures:
            raise TrainerRankFailed(f"{name} failed: {failures}") from exc
        raise exc

    def _answers(self, name: str) -> None:
        """Wait for every rank's answer to a command; a rank's error or death raises TrainerRankFailed."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                proc.join(1)
                raise TrainerRankFailed(f"trainer rank {rank} died during {name} (exit code {proc.exitcode})")
            if status != "ok":
                raise TrainerRankFailed(f"trainer rank {rank} failed during {name}:\n{detail}")

    def _failures(self) -> str:
        """What ranks reported or how they exited, collected after a failed command."""
        notes = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            try:
                if conn.poll(1.0):
                    status, detail = conn.recv()
                    if status != "ok":
                        notes.append(f"rank {rank}: {detail}")
                        continue
            except (EOFError, OSError):
                pass
            proc.join(0.5)
            if proc.exitcode not in (None, 0):
                notes.append(f"rank {rank} exited with code {proc.exitcode}")
        return "; ".join(notes)

    # ---- shutdown -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the process group; idempotent. A step in progress on another thread gets
        CLOSE_WAIT_S to finish, then its ranks are killed (the step then fails on rank 0)."""
        if self._closed:
            return
        if self._lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                for conn in self._conns:
                    try:
                        conn.send(("close", None))
                    except OSError:
                        pass
                for proc in self._procs:
                    proc.join(CLOSE_WAIT_S)
                self._abort()
            finally:
                self._lock.release()
            return
        logger.warning("a trainer step is still running after %.0f s: killing ranks %s", CLOSE_WAIT_S, self.pids)
        self._kill()
        if self._lock.acquire(timeout=CLOSE_WAIT_S):  # the step fails once its peers are gone
            self._lock.release()
        self._abort()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)

    def _abort(self) -> None:
        self._closed = True
        if self._threads_before is not None:  # rank 0's share of the cores goes back to the whole process
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self._kill()
        for conn in self._conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "DistributedPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- ranks 1..N-1 ---------------------------------------------------------------------------------------------

def _rank_main(rank: int, world: int, port: int, backend: str, model_class: type, model_config, dtype: torch.dtype,
               config: TrainerConfig, threads: int, conn: multiprocessing.connection.Connection) -> None:
    """A spawned rank: build the model, take rank 0's weights, then run commands until told to close."""
    _exit_with_parent()
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=START_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        torch.manual_seed(config.seed)
        model = model_class(model_config).to(device=device, dtype=dtype)
        _broadcast_module(model)
        policy = ShardedPolicy(model, config, rank, world)
        conn.send(("ok", None))
        while True:
            try:
                name, arg = conn.recv()
            except EOFError:  # rank 0 closed the pipe or died
                return
            if name == "close":
                return
            COMMANDS[name](policy, arg)
            conn.send(("ok", None))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        dist.destroy_process_group()


def _train_step(policy: ShardedPolicy, _) -> None:
    payload = [None]
    dist.broadcast_object_list(payload, src=0)
    policy.train_step(*payload[0])


COMMANDS: dict[str, Callable[[ShardedPolicy, object], None]] = {
    "train_step": _train_step,
    "save": lambda policy, path: policy.save_checkpoint(path),
    "load": lambda policy, path: policy.load_checkpoint(path),
}


def _exit_with_parent() -> None:
    """End this rank the moment its parent process is gone (killed, crashed): no orphaned trainer ranks."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
