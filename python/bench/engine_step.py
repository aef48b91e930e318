"""Time per training step of a transformers LLaMA through ``tidestore.offload`` beside
plain PyTorch (the same model and batches, gradient checkpointing, torch's fused AdamW),
alternated step by step in one process; medians as JSON.

    python python/bench/engine_step.py --hidden 512 --layers 4 --steps 6 --threads 2
"""

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import torch
import transformers

import tidestore


def llama_args(ap, batch):
    """The model's and the batch's options (shared with ``engine_ranks.py``)."""
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=batch)


def llama_of(args):
    """A randomly initialised transformers LLaMA of ``args``' shape (GQA: a kv head per
    two query heads)."""
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq)
    return transformers.LlamaForCausalLM(cfg)


def main():
    ap = argparse.ArgumentParser()
    llama_args(ap, batch=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps after one warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host-budget", default=None, help="tidestore host pool (default: all in RAM)")
    ap.add_argument("--chunk-elements", type=int, default=None, help="default: searched")
    ap.add_argument("--device-budget", default=None,
                    help="a simulated device standing in for a GPU (default: none)")
    ap.add_argument("--no-checkpointing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = llama_of(args)
    params = sum(p.numel() for p in base.parameters())
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    del base
    if not args.no_checkpointing:
        ref.gradient_checkpointing_enable()
        mine.gradient_checkpointing_enable()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    nvme = tempfile.mkdtemp(prefix="tidestore-engine-bench-")
    mine, opt = tidestore.offload(mine, lr=1e-4, weight_decay=0.01, nvme_dir=nvme,
                                  host_budget=args.host_budget, threads=args.threads,
                                  chunk_elements=args.chunk_elements,
                                  device_budget=args.device_budget)
    g = torch.Generator().manual_seed(1)
    times = {"torch": [], "tidestore": []}
    losses = {"torch": [], "tidestore": []}
    for step in range(args.steps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        for name, model, o in (("torch", ref, opt_ref), ("tidestore", mine, opt)):
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            dt = time.perf_counter() - t0
            losses[name].append(loss.item())
            if step > 0:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "params": params, "threads": args.threads, "seq": args.seq, "batch": args.batch,
        "checkpointing": not args.no_checkpointing, "host_budget": args.host_budget,
        "median_s_per_step": med, "ratio": med["tidestore"] / med["torch"],
        "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in zip(losses["torch"], losses["tidestore"])),
        "store": mine.tidestore_engine.core.stats(), "load": os.getloadavg()[0],
    }, indent=1))


if __name__ == "__main__":
    main()
