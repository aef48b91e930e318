"""Asynchronous tensor I/O through tidestore's io_uring engine.

The interface of DeepSpeed DeepNVMe's ``aio_handle``::

    h = tidestore.aio.AioHandle(block_size=1 << 20, queue_depth=32)
    h.async_pwrite(tensor, "/nvme/x.bin")     # returns at once
    ...                                        # compute meanwhile; don't touch `tensor`
    h.wait()                                   # -> 1 (transfers finished); raises on error
    h.sync_pread(out, "/nvme/x.bin")           # -> bytes read

Buffers are CPU torch tensors (any dtype) or numpy arrays, contiguous; a read fills the
whole buffer (``len`` bytes from ``offset``), and reading past the end of the file raises
``tidestore.IoError`` instead of returning a short count. A buffer of a queued transfer
must not be used, resized or freed until ``wait()`` returns: the handle keeps it alive,
but reads land in it from another thread. Writes create the file if needed and never
truncate it; nothing is fsynced. Transfers run one after another, each with up to
``queue_depth`` blocks of ``block_size`` in flight, through ``bounce_buffers`` aligned
buffers of ``bounce_size`` bytes (O_DIRECT needs aligned memory, which a tensor's is not
in general, so data is copied once, piece by piece, while the next pieces are in flight).
"""

import os

from ._tidestore import AioHandle as _AioHandle
from ._views import byte_view

__all__ = ["AioHandle", "aio_handle"]


class AioHandle:
    def __init__(self, block_size=1 << 20, queue_depth=32, direct=True, engine="auto",
                 bounce_size=8 << 20, bounce_buffers=4):
        self._h = _AioHandle(block_size=block_size, queue_depth=queue_depth, direct=direct,
                             engine=engine, bounce_size=bounce_size,
                             bounce_buffers=bounce_buffers)

    def async_pread(self, buffer, filename, offset=0):
        self._h.async_pread(byte_view(buffer, "buffer", writable=True), os.fspath(filename), offset)

    def async_pwrite(self, buffer, filename, offset=0):
        self._h.async_pwrite(byte_view(buffer, "buffer"), os.fspath(filename), offset)

    def sync_pread(self, buffer, filename, offset=0):
        return self._h.sync_pread(byte_view(buffer, "buffer", writable=True), os.fspath(filename), offset)

    def sync_pwrite(self, buffer, filename, offset=0):
        return self._h.sync_pwrite(byte_view(buffer, "buffer"), os.fspath(filename), offset)

    def wait(self):
        """Waits for every queued transfer; returns how many finished."""
        return self._h.wait()

    def pending(self):
        return self._h.pending()

    def get_block_size(self):
        return self._h.get_block_size()

    def get_queue_depth(self):
        return self._h.get_queue_depth()


#: DeepNVMe's name for the handle.
aio_handle = AioHandle
