"""
Tests for model.py, train.py, configurator.py and sample.py, each against a reference computed here
without the code under test: explicit attention with separate projections and repeated kv heads,
the RMSNorm and RoPE formulas (RoPE as a complex rotation), a greedy loop without the KV cache,
hand-computed cross-entropy, a manual SGD step on the full batch, the cosine schedule's formula,
parameter counts from the config, and a straight training run for resume.

    python -m pytest -q test_train.py
"""
import copy
import io
import json
import math
import os
import random
import re
import runpy
import subprocess
import sys
import time as time_module
import warnings
from contextlib import nullcontext, redirect_stdout
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as model_module
import train
from configurator import ConfigError, configure, key_comments, read_config_file
from conftest import (assert_rmsnorm_rounded_once, assert_same, deterministic, read_metrics, rmsnorm_bf16_case,
                      write_dataset)
from model import (GPT, GPTConfig, KVCache, CausalSelfAttention, MLP, apply_rotary, rope_cache, rotary_tables,
                   sample_next)
from prepare_data import prepare
from train import configure_optimizer, get_lr, train_step

HERE = os.path.dirname(os.path.abspath(__file__))
# The models here are tiny: one intra-op thread is as fast, and it avoids OpenMP threads stalling each
# other on a busy 2-core machine (seen: 0.15 s instead of 0.6 ms per forward).
torch.set_num_threads(1)
NO_SCALER = torch.amp.GradScaler('cpu', enabled=False)  # what train.py uses in float32


def tiny_config(**overrides):
    args = dict(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=32)
    args.update(overrides)
    return GPTConfig(**args)


def tiny_model(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).to(dtype)


def rms_norm_ref(x, weight, eps):
    """The RMSNorm formula: x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def randomize_norms(model, seed=1):
    """Give every RMSNorm a random gain, so that a norm applied without its weight is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g, dtype=m.weight.dtype))


class FakeBatches:
    """train.Batches' interface: next() hands out pre-made (x, y) slices in order."""

    def __init__(self, x, y, n_parts):
        self.parts = list(zip(x.chunk(n_parts), y.chunk(n_parts)))
        self.calls = 0

    def next(self):
        batch = self.parts[self.calls % len(self.parts)]
        self.calls += 1
        return batch


