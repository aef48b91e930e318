"""tidestore on a CUDA GPU, with the tiny LLaMA of the data-parallel tests:
tidestore.AdamW over the parameters of a model on the GPU (the step copies each gradient
to the CPU, steps the store and copies the new values back), and tidestore.offload with
device="cuda" (the store's device tier is the GPU; each module's parameters are CUDA
tensors over the store's GPU memory while it runs).

Guards against: losses on the GPU that drift from torch.optim.AdamW on the same GPU
(fp32, <= 1e-5 relative for AdamW, <= 1e-4 for the engine, whose gradients reach the
store through the host) or from the same training on the CPU (<= 1e-3: the GPU's
kernels reduce in other orders); an engine on the GPU whose modules read anything but
CUDA views of the store's memory, or that leaves a parameter held after a step. Needs a
CUDA GPU; `.ci/gpu-check` runs it where one is.
"""

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch-level tests need it")
pytest.importorskip("transformers", reason="transformers is not installed: the LLaMA tests need it")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_worker  # noqa: E402

import tidestore  # noqa: E402


def losses(device, make_opt, steps=5):
    torch.manual_seed(0)
    model = dist_worker.model_of("llama", False).to(device)
    return train(model, make_opt(model.parameters()), device, steps)


def test_a_tiny_llama_on_cuda_trains_as_torch_adamw_there_and_as_on_the_cpu(tmp_path):
    hp = dict(lr=1e-3, weight_decay=0.01)
    ours = losses("cuda", lambda ps: tidestore.AdamW(ps, **hp, nvme_dir=tmp_path))
    torchs = losses("cuda", lambda ps: torch.optim.AdamW(ps, **hp, foreach=False))
    cpu = losses("cpu", lambda ps: tidestore.AdamW(ps, **hp, nvme_dir=tmp_path))
    for i, (a, b, c) in enumerate(zip(ours, torchs, cpu)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i + 1}: tidestore {a}, torch {b} (CUDA)"
        assert abs(a - c) <= 1e-3 * abs(c), f"step {i + 1}: CUDA {a}, CPU {c}"


def train(model, opt, device, steps=5):
    """Per-step losses of ``steps`` steps on ``device``; an offloaded model must leave
    no parameter held after a step."""
    out = []
    for batch in dist_worker.data(steps):
        ids = batch.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
        engine = getattr(model, "tidestore_engine", None)
        assert engine is None or engine.core.held() == [], "a parameter left held"
    return out


def test_an_offloaded_llama_computes_on_the_gpu_as_torch_there_and_the_engine_on_the_cpu(
        tmp_path):
    hp = dict(lr=1e-3, weight_decay=0.01)
    base = dist_worker.model_of("llama", False)
    ref = copy.deepcopy(base).to("cuda")
    torchs = train(ref, torch.optim.AdamW(ref.parameters(), **hp, foreach=False), "cuda")
    # Chunks of 16K elements, a device tier of a few of them and a host pool below the
    # state: parameters move NVMe -> host -> GPU and back every step.
    small = dict(chunk_elements=16384, host_budget=768 * 1024)
    cpu_model, cpu_opt = tidestore.offload(copy.deepcopy(base), **hp, **small,
                                           nvme_dir=tmp_path / "cpu")
    cpus = train(cpu_model, cpu_opt, "cpu")
    model, opt = tidestore.offload(copy.deepcopy(base), **hp, **small, device="cuda",
                                   device_budget=8 * 16384 * 4, nvme_dir=tmp_path / "gpu")
    engine = model.tidestore_engine
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    assert engine.core.gpu == torch.cuda.current_device()
    seen = []

    def weights_where(module, args):  # after the engine's pre-hook: the bound weights
        for p in module.parameters(recurse=False):
            seen.append((p.device.type, p.data_ptr()))

    model.model.layers[0].mlp.up_proj.register_forward_pre_hook(weights_where)
    gpus = train(model, opt, "cuda")
    assert seen and all(d == "cuda" for d, _ in seen), seen
    stats = engine.stats()
    assert stats["host_to_device_bytes"] > 0 and stats["nvme_read_bytes"] > 0, stats
    for i, (a, b, c) in enumerate(zip(gpus, torchs, cpus)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i + 1}: engine {a}, torch {b} (CUDA)"
        assert abs(a - c) <= 1e-3 * abs(c), f"step {i + 1}: CUDA {a}, CPU {c}"
    # The buffers moved with the modules; converting the model elsewhere is refused.
    assert all(b.device.type == "cuda" for b in model.buffers())
    with pytest.raises(tidestore.TidestoreError, match="converting a model"):
        model.to("cpu")


def test_adamw_on_cuda_moves_parameters_through_pinned_buffers(tmp_path):
    """Gradients come down and new values go up through one pinned host buffer per
    parameter on a side stream: read on the compute stream right after ``step()``
    returns, the parameters on the GPU hold the store's master copies."""
    torch.manual_seed(0)
    model = dist_worker.model_of("llama", False).to("cuda")
    opt = tidestore.AdamW(model.parameters(), lr=1e-2, nvme_dir=tmp_path)
    assert opt._staging is not None
    assert all(b.is_pinned() for b in opt._staging._bufs if b is not None)
    ids = dist_worker.data(1)[0].to("cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    before = [p.detach().cpu() for p in model.parameters()]
    opt.step()
    after = [p.detach().cpu() for p in model.parameters()]  # on the compute stream
    for i, (b, a) in enumerate(zip(before, after)):
        master = torch.frombuffer(bytearray(opt._core.master(i)), dtype=torch.float32)
        assert torch.equal(master.view(a.shape).to(a.dtype), a), f"parameter {i}"
        assert not torch.equal(b, a), f"parameter {i} was not stepped"
