"""Time per step of a transformers LLaMA offloaded with ``tidestore.offload`` (or, with
``--engine adamw``, in memory with ``tidestore.AdamW`` sharding its state) over the
ranks of a ``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs), and the
time each rank waited for its collectives; medians of the steps after the first two
(the first learns the order the gathers ahead follow) as JSON, from rank 0.

    python -m torch.distributed.run --nproc-per-node 2 python/bench/engine_ranks.py \\
        --hidden 512 --layers 4 --collectives-ahead 8
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tidestore
from engine_step import llama_args, llama_of  # (this folder is the script's path)


def main():
    ap = argparse.ArgumentParser()
    llama_args(ap, batch=1)  # (--batch: per rank)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--collectives-ahead", type=int, default=8)
    ap.add_argument("--engine", default="offload", choices=["offload", "adamw"])
    args = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = llama_of(args)
    model.gradient_checkpointing_enable()
    nvme = tempfile.mkdtemp(prefix=f"tidestore-ranks-bench-{rank}-")
    settings = dict(lr=1e-4, weight_decay=0.01, nvme_dir=nvme, threads=args.threads,
                    process_group=dist.group.WORLD, collectives_ahead=args.collectives_ahead)
    if args.engine == "offload":
        model, opt = tidestore.offload(model, **settings)
        engine = model.tidestore_engine
    else:
        engine = opt = tidestore.AdamW(model.parameters(), **settings)
    g = torch.Generator().manual_seed(1 + rank)
    times, waits, losses = [], [], []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        waited = engine.stats()["collective_wait_ns"]
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        waits.append((engine.stats()["collective_wait_ns"] - waited) / 1e9)
        losses.append(loss.item())
    stats = engine.stats()
    timed = slice(2, None)
    out = {"rank": rank, "world": world, "engine": args.engine,
           "collectives_ahead": args.collectives_ahead,
           "threads": args.threads, "median_step_s": statistics.median(times[timed]),
           "median_collective_wait_s": statistics.median(waits[timed]),
           "steps_s": times, "waits_s": waits, "losses": losses,
           "gathers_ahead": stats["gathers_ahead"], "gathers_at_call": stats["gathers_at_call"],
           "scatters_behind": stats["scatters_behind"],
           "sent_all_gather_bytes": stats["sent_all_gather_bytes"]}
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
