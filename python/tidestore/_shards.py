"""Data parallelism for ``tidestore.AdamW`` (the optimizer state sharded over the ranks
of a ``torch.distributed`` process group, gradients partitioned: ZeRO stage 2) and for
``tidestore.offload`` (the parameters sharded too, gathered per module: stage 3).

Layout: every parameter of ``n`` elements is cut into ``world`` equal shards of
``ceil(n / world)`` elements, rank ``r`` owning shard ``r``; the last shards are padded
with zeros where ``world`` does not divide ``n`` (a padded element has a zero gradient,
so AdamW leaves it zero). Each rank's store holds only its shards' fp32 master copies,
M and V: its host pool and its swap file hold ``1 / world`` of the state.

Per step, over the group's backend (gloo on CPUs, NCCL on GPUs; no transport of our own):
- every gradient is **reduce-scattered**: each rank receives the sum of the ranks'
  gradients over its shard, divided by ``world`` (the average, as
  ``DistributedDataParallel`` makes it; a model also wrapped in DDP arrives with its
  gradients averaged already and they stay so, but DDP's all-reduce is then sent for
  nothing);
- the ranks' squared gradient norms are summed by one **all-reduce** of a float64,
  so that clipping and the skip of a non-finite step are decided alike everywhere
  (``AdamWCore.set_norm_peers``);
- every rank steps its shards;
- the new values are **all-gathered** into every rank's parameters (``tidestore.AdamW``,
  after the step; ``tidestore.offload``, into a module's buffer each time it is bound).

Both keep these collectives in flight (``_ahead.Overlapped``, up to
``collectives_ahead``): ``tidestore.offload`` starts a module's gathers ahead of its
bind and waits for each reduce-scatter behind, beside its modules' compute;
``tidestore.AdamW`` leaves its reduce-scatters and write-back gathers behind while the
next start. The ``*_later`` methods start a collective and return a ``Pending``.

Per step and parameter of ``n`` elements of ``b`` bytes, each rank sends and receives
``(world - 1) * ceil(n / world) * b`` bytes in each of the two collectives.
"""

import contextlib
import os

import torch
import torch.distributed as dist

__all__ = ["Pending", "Shards", "check_world", "rank_file", "world_meta", "world_of"]


def world_of(shards):
    """(world size, rank) of a sharded run's ``shards``; (1, 0) without a group."""
    return (1, 0) if shards is None else (shards.world, shards.rank)


def world_meta(shards):
    """The checkpoint metadata naming the world size and rank that wrote it."""
    world, rank = world_of(shards)
    return {"world_size": str(world), "rank": str(rank)}


def rank_file(path, shards):
    """Where this rank keeps the checkpoint named ``path``: ``path`` itself without a
    process group; else the rank and world size go into the file name, before its
    extension."""
    path = os.fspath(path)
    world, rank = world_of(shards)
    if world == 1:
        return path
    stem, dot, ext = path.rpartition(".")
    if not dot or "/" in ext:
        return f"{path}.rank{rank}-of-{world}"
    return f"{stem}.rank{rank}-of-{world}.{ext}"


def check_world(path, world_size, rank, shards, who):
    """Refuses the checkpoint ``path`` written on another world size, or (``rank`` not
    None) by another rank: there is no re-sharding. ``who``: what loads it."""
    world, mine = world_of(shards)
    if int(world_size) != world or (rank is not None and int(rank) != mine):
        by = f"rank {rank} of {world_size}" if rank is not None else f"{world_size} rank(s)"
        raise ValueError(
            f"checkpoint {path} was written by {by}; this {who} is rank {mine} of {world}: "
            "a checkpoint resumes on the world size that wrote it (tidestore does not "
            "re-shard)")


