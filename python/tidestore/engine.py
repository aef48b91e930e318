"""``tidestore.offload``: a whole ``torch.nn.Module`` trained out of tidestore's store.

Every parameter of the model becomes a tensor of a tidestore store (registered in the
model's parameter order, which for the models people fine-tune is forward order; the
first iteration traces the real order and the later ones prefetch and evict by it):
its values, fp32 master, Adam M and V live in chunks in the host pool and in a swap
file on NVMe (and on a device tier: the GPU the modules compute on with
``device="cuda"``, or the simulated device standing in for one, ``device_budget`` /
``device.kind = "sim"``), so the model never has to fit in memory.
Buffers stay torch's.

How a module meets its weights:

- **Before it runs** (forward, and the recompute of activation checkpointing) each of
  its own parameters is acquired from the store and ``param.data`` becomes a torch
  tensor *over the store's memory* (no copy; on a GPU a CUDA tensor over the device
  tier's memory, which the GPU has finished reading before the last hold is released).
  A parameter held twice (a tied weight, a module called twice) is counted, not copied.
- **After it runs** in forward they are released (the chunk may move again) and
  ``param.data`` is a stand-in (its shape over one NaN) whose values nothing may read:
  code that tries is refused by name (``_guard.py``). What autograd saved of them does
  not pin them: the engine's saved-tensor hooks keep a token instead of the tensor, and
  backward acquires the parameter again when it needs the value. In backward (and a checkpoint's
  recompute) a parameter stays held until its module's backward has run, and never past
  the end of backward.
- **Gradients** go to the store as they become final (a post-accumulate-grad hook),
  once the parameter is released: widened into the fp32 gradient (``precision="f32"``)
  or over the bf16 copy (``"bf16"``), their norm reported to the step loop; with
  ``overlap="backward"`` (or ``True``) the store steps each group as soon as its
  gradients are final, during backward. Where the store steps in place in RAM (f32, no
  host budget, one backward per step, no overlap) they are kept until the step instead,
  which reads them where torch left them. ``param.grad`` stays ``None``.
- **The step** (``optimizer.step()``) is the store's: clipping, the rest of the groups
  stepped where the store holds them, the iteration ended. With ``overlap="forward"``
  the step is decided there (clipping included) and each group is stepped in the next
  forward, when the first of its parameters is bound, so its optimizer state loads while
  the modules before it compute; reading the weights or the state (``state_dict``,
  ``save_pretrained``, a checkpoint) first makes every step still due.

The optimizer returned is a ``torch.optim.Optimizer`` (param groups, LR schedulers,
``zero_grad``, ``state_dict`` / ``load_state_dict`` streaming the state into a tidestore
checkpoint file).
"""

import contextlib
import copy
import os
import shutil
import tempfile
import warnings
import weakref

import torch
import torch.distributed as dist

from ._tidestore import AdamWCore, EngineCore, TidestoreError, export_tensors_from
from ._views import byte_view, dtype_name, parse_bytes, store_memory
from ._ahead import DEFAULT_AHEAD, Overlapped, check_ahead
from ._shards import Shards, check_world, rank_file, world_meta, world_of
from ._groups import StoreOptimizer, check_threads, check_torch_only, hyper_params
from ._guard import guard, unguarded
from .optim import closure_loss

# The format named in an offloaded model's optimizer state dict (tidestore.AdamW's is
# "tidestore.checkpoint.v1").
ENGINE_FORMAT = "tidestore.engine.v1"

__all__ = ["offload", "Engine", "EngineOptimizer"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Saved:
    """What autograd keeps of a saved tensor over a parameter's memory: which parameter,
    and how the tensor views it."""

    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index, size, stride, offset):
        self.index, self.size, self.stride, self.offset = index, size, stride, offset


class _OnBackward(torch.autograd.Function):
    """Identity on the tensors it is given; its backward calls ``callback`` when their
    gradients arrive. On a module's outputs that is just before the module's backward
    (the engine binds the module's parameters again for it, and for their gradients'
    accumulation, which checks the parameter's shape); on its inputs, just after (the
    engine releases what backward held of the module)."""

    @staticmethod
    def forward(ctx, callback, *xs):
        ctx.callback = callback
        return xs if len(xs) != 1 else xs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def _on_backward(callback):
    """A ``_map_tensors`` function that passes tensors through ``_OnBackward``."""
    def wrap(xs):
        out = _OnBackward.apply(callback, *xs)
        return out if isinstance(out, tuple) else (out,)
    return wrap


def _map_tensors(out, fn):
    """``out`` (a tensor, or tuples, lists and dicts of them, as modules return) with
    ``fn`` applied to every tensor that needs a gradient; ``fn`` takes and returns a
    list."""
    found = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)

    collect(out)
    if not found:
        return out
    new = iter(fn(found))
    swapped = {id(x): next(new) for x in found}

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return swapped.get(id(x), x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*[rebuild(y) for y in x])
        if isinstance(x, (tuple, list)):
            return type(x)(rebuild(y) for y in x)
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = rebuild(x[k])
            return x
        return x

    return rebuild(out)