def random_batch(seed, batch_size, block_size, vocab_size):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(vocab_size, (batch_size, block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def opt_cfg(**overrides):
    """train.py's config, with the values that configure_optimizer and get_lr read set for the tests."""
    cfg = dict(train.DEFAULTS, learning_rate=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, warmup_iters=10,
               lr_decay_iters=100, max_iters=200, min_lr=1e-4)
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


# ----------------------------------------------------------------------------------------------------
# attention, norms, rotary embedding

def reference_attention(attn, config, x, cos, sin):
    """Separate q/k/v projections cut from the fused weight's rows (q, k, v), QK-norm by formula,
    RoPE, kv heads repeated with repeat_interleave, softmax(QK^T / sqrt(d) + causal mask) V by hand."""
    B, T, _ = x.shape
    H, Hkv, D = config.n_head, config.n_kv_head, config.head_dim
    Wq, Wk, Wv = attn.qkv.weight[:H * D], attn.qkv.weight[H * D:(H + Hkv) * D], attn.qkv.weight[(H + Hkv) * D:]
    assert Wv.shape[0] == Hkv * D
    q = F.linear(x, Wq).view(B, T, H, D)
    k = F.linear(x, Wk).view(B, T, Hkv, D)
    v = F.linear(x, Wv).view(B, T, Hkv, D)
    if config.qk_norm:
        q = rms_norm_ref(q, attn.q_norm.weight, config.norm_eps)
        k = rms_norm_ref(k, attn.k_norm.weight, config.norm_eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k = k.repeat_interleave(H // Hkv, dim=1)  # query head h uses kv head h // (H / Hkv)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float('-inf'))
    y = scores.softmax(dim=-1) @ v  # (B, H, T, D)
    return F.linear(y.transpose(1, 2).reshape(B, T, H * D), attn.proj.weight)


@pytest.mark.parametrize('n_kv_head, qk_norm, head_dim', [(4, False, 0), (2, False, 0), (1, False, 0), (2, True, 0),
                                                       (4, True, 0), (2, True, 24)],
                         ids=['mha', 'gqa', 'mqa', 'gqa-qknorm', 'mha-qknorm', 'gqa-qknorm-wide-heads'])
@pytest.mark.parametrize('dtype, tol', [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=['f64', 'f32'])
def test_attention_matches_explicit_reference(n_kv_head, qk_norm, head_dim, dtype, tol):
    # Reference: reference_attention above (three F.linear calls, repeat_interleave'd kv heads,
    # explicit masked softmax), against the fused-QKV module that goes through SDPA (enable_gqa). Wide heads:
    # head_dim set apart from the width (4 x 24 = 96 channels of attention in a model 64 wide), as in Qwen3.
    config = tiny_config(n_head=4, n_kv_head=n_kv_head, qk_norm=qk_norm, n_embd=64, head_dim=head_dim)
    torch.manual_seed(0)
    attn = CausalSelfAttention(config).to(dtype).eval()
    randomize_norms(attn)
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 0.3)  # large enough that the softmax is far from uniform
    x = torch.randn(2, 12, config.n_embd, dtype=dtype)
    cos, sin = rope_cache(12, config.head_dim, config.rope_base)
    with torch.no_grad():
        got = attn(x, cos, sin)
        want = reference_attention(attn, config, x, cos, sin)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_attention_is_causal():
    # Reference: causality itself; changing the last token must leave every earlier output unchanged,
    # and changing the first token must change the last output.
    config = tiny_config(n_kv_head=2)
    torch.manual_seed(0)
    attn = CausalSelfAttention(config).double().eval()
    x = torch.randn(1, 10, config.n_embd, dtype=torch.float64)
    cos, sin = rope_cache(10, config.head_dim, config.rope_base)
    y = attn(x, cos, sin)
    x2 = x.clone()
    x2[:, -1] += 1.0
    y2 = attn(x2, cos, sin)
    torch.testing.assert_close(y2[:, :-1], y[:, :-1], rtol=0, atol=1e-14)
    x3 = x.clone()
    x3[:, 0] += 1.0
    assert (attn(x3, cos, sin)[:, -1] - y[:, -1]).abs().max() > 1e-6


@pytest.mark.parametrize('norm_eps', [1e-5, 1e-2])
@pytest.mark.parametrize('qk_norm', [False, True])
def test_rmsnorm_matches_formula(norm_eps, qk_norm):
    # Reference: x / sqrt(mean(x^2) + eps) * weight in float64, with random gains, for every norm of
    # the model; inputs at small scales where eps matters, so a misplaced or ignored eps is caught.
    model = tiny_model(dtype=torch.float64, norm_eps=norm_eps, qk_norm=qk_norm)
    randomize_norms(model)
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 2 * model.config.n_layer + 1 + (2 * model.config.n_layer if qk_norm else 0)
    torch.manual_seed(0)
    for norm in norms:
        dim = norm.weight.shape[0]
        x = torch.randn(3, 5, dim, dtype=torch.float64) * torch.tensor([1e-3, 1e-1, 10.0]).view(3, 1, 1)
        torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, norm_eps), rtol=1e-12, atol=1e-12)


def rotate_ref(x, pos, base):
    """RoPE as complex multiplication: channel pair (i, i + D/2) is z_i = x_i + j x_{i+D/2}, turned by
    pos * base^(-2i/D). x is (D,), float64."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    z = torch.complex(x[:D // 2], x[D // 2:]) * torch.polar(torch.ones(D // 2, dtype=torch.float64), pos * theta)
    return torch.cat((z.real, z.imag))


def rotate(x, pos, base=10000.0):
    """The project's apply_rotary on one vector x (D,) at position pos."""
    D = x.shape[-1]
    cos, sin = rope_cache(pos + 1, D, base)
    return apply_rotary(x.view(1, 1, 1, D), cos[pos:pos + 1], sin[pos:pos + 1]).view(D)


def test_rope_matches_complex_rotation():
    # Reference: rotate_ref (complex multiplication by e^{j pos theta_i}); apply_rotary works from float32
    # angles, hence the 1e-5 tolerance. Also the model's cos/sin buffers use its rope_base.
    torch.manual_seed(0)
    for base in (10000.0, 500.0):
        for pos in (0, 1, 7, 63):
            x = torch.randn(16, dtype=torch.float64)
            torch.testing.assert_close(rotate(x, pos, base), rotate_ref(x, pos, base), rtol=0, atol=2e-5)
    m = tiny_model(rope_base=500.0, n_embd=64)  # head_dim 16
    t = torch.arange(16, dtype=torch.float64)[:, None]
    angles = t * 500.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(m.cos.double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(m.sin.double(), angles.sin(), rtol=0, atol=1e-6)


def test_rope_relative_position_and_norm():
    # Reference: the defining property of RoPE, <rot(q, m), rot(k, n)> = f(q, k, m - n): shifting both
    # positions keeps the dot product, other offsets change it; and a rotation keeps the norm.
    torch.manual_seed(0)
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    scale = q.norm() * k.norm()

    def dot(m, n):
        return torch.dot(rotate(q, m), rotate(k, n))
    for offset in (0, 3, -5):
        base_dot = dot(10 + offset, 10)
        for shift in (-5, 1, 17, 40):
            assert abs(dot(10 + offset + shift, 10 + shift) - base_dot) < 1e-5 * scale
    dots = [dot(20 + offset, 20) for offset in (0, 1, 3, -5)]
    for i in range(len(dots)):
        for j in range(i + 1, len(dots)):
            assert abs(dots[i] - dots[j]) > 1e-3 * scale
    for pos in (0, 5, 60):
        torch.testing.assert_close(rotate(q, pos).norm(), q.norm(), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------
# KV cache and sampling

@pytest.mark.parametrize('n_kv_head, qk_norm', [(2, False), (4, True)])
def test_kv_cache_logits_match_full_forward(n_kv_head, qk_norm):
    # Reference: one full-sequence forward without cache; the cache is filled by a prefill and then one
    # token at a time, and its logits must match position by position (float32, 1e-5).
    model = tiny_model(block_size=24, n_kv_head=n_kv_head, qk_norm=qk_norm).eval()
    randomize_norms(model)
    idx = torch.randint(32, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, 2, 24, 'cpu', torch.float32)
        steps = [model(idx[:, :7], cache=cache)[0]]
        for t in range(7, 24):
            steps.append(model(idx[:, t:t + 1], cache=cache)[0])
    assert cache.pos == 24
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match='block_size'):  # the cache is full
        model(idx[:, :1], cache=cache)


def greedy_reference(model, idx, max_new_tokens):
    """Greedy decoding the plain way: full forward over the last block_size tokens at every step."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat((idx, logits[:, -1].argmax(dim=-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize('n_kv_head, qk_norm', [(2, False), (4, True)])
def test_generate_greedy_with_cache_past_block_size(n_kv_head, qk_norm):
    # Reference: greedy_reference (no cache); a 5-token prompt plus 30 tokens runs well past
    # block_size=16, so the cached path must fall back exactly. float64 so that no argmax is a near-tie.
    model = tiny_model(dtype=torch.float64, n_kv_head=n_kv_head, qk_norm=qk_norm, tie_embeddings=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # random weights with varied predictions, not the near-uniform init
    prompt = torch.randint(32, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = greedy_reference(model.eval(), prompt, 30)
    model.train()
    cached = model.generate(prompt, 30, temperature=0, use_cache=True)
    uncached = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert model.training  # generate puts the mode back
    assert cached.shape == (2, 35)
    assert torch.equal(cached, want) and torch.equal(uncached, want)
    assert len(set(want[:, 5:].flatten().tolist())) >= 4  # a meaningful sequence, not one repeated token
    # top_k=1 at temperature 1 is greedy too
    assert torch.equal(model.generate(prompt, 30, temperature=1.0, top_k=1), want)


def test_generate_keeps_the_callers_mode_and_decodes_without_dropout():
    # Reference: greedy_reference on the model in eval mode (dropout off). A model in train mode with dropout=0.5
    # generates exactly that, twice (dropout left on would draw other tokens), and is in train mode after; a model
    # in eval mode stays in eval mode.
    model = tiny_model(dropout=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    prompt = torch.randint(32, (2, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = greedy_reference(model.eval(), prompt, 10)
    assert torch.equal(model.generate(prompt, 10, temperature=0), want) and not model.training
    model.train()
    for _ in range(2):
        assert torch.equal(model.generate(prompt, 10, temperature=0), want) and model.training


@pytest.mark.parametrize('prompt_len, steps', [(5, 30), (1, 15), (16, 3)])  # past B; up to B; a prefill of B
def test_generate_uses_the_kv_cache_while_the_sequence_fits(monkeypatch, prompt_len, steps):
    # Reference: the calls generate() must make, derived from block_size B and the prompt length P: one prefill
    # of the P prompt tokens into an empty cache, then one token at a time against that same cache (its
    # position the tokens before it) until the sequence reaches B; past B, each step is a full forward over
    # the last B tokens without a cache. Outputs alone cannot show this: cached and uncached ones agree.
    # use_cache=False: a full forward over the last (at most B) tokens at every step.
    calls, forward = [], GPT.forward

    def spy(self, idx, *args, cache=None, **kwargs):
        calls.append((idx.size(1), None if cache is None else (id(cache), cache.pos)))
        return forward(self, idx, *args, cache=cache, **kwargs)

    monkeypatch.setattr(GPT, 'forward', spy)
    model = tiny_model()
    B = model.config.block_size
    prompt = torch.randint(32, (2, prompt_len), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, steps, temperature=0, use_cache=True)
    assert out.shape == (2, prompt_len + steps)
    cache_id = calls[0][1][0] if calls[0][1] else None
    decoded = min(steps - 1, B - prompt_len)  # steps whose sequence, the new token's input included, fits in B
    want = ([(prompt_len, (cache_id, 0))] + [(1, (cache_id, pos)) for pos in range(prompt_len, prompt_len + decoded)]
            + [(B, None)] * (steps - 1 - decoded))
    assert calls == want
    calls.clear()
    model.generate(prompt, steps, temperature=0, use_cache=False)
    assert calls == [(min(L, B), None) for L in range(prompt_len, prompt_len + steps)]


def assert_frequencies(samples, probs):
    """samples (a 1-d tensor of token ids) drawn from probs (a list): exactly the tokens of nonzero probability
    appear, each at its probability within 5 standard errors of a frequency over len(samples) draws."""
    n = len(samples)
    counts = torch.bincount(samples, minlength=len(probs)).tolist()
    assert {i for i, c in enumerate(counts) if c} == {i for i, p in enumerate(probs) if p > 0}, counts
    for i, p in enumerate(probs):
        assert abs(counts[i] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (i, counts[i] / n, p)


# a hand-built distribution over 6 tokens, no two alike (so no top-k boundary is a tie): sorted 1, 3, 4, 5, 2, 0
SAMPLING_PROBS = [0.05, 0.3, 0.1, 0.25, 0.18, 0.12]


@pytest.mark.parametrize('temperature', [0.5, 1.0, 2.0])
@pytest.mark.parametrize('top_k', [None, 2, 3, 5])
def test_sampling_frequencies_follow_the_tempered_softmax_over_the_top_k(temperature, top_k):
    # Reference: softmax(log p / temperature) computed here in float64, renormalized over the top_k most likely
    # tokens found by sorting in Python; 20000 seeded samples must show exactly those tokens at those
    # frequencies (assert_frequencies). Temperature 0.5 squares p, 2 takes its square root (before
    # renormalizing): far apart from p and each other at this sample count, as is top_k from greedy.
    n = 20000
    keep = sorted(range(6), key=lambda i: -SAMPLING_PROBS[i])[:top_k or 6]
    tempered = [p ** (1 / temperature) if i in keep else 0.0 for i, p in enumerate(SAMPLING_PROBS)]
    want = [p / sum(tempered) for p in tempered]
    logits = torch.tensor(SAMPLING_PROBS).log().repeat(n, 1)
    samples = sample_next(logits, temperature, top_k=top_k, generator=torch.Generator().manual_seed(0)).squeeze(1)
    assert_frequencies(samples, want)


def test_top_k_one_is_greedy_and_top_k_stays_in_top_k():
    # Reference: argmax / the k largest logits found by sorting in Python.
    logits = torch.randn(500, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(logits.clone(), 1.0, top_k=1, generator=g).squeeze(1), logits.argmax(-1))
    got = sample_next(logits.clone(), 1.5, top_k=3, generator=g).squeeze(1).tolist()
    for row, token in zip(logits.tolist(), got):
        assert token in sorted(range(50), key=lambda i: -row[i])[:3]
    for _ in range(100):  # a batch of fewer rows than k: k counts the vocabulary, not the rows
        got = sample_next(logits[:2].clone(), 1.5, top_k=3, generator=g).squeeze(1).tolist()
        for row, token in zip(logits[:2].tolist(), got):
            assert token in sorted(range(50), key=lambda i: -row[i])[:3]


def test_top_k_keeps_every_token_tied_with_the_kth():
    # Reference: transformers' TopKLogitsWarper, which removes only the logits below the k-th largest: with three
    # tied largest logits and top_k=2, all three are kept, each drawn a third of the time (assert_frequencies)
    logits = torch.tensor([3.0, 3.0, 3.0, 0.0, -1.0]).repeat(6000, 1)
    samples = sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0)).squeeze(1)
    assert_frequencies(samples, [1 / 3, 1 / 3, 1 / 3, 0.0, 0.0])


@pytest.mark.parametrize('temperature', [1e-37, 1e-40, 1e-300])
def test_a_tiny_temperature_samples_the_largest_logits(temperature):
    # Reference: the limit of softmax(logits / t) as t goes to 0: the argmax, or an even draw among tied largest
    # logits. logits / 1e-37 overflows float32 (1e-40 is a subnormal there, 1e-300 rounds to 0): inf - inf was NaN
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(0)) * 10
    got = sample_next(logits, temperature, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got.squeeze(1), logits.argmax(-1))
    tied = torch.tensor([[0.0, 3.0, -1.0, 3.0]]).repeat(4000, 1)
    counts = torch.bincount(sample_next(tied, temperature, top_p=0.9, generator=torch.Generator().manual_seed(2))
                            .squeeze(1), minlength=4).tolist()
    assert counts[0] == counts[2] == 0 and abs(counts[1] - 2000) < 200, counts  # 4.5 standard deviations


def nucleus_ref(probs, p):
    """The smallest set of most likely tokens whose probability reaches p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, total = [], 0.0
    for i in order:
        kept.append(i)
        total += probs[i]
        if total >= p:
            break
    return kept


@pytest.mark.parametrize('top_p', [0.3, 0.65, 0.75, 0.9, 0.99])
def test_top_p_samples_only_the_nucleus(top_p):
    # Reference: nucleus_ref on a hand-built distribution (cumulative 0.4, 0.7, 0.85, 0.95, 1.0; no p sits
    # on a boundary). 4000 seeded samples: exactly the nucleus appears, at its renormalized frequencies.
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    kept = nucleus_ref(probs, top_p)
    n = 4000
    logits = torch.tensor(probs).log().repeat(n, 1)
    samples = sample_next(logits, 1.0, top_p=top_p, generator=torch.Generator().manual_seed(0)).squeeze(1)
    counts = torch.bincount(samples, minlength=len(probs)).tolist()
    assert {i for i, c in enumerate(counts) if c} == set(kept)
    mass = sum(probs[i] for i in kept)
    for i in kept:
        assert abs(counts[i] / n - probs[i] / mass) < 0.03  # about 4 standard deviations


@pytest.mark.parametrize('n_tokens, top_p, kept', [(4, 0.5, 2), (4, 0.75, 3), (2, 0.5, 1)])
def test_top_p_stops_at_the_token_whose_cumulative_probability_reaches_p_exactly(n_tokens, top_p, kept):
    # Reference: nucleus_ref on equal logits, whose probabilities (1/4, 1/2) and sums are exact in float32: the
    # nucleus ends at the token that reaches top_p, so exactly `kept` tokens appear among the samples
    assert len(nucleus_ref([1 / n_tokens] * n_tokens, top_p)) == kept
    samples = sample_next(torch.zeros(2000, n_tokens), 1.0, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert len(set(samples.flatten().tolist())) == kept


def test_top_p_of_one_is_off_and_keeps_every_token(monkeypatch):
    # Reference: the plain softmax that top_p=None samples from. top_p=1.0 is "off" (sample.py's default): every
    # token keeps its probability, also those after the float32 cumulative sum has rounded to 1.0 (here the two
    # at e^-20, after a first token whose probability rounds to 1.0 itself)
    drawn_from = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, 'multinomial',
                        lambda probs, *a, **k: drawn_from.append(probs) or multinomial(probs, *a, **k))
    logits = torch.tensor([[0.0, -20.0, -20.0, -3.0]])
    assert torch.softmax(logits, -1).sort(descending=True).values.cumsum(-1)[0, 1] == 1.0  # the rounding meant
    sample_next(logits, 1.0, top_p=None, generator=torch.Generator().manual_seed(0))
    sample_next(logits, 1.0, top_p=1.0, generator=torch.Generator().manual_seed(0))
    assert (drawn_from[0] > 0).all()
    assert torch.equal(drawn_from[1], drawn_from[0])


@pytest.mark.parametrize('temperature, top_k, top_p', [(2.0, None, 0.75), (0.5, None, 0.75), (1.0, 3, 0.8)])
def test_top_p_applies_to_the_tempered_top_k_distribution(temperature, top_k, top_p):
    # Reference: transformers' order (temperature, then top-k, then top-p), in float64 here: p ** (1/temperature)
    # renormalized, the top_k most likely kept and renormalized, then nucleus_ref of that. Each case's nucleus
    # differs from top-p on the untempered p ({1, 3, 4}) and from top-p over the whole vocabulary, not the top k.
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    tempered = [p ** (1 / temperature) for p in probs]
    keep = sorted(range(5), key=lambda i: -tempered[i])[:top_k or 5]
    mass = sum(tempered[i] for i in keep)
    tempered = [t / mass if i in keep else 0.0 for i, t in enumerate(tempered)]
    nucleus = nucleus_ref(tempered, top_p)
    assert sorted(nucleus) != [1, 3, 4]
    mass = sum(tempered[i] for i in nucleus)
    want = [t / mass if i in nucleus else 0.0 for i, t in enumerate(tempered)]
    n = 20000
    logits = torch.tensor(probs).log().repeat(n, 1)
    samples = sample_next(logits, temperature, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert_frequencies(samples.squeeze(1), want)


def test_generate_samples_from_float32_logits_under_bf16_autocast():
    # Reference: sample_next called here on the model's bf16 logits converted to float32, with the same seed: under
    # CPU bf16 autocast each of 2048 rows draws the same token (top_p=0.9 on bf16 logits, whose softmax and running
    # sums round to bf16, keeps another nucleus in some rows: seen in 21 of them)
    model = tiny_model(vocab_size=512, n_embd=64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    idx = torch.randint(512, (2048, 5), generator=torch.Generator().manual_seed(1))
    with torch.autocast('cpu', dtype=torch.bfloat16), torch.no_grad():
        got = model.generate(idx, 1, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
        logits = model(idx)[0][:, -1]
    assert logits.dtype == torch.bfloat16
    want = sample_next(logits.float(), 0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got[:, -1:], want)


def test_vocab_limit_masks_padding_ids():
    # Reference: argmax over the allowed ids only; the padding ids are made the most likely ones.
    logits = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    logits[:, 40:] += 10.0
    given = logits.clone()
    greedy = sample_next(given, 0, vocab_limit=40).squeeze(1)
    assert torch.equal(greedy, logits[:, :40].argmax(-1))
    assert torch.equal(given, logits)  # the caller's logits as they were: the mask is on a copy
    g = torch.Generator().manual_seed(0)
    for kwargs in ({}, {'top_p': 0.9}, {'top_k': 50}):
        assert sample_next(logits.clone(), 1.0, vocab_limit=40, generator=g, **kwargs).max() < 40
    model = tiny_model(vocab_size=64)
    with torch.no_grad():
        model.lm_head.weight[40:] *= 50  # make the padding ids tempting
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 40, vocab_limit=40,
                         generator=torch.Generator().manual_seed(0))
    assert out[:, 3:].max() < 40


@pytest.mark.parametrize('old, new, changed', [
    (dict(eval_iters=2, batch_size=4, seed=1), dict(eval_iters=2, batch_size=8, seed=2), ['batch_size', 'seed']),
    # every window of the val split, in order, both times: the batch and the seed change nothing measured
    (dict(eval_iters=0, batch_size=4, seed=1), dict(eval_iters=0, batch_size=8, seed=2), []),
    # from every window to sampled batches (and back): the batch and the seed matter on the sampled side
    (dict(eval_iters=0, batch_size=4, seed=1), dict(eval_iters=3, batch_size=8, seed=2),
     ['eval_iters', 'batch_size', 'seed']),
    (dict(eval_iters=3, batch_size=4, seed=1), dict(eval_iters=0, batch_size=4, seed=1), ['eval_iters']),
])
def test_eval_changes_names_what_the_val_loss_measures(tmp_path, old, new, changed):
    # Reference: EVAL_KEYS by hand; data_dir compared by the directory it names, not its spelling
    (tmp_path / 'd').mkdir()
    same = {'data_dir': str(tmp_path / 'd'), 'block_size': 8}
    respelt = {'data_dir': str(tmp_path / '.' / 'd') + '/', 'block_size': 8}
    assert train.eval_changes({**old, **same}, {**new, **respelt}) == changed
    assert train.eval_changes({**old, **same}, {**new, **same, 'data_dir': str(tmp_path)}) == ['data_dir', *changed]


# ----------------------------------------------------------------------------------------------------
# loss, config, MLP, FLOPs

@pytest.mark.parametrize('label_smoothing', [0.0, 0.1])
def test_loss_matches_hand_computed_cross_entropy(label_smoothing):
    # Reference: -log_softmax at the target, mixed with the mean over all classes for label smoothing
    # ((1 - eps) * nll + eps * mean_c(-log p_c)), computed by hand in float64 from the returned logits;
    # and F.cross_entropy on those logits.
    model = tiny_model(dtype=torch.float64)
    x, y = random_batch(0, 3, 16, 32)
    logits, none = model(x)
    logp = logits.double().log_softmax(dim=-1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    want = ((1 - label_smoothing) * nll + label_smoothing * (-logp.mean(dim=-1))).mean()
    assert logits.shape == (3, 16, 32) and none is None
    for chunk in (model.loss_chunk_tokens, 0):  # the chunked loss (the default), then the plain one
        model.loss_chunk_tokens = chunk
        logits_too, loss = model(x, y, label_smoothing=label_smoothing)
        torch.testing.assert_close(loss.double(), want, rtol=1e-12, atol=0)
        torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1),
                                                         label_smoothing=label_smoothing), rtol=1e-12, atol=0)
        assert (logits_too is None) == (chunk != 0)  # the chunked loss never forms all the logits


@pytest.mark.parametrize('overrides, field', [
    (dict(n_embd=32, n_head=4, n_kv_head=3), 'n_kv_head'),
    (dict(n_embd=30, n_head=4), 'n_embd'),
    (dict(n_embd=12, n_head=4), 'head_dim'),  # head_dim 3 is odd
    (dict(head_dim=-2), 'head_dim'),
    (dict(mlp_hidden=-64), 'mlp_hidden'),
    (dict(rope_scaling_factor=0.5), 'rope_scaling_factor'),  # slows nothing down: less than 1
    (dict(rope_scaling_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), 'rope_scaling_factor'),
    (dict(rope_scaling_factor=8.0, rope_low_freq_factor=2.0, rope_high_freq_factor=2.0), 'rope_scaling_factor'),  # 0/0
    (dict(mlp='relu'), 'mlp'),
    (dict(n_layer=0), 'n_layer'),
    (dict(dropout=1.0), 'dropout'),
])
def test_config_errors_name_the_field(overrides, field):
    # Reference: the field that is wrong; its name (as `field=`) must be in the ValueError's message.
    with pytest.raises(ValueError) as e:
        tiny_config(**overrides)
    assert f'{field}=' in str(e.value)


@pytest.mark.parametrize('mlp', ['gelu', 'relu2', 'swiglu', 'geglu'])
@pytest.mark.parametrize('n_embd', [32, 40, 48, 56, 72, 200])
def test_mlp_hidden_is_a_multiple_of_64(mlp, n_embd):
    # Reference: 4 * n_embd (gelu, relu2: two matrices) or 8/3 * n_embd (gated), rounded up to the next multiple of 64.
    config = tiny_config(n_embd=n_embd, mlp=mlp)
    target = 4 * n_embd if mlp in ('gelu', 'relu2') else 8 * n_embd / 3
    assert config.mlp_hidden % 64 == 0
    assert target <= config.mlp_hidden < target + 64
    assert config.head_dim == n_embd // 4


@pytest.mark.parametrize('kind', ['gelu', 'swiglu', 'geglu'])
def test_mlp_matches_formula_and_trains(kind):
    # Reference: the formulas written out (silu(z) = z * sigmoid(z), gelu(z) = z * Phi(z) via erf),
    # with the fused up weight's rows as [gate, up]; then a whole model's forward/backward reaches
    # every parameter with a finite gradient.
    config = tiny_config(mlp=kind)
    torch.manual_seed(0)
    mlp = MLP(config).double()
    x = torch.randn(2, 5, config.n_embd, dtype=torch.float64)
    h = x @ mlp.up.weight.T
    gelu = lambda z: z * 0.5 * (1 + torch.erf(z / math.sqrt(2)))  # noqa: E731
    if kind == 'gelu':
        act = gelu(h)
    else:
        gate, up = h[..., :config.mlp_hidden], h[..., config.mlp_hidden:]
        act = (gate * torch.sigmoid(gate) if kind == 'swiglu' else gelu(gate)) * up
    torch.testing.assert_close(mlp(x), act @ mlp.down.weight.T, rtol=1e-12, atol=1e-12)

    model = tiny_model(mlp=kind)
    _, loss = model(*random_batch(0, 2, 16, 32))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_forward_rejects_sequences_longer_than_block_size():
    # Reference: the documented limit, block_size tokens.
    model = tiny_model()
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match='block_size'):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize('overrides', [dict(), dict(tie_embeddings=False, mlp='gelu'),
                                       dict(n_kv_head=1, n_layer=3), dict(mlp='geglu', n_kv_head=2),
                                       dict(n_kv_head=2, head_dim=24, mlp_hidden=40)])  # sizes apart from the width
def test_flops_per_token(overrides):
    # Reference: the matmul weights counted from the config by hand (qkv, proj, mlp up/down, lm_head;
    # the tied lm_head still does a matmul), times 6, plus the PaLM attention term 12 * L * H * D * T.
    c = tiny_config(**overrides)
    model = GPT(c)
    H, Hkv, D, C, L = c.n_head, c.n_kv_head, c.head_dim, c.n_embd, c.n_layer
    up_rows = c.mlp_hidden * (1 if c.mlp == 'gelu' else 2)
    per_layer = C * (H + 2 * Hkv) * D + H * D * C + C * up_rows + c.mlp_hidden * C
    weights = L * per_layer + c.vocab_size * C
    assert model.flops_per_token() == 6 * weights + 12 * L * H * D * c.block_size
    assert model.flops_per_token(seq_len=7) == 6 * weights + 12 * L * H * D * 7
    assert model.estimate_mfu(1e6, 'cpu') is None


# ----------------------------------------------------------------------------------------------------
# training step, schedule, optimizer groups, activation checkpointing

@pytest.mark.parametrize('accum_steps', [1, 4])
def test_gradient_accumulation_matches_full_batch_sgd(accum_steps):
    # Reference: a manual SGD step on the full batch of 8 (loss.backward() on one forward, p - lr * grad);
    # train_step with accum_steps micro-batches of 8 / accum_steps must give the same weights, the same
    # mean loss and the same gradient norm. grad_clip=0 (off), so that clipping cannot hide a wrong scale.
    lr = 0.5
    ref = tiny_model()
    x, y = random_batch(0, 8, 16, 32)
    _, loss = ref(x, y)
    loss.backward()
    want = {n: (p - lr * p.grad).detach() for n, p in ref.named_parameters()}
    want_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batches = FakeBatches(x, y, accum_steps)
    got_loss, norm, ok = train_step(model, optimizer, NO_SCALER, batches, accum_steps, nullcontext(), 0.0)
    assert ok and batches.calls == accum_steps
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-7, msg=n)
        assert p.grad is None  # zeroed after the step


def test_gradient_accumulation_with_adamw():
    # Reference: one train_step on the batch of 8 with the project's AdamW; 4 micro-batches of 2 must
    # land on the same weights (and the same pre-clipping gradient norm, which AdamW alone would not
    # notice: its first step barely depends on the gradient's scale). float64: Adam divides by |grad|,
    # so float32 rounding in gradients that nearly cancel would move single weights by up to lr.
    x, y = random_batch(0, 8, 16, 32)
    results = []
    for accum_steps in (1, 4):
        model = tiny_model(dtype=torch.float64)
        optimizer = configure_optimizer(model, opt_cfg(learning_rate=1e-2), 'cpu')
        loss, norm, ok = train_step(model, optimizer, NO_SCALER, FakeBatches(x, y, accum_steps), accum_steps,
                                    nullcontext(), 1.0)
        assert ok
        results.append((loss, norm, dict(model.named_parameters())))
    (loss1, norm1, p1), (loss4, norm4, p4) = results
    torch.testing.assert_close(loss4, loss1, rtol=1e-6, atol=0)  # GPT.forward computes the loss in float32
    torch.testing.assert_close(norm4, norm1, rtol=1e-9, atol=0)
    for n in p1:
        torch.testing.assert_close(p4[n], p1[n], rtol=1e-10, atol=1e-12, msg=n)
    initial = tiny_model(dtype=torch.float64).blocks[0].attn.qkv.weight
    assert (p1['blocks.0.attn.qkv.weight'] - initial).abs().max() > 1e-3  # lr 1e-2: the step happened


def test_train_step_window_trains_each_window_in_pieces():
    # Reference: a manual SGD step on the batch cut by hand, each window of 16 as two windows of 8 (the second
    # half's positions start again at 0): (8, 8). train_step with window=8 on the (4, 16) batch, in two
    # micro-batches, must reach the same loss and weights; the whole windows' loss differs, so a window that
    # is not applied fails.
    lr = 0.5
    x, y = random_batch(0, 4, 16, 32)
    ref = tiny_model()
    _, loss = ref(x.reshape(8, 8), y.reshape(8, 8))
    loss.backward()
    want = {n: (p - lr * p.grad).detach() for n, p in ref.named_parameters()}
    with torch.no_grad():
        _, whole = tiny_model()(x, y)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    got, _, ok = train_step(model, optimizer, NO_SCALER, FakeBatches(x, y, 2), 2, nullcontext(), 0.0, window=8)
    assert ok and abs(whole.item() - loss.item()) > 1e-3
    torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_grad_clip_scales_the_step():
    # Reference: a manual SGD step with the gradient scaled by clip / norm (torch's clip_grad_norm_ rule).
    lr, x, y = 0.5, *random_batch(0, 4, 16, 32)
    ref = tiny_model()
    ref(x, y)[1].backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
    clip = float(norm) / 3
    model = tiny_model()
    _, got_norm, ok = train_step(model, torch.optim.SGD(model.parameters(), lr=lr), NO_SCALER,
                                 FakeBatches(x, y, 1), 1, nullcontext(), clip)
    assert ok
    torch.testing.assert_close(got_norm, norm, rtol=1e-5, atol=0)  # reported before clipping
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, (q - lr * q.grad * clip / norm).detach(), rtol=1e-5, atol=1e-7, msg=n)


def test_nonfinite_loss_skips_the_update():
    # Reference: the weights before the step; a NaN loss must not reach them.
    class NaNLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y, label_smoothing=0.0):
            logits, loss = self.inner(x, y)
            return logits, loss * float('nan')
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    optimizer = configure_optimizer(model, opt_cfg(), 'cpu')
    _, _, ok = train_step(NaNLoss(model), optimizer, NO_SCALER, FakeBatches(*random_batch(0, 2, 16, 32), 1), 1,
                          nullcontext(), 1.0)
    assert not ok
    for n, p in model.state_dict().items():
        assert torch.equal(p, before[n]), n
    assert all(p.grad is None for p in model.parameters())


