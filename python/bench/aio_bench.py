"""tidestore.aio read/write MB/s beside fio on the same file, alternated in one run.

    python python/bench/aio_bench.py --file /path/on/nvme/aio.bin [--size-mib 1024 --reps 5]

Both sides: O_DIRECT, io_uring, 1 MiB blocks, queue depth 32, one sequential pass over
the file. tidestore.aio moves a numpy array (its bytes pass through aligned bounce
buffers: one memcpy each way, overlapped with the I/O); fio moves its own buffers,
registered with the ring, files registered, submissions batched by 16 (its fastest
settings here: the plain io_uring job read at half that speed).
Prints the median MB/s of each, and fio's for the physical limit.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import time

import numpy as np

from tidestore.aio import AioHandle


def fio(path, rw, size_mib):
    out = subprocess.run(
        ["fio", "--name=x", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--iodepth=32",
         "--ioengine=io_uring", "--direct=1", "--fixedbufs=1", "--registerfiles=1",
         "--iodepth_batch_submit=16", f"--size={size_mib}M", "--output-format=json"],
        capture_output=True, text=True, check=True).stdout
    job = json.loads(out)["jobs"][0]
    side = job["read" if rw == "read" else "write"]
    return side["io_bytes"] / (side["runtime"] / 1000) / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio)")
    n = args.size_mib << 20
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    out = np.empty_like(data)
    h = AioHandle(block_size=1 << 20, queue_depth=32)
    res = {k: [] for k in ("aio write", "fio write", "aio read", "fio read")}
    for _ in range(args.reps):
        t = time.perf_counter()
        h.sync_pwrite(data, args.file)
        res["aio write"].append(n / (time.perf_counter() - t) / 1e6)
        res["fio write"].append(fio(args.file, "write", args.size_mib))
        h.sync_pwrite(data, args.file)
        t = time.perf_counter()
        h.sync_pread(out, args.file)
        res["aio read"].append(n / (time.perf_counter() - t) / 1e6)
        if not np.array_equal(out, data):
            raise SystemExit("aio read back different bytes")
        res["fio read"].append(fio(args.file, "read", args.size_mib))
    print(f"{args.size_mib} MiB, O_DIRECT, io_uring, bs 1 MiB, qd 32, {args.reps} reps alternated")
    for k, v in res.items():
        print(f"{k:10s} median {statistics.median(v):7.0f} MB/s   all {[round(x) for x in v]}")


if __name__ == "__main__":
    main()
