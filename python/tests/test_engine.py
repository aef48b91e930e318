"""tidestore.offload: whole torch models trained out of the store.

Guards against: losses that drift from plain torch with torch.optim.AdamW (fp32, 10
steps; the weights streamed from NVMe with a host budget below them; with and without
overlap and activation checkpointing; tied embeddings; frozen parameters; gradient
accumulation); a model directory imported otherwise than transformers loads it;
parameters left bound (held by the store) after a step; and bad input (a parameter
added or replaced after the hand-over, a step before the backward passes it was set up
for) that is not refused with an error naming it. Skipped, with the reason printed,
where torch or transformers is not installed (see .ci/python-tests.sh).
"""

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch-level tests need it")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the engine's model tests need it")

import tidestore  # noqa: E402
from conftest import checkpointing_on  # noqa: E402

VOCAB = 128


def llama(tie=False, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def init_model_llama():
    """The shape `tidestore init-model` writes by default (4 layers, hidden 256, GQA 8/4
    heads, vocab 512): the README example's model, random."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


def torch_losses(model, steps, accumulation=1, lr=1e-3, wd=0.01):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=False)
    return losses(model, opt, steps, accumulation)


def engine_losses(model, opt, steps, accumulation=1):
    return losses(model, opt, steps, accumulation, model.tidestore_engine)


def losses(model, opt, steps, accumulation, engine=None):
    """Per-step losses of `steps` steps of `accumulation` micro-batches; with an engine,
    each step must leave no parameter held."""
    out = []
    data = batches(steps * accumulation)
    for s in range(steps):
        total = 0.0
        for ids in data[s * accumulation:(s + 1) * accumulation]:
            loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if engine is not None:
            assert engine.core.held() == [], "a parameter left held"
        out.append(total)
    return out


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(x), f"step {i + 1}: torch {x}, tidestore {y}"


# 2.75 MB of chunks in all for this model; 768 KiB leaves most of them on NVMe.
HOST = 768 * 1024


@pytest.mark.parametrize("overlap", [False, True, "forward"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_losses_equal_torch_with_the_weights_streamed_from_nvme(overlap, checkpointing, tmp_path):
    base = llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    if checkpointing:
        checkpointing_on(ref)
        checkpointing_on(mine)
    want = torch_losses(ref, 10)
    mine, opt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, chunk_elements=16384,
                                  host_budget=HOST, overlap=overlap, nvme_dir=tmp_path)
    # A host budget below the state: every gradient goes into the store as it comes
    # (kept to the step they would be memory the budget does not have).
    assert not mine.tidestore_engine.core.reads_given()
    got = engine_losses(mine, opt, 10)
    assert_close(want, got)
    stats = mine.tidestore_engine.core.stats()
    assert stats["nvme_read_bytes"] > 0, "the weights never left RAM"
    if overlap is True:
        assert stats["tensors_overlapped"] > 0
    if overlap == "forward":
        assert stats["tensors_deferred"] > 0
        assert mine.tidestore_engine.core.overlap == "forward"


def test_in_ram_kept_gradients_and_overlapped_steps_equal_torch_and_each_other(tmp_path):
    """Every chunk in RAM: without overlap torch's gradients are kept to the step and
    read there; with overlap they are put as they come and each group stepped when
    complete. Both equal torch, and each other to the bit."""
    base = llama()
    want = torch_losses(copy.deepcopy(base), 10)
    runs = {}
    for overlap in (False, True):
        mine, opt = tidestore.offload(copy.deepcopy(base), lr=1e-3, weight_decay=0.01,
                                      chunk_elements=16384, overlap=overlap, nvme_dir=tmp_path)
        eng = mine.tidestore_engine
        assert eng.core.reads_given() and (eng._given is None) == overlap
        got = engine_losses(mine, opt, 10)
        assert_close(want, got)
        stats = eng.core.stats()
        assert stats["nvme_read_bytes"] == 0
        assert (stats["tensors_overlapped"] > 0) == overlap
        runs[overlap] = (got, [eng.values(i) for i in range(len(eng.names))])
    assert runs[False][0] == runs[True][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))


def test_stepping_in_the_next_forward_clips_bit_for_bit_as_after_backward(tmp_path):
    """overlap="forward" with clipping (every step clipped), a tied embedding and two
    micro-batches per step: the same losses and weights as overlap="off", bit for bit;
    the last step's updates are made when the weights are read."""
    base = llama(tie=True)
    runs = {}
    for overlap in ("off", "forward"):
        model, opt = tidestore.offload(
            copy.deepcopy(base), lr=1e-3, weight_decay=0.01, chunk_elements=16384,
            host_budget=HOST, max_grad_norm=0.05, accumulation=2, overlap=overlap,
            nvme_dir=tmp_path)
        got = engine_losses(model, opt, 4, accumulation=2)
        eng = model.tidestore_engine
        deferred = eng.core.stats()["tensors_deferred"]
        weights = [eng.values(i).clone() for i in range(len(eng.names))]
        runs[overlap] = (got, weights, deferred)
    (off, w_off, d_off), (fwd, w_fwd, d_fwd) = runs["off"], runs["forward"]
    assert off == fwd, f"off {off}, forward {fwd}"
    assert all(torch.equal(a, b) for a, b in zip(w_off, w_fwd)), "weights differ"
    assert d_off == 0 and d_fwd > 0, (d_off, d_fwd)


def test_an_unknown_overlap_is_refused(tmp_path):
    with pytest.raises(ValueError, match="overlap"):
        tidestore.offload(llama(), overlap="sideways", nvme_dir=tmp_path)


@pytest.mark.parametrize("bad", [-1, 1025, 2.0, True])
def test_a_collectives_ahead_out_of_range_is_refused_by_both_engines(bad, tmp_path):
    with pytest.raises(ValueError, match=f"collectives_ahead: {bad!r} is not a whole number"):
        tidestore.offload(llama(), collectives_ahead=bad, nvme_dir=tmp_path)
    with pytest.raises(ValueError, match=f"collectives_ahead: {bad!r} is not a whole number"):
        tidestore.AdamW(llama().parameters(), collectives_ahead=bad, nvme_dir=tmp_path)


def test_a_config_files_overlap_during_backward_is_refused_with_accumulation(tmp_path):
    # The file's overlap decides, not the keyword's (which is not read with a config).
    cfg = tmp_path / "overlap.toml"
    cfg.write_text('[optimizer]\noverlap = "backward"\nmax_grad_norm = 0\n'
                   f'[nvme]\ndir = "{tmp_path}"\n'
                   '[device]\nbudget = "16MiB"\n[host]\nbudget = "64MiB"\n')
    with pytest.raises(ValueError, match="accumulation=1"):
        tidestore.offload(llama(), config=cfg, accumulation=2)
    tidestore.offload(llama(), config=cfg, accumulation=1)


def test_a_config_files_gpu_is_its_ordinal_or_the_ranks_local_one(tmp_path):
    # device.ordinal = "auto" follows the rank's GPU (torch's current device under a
    # process group); a number in the file wins. The simulated device opens no GPU, so
    # this holds on a machine without one.
    from tidestore._tidestore import EngineCore
    specs = [("w", [4, 4], True)]

    def core(ordinal, **kw):
        cfg = tmp_path / f"gpu-{ordinal}.toml"
        cfg.write_text(f'[nvme]\ndir = "{tmp_path}"\n[device]\nkind = "sim"\n'
                       f'budget = "16MiB"\nordinal = {ordinal}\n[host]\nbudget = "64MiB"\n')
        return EngineCore(specs, config=str(cfg), **kw)

    assert core('"auto"').gpu_ordinal == 0
    assert core('"auto"', local_gpu=3).gpu_ordinal == 3
    assert core("1", local_gpu=3).gpu_ordinal == 1
    with pytest.raises(ValueError, match="device.ordinal"):
        core("-1")


def test_ranks_compute_on_the_cpu_whatever_the_config_file_says(tmp_path):
    """Under a process group (``cpu_only``) a config file's ``device.kind = "auto"``
    opens no GPU, even on a machine with one, and ``"cuda"`` is refused by key."""
    from tidestore._tidestore import EngineCore

    def core(kind):
        cfg = tmp_path / f"{kind}.toml"
        cfg.write_text(f'[nvme]\ndir = "{tmp_path}"\n[device]\nkind = "{kind}"\n'
                       'budget = "16MiB"\n[host]\nbudget = "64MiB"\n')
        return EngineCore([("w", [4, 4], True)], config=str(cfg), cpu_only=True)

    assert core("auto").gpu is None
    assert core("sim").gpu is None
    with pytest.raises(tidestore.ConfigError, match=r"device\.kind.*process group"):
        core("cuda")


def test_tied_embeddings_and_accumulation(tmp_path):
    base = llama(tie=True)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    want = torch_losses(ref, 5, accumulation=2)
    mine, opt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, chunk_elements=16384,
                                  host_budget=HOST, accumulation=2, nvme_dir=tmp_path)
    assert len(mine.tidestore_engine.params) == len(list(base.parameters()))
    assert_close(want, engine_losses(mine, opt, 5, accumulation=2))