def test_train_step_trains_on_the_label_smoothed_loss():
    # Reference: a manual SGD step on the label-smoothed loss written out by hand ((1 - eps) * nll + eps *
    # mean_c(-log p_c), from the model's logits), on the whole batch. train_step with label_smoothing in two
    # micro-batches must return that loss and reach those weights. The head is scaled up so that the predictions
    # are far from uniform (near uniform, smoothing changes little): the plain loss differs by far more than the
    # tolerance, so a smoothing that does not reach the model fails.
    eps, lr = 0.1, 0.5
    x, y = random_batch(0, 4, 16, 32)

    def confident_model():
        model = tiny_model(tie_embeddings=False)
        with torch.no_grad():
            model.lm_head.weight.mul_(30)
        return model
    ref = confident_model()
    logits, _ = ref(x)
    logp = logits.log_softmax(dim=-1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    loss = ((1 - eps) * nll + eps * -logp.mean(dim=-1)).mean()
    assert abs(loss.item() - nll.mean().item()) > 1e-2
    loss.backward()
    want = {n: (p - lr * p.grad).detach() for n, p in ref.named_parameters()}
    model = confident_model()
    got, _, ok = train_step(model, torch.optim.SGD(model.parameters(), lr=lr), NO_SCALER, FakeBatches(x, y, 2), 2,
                            nullcontext(), 0.0, label_smoothing=eps)
    assert ok
    torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_tiny_model_overfits_one_batch():
    # Reference: ln(vocab_size), the loss of a uniform guess; memorizing one batch must go far below it.
    model = tiny_model(vocab_size=16, n_embd=64)
    x, y = random_batch(0, 4, 16, 16)
    optimizer = configure_optimizer(model, opt_cfg(learning_rate=1e-2, weight_decay=0.0), 'cpu')
    losses = []
    for _ in range(200):
        loss, _, ok = train_step(model, optimizer, NO_SCALER, FakeBatches(x, y, 1), 1, nullcontext(), 1.0)
        assert ok
        losses.append(loss.item())
        if losses[-1] < 0.05:
            break
    assert abs(losses[0] - math.log(16)) < 0.3
    assert losses[-1] < 0.1, losses[-10:]


def test_get_lr_schedule():
    # Reference: linear warmup (constant increments, learning_rate within one increment at the last
    # warmup step), then min_lr + 0.5 * (1 + cos(pi * progress)) * (learning_rate - min_lr), min_lr after.
    cfg = opt_cfg(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    warm = [get_lr(it, cfg) for it in range(10)]
    steps = [b - a for a, b in zip(warm, warm[1:])]
    assert warm[0] > 0 and all(s > 0 for s in steps)
    assert max(steps) - min(steps) < 1e-12
    assert 1.0 - steps[0] - 1e-12 <= warm[-1] <= 1.0
    for it in (10, 20, 35, 60, 85, 109, 110):
        want = 0.1 + 0.5 * (1 + math.cos(math.pi * (it - 10) / 100)) * 0.9
        assert math.isclose(get_lr(it, cfg), want, rel_tol=1e-12, abs_tol=1e-12), it
    assert math.isclose(get_lr(10, cfg), 1.0) and math.isclose(get_lr(60, cfg), 0.55)
    for it in (110, 111, 150, 10 ** 6):
        assert get_lr(it, cfg) == 0.1
    # lr_decay_iters=0 means max_iters
    cfg0 = opt_cfg(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=0, max_iters=110)
    assert all(get_lr(it, cfg0) == get_lr(it, cfg) for it in (0, 5, 10, 50, 109, 110, 200))


@pytest.mark.parametrize('tie', [True, False])
@pytest.mark.parametrize('qk_norm', [False, True])
def test_weight_decay_groups(tie, qk_norm):
    # Reference: the modules by type: Linear and Embedding weights decay, RMSNorm gains do not; each
    # parameter in exactly one group, a tied embedding once.
    model = tiny_model(tie_embeddings=tie, qk_norm=qk_norm)
    decay, no_decay = set(), set()
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            decay.add(id(m.weight))
        elif isinstance(m, nn.RMSNorm):
            no_decay.add(id(m.weight))
    optimizer = configure_optimizer(model, opt_cfg(weight_decay=0.1), 'cpu')
    groups = {g['weight_decay']: [id(p) for p in g['params']] for g in optimizer.param_groups}
    assert sorted(groups) == [0.0, 0.1]
    assert len(groups[0.1]) == len(set(groups[0.1])) and set(groups[0.1]) == decay
    assert len(groups[0.0]) == len(set(groups[0.0])) and set(groups[0.0]) == no_decay
    n_layer = model.config.n_layer
    assert len(decay) == 1 + 4 * n_layer + (0 if tie else 1)  # wte, qkv/proj/up/down, lm_head
    assert len(no_decay) == 2 * n_layer + 1 + (2 * n_layer if qk_norm else 0)
    total = sum(p.numel() for g in optimizer.param_groups for p in g['params'])
    assert total == model.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('dropout', [0.0, 0.1])
def test_activation_checkpointing_same_loss_and_grads(dropout, monkeypatch):
    # Reference: the same model and seed without checkpointing; with dropout too (checkpoint restores the
    # RNG for the recomputation). The checkpoint function is counted, so a flag that is ignored fails.
    calls = []
    real_checkpoint = model_module.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(1)
        return real_checkpoint(*args, **kwargs)
    monkeypatch.setattr(model_module, 'checkpoint', counting_checkpoint)
    x, y = random_batch(0, 4, 16, 32)
    results = []
    for mode in ('none', 'full'):
        model = tiny_model(dropout=dropout)
        model.activation_checkpointing = mode
        torch.manual_seed(123)
        _, loss = model(x, y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert len(calls) == model.config.n_layer
    (loss0, g0), (loss1, g1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-8, msg=n)


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
def test_dropout_on_the_embeddings_and_on_each_blocks_attention_and_mlp_outputs(training):
    # Reference: what each dropout receives, seen by forward hooks: the token embeddings (wte's output), each
    # block's attention projection (proj's output) and MLP down projection (down's output). With dropout=0.5 in
    # train mode, what goes on (block 0's input; the attention's and the MLP's outputs) is that, each element
    # either zeroed or doubled (1 / (1 - p)), about half of them zeroed (within 5 standard errors); in eval
    # mode it is that, unchanged.
    model = tiny_model(dropout=0.5, n_layer=3).train(training)
    seen = {}

    def keep(name, where):  # a forward hook's output, or a pre-hook's input (which has no output)
        def hook(module, args, out=None):
            seen[name, where] = (args[0] if out is None else out).detach().clone()
        return hook

    model.wte.register_forward_hook(keep('embeddings', 'before'))
    model.blocks[0].register_forward_pre_hook(keep('embeddings', 'after'))  # x0_mix is off: the embeddings' path
    for i, block in enumerate(model.blocks):
        for name, before, after in ((f'block {i} attention', block.attn.proj, block.attn),
                                    (f'block {i} mlp', block.mlp.down, block.mlp)):
            before.register_forward_hook(keep(name, 'before'))
            after.register_forward_hook(keep(name, 'after'))
    x, _ = random_batch(0, 4, 16, 32)
    with torch.no_grad():
        model(x)
    names = ['embeddings'] + [f'block {i} {part}' for i in range(3) for part in ('attention', 'mlp')]
    assert sorted(seen) == sorted((name, where) for name in names for where in ('before', 'after'))
    for name in names:
        before, after = seen[name, 'before'], seen[name, 'after']
        live = before != 0  # not all in train mode: attention's own dropout can drop all of a query's keys
        assert live.float().mean() > 0.9, name
        if not training:
            assert torch.equal(after, before), name
            continue
        assert torch.equal(after, torch.where(after != 0, before * 2, 0.0)), name
        n = live.sum().item()
        assert abs(((after == 0) & live).sum().item() / n - 0.5) <= 5 * math.sqrt(0.25 / n), name


def draws_after_restore(draw):
    """draw() right after rng_state(), and again after set_rng_state() of that state, mid-stream."""
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    random.random(), np.random.rand(3), torch.rand(3)  # mid-stream, not at a fresh seed
    state = train.rng_state()
    first = draw()
    train.set_rng_state(state)
    return first, draw()


def test_rng_state_round_trip():
    # Reference: the draws taken right after rng_state(); after set_rng_state the same draws must come
    # again from Python's and torch's generators (what an exact resume relies on).
    first, again = draws_after_restore(lambda: (random.random(), torch.rand(4).tolist()))
    assert first == again


def test_rng_state_round_trip_numpy():
    # Reference: as above, for numpy's global generator.
    first, again = draws_after_restore(lambda: np.random.rand(4).tolist())
    assert first == again


def test_rng_state_round_trip_numpy_normals():
    # Reference: as above, for numpy's normal draws. An odd number drawn before the save leaves the second
    # value of a Box-Muller pair cached in the state (has_gauss, gauss): the first normal after the restore is
    # that value, not a new pair's.
    def draw():
        return np.random.randn(3).tolist()
    np.random.seed(1), np.random.randn(1)
    assert np.random.get_state()[3] == 1  # a value is cached
    state = train.rng_state()
    first = draw()
    np.random.seed(2), np.random.randn(2)  # another stream, nothing cached
    train.set_rng_state(state)
    assert draw() == first


def test_stop_on_signals_takes_the_signals_inside_only():
    # Reference: the handlers installed before. Inside, SIGTERM and SIGINT are recorded rather than acted on;
    # after, on a normal exit and on an exception, each signal has its earlier handler again (a notebook or a
    # test that calls train.main keeps its Ctrl-C).
    import signal
    seen = []

    def mine(signum, frame):
        seen.append(signum)
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with train.stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop == {'signal': signal.SIGTERM} and seen == []
        assert all(signal.getsignal(s) is mine for s in before)
        with pytest.raises(ValueError), train.stop_on_signals():
            raise ValueError
        assert all(signal.getsignal(s) is mine for s in before)
        os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_check_device_counts_the_gpus_from_0(monkeypatch):
    # Reference: CUDA's ordinals, 0 to count - 1 (faked: 2 GPUs). cuda:2 is the third GPU, which this machine
    # lacks; 'auto' (the default) is always accepted, whatever the machine has.
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    for name in ('auto', 'cpu', 'cuda', 'cuda:0', 'cuda:1'):
        train.check_device(name)
    with pytest.raises(ConfigError, match=re.escape("device='cuda:2', but this machine has 2 CUDA devices")):
        train.check_device('cuda:2')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)
    train.check_device('auto')
    train.check_config(SimpleNamespace(**train.DEFAULTS))  # the defaults pass on any machine


def test_complete_model_args_derives_what_an_older_checkpoint_lacks():
    # Reference: GPTConfig's documented derivations by hand: head_dim = n_embd // n_head (48 // 4), n_kv_head 0
    # = n_head, the defaults for the fields an older checkpoint lacks. A field this model.py does not know
    # leaves the args as they are (compared as stored), not a TypeError.
    old = dict(block_size=16, vocab_size=64, n_layer=1, n_head=4, n_kv_head=0, n_embd=48, dropout=0.0)
    full = train.complete_model_args(old)
    assert full['head_dim'] == 12 and full['n_kv_head'] == 4 and full['rope_scaling_factor'] == \
        GPTConfig().rope_scaling_factor
    assert set(full) == set(train.MODEL_KEYS)
    newer = {**old, 'sliding_window': 128}
    assert train.complete_model_args(newer) == newer


# ----------------------------------------------------------------------------------------------------
# configurator

def test_unknown_key_suggests_the_closest():
    # Reference: the misspelled key and the real key it is closest to.
    with pytest.raises(ConfigError, match=r"'learning_rat' in flag '--learning_rat=1'.*'learning_rate'"):
        configure(train.DEFAULTS, ['--learning_rat=1'])
    with pytest.raises(ConfigError, match=r"'n_layers'.*'n_layer'"):
        configure(train.DEFAULTS, ['--n_layers=2'])


@pytest.mark.parametrize('typo, key', [('dropout_rate', 'dropout'), ('warmup', 'warmup_iters'),
                                       ('weight_decay_rate', 'weight_decay'), ('iters', 'max_iters')])
def test_unknown_key_suggests_the_intended_key_for_realistic_typos(typo, key):
    # Reference: the key each typo means, by hand (each within difflib's default cutoff of 0.6, none within 0.9)
    with pytest.raises(ConfigError, match=re.escape(f"unknown config key '{typo}' in flag '--{typo}=1'; "
                                                    f"did you mean '{key}'?")):
        configure(train.DEFAULTS, [f'--{typo}=1'])


def test_unknown_key_in_config_file(tmp_path):
    # Reference: the misspelled key in the file and its closest real key, and the file's name.
    path = tmp_path / 'cfg.py'
    path.write_text("n_layer = 2\nbatch_sise = 4\n")
    with pytest.raises(ConfigError) as e:
        configure(train.DEFAULTS, [str(path)])
    assert "'batch_sise'" in str(e.value) and "'batch_size'" in str(e.value) and 'cfg.py' in str(e.value)


@pytest.mark.parametrize('arg, key, got, expected', [
    ('--batch_size=abc', 'batch_size', "'abc' (str)", 'int'),
    ('--compile=1', 'compile', '1 (int)', 'bool'),
    ('--learning_rate=fast', 'learning_rate', "'fast' (str)", 'float'),
    ('--batch_size=1.5', 'batch_size', '1.5 (float)', 'int'),
    ('--dropout=True', 'dropout', 'True (bool)', 'float'),  # a bool is not a number here
    ('--batch_size=True', 'batch_size', 'True (bool)', 'int'),  # nor an int (though bool subclasses int)
])
def test_wrong_type_names_key_value_and_type(arg, key, got, expected):
    # Reference: the flag's key, its value as Python reads it (by hand) and the type of the key's default, in one
    # message (the flag alone holds the key and the value: a message of the flag only passed `key in msg`)
    hint = ': write True or False' if expected == 'bool' else ''
    with pytest.raises(ConfigError) as e:
        configure(train.DEFAULTS, [arg])
    assert str(e.value) == (f"config key '{key}' in flag '{arg}': got {got}, expected {expected} "
                            f"(default {train.DEFAULTS[key]!r}){hint}")


@pytest.mark.parametrize('flag', ['--help', '-h'])
def test_help_lists_every_key_with_its_default(flag, capsys):
    # Reference: train.DEFAULTS, each key once with its repr, the defaults even after a flag changed one;
    # no other argument is read, before --help or after it (a bad key, a config file that does not exist)
    with pytest.raises(SystemExit) as e:
        configure(train.DEFAULTS, ['--no_such_key=1', 'no_such_file.py', '--batch_size=3', flag, '--no_such_key=1'])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines == [f"  {k} = {v!r}" for k, v in train.DEFAULTS.items()]


def test_help_into_a_pipe_closed_early_ends_quietly():
    # Reference: a reader such as `head` that leaves before the list is written (the read end closed at once):
    # exit 0 and nothing on stderr, where Python's default is a BrokenPipeError traceback
    code = "import configurator; configurator.configure({'a': 1}, ['--help'])"
    proc = subprocess.Popen([sys.executable, '-c', code], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=SUBPROCESS_ENV)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == b'', err


def test_help_shows_the_comment_beside_each_default(tmp_path, capsys):
    # Reference: the comments written in the source below, by hand: a key's first line only, continued by the
    # comment-only lines under it at its column (not by one at another column, left or right, nor across a line of
    # code)
    src = tmp_path / 'script.py'
    src.write_text("""
\"\"\"a = 9  # not code: a docstring\"\"\"
a = 1          # the first
               # and its second line
               # and its third
b = 'x'        # one line
                 # deeper than b's: not its continuation
# a section heading
c = 2.0
d = dict(
    e=3,      # inside dict(...),
              # continued
    f=4, g=5,  # two keys, one comment
    # a heading inside
)
a = 7          # a later assignment: not a's comment
""")
    assert key_comments(str(src)) == {
        'a': 'the first and its second line and its third', 'b': 'one line', 'e': 'inside dict(...), continued',
        'f': 'two keys, one comment', 'g': 'two keys, one comment'}
    with pytest.raises(SystemExit):
        configure({'a': 1, 'c': 2.0}, ['--help'], str(src))
    assert capsys.readouterr().out.splitlines()[1:] == ["  a = 1  # the first and its second line and its third",
                                                     "  c = 2.0"]
    with pytest.raises(SystemExit):
        train.main(['-h'])
    lines = capsys.readouterr().out.splitlines()
    assert "  init_from = 'scratch'  # 'scratch', 'resume' from out_dir/ckpt.pt, or 'hf:PATH': the weights of a " \
        "Hugging Face Llama/Qwen3 directory (model shape from its config.json)" in lines
    assert "  seed = 1337" in lines and len(lines) == len(train.DEFAULTS) + 1


def test_config_file_that_is_a_directory_or_not_utf8(tmp_path):
    # Reference: the messages; without these checks, a directory was said not to exist and a Latin-1 file
    # ended in a UnicodeDecodeError traceback
    with pytest.raises(ConfigError, match=re.escape(f"config file '{tmp_path}' is a directory")):
        configure(train.DEFAULTS, [str(tmp_path)])
    path = tmp_path / 'latin1.py'
    path.write_bytes("out_dir = 'caf\u00e9'\n".encode('latin-1'))
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' is not UTF-8 text (byte 14)")):
        configure(train.DEFAULTS, [str(path)])
    path.write_bytes(b'\xef\xbb\xbfn_layer = 3\n')  # UTF-8 with a byte-order mark, as Python reads it too
    assert configure(train.DEFAULTS, [str(path)])['n_layer'] == 3


def test_a_string_key_takes_a_flag_that_reads_as_another_literal_as_its_text():
    # Reference: the text after '=' as written: a string key's value is its flag's text whatever Python literal
    # it also reads as (a prompt of digits, a directory named 2024 or None); a quoted string is unquoted.
    import sample
    cfg = configure(sample.DEFAULTS, ['--start=42', '--out_dir=2024', '--ckpt=None', "--device='cpu'"])
    assert (cfg['start'], cfg['out_dir'], cfg['ckpt'], cfg['device']) == ('42', '2024', 'None', 'cpu')


def test_wrong_type_in_config_file(tmp_path):
    # Reference: the key, the value and the default's type, as for flags, and the file that set it, by hand
    path = tmp_path / 'cfg.py'
    path.write_text("batch_size = 'big'\n")
    with pytest.raises(ConfigError, match=re.escape(f"config key 'batch_size' in config file '{path}': got 'big' "
                                                    f"(str), expected int (default {train.DEFAULTS['batch_size']!r})")):
        configure(train.DEFAULTS, [str(path)])


def test_a_key_set_twice_in_a_config_file_or_by_two_flags_takes_the_last_value(tmp_path):
    # Reference: Python's own run of the file (runpy), where the later assignment wins; for flags, the README's rule
    # (a script appends flags to override its own)
    path = tmp_path / 'cfg.py'
    path.write_text("n_layer = 3\nbatch_size = 5\nn_layer = 4\n")
    ran = runpy.run_path(str(path))
    cfg = configure(train.DEFAULTS, [str(path)])
    assert (cfg['n_layer'], cfg['batch_size']) == (ran['n_layer'], ran['batch_size']) == (4, 5)
    assert configure(train.DEFAULTS, ['--learning_rate=1e-3', '--learning_rate=2e-3'])['learning_rate'] == 2e-3


def test_int_accepted_for_float(tmp_path):
    # Reference: the float value of the int given; ints stay ints, strings stay strings.
    path = tmp_path / 'cfg.py'
    path.write_text('"""a docstring is fine"""\nmin_lr = 0\n')
    cfg = configure(train.DEFAULTS, ['--learning_rate=1', str(path), '--out_dir=123', '--n_layer=3'])
    assert cfg['learning_rate'] == 1.0 and type(cfg['learning_rate']) is float
    assert cfg['min_lr'] == 0.0 and type(cfg['min_lr']) is float
    assert cfg['out_dir'] == '123' and cfg['n_layer'] == 3 and type(cfg['n_layer']) is int
    assert train.DEFAULTS['learning_rate'] == 6e-4  # the defaults are not modified


@pytest.mark.parametrize('source', [
    "learning_rate = open(r'{flag}', 'w').close() or 1e-3\n",
    "import os\nos.system('touch {flag}')\n",
    "n_layer = __import__('os').system('touch {flag}')\n",
    "open(r'{flag}', 'w').close()\n",
    "n_layer = 2\nif True:\n    open(r'{flag}', 'w').close()\n",
], ids=['call-in-value', 'import', 'dunder-import', 'bare-call', 'if-block'])
def test_config_file_is_never_executed(tmp_path, source):
    # Reference: a file the code would create if it ran; it must not exist after the ConfigError.
    flag = tmp_path / 'executed'
    path = tmp_path / 'evil.py'
    path.write_text(source.format(flag=flag))
    with pytest.raises(ConfigError, match='line'):
        configure(train.DEFAULTS, [str(path)])
    assert not flag.exists()


def test_later_arguments_override_earlier(tmp_path):
    # Reference: argv order; the last mention of a key wins, a flag over a file, a flag or a file over a file;
    # but a file that would override an earlier flag is an error naming both (the flag would silently lose)
    a, b = tmp_path / 'a.py', tmp_path / 'b.py'
    a.write_text("n_layer = 3\nbatch_size = 5\n")
    b.write_text("n_layer = 4\n")
    assert configure(train.DEFAULTS, [str(a), '--n_layer=7'])['n_layer'] == 7
    with pytest.raises(ConfigError, match=re.escape(f"config file '{a}' sets 'n_layer', which the flag "
                                                    "'--n_layer=7' before it set: ")):
        configure(train.DEFAULTS, ['--n_layer=7', str(a)])
    assert configure(train.DEFAULTS, ['--n_head=2', str(a)])['n_layer'] == 3  # a flag the file leaves alone
    assert configure(train.DEFAULTS, [str(a), str(b)])['n_layer'] == 4
    assert configure(train.DEFAULTS, [str(b), str(a)])['n_layer'] == 3
    assert configure(train.DEFAULTS, ['--n_layer=7', '--n_layer=8'])['n_layer'] == 8
    cfg = configure(train.DEFAULTS, [str(a), str(b)])
    assert cfg['batch_size'] == 5 and cfg['n_head'] == train.DEFAULTS['n_head']


def test_flag_value_is_after_the_first_equals_and_a_string_may_be_quoted():
    # Reference: the text after the first '=', as written or without its quotes for a string key
    cfg = configure(train.DEFAULTS, ['--out_dir=a=b', "--data_dir='data/x y'", '--wandb_run_name="run 1"'])
    assert (cfg['out_dir'], cfg['data_dir'], cfg['wandb_run_name']) == ('a=b', 'data/x y', 'run 1')


@pytest.mark.parametrize('flag', ['--out_dir', '--compile'])
def test_flag_without_value_is_an_error(flag):
    # Reference: the message; a string key must not silently become ''
    with pytest.raises(ConfigError, match=re.escape(f"flag '{flag}' has no value: write {flag}=VALUE")):
        configure(train.DEFAULTS, [flag])


@pytest.mark.parametrize('source, message', [
    ("n_layer = 2\n\nbatch_size = (4\n", "line 3: '(' was never closed"),
    ("n_layer = n_head = 2\n", "line 1: only `name = literal` assignments are allowed, got: n_layer = n_head = 2"),
    ("n_layer, n_head = 2, 2\n", "line 1: only `name = literal` assignments are allowed, got: n_layer, n_head = 2, 2"),
    ("n_layer = 2\nn_head = n_layer * 2\n", "line 2: the value of 'n_head' is not a literal (expressions are not "
                                             "evaluated): n_layer * 2"),
], ids=['syntax', 'chained', 'tuple', 'expression'])
def test_config_file_errors_name_the_line(tmp_path, source, message):
    # Reference: the line (counted here by hand), the key and the source text of the statement refused
    path = tmp_path / 'cfg.py'
    path.write_text(source)
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' {message}")):
        configure(train.DEFAULTS, [str(path)])


def test_value_that_literal_eval_refuses_with_a_type_error_is_a_config_error(tmp_path):
    # Reference: the messages. ast.literal_eval raises TypeError, not ValueError, for an unhashable dict key:
    # it was a traceback
    with pytest.raises(ConfigError, match=re.escape("config key 'n_layer' in flag '--n_layer={[1]: 2}': got "
                                                    "'{[1]: 2}' (str), expected int")):
        configure(train.DEFAULTS, ['--n_layer={[1]: 2}'])
    path = tmp_path / 'cfg.py'
    path.write_text("n_layer = {[1]: 2}\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' line 1: the value of 'n_layer' is not a "
                                                    "literal")):
        configure(train.DEFAULTS, [str(path)])


def test_an_integer_beyond_a_floats_range_is_a_config_error(tmp_path):
    # Reference: the message. float() of it raised OverflowError, a traceback (1e999 parses as inf, which
    # check_config refuses by name)
    with pytest.raises(ConfigError, match=re.escape("config key 'learning_rate' in flag '--learning_rate=1000") +
                       r"0*': " + re.escape("an integer of 401 digits is beyond a float's range")):
        configure(train.DEFAULTS, ['--learning_rate=1' + '0' * 400])


def test_missing_config_file_is_named(tmp_path, monkeypatch):
    # Reference: the path given and the reason; where the name as typed lacks its folder or its .py, the file meant
    path = tmp_path / 'nope.py'
    with pytest.raises(ConfigError) as e:
        configure(train.DEFAULTS, [str(path)])
    assert str(e.value) == f"config file '{path}' does not exist"
    (tmp_path / 'config').mkdir()
    (tmp_path / 'config' / 'small.py').write_text('n_layer = 2\n')
    monkeypatch.chdir(tmp_path)
    for typed in ('small', 'small.py', 'config/small'):
        with pytest.raises(ConfigError) as e:
            configure(train.DEFAULTS, [typed])
        assert str(e.value) == f"config file '{typed}' does not exist; did you mean 'config/small.py'?"


def test_another_scripts_config_file_is_named_as_such(tmp_path):
    # Reference: the keys of config/train_small.py that sample.py lacks, read from the file. A file of mostly unknown
    # keys is another script's (the hint was the closest key to its first: did you mean 'out_dir'?); one unknown key
    # in a file of known ones is a typo, and gets the closest real key
    import sample
    path = os.path.join(HERE, 'config', 'train_small.py')
    unknown = [k for k in read_config_file(path) if k not in sample.DEFAULTS]
    with pytest.raises(ConfigError) as e:
        configure(sample.DEFAULTS, [path])
    assert str(e.value) == (f"config file '{path}' sets {len(unknown)} keys this script does not have "
                            f"({', '.join(unknown[:4])}, ...): another script's config? --help lists this one's keys")
    typo = tmp_path / 'typo.py'
    typo.write_text("out_dir = 'x'\nnum_samples = 2\ntop_kk = 5\n")
    with pytest.raises(ConfigError, match=re.escape(f"unknown config key 'top_kk' in config file '{typo}'; did you "
                                                    f"mean 'top_k'?")):
        configure(sample.DEFAULTS, [str(typo)])
    # the rule at its edges: two typos of three keys are typos (more than two unknown keys, and more than half of
    # the file, make another script's), and so are three of six (half, not most); three of five are another script's
    two = tmp_path / 'two.py'
    two.write_text("out_dir = 'x'\nnum_sample = 2\ntop_kk = 5\n")
    half = tmp_path / 'half.py'
    half.write_text("out_dir = 'x'\nckpt = 'best.pt'\nstart = 'a'\nnum_sample = 2\ntop_kk = 5\nseeed = 1\n")
    for path in (two, half):
        with pytest.raises(ConfigError, match="unknown config key 'num_sample'.*did you mean 'num_samples'"):
            configure(sample.DEFAULTS, [str(path)])
    three = tmp_path / 'three.py'
    three.write_text("out_dir = 'x'\nnum_samples = 2\nalpha = 1\nbeta = 2\ngamma = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file '{three}' sets 3 keys this script does not have "
                                                    f"(alpha, beta, gamma): another script's config?")):
        configure(sample.DEFAULTS, [str(three)])


