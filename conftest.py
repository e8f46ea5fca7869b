"""Helpers shared by the test files: a tiny dataset on disk, exact comparison of nested state, RMSNorm on bf16
input against float64."""
import json
import os
import warnings

import numpy as np
import torch


def write_dataset(d, train, val, vocab, **meta):
    """train.bin / val.bin holding the given ids as uint16, and a char-level meta.json whose vocab
    characters start at U+0100; entries of `meta` replace the computed ones."""
    os.makedirs(d, exist_ok=True)
    train, val = np.asarray(train, np.uint16), np.asarray(val, np.uint16)
    train.tofile(os.path.join(d, 'train.bin'))
    val.tofile(os.path.join(d, 'val.bin'))
    fields = dict(tokenizer='char', vocab_size=vocab, dtype='uint16', train_tokens=len(train),
                  val_tokens=len(val), chars=''.join(chr(0x100 + i) for i in range(vocab)))
    fields.update(meta)
    with open(os.path.join(d, 'meta.json'), 'w') as f:
        json.dump(fields, f)
    return str(d)


def assert_same(a, b, where='state'):
    """Nested dicts / lists / tensors equal exactly (torch.equal for tensors, == for the rest)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f'{where}[{k!r}]')
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f'{where}[{i}]')
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl, in order."""
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def deterministic(lines):
    """The fields of metrics.jsonl that an exact resume must repeat (not the timings)."""
    keys = ('iter', 'loss', 'grad_norm', 'lr', 'train_loss', 'val_loss', 'train_bpb', 'val_bpb')
    return [{k: r[k] for k in keys if k in r} for r in lines]


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def rmsnorm_bf16_case(device='cpu', seed=0, C=32):
    """model.RMSNorm with a float32 gain away from 1, and 64 rows of bf16 input on device: what the q/k norms of
    qk_norm, and every norm with autocast_residual, get under autocast."""
    from model import RMSNorm
    torch.manual_seed(seed)
    norm = RMSNorm(C, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(C))
    return norm, (torch.randn(64, C) * 3).bfloat16().to(device).requires_grad_()


def assert_rmsnorm_rounded_once(norm, x):
    """norm(x) under autocast against the formula in float64 on the bf16 input: float32 math rounded once, so
    within half a bf16 step (at most 2^-8 of the value) of the exact value, as is the input's gradient; the
    gain's gradient stays float32; no warning (torch's own path warns that it cannot fuse a float32 gain with
    bf16 input). Returns the exact values."""
    g = torch.randn(x.shape, dtype=torch.float64).to(x.device)
    with warnings.catch_warnings(), torch.autocast(x.device.type, dtype=torch.bfloat16):
        warnings.simplefilter('error')
        y = norm(x)
        got = torch.autograd.grad(y, (x, norm.weight), g.bfloat16())
    assert y.dtype == torch.bfloat16 and got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * w64
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0 ** -8 * 1.001).all()
    want = torch.autograd.grad(exact, (x64, w64), g.bfloat16().double())
    torch.testing.assert_close(got[0].double(), want[0], rtol=2.0 ** -8, atol=1e-6)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-5)
    return exact.detach()
