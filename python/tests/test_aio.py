"""tidestore.aio round trips and failures, with numpy arrays (no torch).

Guards against: bytes that come back different (aligned, unaligned, tail, multi-buffer
transfers; async batches); a short read past the end of a file returning quietly; a
kernel error on a write (EFBIG from RLIMIT_FSIZE, raised by the filesystem under the
io_uring write) or on open (ENOENT, EISDIR) lost or raised as the wrong class; a buffer
that cannot be written into accepted. EIO itself needs a failing device (device-mapper's
`error` target); that is not reachable in an unprivileged container, so the errno
mapping is tested with the kernel errors that are.
"""

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

import tidestore
from tidestore.aio import AioHandle, aio_handle

SIZES = [1, 4095, 4096, 4096 * 3 + 17, (1 << 20) + 123, 20 * (1 << 20) + 4096]


def data(n, seed=0):
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_sync_round_trip(tmp_path, n, direct):
    h = AioHandle(direct=direct, bounce_size=1 << 20, bounce_buffers=3)
    f = tmp_path / "x.bin"
    src = data(n)
    assert h.sync_pwrite(src, f) == n
    assert os.path.getsize(f) == n
    out = np.zeros(n, np.uint8)
    assert h.sync_pread(out, f) == n
    np.testing.assert_array_equal(out, src)


@pytest.mark.parametrize("offset", [4096, 100])
def test_offsets(tmp_path, offset):
    h = aio_handle()
    f = tmp_path / "x.bin"
    head = data(offset, 1)
    body = data(3 * 4096 + 5, 2)
    h.sync_pwrite(head, f)
    h.sync_pwrite(body, f, offset)
    out = np.zeros(offset + body.size, np.uint8)
    h.sync_pread(out, f)
    np.testing.assert_array_equal(out[:offset], head)
    np.testing.assert_array_equal(out[offset:], body)
    part = np.zeros(body.size, np.uint8)
    h.sync_pread(part, f, offset)
    np.testing.assert_array_equal(part, body)


def test_async_batch_then_wait(tmp_path):
    h = AioHandle(bounce_size=1 << 20, bounce_buffers=2)
    arrays = [np.random.default_rng(i).standard_normal(1000 * (i + 1)).astype(np.float32)
              for i in range(6)]
    for i, a in enumerate(arrays):
        h.async_pwrite(a, tmp_path / f"{i}.bin")
    assert h.pending() == 6
    assert h.wait() == 6
    assert h.pending() == 0
    outs = [np.empty_like(a) for a in arrays]
    for i, o in enumerate(outs):
        h.async_pread(o, tmp_path / f"{i}.bin")
    assert h.wait() == 6
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


@pytest.mark.parametrize("n", [4096 * 4, 4096 * 4 + 10, 100])
def test_read_past_end_of_file_raises(tmp_path, n):
    h = AioHandle()
    f = tmp_path / "short.bin"
    h.sync_pwrite(data(n - 50 if n > 100 else 40), f)
    out = np.zeros(n, np.uint8)
    with pytest.raises(tidestore.IoError, match="short.bin.*end of file") as e:
        h.sync_pread(out, f)
    # The docs promise an errno: a read the file ends before is EIO (issue 26).
    assert e.value.errno == errno.EIO


@pytest.mark.parametrize("call", ["sync_pread", "sync_pwrite", "async_pread", "async_pwrite"])
def test_a_negative_offset_is_a_value_error_naming_it(tmp_path, call):
    h = AioHandle()
    with pytest.raises(ValueError, match="offset -4096 is negative"):
        getattr(h, call)(np.zeros(4096, np.uint8), tmp_path / "f.bin", -4096)
    assert h.pending() == 0


def test_async_errors_are_raised_by_wait_after_every_transfer(tmp_path):
    h = AioHandle()
    good = tmp_path / "good.bin"
    h.sync_pwrite(data(8192), good)
    a, b, c = (np.zeros(8192, np.uint8) for _ in range(3))
    h.async_pread(a, good)
    h.async_pread(b, tmp_path / "missing.bin")
    h.async_pread(c, good)
    with pytest.raises(tidestore.IoError, match="missing.bin") as e:
        h.wait()
    assert e.value.errno == errno.ENOENT
    assert h.pending() == 0
    np.testing.assert_array_equal(c, data(8192))


def test_directory_is_refused_with_its_errno(tmp_path):
    h = AioHandle()
    with pytest.raises(tidestore.IoError) as e:
        h.sync_pread(np.zeros(4096, np.uint8), tmp_path)
    assert e.value.errno == errno.EISDIR
    assert isinstance(e.value, OSError)


def test_write_error_from_the_kernel_is_raised(tmp_path):
    # RLIMIT_FSIZE makes the filesystem fail writes past 64 KiB with EFBIG: a real
    # error returned by the kernel to the io_uring write of the second block.
    code = f"""
import resource, signal, numpy as np, tidestore
from tidestore.aio import AioHandle
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
try:
    AioHandle(block_size=65536).sync_pwrite(np.ones(1 << 20, np.uint8), {str(tmp_path / 'big.bin')!r})
except tidestore.IoError as e:
    print("errno", e.errno, str(e))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"errno {errno.EFBIG} "), out.stdout + out.stderr
    assert "big.bin" in out.stdout and "write" in out.stdout


def test_bad_buffers_are_refused(tmp_path):
    h = AioHandle()
    ro = np.zeros(4096, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        h.async_pread(ro, tmp_path / "x")
    with pytest.raises(ValueError, match="contiguous"):
        h.async_pwrite(np.zeros((64, 64), np.float32)[:, ::2], tmp_path / "x")
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        h.async_pwrite(b"bytes", tmp_path / "x")
    assert h.pending() == 0
    with pytest.raises(tidestore.ConfigError, match="block_size"):
        AioHandle(block_size=1000)
    with pytest.raises(tidestore.ConfigError, match="bounce_size"):
        AioHandle(bounce_size=100)