# ----------------------------------------------------------------------------------------------------
# the real scripts: train, resume, sample

TEXT = ''.join(f"{w}{' ' if i % 7 else chr(10)}" for i, w in enumerate(
    ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
     "You are all resolved rather to die than to famish? Resolved. resolved. ").split() * 12))

TRAIN_FLAGS = ['--device=cpu', '--dtype=float32', '--n_layer=2', '--n_head=4', '--n_kv_head=2', '--n_embd=32',
               '--block_size=16', '--batch_size=4', '--eval_interval=4', '--eval_iters=2', '--log_interval=1',
               '--dropout=0.1', '--learning_rate=1e-2', '--min_lr=1e-3', '--warmup_iters=2',
               '--lr_decay_iters=8']  # explicit: lr_decay_iters=0 would follow max_iters, which run B changes


SUBPROCESS_ENV = dict(os.environ, OMP_NUM_THREADS='1')  # see torch.set_num_threads(1) above


def run_script(*args):
    proc = subprocess.run([sys.executable, *args], cwd=HERE, capture_output=True, text=True, timeout=180,
                          env=SUBPROCESS_ENV)
    assert proc.returncode == 0, f"{args}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Run A: 8 iterations straight. Run B: 4 iterations, then resumed to 8."""
    root = tmp_path_factory.mktemp('runs')
    data_dir = root / 'data'
    (root / 'input.txt').write_text(TEXT)
    meta = prepare(input=str(root / 'input.txt'), tokenizer='char', data_dir=str(data_dir))
    a, b = root / 'a', root / 'b'
    common = TRAIN_FLAGS + [f'--data_dir={data_dir}']
    run_script('train.py', *common, f'--out_dir={a}', '--max_iters=8')
    run_script('train.py', *common, f'--out_dir={b}', '--max_iters=4')
    resumed = run_script('train.py', *common, f'--out_dir={b}', '--init_from=resume', '--max_iters=8')
    return SimpleNamespace(a=a, b=b, meta=meta, resumed_stdout=resumed.stdout)


TRAIN_KEYS = {'iter', 'tokens', 'loss', 'grad_norm', 'lr', 'tokens_per_sec', 'mfu', 'peak_mem_mb', 'time_s'}
EVAL_KEYS = {'iter', 'tokens', 'train_loss', 'val_loss', 'train_bpb', 'val_bpb', 'time_s'}


def test_metrics_have_the_documented_keys(runs):
    # Reference: the documented keys, and the loop's order: eval at 0, 4, 8, a training line per step.
    lines = read_metrics(runs.a)
    kinds = [('eval' if set(r) == EVAL_KEYS else 'train' if set(r) == TRAIN_KEYS else r, r['iter']) for r in lines]
    assert kinds == ([('eval', 0)] + [('train', i) for i in range(1, 5)] + [('eval', 4)]
                     + [('train', i) for i in range(5, 9)] + [('eval', 8)])
    for r in lines:
        if 'loss' in r:
            assert r['mfu'] is None and r['tokens_per_sec'] > 0 and r['peak_mem_mb'] > 0
            assert r['lr'] == get_lr(r['iter'] - 1, opt_cfg(learning_rate=1e-2, min_lr=1e-3, warmup_iters=2,
                                                             lr_decay_iters=8, max_iters=8))
            assert math.isfinite(r['loss'])


def test_the_logged_gradient_norm_is_its_steps_norm_before_clipping(runs, tmp_path, monkeypatch):
    # Reference: the square root of the sum of the squared gradients, taken by hand from the gradients the optimizer
    # is about to apply (a step pre-hook). With grad_clip=0 those are the step's own gradients: each log line (every
    # 2nd step) must give its own step's norm, not another step's. With a clip far below it, the first step (the
    # same weights and batch) must log the same norm, while the optimizer gets gradients clipped to the clip. Under
    # fp16 the GradScaler's scale (65536 at first) must be out of the norm: the optimizer gets unscaled gradients.
    configure = train.configure_optimizer

    def spied(*args, **kwargs):
        optimizer = configure(*args, **kwargs)
        hand.append([])
        optimizer.register_step_pre_hook(lambda opt, a, k: hand[-1].append(math.sqrt(sum(
            float(p.grad.double().pow(2).sum()) for group in opt.param_groups for p in group['params']
            if p.grad is not None))))
        return optimizer
    hand = []
    monkeypatch.setattr(train, 'configure_optimizer', spied)
    flags = TRAIN_FLAGS + [f'--data_dir={runs.a.parent / "data"}', '--eval_at_start=False']
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert train.main(flags + [f'--out_dir={tmp_path / "a"}', '--max_iters=6', '--log_interval=2',
                                   '--grad_clip=0']) == 0
        assert train.main(flags + [f'--out_dir={tmp_path / "b"}', '--max_iters=1', '--log_interval=1',
                                   '--grad_clip=1e-4']) == 0
        assert train.main(flags + [f'--out_dir={tmp_path / "fp16"}', '--max_iters=1', '--log_interval=1',
                                   '--grad_clip=0', '--dtype=float16']) == 0
    (steps, clipped, fp16), records = hand, read_metrics(tmp_path / 'a')
    logged = {r['iter']: r['grad_norm'] for r in records if 'loss' in r}
    assert len(steps) == 6 and len(set(steps)) == 6 and min(steps) > 1e-2
    assert logged == pytest.approx({i: steps[i - 1] for i in (2, 4, 6)}, rel=1e-5)
    printed_norms = re.findall(r'^iter (\d+): loss [\d.]+, grad norm (\S+), lr', printed.getvalue(), re.M)
    assert printed_norms[:3] == [(str(i), f"{logged[i]:.4g}") for i in (2, 4, 6)]
    assert clipped == pytest.approx([1e-4], rel=1e-4)
    assert read_metrics(tmp_path / 'b')[0]['grad_norm'] == pytest.approx(steps[0], rel=1e-5)
    assert read_metrics(tmp_path / 'fp16')[0]['grad_norm'] == pytest.approx(fp16[0], rel=1e-5)
    assert fp16[0] == pytest.approx(steps[0], rel=1e-2)  # fp16's rounding only


def test_resume_is_bitwise_identical(runs):
    # Reference: run A, trained straight through; run B stopped at 4 and resumed must log the same losses
    # and end with bitwise-equal weights and optimizer state (dropout 0.1 makes the RNG state matter).
    assert 'resuming from' in runs.resumed_stdout
    assert deterministic(read_metrics(runs.b)) == deterministic(read_metrics(runs.a))
    ca, cb = (torch.load(d / 'ckpt.pt', weights_only=True) for d in (runs.a, runs.b))
    assert ca['iter_num'] == cb['iter_num'] == 8
    assert ca['model'].keys() == cb['model'].keys()
    for k in ca['model']:
        assert torch.equal(ca['model'][k], cb['model'][k]), k
    assert ca['optimizer']['state'].keys() == cb['optimizer']['state'].keys() and ca['optimizer']['state']
    for pa, pb in zip(ca['optimizer']['state'].values(), cb['optimizer']['state'].values()):
        assert pa.keys() == pb.keys() and pa, pa.keys()
        for k in pa:
            assert torch.equal(pa[k], pb[k]), k
    # and the run did train: the weights moved away from the first checkpoint's
    torch.manual_seed(train.DEFAULTS['seed'])  # train.py seeds, then builds the model
    model = GPT(GPTConfig(**ca['model_args']))
    assert not torch.equal(ca['model']['blocks.0.attn.qkv.weight'], model.blocks[0].attn.qkv.weight)
    assert (runs.a / 'best.pt').exists()


def test_deterministic_runs_repeat_bit_for_bit_compiled_on_two_threads(tmp_path, monkeypatch):
    # Reference: the first run. Compiled, inductor sums the embedding's gradient over the tokens with atomic adds,
    # in an order that varies from run to run on more than one thread: without deterministic, runs of this command
    # differed by about 5e-9 in the weights after 2 steps, each time tried. deterministic=True must make the second
    # run repeat the first bit for bit (weights and optimizer state). Its training loop runs with torch's
    # deterministic algorithms and inductor's deterministic mode (which torch's switch sets: no kernel chosen by
    # timing, as a GPU's max-autotune would; nothing to see on the CPU), and both are as they were once main returns.
    import torch._inductor.config as inductor_config  # what torch.use_deterministic_algorithms sets too
    seen, loop = [], train.train_loop
    monkeypatch.setattr(train, 'train_loop', lambda r: seen.append(
        (torch.are_deterministic_algorithms_enabled(), inductor_config.deterministic)) or loop(r))
    rng = np.random.default_rng(0)  # 8 ids: each embedding row is the sum of hundreds of tokens' gradients
    data = write_dataset(tmp_path / 'data', rng.integers(0, 8, 20_000), rng.integers(0, 8, 2_000), 8)
    flags = ['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=64', '--block_size=64',
             '--batch_size=32', '--max_iters=2', '--warmup_iters=0', '--lr_decay_iters=2', '--eval_iters=1',
             '--eval_at_start=False', '--compile=True', '--deterministic=True', f'--data_dir={data}']
    ckpts = []
    torch.set_num_threads(2)
    try:
        for run in 'ab':
            torch._dynamo.reset()
            with redirect_stdout(io.StringIO()):
                assert train.main(flags + [f'--out_dir={tmp_path / run}']) == 0
            ckpts.append(torch.load(tmp_path / run / 'ckpt.pt', weights_only=True))
            assert not torch.are_deterministic_algorithms_enabled() and not inductor_config.deterministic
    finally:
        torch.set_num_threads(1)
    assert seen == [(True, True)] * 2
    torch.manual_seed(train.DEFAULTS['seed'])  # the weights the runs started from (train.py seeds, then builds)
    assert not torch.equal(ckpts[0]['model']['wte.weight'], GPT(GPTConfig(**ckpts[0]['model_args'])).wte.weight)
    assert_same(ckpts[1]['model'], ckpts[0]['model'], 'model')
    assert_same(ckpts[1]['optimizer'], ckpts[0]['optimizer'], 'optimizer')


def test_sample_prints_text_from_the_vocabulary(runs):
    # Reference: the dataset's character set (meta.json) and the prompt '\n' plus 20 new characters.
    proc = run_script('sample.py', f'--out_dir={runs.a}', '--max_new_tokens=20', '--num_samples=1',
                      '--device=cpu')
    assert proc.stdout.endswith(SEPARATOR)
    text = proc.stdout[:-len(SEPARATOR)]
    assert len(text) == 21 and text[0] == '\n'
    assert set(text) <= set(runs.meta['chars'])


def test_sample_into_a_pipe_whose_reader_has_gone_ends_quietly(runs):
    # Reference: Python's docs' recipe for a closed pipe (`python sample.py | head -1`): no traceback, exit 0. Its
    # read end closed before the process writes (it imports torch first), every write meets a pipe with no reader
    proc = subprocess.Popen([sys.executable, 'sample.py', f'--out_dir={runs.a}', '--max_new_tokens=20',
                             '--num_samples=2', '--device=cpu'], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=180) == 0 and err == '', err


