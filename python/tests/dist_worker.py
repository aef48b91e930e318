"""One rank of the data-parallel tests (``test_dist.py``): a tiny transformers LLaMA (or
a small MLP with odd sizes), full or LoRA, trained with ``tidestore.AdamW`` sharded
over a gloo process group (on the CPU), or an NCCL one (``--device cuda``: rank ``r``
on GPU ``r``). Launched by ``torchrun`` (or with torchrun's environment
variables set by hand: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``);
``train(..., group=None)`` is the one-process reference, run in the test itself.

Every rank takes its slice of each step's global batch; the loss reported is the mean
over the global batch. Each rank writes ``rank{r}.json`` into ``--out``: the losses,
a hash of the final parameters, the optimizer's counters, and the error that stopped
it (if one did).
"""

import argparse
import datetime
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist

import tidestore

VOCAB = 128
BATCH = 4  # sequences per step, over all ranks
SEQ = 16


def model_of(kind, lora):
    torch.manual_seed(0)
    if kind == "mlp":
        # Sizes no world size of 2 divides: the last shards are padded.
        return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 15), torch.nn.Linear(15, 21),
                                   torch.nn.Tanh(), torch.nn.Linear(21, VOCAB))
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return model


def loss_of(kind, model, ids):
    if kind == "mlp":
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return model(input_ids=ids, labels=ids).loss


