"""tidestore.AdamW over the parameters of a model on a CUDA GPU (the tiny LLaMA of the
data-parallel tests): the step copies each gradient to the CPU, steps the store and
copies the new values back.

Guards against: losses on the GPU that drift from torch.optim.AdamW on the same GPU
(fp32, <= 1e-5 relative) or from the same training on the CPU (<= 1e-3: the GPU's
kernels reduce in other orders). Needs a CUDA GPU; `.ci/gpu-check` runs it where one is.
"""

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
    opt = make_opt(model.parameters())
    out = []
    for batch in dist_worker.data(steps):
        ids = batch.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_a_tiny_llama_on_cuda_trains_as_torch_adamw_there_and_as_on_the_cpu(tmp_path):
    hp = dict(lr=1e-3, weight_decay=0.01)
    ours = losses("cuda", lambda ps: tidestore.AdamW(ps, **hp, nvme_dir=tmp_path))
    torchs = losses("cuda", lambda ps: torch.optim.AdamW(ps, **hp, foreach=False))
    cpu = losses("cpu", lambda ps: tidestore.AdamW(ps, **hp, nvme_dir=tmp_path))
    for i, (a, b, c) in enumerate(zip(ours, torchs, cpu)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i + 1}: tidestore {a}, torch {b} (CUDA)"
        assert abs(a - c) <= 1e-3 * abs(c), f"step {i + 1}: CUDA {a}, CPU {c}"