def test_sample_passes_its_sampling_settings_to_generate(tmp_path, monkeypatch, capsys):
    # Reference: greedy decoding by GPT.generate called here on the checkpoint's model, and the values given on
    # the command line. sample.py at --temperature=0, at --top_k=1 and at a --top_p below any token's probability
    # must print the greedy text; plain sampling at temperature 1 must not (the fresh model is near-uniform over
    # its 32 ids), so settings that never reached generate would fail. The values reach generate as given
    # (top_k=0: off), and without flags the defaults sample.py documents do (temperature 0.8, top_k 200; top_p
    # 1.0: off).
    import sample
    model = tiny_model().eval()
    chars = ''.join(chr(0x100 + i) for i in range(32))
    train.save_checkpoint(str(tmp_path / 'ckpt.pt'), {'model': model.state_dict(), 'model_args': model.config.to_dict(),
                                                      'meta': dict(tokenizer='char', vocab_size=32, chars=chars)})
    greedy = model.generate(torch.tensor([[3, 4, 5]] * 2), 20, temperature=0)
    greedy_text = sample_text(greedy.tolist(), chars)
    seen, generate = [], GPT.generate

    def spy(self, idx, max_new_tokens, **kwargs):
        seen.append({k: kwargs[k] for k in ('temperature', 'top_k', 'top_p')})
        return generate(self, idx, max_new_tokens, **kwargs)

    monkeypatch.setattr(GPT, 'generate', spy)

    def run(*flags):
        capsys.readouterr()
        sample.main([f'--out_dir={tmp_path}', '--device=cpu', '--dtype=float32', '--num_samples=2',
                     '--max_new_tokens=20', f'--start={chars[3:6]}', *flags])
        return capsys.readouterr().out

    assert run('--temperature=0') == greedy_text
    assert run('--temperature=1.0', '--top_k=1') == greedy_text
    assert run('--temperature=1.0', '--top_k=0', '--top_p=0.001') == greedy_text
    assert run('--temperature=1.0', '--top_k=0') != greedy_text
    run('--temperature=0.7', '--top_k=5', '--top_p=0.9')
    run()
    assert seen == [dict(temperature=0.0, top_k=200, top_p=1.0), dict(temperature=1.0, top_k=1, top_p=1.0),
                    dict(temperature=1.0, top_k=None, top_p=0.001), dict(temperature=1.0, top_k=None, top_p=1.0),
                    dict(temperature=0.7, top_k=5, top_p=0.9), dict(temperature=0.8, top_k=200, top_p=1.0)]


SEPARATOR = '\n' + '-' * 80 + '\n'  # sample.py prints it after each sample


def sample_text(rows, chars):
    """What sample.py prints for samples of ids of the character vocabulary chars."""
    return ''.join(''.join(chars[i] for i in row) + SEPARATOR for row in rows)


def sample_checkpoint(path):
    """A fresh tiny model (block_size 16, near-uniform over its 32 ids) saved as a checkpoint of 32 characters."""
    model = tiny_model().eval()
    chars = ''.join(chr(0x100 + i) for i in range(32))
    train.save_checkpoint(str(path / 'ckpt.pt'), {'model': model.state_dict(), 'model_args': model.config.to_dict(),
                                                  'meta': dict(tokenizer='char', vocab_size=32, chars=chars)})
    return model, chars


def test_sample_prompt_from_a_file_long_prompts_and_the_seed(tmp_path, capsys):
    # Reference: greedy decoding by GPT.generate called here on the last block_size (16) characters of a longer
    # prompt; the same prompt given inline and through --start=FILE:; the prompt alone at max_new_tokens=0; the
    # same text for the same --seed and another for another seed (8 tokens, near-uniform over 32 ids)
    import sample
    model, chars = sample_checkpoint(tmp_path)

    def run(*flags):
        capsys.readouterr()
        sample.main([f'--out_dir={tmp_path}', '--device=cpu', '--dtype=float32', '--num_samples=1',
                     '--max_new_tokens=8', *flags])
        return capsys.readouterr()

    prompt = ''.join(chars[5 * i % 32] for i in range(20))  # no character twice: 4 past block_size
    want = model.generate(torch.tensor([[chars.index(c) for c in prompt[-16:]]]), 8, temperature=0)[0].tolist()
    printed = run(f'--start={prompt}', '--temperature=0')
    assert printed.out == sample_text([want], chars)
    assert "the prompt's 20 tokens are cut to the model's block_size, its last 16" in printed.err
    assert 'cut' not in run(f'--start={prompt[:16]}', '--temperature=0').err  # exactly block_size: whole
    (tmp_path / 'prompt.txt').write_text(prompt[:6], encoding='utf-8')
    assert run(f'--start=FILE:{tmp_path / "prompt.txt"}', '--temperature=0').out == \
        run(f'--start={prompt[:6]}', '--temperature=0').out
    assert run(f'--start={prompt[:6]}', '--max_new_tokens=0').out == prompt[:6] + SEPARATOR
    sampled = [run(f'--start={prompt[:6]}', '--temperature=1.0', '--top_k=0', f'--seed={seed}').out
               for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    with pytest.raises(ConfigError, match=re.escape(f"--start=FILE:{tmp_path / 'none.txt'}: cannot read ")):
        run(f'--start=FILE:{tmp_path / "none.txt"}')
    latin1 = tmp_path / 'latin1.txt'
    latin1.write_bytes(b'\xe9')  # not UTF-8: the codec's UnicodeDecodeError, a ValueError
    with pytest.raises(ConfigError, match=re.escape(f"--start=FILE:{latin1}: cannot read {latin1} ('utf-8' codec "
                                                    "can't decode byte 0xe9")):
        run(f'--start=FILE:{latin1}')
    # a file's line ends are the prompt's, as prepare_data.py reads text (bytes as they are): a model of text with
    # '\r\n' is prompted with '\r\n', not '\n'
    train.save_checkpoint(str(tmp_path / 'crlf.pt'), {'model': model.state_dict(), 'model_args': model.config.to_dict(),
                                                      'meta': dict(tokenizer='char', vocab_size=32,
                                                                   chars='\n\r' + chars[2:])})
    (tmp_path / 'crlf.txt').write_bytes(f'{chars[5]}\r\n{chars[6]}\r\r\n'.encode())
    assert run('--ckpt=crlf.pt', f'--start=FILE:{tmp_path / "crlf.txt"}', '--max_new_tokens=0').out == \
        f'{chars[5]}\r\n{chars[6]}\r\r\n' + SEPARATOR


def test_sample_draws_each_sample_on_its_own_as_one_batch(tmp_path, capsys):
    # Reference: GPT.generate called here as sample.py documents its samples, one batch of the prompt repeated
    # num_samples times, with the seed's generator; at temperature 1 over a near-uniform 32 ids, 4 rows of 8 tokens
    # are pairwise distinct (samples that shared one draw would be 4 copies of one row)
    import sample
    model, chars = sample_checkpoint(tmp_path)
    prompt = torch.tensor([[3, 4, 5]])
    want = model.generate(prompt.repeat(4, 1), 8, temperature=1.0, vocab_limit=32,
                          generator=torch.Generator().manual_seed(5)).tolist()
    assert len({tuple(row) for row in want}) == 4
    sample.main([f'--out_dir={tmp_path}', '--device=cpu', '--dtype=float32', '--num_samples=4', '--max_new_tokens=8',
                 '--temperature=1', '--top_k=0', '--seed=5', f'--start={chars[3:6]}'])
    assert capsys.readouterr().out == sample_text(want, chars)


@pytest.mark.parametrize('use_cache, check', [(True, 1), (False, 1), (True, 4), (True, model_module.STOP_CHECK)])
def test_generate_ends_each_row_at_its_stop_token(use_cache, check, monkeypatch):
    # Reference: the same seeded draws without stop_token. Each row must equal its unstopped draw up to and
    # including its first stop, then hold the stop token, also between the last row's stop and the look that sees
    # it; generation ends at the first look (every `check` tokens) after every row has stopped, and runs its whole
    # length while one has not (3 rows of 30 tokens drawn from a near-uniform 32 ids; every token that all rows
    # draw, so that the rows have all stopped at several distances before a look).
    monkeypatch.setattr(model_module, 'STOP_CHECK', check)
    model = tiny_model().eval()
    prompt = torch.tensor([[3, 4, 5]] * 3)

    def draw(stop):
        return model.generate(prompt, 30, temperature=1.0, use_cache=use_cache, stop_token=stop,
                              generator=torch.Generator().manual_seed(7))

    full = draw(None)
    new = full[:, 3:].tolist()
    in_all = [t for t in range(32) if all(t in row for row in new)]
    in_some = [t for t in range(32) if t in new[0] and not all(t in row for row in new)]
    assert in_all and in_some  # (the seed gives both kinds of stop)
    lengths, waits = [], []
    for stop in [*in_all, in_some[0]]:
        got = draw(stop)
        ends = [row.index(stop) + 1 if stop in row else 31 for row in new]  # tokens up to each row's stop
        length = min(30, -(-max(ends) // check) * check)  # at the first look after the last row's stop
        assert got.size(1) == 3 + length, (stop, ends)
        for row, end, got_row, full_row in zip(new, ends, got.tolist(), full.tolist()):
            assert got_row[:3 + end] == full_row[:3 + end]
            assert got_row[3 + end:] == [stop] * (length - end)
        lengths.append(length)
        if max(ends) <= 30:  # every row stopped
            waits.append(length - max(ends))
    assert min(lengths) < 30 and (check == 1 or max(waits) > 0)  # (an early end; rows held until a look)


def test_sample_ends_each_sample_at_the_end_of_text_token(tmp_path, capsys, monkeypatch):
    # Reference: GPT.generate's draws without a stop, cut here at each row's first eot_token after the prompt
    # (the token meta.json names, one of the prompt's, which must not end anything), generate told to stop there.
    # --stop_at_eot=False prints every draw; a checkpoint without eot_token (character data) prints every draw. An
    # eot that the first sample draws first prints that sample as its prompt alone, with 24 new tokens and with 1
    # (where the stop is its last).
    import sample
    model, chars = sample_checkpoint(tmp_path)
    prompt = torch.tensor([[3, 4, 5]])
    rows = model.generate(prompt.repeat(4, 1), 24, temperature=1.0, vocab_limit=32,
                          generator=torch.Generator().manual_seed(5)).tolist()
    eot = next(t for t in (3, 4, 5) if 1 <= sum(t in row[3:] for row in rows) < 4)  # ends some samples, not all
    first = rows[0][3]
    stops, generate = [], GPT.generate

    def spy(self, *args, **kwargs):
        stops.append(kwargs['stop_token'])
        return generate(self, *args, **kwargs)
    monkeypatch.setattr(GPT, 'generate', spy)
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    for name, token in ('eot.pt', eot), ('first.pt', first):
        ckpt['meta']['eot_token'] = token
        train.save_checkpoint(str(tmp_path / name), ckpt)

    def run(*flags, new=24):
        sample.main([f'--out_dir={tmp_path}', '--device=cpu', '--dtype=float32', '--num_samples=4',
                     f'--max_new_tokens={new}', '--temperature=1', '--top_k=0', '--seed=5', f'--start={chars[3:6]}',
                     *flags])
        return capsys.readouterr().out

    def cut(rows, stop):
        return [row[:3 + row[3:].index(stop)] if stop in row[3:] else row for row in rows]

    assert cut(rows, eot) != rows
    assert run('--ckpt=eot.pt') == sample_text(cut(rows, eot), chars)
    assert run('--ckpt=eot.pt', '--stop_at_eot=False') == run() == sample_text(rows, chars)
    for new in 24, 1:
        drawn = cut([row[:3 + new] for row in rows], first)
        assert drawn[0] == [3, 4, 5] and run('--ckpt=first.pt', new=new) == sample_text(drawn, chars)
    assert stops == [eot, None, None, first, first]


def test_sample_generates_under_the_autocast_of_its_dtype(tmp_path, monkeypatch):
    # Reference: torch's own autocast state (torch.is_autocast_enabled / get_autocast_dtype) seen inside
    # GPT.generate: --dtype=bfloat16 on the CPU samples under CPU bf16 autocast, --dtype=float32 without
    import sample
    sample_checkpoint(tmp_path)
    seen, generate = [], GPT.generate

    def spy(self, *args, **kwargs):
        seen.append((torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu')))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GPT, 'generate', spy)
    for dtype in ('bfloat16', 'float32'):
        sample.main([f'--out_dir={tmp_path}', '--device=cpu', f'--dtype={dtype}', '--num_samples=1',
                     '--max_new_tokens=2', '--start=\u0103'])
    assert seen[0] == (True, torch.bfloat16) and seen[1][0] is False, seen


@pytest.mark.parametrize('flag, message', [
    ('--num_samples=0', 'num_samples=0 is out of range'), ('--max_new_tokens=-1', 'max_new_tokens=-1 is out of range'),
    ('--temperature=-0.5', 'temperature=-0.5 is out of range'), ('--top_k=-1', 'top_k=-1 is out of range'),
    ('--top_p=0.0', 'top_p=0.0 is out of range'), ('--top_p=1.5', 'top_p=1.5 is out of range'),
    ('--start=', '--start is empty'),
    ('--temperature=1e39', 'temperature=1e+39 is out of range'),  # inf in float32: a sampling traceback
    ('--seed=-1', 'seed=-1 is out of range'), ('--seed=9223372036854775808', 'seed=9223372036854775808 is out'),
    ('--start=xyz', "--start: characters not in the dataset's vocabulary: 'xyz'"),  # the encoder's ValueError
])
def test_sample_settings_out_of_range_are_config_errors_naming_them(tmp_path, flag, message):
    # Reference: the messages; a ConfigError is sample.py's one-line error, a ValueError from sample_next a traceback
    import sample
    sample_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        sample.main([f'--out_dir={tmp_path}', '--device=cpu', '--dtype=float32', flag])


def test_train_cli_reports_config_errors_without_traceback(tmp_path):
    # Reference: the misspelled flag and its suggestion on stderr, a non-zero exit, no traceback.
    proc = subprocess.run([sys.executable, 'train.py', '--learning_rat=1'], cwd=HERE, capture_output=True,
                          text=True, timeout=60, env=SUBPROCESS_ENV)
    assert proc.returncode != 0
    assert "'learning_rat'" in proc.stderr and "'learning_rate'" in proc.stderr
    assert 'Traceback' not in proc.stderr


# ----------------------------------------------------------------------------------------------------
# the chunked loss (model.ChunkedCrossEntropy) against the plain one, and FLOPs against torch's counter

def loss_and_grads(model, x, y, chunk, label_smoothing=0.1, net=None, autocast=nullcontext()):
    """The loss and every parameter's gradient, with loss_chunk_tokens=chunk (0: the plain loss)."""
    model.loss_chunk_tokens = chunk
    model.zero_grad(set_to_none=True)
    with autocast:
        _, loss = (model if net is None else net)(x, y, label_smoothing=label_smoothing)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize('tie, chunk, checkpointing', [(True, 7, 'none'), (False, 7, 'none'), (True, 5, 'full'),
                                                       (False, 1000, 'selective'), (True, 48, 'none')])
def test_chunked_loss_matches_the_plain_loss_in_float64(tie, chunk, checkpointing):
    # Reference: the plain loss (F.cross_entropy over all the logits, autograd's gradients) in float64,
    # label smoothing 0.1, on 3 x 16 = 48 tokens: chunks of 7 (the last one 6 tokens), 5, 1000 (one chunk), 48.
    model = tiny_model(dtype=torch.float64, tie_embeddings=tie)
    randomize_norms(model)
    x, y = random_batch(0, 3, 16, 32)
    want_loss, want = loss_and_grads(model, x, y, 0)
    model.activation_checkpointing = checkpointing
    loss, grads = loss_and_grads(model, x, y, chunk)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-10, atol=1e-14, msg=name)
    with torch.no_grad():  # no gradients to compute: the loss alone
        torch.testing.assert_close(model(x, y, label_smoothing=0.1)[1], want_loss, rtol=1e-12, atol=0)


def test_chunked_loss_under_bf16_autocast_is_as_close_as_the_plain_loss():
    # Reference: float32 without autocast. Under bf16 autocast the chunked loss must land as close to it as the
    # plain loss does (both round the same matmuls to bf16; a wrong gradient would be off by far more).
    model = tiny_model(n_layer=1, tie_embeddings=False)
    x, y = random_batch(0, 4, 16, 32)
    want_loss, want = loss_and_grads(model, x, y, 0)
    bf16 = torch.autocast('cpu', torch.bfloat16)
    (plain_loss, plain), (loss, grads) = (loss_and_grads(model, x, y, c, autocast=bf16) for c in (0, 7))
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads.values())
    assert abs(loss - want_loss) <= 2 * abs(plain_loss - want_loss) + 1e-6
    for name in want:
        err, plain_err = (grads[name] - want[name]).norm(), (plain[name] - want[name]).norm()
        assert err <= 2 * plain_err + 1e-7 * want[name].norm(), (name, err, plain_err)


@pytest.mark.parametrize('label_smoothing, cap', [(0.1, 0.0), (0.0, 3.0)])
def test_chunked_loss_compiles_to_the_same_loss_and_gradients(label_smoothing, cap):
    # Reference: the plain loss, eager. torch.compile traces the chunked loss (and full activation
    # checkpointing, which it must compile too) to the same loss and gradients, and evaluates without them;
    # what it traces subtracts the targets as a select (torch.where: cross_entropy_chunk's compiled form).
    # The aot_eager backend runs what traces them (dynamo, AOTAutograd) without inductor's C++ build, which
    # takes minutes on a busy 2-core CPU; bench.py's compile rung runs inductor on the chunked loss.
    model = tiny_model(tie_embeddings=False, logit_softcap=cap)
    x, y = random_batch(0, 3, 16, 32)
    want_loss, want = loss_and_grads(model, x, y, 0, label_smoothing)
    model.activation_checkpointing = 'full'
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.extend(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
        return torch._dynamo.lookup_backend('aot_eager')(gm, example_inputs)
    compiled = torch.compile(model, backend=backend)
    loss, grads = loss_and_grads(model, x, y, 7, label_smoothing, net=compiled)
    assert any('torch.where' in code for code in graphs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y, label_smoothing=label_smoothing)[1], want_loss, rtol=1e-6, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize('label_smoothing, cap', [(0.0, 0.0), (0.1, 0.0), (0.1, 3.0)])
def test_chunk_gradient_takes_the_same_values_in_its_compiled_form(monkeypatch, label_smoothing, cap):
    # Reference: the eager form (an indexed update of the targets' entries), in float64. The form torch.compile
    # traces (a select over the whole chunk, which inductor fuses) gives the same loss and gradient, bit for bit.
    from model import cross_entropy_chunk
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g, dtype=torch.float64), torch.randn(40, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 40, (10,), generator=g)
    want_loss, want = cross_entropy_chunk(x, w, y, label_smoothing, cap)
    loss, grad = cross_entropy_chunk(x, w, y, label_smoothing, cap, with_grad=False)  # evaluation: the loss alone
    assert torch.equal(loss, want_loss) and grad is None
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    loss, grad = cross_entropy_chunk(x, w, y, label_smoothing, cap)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want)
    assert (want[torch.arange(10), y] < 0).all()  # softmax minus the target distribution, times 1 - tanh^2 with a cap
    assert cap or (want.sum(1).abs() < 1e-12).all()  # without the cap, each row sums to 0


@pytest.mark.parametrize('label_smoothing', [0.0, 0.1])
def test_ignored_targets_count_in_neither_loss(monkeypatch, label_smoothing):
    # Reference: the cross-entropy written out in float64 over the tokens whose target is not IGNORE_INDEX
    # alone (as F.cross_entropy's ignore_index has it), from the logits of a forward without targets, and its
    # autograd gradients. The chunked loss (chunks of 7, eager and in its compiled form) and the plain one
    # give that loss and those gradients; a token ignored everywhere gives NaN, as F.cross_entropy does.
    from model import IGNORE_INDEX
    model = tiny_model(dtype=torch.float64, tie_embeddings=False)
    x, y = random_batch(0, 3, 16, 32)
    y = y.clone()  # (a view of the tokens x is a view of too)
    y[0, :5], y[2, 7] = IGNORE_INDEX, IGNORE_INDEX
    kept = y != IGNORE_INDEX
    model.zero_grad(set_to_none=True)
    logp = model(x)[0].log_softmax(dim=-1)[kept]  # (kept tokens, V)
    per_token = -(1 - label_smoothing) * logp.gather(1, y[kept][:, None]).squeeze(1) - label_smoothing * logp.mean(1)
    want_loss = per_token.sum() / kept.sum()
    # ... which is F.cross_entropy's with its default ignore_index (-100, what Hugging Face's data collators write)
    plain = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), label_smoothing=label_smoothing)
    torch.testing.assert_close(want_loss, plain, rtol=1e-12, atol=0)
    want_loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for chunk, compiling in ((7, False), (7, True), (0, False)):
        monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: compiling)  # cross_entropy_chunk's two forms
        loss, grads = loss_and_grads(model, x, y, chunk, label_smoothing)
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-12, atol=0)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-10, atol=1e-14, msg=(chunk, name))
    for chunk in (7, 0):
        model.loss_chunk_tokens = chunk
        assert model(x, torch.full_like(y, IGNORE_INDEX))[1].isnan()


