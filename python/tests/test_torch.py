"""tidestore.AdamW in PyTorch training loops.

Guards against: parameters that drift from torch.optim.AdamW (fp32, and bf16 parameters
against an fp32 master trained by torch); clipping that differs from
clip_grad_norm_; check_finite=False that steps otherwise than torch (a NaN gradient
included) or than the checked steps on finite gradients; overlap=True that is not bit-identical to overlap=False; a state_dict
that does not resume bit for bit or loads a file overwritten since; bad input (a
non-float or non-contiguous parameter, a parameter whose shape changed, a missing
gradient) that changes anything before it is refused; a CPU fp32 parameter bound to the
store's master copy that a step moves, that loses an edit, or that is left over freed
memory when the optimizer goes. Skipped, with the reason printed,
where torch is not installed (see .ci/python-tests.sh).
"""

import copy
import gc
import os
import pickle
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch-level tests need it")

import tidestore  # noqa: E402


def model(seed=0, dtype=torch.float32, hidden_layers=1):
    torch.manual_seed(seed)
    inner = [m for _ in range(hidden_layers) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())]
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), *inner, torch.nn.Linear(64, 4)).to(dtype)


def batches(n, dtype=torch.float32, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 4, generator=g).to(dtype))
            for _ in range(n)]


def train(m, opt, data, clip=None):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x).float(), y.float()).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()


def max_diff(a, b):
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize("states", ["fp32"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp32_matches_torch_adamw(tmp_path, clip, states):
    a, b = model(), model()
    data = batches(8)
    train(a, tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path, max_grad_norm=clip,
                             states=states), data)
    train(b, torch.optim.AdamW(b.parameters(), **HP, foreach=False), data, clip=clip)
    assert max_diff(a, b) < 2e-5


def test_bf16_params_match_an_fp32_master_trained_by_torch(tmp_path):
    """bf16 parameters: the core keeps an fp32 master; the reference is torch's AdamW on
    fp32 copies fed the same bf16 gradients, rounded to bf16 after each step."""
    a = model(dtype=torch.bfloat16)
    master = copy.deepcopy(a).float()
    opt_a = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path)
    opt_m = torch.optim.AdamW(master.parameters(), **HP, foreach=False)
    shadow = copy.deepcopy(a)
    for x, y in batches(5, torch.bfloat16):
        opt_a.zero_grad()
        torch.nn.functional.mse_loss(a(x).float(), y.float()).backward()
        shadow.load_state_dict(a.state_dict())
        for pm, pa in zip(master.parameters(), a.parameters()):
            pm.grad = pa.grad.float()
        opt_a.step()
        opt_m.step()
    for pa, pm in zip(a.parameters(), master.parameters()):
        assert pa.dtype == torch.bfloat16
        diff = (pa.float() - pm.to(torch.bfloat16).float()).abs()
        # Equal but for ties of rounding where the two fp32 masters differ in the last bits.
        assert (diff > 0).float().mean().item() < 0.01
        assert diff.max().item() <= 2 ** -7 * pm.abs().max().item()


def test_overlap_is_bit_identical(tmp_path):
    a, b = model(), model()
    data = batches(6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path / "a", chunk_elements=8192)
    ob = tidestore.AdamW(b.parameters(), **HP, nvme_dir=tmp_path / "b", chunk_elements=8192,
                         overlap=True)
    train(a, oa, data)
    train(b, ob, data)
    assert ob.stats()["tensors_overlapped"] > 0
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_without_the_finiteness_check_steps_are_torchs_nan_included(tmp_path):
    a, b, c = model(), model(), model()
    data = batches(4)
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path, check_finite=False)
    oc = tidestore.AdamW(c.parameters(), **HP, nvme_dir=tmp_path)
    ob = torch.optim.AdamW(b.parameters(), **HP, foreach=False)
    train(a, oa, data)
    train(b, ob, data)
    train(c, oc, data)
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q), "finite steps differ with and without the check"
    assert max_diff(a, b) < 2e-5
    assert oa.last_step[0] != oa.last_step[0], "a norm was reported (none is taken)"
    # A NaN in one gradient: applied, as torch applies it (the check would skip it).
    for m, o in ((a, oa), (b, ob), (c, oc)):
        o.zero_grad()
        x, y = data[0]
        torch.nn.functional.mse_loss(m(x), y).backward()
        m[0].weight.grad[3, 5] = float("nan")
        o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.isnan(), q.isnan())
    assert a[0].weight[3, 5].isnan() and not c[0].weight.isnan().any()
    with pytest.raises(tidestore.ConfigError, match="check_finite"):
        tidestore.AdamW(model().parameters(), max_grad_norm=1.0, check_finite=False)


