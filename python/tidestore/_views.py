"""Tensor memory as the flat uint8 numpy arrays the Rust core takes.

The core reads a numpy array's ``__array_interface__`` (address, length, read-only
flag) and keeps the array referenced while it works; a CPU torch tensor becomes
``tensor.view(torch.uint8).numpy()``, which shares its memory and references it. Every
check that only Python can make (a torch tensor on the GPU, non-contiguous memory, a
non-float dtype) is made here, raising before the core is called.
"""

import math

import numpy as np

# dtype names the core understands, by numpy / torch dtype name.
FLOAT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def is_torch_tensor(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def dtype_name(x):
    """'float32' / 'bfloat16' / 'float16' / other numpy or torch dtype name."""
    if is_torch_tensor(x):
        return str(x.dtype).replace("torch.", "")
    return np.asarray(x).dtype.name


def byte_view(x, what, writable=False, float_only=False):
    """A flat uint8 numpy array over ``x``'s memory (a CPU torch tensor or numpy array)."""
    if float_only and dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(
            f"{what}: dtype {dtype_name(x)} is not a floating type tidestore steps "
            "(float32, bfloat16, float16)"
        )
    if is_torch_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{what}: a tensor on {x.device}; pass a CPU tensor")
        if not x.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous (call .contiguous())")
        import torch

        t = x.detach()
        if t.dim() == 0:
            t = t.reshape(1)
        return t.reshape(-1).view(torch.uint8).numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what}: a {type(x).__name__}, expected a numpy array or torch tensor")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: array is not C-contiguous (use np.ascontiguousarray)")
    if writable and not x.flags.writeable:
        raise ValueError(f"{what}: array is read-only")
    return x.reshape(-1).view(np.uint8)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, what):
    """An int, or a string such as '512MiB' / '4 GB', as bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected bytes (int or '4GiB'), got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{what}: {value} bytes is not positive")
        return value
    if isinstance(value, str):
        s = value.strip().lower().replace(" ", "")
        num = s.rstrip("kmgtib")
        unit = s[len(num):]
        try:
            n = float(num)
        except ValueError:
            n = -1.0
        if unit in _UNITS and n > 0 and math.isfinite(n * _UNITS[unit]):
            return int(n * _UNITS[unit])
    raise ValueError(f"{what}: {value!r} is not a size (an int of bytes, or e.g. '512MiB', '4GB')")


class _StoreMemory:
    """numpy's view of ``nbytes`` of a store's memory at ``addr``; it references the
    Rust core that owns the store, so the store outlives every tensor over its memory."""

    __slots__ = ("__array_interface__", "_core")

    def __init__(self, core, addr, nbytes):
        self._core = core
        self.__array_interface__ = {
            "version": 3, "shape": (nbytes,), "typestr": "|u1", "data": (addr, False)}


class _GpuStoreMemory:
    """The CUDA array interface (numba's, which torch reads) of ``nbytes`` of a store's
    GPU memory at device address ``addr``; it references the Rust core that owns the
    store. No ``stream`` key: the store hands memory out only once its copy is done, so
    any stream may read it."""

    __slots__ = ("__cuda_array_interface__", "_core")

    def __init__(self, core, addr, nbytes):
        self._core = core
        self.__cuda_array_interface__ = {
            "version": 2, "shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
            "strides": None}


def store_memory(core, addr, nbytes, gpu=None):
    """A uint8 torch tensor over ``nbytes`` of ``core``'s store at ``addr`` (no copy): a
    CPU tensor, or with ``gpu`` (a CUDA ordinal) a tensor on that GPU over its memory;
    it keeps ``core`` alive."""
    import torch

    if gpu is None:
        return torch.from_numpy(np.asarray(_StoreMemory(core, addr, nbytes)))
    t = torch.as_tensor(_GpuStoreMemory(core, addr, nbytes), device=f"cuda:{gpu}")
    if t.data_ptr() != addr:
        raise RuntimeError(f"torch copied the store's GPU memory at {addr:#x} instead of "
                           "viewing it")
    return t