def test_frozen_parameters_are_served_and_not_stepped(tmp_path):
    base = llama()
    for n, p in base.named_parameters():
        p.requires_grad_("mlp" in n)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3,
                                weight_decay=0.01, foreach=False)
    mine, opt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, chunk_elements=16384,
                                  host_budget=HOST, nvme_dir=tmp_path)
    for ids in batches(4):
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = mine(input_ids=ids, labels=ids).loss
        got.backward()
        opt.step()
        assert abs(want.item() - got.item()) <= 1e-5 * abs(want.item())
    eng = mine.tidestore_engine
    for i, n in enumerate(eng.names):
        if n in frozen:
            assert torch.equal(eng.values(i), frozen[n]), n


def test_a_model_directory_is_imported_as_transformers_loads_it(tmp_path):
    base = llama()
    base.save_pretrained(tmp_path / "model")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    want = torch_losses(ref, 3)
    mine, opt = tidestore.offload(tmp_path / "model", lr=1e-3, weight_decay=0.01,
                                  chunk_elements=16384, nvme_dir=tmp_path)
    # Every chunk in RAM: torch's gradients are kept to the step and read there.
    assert mine.tidestore_engine.core.reads_given()
    assert_close(want, engine_losses(mine, opt, 3))


def test_parameters_are_bound_only_while_their_module_runs(tmp_path):
    mine, _ = tidestore.offload(llama(), chunk_elements=16384, nvme_dir=tmp_path)
    w = mine.model.layers[0].mlp.up_proj.weight
    assert w.shape == (128, 64), "the shape stays the parameter's"
    assert w.stride() == (0, 0), "no memory of its own outside the forward"
    seen = []
    # Runs after the engine's own pre-hook, which binds the weight.
    mine.model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda m, a: seen.append((m.weight.stride(), m.weight.abs().sum().item())))
    with torch.no_grad():
        mine(input_ids=batches(1)[0])
    assert seen[0][0] == (64, 1) and seen[0][1] > 0, "bound to the store's values while it runs"
    assert mine.tidestore_engine.core.held() == []