class Shards:
    """The shards of ``params`` this rank of ``group`` owns, and the collectives that
    move gradients and values between the ranks."""

    def __init__(self, params, group):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group first (torchrun sets its environment)")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numels = [p.numel() for p in params]
        self.lens = [-(-n // self.world) for n in self.numels]
        # Bytes this rank sent into each collective (``(world - 1)`` shards of each
        # tensor it passed: what ring and direct algorithms send alike).
        self.sent = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
        backend = dist.get_backend(group)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if backend == "nccl" else torch.device("cpu"))

    # -- start: every rank the same ------------------------------------------------

    def check_alike(self, params, settings):
        """Raises on every rank, naming what differs, unless every rank registered the
        same parameters (shapes, dtypes) with the same optimizer settings."""
        mine = {"shapes": [tuple(p.shape) for p in params],
                "dtypes": [str(p.dtype) for p in params], "settings": settings}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        first = everyone[0]
        for r, theirs in enumerate(everyone[1:], 1):
            why = _difference(first, theirs)
            if why is not None:
                raise ValueError(
                    f"tidestore: rank {r} differs from rank 0: {why}; every rank must build "
                    "the same model and optimizer")

    def broadcast(self, params):
        """Rank 0's parameter values on every rank (as ``DistributedDataParallel``
        starts)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for p in params:
                t = p.detach().to(self.device)
                dist.broadcast(t, src=src, group=self.group)
                if t.data_ptr() != p.data_ptr():
                    p.copy_(t)

    # -- per step ------------------------------------------------------------------

    def values(self, i, t):
        """This rank's shard of parameter ``i``'s values ``t``: a contiguous CPU tensor
        of the shard's length, zero-padded."""
        lo, hi = self._bounds(i)
        flat = t.detach().reshape(-1)[lo:hi].to("cpu")
        if hi - lo == self.lens[i]:
            return flat.contiguous()
        out = torch.zeros(self.lens[i], dtype=t.dtype)
        out[: hi - lo] = flat
        return out

    def grad_later(self, i, g):
        """Starts reduce-scattering the gradient ``g`` of this rank's batch for parameter
        ``i``: a ``Pending`` whose ``wait`` gives this rank's shard of the ranks' average,
        on the CPU."""
        s, n = self.lens[i], self.numels[i]
        flat = g.detach().reshape(-1).to(self.device)
        if s * self.world != n:
            padded = torch.zeros(s * self.world, dtype=g.dtype, device=self.device)
            padded[:n] = flat
            flat = padded
        flat = flat.contiguous()
        out = torch.empty(s, dtype=g.dtype, device=self.device)
        what = f"the reduce-scatter of parameter {i}'s gradient"
        with _collective(what):
            work = dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM,
                                              group=self.group, async_op=True)
        self.sent["reduce_scatter"] += (self.world - 1) * out.numel() * out.element_size()

        def average():
            return out.div_(self.world).to("cpu")
        return Pending(work, average, what, flat)

    def gather_into_later(self, i, p, shard):
        """Starts gathering every rank's new shard of parameter ``i`` (this rank's is
        ``shard``) into ``p``: a ``Pending`` whose ``wait`` finishes it (``p`` is not to
        be read before)."""
        s, n = self.lens[i], self.numels[i]
        if s * self.world == n and p.device == self.device and p.is_contiguous():
            return self._start_gather(i, p.detach().view(-1), shard, lambda: None)
        full = torch.empty(s * self.world, dtype=shard.dtype, device=self.device)

        def copy():
            with torch.no_grad():
                p.view(-1).copy_(full[:n].to(p.device))
        return self._start_gather(i, full, shard, copy)

    def gathered(self, i, shard):
        """Parameter ``i``'s whole values, flat, in a new tensor: every rank's shard
        (this rank's is ``shard``) gathered."""
        return self.gather_later(i, shard).wait()

    def gather_later(self, i, shard):
        """``gathered`` started: a ``Pending`` whose ``wait`` gives the values."""
        full = torch.empty(self.lens[i] * self.world, dtype=shard.dtype, device=self.device)
        return self._start_gather(i, full, shard, lambda: full[: self.numels[i]])

    def _start_gather(self, i, full, shard, result):
        shard = shard.to(self.device)
        what = f"the all-gather of parameter {i}"
        with _collective(what):
            work = dist.all_gather_into_tensor(full, shard, group=self.group, async_op=True)
        self.sent["all_gather"] += (self.world - 1) * shard.numel() * shard.element_size()
        return Pending(work, result, what, shard)

    def sum_sq_norm(self, local):
        """The ranks' squared gradient norms summed (the step loop's ``NormPeers``)."""
        t = torch.tensor([local], dtype=torch.float64, device=self.device)
        with _collective("the all-reduce of the gradient norm"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.sent["all_reduce"] += (self.world - 1) * t.element_size()
        return float(t.item())

    def _bounds(self, i):
        s, n = self.lens[i], self.numels[i]
        return min(self.rank * s, n), min((self.rank + 1) * s, n)


class Pending:
    """A collective in flight: ``wait`` blocks until it is done and gives what
    ``result()`` makes of it then. It keeps the tensor the collective reads alive
    until then."""

    __slots__ = ("_work", "_result", "_what", "_input")

    def __init__(self, work, result, what, input_tensor):
        self._work = work
        self._result = result
        self._what = what
        self._input = input_tensor

    def wait(self):
        with _collective(self._what):
            self._work.wait()
        self._input = None
        return self._result()


@contextlib.contextmanager
def _collective(what):
    """Names the collective that failed (a rank that died, a timeout)."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"tidestore: {what} with the other ranks failed: {e}") from e


def _difference(a, b):
    """What differs between two ranks' registrations (None: nothing)."""
    if len(a["shapes"]) != len(b["shapes"]):
        return f"{len(b['shapes'])} parameters against {len(a['shapes'])}"
    for k, (sa, sb, da, db) in enumerate(zip(a["shapes"], b["shapes"], a["dtypes"], b["dtypes"])):
        if sa != sb or da != db:
            return f"parameter {k} is {sb} {db} against {sa} {da}"
    for key, va in a["settings"].items():
        vb = b["settings"].get(key)
        if va != vb:
            return f"{key} = {vb!r} against {va!r}"
    return None
