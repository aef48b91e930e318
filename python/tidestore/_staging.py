"""Pinned host staging for ``tidestore.AdamW`` over parameters on a CUDA GPU.

Each such parameter has one page-locked host buffer of its own shape and dtype, made
once: its gradient comes down into it and its new values go up from it, both as
asynchronous copies on a side stream of the parameter's GPU (DMA from and to pinned
memory; a pageable copy would be staged by the driver and block).

Ordering:
- down: the side stream first waits for everything queued on the current (compute)
  stream, which wrote the gradients; the host waits for the side stream before the
  core reads a buffer;
- up: the host waits until the side stream is idle before the core writes a buffer (a
  buffer's last upload may still be reading it); the side stream waits for the compute
  stream, copies into the parameters, and the compute stream then waits for the side
  stream on the GPU (no host wait), so whatever reads a parameter next sees its new
  values.
"""

import torch


class GpuStaging:
    """The staging buffers of the parameters ``params`` that are on a CUDA GPU."""

    def __init__(self, params):
        self._bufs = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                      if p.device.type == "cuda" else None for p in params]
        self._streams = {}  # device -> its side stream

    def covers(self, i, t):
        """Whether ``t`` (parameter ``i``'s gradient or values) moves through ``i``'s
        buffer: on a GPU, of the buffer's shape and dtype (else it is copied plainly)."""
        b = self._bufs[i]
        return (b is not None and t.device.type == "cuda" and t.dtype == b.dtype
                and t.shape == b.shape)

    def _side(self, device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def _idle(self):
        for s in self._streams.values():
            s.synchronize()

    def down(self, items):
        """``items``: ``(i, t)`` with ``covers(i, t)``; returns the buffers they were copied
        into, in order, once every copy is done."""
        for device in {t.device for _, t in items}:
            side = self._side(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for i, t in items:
                    if t.device == device:
                        self._bufs[i].copy_(t.detach(), non_blocking=True)
        self._idle()
        return [self._bufs[i] for i, _ in items]

    def buffer(self, i):
        """Parameter ``i``'s buffer, for the host to write its new values into (nothing
        reads it on the GPU any more)."""
        self._idle()
        return self._bufs[i]

    def up(self, items):
        """``items``: ``(i, p)`` whose buffers hold their new values: copied into the
        parameters on the side stream, which the compute stream then waits for."""
        for device in {p.device for _, p in items}:
            side = self._side(device)
            compute = torch.cuda.current_stream(device)
            side.wait_stream(compute)
            with torch.cuda.stream(side), torch.no_grad():
                for i, p in items:
                    if p.device == device:
                        p.copy_(self._bufs[i], non_blocking=True)
            compute.wait_stream(side)
