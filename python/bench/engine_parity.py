"""Losses of a transformers LLaMA trained through ``tidestore.offload`` with its weights
streamed from NVMe, beside plain torch on the same weights and batches: every
combination of precision (f32; bf16 with an fp32 master, against a torch loop doing the
same mixed precision), overlap, gradient checkpointing, and full or LoRA (peft)
training. One JSON line a combination, then a summary; exits 1 if any is off its
tolerance (1e-5 relative for f32, 1e-3 for bf16).

    python python/bench/engine_parity.py --steps 10
"""

import argparse
import copy
import json
import sys
import tempfile

import torch

import tidestore
from engine_step import llama_args, llama_of

TOLERANCE = {"f32": 1e-5, "bf16": 1e-3}


def lora(model):
    import peft

    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                          lora_dropout=0.0)
    model = peft.get_peft_model(model, cfg)
    # B starts at zero: give it values so the adapters change the losses from step 1.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def torch_losses(model, batches, precision, lr, wd):
    """Plain torch: AdamW on the fp32 model, or bf16 weights computing with an fp32
    master copy stepped from the widened gradients (the store's mixed precision)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if precision == "f32":
        opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=wd, foreach=False)
        master = None
    else:
        master = [p.detach().float().clone().requires_grad_() for p in trainable]
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        opt = torch.optim.AdamW(master, lr=lr, weight_decay=wd, foreach=False)
    out = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if master is not None:
            for m, p in zip(master, trainable):
                m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        if master is not None:
            with torch.no_grad():
                for m, p in zip(master, trainable):
                    p.copy_(m.to(torch.bfloat16))
        out.append(loss.item())
    return out


def engine_losses(model, batches, precision, overlap, args, nvme, chunk_elements):
    mine, opt = tidestore.offload(model, precision=precision, overlap=overlap, lr=args.lr,
                                  weight_decay=args.wd, host_budget=args.host_budget,
                                  device_budget=args.device_budget, nvme_dir=nvme,
                                  chunk_elements=chunk_elements, threads=args.threads)
    out = []
    for ids in batches:
        loss = mine(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out, mine.tidestore_engine.core.stats()


def main():
    ap = argparse.ArgumentParser()
    llama_args(ap, batch=2)
    ap.set_defaults(hidden=768, layers=7, vocab=4000, seq=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--host-budget", default="96MiB", help="below the 16-bit weights")
    ap.add_argument("--device-budget", default="64MiB")
    ap.add_argument("--chunk-elements", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--lora-chunk-elements", type=int, default=8 * 1024 * 1024,
                    help="with LoRA (a frozen f32 tensor takes two 16-bit slots an element)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = llama_of(args)
    params = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
               for _ in range(args.steps)]
    worst = {}
    failed = []
    for precision in ("f32", "bf16"):
        for adapters in (False, True):
            for checkpointing in (False, True):
                for overlap in (False, True):
                    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
                    if adapters:
                        ref, mine = lora(ref), None
                        mine = copy.deepcopy(ref)
                    if checkpointing:
                        ref.gradient_checkpointing_enable()
                        mine.gradient_checkpointing_enable()
                    want = torch_losses(ref, batches, precision, args.lr, args.wd)
                    with tempfile.TemporaryDirectory(prefix="tidestore-parity-") as nvme:
                        chunk = args.lora_chunk_elements if adapters else args.chunk_elements
                        got, stats = engine_losses(mine, batches, precision, overlap, args, nvme,
                                                   chunk)
                    diff = max(abs(a - b) / abs(a) for a, b in zip(want, got))
                    case = {"precision": precision, "lora": adapters,
                            "checkpointing": checkpointing, "overlap": overlap,
                            "max_rel_loss_diff": diff, "tolerance": TOLERANCE[precision],
                            "torch_last": want[-1], "tidestore_last": got[-1],
                            "nvme_read_bytes": stats["nvme_read_bytes"]}
                    print(json.dumps(case), flush=True)
                    worst[precision] = max(worst.get(precision, 0.0), diff)
                    if diff > TOLERANCE[precision] or stats["nvme_read_bytes"] == 0:
                        failed.append(case)
    print(json.dumps({"params": params, "steps": args.steps, "host_budget": args.host_budget,
                      "worst_rel_loss_diff": worst, "failed": len(failed)}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