def test_a_changed_model_is_refused_naming_the_parameter(tmp_path):
    mine, opt = tidestore.offload(llama(), chunk_elements=16384, nvme_dir=tmp_path)
    mine.model.layers[0].mlp.extra = torch.nn.Linear(4, 4)
    with pytest.raises(tidestore.TidestoreError, match="model.layers.0.mlp.extra.weight"):
        mine(input_ids=batches(1)[0])
    del mine.model.layers[0].mlp.extra
    mine.model.norm.weight = torch.nn.Parameter(torch.ones(64))
    with pytest.raises(tidestore.TidestoreError, match="changed"):
        mine(input_ids=batches(1)[0])


class _ReadsAChildsWeight(torch.nn.Module):
    """Uses its embedding's weight as the head in its own forward, outside the
    embedding module: the read the engine cannot bind."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, ids):
        return self.mix(self.embed(ids)) @ self.embed.weight.T


def test_a_parameter_used_outside_its_modules_forward_is_refused_by_name(tmp_path):
    model, _ = tidestore.offload(_ReadsAChildsWeight(), chunk_elements=16384,
                                 nvme_dir=tmp_path)
    ids = batches(1)[0]
    with pytest.raises(tidestore.TidestoreError, match=r"`embed.weight` used outside the "
                       r"forward of its module `embed`"):
        model(ids)
    mine, opt = tidestore.offload(llama(), chunk_elements=16384, nvme_dir=tmp_path)
    w = mine.model.layers[0].mlp.up_proj.weight
    # What reads no value passes: the shape, dtype, strides, no gradient.
    assert (w.shape, w.dtype, w.stride(), w.grad, w.numel()) == ((128, 64), torch.float32,
                                                                  (0, 0), None, 128 * 64)
    loss = mine(input_ids=ids, labels=ids).loss
    with pytest.raises(tidestore.TidestoreError, match=r"`model.embed_tokens.weight` used "
                       r"outside the forward of its module `model.embed_tokens` \(`pow`\)"):
        loss + sum(p.pow(2).sum() for p in mine.parameters())  # a regulariser after forward
    with pytest.raises(tidestore.TidestoreError, match="up_proj.weight"):
        copy.deepcopy(w)
    with pytest.raises(tidestore.TidestoreError, match="cannot be copied or pickled"):
        copy.deepcopy(mine)
    with pytest.raises(tidestore.TidestoreError, match="set_values"):
        w.data = torch.zeros(128, 64)
    with pytest.raises(tidestore.TidestoreError, match="up_proj.weight"):
        w.data.normal_()
    # Nothing was lost: the same loss backs and steps, and the next forward runs.
    loss.backward()
    opt.step()
    assert torch.isfinite(mine(input_ids=ids, labels=ids).loss)


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, use_b):
        return self.b(self.a(x)) if use_b else self.a(x)


def test_a_step_without_a_parameters_gradient_names_it_and_training_goes_on(tmp_path):
    model, opt = tidestore.offload(_Branches(), chunk_elements=16384, nvme_dir=tmp_path)
    x = torch.randn(4, 8)
    model(x, False).sum().backward()
    with pytest.raises(tidestore.TidestoreError, match=r"`b.weight` was given.*freeze"):
        opt.step()
    for _ in range(2):  # not stuck: the next iterations step
        model(x, True).sum().backward()
        opt.step()
    assert model.tidestore_engine.core.step_count() == 2


def test_without_a_device_budget_modules_are_bound_in_the_host_pool(tmp_path):
    """The README's call (a host budget, no device budget, chunks searched) with
    activation checkpointing: nothing stands in for a GPU, so no device working set has
    to fit (a 4-chunk stand-in refused the recompute's at the first backward)."""
    base = init_model_llama()
    ref = copy.deepcopy(base)
    checkpointing_on(ref)
    want = torch_losses(ref, 3)
    mine, opt = tidestore.offload(base, lr=1e-3, weight_decay=0.01, host_budget="1GiB",
                                  nvme_dir=tmp_path)
    checkpointing_on(mine)
    assert_close(want, engine_losses(mine, opt, 3))


def test_a_budget_a_moment_cannot_fit_names_the_module_and_parameter(tmp_path):
    """A simulated device of 4 chunks opens (it holds the layout's working set) but the
    checkpointed recompute needs more at once: the store's refusal says which module's
    parameter was being bound."""
    mine, _ = tidestore.offload(init_model_llama(), host_budget="1GiB",
                                device_budget=4 * 196608 * 4, chunk_elements=196608,
                                nvme_dir=tmp_path)
    checkpointing_on(mine)
    ids = batches(1)[0]
    with pytest.raises(tidestore.TidestoreError, match=r"binding parameter `model\.layers\.0\."
                       r"mlp\.\w+\.weight` of module `model\.layers\.0\.mlp\.\w+`: moment \d+: "
                       r"the chunks needed together take \d+ bytes but the tier holds"):
        mine(input_ids=ids, labels=ids).loss.backward()


def test_a_step_before_the_backward_passes_is_refused(tmp_path):
    mine, opt = tidestore.offload(llama(), accumulation=2, chunk_elements=16384,
                                  nvme_dir=tmp_path)
    ids = batches(1)[0]
    mine(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(tidestore.TidestoreError, match="accumulation=2"):
        opt.step()


def test_bad_settings_are_config_errors(tmp_path):
    with pytest.raises(tidestore.ConfigError, match="precision"):
        tidestore.offload(llama(), precision="fp8", nvme_dir=tmp_path)
    with pytest.raises(tidestore.ConfigError, match="chunk_elements"):
        tidestore.offload(llama(), chunk_elements=1000, nvme_dir=tmp_path)
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[optimizer]\nlr = -1\nbogus = 1\n")
    with pytest.raises(tidestore.ConfigError, match="bogus"):
        tidestore.offload(llama(), config=cfg)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_parameters_equal_a_torch_mixed_precision_loop(checkpointing, tmp_path):
    base = llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    if checkpointing:
        checkpointing_on(ref)
        checkpointing_on(mine)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    # torch's side of the same mixed precision: bf16 weights compute, an fp32 master
    # copy takes the widened bf16 gradients and is stepped, the weights are its rounding.
    master = [p.detach().float().clone().requires_grad_() for p in base.parameters()]
    opt_ref = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.01, foreach=False)
    mine, opt = tidestore.offload(mine, precision="bf16", lr=1e-3, weight_decay=0.01,
                                  chunk_elements=16384, host_budget=HOST, nvme_dir=tmp_path)
    for ids in batches(10):
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        for m, p in zip(master, ref.parameters()):
            m.grad, p.grad = p.grad.float(), None
        opt_ref.step()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters()):
                p.copy_(m.to(torch.bfloat16))
        got = mine(input_ids=ids, labels=ids).loss
        got.backward()
        opt.step()
        assert abs(want.item() - got.item()) <= 1e-3 * abs(want.item())
    w = mine.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16, "bound in the store's bf16"


