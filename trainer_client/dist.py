"""Rank context, node-aware process groups, and a local multi-process launcher.

The node layout is derived, never discovered: ranks are consecutive per node (torchrun's
convention, the planner's `Topology`), so `node = rank // local_world_size` on every rank
without a collective. Groups are created once per (world, layout) because `new_group` is a
collective every rank must enter in the same order; the cache keeps that true however often
callers ask.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: Locality of a peer as seen from this rank, index into planner.types.LOCALITIES.
SAME_RANK, INTRA_NODE, INTER_NODE = 0, 1, 2


@dataclass(frozen=True, slots=True, kw_only=True)
class RankContext:
    """Where this process sits: global rank, world, rank within its node, node index."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size={self.local_world_size} must divide world_size={self.world_size}"
            )
        if self.local_rank != self.rank % self.local_world_size:
            raise ValueError(
                f"local_rank={self.local_rank} != rank % local_world_size = "
                f"{self.rank % self.local_world_size}: ranks must be consecutive per node"
            )
        if self.node != self.rank // self.local_world_size:
            raise ValueError(f"node={self.node} != rank // local_world_size")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def locality(self, peer: int) -> int:
        """SAME_RANK, INTRA_NODE or INTER_NODE of `peer` relative to this rank."""
        if peer == self.rank:
            return SAME_RANK
        return INTRA_NODE if self.node_of(peer) == self.node else INTER_NODE

    @classmethod
    def create(cls, *, rank: int, world_size: int, local_world_size: int) -> RankContext:
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=rank % local_world_size,
            local_world_size=local_world_size,
            node=rank // local_world_size,
        )

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
    ) -> RankContext:
        """Read torchrun's RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (LOCAL_RANK is checked).

        Explicit arguments override the environment; a missing RANK/WORLD_SIZE means a single
        process, a missing LOCAL_WORLD_SIZE means one node.
        """
        env = os.environ if env is None else env

        def read(name: str, given: int | None, default: int | None) -> int:
            if given is not None:
                return int(given)
            raw = env.get(name)
            if raw is None:
                if default is None:
                    raise ValueError(f"{name} is not set and no explicit value was given")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None

        r = read("RANK", rank, 0)
        w = read("WORLD_SIZE", world_size, 1)
        lw = read("LOCAL_WORLD_SIZE", local_world_size, w)
        ctx = cls.create(rank=r, world_size=w, local_world_size=lw)
        if "LOCAL_RANK" in env and rank is None and local_world_size is None:
            if int(env["LOCAL_RANK"]) != ctx.local_rank:
                raise ValueError(
                    f"LOCAL_RANK={env['LOCAL_RANK']} disagrees with RANK={r} and "
                    f"LOCAL_WORLD_SIZE={lw}: ranks must be consecutive per node"
                )
        return ctx

    @classmethod
    def from_process_group(cls, local_world_size: int | None = None) -> RankContext:
        """Rank and world from the initialized default group; layout from env or argument."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized")
        return cls.from_env(
            rank=dist.get_rank(), world_size=dist.get_world_size(),
            local_world_size=local_world_size
            if local_world_size is not None
            else int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        )


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """This rank's intra-node group (ranks of its node) and inter-node group (same local rank)."""

    intra: Any  # ProcessGroup; group rank == local_rank
    inter: Any  # ProcessGroup; group rank == node


# value holds the world group too: keeping it alive means its id() cannot be reused by a new world
_GROUP_CACHE: dict[tuple[int, int, int], tuple[Any, NodeGroups]] = {}


