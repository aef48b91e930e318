"""tidestore for PyTorch users.

- ``tidestore.AdamW``: a ``torch.optim.Optimizer`` whose fp32 master weights, Adam M and V
  live in a tidestore chunk store (a host-memory pool that spills to a swap file on
  NVMe), stepped by tidestore's SIMD AdamW kernels.
- ``tidestore.offload(model, config=...)``: a whole ``torch.nn.Module`` (or a Hugging
  Face model directory) trained out of the store: every parameter lives in its chunks
  and is bound to the module that runs, as a tensor over the store's memory, only while
  it runs; gradients go to the store as they become final; the optimizer returned steps
  them there.
- ``tidestore.aio``: asynchronous reads and writes of tensors / numpy arrays to files
  through tidestore's io_uring engine (DeepNVMe's ``aio_handle`` interface).

Importing ``tidestore`` does not import torch; ``tidestore.AdamW`` and
``tidestore.offload`` import it on first use. Errors from the Rust core are ``tidestore.ConfigError`` (a ``ValueError``: bad
argument, budget or directory), ``tidestore.IoError`` (an ``OSError``) and
``tidestore.TidestoreError`` (a ``RuntimeError``), with the core's message.
"""

from ._tidestore import AdamWCore, ConfigError, EngineCore, IoError, TidestoreError
from . import aio

__all__ = ["AdamW", "AdamWCore", "ConfigError", "EngineCore", "IoError", "TidestoreError",
           "aio", "offload"]


def __getattr__(name):
    # PEP 562: torch is imported only when AdamW is first asked for.
    if name == "AdamW":
        from .optim import AdamW

        return AdamW
    if name == "offload":
        from .engine import offload

        return offload
    raise AttributeError(f"module 'tidestore' has no attribute {name!r}")