def test_a_peft_lora_model_equals_torch(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed: the LoRA test needs it")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    base = peft.get_peft_model(llama(), lora)
    # B starts at zero; give it values so the adapters change the losses from step 1.
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3,
                                weight_decay=0.01, foreach=False)
    mine, opt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, chunk_elements=16384,
                                  host_budget=HOST, nvme_dir=tmp_path)
    core = mine.tidestore_engine.core
    assert sum(core.spec(i)[2] for i in range(len(core))) == 8, "A and B of 2 x 2 layers"
    for ids in batches(10):
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = mine(input_ids=ids, labels=ids).loss
        got.backward()
        opt.step()
        assert abs(want.item() - got.item()) <= 1e-5 * abs(want.item())


def test_transformers_trainer_runs_with_the_engines_optimizer(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed: Trainer needs it")
    mine, opt = tidestore.offload(llama(), lr=1e-3, chunk_elements=16384, nvme_dir=tmp_path)
    data = [{"input_ids": x, "labels": x} for x in torch.cat(batches(6))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
        logging_steps=1, report_to=[], max_grad_norm=0.0, use_cpu=True, save_strategy="no")
    trainer = transformers.Trainer(model=mine, args=args, train_dataset=data,
                                   optimizers=(opt, None))
    trainer.train()
    assert mine.tidestore_engine.core.step_count() == 3
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(4.0 < x < 5.5 for x in losses), losses
    # Trainer's linear schedule reached the optimizer the store reads its rate from.
    assert opt.param_groups[0]["lr"] < 1e-3


def test_save_pretrained_writes_what_transformers_loads(tmp_path):
    base = llama()
    mine, opt = tidestore.offload(copy.deepcopy(base), lr=1e-3, chunk_elements=16384,
                                  nvme_dir=tmp_path)
    engine_losses(mine, opt, 2)
    mine.save_pretrained(tmp_path / "out", dtype=torch.float32)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    eng = mine.tidestore_engine
    for i, (n, p) in enumerate(back.named_parameters()):
        assert n == eng.names[i]
        assert torch.equal(p.detach(), eng.values(i)), n
    assert not torch.equal(back.model.norm.weight, base.model.norm.weight), "trained"
    ids = batches(1)[0]
    assert mine.state_dict()["model.norm.weight"].isfinite().all()
    with torch.no_grad():
        a, b = mine(input_ids=ids).logits, back(input_ids=ids).logits
    assert torch.equal(a, b)


def test_a_module_that_keeps_its_weight_is_refused_naming_it(tmp_path):
    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 4))
            self.kept = None

        def forward(self, x):
            self.kept = self.weight.t()
            return x @ self.kept

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Keeps())
    model, _ = tidestore.offload(model, nvme_dir=tmp_path)
    with pytest.raises(tidestore.TidestoreError, match=r"module `1` keeps a tensor over "
                                                       r"parameter `1.weight`"):
        model(torch.randn(2, 4))


