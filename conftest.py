"""Helpers shared by the test files: a tiny dataset on disk, exact comparison of nested state."""
import json
import os

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
    keys = ('iter', 'loss', 'lr', 'train_loss', 'val_loss')
    return [{k: r[k] for k in keys if k in r} for r in lines]


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)