@pytest.mark.parametrize('kwargs, message', [(dict(top_k=0), 'top_k=0 must be at least 1'),
                                             (dict(top_k=-1), 'top_k=-1 must be at least 1'),
                                             (dict(temperature=-1.0), 'temperature=-1.0 must be at least 0'),
                                             (dict(temperature=float('nan')), 'temperature=nan must be at least 0'),
                                             (dict(temperature=float('inf'), vocab_limit=5), 'temperature=inf must be'),
                                             (dict(vocab_limit=0), 'vocab_limit=0 must be at least 1'),
                                             (dict(top_p=0.0), 'top_p=0.0 must be in (0, 1]')])
def test_sampling_settings_out_of_range_are_errors_naming_them(kwargs, message):
    # Reference: the messages of sample_next's checks; without them, top_k=0 was a shape error from deep in
    # torch, a negative temperature sampled from the inverted distribution, vocab_limit=0 a NaN error and an
    # infinite temperature with vocab_limit too (the masked ids' -inf / inf)
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match=re.escape(message)):
        sample_next(logits, **{'temperature': 1.0, **kwargs})
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_model().generate(torch.zeros(1, 2, dtype=torch.long), 3, **{'temperature': 1.0, **kwargs})


def test_loss_chunk_size_keeps_a_chunk_of_logits_small():
    # Reference: the sizes: a power of two of tokens whose logits fit in LOSS_CHUNK_LOGITS (1 GiB in fp32).
    def chunk(vocab_size):
        return GPT(GPTConfig(block_size=8, vocab_size=vocab_size, n_layer=1, n_head=1, n_embd=8)).loss_chunk_tokens
    assert chunk(50304) == 4096 and 4096 * 50304 * 4 <= 2**30 < 8192 * 50304 * 4  # GPT-2: 4 chunks of 16 x 1024
    assert chunk(100352) == 2048 and chunk(128) == 2**21  # cl100k_base; characters: one chunk for any batch here


@pytest.mark.parametrize('tie, n_kv_head', [(True, 4), (False, 2), (True, 1)])
def test_flops_per_token_matches_torch_flop_counter(tie, n_kv_head):
    # Reference: torch.utils.flop_counter.FlopCounterMode over a forward and backward of B x T tokens. Where the
    # two count alike: every matmul 2 FLOPs per weight per token forward, 4 backward (the blocks' first matmul
    # too: the embedding output needs its gradient); the chunked loss's head matmuls run once each, none
    # recomputed; the embedding lookup counts zero in both; and both count attention's whole T x T square,
    # ignoring what the causal mask saves (SDPA's math kernel computes the square and masks it, and the counter's
    # SDPA formulas assume the square). Where they differ: CPU's fused flash kernel has no formula in the
    # counter, so with it the count lacks exactly the attention term, 12 * n_layer * n_head * head_dim * T.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    model = tiny_model(tie_embeddings=tie, n_kv_head=n_kv_head)
    c, (B, T) = model.config, (2, 16)
    x, y = random_batch(0, B, T, c.vocab_size)
    attention = 12 * c.n_layer * c.n_head * c.head_dim * T

    def counted(chunk, backends):
        model.loss_chunk_tokens = chunk
        with sdpa_kernel(backends), FlopCounterMode(display=False) as counter:
            model(x, y)[1].backward()
        return counter.get_total_flops()
    for chunk in (7, 0):  # the chunked loss and the plain one
        assert counted(chunk, [SDPBackend.MATH]) == model.flops_per_token(T) * B * T
        assert counted(chunk, [SDPBackend.FLASH_ATTENTION]) == (model.flops_per_token(T) - attention) * B * T


# ----------------------------------------------------------------------------------------------------
# the CPU speedrun's pieces: RoPE in fewer kernels, ReLU^2, zero-initialized projections, logit soft-capping,
# the whole-split evaluation, time_s and the warmup-stable-decay schedule

def rope_textbook(x, cos, sin):
    """apply_rotary as the model first wrote it: halves by chunk, four products, one cat."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def test_rope_matches_the_textbook_formulation():
    # Reference: rope_textbook in float64, values and gradients, on q and k as the model passes them (strided
    # views into the fused qkv output), at positions 0..T-1 and at an offset (the KV cache's decode step), from
    # the angles and from rotary_tables; float32 within its rounding. A sign slip or swapped halves is off by O(1).
    torch.manual_seed(0)
    B, T, H, D = 2, 16, 3, 8
    qkv = torch.randn(B, T, 3 * H * D, dtype=torch.float64, requires_grad=True)
    q = qkv[..., :H * D].view(B, T, H, D)
    for cos, sin in (rope_cache(T, D, 10000.0), [t[5:6] for t in rope_cache(T, D, 500.0)]):
        n = cos.size(0)
        x = q[:, :n]
        got, want = apply_rotary(x, cos.double(), sin.double()), rope_textbook(x, cos.double(), sin.double())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
        # the tables GPT.forward builds once for all layers: the same rotation
        tables = rotary_tables(cos.double(), sin.double())
        torch.testing.assert_close(apply_rotary(x, *tables), want, rtol=0, atol=1e-14)
        g = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, qkv, g)[0], torch.autograd.grad(want, qkv, g)[0],
                                   rtol=0, atol=1e-14)
        got32 = apply_rotary(x.float(), cos, sin)
        assert got32.dtype == torch.float32
        torch.testing.assert_close(got32.double(), want, rtol=0, atol=1e-5)


def test_relu2_mlp_matches_formula():
    # Reference: max(0, x W_up^T)^2 W_down^T in float64, with a hidden width of 4 * n_embd (not gated).
    config = tiny_config(mlp='relu2')
    assert config.mlp_hidden == 4 * config.n_embd
    torch.manual_seed(0)
    mlp = MLP(config).double()
    assert mlp.up.weight.shape == (4 * config.n_embd, config.n_embd)
    x = torch.randn(2, 5, config.n_embd, dtype=torch.float64)
    want = (x @ mlp.up.weight.T).clamp(min=0).pow(2) @ mlp.down.weight.T
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_zero_init_proj_starts_each_block_as_the_identity():
    # Reference: the default model from the same seed (every other weight must be the same draw), and the
    # forward of a model without blocks, lm_head(norm(wte(idx))), which a block with zero projections adds
    # nothing to; the projections still get a gradient, so they leave zero at the first step.
    default, zero = tiny_model(seed=3), tiny_model(seed=3, zero_init_proj=True)
    for (name, p), q in zip(zero.named_parameters(), default.parameters()):
        if name.endswith(('attn.proj.weight', 'mlp.down.weight')):
            assert not p.any() and q.any(), name
        else:
            assert torch.equal(p, q), name
    x, y = random_batch(0, 2, 16, 32)
    logits, _ = zero(x)
    torch.testing.assert_close(logits, zero.lm_head(zero.norm(zero.wte(x))), rtol=0, atol=0)
    zero(x, y)[1].backward()
    assert zero.blocks[0].attn.proj.weight.grad.abs().sum() > 0 and zero.blocks[1].mlp.down.weight.grad.abs().sum() > 0


@pytest.mark.parametrize('tie', [True, False])
def test_init_scales_the_residual_projections_by_depth(tie):
    # Reference: GPT-2's init: every Linear and Embedding weight N(0, 0.02), but the two projections
    # into the residual stream (attn.proj, mlp.down) N(0, 0.02 / sqrt(2 n_layer)), 0.02 / 4 at 8 layers; the
    # norms' gains 1. Each matrix has >= 16k entries: its sample std is off by ~0.5%; 10% is allowed, 4x is not.
    n_layer = 8
    model = tiny_model(n_layer=n_layer, n_embd=128, vocab_size=256, tie_embeddings=tie)
    stds = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:  # the RMSNorm gains
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        stds[name] = want = 0.02 / math.sqrt(2 * n_layer) if name.endswith(('attn.proj.weight',
                                                                            'mlp.down.weight')) else 0.02
        assert p.std().item() == pytest.approx(want, rel=0.1), name
        assert abs(p.mean().item()) < 0.1 * want, name
    assert sum(v < 0.02 for v in stds.values()) == 2 * n_layer
    assert ('lm_head.weight' in stds) is not tie and 'wte.weight' in stds  # tied: lm_head is wte, checked once
    assert (model.lm_head.weight is model.wte.weight) is tie


def test_x0_mix_adds_the_scaled_token_embeddings_before_each_later_block():
    # Reference: the forward written out with the model's own modules, block i > 0 reading x + s[i-1] * wte(idx)
    # (float64, scales set away from 0), and the model without x0_mix from the same seed, which the mixing
    # model equals while its scales are at their initial 0; the scales get a gradient from the first step.
    plain, mixed = tiny_model(seed=4, dtype=torch.float64, n_layer=3), tiny_model(seed=4, dtype=torch.float64,
                                                                                   n_layer=3, x0_mix=True)
    x, y = random_batch(0, 2, 16, 32)
    assert mixed.x0_scale.shape == (2,) and not mixed.x0_scale.any()
    mixed.load_state_dict(plain.state_dict(), strict=False)
    torch.testing.assert_close(mixed(x)[0], plain(x)[0], rtol=0, atol=0)
    mixed(x, y)[1].backward()
    assert (mixed.x0_scale.grad != 0).all()
    with torch.no_grad():
        mixed.x0_scale.copy_(torch.tensor([0.7, -1.3]))
    x0 = h = mixed.wte(x)
    cos, sin = mixed.cos[:16], mixed.sin[:16]
    for i, block in enumerate(mixed.blocks):
        h = block(h + (mixed.x0_scale[i - 1] * x0 if i else 0), cos, sin)
    want = mixed.lm_head(mixed.norm(h))
    torch.testing.assert_close(mixed(x)[0], want, rtol=1e-12, atol=1e-12)
    assert (mixed(x)[0] - plain(x)[0]).abs().max() > 1e-3  # the scales change the output
    with pytest.raises(ValueError, match='x0_mix=True with n_layer=1'):
        tiny_config(n_layer=1, x0_mix=True)


@pytest.mark.parametrize('x0_mix, dtype', [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16)])
def test_autocast_residual_keeps_the_stream_in_the_autocast_dtype(x0_mix, dtype):
    # Reference: the forward written out with the model's own modules under CPU bf16 (or float16) autocast, the
    # token embeddings cast to autocast's dtype first; the dtype every block receives and returns, recorded as it
    # runs; without autocast the switch changes nothing, bit for bit; and the rounded stream's loss stays near the
    # float32 stream's.
    model = tiny_model(seed=5, n_layer=3, x0_mix=x0_mix)
    if x0_mix:
        with torch.no_grad():
            model.x0_scale.copy_(torch.tensor([0.5, -0.25]))
    x, y = random_batch(1, 2, 16, 32)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    autocast = torch.autocast('cpu', dtype)
    with autocast:
        float32_stream = model(x, y)[1]
    assert set(seen) == {(torch.float32, torch.float32)}
    model.autocast_residual, seen[:] = True, []
    with autocast:
        loss = model(x, y)[1]
    assert set(seen) == {(dtype, dtype)} and len(seen) == 3
    with autocast:
        x0 = h = model.wte(x).to(dtype)
        cos, sin = model.cos[:16], model.sin[:16]
        for i, block in enumerate(model.blocks):
            h = block(h + (model.x0_scale[i - 1] * x0 if x0_mix and i else 0), cos, sin)
        logits = model.lm_head(model.norm(h)).float()
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.reshape(-1)), rtol=1e-6, atol=1e-6)
    assert loss != float32_stream and abs(loss - float32_stream) < 0.02  # rounded otherwise, and not far off
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    plain = tiny_model(seed=5, n_layer=3, x0_mix=x0_mix)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x, y)[1], plain(x, y)[1], rtol=0, atol=0)  # no autocast: nothing to follow


@pytest.mark.parametrize('chunk', [0, 5])
def test_logit_softcap_bounds_the_logits(chunk):
    # Reference: cap * tanh(z / cap) of the uncapped model's logits z (same weights), and the cross-entropy of
    # those capped logits by formula, with autograd's gradients through them (float64), for the plain loss and
    # the chunked one (chunks of 5 tokens: its hand-written gradient); the caps bind (|z| > cap somewhere).
    cap = 2.0
    plain, capped = tiny_model(seed=1, dtype=torch.float64), tiny_model(seed=1, logit_softcap=cap, dtype=torch.float64)
    with torch.no_grad():
        plain.lm_head.weight.mul_(10)  # logits well beyond the cap
    capped.load_state_dict(plain.state_dict())
    capped.loss_chunk_tokens = chunk
    x, y = random_batch(0, 2, 16, 32)
    z, _ = plain(x)
    logits, _ = capped(x)
    assert z.abs().max() > 2 * cap and logits.abs().max() <= cap
    torch.testing.assert_close(logits, cap * torch.tanh(z / cap), rtol=1e-12, atol=1e-12)
    want = -(logits.log_softmax(-1).gather(-1, y[..., None])).mean()
    loss = capped(x, y)[1]
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    params = list(capped.parameters())
    for got, ref in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match='logit_softcap'):
        tiny_config(logit_softcap=-1.0)


def test_fused_parts_name_the_row_blocks():
    # Reference: the fused weights' row layout, as the model splits them: [q | k | v] (GQA: fewer k, v rows) and
    # [gate | up] for the gated MLPs; the ungated MLPs have no parts.
    model = tiny_model(n_kv_head=2, mlp='swiglu')
    parts = {n: model.fused_parts().get(p) for n, p in model.named_parameters()}
    c = model.config
    for i in range(c.n_layer):
        assert parts[f'blocks.{i}.attn.qkv.weight'] == [4 * c.head_dim, 2 * c.head_dim, 2 * c.head_dim]
        assert parts[f'blocks.{i}.mlp.up.weight'] == [c.mlp_hidden, c.mlp_hidden]
    assert sum(v is not None for v in parts.values()) == 2 * c.n_layer
    assert len(tiny_model(mlp='relu2').fused_parts()) == c.n_layer


def windows_reference(model, tokens, T):
    """Mean cross-entropy over every non-overlapping window tokens[iT : iT + T + 1], one window at a time."""
    losses = []
    with torch.no_grad():
        for i in range((len(tokens) - 1) // T):
            w = torch.from_numpy(tokens[i * T:i * T + T + 1].astype(np.int64))
            logits, _ = model(w[None, :-1])
            losses.append(F.cross_entropy(logits[0].double(), w[1:]))
    return torch.stack(losses).mean().item()


def test_whole_split_eval_covers_every_window_once():
    # Reference: windows_reference, window by window (10 windows; the 4 tokens after them are too few for one
    # more). Any batch size gives it; shared by 2 or 3 processes (no process group here, so each returns its
    # own part), the parts add up to it: a window counted twice, a repeated filler batch given weight, or a
    # shifted target would not.
    T = 16
    tokens = np.random.default_rng(0).integers(0, 32, 10 * T + 5).astype(np.uint16)
    model = tiny_model().eval()
    want = windows_reference(model, tokens, T)

    def loss(windows):
        return train.estimate_loss(model, {'val': windows}, nullcontext())['val']
    for batch_size in (1, 3, 10, 64):
        got = loss(train.Windows(tokens, batch_size, T, 'cpu'))
        assert got == pytest.approx(want, rel=1e-6), batch_size
    for world in (2, 3):
        parts = [loss(train.Windows(tokens, 3, T, 'cpu', rank, world)) for rank in range(world)]
        assert sum(parts) == pytest.approx(want, rel=1e-6), world
    # every process runs as many forwards (under FSDP each is a collective): 10 windows in batches of 3 make 4
    # batches (3, 3, 3, 1 windows), not divisible by 3 processes; rank r takes batches r, r + 3, ..., and a rank
    # past the last batch a filler of weight 0 (the weights: the windows of each batch, as counted by hand)
    weights = [[w for _, _, w in train.Windows(tokens, 3, T, 'cpu', rank, 3).eval_batches()] for rank in range(3)]
    assert weights == [[3, 1], [3, 0], [3, 0]]
    # estimate_loss runs it in eval mode and hands the model back in train mode; eval_iters=0 means only val
    cfg = SimpleNamespace(eval_iters=0, batch_size=4, block_size=T, seed=0)
    splits = train.eval_splits(cfg, tokens, tokens, 'cpu', 0, 1)
    assert list(splits) == ['val']
    model = tiny_model(dropout=0.5)  # eval mode matters
    losses = train.estimate_loss(model, splits, nullcontext())
    assert model.training
    eval_loss = windows_reference(model.eval(), tokens, T)
    assert losses == {'val': pytest.approx(eval_loss, rel=1e-6)}
    # an evaluation with dropout on would miss that by far (seen: 1e-3 relative): the check above can fail
    assert windows_reference(model.train(), tokens, T) != pytest.approx(eval_loss, rel=1e-4)


@pytest.mark.parametrize('extra, count', [(0, 9), (1, 10)])
def test_whole_split_eval_windows_need_block_size_plus_one_tokens(extra, count):
    # Reference: windows_reference, and the count by hand: window i is tokens[iT : iT + T + 1] (its targets
    # reach one token past it), so 10 T tokens hold 9 windows and 10 T + 1 tokens hold 10.
    T = 16
    tokens = np.random.default_rng(1).integers(0, 32, 10 * T + extra).astype(np.uint16)
    windows = train.Windows(tokens, 4, T, 'cpu')
    assert windows.eval_total == count
    model = tiny_model().eval()
    got = train.estimate_loss(model, {'val': windows}, nullcontext())['val']
    assert got == pytest.approx(windows_reference(model, tokens, T), rel=1e-6)


class EvalRecorder(nn.Module):
    """A stand-in for the model in estimate_loss: records each batch it is given, in eval mode, and returns a loss
    of its own for each, the mean of the batch's input ids."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, y):
        assert not self.training
        self.seen.append((x, y))
        return None, x.double().mean()