def test_converting_a_handed_over_model_is_refused(tmp_path):
    mine, _ = tidestore.offload(llama(), chunk_elements=16384, nvme_dir=tmp_path)
    assert mine.to("cpu") is mine, "a conversion that changes nothing passes"
    with pytest.raises(tidestore.TidestoreError, match="model.embed_tokens.weight"):
        mine.to(torch.float16)
    with pytest.raises(tidestore.TidestoreError, match="live in the store"):
        mine.to("meta")


def test_hyper_parameters_changed_between_steps_are_torchs(tmp_path):
    base = llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    mine, mopt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, nvme_dir=tmp_path)

    def edit(opt, k):
        g = opt.param_groups[0]
        g["weight_decay"], g["eps"] = (0.2, 1e-4) if k >= 2 else (0.01, 1e-8)

    got = [step_losses(model, opt, batches(5), lambda m, ids: m(input_ids=ids, labels=ids).loss,
                       edit, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1e-2, total_steps=8))
           for model, opt in ((ref, ropt), (mine, mopt))]  # OneCycleLR cycles beta1 too
    assert_close(*got)
    assert mine.tidestore_engine.core.hyper_params()["weight_decay"] == pytest.approx(0.2)


def step_losses(model, opt, data, loss_of, before=None, scheduler=None):
    """The losses of one step per batch; ``before(opt, k)`` runs before step k's forward,
    a scheduler made by ``scheduler(opt)`` steps after each step."""
    sched = scheduler(opt) if scheduler else None
    out = []
    for k, batch in enumerate(data):
        if before:
            before(opt, k)
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        out.append(loss.item())
    return out