def _storage_users(t):
    """How many tensors share ``t``'s storage (None where this torch cannot say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return count(t.untyped_storage()._cdata)


def _in_backward():
    return torch._C._current_graph_task_id() != -1


class Engine:
    """The hooks and the store of one offloaded model (see the module doc)."""

    def __init__(self, model, core, params, names, accumulation, overlap, shards=None,
                 device=None):
        self.model = model
        self.core = core
        # Where the modules compute: the CPU, or the GPU that is the store's device tier
        # (parameters bound as CUDA tensors over its memory).
        self.device = torch.device("cpu") if device is None else device
        self._cuda = self.device.type == "cuda"
        self._shards = shards  # with a process group: this rank's shards of every parameter
        self.params = params  # index -> Parameter
        self.names = names  # index -> name
        self.index = {id(p): i for i, p in enumerate(params)}
        self.accumulation = accumulation
        self.overlap = overlap  # "off", "backward" or "forward": the core's
        self.micro = 0  # backward passes since the last step
        self._holds = [0] * len(params)  # Python's count of the core's holds
        self._held = 0  # parameters with a hold
        self._bf16 = core.precision == "bf16"
        self._users = [None] * len(params)  # tensors over a parameter's memory once bound
        self._stand_ins = [None] * len(params)  # data_ptr of an unbound parameter's NaN
        self._shapes = ([tuple(p.shape) for p in params] if shards is not None
                        else [tuple(core.spec(i)[1]) for i in range(len(params))])
        # The dtype a parameter is bound in: bf16 for a trainable one in bf16 precision.
        bf16 = core.precision == "bf16"
        self._dtypes = [torch.bfloat16 if bf16 and p.requires_grad else torch.float32
                        for p in params]
        # On a GPU, one pinned host buffer of the largest gradient's bytes: each
        # gradient comes down into it (DMA, not a copy staged by the driver) and goes
        # into the store from it before the next one does.
        self._grad_buf = None
        if self._cuda:
            largest = max((torch.Size(s).numel() * d.itemsize for s, d, p in
                           zip(self._shapes, self._dtypes, params) if p.requires_grad),
                          default=0)
            self._grad_buf = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
        self._by_storage = {}  # data_ptr of a bound parameter's memory -> index
        self._bwd_holds = {}  # module key -> [indices held in backward]
        self._pending = {}  # index -> final gradient waiting for the release
        # Where the store steps in place in RAM (f32, no host budget), one backward per
        # step and no overlap: torch's gradients are kept until step() and read there
        # (no copy into the store); index -> gradient.
        self._given = ({} if shards is None and accumulation == 1 and overlap == "off"
                       and core.reads_given() else None)
        self._callback_queued = False
        self._handles = []
        self._modules = {}  # key -> (module name, indices of its own parameters)
        self._owner = {}  # index -> key of the first module that owns it
        self._saved_hooks = None
        # With a process group: the collectives, up to `collectives_ahead` in flight.
        self._collectives = (Overlapped(shards, core.collectives_ahead)
                             if shards is not None else None)
        self._install()

    # -- binding ---------------------------------------------------------------------

    @unguarded
    def _bind(self, i):
        if self._shards is None:
            try:
                addr, nbytes, dtype, gpu = self.core.acquire(i)
            except TidestoreError as e:
                # The store's refusal (a budget its moment cannot fit, an I/O error)
                # said of the module and parameter being bound; nothing was held.
                raise type(e)(f"binding parameter `{self.names[i]}` of module "
                              f"{self._module_name(i)}: {e}") from e
        self._holds[i] += 1
        if self._holds[i] == 1:
            self._held += 1
            if self._shards is None:
                mem = store_memory(self.core, addr, nbytes, gpu).view(_TORCH_DTYPES[dtype])
            else:
                # Every rank binds in the same order (the same model, the same hooks);
                # the parameter is bound to its gathered copy, the store's lease ended.
                mem = self._collectives.whole((i, _in_backward()), self._read_shard)
            self.params[i].data = mem.view(self._shapes[i])
            del mem  # counted below, it would hide a module's reference
            self._users[i] = _storage_users(self.params[i])
            self._by_storage[self.params[i].data.data_ptr()] = i

    def _read_shard(self, key):
        """A copy of this rank's shard of parameter ``key[0]``: one access of the store
        (its lease ended as the bind's would end, in backward when ``key[1]``)."""
        i, backward = key
        addr, nbytes, dtype, gpu = self.core.acquire(i)
        try:
            return store_memory(self.core, addr, nbytes, gpu).view(_TORCH_DTYPES[dtype]).clone()
        finally:
            self._reads_done()
            self.core.release(i, backward)

    def _placeholder(self, i):
        """What a parameter is while not bound: its shape and dtype over one NaN (stride
        0, no memory of its own). Code that reads its values outside a module's forward
        is refused by the guard (``_guard.py``) before it computes with the NaN."""
        t = torch.full((), float("nan"), dtype=self._dtypes[i],
                       device=self.device).expand(self._shapes[i])
        self._stand_ins[i] = t.data_ptr()
        return t

    def bound(self, i):
        """Whether parameter ``i`` is bound to the store's memory now."""
        return self._holds[i] > 0

    def _module_name(self, i):
        """The first module that owns parameter ``i``, quoted (the root by its class)."""
        if i not in self._owner:
            return "(none)"
        mname = self._modules[self._owner[i]][0]
        return f"`{mname or type(self.model).__name__}`"

    def outside_forward(self, i, what):
        """The error of a parameter read (``what``: the torch function) while it is a
        stand-in (see ``_guard.py``)."""
        module = self._module_name(i)
        change = ("change it with model.tidestore_engine.set_values" if what == "set data"
                  else "read it inside that module's forward, or read its values with "
                  "model.tidestore_engine.values / state_dict")
        return (f"parameter `{self.names[i]}` used outside the forward of its module "
                f"{module} (`{what}`): between forwards its values live in the store and "
                f"the parameter is a stand-in that would compute with NaN; {change}")

    @unguarded
    def _unbind(self, i, backward):
        p = self.params[i]
        if self._holds[i] == 1:
            self._by_storage.pop(p.data.data_ptr(), None)
            p.data = self._placeholder(i)
        self._holds[i] -= 1
        if self._shards is None:
            if self._holds[i] == 0:
                self._reads_done()
            left = self.core.release(i, backward)
            assert left == self._holds[i], "the core's holds and the engine's disagree"
        if self._holds[i] == 0:
            self._held -= 1
            if self._pending:
                self._flush_grads()

    def _reads_done(self):
        """On a GPU, waits until every kernel queued on it has run: the last lease of a
        parameter ends next, after which the store may move its chunk or copy another
        one over its memory, and torch's kernels reading it run asynchronously."""
        if self._cuda:
            torch.cuda.synchronize(self.device)

    # -- module hooks ----------------------------------------------------------------

    def _install(self):
        for mname, m in self.model.named_modules():
            own = [self.index[id(p)] for p in m.parameters(recurse=False)]
            if not own:
                continue
            key = len(self._modules)
            self._modules[key] = (mname, own)
            for i in own:
                self._owner.setdefault(i, key)
            self._handles.append(m.register_forward_pre_hook(
                self._pre_forward(key), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_forward(key)))
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(i)))
        # First of the root's pre-hooks: a forward that raised is cleared up before the
        # root's own parameters are bound again.
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre, prepend=True))
        self._handles.append(self.model.register_forward_hook(self._root_post))

    def _root_pre(self, module, args):
        self._check_unchanged()
        if self._backward_raised():
            self._drop_raised_backward()
            warnings.warn("tidestore: the last backward pass raised before its end; its "
                          "iteration was dropped (the gradients it and the passes before it "
                          "made, nothing stepped)", RuntimeWarning, stacklevel=2)
        if self._saved_hooks is not None and not _in_backward():
            self._abandoned_forward()
        if self._saved_hooks is None and not _in_backward():
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()

    def _abandoned_forward(self):
        """The last forward raised before its end (its root hook never ran): its
        saved-tensor hooks are left and what its modules still hold is released, so the
        next forward starts as after a whole one (a bad batch does not end training)."""
        hooks, self._saved_hooks = self._saved_hooks, None
        hooks.__exit__(None, None, None)
        for i, holds in enumerate(self._holds):
            for _ in range(holds):
                self._unbind(i, False)

    def _backward_raised(self):
        """Whether a backward pass raised before its end: the end-of-backward callback
        it queued never ran (autograd drops a failed pass's callbacks)."""
        return self._callback_queued and not _in_backward()

    def _drop_raised_backward(self):
        """After a backward pass that raised: what it held is released, the gradients it
        and the accumulation's passes before it made are dropped with the iteration
        (nothing is stepped; the core refuses, poisoned, where groups were already
        stepped during backward), so the next pass starts a new iteration."""
        self._callback_queued = False
        self._pending.clear()
        if self._given is not None:
            self._given = {}
        for key in list(self._bwd_holds):
            for i in self._bwd_holds.pop(key):
                self._unbind(i, True)
        self._flush_scatters()
        self.micro = 0
        self.core.abandon_iteration("a backward pass raised before its end")

    def _root_post(self, module, args, out):
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _pre_forward(self, key):
        def hook(module, args, kwargs):
            _, own = self._modules[key]
            backward = _in_backward()
            if backward:
                self._check_backward_due()  # a recompute: the first a pass does
            for i in own:
                self._bind(i)
            if backward:
                self._bwd_holds.setdefault(key, []).extend(own)
                self._queue_end_of_backward()
            if not torch.is_grad_enabled():
                return None
            # Inputs that need gradients call back once the module's backward is done.
            return _map_tensors((tuple(args), kwargs),
                                _on_backward(lambda: self._module_backward_done(key)))
        return hook

    def _post_forward(self, key):
        def hook(module, args, out):
            if _in_backward():
                return None  # a recompute: held until the module's backward
            mname, own = self._modules[key]
            for i in own:
                if self._holds[i] == 1:
                    self._check_unreferenced(mname, i)
            for i in own:
                self._unbind(i, False)
            if not torch.is_grad_enabled():
                return None
            # Outputs that need gradients call back before the module's backward begins.
            return _map_tensors(out, _on_backward(lambda: self._module_backward_begins(key)))
        return hook

    @unguarded
    def _check_unreferenced(self, mname, i):
        """After its forward nothing but the parameter may reference the store's memory
        it was bound to (autograd's saved tensors are tokens by then): a tensor a module
        kept would read another chunk's bytes once the store moves this one."""
        users = _storage_users(self.params[i])
        if users is not None and users > self._users[i]:
            raise TidestoreError(
                f"module `{mname or type(self.model).__name__}` keeps a tensor over parameter "
                f"`{self.names[i]}` after its forward ({users - self._users[i]} reference(s) "
                "besides the parameter): a module must read its weights in forward, not "
                "keep them")

    def _module_backward_begins(self, key):
        self._check_backward_due()
        own = self._modules[key][1]
        for i in own:
            self._bind(i)
        self._bwd_holds.setdefault(key, []).extend(own)
        self._queue_end_of_backward()

    def _check_backward_due(self):
        """Refuses a backward pass beyond ``accumulation`` before the step, at its first
        module and before anything is bound or handed over: the gradients of the passes
        before stay whole, and ``step()`` still steps them (a gradient is final once per
        step; torch would add the extra pass in)."""
        if self.micro >= self.accumulation:
            raise TidestoreError(
                f"a backward pass beyond accumulation={self.accumulation} before "
                "optimizer.step(): step first, or hand the model over with a larger "
                "accumulation; the gradients of the passes before are kept")

    def _module_backward_done(self, key):
        for i in self._bwd_holds.pop(key, []):
            self._unbind(i, True)
        self._step_ready()

    # -- saved tensors ---------------------------------------------------------------

    @unguarded
    def _pack(self, t):
        i = (self._by_storage.get(t.untyped_storage().data_ptr())
             if t.device == self.device else None)
        if i is None:
            return t
        return _Saved(i, t.size(), t.stride(), t.storage_offset())

    @unguarded
    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        i = saved.index
        self._bind(i)
        self._bwd_holds.setdefault(self._owner[i], []).append(i)
        self._queue_end_of_backward()
        base = self.params[i].data
        return torch.as_strided(base, saved.size, saved.stride, saved.offset)

    def _queue_end_of_backward(self):
        if not self._callback_queued and _in_backward():
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        self._callback_queued = False
        for key in list(self._bwd_holds):
            self._module_backward_done(key)
        self._flush_grads()
        self._flush_scatters()
        self.micro += 1

    # -- gradients and the step ------------------------------------------------------

    def _grad_hook(self, i):
        @unguarded
        def hook(p):
            self._check_backward_due()
            g, p.grad = p.grad, None
            self._queue_end_of_backward()
            if self._given is not None:
                self._given[i] = g
                return
            self._pending[i] = g
            self._flush_grads()
        return hook

    def _flush_grads(self):
        """Hands the store the final gradients that may go now: a parameter's once it is
        released; in bf16 precision, where a gradient is written over the parameters'
        16-bit copy and so into a chunk that a held parameter may share, only while no
        parameter is held."""
        if self._bf16 and self._held:
            return
        for i in [i for i in self._pending if self._holds[i] == 0]:
            self._put_grad(i, self._pending.pop(i))

    def _host_grad(self, i, g):
        """The gradient ``g`` of parameter ``i`` where the store takes it, in host memory:
        as it is on the CPU; from the GPU the model computes on, copied into the pinned
        buffer (valid until the next gradient comes down)."""
        if g.device != self.device:
            raise TidestoreError(
                f"the gradient of `{self.names[i]}` is on {g.device}: the model computes on "
                f"{self.device}")
        if not self._cuda:
            return g
        nbytes = g.numel() * g.element_size()
        if nbytes > self._grad_buf.numel():
            return g.to("cpu")  # (a dtype wider than the parameter's)
        out = self._grad_buf[:nbytes].view(g.dtype).view(g.shape)
        out.copy_(g)  # synchronous: the host waits for the copy
        return out

    def _put_grad(self, i, g):
        g = self._host_grad(i, g)
        first = self.micro == 0
        last = self.micro == self.accumulation - 1
        if self._collectives is not None:
            self._collectives.scatter(i, g, first, last, self._put_shard)
        else:
            self._put_shard(i, g, first, last)

    def _put_shard(self, i, g, first, last):
        """Hands the store the gradient ``g`` (this rank's shard of it under a process
        group)."""
        g = g.contiguous()
        self.core.put_grad(i, byte_view(g, self.names[i] + ".grad"), dtype_name(g), first, last)
        self._step_ready()

    def _flush_scatters(self):
        """Every gradient reduce-scattered so far into the store."""
        if self._collectives is not None:
            self._collectives.flush()

    def _step_ready(self):
        """With overlap, steps the groups whose gradients are all final — only while no
        parameter is held: a group's chunk may hold a parameter a module still uses."""
        if (self.overlap == "backward" and not self._held
                and self.micro == self.accumulation - 1):
            self.core.step_ready()

    def step(self):
        if self._backward_raised():
            self._drop_raised_backward()
            raise TidestoreError(
                "step after a backward pass that raised before its end: its iteration was "
                "dropped (the gradients it and the passes before it made, nothing stepped); "
                "run the forward and backward passes again")
        if self.micro != self.accumulation:
            raise TidestoreError(
                f"step after {self.micro} backward pass(es); the engine was set up with "
                f"accumulation={self.accumulation}")
        if self._pending or any(self._holds):
            held = [self.names[i] for i, h in enumerate(self._holds) if h]
            raise TidestoreError(f"step while parameters are held by a module: {held}")
        self._flush_scatters()
        if self._collectives is not None:
            self._collectives.end_iteration()
        try:
            if self._given is not None:
                return self._step_given()
            return self.core.step()
        finally:
            # Stepped, or the iteration ended by the failure (a missing gradient drops
            # it; a half-made step poisons the store until a checkpoint is loaded).
            self.micro = 0

    def _step_given(self):
        """The step with the gradients kept since backward, read where torch left them.
        A trainable parameter without one: the others are put and the core's step
        refuses it by name, dropping the iteration (as without kept gradients)."""
        given, self._given = self._given, {}
        for i, g in given.items():
            self._host_grad(i, g)  # (its device checked; on the CPU it is ``g``)
        if any(p.requires_grad and i not in given for i, p in enumerate(self.params)):
            for i, g in given.items():
                self._put_shard(i, g, True, True)
            return self.core.step()
        grads = [None] * len(self.params)
        for i, g in given.items():
            grads[i] = (byte_view(g.contiguous(), self.names[i] + ".grad"), dtype_name(g))
        return self.core.step_given(grads)

    # -- bad input -------------------------------------------------------------------

    @unguarded
    def _check_unchanged(self):
        params = list(self.model.parameters())
        if len(params) != len(self.params) or any(
                p is not q for p, q in zip(params, self.params)):
            known = {id(p) for p in self.params}
            new = [n for n, p in self.model.named_parameters() if id(p) not in known]
            raise TidestoreError(
                "the model's parameters changed after it was handed to tidestore"
                + (f" (new: {new[:5]})" if new else " (a parameter was removed)")
                + ": hand the changed model over again")
        for i, p in enumerate(self.params):
            if p.device != self.device or (self._holds[i] == 0
                                           and p.data_ptr() != self._stand_ins[i]):
                raise TidestoreError(
                    f"parameter `{self.names[i]}` was moved or replaced outside tidestore "
                    f"({tuple(p.shape)} on {p.device}): its values live in the store; change "
                    "them with model.tidestore_engine.set_values")

    def _refuse_apply(self, fn, recurse=True):
        """Stands in for the model's ``_apply`` (behind ``.to()``, ``.cuda()``, ``.half()``):
        a conversion that changes nothing passes (transformers' Trainer moves the model
        to the CPU it is on); one that would move or convert the parameters is refused
        before anything is allocated."""
        probe = torch.zeros(1, device=self.device)
        out = fn(probe)
        if out.device == probe.device and out.dtype == probe.dtype:
            return self.model
        raise TidestoreError(
            f"converting a model handed to tidestore to {out.device}/{out.dtype}: its "
            f"parameters (first: `{self.names[0]}`) live in the store, in its precision "
            f"({self.core.precision}); convert the model before tidestore.offload")

    def values(self, i):
        """Parameter ``i``'s current values (fp32; the master copy of a trainable one)."""
        self._flush_scatters()
        t = torch.frombuffer(bytearray(self.core.values(i)), dtype=torch.float32)
        if self._shards is not None:
            t = self._shards.gathered(i, t)  # a collective: every rank calls it
        return t.view(self._shapes[i])

    def set_values(self, name, values):
        """Sets parameter ``name``'s values (a tensor of its shape, any float dtype) in
        the store — its master copy too when trainable: how a handed-over parameter is
        changed (its own tensor is a stand-in between forwards). Under a process group
        every rank calls it with the same values."""
        if name not in self.names:
            raise KeyError(f"no parameter `{name}` in the offloaded model")
        i = self.names.index(name)
        if tuple(values.shape) != self._shapes[i]:
            raise ValueError(f"parameter `{name}`: values of shape {tuple(values.shape)} "
                             f"for a parameter of shape {self._shapes[i]}")
        if self._holds[i]:
            raise TidestoreError(f"parameter `{name}` is in use by a module: set it between steps")
        if self._collectives is not None:
            self._collectives.discard_gathers()  # gathered ahead: the old values
        t = values.detach().to("cpu").contiguous()
        if self._shards is not None:
            t = self._shards.values(i, t)
        self.core.set_values(i, byte_view(t, name), dtype_name(t))

    def state_dict(self):
        """Every parameter's values by name, one tensor at a time into a new dict (the
        whole model in memory: for small models and tests)."""
        return {n: self.values(i) for i, n in enumerate(self.names)}

    def save_pretrained(self, save_directory, dtype=torch.bfloat16, max_shard_size=5_000_000_000,
                        **_ignored):
        """Writes the model as a Hugging Face directory from the store, one tensor at a
        time: safetensors shards of ``dtype`` (with ``model.safetensors.index.json`` when
        there are several) under the parameters' names, and the model's ``config.json``
        when it has a config; atomically (an existing export is replaced whole). Stands
        in for the model's own ``save_pretrained``, which would write the unbound
        parameters' placeholders."""
        name = str(dtype).replace("torch.", "")
        config = getattr(self.model, "config", None)
        config_json = None
        if config is not None and hasattr(config, "to_json_string"):
            config = copy.deepcopy(config)
            for key in ("torch_dtype", "dtype"):
                if hasattr(config, key):
                    setattr(config, key, name)
            config_json = config.to_json_string()
        if self._shards is not None:
            return self._save_gathered(os.fspath(save_directory), name, int(max_shard_size),
                                       config_json)
        return self.core.export_dir(os.fspath(save_directory), name, int(max_shard_size),
                                    config_json)

    def _save_gathered(self, path, dtype, max_shard_size, config_json):
        """``save_pretrained`` of a model sharded over a process group: rank 0 writes the
        directory while each tensor it asks for is gathered from every rank's shard; the
        other ranks join each gather, told which by rank 0, and learn at the end whether
        the directory was written. Returns the weight files (rank 0) or ``[]``."""
        shards = self._shards
        src = dist.get_global_rank(shards.group, 0) if shards.group is not None else 0
        index = {n: i for i, n in enumerate(self.names)}

        def tell(what):
            box = [what]
            dist.broadcast_object_list(box, src=src, group=shards.group)
            return box[0]

        if shards.rank != 0:
            while (i := tell(None)) is not None:
                self.values(i)
            if not tell(None):
                raise TidestoreError(
                    f"save_pretrained to {path}: rank 0 could not write it (its error says why)")
            return []

        def read(tensor):
            i = index[tensor]
            tell(i)
            return self.values(i).to(torch.float32).contiguous().numpy().tobytes()

        tensors = [(n, list(self._shapes[i])) for i, n in enumerate(self.names)]
        try:
            self.core.check_exportable()
            files = export_tensors_from(path, tensors, read, dtype, max_shard_size, config_json)
        except BaseException:
            tell(None)  # the gathers end
            tell(False)  # nothing was written
            raise
        tell(None)
        tell(True)
        return files

    def __reduce_ex__(self, protocol):
        raise TidestoreError(
            "a model handed to tidestore.offload cannot be copied or pickled: its "
            "parameters live in the store; save it with model.save_pretrained, its "
            "training state with the optimizer's state_dict")

    def stats(self):
        """The store's and the step loop's counters; with a process group, also the
        world size and the bytes this rank sent into each collective (as
        ``tidestore.AdamW.stats``)."""
        stats = self.core.stats()
        if self._collectives is not None:
            stats.update(self._collectives.report())
        return stats

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