def test_sampled_eval_averages_eval_iters_batches_of_each_split_shared_among_processes():
    # Reference: the mean, computed here, of the losses of the batches that the model was given, and the rules by
    # hand: eval_iters (5) batches of batch_size windows for each split, each window block_size + 1 consecutive
    # tokens of its own split (the tokens are their positions: train 0.., val 1000..), no batch twice, the same
    # batches at every evaluation. Shared by 2 or 3 processes (no process group here, so each returns its own
    # part), the parts add up to the one-process mean, and every process runs ceil(5 / world) forwards per split
    # (under FSDP each is a collective): a process's batch counted twice, a filler given weight, or a mean over
    # anything but eval_iters batches would not.
    train_tokens, val_tokens = np.arange(500, dtype=np.uint16), np.arange(1000, 1400, dtype=np.uint16)
    cfg = SimpleNamespace(eval_iters=5, batch_size=2, block_size=8, seed=3)
    model = EvalRecorder()
    splits = train.eval_splits(cfg, train_tokens, val_tokens, 'cpu', 0, 1)
    got = train.estimate_loss(model, splits, nullcontext())
    assert model.training and sorted(got) == ['train', 'val'] and len(model.seen) == 10
    for i, (split, lo, hi) in enumerate([('train', 0, 500), ('val', 1000, 1400)]):
        batches = model.seen[5 * i:5 * i + 5]
        for x, y in batches:
            assert x.shape == y.shape == (2, 8)
            assert torch.equal(x[:, 1:], x[:, :-1] + 1) and torch.equal(y, x + 1)
            assert x.min() >= lo and y.max() < hi
        assert len({tuple(x[:, 0].tolist()) for x, _ in batches}) == 5
        want = sum(x.double().mean().item() for x, _ in batches) / 5
        assert got[split] == pytest.approx(want, rel=1e-6), split
    again = EvalRecorder()
    assert train.estimate_loss(again, splits, nullcontext()) == got
    assert all(torch.equal(a[0], b[0]) for a, b in zip(model.seen, again.seen))
    for world in (2, 3):
        parts = []
        for rank in range(world):
            model = EvalRecorder()
            parts.append(train.estimate_loss(model, train.eval_splits(cfg, train_tokens, val_tokens, 'cpu', rank,
                                                                      world), nullcontext()))
            assert len(model.seen) == 2 * math.ceil(5 / world), (world, rank)
        for split in got:
            assert sum(part[split] for part in parts) == pytest.approx(got[split], rel=1e-6), (world, split)


def test_get_lr_wsd_schedule():
    # Reference: the warmup-stable-decay formula written out: the same warmup as cosine, learning_rate until
    # the last wsd_decay_frac of lr_decay_iters, a straight line down to min_lr at lr_decay_iters, min_lr after.
    cfg = opt_cfg(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200,
                  lr_schedule='wsd', wsd_decay_frac=0.2)
    cosine = opt_cfg(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    assert all(get_lr(it, cfg) == get_lr(it, cosine) for it in range(10))
    for it in range(10, 89):
        assert get_lr(it, cfg) == 1.0, it
    for it in range(88, 111):
        want = 1.0 - 0.9 * (it - 88) / 22
        assert math.isclose(get_lr(it, cfg), want, rel_tol=1e-12, abs_tol=1e-12), it
    assert get_lr(111, cfg) == get_lr(10 ** 6, cfg) == 0.1
    # a decay fraction that reaches into the warmup starts the decay where the warmup ends
    whole = opt_cfg(learning_rate=1.0, min_lr=0.0, warmup_iters=10, lr_decay_iters=110, lr_schedule='wsd',
                    wsd_decay_frac=1.0)
    assert get_lr(10, whole) == 1.0 and math.isclose(get_lr(60, whole), 0.5)
    # a fraction that is no whole number of iterations: the nearest (0.17 x 110 = 18.7: the last 19, from 91)
    odd = opt_cfg(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, lr_schedule='wsd',
                  wsd_decay_frac=0.17)
    for it in range(85, 111):
        want = 1.0 - 0.9 * max(0, it - 91) / 19
        assert math.isclose(get_lr(it, odd), want, rel_tol=1e-12, abs_tol=1e-12), it


@pytest.mark.parametrize('flag, key', [('--lr_schedule=linear', 'lr_schedule'),
                                       ('--wsd_decay_frac=0', 'wsd_decay_frac'),
                                       ('--eval_iters=-1', 'eval_iters'),
                                       ('--short_block_size=256 --block_size=768', 'short_block_size')])  # 3x
def test_schedule_and_eval_keys_are_checked(tmp_path, flag, key):
    # Reference: the key named in a one-line error, before any file is written. (A data_dir that does not exist: a
    # missing check fails at once, on the data, instead of training the default model.)
    with pytest.raises(ConfigError, match=key):
        train.main([*flag.split(), f'--out_dir={tmp_path}', f'--data_dir={tmp_path / "no-data"}'])
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize('key, value', [('wsd_decay_frac', 1.0), ('seed', 2**63 - 1), ('short_block_size', 512),
                                        ('min_lr', 6e-4), ('dropout', 0.999), ('beta2', 0.999), ('rope_base', 1.5)])
def test_values_at_the_edge_of_their_range_are_accepted(key, value):
    # Reference: the ranges as documented (check_config's messages and the comments on the defaults), at their
    # valid edges: wsd_decay_frac 1 (the decay takes all of lr_decay_iters), the largest seed, block_size (1024)
    # halved, min_lr = learning_rate (6e-4: constant after warmup), just under 1, just over 1. (The zeros that mean
    # something run in test_failures.py's test_valid_edge_values_still_run.)
    train.check_config(SimpleNamespace(**{**train.DEFAULTS, key: value}))


@pytest.fixture(scope='module')
def speedrun_run(tmp_path_factory):
    """A run with eval_iters=0 and the speedrun's model options, timed from outside the process."""
    root = tmp_path_factory.mktemp('speedrun')
    (root / 'input.txt').write_text(TEXT)
    prepare(input=str(root / 'input.txt'), tokenizer='char', data_dir=str(root / 'data'))
    flags = [f for f in TRAIN_FLAGS if not f.startswith(('--eval_iters', '--dropout'))]
    before = time_module.time()
    run_script('train.py', *flags, f'--data_dir={root / "data"}', f'--out_dir={root / "out"}', '--max_iters=8',
               '--eval_iters=0', '--mlp=relu2', '--logit_softcap=15', '--zero_init_proj=True', '--lr_schedule=wsd')
    return SimpleNamespace(root=root, out=root / 'out', wall=time_module.time() - before)


def test_evaluates_at_the_end_and_at_iteration_0_only_with_eval_at_start(speedrun_run, tmp_path):
    # Reference: the iterations the rule names: every eval_interval (4), the last iteration (6, not a multiple
    # of it) and iteration 0 with eval_at_start (the default); the checkpoint is the last iteration's.
    flags = TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', '--max_iters=6', '--log_interval=100']
    for at_start, want in ((True, [0, 4, 6]), (False, [4, 6])):
        out = tmp_path / str(at_start)
        with redirect_stdout(io.StringIO()):
            assert train.main(flags + [f'--out_dir={out}', f'--eval_at_start={at_start}']) == 0
        assert [r['iter'] for r in read_metrics(out) if 'val_loss' in r] == want, at_start
        assert torch.load(out / 'ckpt.pt', weights_only=False)['iter_num'] == 6


def test_best_pt_is_the_lowest_val_loss_and_the_done_line_names_it(speedrun_run, tmp_path, monkeypatch):
    # Reference: scripted evaluations at 0, 2, 4 and 6 whose val losses (5.0, 4.0, 4.5, 4.25) are lowest at 2 while
    # the train losses (5.5, 6.0, 3.0, 2.0) fall to the end: best.pt is iteration 2's, with best val loss 4.0, and
    # the last line says so.
    losses = iter([(5.5, 5.0), (6.0, 4.0), (3.0, 4.5), (2.0, 4.25)])
    monkeypatch.setattr(train, 'estimate_loss', lambda model, splits, autocast: dict(zip(('train', 'val'),
                                                                                        next(losses))))
    out, printed = tmp_path / 'out', io.StringIO()
    flags = TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', f'--out_dir={out}', '--eval_interval=2',
                           '--max_iters=6', '--log_interval=100']
    with redirect_stdout(printed):
        assert train.main(flags) == 0
    best = torch.load(out / 'best.pt', weights_only=True)
    assert best['iter_num'] == 2 and best['best_val_loss'] == 4.0
    assert printed.getvalue().splitlines()[-1] == f"done: 6 iterations, best val loss 4.0000; checkpoints in {out}"


def test_a_run_of_no_iterations_without_an_evaluation_still_writes_its_checkpoint(speedrun_run, tmp_path):
    # Reference: the weights that train.py's seed gives the model, built here (as in test_resume_is_bitwise_identical):
    # max_iters=0 with eval_at_start=False evaluates nothing, and still leaves ckpt.pt at iteration 0 holding them
    # (a checkpoint of the starting weights, e.g. of a run started from a Hugging Face model).
    out = tmp_path / 'out'
    flags = TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', f'--out_dir={out}', '--max_iters=0',
                           '--eval_at_start=False']
    with redirect_stdout(io.StringIO()):
        assert train.main(flags) == 0
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 0 and not (out / 'best.pt').exists()
    torch.manual_seed(train.DEFAULTS['seed'])
    model = GPT(GPTConfig(**ckpt['model_args']))
    assert ckpt['model'].keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt['model'][k], v), k


def test_report_states_the_runs_facts(speedrun_run, tmp_path, monkeypatch):
    # Reference: the facts worked out here: the parameters and FLOPs per token of a model built here with the same
    # shape (n_kv_head=0 resolved to n_head = 4, the vocabulary padded to 64), the characters of the text the data
    # was prepared from, tokens per iteration = batch_size 4 x block_size 16 x gradient_accumulation_steps 3; on the
    # CPU: TF32 off, the optimizer state in CPU memory once a step has run, AdamW not fused, and fused where
    # configure_optimizer gives CUDA's (fused) AdamW, faked here over the CPU tensors.
    shape = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=0, n_embd=96, dropout=0.1)
    model = GPT(GPTConfig(**shape))
    flags = TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', '--max_iters=0', '--n_embd=96',
                           '--n_kv_head=0', '--gradient_accumulation_steps=3']

    def report(out):
        printed = io.StringIO()
        with redirect_stdout(printed):
            assert train.main(flags + [f'--out_dir={out}']) == 0
        return printed.getvalue()
    text = report(tmp_path / 'a')
    params = sum(p.numel() for p in model.parameters())
    assert (f"model: {params / 1e6:.2f}M parameters, {model.flops_per_token() / 1e6:.1f} MFLOP per token, vocab 64 "
            f"(char, {len(set(TEXT))} used), 192 tokens per iteration\n") in text
    assert re.search(r'^  n_kv_head +=  ?4$', text, re.M) and re.search(r'^  vocab_size +=  ?64$', text, re.M)
    assert '\n  TF32 matmuls      off (CUDA only)\n' in text
    assert '\n  optimizer         adamw\n' in text
    assert '\n  optimizer state   CPU memory, from the first step\n' in text
    real = train.configure_optimizer
    monkeypatch.setattr(train, 'configure_optimizer', lambda model, cfg, device_type: real(model, cfg, 'cuda'))
    assert '\n  optimizer         adamw, fused AdamW\n' in report(tmp_path / 'b')


def test_metrics_time_s_and_whole_split_val_loss(speedrun_run):
    # Reference: the wall time measured around the process (time_s can only be shorter), the order of the
    # lines, and the val loss recomputed here from the checkpoint over every window of val.bin.
    lines = read_metrics(speedrun_run.out)
    times = [r['time_s'] for r in lines]
    assert all(0 < t < speedrun_run.wall for t in times) and times == sorted(times)
    evals = [r for r in lines if 'val_loss' in r]
    assert [r['iter'] for r in evals] == [0, 4, 8]
    assert all(set(r) == {'iter', 'tokens', 'val_loss', 'val_bpb', 'time_s'} for r in evals)
    ckpt = torch.load(speedrun_run.out / 'ckpt.pt', weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    tokens = np.fromfile(speedrun_run.root / 'data' / 'val.bin', dtype=np.uint16)
    assert evals[-1]['val_loss'] == pytest.approx(windows_reference(model.eval(), tokens, 16), rel=1e-5)


def test_evaluations_draw_their_own_windows_not_the_training_steps():
    # Reference: the seeds as train.py gives them: the train split's evaluation seed + 1, val's seed + 2; the
    # training draw has seed itself. Evaluated on the training draw's own windows, the "train loss" would be that of
    # the windows the first steps trained on
    tokens = np.arange(5000, dtype=np.uint16)
    cfg = SimpleNamespace(eval_iters=2, batch_size=3, block_size=8, seed=7)
    splits = train.eval_splits(cfg, tokens, tokens, 'cpu', 0, 1)
    assert [splits[k].seed for k in ('train', 'val')] == [8, 9]
    steps = train.Batches(tokens, 3, 8, 'cpu', 7, groups=2)
    first = next(splits['train'].eval_batches())[0]
    assert not torch.equal(first, steps.next()[0])
    assert torch.equal(first, train.Batches(tokens, 3, 8, 'cpu', 8, groups=2).next()[0])


def test_bits_per_byte_of_an_evaluation_are_its_nats_over_the_utf8_bytes_of_its_targets(tmp_path):
    # Reference: text of 1-, 2- and 4-byte characters; by hand from the checkpoint, window by window, the summed
    # cross-entropy over every target of val.bin's windows (eval_iters=0), in bits, over the UTF-8 bytes of those
    # targets' characters. With eval_iters=2, each split's loss times its drawn targets over their bytes (the same
    # batches every evaluation: drawn here again with the run's seeds), in bits. A bpb of the loss over ln 2 alone,
    # bytes counted as tokens, or a byte count of another draw would differ: the text's bytes per token vary.
    (tmp_path / 'input.txt').write_text(TEXT.replace('e', 'é').replace('o', '😀'), encoding='utf-8')
    prepare(input=str(tmp_path / 'input.txt'), tokenizer='char', data_dir=str(tmp_path / 'data'))
    meta = json.loads((tmp_path / 'data' / 'meta.json').read_text())
    n_bytes = np.array([len(c.encode()) for c in meta['chars']])
    assert set(n_bytes) == {1, 2, 4}
    splits = {k: np.fromfile(tmp_path / 'data' / f'{k}.bin', dtype=np.uint16) for k in ('train', 'val')}
    flags = TRAIN_FLAGS + [f'--data_dir={tmp_path / "data"}', '--max_iters=4']
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert train.main(flags + [f'--out_dir={tmp_path / "all"}', '--eval_iters=0']) == 0
    ckpt = torch.load(tmp_path / 'all' / 'ckpt.pt', weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args'])).eval()
    model.load_state_dict(ckpt['model'])
    targets = splits['val'][1:(len(splits['val']) - 1) // 16 * 16 + 1]  # those of every whole window
    nats = windows_reference(model, splits['val'], 16) * len(targets)
    last = [r for r in read_metrics(tmp_path / 'all') if 'val_loss' in r][-1]
    assert last['iter'] == 4 and last['val_bpb'] == pytest.approx(nats / math.log(2) / n_bytes[targets].sum(),
                                                                   rel=1e-5)
    assert f"iter 4: val loss {last['val_loss']:.4f}, val bpb {last['val_bpb']:.4f}\n" in printed.getvalue()
    assert '\nbits per byte = eval loss / ln 2 / bytes per token (val ' in printed.getvalue()
    # the bytes per token it names: those of every whole window's targets, by hand (here more than 1: the line's
    # inverse, tokens per byte, would be less)
    per_token = n_bytes[targets].sum() / len(targets)
    assert per_token > 1.2
    assert f"bytes per token (val {per_token:.3f})\n" in printed.getvalue()

    printed = io.StringIO()
    with redirect_stdout(printed):
        assert train.main(flags + [f'--out_dir={tmp_path / "drawn"}']) == 0
    evals = [r for r in read_metrics(tmp_path / 'drawn') if 'val_loss' in r]
    for r in evals:  # the line names val's, not train's
        assert (f"iter {r['iter']}: train loss {r['train_loss']:.4f}, val loss {r['val_loss']:.4f}, "
                f"val bpb {r['val_bpb']:.4f}\n") in printed.getvalue()
    for i, split in enumerate(('train', 'val'), start=1):
        draw = train.Batches(splits[split], 4, 16, 'cpu', train.seed + i, 2)
        targets = np.concatenate([y.numpy().ravel() for _, y, _ in draw.eval_batches()])
        for r in evals:
            want = r[f'{split}_loss'] * len(targets) / n_bytes[targets].sum() / math.log(2)
            assert r[f'{split}_bpb'] == pytest.approx(want, rel=1e-12), (split, r['iter'])


@pytest.mark.parametrize('error, why', [
    (ValueError("tokenizer hf:x has no byte-level decoder (Metaspace)"),
     "tokenizer hf:x has no byte-level decoder (Metaspace)"),
    (Exception("data did not match any variant of untagged enum ModelWrapper"),  # tokenizers' own, as it raises it
     "Exception: data did not match any variant of untagged enum ModelWrapper")])
def test_bits_per_byte_left_out_with_the_reason_when_the_bytes_are_not_known(speedrun_run, tmp_path, monkeypatch,
                                                                             error, why):
    # Reference: a tokenizer whose bytes per token prepare_data.token_bytes cannot give (its ValueError), or that
    # cannot be loaded here (a tokenizer.json newer than this `tokenizers`: whatever it raises): the run trains
    # and evaluates as before, its report says why bits per byte are missing, and no line holds one.
    def unknown(meta):
        raise error

    monkeypatch.setattr(train, 'token_bytes', unknown)
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert train.main(TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', f'--out_dir={tmp_path}',
                                         '--max_iters=4']) == 0
    assert f"\nbits per byte: not reported: {why}\n" in printed.getvalue()
    lines = read_metrics(tmp_path)
    assert [r['iter'] for r in lines if 'val_loss' in r] == [0, 4]
    assert not [r for r in lines if 'val_bpb' in r or 'train_bpb' in r] and ' bpb ' not in printed.getvalue()


@pytest.mark.parametrize('short, iters, want', [
    (8, 3, [(8, 8)] * 3 + [(4, 16)] * 3),
    (4, 4, [(16, 4)] * 2 + [(8, 8)] * 2 + [(4, 16)] * 2),  # 4, doubled halfway, 16 from iteration 4
    (2, 6, [(32, 2)] * 2 + [(16, 4)] * 2 + [(8, 8)] * 2),  # three doublings in six iterations: none whole
])
def test_short_windows_double_up_to_block_size_at_short_block_iters(speedrun_run, tmp_path, monkeypatch, short,
                                                                    iters, want):
    # Reference: the schedule by hand, seen as the inputs of the model's training forwards over 6 iterations
    # (batch 4 x 16 tokens): short_block_size, doubled at equal steps of short_block_iters, whole after.
    shapes, forward = [], GPT.forward

    def spy(self, idx, *args, **kwargs):
        if self.training:
            shapes.append(tuple(idx.shape))
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, 'forward', spy)
    flags = TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', f'--out_dir={tmp_path / "out"}',
                           '--max_iters=6', f'--short_block_size={short}', f'--short_block_iters={iters}']
    with redirect_stdout(io.StringIO()):
        assert train.main(flags) == 0
    assert shapes == want


