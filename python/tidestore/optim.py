"""``tidestore.AdamW``: a ``torch.optim.Optimizer`` over tidestore's chunk store.

The optimizer state — an fp32 master copy of every parameter, Adam's M and V (fp32,
bf16 or block-wise int8), and an fp32 copy of each gradient — lives in a tidestore
store: a host-memory pool of ``host_budget`` bytes, the rest in a swap file in
``nvme_dir`` (unlinked as soon as it is open: no run leaves it behind). The Rust core
steps it with tidestore's SIMD AdamW (``AdamWCore``); this class only moves tensors in
and out:

- ``step()``: every parameter's ``.grad`` (fp32, bf16 or fp16; on the GPU it comes down
  into a pinned host buffer of the parameter's own, on a side stream, ``_staging.py``) is
  handed to the core, which reads it where it is when the store steps in RAM (no copy
  into the store; else it is copied in), steps, and each parameter receives its new
  master copy rounded to its dtype, in place (on the GPU through the same buffer, the
  upload asynchronous: the compute stream waits for it on the GPU).
- ``overlap=True``: a ``register_post_accumulate_grad_hook`` hands each gradient over as
  soon as backward has finished it, and the core steps every group whose gradients are
  all final while backward goes on; ``step()`` steps the rest and writes parameters back.
  The result is bit-identical to ``overlap=False``. It is refused with ``max_grad_norm``
  (clipping needs every gradient first) and needs one backward per step (no gradient
  accumulation over several backward passes). A step cannot be skipped once groups were
  stepped during backward: a non-finite gradient that arrives after them, or a parameter
  with no gradient at ``step()``, leaves the step half made, and it raises
  (``TidestoreError``, naming the tensor and how many were stepped); the optimizer then
  refuses to go on until a checkpoint is loaded (``load_state_dict``). With nothing
  stepped yet, the iteration is dropped instead and the next one trains as usual. The
  hooks reach the optimizer weakly and go with it.
- **A CPU fp32 parameter is its own master copy** where the store keeps every chunk in
  host memory (no ``host_budget``): at construction its ``.data`` becomes a tensor over
  the master's memory in the store (the store never moves it; the tensor keeps the
  store alive), so a step reads and writes the parameter in place, with nothing copied
  back, and an edit of the parameter is an edit of the master. A tensor taken of the
  parameter's old ``.data`` before the optimizer was made no longer follows it.
  ``close()`` (or collecting the optimizer) gives each such parameter memory of its own
  again. A parameter whose ``.data`` is replaced later (``.to()``, ``p.data = ...``) is
  taken as the new master at the next step and bound again where it can be.
- Any other parameter (16-bit, on the GPU, or with a ``host_budget`` that puts state on
  NVMe) is copied: changed outside the optimizer (``model.load_state_dict``, an
  in-place edit under ``no_grad``: its version counter moved), it is compared with the
  master copy before the next step; if its values differ, they become the master copy.
  An in-place edit through ``.data`` (``p.data.mul_(0)``) moves no version counter
  torch keeps, so it is not seen there and the next step writes the master over it:
  edit such a parameter under ``torch.no_grad()`` (``p.mul_(0)``) or replace its
  ``.data``.

**Data parallel** (``process_group=torch.distributed.group.WORLD``, or any group; launch
with ``torchrun --nproc-per-node N``): the state is sharded over the group's ranks
(ZeRO-DP stage 2, see ``_shards.py``). Every rank registers the same parameters with
the same settings (checked at construction, naming what differs) and starts from rank
0's values (broadcast, as ``DistributedDataParallel`` starts); each rank's store holds
``1/N`` of every parameter's master copy, M and V (its own host pool and swap file). A
step reduce-scatters the gradients (each rank gets the average over the ranks of its
shard: no DDP wrapper is needed, its all-reduce would be traffic for nothing), sums
the ranks' gradient norms (clipping and skipping decided alike everywhere), steps the
shards and all-gathers the new values into every rank's parameters. Checkpoints are
per rank (the file name carries the rank and world size) and resume only on the same
world size. A rank that dies makes the others' next collective fail with an error
naming it. ``collectives_ahead`` (8 by default, 0 to 1024): the reduce-scatters (in
``step()``, or during backward with ``overlap``) and the write-back's all-gathers kept
in flight while the next are started and the next shards read from the store, each
waited for at most that many collectives later (0: each where it is asked for); the
same results, to the bit.

Checkpoints are streamed: ``state_dict()`` writes the state into a tidestore checkpoint
(one safetensors file: ``optimizer.master.param.I``, ``optimizer.exp_avg.param.I``,
``optimizer.exp_avg_sq.param.I``, one tensor at a time, never all in RAM) at
``checkpoint_path`` and returns a small dict that names the file, its step and the
param groups — so ``torch.save({"optim": opt.state_dict(), ...})`` stays small; keep the
file with it. ``load_state_dict()`` verifies the whole file (checksums, shapes, and that it
still holds the step the dict names) before it changes anything, loads it and writes the
master copies into the parameters. ``save(path)`` / ``load(path)`` do the same with an
explicit file.

A step with a non-finite gradient (inf, NaN) is skipped, leaving everything as it was:
that takes every gradient's norm before any parameter is stepped, one more pass over
the gradients. ``check_finite=False`` (refused with ``max_grad_norm``) applies every
step as ``torch.optim.AdamW`` does and takes no norm (``last_step`` then reports a NaN
norm).

With no ``nvme_dir`` the swap file goes in a temporary directory that goes with the
optimizer, and ``checkpoint_path`` defaults to a file beside it (same name,
``.safetensors``), which stays: a ``state_dict()`` taken before the optimizer went can
still be loaded.

Differences from ``torch.optim.AdamW``: every parameter is stepped every step (one
without a gradient is an error, where torch skips it); all param groups must share one
set of hyper-parameters, which may change between steps (a scheduler, an edit of
``param_groups``, ``load_state_dict``) and are read before each step; the parameters
are fixed when the optimizer is made (``add_param_group`` is refused); the optimizer
cannot be pickled or copied (its state is in the store: ``state_dict()``);
``amsgrad``, ``maximize``, ``capturable``, ``differentiable``, ``foreach`` and ``fused``
are taken only at torch's defaults; complex parameters are not supported (see
``_groups.py``).
"""

