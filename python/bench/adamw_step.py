"""One optimizer step of a 100M+ parameter model: tidestore.AdamW (M and V in RAM, and
on NVMe with a small host budget) beside torch.optim.AdamW (fused where this torch has
it on the CPU, else foreach), alternated in one run; prints medians.

    python python/bench/adamw_step.py --nvme-dir /path/on/nvme [--layers 6 --width 4096]

Each model gets the same fixed random gradients (no forward/backward: it is the same
for every optimizer); what is timed is ``opt.step()``: for tidestore that includes
handing the gradients over and writing the new parameters back into the model.
A forward+backward of the model is timed once for scale.

Three pairs do the same work on both sides:
- no check: torch's fused step against ``check_finite=False``;
- a step skipped on a non-finite gradient (tidestore's default): torch's
  ``get_total_norm`` and a step only when it is finite, against the default;
- clipping to norm 1 (transformers' ``Trainer`` default): torch's ``clip_grad_norm_``
  then the fused step, against ``max_grad_norm=1.0``.
"""

import argparse
import statistics
import tempfile
import time

import torch

import tidestore


def make_model(layers, width, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme-dir", required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small-host", default="1GiB", help="host_budget of the NVMe case")
    ap.add_argument("--full", action="store_true",
                    help="time whole training steps (forward, backward, step) instead, "
                         "with overlap=True cases")
    args = ap.parse_args()
    if args.full:
        return full_steps(args)

    models, opts = {}, {}
    ref = make_model(args.layers, args.width)
    n = sum(p.numel() for p in ref.parameters())
    grads = [torch.randn_like(p) * 1e-3 for p in ref.parameters()]
    try:
        torch.optim.AdamW(make_model(1, 8).parameters(), fused=True).step()
        torch_kind = "fused"
    except (RuntimeError, TypeError) as e:
        torch_kind = "foreach"
        print(f"torch fused AdamW unavailable on CPU ({e}); using foreach")
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    models["torch"] = ref
    opts["torch"] = torch.optim.AdamW(ref.parameters(), **hp, **{torch_kind: True})
    models["tide_ram"] = make_model(args.layers, args.width)
    opts["tide_ram"] = tidestore.AdamW(models["tide_ram"].parameters(), **hp,
                                       nvme_dir=tempfile.mkdtemp(dir=args.nvme_dir))  # noqa
    models["tide_ram_torch"] = make_model(args.layers, args.width)
    opts["tide_ram_torch"] = tidestore.AdamW(models["tide_ram_torch"].parameters(), **hp,
                                             nvme_dir=tempfile.mkdtemp(dir=args.nvme_dir),
                                             check_finite=False)
    models["tide_clip"] = make_model(args.layers, args.width)
    opts["tide_clip"] = tidestore.AdamW(models["tide_clip"].parameters(), **hp,
                                        nvme_dir=tempfile.mkdtemp(dir=args.nvme_dir),
                                        max_grad_norm=1.0)
    for k in ("torch_check", "torch_clip"):
        models[k] = make_model(args.layers, args.width)
        opts[k] = torch.optim.AdamW(models[k].parameters(), **hp, **{torch_kind: True})
    models["tide_nvme"] = make_model(args.layers, args.width)
    opts["tide_nvme"] = tidestore.AdamW(models["tide_nvme"].parameters(), **hp,
                                        nvme_dir=tempfile.mkdtemp(dir=args.nvme_dir),
                                        host_budget=args.small_host)
    for k, m in models.items():
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()

    x = torch.randn(8, args.width)
    t = time.perf_counter()
    ref(x).square().mean().backward()
    fwd_bwd = time.perf_counter() - t
    for p, g in zip(ref.parameters(), grads):
        p.grad = g.clone()

    steps = {k: o.step for k, o in opts.items()}
    steps["torch_check"] = lambda: step_if_finite(models["torch_check"], opts["torch_check"])
    steps["torch_clip"] = lambda: clip_and_step(models["torch_clip"], opts["torch_clip"])
    times = {k: [] for k in opts}
    for rep in range(args.reps + 1):
        for k, step in steps.items():
            t = time.perf_counter()
            step()
            dt = time.perf_counter() - t
            if rep > 0:  # the first step of each is a warm-up
                times[k].append(dt)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {n / 1e6:.1f}M params, "
          f"fp32, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"forward+backward of a batch of 8 (once, for scale): {fwd_bwd:.3f} s")
    for k in opts:
        med = statistics.median(times[k])
        extra = ""
        if k.startswith("tide"):
            s = opts[k].stats()
            extra = (f"  host pool {s['host_budget_bytes'] / 2**20:.0f} MiB, NVMe read "
                     f"{s['nvme_read_bytes'] / 2**30:.2f} GiB / written "
                     f"{s['nvme_written_bytes'] / 2**30:.2f} GiB over {s['steps']} steps")
        name = {"torch": f"torch.optim.AdamW({torch_kind}=True)", "tide_ram": "tidestore.AdamW, M/V in RAM",
                "tide_ram_torch": "tidestore.AdamW, M/V in RAM, check_finite=False",
                "torch_check": "torch: get_total_norm, step if finite",
                "torch_clip": "torch: clip_grad_norm_(1.0), step",
                "tide_clip": "tidestore.AdamW, M/V in RAM, max_grad_norm=1.0",
                "tide_nvme": f"tidestore.AdamW, M/V on NVMe (host_budget={args.small_host})"}[k]
        print(f"{name:55s} median {med:.3f} s  ({n / med / 1e6:.0f} Mparam/s)  "
              f"all {[round(t, 3) for t in times[k]]}{extra}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for torch_k, tide_k, what in [("torch", "tide_ram_torch", "no check"),
                                  ("torch_check", "tide_ram", "skip on non-finite"),
                                  ("torch_clip", "tide_clip", "clip to 1.0")]:
        print(f"same work, {what:20s} tidestore at {med[torch_k] / med[tide_k]:.2f}x torch's speed")
    print(f"default tidestore against torch's bare fused step: {med['torch'] / med['tide_ram']:.2f}x")
    dmax = max((p - q).abs().max().item()
               for p, q in zip(models["torch"].parameters(), models["tide_nvme"].parameters()))
    print(f"max |torch - tidestore(NVMe)| after {args.reps + 1} steps: {dmax:.2e}")