def data(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def params_hash(model):
    """A hash of every parameter's values (an offloaded model's from its store: a
    collective with a process group, every rank calls it)."""
    engine = getattr(model, "tidestore_engine", None)
    values = (engine.state_dict().values() if engine is not None
              else (p.detach() for p in model.parameters()))
    h = hashlib.sha256()
    for t in values:
        h.update(t.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer(a, model, rank, world, group):
    """``tidestore.AdamW`` over the trainable parameters, or the whole model offloaded
    (``--engine offload``); the model to train and its optimizer."""
    swap = os.path.join(a.out, f"swap{rank}")
    os.makedirs(swap, exist_ok=True)
    wd = a.weight_decay if rank == world - 1 else 0.01
    ahead = a.collectives_ahead
    if a.last_rank_ahead is not None and rank == world - 1:
        ahead = a.last_rank_ahead
    common = dict(lr=1e-3, weight_decay=wd, overlap=a.overlap, threads=1, max_grad_norm=a.clip,
                  nvme_dir=swap, host_budget=a.host_budget, chunk_elements=a.chunk_elements,
                  checkpoint_path=os.path.join(a.out, "optim.safetensors"), process_group=group,
                  collectives_ahead=ahead)
    if a.engine == "offload":
        if a.checkpointing:
            # transformers 5's name, else 4's
            (getattr(model, "activation_checkpointing_enable", None)
             or model.gradient_checkpointing_enable)()
        if a.config_file:  # the same settings from a tidestore.toml (the keywords unread)
            config = os.path.join(a.out, f"tidestore{rank}.toml")
            with open(config, "w") as f:
                f.write(f"[optimizer]\nlr = 1e-3\nweight_decay = {wd}\nthreads = 1\n"
                        f"[device]\nbudget = \"16MiB\"\n[host]\nbudget = \"64MiB\"\n"
                        f"[nvme]\ndir = \"{swap}\"\n[train]\nprecision = \"f32\"\n"
                        f"collectives_ahead = {ahead}\n")
            return tidestore.offload(a.model_dir or model, config, process_group=group,
                                     checkpoint_path=common["checkpoint_path"])
        return tidestore.offload(a.model_dir or model, **common, device_budget=a.device_budget,
                                 precision=a.precision)
    params = [p for p in model.parameters() if p.requires_grad]
    if a.drop_last and rank == world - 1:
        params = params[:-1]
    return model, tidestore.AdamW(params, **common)


def train(a, rank, world, group):
    """Trains as ``a`` says; the result dict (``error`` set when a collective failed)."""
    torch.set_num_threads(1)
    model = model_of(a.model, a.lora).to(a.device)
    if a.resume and a.engine != "offload":  # the engine's checkpoint holds the model
        model.load_state_dict(torch.load(os.path.join(a.resume, "model.pt"), map_location=a.device))
    model, opt = optimizer(a, model, rank, world, group)
    start = 0
    if a.resume:
        state = torch.load(os.path.join(a.resume, "optim.pt"))
        opt.load_state_dict(state)
        start = state["tidestore"]["step"]
    per = BATCH // world
    losses, evals, error = [], [], None
    try:
        for step, batch in enumerate(data(a.steps)):
            if step < start:
                continue
            ids = batch[rank * per:(rank + 1) * per].to(a.device)
            loss = loss_of(a.model, model, ids)
            loss.backward()
            if step == a.die_at and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            if group is not None:
                dist.all_reduce(mean, group=group)
            losses.append(float(mean) / world)
            if a.eval_every and (step + 1) % a.eval_every == 0:
                with torch.no_grad():  # an evaluation: forward binds only
                    evals.append(float(loss_of(a.model, model, ids)))
            if step + 1 == a.save_at:
                save(a.out, rank, model, opt)
    except Exception as e:  # the rank that lost its peer reports why
        error = f"{type(e).__name__}: {e}"
    if a.engine == "offload":
        stats = model.tidestore_engine.stats()
        digest = params_hash(model) if error is None else None
        if a.export and error is None:  # a collective: rank 0 writes
            model.save_pretrained(os.path.join(a.out, a.export), dtype=torch.float32)
    else:
        stats = opt.stats()
        opt.close()
        digest = params_hash(model)
    return {"losses": losses, "evals": evals, "hash": digest, "stats": stats, "error": error}


def save(out, rank, model, opt):
    """Every rank writes its shards; rank 0 the model and the state dict (which names
    the shards' files of every rank)."""
    state = opt.state_dict()
    # An offloaded model's values are in the engine's checkpoint.
    objs = [("optim.pt", state)]
    if not hasattr(model, "tidestore_engine"):
        objs.append(("model.pt", model.state_dict()))
    if rank == 0:
        ckpt = os.path.join(out, "ckpt")
        os.makedirs(ckpt, exist_ok=True)
        for name, obj in objs:
            tmp = os.path.join(ckpt, name + ".tmp")
            torch.save(obj, tmp)
            os.replace(tmp, os.path.join(ckpt, name))


def args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama", choices=["llama", "mlp"])
    p.add_argument("--lora", action="store_true")
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--host-budget", default=None)
    p.add_argument("--chunk-elements", type=int, default=None)
    p.add_argument("--device-budget", default=None, help="offload only")
    p.add_argument("--precision", default="f32", choices=["f32", "bf16"], help="offload only")
    p.add_argument("--model-dir", default=None,
                   help="offload only: a Hugging Face directory to import instead")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--engine", default="adamw", choices=["adamw", "offload"],
                   help="tidestore.AdamW, or the whole model offloaded (tidestore.offload)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing (transformers'), offload only")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--config-file", action="store_true",
                   help="offload only: the settings from a tidestore.toml")
    p.add_argument("--export", nargs="?", const="export", default=None,
                   help="offload only: save_pretrained into OUT/EXPORT at the end (f32)")
    p.add_argument("--collectives-ahead", type=int, default=8,
                   help="collectives in flight beside compute")
    p.add_argument("--last-rank-ahead", type=int, default=None,
                   help="the last rank's --collectives-ahead")
    p.add_argument("--eval-every", type=int, default=0,
                   help="a forward under no_grad after every this many steps")
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--resume", default=None)
    p.add_argument("--weight-decay", type=float, default=0.01, help="the last rank's")
    p.add_argument("--drop-last", action="store_true", help="the last rank drops a parameter")
    return p.parse_args(argv)


def main():
    a = args()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = train(a, rank, world, dist.group.WORLD)
    except Exception as e:  # a refusal at construction: reported, not a traceback
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if result.get("error") is None:
        dist.destroy_process_group()
    os._exit(0 if result.get("error") is None else 3)


if __name__ == "__main__":
    main()