def node_groups(ctx: RankContext) -> NodeGroups:
    """Build (once) the node-aware process groups; every rank must call this collectively."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized")
    if dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
        raise ValueError(
            f"RankContext(rank={ctx.rank}, world_size={ctx.world_size}) does not match the "
            f"process group (rank={dist.get_rank()}, world_size={dist.get_world_size()})"
        )
    # id() of the default group distinguishes re-initialized worlds inside one process.
    world = dist.group.WORLD
    key = (id(world), ctx.world_size, ctx.local_world_size)
    cached = _GROUP_CACHE.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    g, n = ctx.local_world_size, ctx.num_nodes
    intra = inter = None
    for node in range(n):  # every rank creates every group, in the same order
        pg = dist.new_group(ranks=list(range(node * g, (node + 1) * g)))
        if node == ctx.node:
            intra = pg
    for local in range(g):
        pg = dist.new_group(ranks=list(range(local, ctx.world_size, g)))
        if local == ctx.local_rank:
            inter = pg
    groups = NodeGroups(intra=intra, inter=inter)
    _GROUP_CACHE[key] = (world, groups)
    return groups


#: Gradient bytes summed in one all_reduce (DDP's default bucket): fewer collectives than one
#: per parameter, and a bounded extra copy.
GRAD_BUCKET_BYTES = 25 * 2**20


def all_reduce_gradients(model: torch.nn.Module, *, divide_by: float = 1.0, group=None) -> None:
    """Sum every trainable parameter's gradient over the data-parallel ranks, then divide it by
    `divide_by` (with summed losses, `LLMOutput.loss_sum`: the global number of targets).

    The gradient sync DistributedDataParallel does in its backward hooks, called by the loop
    after the step's micro-batches: DDP cannot wrap a model run by `forward_microbatch`
    (the wrapper hides `encode_vision`..., and its `.module` skips the sync), and each rank's
    share of a balanced step differs. Every rank must call it with the same model; a
    parameter without a gradient on this rank (no item of its encoder here) counts as zeros,
    so the ranks' collectives stay in step. A parameter FSDP shards (a DTensor, as
    `shard_model` leaves every one) had its gradient summed by FSDP's reduce-scatter in
    backward: it is only divided, so one loop serves both.
    """
    from torch.distributed.tensor import DTensor

    params, sharded = [], []
    for p in model.parameters():
        if p.requires_grad:
            (sharded if isinstance(p, DTensor) else params).append(p)
    if divide_by != 1.0:
        with torch.no_grad():
            for p in sharded:
                if p.grad is not None:
                    p.grad.div_(divide_by)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for grads in _buckets([p.grad for p in params]):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if divide_by != 1.0:
            flat /= divide_by
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


#: The `MultimodalModel` methods `forward_microbatch` and `train_microbatch` call instead of
#: `forward`: FSDP runs its hooks around these too once `shard_model` registers them.
FORWARD_METHODS = ("encode_vision", "encode_audio", "embed_text", "llm")


def shard_model(model: torch.nn.Module, mesh, *, units=None, **fully_shard_kwargs) -> torch.nn.Module:
    """Shard `model` with FSDP2 (`torch.distributed.fsdp.fully_shard`) for `forward_microbatch`
    and `train_microbatch`; returns it (now an `FSDPModule`, sharded in place).

    Each of `units` (default: every module of every `nn.ModuleList` in the model, e.g. the
    transformer blocks) becomes an FSDP unit, then `model` itself: the root holds what is left
    (embeddings, projectors, heads). Three things plain `fully_shard` would get wrong here:

    - the four `FORWARD_METHODS` run FSDP's pre/post-forward hooks
      (`register_fsdp_forward_method`): the loop never calls `model.forward`, so the root's
      parameters would stay sharded;
    - a parameter without a gradient on a rank (attention over no item, an encoder with
      nothing to encode) reduce-scatters zeros (`set_reduce_scatter_unused_params`), so
      every rank makes the same collectives;
    - gradients are summed over ranks, not averaged (`set_gradient_divide_factor(1.0)`, sum
      reductions only: gloo has no PREMUL_SUM), as `all_reduce_gradients` sums: the loop
      divides by the step's targets with `all_reduce_gradients(model, divide_by=targets)`,
      which only divides what FSDP reduced.

    Every rank must call every unit the same number of times per micro-batch, and keep each
    call's output in the loss's graph, also where it has no item of a phase (the reference
    model does; `forward_microbatch` calls every encoder, on no items too). `mesh`: the
    data-parallel `DeviceMesh`, e.g. `init_device_mesh("cuda", (world_size,))` ("cpu" with
    gloo); it and `fully_shard_kwargs` (`reshard_after_forward`, `mp_policy`...) go to every
    `fully_shard` call.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    missing = [m for m in FORWARD_METHODS if not callable(getattr(model, m, None))]
    if missing:
        raise ValueError(f"{type(model).__name__} has no {', '.join(missing)}: not a MultimodalModel")
    if units is None:
        units = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
    for unit in units:
        fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reduce_scatter_unused_params(True, recurse=False)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`grads` in runs of one dtype and device, each of about GRAD_BUCKET_BYTES; the same runs
    on every rank (parameters come in one order)."""
    out: list[list[torch.Tensor]] = []
    open_runs: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    for g in grads:
        key = (g.dtype, g.device)
        run, size = open_runs.get(key, (None, 0))
        if run is None or size >= GRAD_BUCKET_BYTES:
            run, size = [], 0
            out.append(run)
        run.append(g)
        open_runs[key] = (run, size + g.numel() * g.element_size())
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn, args, ctx: RankContext, port: int, backend: str, timeout_s: float, out) -> None:
    os.environ.update(
        RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.local_rank),
        LOCAL_WORLD_SIZE=str(ctx.local_world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # all ranks share this machine: one GPU per global rank
            torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
            world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s),
        )
        try:
            out.put((ctx.rank, True, fn(ctx, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank attached
        out.put((ctx.rank, False, traceback.format_exc()))


def run_local_group(
    fn: Callable[..., Any],
    *,
    world_size: int,
    local_world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` spawned local ranks; return results by rank.

    For tests, benchmarks and demos on one machine: a loopback rendezvous on a random free
    port, a process-group timeout and a hard join deadline so a hung collective fails instead
    of hanging. `fn` must be importable (module level) and return picklable values.
    """
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    port = free_port()
    procs = []
    for r in range(world_size):
        ctx = RankContext.create(rank=r, world_size=world_size, local_world_size=local_world_size)
        p = mp.Process(target=_worker, args=(fn, args, ctx, port, backend, timeout_s, out), daemon=True)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout_s + 30.0
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                # A rank that died before reporting leaves its peers blocked in a collective
                # until the group timeout fires; they report then, so only stop when all are gone.
                if all(not p.is_alive() for p in procs):
                    break
                continue
            (results if ok else errors)[rank] = value
            if not ok:  # its peers are likely blocked on it: give them a moment, not the full timeout
                deadline = min(deadline, time.monotonic() + 5.0)
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        # before the kill below: a rank still running now is one that timed out
        exit_codes = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    # A rank that died without a word is the likely cause of its peers' collective errors: named
    # first, with how it ended, and with the errors the others reported.
    silent = [_unreported(r, exit_codes[r], timeout_s, bool(errors)) for r in range(world_size)
              if r not in results and r not in errors]
    if errors:
        first = next(iter(errors))  # the first to report is the likely cause; peers time out after
        others = "".join(f"\nrank {r}: {tb.strip().splitlines()[-1]}" for r, tb in errors.items()
                         if r != first)
        raise RuntimeError("".join(f"{s}; " for s in silent) + f"rank {first} failed ({len(errors)} "
                           f"ranks failed):\n{errors[first]}{others}")
    if silent:
        raise RuntimeError("; ".join(silent))
    return [results[r] for r in range(world_size)]


def _unreported(rank: int, exit_code: int | None, timeout_s: float, peer_failed: bool) -> str:
    """How rank `rank` ended without reporting a result or an error."""
    if exit_code is None:  # still running: killed at the deadline
        return (f"rank {rank} had not reported 5 s after a peer failed (killed)" if peer_failed
                else f"rank {rank} did not report within {timeout_s}s (killed)")
    if exit_code < 0:
        return f"rank {rank} was killed by signal {-exit_code} before it reported"
    return (f"rank {rank} exited with code {exit_code} before it reported (os._exit or a crash "
            "in native code: its output above says why)")