class EngineOptimizer(StoreOptimizer):
    """The step of an offloaded model: ``step()`` is the store's step, with the param
    groups' hyper-parameters (so LR schedulers work; see ``_groups.py``); ``zero_grad()``
    has nothing to do (gradients went to the store); ``state_dict()`` streams the
    training state into a tidestore checkpoint at ``checkpoint_path`` and returns a small
    dict naming it."""

    def __init__(self, engine, checkpoint_path):
        hp = engine.core.hyper_params()
        trainable = [p for p in engine.params if p.requires_grad]
        super().__init__(trainable, dict(lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                                         weight_decay=hp["weight_decay"]))
        self.engine = engine
        self.checkpoint_path = os.fspath(checkpoint_path)
        self._applied = hyper_params(self.param_groups, type(self).__name__)
        self._seal()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self._sync_hyper(self.engine.core)
        self.last = self.engine.step()
        return loss

    def zero_grad(self, set_to_none=True):
        for p in self.engine.params:
            p.grad = None

    def state_dict(self):
        """The training state streamed into this rank's checkpoint file; with a process
        group every rank writes its shards (call it on every rank)."""
        path = rank_file(self.checkpoint_path, self.engine._shards)
        world, _ = world_of(self.engine._shards)
        step = self.engine.core.step_count()
        self.engine.core.save(path, {"step": str(step), **world_meta(self.engine._shards)})
        return {"state": {}, "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "tidestore": {"format": ENGINE_FORMAT, "path": path,
                          "base_path": self.checkpoint_path, "step": step,
                          "world_size": world}}

    def load_state_dict(self, state_dict):
        ts = state_dict.get("tidestore") if isinstance(state_dict, dict) else None
        if not ts or ts.get("format", ENGINE_FORMAT) != ENGINE_FORMAT:
            raise ValueError("not an offloaded model's optimizer state (no 'tidestore' entry "
                             f"of format {ENGINE_FORMAT}; found {ts and ts.get('format')!r})")
        shards = self.engine._shards
        check_world(ts["path"], ts.get("world_size", 1), None, shards, "engine")
        if self.engine._collectives is not None:
            # Gathers started ahead read the values the load replaces.
            self.engine._collectives.discard_gathers()
        path = rank_file(ts["base_path"], shards) if "base_path" in ts else ts["path"]
        found = AdamWCore.read_metadata(path).get("step")
        if found is not None and found != str(ts.get("step")):
            raise ValueError(
                f"checkpoint {path} holds step {found}, the state dict names step "
                f"{ts.get('step')}: the file was overwritten by a later save")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        self.engine.core.load(path)
        for g, saved in zip(self.param_groups, groups):
            g.update({k: tuple(v) if k == "betas" else v
                      for k, v in saved.items() if k != "params"})


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on torch's ``meta`` device (no
    memory), their buffers on the CPU as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _from_dir(path):
    """The model of a Hugging Face directory, built with parameters that hold no memory
    (their values come from the files, into the store)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    # torch cannot rebind a meta parameter to CPU memory: each becomes a CPU parameter
    # of its shape over one element (a tied one stays one parameter).
    fresh = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in fresh:
                    empty = torch.zeros((1,), dtype=p.dtype).expand(p.shape)
                    fresh[id(p)] = torch.nn.Parameter(empty, requires_grad=p.requires_grad)
                m._parameters[name] = fresh[id(p)]
    return model


def _shard(named, group, source_dir, config, settings):
    """The shards of ``named``'s parameters this rank of ``group`` owns, after checking
    that every rank hands over the same model with the same settings and taking rank
    0's values."""
    if config is not None:
        # The file decides the store (the keywords are not read): the ranks' files must
        # say the same, but for where each rank's swap file goes.
        settings = {"config file": _settings_of(config)}
    params = [p for _, p in named]
    shards = Shards(params, group)
    shards.check_alike(params, {**settings, "names": [n for n, _ in named]})
    if source_dir is None:
        shards.broadcast(params)  # (every rank reads a directory's same files)
    return shards


