"""The Rust core of tidestore.AdamW (AdamWCore) driven with numpy arrays, no torch.

Guards against: an optimizer whose numbers drift from torch's AdamW; state that spills
to NVMe and comes back different; an overlapped step that differs from a plain one; a
checkpoint that does not resume bit for bit; bad arguments that get past the constructor
or change state before they are refused.
"""

import os

import numpy as np
import pytest

import tidestore
from tidestore import AdamWCore
from conftest import adamw_reference, bf16_bits, bf16_to_f32, u8

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
SHAPES = [[64, 48], [48], [48, 32], [32], [7, 3, 5]]
# Spilling cases: 8 tensors of 64K elements, chunks of 128K slots (a parameter's fp32
# gradient takes two 16-bit slots per element), a host pool of 6 fp32 chunks.
CHUNK = 131072
SMALL_HOST = 6 * CHUNK * 4


def core(tmp_path, shapes=SHAPES, **kw):
    args = dict(HP, states="fp32", nvme_dir=str(tmp_path), host_budget=None)
    args.update(kw)
    return AdamWCore([list(s) for s in shapes], **args)


def init_params(c, rng, shapes=SHAPES):
    ps = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for i, p in enumerate(ps):
        c.set_param(i, u8(p), "float32")
    return ps


def grads_for(rng, shapes, steps):
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]


def run(c, grads, order=None):
    for gs in grads:
        idx = order or range(len(gs))
        for i in idx:
            c.put_grad(i, u8(gs[i]), "float32")
        c.step()


def masters(c, n):
    return [np.frombuffer(c.master(i), np.float32) for i in range(n)]


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_matches_torch_adamw_formula(tmp_path, rng, max_grad_norm):
    c = core(tmp_path, max_grad_norm=max_grad_norm)
    p0 = init_params(c, rng)
    grads = grads_for(rng, SHAPES, 6)
    run(c, grads)
    want = adamw_reference(p0, grads, HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"],
                           max_grad_norm)
    for got, w in zip(masters(c, len(SHAPES)), want):
        np.testing.assert_allclose(got, w.reshape(-1), rtol=2e-5, atol=2e-6)
    assert c.step_count() == 6


def test_read_param_rounds_to_the_dtype(tmp_path, rng):
    c = core(tmp_path)
    p0 = init_params(c, rng)
    out32 = np.empty(SHAPES[0], np.float32)
    c.read_param(0, u8(out32), "float32")
    np.testing.assert_array_equal(out32, p0[0])
    out16 = np.empty(SHAPES[0], np.uint16)
    c.read_param(0, out16.reshape(-1).view(np.uint8), "bfloat16")
    np.testing.assert_array_equal(out16, bf16_bits(p0[0]))


def test_bf16_gradients_are_widened(tmp_path, rng):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = core(tmp_path / "a")
    b = core(tmp_path / "b")
    p0 = init_params(a, rng)
    for i, p in enumerate(p0):
        b.set_param(i, u8(p), "float32")
    g = grads_for(rng, SHAPES, 1)[0]
    for i, gi in enumerate(g):
        bits = bf16_bits(gi)
        a.put_grad(i, bits.reshape(-1).view(np.uint8), "bfloat16")
        b.put_grad(i, u8(bf16_to_f32(bits)), "float32")
    a.step()
    b.step()
    for x, y in zip(masters(a, len(SHAPES)), masters(b, len(SHAPES))):
        np.testing.assert_array_equal(x, y)


def spill_shapes():
    return [[256, 256]] * 8