def test_time_left_and_mfu_of_a_log_line_by_a_fake_clock(speedrun_run, tmp_path, monkeypatch):
    # Reference: a fake clock on which each training step takes 2 s and each evaluation (with its plot and
    # checkpoints) 30 s, and a fake peak of 1e9 FLOP/s; by hand, for 10 iterations of 4 x 16 tokens with
    # evaluations at 0, 4, 8 and 10 and windows of 4 tokens (iterations 0, 1), 8 (2, 3), then 16:
    # - time left at iteration k: (10 - k) steps of 2 s and 30 s for each evaluation still to come (those at 4, 8
    #   and 10 at k=3; at 8 and 10 at k=6; at 10 at k=9): 104 s, 68 s, 32 s;
    # - MFU: each step's FLOPs at its own window over the interval's time (at k=3: windows 4, 4 and 8).
    now = [time_module.time()]
    monkeypatch.setattr(train, 'time', SimpleNamespace(time=lambda: now[0], strftime=time_module.strftime))

    def taking(seconds, f):
        def timed(*args, **kwargs):
            out = f(*args, **kwargs)
            now[0] += seconds
            return out
        return timed
    monkeypatch.setattr(train, 'train_step', taking(2.0, train.train_step))
    monkeypatch.setattr(train, 'estimate_loss', taking(30.0, train.estimate_loss))
    monkeypatch.setattr(model_module, 'peak_flops', lambda device, dtype='bfloat16': 1e9)
    out = tmp_path / 'out'
    flags = TRAIN_FLAGS + [f'--data_dir={speedrun_run.root / "data"}', f'--out_dir={out}', '--max_iters=10',
                           '--log_interval=3', '--short_block_size=4', '--short_block_iters=4']
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert train.main(flags) == 0
    left = re.findall(r'^iter (\d+): loss .* ms/iter, .* (\d+)m(\d\d)s left', printed.getvalue(), re.M)
    assert [(int(k), 60 * int(m) + int(s)) for k, m, s in left] == [(3, 104), (6, 68), (9, 32)]
    flops = GPT(GPTConfig(**torch.load(out / 'ckpt.pt', weights_only=True)['model_args'])).flops_per_token
    mfu = {r['iter']: r['mfu'] for r in read_metrics(out) if 'mfu' in r}
    step_flops = {3: [flops(4), flops(4), flops(8)], 6: [flops(16)] * 2, 9: [flops(16)]}
    assert mfu == pytest.approx({k: 64 * sum(f) / (2.0 * len(f)) / 1e9 for k, f in step_flops.items()}, rel=1e-9)


def test_mfu_under_torchrun_is_per_process(speedrun_run, tmp_path):
    # Reference: MFU by hand for 2 processes under torchrun (gloo, on the CPU) with a faked peak of 1e9 FLOP/s. The
    # logged tokens/s counts the tokens of both (batch 4 x block 16 x 2 micro-batches per step in all) and each
    # process does half of them, so the MFU of a process (of its GPU) is FLOPs per token (of a model built here with
    # the run's shape) x tokens/s / 2 / peak. A subprocess: in-process tests have no process group.
    script = tmp_path / 'fake_peak.py'
    script.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\nimport model\n"
                      "model.peak_flops = lambda device, dtype='bfloat16': 1e9\n"
                      "import train\nsys.exit(train.main(sys.argv[1:]))\n")
    out = tmp_path / 'out'
    flags = [f for f in TRAIN_FLAGS if not f.startswith('--dropout')] + [
        f'--data_dir={speedrun_run.root / "data"}', f'--out_dir={out}', '--max_iters=2', '--eval_iters=2',
        '--gradient_accumulation_steps=2']
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(script), *flags], cwd=HERE, capture_output=True, text=True, timeout=300,
                          env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model = GPT(GPTConfig(**torch.load(out / 'ckpt.pt', weights_only=True)['model_args']))
    records = [r for r in read_metrics(out) if 'loss' in r]
    assert [r['iter'] for r in records] == [1, 2]
    for r in records:
        assert r['mfu'] == pytest.approx(model.flops_per_token(16) * r['tokens_per_sec'] / 2 / 1e9, rel=1e-9)


def test_evals_left_counts_the_evaluations_still_to_come():
    # Reference: the evaluations counted one by one: at a log line after iteration `it`, those at iterations it to
    # max_iters that are multiples of eval_interval, and the one at max_iters (the one at `it` itself runs before
    # its step, so it is still to come).
    for max_iters in range(1, 25):
        for interval in range(1, 8):
            cfg = SimpleNamespace(max_iters=max_iters, eval_interval=interval)
            for it in range(1, max_iters + 1):
                want = sum(1 for e in range(it, max_iters + 1) if e % interval == 0 or e == max_iters)
                assert train.evals_left(it, cfg) == want, (max_iters, interval, it)


def test_peak_memory_is_the_process_peak_in_mib(monkeypatch):
    # Reference: on the CPU, the kernel's own count of this process's peak resident memory, VmHWM in
    # /proc/self/status (kB), read before and after, with 256 MiB touched and freed before: the peak, not what
    # the process holds now (VmRSS, 256 MiB less at least); on CUDA, the peak of torch's allocator, not what it
    # holds now (both faked here: 3 GiB at the peak, 1 GiB now).
    if not os.path.exists('/proc/self/status'):
        pytest.skip('no /proc/self/status (not Linux)')

    def status_mib(key):
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ':')) / 1024
    held = np.ones(2**25)  # 256 MiB, each page written: resident, then given back to the system (a mapping of its own)
    del held
    before, now = status_mib('VmHWM'), status_mib('VmRSS')
    got = train.peak_memory_mb('cpu')
    after = status_mib('VmHWM')
    assert before * 0.99 <= got <= after * 1.01 and got > now + 200, (before, got, after, now)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda *a, **k: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda *a, **k: 2**30)
    assert train.peak_memory_mb('cuda') == 3 * 1024


def test_start_time_is_taken_before_the_heavy_imports():
    # Reference: a clock read just before `import train` in a fresh interpreter: START_TIME must follow it
    # within a small part of the import (which loads torch, a second or more).
    code = ("import time; t = time.time(); import train; done = time.time(); "
            "print(train.START_TIME - t, done - t)")
    proc = subprocess.run([sys.executable, '-c', code], cwd=HERE, capture_output=True, text=True, timeout=120,
                          env=SUBPROCESS_ENV)
    start, total = map(float, proc.stdout.split())
    assert 0 <= start < 0.2 * total, (start, total)


@pytest.mark.parametrize('shape', [(3, 5, 32), (2, 4, 3, 8)], ids=['stream', 'qk-norm heads'])
def test_rmsnorm_gradients_match_the_formula(shape):
    # Reference: autograd through rms_norm_ref (the formula, float64), gradients for the input and the gain, at
    # scales where eps matters; float32 within rounding of torch's own nn.RMSNorm (its composite CPU path).
    torch.manual_seed(0)
    C = shape[-1]
    norm = model_module.RMSNorm(C, eps=1e-2).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(C, dtype=torch.float64))
    scales = torch.logspace(-2, 1, shape[0], dtype=torch.float64).view(-1, *[1] * (len(shape) - 1))
    x = (torch.randn(shape, dtype=torch.float64) * scales).requires_grad_()
    g = torch.randn(shape, dtype=torch.float64)
    got = torch.autograd.grad(norm(x), (x, norm.weight), g)
    want = torch.autograd.grad(rms_norm_ref(x, norm.weight, 1e-2), (x, norm.weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ref, fast = nn.RMSNorm(C, eps=1e-5), model_module.RMSNorm(C, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(norm.weight.float())
        fast.weight.copy_(norm.weight.float())
    x32 = x.detach().float().requires_grad_()
    outs = [m(x32) for m in (fast, ref)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    grads = [torch.autograd.grad(o, (x32, m.weight), g.float()) for o, m in zip(outs, (fast, ref))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_under_cpu_autocast_runs_in_float32():
    # Reference: F.scaled_dot_product_attention in float32 on the same bf16 q, k, v. Under CPU autocast, attend
    # gives exactly that (torch's CPU flash attention is slower in bf16), where SDPA alone would run in bf16;
    # outside autocast it is SDPA itself, dtype and values.
    torch.manual_seed(0)
    q, k, v = [torch.randn(2, 4, 16, 8).bfloat16() for _ in range(3)]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = model_module.attend(q, k, v, is_causal=True)
        alone = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert got.dtype == torch.float32 and alone.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (alone.float() - want).abs().max() > 1e-4  # what the bf16 path would have given instead
    plain = model_module.attend(q, k, v, is_causal=True)
    assert plain.dtype == torch.bfloat16
    torch.testing.assert_close(plain, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=0)


def test_rmsnorm_under_cpu_autocast_is_float32_math_rounded_once():
    # Reference: the formula in float64 on the bf16 input (conftest.assert_rmsnorm_rounded_once). Under CPU autocast
    # the norms (the q/k norms of qk_norm) get bf16 input and a float32 gain; ours computes in float32 and rounds
    # the output once to bf16. Computed in bf16 throughout, a quarter of the outputs would miss.
    norm, x = rmsnorm_bf16_case()
    exact = assert_rmsnorm_rounded_once(norm, x)
    bf16_math = rms_norm_ref(x.detach(), norm.weight.detach().bfloat16(), 1e-5).double()
    assert ((bf16_math - exact).abs() <= exact.abs() * 2.0 ** -8 * 1.001).float().mean() < 0.8


def test_rmsnorm_off_the_cpu_path_matches_the_cpu_path_on_bf16_input():
    # Reference: the CPU path (float32 math rounded once, checked against float64 above). fused_forward, what CUDA
    # runs (torch's rms_norm, fed float32 when a bf16 input meets a float32 weight), run here on the same values:
    # the same bf16 output and gradients within float32 rounding, and no mismatch warning from torch.
    norm, x = rmsnorm_bf16_case(seed=1)
    g = torch.randn(x.shape).bfloat16()
    outs = []
    for path in (norm.cpu_forward, norm.fused_forward):
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            y = path(x)
        outs.append((y, *torch.autograd.grad(y, (x, norm.weight), g)))
    (y_cpu, gx_cpu, gw_cpu), (y_fused, gx_fused, gw_fused) = outs
    assert y_fused.dtype == torch.bfloat16 and gw_fused.dtype == torch.float32
    assert (y_fused.float() - y_cpu.float()).abs().max() <= 2.0 ** -7 * y_cpu.float().abs().max()  # at most a step
    assert (y_fused != y_cpu).float().mean() < 0.02  # and nearly always the same rounding
    torch.testing.assert_close(gx_fused.float(), gx_cpu.float(), rtol=2.0 ** -7, atol=1e-3)
    torch.testing.assert_close(gw_fused, gw_cpu, rtol=1e-4, atol=1e-4)
    assert torch.equal(norm(x), y_cpu)  # forward takes the CPU's path on the CPU


def test_dropout_is_off_in_eval_mode_and_drops_attention_weights_in_train_mode():
    # Reference: nn.Dropout / SDPA's dropout_p semantics: in eval mode dropout is the identity, so a model with
    # dropout=0.5 gives exactly the logits of the same weights with dropout=0; in train mode the attention's own
    # dropout (on the attention weights, before proj) changes what proj reads against the dropout-free attention:
    # the first position attends to itself alone, so each head's output there is dropped or doubled whole (its
    # one weight is); later positions mix their values anew, where dropout on the output would only zero or double
    # each element.
    x, _ = random_batch(0, 2, 16, 32)
    with torch.no_grad():
        logits, _ = tiny_model(dropout=0.5).eval()(x)
        want, _ = tiny_model(dropout=0.0).eval()(x)
    assert torch.equal(logits, want)
    model = tiny_model(dropout=0.5)
    attn, seen = model.blocks[0].attn, []
    attn.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    h = torch.randn(2, 16, 32)
    cos, sin = model.cos[:16], model.sin[:16]
    with torch.no_grad():
        torch.manual_seed(1)
        attn.train()(h, cos, sin)
        attn.eval()(h, cos, sin)
    dropped, plain = seen
    assert not torch.allclose(dropped, plain)
    first, want = (t[:, 0].view(2, attn.n_head, -1) for t in (dropped, plain))
    kept = first.ne(0).any(-1)
    assert kept.any() and not kept.all()  # both happen among the 2 x n_head heads (seed 1)
    assert torch.allclose(first[kept], 2 * want[kept]) and first[~kept].eq(0).all()
    assert not torch.equal(dropped[:, 1:], torch.where(dropped[:, 1:] != 0, 2 * plain[:, 1:], 0.0))


def test_rmsnorm_under_cpu_autocast_uses_the_norms_eps():
    # Reference: the formula in float64 with the norm's own eps (conftest.assert_rmsnorm_rounded_once). With
    # eps=1 against inputs of mean square about 9, eps moves every output by about 5%, far past bf16's half step:
    # an eps that the bf16 path replaced (by float32's machine epsilon) shows.
    norm, x = rmsnorm_bf16_case(seed=2)
    norm.eps = 1.0
    assert_rmsnorm_rounded_once(norm, x)


def test_selective_checkpointing_recomputes_no_matmul_and_full_checkpointing_every_block():
    # Reference: torch's FlopCounterMode over backward (matmul and attention FLOPs). Without checkpointing backward
    # runs only gradient matmuls; 'selective' saves the matmul and attention outputs (SAVED_OPS), so it runs the
    # same FLOPs; 'full' recomputes each block's forward first: more, all but the MLP's down projections (whose
    # output backward never needs: non-reentrant checkpointing stops its recompute there), 3/4 of the blocks' here.
    from torch.utils.flop_counter import FlopCounterMode
    x, y = random_batch(0, 2, 16, 32)
    flops = {}
    for mode in ('none', 'selective', 'full'):
        model = tiny_model()
        model.activation_checkpointing = mode
        _, loss = model(x, y)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[mode] = counter.get_total_flops()
    down = sum(2 * x.numel() * block.mlp.down.weight.numel() for block in model.blocks)
    h = model.wte(x)
    cos, sin = rotary_tables(model.cos[:16], model.sin[:16])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for block in model.blocks:
            h = block(h, cos, sin)
    assert flops['selective'] == flops['none']
    assert flops['full'] == flops['none'] + counter.get_total_flops() - down


def test_head_dim_is_the_width_over_the_query_heads_and_n_kv_head_defaults_to_n_head():
    # Reference: head_dim = n_embd / n_head (GPT-2, Llama; GQA's fewer key/value heads share it, they do not widen
    # it), so Llama 3.2 1B's shape, width 2048, 32 query and 8 key/value heads, has heads of 64 and a fused QKV
    # projection of (32 + 2 * 8) * 64 rows. Here the same ratios, scaled down.
    config = tiny_config(n_embd=64, n_head=8, n_kv_head=2)
    assert config.head_dim == 8
    attn = CausalSelfAttention(config)
    assert attn.qkv.weight.shape == ((8 + 2 * 2) * 8, 64) and attn.proj.weight.shape == (64, 64)
    default = tiny_config(n_embd=64, n_head=8)  # n_kv_head 0: one key/value head per query head (GPT-2's attention)
    assert default.n_kv_head == 8 and default.head_dim == 8


def test_x0_mix_adds_the_same_dropped_out_embeddings_that_the_first_block_reads():
    # Reference: x0 is the token embeddings after the embedding dropout, one draw (the module docstring: x = x0 =
    # drop(wte(idx))): in train mode with dropout=0.5, block 1 reads block 0's output + x0_scale[0] * block 0's
    # input, exactly, not a second, undropped copy of the embeddings.
    model = tiny_model(dropout=0.5, x0_mix=True).train()
    with torch.no_grad():
        model.x0_scale.fill_(0.5)
    seen = {}
    model.blocks[0].register_forward_hook(lambda m, args, out: seen.update(x0=args[0].clone(), out0=out.clone()))
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.update(in1=args[0].clone()))
    with torch.no_grad():
        model(random_batch(0, 2, 16, 32)[0])
    assert (seen['x0'] == 0).float().mean() > 0.3  # the dropout drew
    torch.testing.assert_close(seen['in1'], seen['out0'] + 0.5 * seen['x0'], rtol=0, atol=0)


def test_head_dim_set_apart_from_the_width_needs_no_divisible_width():
    # Reference: Qwen3's attention (transformers' Qwen3Attention): heads of head_dim each, q projected to
    # n_head * head_dim and back to the width by o_proj, which need not be n_embd; so n_embd=40 with 3 heads of 16
    # (48 wide) is a valid config, and only a derived head_dim (0) asks n_embd to divide by n_head.
    config = tiny_config(n_embd=40, n_head=3, head_dim=16)
    assert config.head_dim == 16
    model = GPT(config)
    assert model.blocks[0].attn.proj.weight.shape == (40, 48)
    logits, _ = model(random_batch(0, 2, 16, 32)[0])
    assert logits.shape == (2, 16, 32) and torch.isfinite(logits).all()