class ScaledHead(torch.nn.Module):
    """A one-output head (bias of shape (1,)) and a 0-dim parameter of the root."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.out(torch.tanh(self.body(x))) * self.scale


def test_one_element_dimensions_and_scalars_train_as_torch(tmp_path):
    ref, mine = ScaledHead(), ScaledHead()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    mine, mopt = tidestore.offload(mine, lr=1e-2, nvme_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    got = [step_losses(model, opt, data, lambda m, xy: torch.nn.functional.mse_loss(m(xy[0]), xy[1]))
           for model, opt in ((ref, ropt), (mine, mopt))]
    assert_close(*got)


def test_a_forward_that_raised_leaves_training_as_torchs(tmp_path):
    base = llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    want = torch_losses(ref, 3)
    mine, opt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, nvme_dir=tmp_path)
    with pytest.raises(IndexError):
        mine(input_ids=torch.full((2, 16), VOCAB + 5))  # a token id past the vocabulary
    assert_close(want, engine_losses(mine, opt, 3))


def test_what_the_engine_cannot_do_is_refused(tmp_path):
    mine, opt = tidestore.offload(llama(), lr=1e-3, nvme_dir=tmp_path)
    with pytest.raises(ValueError, match="already handed to tidestore"):
        tidestore.offload(mine, nvme_dir=tmp_path)
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        copy.deepcopy(opt)
    with pytest.raises(ValueError, match="accumulation: 2.5"):
        tidestore.offload(llama(), nvme_dir=tmp_path, accumulation=2.5)
    with pytest.raises(ValueError, match="maximize=True is not supported"):
        tidestore.offload(llama(), nvme_dir=tmp_path, maximize=True)
    engine_losses(mine, opt, 1)
    first = opt.state_dict()
    engine_losses(mine, opt, 1)
    second = opt.state_dict()  # the same file, a later step
    with pytest.raises(ValueError, match="overwritten by a later save"):
        opt.load_state_dict(first)
    with pytest.raises(ValueError, match="offloaded model's state cannot be loaded"):
        tidestore.AdamW(llama().parameters(), nvme_dir=tmp_path).load_state_dict(second)
    engine = mine.tidestore_engine
    engine.set_values("model.norm.weight", torch.full((64,), 0.5))
    assert torch.equal(engine.values(engine.names.index("model.norm.weight")),
                       torch.full((64,), 0.5))
    with pytest.raises(ValueError, match="shape"):
        engine.set_values("model.norm.weight", torch.ones(3))
    adamw_state = tidestore.AdamW(llama().parameters(), nvme_dir=tmp_path).state_dict()
    with pytest.raises(ValueError, match="not an offloaded model's optimizer state"):
        opt.load_state_dict(adamw_state)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_backward_beyond_the_accumulation_is_refused_and_the_step_goes_on(checkpointing, tmp_path):
    base = llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    want = torch_losses(ref, 3)
    mine, opt = tidestore.offload(mine, lr=1e-3, weight_decay=0.01, nvme_dir=tmp_path)
    if checkpointing:
        checkpointing_on(mine)
    ids = batches(1)[0]
    first = mine(input_ids=ids, labels=ids).loss
    first.backward()
    with pytest.raises(tidestore.TidestoreError, match="beyond accumulation=1"):
        mine(input_ids=ids, labels=ids).loss.backward()  # once stuck for good after this
    opt.step()
    opt.zero_grad()
    assert mine.tidestore_engine.core.held() == []
    rest = step_losses(mine, opt, batches(3)[1:], lambda m, ids: m(input_ids=ids, labels=ids).loss)
    assert_close(want, [first.item()] + rest)


def test_engines_without_an_nvme_dir_keep_their_checkpoints_apart():
    (_, a), (_, b) = tidestore.offload(llama()), tidestore.offload(llama(seed=1))
    assert a.checkpoint_path != b.checkpoint_path


def test_where_the_model_computes_is_the_cpu_or_a_gpu_the_store_opens(tmp_path):
    """``device=`` names the CPU (the default) or a CUDA GPU torch sees; with a config
    file the file's ``[device]`` decides. Each refusal comes before the model is touched
    (its parameters keep their values, no engine is attached)."""
    model = llama()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="neither the CPU nor a CUDA GPU"):
        tidestore.offload(model, device="meta", nvme_dir=tmp_path)
    with pytest.raises(ValueError, match="not a torch device"):
        tidestore.offload(model, device="gpu0", nvme_dir=tmp_path)
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[nvme]\ndir = "{tmp_path}"\n')
    with pytest.raises(ValueError, match=r"the file's \[device\] decides"):
        tidestore.offload(model, config=cfg, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(tidestore.TidestoreError, match="torch sees no CUDA GPU"):
            tidestore.offload(model, device="cuda", nvme_dir=tmp_path)
    assert not hasattr(model, "tidestore_engine")
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    want = torch_losses(copy.deepcopy(model), 2)
    mine, opt = tidestore.offload(model, device=torch.device("cpu"), lr=1e-3,
                                  weight_decay=0.01, nvme_dir=tmp_path)
    assert mine.tidestore_engine.device == torch.device("cpu")
    assert mine.tidestore_engine.core.gpu is None
    assert_close(want, engine_losses(mine, opt, 2))


def test_a_refused_hand_over_leaves_no_directory_behind():
    import glob
    import os
    import tempfile

    made = os.path.join(tempfile.gettempdir(), "tidestore-engine-*")
    before = set(glob.glob(made))
    with pytest.raises(tidestore.ConfigError, match="chunk_elements"):
        tidestore.offload(llama(), chunk_elements=1000)
    assert set(glob.glob(made)) <= before


def run_with_a_raising_backward(model, opt, data, accumulation, bad_step, engine=None):
    """Per-step losses, where the last backward pass of step ``bad_step`` raises half
    way (a hook on the first layer's MLP): the user catches it, zeroes the gradients
    and goes on to the next step's batches (that step's loss is None)."""
    out = []
    for s in range(len(data) // accumulation):
        total = 0.0
        try:
            for k, ids in enumerate(data[s * accumulation:(s + 1) * accumulation]):
                hook = None
                if s == bad_step and k == accumulation - 1:
                    def fail(module, grad_output):
                        raise RuntimeError("a bad batch")
                    inner = model.model if hasattr(model, "model") else model
                    hook = inner.layers[0].mlp.register_full_backward_pre_hook(fail)
                try:
                    loss = model(input_ids=ids, labels=ids).loss / accumulation
                    loss.backward()
                finally:
                    if hook is not None:
                        hook.remove()
                total += loss.item()
            opt.step()
            out.append(total)
        except RuntimeError as e:
            assert "a bad batch" in str(e)
            out.append(None)
        opt.zero_grad()
        if engine is not None and s != bad_step:
            assert engine.core.held() == [], "a parameter left held"
    return out


@pytest.mark.parametrize("accumulation,overlap", [(1, False), (2, False), (1, "forward")])
def test_a_backward_that_raised_drops_its_iteration_and_training_goes_on(
        accumulation, overlap, tmp_path):
    """The gradients a raised backward (and the accumulation's passes before it) put
    into the store are dropped with the iteration at the next forward; the losses go on
    as torch's do when that step's batches are skipped, with the weights streamed from
    NVMe (with ``overlap="forward"`` the last step's groups, stepped in the raised
    pass's forward, stay stepped)."""
    base = llama()
    data = batches(4 * accumulation)
    ref = copy.deepcopy(base)
    want = run_with_a_raising_backward(
        ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False),
        data, accumulation, 1)
    mine, opt = tidestore.offload(copy.deepcopy(base), lr=1e-3, weight_decay=0.01,
                                  chunk_elements=16384, host_budget=HOST, overlap=overlap,
                                  accumulation=accumulation, nvme_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="backward pass raised"):
        got = run_with_a_raising_backward(mine, opt, data, accumulation, 1,
                                          mine.tidestore_engine)
    assert want[1] is None and got[1] is None
    assert_close([x for x in want if x is not None], [x for x in got if x is not None])


def test_after_a_raised_backward_bf16_weights_are_weights_and_a_step_is_refused(tmp_path):
    """bf16: gradients are written over the weights' 16-bit copy; a raised backward's
    are undone from the master (the same batch gives the same loss again). A step right
    after it is refused by name, and the iteration after that trains."""
    mine, opt = tidestore.offload(llama(), precision="bf16", chunk_elements=16384,
                                  nvme_dir=tmp_path)
    ids = batches(1)[0]
    with torch.no_grad():
        before = mine(input_ids=ids, labels=ids).loss.item()
    hook = mine.model.layers[0].mlp.register_full_backward_pre_hook(
        lambda m, g: (_ for _ in ()).throw(RuntimeError("a bad batch")))
    with pytest.raises(RuntimeError, match="a bad batch"):
        mine(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    with pytest.raises(tidestore.TidestoreError, match="backward pass that raised"):
        opt.step()
    with torch.no_grad():
        assert mine(input_ids=ids, labels=ids).loss.item() == before
    mine(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert mine.tidestore_engine.core.step_count() == 1


def test_a_backward_that_raised_after_overlapped_steps_stops_until_a_checkpoint_loads(
        tmp_path):
    """With ``overlap=True`` groups are stepped during backward: a pass that raised after
    some were leaves the step half made. The next forward says so (nothing trains on
    half-stepped weights); loading the last checkpoint goes on from before it, as torch
    does when that step's batch is skipped."""
    base = llama()
    data = batches(4)
    ref = copy.deepcopy(base)
    want = run_with_a_raising_backward(
        ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False),
        data, 1, 1)
    mine, opt = tidestore.offload(copy.deepcopy(base), lr=1e-3, weight_decay=0.01,
                                  chunk_elements=16384, overlap=True, nvme_dir=tmp_path)
    got = run_with_a_raising_backward(mine, opt, data[:1], 1, None, mine.tidestore_engine)
    saved = opt.state_dict()
    assert run_with_a_raising_backward(mine, opt, data[1:2], 1, 0) == [None]
    with pytest.raises(tidestore.TidestoreError, match="stepped during backward"):
        mine(input_ids=data[2], labels=data[2])
    opt.load_state_dict(saved)
    got += [None] + run_with_a_raising_backward(mine, opt, data[2:], 1, None,
                                                mine.tidestore_engine)
    assert_close([x for x in want if x is not None], [x for x in got if x is not None])