def step_if_finite(model, opt):
    """A torch step skipped when the gradients' norm is not finite (tidestore's default)."""
    grads = [p.grad for p in model.parameters()]
    if torch.isfinite(torch.nn.utils.get_total_norm(grads)):
        opt.step()


def clip_and_step(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def full_steps(args):
    """Forward + backward + step of a batch of 8, per optimizer, alternated."""
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    cases = {}
    m = make_model(args.layers, args.width)
    cases["torch.optim.AdamW(fused=True)"] = (m, torch.optim.AdamW(m.parameters(), **hp, fused=True))
    for name, kw in [("tidestore RAM, overlap=False", {}),
                     ("tidestore RAM, overlap=True", {"overlap": True}),
                     (f"tidestore NVMe ({args.small_host}), overlap=True",
                      {"overlap": True, "host_budget": args.small_host})]:
        m = make_model(args.layers, args.width)
        cases[name] = (m, tidestore.AdamW(m.parameters(), **hp, **kw,
                                          nvme_dir=tempfile.mkdtemp(dir=args.nvme_dir)))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, args.width, generator=g) for _ in range(args.reps + 1)]
    times = {k: [] for k in cases}
    for rep, x in enumerate(batches):
        for k, (m, o) in cases.items():
            t = time.perf_counter()
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            if rep > 0:
                times[k].append(time.perf_counter() - t)
    n = sum(p.numel() for p in cases[next(iter(cases))][0].parameters())
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {n / 1e6:.1f}M params, "
          f"fp32, CPU, batch 8, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for k, v in times.items():
        print(f"{k:45s} median {statistics.median(v):.3f} s  all {[round(t, 3) for t in v]}")


if __name__ == "__main__":
    main()
