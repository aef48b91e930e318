"""tidestore for PyTorch users.

- ``tidestore.AdamW``: a ``torch.optim.Optimizer`` whose fp32 master weights, Adam M and V
  live in a tidestore chunk store (a host-memory pool that spills to a swap file on
  NVMe), stepped by tidestore's SIMD AdamW kernels.
- ``tidestore.aio``: asynchronous reads and writes of tensors / numpy arrays to files
  through tidestore's io_uring engine (DeepNVMe's ``aio_handle`` interface).

Importing ``tidestore`` does not import torch; ``tidestore.AdamW`` imports it on first
use. Errors from the Rust core are ``tidestore.ConfigError`` (a ``ValueError``: bad
argument, budget or directory), ``tidestore.IoError`` (an ``OSError``) and
``tidestore.TidestoreError`` (a ``RuntimeError``), with the core's message.
"""

from ._tidestore import AdamWCore, ConfigError, IoError, TidestoreError
from . import aio

__all__ = ["AdamW", "AdamWCore", "ConfigError", "IoError", "TidestoreError", "aio"]


def __getattr__(name):
    # PEP 562: torch is imported only when AdamW is first asked for.
    if name == "AdamW":
        from .optim import AdamW

        return AdamW
    raise AttributeError(f"module 'tidestore' has no attribute {name!r}")