def test_overlap_with_clipping_is_refused():
    m = model()
    with pytest.raises(tidestore.ConfigError, match="max_grad_norm"):
        tidestore.AdamW(m.parameters(), overlap=True, max_grad_norm=1.0)


# fp32 moments spill master, M and V at this budget; bf16 moments only on a deeper model
# (with overlap each gradient is stepped where torch holds it: the pool holds none).
@pytest.mark.parametrize("states,overlap,layers", [("fp32", False, 1), ("bf16", True, 6)])
def test_state_dict_round_trip_resumes_bit_identically(tmp_path, states, overlap, layers):
    data = batches(6)
    a = model(hidden_layers=layers)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path / "a", states=states,
                         host_budget="80KiB", chunk_elements=4096, overlap=overlap)
    train(a, oa, data[:3])
    assert oa.stats()["nvme_read_bytes"] > 0
    saved = {"model": copy.deepcopy(a.state_dict()), "optim": oa.state_dict()}
    torch.save(saved, tmp_path / "ckpt.pt")
    train(a, oa, data[3:])

    b = model(seed=99, hidden_layers=layers)
    ob = tidestore.AdamW(b.parameters(), **HP, nvme_dir=tmp_path / "b", states=states)
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    b.load_state_dict(loaded["model"])
    ob.load_state_dict(loaded["optim"])
    train(b, ob, data[3:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_state_dict_of_an_overwritten_file_is_refused(tmp_path):
    m = model()
    opt = tidestore.AdamW(m.parameters(), nvme_dir=tmp_path)
    train(m, opt, batches(1))
    sd = opt.state_dict()
    train(m, opt, batches(1))
    opt.state_dict()
    with pytest.raises(ValueError, match="overwritten"):
        opt.load_state_dict(sd)


def test_parameter_changed_outside_the_optimizer_is_taken(tmp_path):
    a, b = model(), model()
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path)
    ob = torch.optim.AdamW(b.parameters(), **HP, foreach=False)
    data = batches(4)
    train(a, oa, data[:2])
    train(b, ob, data[:2])
    fresh = model(seed=3).state_dict()
    a.load_state_dict(fresh)
    b.load_state_dict(fresh)
    train(a, oa, data[2:])
    train(b, ob, data[2:])
    assert max_diff(a, b) < 2e-5


def test_fp32_cpu_parameters_are_the_master_copy_in_ram(tmp_path):
    """Without a host budget a CPU fp32 parameter's memory is the store's master copy: a
    step changes it in place (no copy back), an edit of it is an edit of the master, a
    replaced .data is taken and bound again, and close() hands each parameter memory of
    its own with its values. With state on NVMe nothing is bound."""
    a, b = model(), model()
    before = [p.data_ptr() for p in a.parameters()]
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path)
    ob = torch.optim.AdamW(b.parameters(), **HP, foreach=False)
    bound = [p.data_ptr() for p in a.parameters()]
    assert all(x != y for x, y in zip(before, bound)), "no parameter was bound to the store"
    data = batches(6)
    train(a, oa, data[:2])
    train(b, ob, data[:2])
    assert [p.data_ptr() for p in a.parameters()] == bound, "a step moved a parameter"
    assert max_diff(a, b) < 2e-5
    with torch.no_grad():
        for m in (a, b):
            m[0].weight.mul_(0.5)  # in place: the master itself
            m[2].weight.data = torch.full_like(m[2].weight, 0.01)  # replaced
    train(a, oa, data[2:4])
    train(b, ob, data[2:4])
    assert a[0].weight.data_ptr() == bound[0]
    assert max_diff(a, b) < 2e-5
    rebound = a[2].weight.data_ptr()
    train(a, oa, data[4:])
    assert a[2].weight.data_ptr() == rebound, "the replaced parameter was not bound again"
    values = [p.detach().clone() for p in a.parameters()]
    oa.close()
    assert all(p.data_ptr() not in bound + [rebound] for p in a.parameters())
    assert all(torch.equal(p, v) for p, v in zip(a.parameters(), values))

    c = model()
    (tmp_path / "nvme").mkdir()
    before = [p.data_ptr() for p in c.parameters()]
    oc = tidestore.AdamW(c.parameters(), **HP, nvme_dir=tmp_path / "nvme", host_budget="80KiB",
                         chunk_elements=4096)
    train(c, oc, data[:1])
    assert [p.data_ptr() for p in c.parameters()] == before