def test_state_on_nvme_is_bit_identical_to_state_in_ram(tmp_path, rng):
    shapes = spill_shapes()
    (tmp_path / "ram").mkdir()
    (tmp_path / "nvme").mkdir()
    ram = core(tmp_path / "ram", shapes, chunk_elements=CHUNK)
    nvme = core(tmp_path / "nvme", shapes, chunk_elements=CHUNK, host_budget=SMALL_HOST)
    p0 = init_params(ram, rng, shapes)
    for i, p in enumerate(p0):
        nvme.set_param(i, u8(p), "float32")
    grads = grads_for(rng, shapes, 3)
    run(ram, grads)
    run(nvme, grads)
    stats = nvme.stats()
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_written_bytes"] > 0, stats
    assert ram.stats()["nvme_read_bytes"] == 0
    for x, y in zip(masters(ram, len(shapes)), masters(nvme, len(shapes))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("host_budget", [None, SMALL_HOST])
def test_overlap_is_bit_identical_to_no_overlap(tmp_path, rng, host_budget):
    shapes = spill_shapes()
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off = core(tmp_path / "off", shapes, chunk_elements=CHUNK, host_budget=host_budget)
    on = core(tmp_path / "on", shapes, chunk_elements=CHUNK, host_budget=host_budget,
              overlap=True)
    p0 = init_params(off, rng, shapes)
    for i, p in enumerate(p0):
        on.set_param(i, u8(p), "float32")
    grads = grads_for(rng, shapes, 3)
    backward_order = list(reversed(range(len(shapes))))
    run(off, grads, backward_order)
    run(on, grads, backward_order)
    assert on.stats()["tensors_overlapped"] > 0
    assert off.stats()["tensors_overlapped"] == 0
    for x, y in zip(masters(off, len(shapes)), masters(on, len(shapes))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_compact_moments_stay_close_to_fp32(tmp_path, rng, states):
    shapes = [[128, 64]]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = core(tmp_path / "a", shapes)
    compact = core(tmp_path / "b", shapes, states=states)
    p0 = init_params(full, rng, shapes)
    compact.set_param(0, u8(p0[0]), "float32")
    grads = grads_for(rng, shapes, 4)
    run(full, grads)
    run(compact, grads)
    a, b = masters(full, 1)[0], masters(compact, 1)[0]
    step = np.abs(a - p0[0].reshape(-1)).mean()
    assert np.abs(a - b).mean() < 0.05 * step
    m, v = (np.frombuffer(x, np.float32) for x in compact.moments(0))
    assert m.shape == v.shape == (128 * 64,) and (v >= 0).all()


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path, rng):
    shapes = spill_shapes()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = core(tmp_path / "a", shapes, chunk_elements=CHUNK, host_budget=SMALL_HOST,
             states="int8")
    p0 = init_params(a, rng, shapes)
    grads = grads_for(rng, shapes, 5)
    run(a, grads[:3])
    path = str(tmp_path / "state.safetensors")
    a.save(path, {"note": "x"})
    run(a, grads[3:])
    # A fresh core with another chunk size and budget: the file is per tensor.
    b = core(tmp_path / "b", shapes, states="int8")
    assert b.load(path)["note"] == "x"
    assert b.step_count() == 3
    run(b, grads[3:])
    for x, y in zip(masters(a, len(shapes)), masters(b, len(shapes))):
        np.testing.assert_array_equal(x, y)
    assert AdamWCore.read_metadata(path)["note"] == "x"


def test_corrupt_checkpoint_is_refused_and_changes_nothing(tmp_path, rng):
    c = core(tmp_path)
    init_params(c, rng)
    run(c, grads_for(rng, SHAPES, 1))
    path = str(tmp_path / "s.safetensors")
    c.save(path)
    before = masters(c, len(SHAPES))
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(tidestore.TidestoreError, match="s.safetensors"):
        c.load(path)
    for x, y in zip(before, masters(c, len(SHAPES))):
        np.testing.assert_array_equal(x, y)


def test_bad_arguments_are_refused_naming_them(tmp_path, rng):
    with pytest.raises(tidestore.ConfigError, match="states"):
        core(tmp_path, states="fp8")
    with pytest.raises(tidestore.ConfigError, match="nvme_dir"):
        core(tmp_path, nvme_dir=str(tmp_path / "missing"))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(tidestore.ConfigError, match="not a directory"):
        core(tmp_path, nvme_dir=str(a_file))
    with pytest.raises(tidestore.ConfigError, match="host_budget"):
        core(tmp_path, spill_shapes(), chunk_elements=CHUNK, host_budget=4096)
    with pytest.raises(tidestore.ConfigError, match="chunk_elements"):
        core(tmp_path, spill_shapes(), chunk_elements=32768)
    with pytest.raises(tidestore.ConfigError, match="max_grad_norm"):
        core(tmp_path, overlap=True, max_grad_norm=1.0)
    with pytest.raises(tidestore.ConfigError, match="lr"):
        core(tmp_path, lr=-1.0)
    with pytest.raises(tidestore.ConfigError, match="no elements"):
        core(tmp_path, shapes=[[3, 0]])


def test_bad_buffers_are_refused_before_anything_changes(tmp_path, rng):
    c = core(tmp_path)
    p0 = init_params(c, rng)
    with pytest.raises(tidestore.ConfigError, match=r"param\.0.*bytes, expected"):
        c.put_grad(0, u8(np.zeros(5)), "float32")
    with pytest.raises(tidestore.ConfigError, match="uint8"):
        c.put_grad(0, np.zeros(SHAPES[0], np.float32), "float32")
    with pytest.raises(tidestore.ConfigError, match="dtype"):
        c.put_grad(0, u8(np.zeros(SHAPES[0])), "int32")
    with pytest.raises(tidestore.ConfigError, match="contiguous"):
        c.put_grad(0, np.zeros((64, 96 * 4), np.uint8)[:, ::2], "float32")
    ro = u8(np.zeros(SHAPES[0]))
    ro.flags.writeable = False
    with pytest.raises(tidestore.ConfigError, match="read-only"):
        c.read_param(0, ro, "float32")
    with pytest.raises(tidestore.ConfigError, match="out of range"):
        c.put_grad(99, u8(np.zeros(1)), "float32")
    assert c.reported() == 0
    with pytest.raises(tidestore.TidestoreError, match=r"param\.0"):
        c.step()
    np.testing.assert_array_equal(masters(c, 1)[0], p0[0].reshape(-1))
    c.put_grad(0, u8(np.zeros(SHAPES[0])), "float32")
    with pytest.raises(tidestore.TidestoreError, match="already given"):
        c.put_grad(0, u8(np.zeros(SHAPES[0])), "float32")
    with pytest.raises(tidestore.TidestoreError, match="step first"):
        c.save(str(tmp_path / "x.safetensors"))


def test_sync_param_replaces_the_master_only_when_values_differ(tmp_path, rng):
    c = core(tmp_path)
    p0 = init_params(c, rng)
    assert not c.sync_param(0, u8(p0[0]), "float32")
    bits = bf16_bits(p0[0])
    assert not c.sync_param(0, bits.reshape(-1).view(np.uint8), "bfloat16")
    np.testing.assert_array_equal(masters(c, 1)[0], p0[0].reshape(-1))
    assert c.sync_param(0, u8(p0[0] + 1), "float32")
    np.testing.assert_array_equal(masters(c, 1)[0], (p0[0] + 1).reshape(-1))


def test_importing_tidestore_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tidestore, tidestore.aio; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(__file__))
    assert out.stdout.strip() == "False"


