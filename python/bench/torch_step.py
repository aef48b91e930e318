"""Plain PyTorch in RAM: the baseline `tidestore finetune` is compared with on a CPU.

    python python/bench/torch_step.py MODEL_DIR [--steps 6 --warmup 1 --threads 2 --seq 512]

Loads the Hugging Face LLaMA in MODEL_DIR (written by `tidestore init-model ... --dtype f32`)
with transformers, in fp32, with gradient checkpointing and torch.optim.AdamW(fused=True),
and runs full fine-tuning steps of micro-batch 1 on `--seq` fixed random tokens (the
speed does not depend on which tokens). Prints each step's forward+backward and optimizer
seconds, their medians after the warm-up steps, and the peak RSS, as JSON on the last
line. Run it alternated with `tidestore finetune --json` on the same model, sequence and
thread count (`RAYON_NUM_THREADS`) so both see the same machine load.
"""

import argparse
import json
import resource
import statistics
import time

import torch
from transformers import LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(a.model_dir, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (1, a.seq))
    rows = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        row = {"step": step + 1, "loss": loss.item(), "fwd_bwd": t1 - t0, "optimizer": t2 - t1}
        row["seconds"] = t2 - t0
        print(json.dumps(row), flush=True)
        if step >= a.warmup:
            rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in ("seconds", "fwd_bwd", "optimizer")}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"torch": torch.__version__, "threads": a.threads, "median": med, "peak_rss_bytes": rss}))


if __name__ == "__main__":
    main()