def test_a_bound_parameter_outlives_its_optimizer():
    """Dropping the optimizer without close() leaves every parameter its values in memory
    of its own (the store's memory is not read after the store is gone)."""
    import gc

    a = model()
    opt = tidestore.AdamW(a.parameters(), **HP)
    train(a, opt, batches(2))
    values = [p.detach().clone() for p in a.parameters()]
    bound = [p.data_ptr() for p in a.parameters()]
    del opt
    gc.collect()
    assert all(p.data_ptr() not in bound for p in a.parameters())
    assert all(torch.equal(p, v) for p, v in zip(a.parameters(), values))


def test_lr_scheduler_changes_the_step(tmp_path):
    a, b = model(), model()
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path)
    ob = torch.optim.AdamW(b.parameters(), **HP, foreach=False)
    sa = torch.optim.lr_scheduler.StepLR(oa, 1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, 1, gamma=0.5)
    for batch in batches(4):
        train(a, oa, [batch])
        train(b, ob, [batch])
        sa.step()
        sb.step()
    assert max_diff(a, b) < 2e-5


def test_bad_parameters_are_refused(tmp_path):
    with pytest.raises(TypeError, match="parameter 0.*int64"):
        tidestore.AdamW([torch.zeros(3, dtype=torch.int64)], nvme_dir=tmp_path)
    nc = torch.randn(4, 3).t().detach().requires_grad_()
    with pytest.raises(ValueError, match="parameter 0.*not contiguous"):
        tidestore.AdamW([nc], nvme_dir=tmp_path)
    with pytest.raises(tidestore.ConfigError, match="nvme_dir"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path / "missing")
    with pytest.raises(tidestore.ConfigError, match="host_budget"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, host_budget="4KiB")
    with pytest.raises(ValueError, match="host_budget"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, host_budget="lots")
    m = model()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['weight_decay'\]"):
        tidestore.AdamW([{"params": m[0].parameters()},
                         {"params": m[2].parameters(), "weight_decay": 0.0}], nvme_dir=tmp_path)


def test_an_overlapped_step_without_a_gradient_does_not_leave_the_optimizer_stuck(tmp_path):
    """With overlap, a parameter that got no gradient is found at step(). Where nothing
    was stepped yet (here: no backward at all) the iteration is dropped and training goes
    on as if it had not been; where tensors were stepped during backward the step is half
    made: refused until a checkpoint is loaded, then training goes on."""
    data = batches(3)
    x, _ = data[0]
    ref = model()
    train(ref, tidestore.AdamW(ref.parameters(), **HP, nvme_dir=tmp_path), data)
    for partial, want in [(False, r"`param.0` was given.*abandoned"),
                          (True, r"`param.4` was given.*4 tensors were stepped.*checkpoint")]:
        m = model()
        opt = tidestore.AdamW(m.parameters(), **HP, nvme_dir=tmp_path, overlap=True)
        saved = opt.state_dict()
        if partial:
            m[2](torch.relu(m[0](x))).sum().backward()  # the last layer gets no gradient
        with pytest.raises(tidestore.TidestoreError, match=want):
            opt.step()
        opt.zero_grad()
        if partial:
            opt.load_state_dict(saved)
        train(m, opt, data)
        for p, q in zip(ref.parameters(), m.parameters()):
            assert torch.equal(p, q)


def test_shape_change_and_missing_grad_change_nothing(tmp_path):
    m = model()
    opt = tidestore.AdamW(m.parameters(), nvme_dir=tmp_path)
    train(m, opt, batches(1))
    before = [p.detach().clone() for p in m.parameters()]
    masters = [opt._core.master(i) for i in range(len(before))]
    x, y = batches(1)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    m[4].bias.grad = None
    with pytest.raises(ValueError, match="parameter 5.*no gradient"):
        opt.step()
    m[4].bias.grad = torch.zeros(4)
    with torch.no_grad():
        m[0].bias.data = torch.zeros(65)
    with pytest.raises(ValueError, match="parameter 1 changed shape"):
        opt.step()
    assert opt._core.reported() == 0
    assert [opt._core.master(i) for i in range(len(before))] == masters
    for p, q in zip(before[2:], list(m.parameters())[2:]):
        assert torch.equal(p, q)