def test_no_swap_file_outlives_the_process_however_it_ends(tmp_path, rng):
    """The swap file is unlinked as soon as the store has it open: the core spills
    through it with no name in nvme_dir, and a process that exits without any cleanup
    (os._exit) leaves nothing behind."""
    import subprocess
    import sys

    shapes = spill_shapes()
    c = core(tmp_path, shapes, chunk_elements=CHUNK, host_budget=SMALL_HOST)
    ps = init_params(c, rng, shapes)
    assert os.listdir(tmp_path) == []
    for i, p in enumerate(ps):
        c.put_grad(i, u8(np.ones_like(p)), "float32")
    c.step()
    assert c.stats()["nvme_read_bytes"] > 0, "the state did not spill"
    assert np.all(np.frombuffer(c.master(7), np.float32) != ps[7].ravel())

    (tmp_path / "killed").mkdir()
    code = (
        "import os, sys, numpy as np; from tidestore import AdamWCore\n"
        f"c = AdamWCore([[256, 256]] * 8, nvme_dir=sys.argv[1], host_budget={SMALL_HOST}, "
        f"chunk_elements={CHUNK}, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, "
        "states='fp32')\n"
        "for i in range(8): c.set_param(i, np.ones(65536, np.float32).view(np.uint8), 'float32')\n"
        "print(os.listdir(sys.argv[1]), flush=True); os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "killed")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert os.listdir(tmp_path / "killed") == []
