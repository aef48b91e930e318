"""Reads of an offloaded parameter outside its module's forward, refused by name.

Between forwards an offloaded parameter is a stand-in (its shape and dtype over one NaN;
its values live in the store). Code that reads it there — a weight used by the model's
own ``forward`` outside the module that owns it, a regulariser summed over
``model.parameters()`` after the forward, ``copy.deepcopy(model)``, ``p.data.normal_()``
— would compute with NaN, and the step would then skip the non-finite gradients: a
wrong result with no error. So each handed-over parameter (a plain ``nn.Parameter``;
one of a subclass of its own keeps its class, unguarded) becomes an
``OffloadedParameter`` (still an ``nn.Parameter``), whose ``__torch_function__`` lets
every torch function through while the engine has it bound, and outside of that only
what reads no value (its shape, dtype, device, strides, ``grad``…): anything that would
compute from its values, view them or write them is a ``TidestoreError`` naming the
parameter and its module.

While a parameter is bound the check is one lookup per torch call that involves it
(a few microseconds, against the milliseconds of the call it guards); the engine's own
bookkeeping (binding, saved tensors, gradients) runs ``unguarded``.
"""

import functools

import torch

from ._tidestore import TidestoreError

# Properties and methods that read no value: they pass while the parameter is a
# stand-in (properties by the name of their getter, `get <name>`).
_METADATA = frozenset({
    "get shape", "get dtype", "get device", "get requires_grad", "set requires_grad",
    "get grad", "set grad", "get is_leaf", "get layout", "get ndim", "get names",
    "get grad_fn", "get itemsize", "get nbytes", "get output_nr", "get _version",
    "get is_cuda", "get is_cpu", "get is_meta", "get is_sparse", "get is_quantized",
    "get is_mkldnn", "get is_nested", "get is_xpu", "get is_mps", "get _backward_hooks",
    "get _post_accumulate_grad_hooks", "set _backward_hooks",
    "set _post_accumulate_grad_hooks", "size", "stride", "dim", "numel", "nelement",
    "element_size", "is_floating_point", "is_complex", "is_contiguous", "data_ptr",
    "storage_offset", "get_device", "is_pinned", "is_shared", "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook", "__len__", "_is_view",
    "untyped_storage",
})


def _key(func):
    """``func``'s name, properties' getters and setters as ``get <name>`` / ``set <name>``."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return name[2:5] + " " + getattr(getattr(func, "__self__", None), "__name__", "")
    return name


def _stand_ins(args, kwargs):
    """The offloaded parameters among a torch call's arguments (one level of lists and
    tuples, as ``torch.cat`` takes them) that are not bound now."""
    found = []

    def visit(x, nested):
        if isinstance(x, OffloadedParameter):
            engine = x._tidestore_engine()
            if engine is not None and not engine.bound(x._tidestore_index):
                found.append((engine, x._tidestore_index))
        elif not nested and isinstance(x, (list, tuple)):
            for y in x:
                visit(y, True)

    for a in args:
        visit(a, False)
    for a in kwargs.values():
        visit(a, False)
    return found


class OffloadedParameter(torch.nn.Parameter):
    """A parameter handed to ``tidestore.offload`` (see the module doc)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unbound = _stand_ins(args, kwargs)
        if unbound:
            key = _key(func)
            if key not in _METADATA:
                engine, i = unbound[0]
                raise TidestoreError(engine.outside_forward(i, key))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def unguarded(method):
    """``method`` run with the guard off: the engine's own handling of its parameters
    (their ``.data``, storage and gradients as it binds and releases them) is no
    user's read, and skips the Python call per access."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return method(*args, **kwargs)
    return run


def guard(param, engine_ref, index):
    """Makes ``param`` (parameter ``index`` of the engine behind the weak reference
    ``engine_ref``) an ``OffloadedParameter``; its data is not touched. A parameter of a
    subclass of its own keeps its class (and goes unguarded): its behaviour is not ours
    to replace."""
    if type(param) is not torch.nn.Parameter:
        return
    param.__class__ = OffloadedParameter
    param._tidestore_engine = engine_ref
    param._tidestore_index = index