def edit_hyper_params(opt, step):
    """Between steps, what torch users change in param_groups besides the lr."""
    g = opt.param_groups[0]
    if step == 1:
        g["weight_decay"] = 0.3
    elif step == 2:
        g["betas"] = (g["betas"][0], 0.95)
    elif step == 3:
        g["eps"] = 1e-3


def test_hyper_parameters_changed_between_steps_are_torchs(tmp_path):
    a, b = model(), model()
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path)
    ob = torch.optim.AdamW(b.parameters(), **HP, foreach=False)
    # OneCycleLR cycles beta1 with the lr.
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=8) for o in (oa, ob)]
    for k, batch in enumerate(batches(6)):
        for o in (oa, ob):
            edit_hyper_params(o, k)
        train(a, oa, [batch])
        train(b, ob, [batch])
        for s in scheds:
            s.step()
    assert oa.param_groups[0]["betas"][0] != HP["betas"][0]
    assert max_diff(a, b) < 2e-5


def test_load_state_dict_restores_every_hyper_parameter(tmp_path):
    a, b = model(), model()
    data = batches(4)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    oa = tidestore.AdamW(a.parameters(), **{**HP, "weight_decay": 0.0}, nvme_dir=tmp_path / "a")
    train(a, oa, data[:2])
    ob = tidestore.AdamW(b.parameters(), **HP, nvme_dir=tmp_path / "b")
    ob.load_state_dict(oa.state_dict())
    assert ob.param_groups[0]["weight_decay"] == 0.0
    train(a, oa, data[2:])
    train(b, ob, data[2:])
    assert max_diff(a, b) == 0


def test_what_a_store_cannot_do_is_refused(tmp_path):
    m = model()
    opt = tidestore.AdamW(m.parameters(), nvme_dir=tmp_path)
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        pickle.dumps(opt)
    w = m[0].weight
    with pytest.raises(ValueError, match="parameter 1 is parameter 0 again"):
        tidestore.AdamW([w, w], nvme_dir=tmp_path)
    # torch.optim.AdamW's keywords at their off values pass; others are refused.
    tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, amsgrad=False, maximize=False,
                    foreach=None, fused=False, capturable=False, differentiable=False).close()
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, amsgrad=True)
    with pytest.raises(TypeError, match="'nesterov'"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, nesterov=True)
    with pytest.raises(ValueError, match="threads: -1"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, threads=-1)
    with pytest.raises(ValueError, match="host_budget: 'inf'"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, host_budget="inf")
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] = '0.1'"):
        tidestore.AdamW(model().parameters(), nvme_dir=tmp_path, lr="0.1")
    opt.close()
    with pytest.raises(tidestore.TidestoreError, match="used after close"):
        opt.stats()


def test_an_overlapped_optimizer_goes_with_its_hooks(tmp_path):
    a = model()
    oa = tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path, overlap=True)
    train(a, oa, batches(1))
    gone = weakref.ref(oa)
    del oa
    gc.collect()
    assert gone() is None
    # Its hooks went with it: another optimizer trains the model as torch does.
    b = copy.deepcopy(a)
    data = batches(2, seed=3)
    train(a, tidestore.AdamW(a.parameters(), **HP, nvme_dir=tmp_path, overlap=True), data)
    train(b, torch.optim.AdamW(b.parameters(), **HP, foreach=False), data)
    assert max_diff(a, b) < 2e-5


def test_a_state_dict_outlives_an_optimizer_in_a_temporary_dir():
    a, b = model(), model(seed=1)
    oa = tidestore.AdamW(a.parameters(), **HP)  # no nvme_dir: a temporary one
    train(a, oa, batches(2))
    sd = oa.state_dict()
    nvme_dir = oa.nvme_dir
    del oa
    gc.collect()
    assert not os.path.exists(nvme_dir)
    try:
        tidestore.AdamW(b.parameters(), **HP).load_state_dict(sd)
        assert max_diff(a, b) == 0
    finally:
        os.remove(sd["tidestore"]["path"])