import json
import os
import shutil
import tempfile
import weakref

import torch

from ._tidestore import AdamWCore, TidestoreError
from ._ahead import DEFAULT_AHEAD, Overlapped, check_ahead
from ._groups import StoreOptimizer, check_threads, check_torch_only, hyper_params
from ._shards import Shards, check_world, rank_file, world_meta
from ._staging import GpuStaging
from ._views import FLOAT_DTYPES, byte_view, dtype_name, parse_bytes, store_memory

__all__ = ["AdamW"]

ADAMW_FORMAT = "tidestore.checkpoint.v1"


def closure_loss(closure):
    """What ``Optimizer.step(closure)`` returns: the loss ``closure`` computes, run with
    gradients enabled (``step`` itself runs under ``torch.no_grad``), or None without
    one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _unbind(params, adopted):
    """Gives every parameter still bound to a store's memory (``adopted``: the address
    per parameter, or None) a copy of its own, so that the store can go."""
    with torch.no_grad():
        for k, (p, addr) in enumerate(zip(params, adopted)):
            if addr is not None and p.data_ptr() == addr:
                p.data = p.data.clone()
            adopted[k] = None


def _grad_hook(opt_ref, i):
    def hook(p):
        opt = opt_ref()
        if opt is not None:
            opt._grad_ready(i, p)
    return hook


def _remove_hooks(hooks):
    for h in hooks:
        h.remove()
    hooks.clear()


class _Closed:
    """The core of a closed optimizer: any use is an error that says so."""

    def __getattr__(self, name):
        raise TidestoreError("tidestore.AdamW: used after close()")


class AdamW(StoreOptimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 states="fp32", nvme_dir=None, host_budget=None, max_grad_norm=None,
                 overlap=False, threads=0, checkpoint_path=None, chunk_elements=None,
                 process_group=None, check_finite=True,
                 collectives_ahead=DEFAULT_AHEAD, **torch_only):
        check_torch_only(torch_only, "tidestore.AdamW")
        check_threads(threads)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        hp = hyper_params(self.param_groups, "tidestore.AdamW")
        self._params = [p for g in self.param_groups for p in g["params"]]
        first_at = {}
        for i, p in enumerate(self._params):
            self._check_param(i, p)
            j = first_at.setdefault(id(p), i)
            if j != i:
                raise ValueError(f"parameter {i} is parameter {j} again: pass each "
                                 "parameter once")
        host_budget = parse_bytes(host_budget, "host_budget")
        check_ahead(collectives_ahead)
        self._tmpdir = None
        if nvme_dir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="tidestore-adamw-")
            nvme_dir = self._tmpdir
            weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        self.nvme_dir = os.fspath(nvme_dir)
        # Beside a temporary nvme_dir, not in it: the directory goes with the optimizer,
        # a state_dict's file must outlive it.
        default_checkpoint = (self._tmpdir + ".safetensors" if self._tmpdir is not None
                              else os.path.join(self.nvme_dir, "tidestore-adamw.safetensors"))
        self.checkpoint_path = os.fspath(checkpoint_path or default_checkpoint)
        self.overlap = bool(overlap)
        self._shapes = [tuple(p.shape) for p in self._params]
        g0 = self.param_groups[0]
        core_shapes = [list(s) for s in self._shapes]
        self._shards = None
        self._collectives = None
        if process_group is not None:
            self._shards = Shards(self._params, process_group)
            self._shards.check_alike(self._params, {
                **{k: (list(v) if isinstance(v, tuple) else v) for k, v in g0.items()
                   if k != "params"},
                "states": states, "max_grad_norm": max_grad_norm, "overlap": self.overlap,
                "check_finite": bool(check_finite), "collectives_ahead": collectives_ahead})
            self._shards.broadcast(self._params)
            core_shapes = [[s] for s in self._shards.lens]
            self._collectives = Overlapped(self._shards, collectives_ahead)
        self._core = AdamWCore(
            core_shapes, lr=hp[0], betas=hp[1], eps=hp[2], weight_decay=hp[3], states=states,
            nvme_dir=self.nvme_dir, host_budget=host_budget, max_grad_norm=max_grad_norm,
            overlap=self.overlap, threads=threads, chunk_elements=chunk_elements,
            check_finite=bool(check_finite))
        if self._shards is not None:
            self._core.set_norm_peers(self._shards.sum_sq_norm)
        self._applied = hp
        # Parameters on a GPU move through pinned buffers on a side stream (one rank's
        # whole parameters: not under a process group, whose collectives stage them).
        self._staging = (GpuStaging(self._params) if self._shards is None and any(
            p.device.type == "cuda" for p in self._params) else None)
        # Per parameter, the address of the store's memory its .data is bound to (None:
        # copied; see the module doc).
        self._adopted = [None] * len(self._params)
        for i, p in enumerate(self._params):
            self._take(i, p)
        unbind = weakref.finalize(self, _unbind, self._params, self._adopted)
        unbind.atexit = False
        self._versions = [p._version for p in self._params]
        self._checked = False
        self._hooks = []
        if self.overlap:
            # The hooks reach the optimizer weakly (a parameter must not keep it, and its
            # store, alive) and go with it.
            me = weakref.ref(self)
            for i, p in enumerate(self._params):
                self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, i)))
            weakref.finalize(self, _remove_hooks, self._hooks)
        self._seal()

    # -- checks ------------------------------------------------------------------------

    def _check_param(self, i, p, shape=None):
        what = f"parameter {i}"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{what}: a {type(p).__name__}, expected a torch.Tensor")
        if dtype_name(p) not in FLOAT_DTYPES:
            raise TypeError(f"{what}: dtype {p.dtype} is not float32, bfloat16 or float16")
        if not p.requires_grad:
            raise ValueError(f"{what} does not require grad; pass only trainable parameters")
        if not p.is_contiguous():
            raise ValueError(f"{what} (shape {tuple(p.shape)}) is not contiguous")
        if shape is not None and tuple(p.shape) != shape:
            raise ValueError(
                f"{what} changed shape from {shape} to {tuple(p.shape)} since it was registered")

    def _check_grad(self, i, p):
        g = p.grad
        what = f"parameter {i}"
        if g is None:
            raise ValueError(
                f"{what} (shape {tuple(p.shape)}) has no gradient: tidestore.AdamW steps every "
                "parameter every step; pass only parameters that get gradients")
        if g.is_sparse or g.layout != torch.strided:
            raise TypeError(f"{what}: sparse gradients are not supported")
        if dtype_name(g) not in FLOAT_DTYPES:
            raise TypeError(f"{what}: gradient dtype {g.dtype} is not float32, bfloat16 or float16")
        if tuple(g.shape) != self._shapes[i]:
            raise ValueError(
                f"{what}: gradient of shape {tuple(g.shape)} for a parameter of shape "
                f"{self._shapes[i]}")

    def _check_all(self):
        """Every parameter as registered (shape, dtype, contiguity), checked before any
        is handed over; parameters changed outside the optimizer synced into the core."""
        self._sync_hyper(self._core)
        for i, p in enumerate(self._params):
            self._check_param(i, p, self._shapes[i])
        for i, p in enumerate(self._params):
            if self._adopted[i] is not None:
                if self._bound(i):
                    continue
                # .data was replaced: the new values are the master, bound again.
                self._take(i, p)
                self._versions[i] = p._version
            elif p._version != self._versions[i]:
                self._core.sync_param(i, self._cpu_view(self._held(i, p)), dtype_name(p))
                self._versions[i] = p._version

    # -- moving tensors ----------------------------------------------------------------

    def _take(self, i, p):
        """p's values become parameter i's master copy, and p is bound to it where the
        store keeps it in place (a CPU fp32 parameter, see the module doc); otherwise
        it stays copied."""
        self._adopted[i] = None
        self._core.set_param(i, self._cpu_view(self._held(i, p)), dtype_name(p))
        if p.device.type != "cpu" or p.dtype != torch.float32 or self._shards is not None:
            return
        where = self._core.resident_master(i)
        if where is None:
            return
        addr, nbytes = where
        p.data = store_memory(self._core, addr, nbytes).view(torch.float32).view(p.shape)
        self._adopted[i] = addr

    def _held(self, i, t):
        """What the core holds of parameter ``i`` (or its gradient) ``t``: all of it, or
        this rank's shard (the ranks' average, for a gradient)."""
        if self._shards is None:
            return t
        return self._shards.values(i, t)

    def _bound(self, i):
        """Parameter i's .data is still the store's memory it was bound to."""
        return self._adopted[i] is not None and self._params[i].data_ptr() == self._adopted[i]

    @staticmethod
    def _cpu_view(t):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        return byte_view(t, "tensor")

    def _put_grad(self, i, p):
        """Hands the core parameter ``i``'s gradient as it is, or (with a process group)
        starts reduce-scattering it, to be handed over at most ``collectives_ahead``
        gradients later."""
        if self._collectives is None:
            self._put_shard(i, p.grad.detach())
        else:
            self._collectives.scatter(i, p.grad, True, True,
                                      lambda i, g, _first, _last: self._put_shard(i, g))

    def _put_shard(self, i, g):
        if self._staging is not None and self._staging.covers(i, g):
            g = self._staging.down([(i, g)])[0]
        self._core.put_grad(i, self._cpu_view(g), dtype_name(g))

    def _given_grads(self):
        """Every gradient as the core's ``step_given`` takes it, in order: where torch
        left it, or this rank's shard of the ranks' average (up to
        ``collectives_ahead`` reduce-scatters in flight)."""
        if self._collectives is None:
            # Read where torch left them (copied in only where the store cannot); on a
            # GPU, from the staging buffers they came down into.
            grads = [p.grad.detach() for p in self._params]
            if self._staging is not None:
                down = [(i, g) for i, g in enumerate(grads) if self._staging.covers(i, g)]
                for (i, _), buf in zip(down, self._staging.down(down)):
                    grads[i] = buf
            return [(self._cpu_view(g), dtype_name(g)) for g in grads]
        grads = []

        def take(_i, g, _first, _last):
            grads.append((self._cpu_view(g), dtype_name(g)))
        for i, p in enumerate(self._params):
            self._collectives.scatter(i, p.grad, True, True, take)
        self._collectives.flush()
        return grads

    def _write_back(self):
        up = []
        for i, p in enumerate(self._params):
            if self._bound(i):
                continue
            dt = dtype_name(p)
            if self._shards is not None:
                # The all-gathers left behind, up to collectives_ahead in flight while
                # the next shards are read from the store.
                shard = torch.empty(self._shards.lens[i], dtype=p.dtype)
                self._core.read_param(i, byte_view(shard, f"parameter {i}", writable=True), dt)
                self._collectives.behind(self._shards.gather_into_later(i, p, shard),
                                         lambda _, i=i, p=p: self._written(i, p))
                continue
            if p.device.type == "cpu":
                self._core.read_param(i, byte_view(p.detach(), f"parameter {i}", writable=True), dt)
            elif self._staging is not None and self._staging.covers(i, p):
                buf = self._staging.buffer(i)
                self._core.read_param(i, byte_view(buf, f"parameter {i}", writable=True), dt)
                up.append((i, p))
                continue
            else:
                tmp = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                self._core.read_param(i, byte_view(tmp, f"parameter {i}", writable=True), dt)
                with torch.no_grad():
                    p.copy_(tmp)
            self._written(i, p)
        if up:
            self._staging.up(up)
            for i, p in up:
                self._written(i, p)
        if self._collectives is not None:
            self._collectives.flush()

    def _written(self, i, p):
        """Parameter ``i`` holds its master's values now: a later change is the user's."""
        self._versions[i] = p._version

    def _grad_ready(self, i, p):
        """With overlap, parameter ``i``'s gradient is final: handed over now."""
        if not self._checked:
            self._check_all()
            self._checked = True
        self._check_grad(i, p)
        self._put_grad(i, p)

    # -- the Optimizer interface -------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if not self.overlap:
            self._check_all()
            for i, p in enumerate(self._params):
                self._check_grad(i, p)
            self.last_step = self._core.step_given(self._given_grads())
        else:
            # A step that fails ends the iteration all the same (a missing gradient
            # drops it, see `StepLoop::abandon`): the next backward checks afresh.
            self._checked = False
            if self._collectives is not None:
                self._collectives.flush()  # the gradients the hooks left behind
            self.last_step = self._core.step()
        self._checked = False
        self._write_back()
        return loss

    def _groups_meta(self):
        groups, start = [], 0
        for g in self.param_groups:
            meta = {k: (list(v) if isinstance(v, tuple) else v)
                    for k, v in g.items() if k != "params"}
            meta["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(meta)
        return groups

    def save(self, path):
        """Streams the optimizer state into a tidestore checkpoint file at ``path``
        (with a process group, every rank writes its shards into a file of its own,
        named after ``path`` with its rank and the world size; returns that name)."""
        path = rank_file(path, self._shards)
        meta = {"param_groups": json.dumps(self._groups_meta()),
                "step": str(self._core.step_count()), **world_meta(self._shards)}
        self._core.save(path, meta)
        return path

    def load(self, path):
        """Loads a checkpoint written by ``save``/``state_dict`` (verified whole first)
        and writes its master copies into the parameters. A sharded checkpoint loads
        only on the same world size, each rank its own file (no re-sharding)."""
        base, path = os.fspath(path), rank_file(path, self._shards)
        if not os.path.exists(path) and os.path.exists(base):
            path = base  # written without a process group: refused below, by name
        found = AdamWCore.read_metadata(path)
        check_world(path, found.get("world_size", 1), found.get("rank", 0), self._shards,
                    "optimizer")
        groups = json.loads(found.get("param_groups", "[]"))
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"checkpoint {path} has {len(groups)} param groups, this optimizer "
                f"{len(self.param_groups)}")
        meta = self._core.load(path)
        self._restore_groups(groups)
        self._write_back()
        return meta

    def _restore_groups(self, groups):
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v
        self._sync_hyper(self._core)

    def state_dict(self):
        path = self.save(self.checkpoint_path)
        return {
            "state": {},
            "param_groups": self._groups_meta(),
            "tidestore": {"format": ADAMW_FORMAT, "path": path,
                          "base_path": self.checkpoint_path,
                          "step": self._core.step_count(), **world_meta(self._shards)},
        }

    def load_state_dict(self, state_dict):
        ts = state_dict.get("tidestore") if isinstance(state_dict, dict) else None
        if not ts or "path" not in ts or ts.get("format", ADAMW_FORMAT) != ADAMW_FORMAT:
            raise ValueError(
                "not a tidestore.AdamW state dict (no 'tidestore' entry of format "
                f"{ADAMW_FORMAT} naming the checkpoint file; found "
                f"{ts and ts.get('format')!r}); torch.optim.AdamW's or an offloaded "
                "model's state cannot be loaded into it")
        # Every rank loads its own file, whichever rank's dict this is.
        path = rank_file(ts["base_path"], self._shards) if "base_path" in ts else ts["path"]
        check_world(path, ts.get("world_size", 1), None, self._shards, "optimizer")
        found = AdamWCore.read_metadata(path).get("step")
        if found != str(ts.get("step")):
            raise ValueError(
                f"checkpoint {path} holds step {found}, the state dict names step "
                f"{ts.get('step')}: the file was overwritten by a later save")
        self.load(ts.get("base_path", path))
        self._restore_groups(state_dict["param_groups"])

    def close(self):
        """Releases the store now: its host pool, and the space of its swap file (the
        file has no name in ``nvme_dir`` once the store is open; its space comes back
        when the store goes: here, when the optimizer is garbage-collected, or when the
        process ends). Bound parameters get memory of their own first."""
        _remove_hooks(self._hooks)
        _unbind(self._params, self._adopted)
        self._core = _Closed()
        self._staging = None

    def stats(self):
        """The store's and the step loop's counters (NVMe bytes moved, host buffers...);
        with a process group, also the world size and the bytes this rank sent into
        each collective (``sent_reduce_scatter_bytes``, ...)."""
        stats = self._core.stats()
        if self._collectives is not None:
            stats.update(self._collectives.report())
        return stats
