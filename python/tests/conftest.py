"""Shared helpers of the tidestore Python tests."""

import numpy as np
import pytest


def u8(a, dtype=np.float32):
    """A flat uint8 view of `a` as `dtype` (what the core takes)."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1).view(np.uint8)


def bf16_bits(a):
    """float32 values rounded to bf16 (nearest even), as uint16 bits."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def checkpointing_on(model):
    """transformers' activation checkpointing, by its 5.x name where the model has it
    (4.x's `gradient_checkpointing_enable` is a deprecated alias there)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


def adamw_reference(p0, grads, lr, betas, eps, wd, max_grad_norm=None):
    """torch.optim.AdamW's update in float64, over a list of parameters and a list of
    per-step gradient lists; global-norm clipping as torch.nn.utils.clip_grad_norm_."""
    b1, b2 = betas
    ps = [np.asarray(p, np.float64).copy() for p in p0]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    for t, gs in enumerate(grads, 1):
        gs = [np.asarray(g, np.float64) for g in gs]
        if max_grad_norm is not None:
            norm = np.sqrt(sum(float((g * g).sum()) for g in gs))
            coef = min(1.0, max_grad_norm / (norm + 1e-6))
            gs = [g * coef for g in gs]
        for p, m, v, g in zip(ps, ms, vs, gs):
            p *= 1 - lr * wd
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
            p -= (lr / (1 - b1**t)) * m / denom
    return ps


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