def _settings_of(config):
    """The settings lines of the config file ``config`` that every rank must share: blank
    and comment lines dropped, and ``nvme.dir`` (each rank's own disk)."""
    lines, section = [], ""
    with open(config, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                section = line
            elif section == "[nvme]" and line.split("=", 1)[0].strip() == "dir":
                continue
            lines.append(line)
    return "\n".join(lines)


def _gpu_of(device, config):
    """The CUDA ordinal ``offload``'s ``device`` names, ``None`` for the CPU."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a torch device ({e})") from None
    if config is not None:
        raise ValueError(f"device={device!r} with a config file: the file's [device] decides "
                         "where the model computes (kind = \"cuda\" for the GPU)")
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise ValueError(f"device: {d} is neither the CPU nor a CUDA GPU")
    if not torch.cuda.is_available():
        raise TidestoreError(f"device={device!r}: torch sees no CUDA GPU "
                             "(torch.cuda.is_available() is False)")
    return d.index if d.index is not None else torch.cuda.current_device()


def _compute_device(core, gpu):
    """Where the modules of an engine over ``core`` compute: the GPU that is its store's
    device tier, else the CPU. A GPU asked for (``gpu``) that the store could not open
    is refused."""
    if gpu is not None and core.gpu is None:
        raise TidestoreError(
            f"device='cuda:{gpu}': the store could not open that GPU (this tidestore was "
            "built without its `cuda` feature, or libcuda was not found; its log says "
            "which): the model would compute on the CPU")
    return torch.device("cpu") if core.gpu is None else torch.device("cuda", core.gpu)


def _values_in(core, named, source_dir, shards):
    """The model's values into the store: imported from its directory by the Rust
    importer (which reads each tensor whole and, under a process group, keeps this
    rank's shard of it), or copied from its parameters in memory."""
    if source_dir is not None and shards is not None:
        core.import_dir(source_dir, shapes=[list(p.shape) for _, p in named],
                        rank=shards.rank, world=shards.world)
    elif source_dir is not None:
        core.import_dir(source_dir)
    else:
        for i, (n, p) in enumerate(named):
            t = p.detach().to("cpu").contiguous() if shards is None else shards.values(i, p)
            core.set_values(i, byte_view(t, n), dtype_name(t))
    if shards is not None:
        core.set_norm_peers(shards.sum_sq_norm)


def _buffers_to(model, device):
    """Moves the model's buffers (rotary frequencies, norms' running statistics) to
    ``device``, where its modules compute; its parameters are the store's."""
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


def _check_accumulation(overlap, accumulation):
    if overlap == "backward" and accumulation > 1:
        raise ValueError("overlap steps each group when its gradient is final: "
                         "it needs accumulation=1")


def _overlap_name(overlap):
    """``overlap`` as the core spells it: False / "off", True / "backward", "forward"."""
    names = {False: "off", True: "backward", "off": "off", "backward": "backward",
             "forward": "forward"}
    if isinstance(overlap, (bool, str)) and overlap in names:
        return names[overlap]
    raise ValueError(f"overlap: {overlap!r} is not one of False, True, 'off', 'backward', "
                     "'forward'")


def offload(model, config=None, *, precision="f32", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
            weight_decay=1e-2, states="fp32", nvme_dir=None, host_budget=None,
            device_budget=None, device=None, max_grad_norm=None, overlap=False, threads=0,
            chunk_elements=None, accumulation=1, checkpoint_path=None, process_group=None,
            collectives_ahead=DEFAULT_AHEAD, **torch_only):
    """Hands ``model`` (a ``torch.nn.Module``, or a Hugging Face model directory that is
    built with its parameters on the meta device and imported straight into the store)
    to a tidestore store; returns ``(model, optimizer)``.

    ``config``: a ``tidestore.toml`` whose sections decide the store (``train.precision``,
    ``[optimizer]``, ``[chunk]``, ``[device]``, ``[host]``, ``[nvme]``, ``[io]``); without
    it the keywords do (``host_budget``/``device_budget`` in bytes or '4GiB'; no
    ``host_budget``: every chunk in RAM; a ``device_budget`` puts a simulated device
    standing in for a GPU between them and the modules, none binds them in the host
    pool). ``device``: where the modules compute — ``None`` / ``"cpu"``, or a CUDA GPU
    (``"cuda"``, ``"cuda:1"``, a ``torch.device``): that GPU is then the store's device
    tier, ``device_budget`` of its memory (default: half of what is free on it), and each
    module's parameters are bound as CUDA tensors over the store's GPU memory (no copy),
    its buffers moved there; gradients come to the store through a pinned host buffer. With
    ``config``, the file's ``[device]`` decides instead (``kind = "auto"``, the default,
    or ``"cuda"`` on a machine with a GPU: the modules compute there). Under a process
    group the ranks compute on the CPU. ``accumulation``: backward passes per step.
    ``overlap``: ``False`` / ``"off"`` (the step after backward), ``True`` /
    ``"backward"`` (each group during backward; no clipping, ``accumulation=1``) or
    ``"forward"`` (decided after backward, clipping included; each group stepped in the
    next forward), all bit-identical.
    After the call the model's own parameter storage is freed: its values are the store's.
    The hyper-parameters default to ``torch.optim.AdamW``'s and are the optimizer's
    ``param_groups``' at each step (see ``_groups.py``). A forward that raised (a bad
    batch) releases what it held at the next forward, so training goes on; so does a
    backward that raised, whose iteration is dropped there (the gradients of that step's
    passes discarded, nothing stepped; a warning says so, and ``step()`` before it is
    refused).

    ``process_group`` (a ``torch.distributed`` group, e.g. ``group.WORLD``; launch with
    ``torchrun``): every parameter is sharded over the group's ranks as
    ``tidestore.AdamW`` shards its state (ZeRO-DP stage 3): each rank's store holds
    ``1/N`` of every parameter, its master copy, M and V. A module's parameters are
    all-gathered when it is bound (forward, recompute, backward) and dropped when it is
    released; gradients are reduce-scattered (the ranks' average) into the store; the
    ranks' norms are summed for the step. The model is handed over in memory on every
    rank (rank 0's values are taken), or each rank imports its shards of a model
    directory (the importer reads one tensor at a time). The ranks compute on the CPU
    and open no GPU (a config file's ``device.kind = "cuda"`` is refused; its
    ``device.ordinal = "auto"`` names each rank's current CUDA device). With ``config``,
    the ranks' files
    must say the same (checked at start); each rank's swap file is its own under
    ``nvme.dir``. ``save_pretrained`` is a collective: rank 0 writes the directory, each
    tensor gathered from the ranks' shards as it is written. ``collectives_ahead`` (a
    config file's ``train.collectives_ahead``): the collectives kept in flight beside
    compute, 0 to 1024 — parameters all-gathered that many binds ahead (in the order the
    last step bound them), gradients reduce-scattered that many behind; 0: each waits
    where it is asked for. The results are the same.
    """
    check_torch_only(torch_only, "tidestore.offload")
    check_threads(threads)
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation: {accumulation!r} is not a positive whole count")
    check_ahead(collectives_ahead)
    overlap = _overlap_name(overlap)
    _check_accumulation(overlap, accumulation)
    source_dir = None
    if isinstance(model, (str, os.PathLike)):
        source_dir = os.fspath(model)
        model = _from_dir(source_dir)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: a {type(model).__name__}, expected a torch.nn.Module "
                        "or a model directory")
    if hasattr(model, "tidestore_engine"):
        raise ValueError("model: already handed to tidestore (model.tidestore_engine): its "
                         "parameters live in that store; use the optimizer it returned")
    named = list(model.named_parameters())
    if not named:
        raise ValueError("model: it has no parameters")
    gpu = _gpu_of(device, config)
    if gpu is not None and process_group is not None:
        raise ValueError(f"device={device!r} with a process group: the ranks compute on the "
                         "CPU in this version")
    for n, p in named:
        if p.device.type not in ("cpu", "meta", "cuda"):
            raise ValueError(f"parameter `{n}` is on {p.device}: hand the model over on the "
                             "CPU or a CUDA GPU")
        if dtype_name(p) not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"parameter `{n}`: dtype {p.dtype} is not a float type")
    specs = [(n, list(p.shape), bool(p.requires_grad)) for n, p in named]
    shards = None
    if process_group is not None:
        shards = _shard(named, process_group, source_dir, config, dict(
            precision=precision, lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay,
            states=states, max_grad_norm=max_grad_norm, overlap=overlap,
            accumulation=accumulation, collectives_ahead=collectives_ahead))
        specs = [(n, [s], t) for (n, _, t), s in zip(specs, shards.lens)]
    default_checkpoint = os.path.join(nvme_dir or tempfile.gettempdir(),
                                      f"tidestore-engine-{os.getpid()}.safetensors")
    tmpdir = None
    if config is None and nvme_dir is None:
        tmpdir = tempfile.mkdtemp(prefix="tidestore-engine-")
        nvme_dir = tmpdir
        # Beside the temporary directory, which goes with the engine (a state_dict's
        # file must outlive it), and named after it: one per engine.
        default_checkpoint = tmpdir + ".safetensors"
    try:
        kw = {}
        if config is None:
            if gpu is not None and device_budget is None:
                device_budget = torch.cuda.mem_get_info(gpu)[0] // 2
            kw = dict(precision=precision, lr=lr, betas=tuple(betas), eps=eps,
                      weight_decay=weight_decay, states=states, nvme_dir=nvme_dir,
                      host_budget=parse_bytes(host_budget, "host_budget"),
                      device_budget=parse_bytes(device_budget, "device_budget"),
                      gpu=gpu, max_grad_norm=max_grad_norm, overlap=overlap, threads=threads,
                      chunk_elements=chunk_elements, collectives_ahead=collectives_ahead)
        if config is not None and process_group is not None:
            # The ranks compute on the CPU: no GPU is opened (device.kind = "cuda" is
            # refused); device.ordinal = "auto" names each rank's current CUDA device.
            kw["cpu_only"] = True
            if torch.cuda.is_available():
                kw["local_gpu"] = torch.cuda.current_device()
        core = EngineCore(specs, config=os.fspath(config) if config is not None else None, **kw)
        _check_accumulation(core.overlap, accumulation)  # (a config file's overlap)
        compute = _compute_device(core, gpu)
        for n, p in named:
            if p.device.type == "cuda" and p.device != compute:
                raise ValueError(f"parameter `{n}` is on {p.device}, the model computes on "
                                 f"{compute}: hand it over on the CPU or that device")
        _values_in(core, named, source_dir, shards)
        params = [p for _, p in named]
        engine = Engine(model, core, params, [n for n, _ in named], accumulation, core.overlap,
                        shards, compute)
    except BaseException:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, True)  # nothing of a refused hand-over is left
        raise
    _buffers_to(model, compute)
    # The model's own storage is freed: from here its values are the store's.
    engine_ref = weakref.ref(engine)
    for i, p in enumerate(params):
        p.data = engine._placeholder(i)
        guard(p, engine_ref, i)
    if tmpdir is not None:
        weakref.finalize(engine, shutil.rmtree, tmpdir, True)
    model.tidestore_engine = engine
    # The model's own save_pretrained and state_dict would read the placeholders of
    # unbound parameters: both read the store instead.
    model.save_pretrained = engine.save_pretrained
    model._apply = engine._refuse_apply
    model.state_dict = lambda *a, **k: engine.state_dict()
    opt = EngineOptimizer(engine, checkpoint_path or default_checkpoint)
    return model, opt
