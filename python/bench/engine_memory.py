"""Peak memory and time per step of a Hugging Face model directory trained through
``tidestore.offload`` with a host budget below its training state, beside the bound
derived from what the run holds; JSON.

    python python/bench/engine_memory.py --model models/llama-1b --host-budget 4GiB \\
        --device-budget 1GiB --nvme-dir /nvme/run --seq 256 --steps 4

The bound is what this process may hold at once: torch's and transformers' own baseline
(measured: the resident set after the model's skeleton is built, before the store
opens), the host pool (the store touches it whole) and the device budget (the
simulated device a config asks for; without one asked for nothing is placed there), the
largest module's parameters and their gradients while it runs (in the bound dtype), and
the activations of one step with gradient checkpointing (each layer's saved input, one
layer recomputed with its attention scores, the logits with their log-softmax and
gradient; derived from the config, in the compute dtype).

Each step's time is also split three ways: waiting on the store (its parameters made
current where compute reads them, leases ended, gradients written in: the engine
core's ``store_ns``), the optimizer (``optimizer_ns``: groups stepped during backward and
the step itself, M and V streamed from NVMe included), and compute (the rest: torch's
forward and backward, and the engine's Python hooks).
"""

import argparse
import json
import os
import resource
import statistics
import time

import torch
import transformers

import tidestore
from tidestore._views import parse_bytes


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def activation_bytes(cfg, batch, seq, elem):
    """Activations of one step of a checkpointed decoder (see the module doc)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", heads) or heads
    tokens = batch * seq
    saved_inputs = layers * tokens * h * elem
    # One layer recomputed: norms, q/k/v/o, rotary copies, MLP gate/up/act/product,
    # and its gradients of the same size; attention scores and probabilities.
    layer = tokens * (6 * h + 4 * h * kv // heads + 4 * inter) * elem * 2
    scores = 3 * batch * heads * seq * seq * elem
    logits = 3 * tokens * cfg.vocab_size * 4
    return saved_inputs + layer + scores + logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--nvme-dir", required=True)
    ap.add_argument("--host-budget", required=True)
    ap.add_argument("--device-budget", required=True)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--states", default="fp32")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-elements", type=int, default=None, help="default: searched")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = transformers.AutoConfig.from_pretrained(args.model)
    from tidestore.engine import _from_dir

    skeleton = _from_dir(args.model)
    baseline = rss_bytes()
    del skeleton
    t0 = time.perf_counter()
    model, opt = tidestore.offload(args.model, precision=args.precision, states=args.states,
                                   host_budget=args.host_budget,
                                   device_budget=args.device_budget, nvme_dir=args.nvme_dir,
                                   threads=args.threads, chunk_elements=args.chunk_elements)
    import_s = time.perf_counter() - t0
    model.gradient_checkpointing_enable()
    eng = model.tidestore_engine
    params = sum(torch.Size(s).numel() for s in eng._shapes)
    bound_elem = 2 if args.precision == "bf16" else 4
    largest = max(
        sum(torch.Size(eng._shapes[i]).numel() for i in own) for _, own in eng._modules.values())
    host = parse_bytes(args.host_budget, "host")
    device = parse_bytes(args.device_budget, "device")
    acts = activation_bytes(cfg, args.batch, args.seq, bound_elem)
    bound = baseline + host + device + 2 * largest * bound_elem + acts

    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        before = eng.core.stats()
        t = [time.perf_counter()]
        loss = model(input_ids=ids, labels=ids).loss
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        t.append(time.perf_counter())
        after = eng.core.stats()
        spent = {k: (after[k] - before[k]) / 1e9 for k in ("store_ns", "optimizer_ns")}
        steps.append({"loss": loss.item(), "forward_s": t[1] - t[0],
                      "backward_s": t[2] - t[1], "step_s": t[3] - t[2],
                      "total_s": t[3] - t[0],
                      # The split: waiting on the store (loads, lease ends, gradients
                      # written in), the optimizer (during backward and at the step),
                      # and compute (the rest: torch, and the engine's Python hooks).
                      "store_s": spent["store_ns"], "optimizer_s": spent["optimizer_ns"],
                      "compute_s": t[3] - t[0] - spent["store_ns"] - spent["optimizer_ns"],
                      "rss": rss_bytes()})
    peak = peak_rss_bytes()
    stats = eng.core.stats()
    print(json.dumps({
        "params": params, "precision": args.precision, "states": args.states,
        "seq": args.seq, "batch": args.batch, "import_s": import_s,
        "baseline_rss": baseline, "host_budget": host, "device_budget": device,
        "largest_module_params": largest, "activations_derived": acts,
        "bound": bound, "peak_rss": peak, "peak_over_bound": peak / bound,
        "steps": steps,
        "median_total_s": statistics.median(s["total_s"] for s in steps[1:] or steps),
        "store": stats, "load": os.getloadavg()[0],
    }, indent=1))


if __name__ == "__main__":
    main()
