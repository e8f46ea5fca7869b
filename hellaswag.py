"""
A checkpoint's zero-shot accuracy on HellaSwag (Zellers et al. 2019, https://arxiv.org/abs/1905.07830): for each item
of its validation split (10,042), which of four endings of a short text the model finds the most likely. The
downstream yardstick of GPT-2 reproductions; chance is 25%.

    python hellaswag.py --out_dir=out-gpt2                 # the val split, downloaded to data/hellaswag/ on first use
    python hellaswag.py --out_dir=out-small --limit=500    # its first 500 items
    python hellaswag.py --out_dir=out-gpt2 --input=PATH    # a copy of hellaswag_val.jsonl (JSON lines) you have

Scored as lm-evaluation-harness scores its `hellaswag` task (zero-shot), so that the figures compare with the ones
it gives for other models:
- the text is `activity_label: ctx_a Ctx_b` (ctx_b capitalized as str.capitalize does); it and each ending go through
  preprocess (" [title]" becomes ". ", other bracketed tags go, double spaces become one);
- each ending, after a space, is scored by the sum of its tokens' log-probabilities given the text (encode_pair:
  the ending's tokens are those of text + ending past the text's own); where the two are longer than block_size + 1
  tokens, the text's first tokens are cut;
- acc: the ending with the highest sum; acc_norm: the highest sum per character of the ending.
The log-probabilities are over the data's vocabulary (meta.json's vocab_size: the ids a padded vocabulary adds are
masked). An item the tokenizer cannot encode (a character-level vocabulary lacks one of its characters), or with an
ending longer than block_size tokens or with none of its own (rows_of), is left out, and the result says how many
and why. The result line gives each accuracy with its standard error (over the items, as lm-evaluation-harness
gives it) and the accuracy of a random pick.
"""
import http.client
import json
import math
import os
import re
import sys
import urllib.request
from contextlib import nullcontext

import torch

from configurator import configure, ConfigError
from sample import load_model
from train import TrainError, check_device, out_of_memory, pick_device, pick_dtype

URL = 'https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl'
DEFAULT_INPUT = 'data/hellaswag/hellaswag_val.jsonl'

DEFAULTS = dict(
    out_dir='out',
    ckpt='ckpt.pt',          # 'ckpt.pt' (latest) or 'best.pt' (lowest val loss)
    input=DEFAULT_INPUT,     # HellaSwag's JSON lines; this default is downloaded from rowanz/hellaswag if missing
    limit=0,                 # score the first this many items; 0: all
    batch_size=8,            # items per forward (4 endings each)
    device='auto',
    dtype='auto',
)


def download(path, url, timeout=60):
    """url to path, through a temporary file beside it: an interrupted download leaves nothing at path, nor does one
    whose connection closed early (fewer bytes than its Content-Length, which http.client does not raise for)."""
    print(f"hellaswag.py: downloading {url} to {path}", file=sys.stderr)
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, 'wb') as f:
            size, expected = 0, response.headers.get('Content-Length')
            while chunk := response.read(1 << 20):
                size += f.write(chunk)
        if expected is not None and size != int(expected):
            raise OSError(f"the connection closed after {size:,} of its {int(expected):,} bytes")
        os.replace(tmp, path)
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError and timeouts are OSErrors
        raise TrainError(f"could not download {url} to {path} ({e}): fetch it by hand to that path, or pass "
                         f"--input=PATH") from None
    finally:
        if os.path.exists(tmp):  # (Ctrl-C too)
            os.remove(tmp)


def preprocess(text):
    """lm-evaluation-harness's clean-up of HellaSwag's text (its WikiHow half carries tags such as [title], [step])."""
    text = text.strip().replace(' [title]', '. ')
    text = re.sub(r'\[.*?\]', '', text)
    return text.replace('  ', ' ')


def read_items(path, limit=0):
    """[(text, endings, label)] of a HellaSwag JSON lines file, the first `limit` (0: all); a line that is not a
    HellaSwag item is a TrainError naming it."""
    items = []
    try:
        with open(path, encoding='utf-8') as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if limit and len(items) == limit:
                    break
                where = f"{path} line {number}"
                try:
                    item = json.loads(line)
                except ValueError as e:
                    raise TrainError(f"{where} is not JSON: {e}") from None
                if not isinstance(item, dict):
                    raise TrainError(f"{where}: expected a JSON object, got {type(item).__name__}")
                if missing := [k for k in ('activity_label', 'ctx_a', 'ctx_b', 'endings', 'label') if k not in item]:
                    raise TrainError(f"{where} lacks {', '.join(missing)}"
                                     + (" (the test split has no labels: use val)" if 'label' in missing else ''))
                endings, label = item['endings'], item['label']
                if not (isinstance(endings, list) and len(endings) >= 2 and all(isinstance(e, str) for e in endings)
                        and all(isinstance(item[k], str) for k in ('activity_label', 'ctx_a', 'ctx_b'))):
                    raise TrainError(f"{where}: expected text in activity_label, ctx_a and ctx_b, and a list of at "
                                     f"least two endings")
                if isinstance(label, str) and label.isdigit():
                    label = int(label)
                if type(label) is not int or not 0 <= label < len(endings):
                    raise TrainError(f"{where}: label {item['label']!r} is not the index of one of its "
                                     f"{len(endings)} endings")
                text = preprocess(item['activity_label'] + ': ' + item['ctx_a'] + ' ' + item['ctx_b'].capitalize())
                items.append((text, [preprocess(e) for e in endings], label))
    except (OSError, UnicodeDecodeError) as e:
        raise TrainError(f"cannot read {path}: {e}") from None
    if not items:
        raise TrainError(f"{path} holds no items")
    return items


def encode_pair(encode, context, continuation):
    """(context's tokens, continuation's tokens) as lm-evaluation-harness splits them: the context's own, and those
    of context + continuation past their count, so that a BPE merges across the join as it would in running text.
    Spaces that end the context go to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


def rows_of(item, encode, block_size):
    """Each ending's row: (tokens, n), the last block_size + 1 tokens of text and ending, whose last n are the
    ending's. A ValueError says why the item cannot be scored."""
    text, endings, _ = item
    rows = []
    for ending in endings:
        head, tail = encode_pair(encode, text, ' ' + ending)
        if not tail:  # nothing to score (the harness would score it 0, the most likely of all)
            raise ValueError("an ending with no tokens of its own: the tokenizer merged it into the text's last one")
        if len(tail) > block_size:
            raise ValueError(f"an ending of {len(tail)} tokens, longer than block_size={block_size}")
        rows.append(((head + tail)[-(block_size + 1):], len(tail)))
    return rows


@torch.inference_mode()
def log_likelihoods(model, rows, vocab_size, device, autocast):
    """The sum of the log-probabilities of each row's last n tokens, each given the tokens before it: one forward
    over the rows, right-padded to the longest (causal attention: the padding after a row changes nothing in it)."""
    T = max(len(tokens) for tokens, _ in rows) - 1
    x = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (tokens, _) in enumerate(rows):
        x[i, :len(tokens) - 1] = torch.tensor(tokens[:-1])
    with autocast:
        logits, _ = model(x.to(device))  # (B, T, padded vocab)
    out = []
    for i, (tokens, n) in enumerate(rows):
        end = len(tokens) - 1  # the position that predicts the row's last token
        log_probs = logits[i, end - n:end, :vocab_size].float().log_softmax(-1)  # (n, vocab_size)
        targets = torch.tensor(tokens[-n:], device=log_probs.device)
        out.append(log_probs.gather(1, targets[:, None]).sum())
    return torch.stack(out).tolist()


def evaluate(model, items, encode, vocab_size, device, autocast, batch_size=8):
    """{'acc', 'acc_norm', 'acc_se', 'acc_norm_se', 'items', 'left_out', 'chance'}: the accuracies over the items
    scored, their standard errors, how many were scored, [(index, why)] of the items left out, and the accuracy
    of a random pick among each item's endings."""
    block_size = model.config.block_size
    correct, correct_norm, chance, left_out, batch = 0, 0, 0.0, [], []

    def score(batch):
        nonlocal correct, correct_norm, chance
        sums = log_likelihoods(model, [row for _, rows in batch for row in rows], vocab_size, device, autocast)
        for (text, endings, label), _ in batch:
            lls, sums = sums[:len(endings)], sums[len(endings):]
            chance += 1 / len(endings)
            correct += max(range(len(endings)), key=lambda j: lls[j]) == label
            correct_norm += max(range(len(endings)), key=lambda j: lls[j] / max(len(endings[j]), 1)) == label

    for index, item in enumerate(items):
        try:
            batch.append((item, rows_of(item, encode, block_size)))
        except ValueError as e:
            left_out.append((index, str(e)))
            continue
        if len(batch) == batch_size:
            score(batch)
            batch = []
    if batch:
        score(batch)
    n = len(items) - len(left_out)
    if not n:
        raise TrainError(f"none of the {len(items)} items could be scored: item {left_out[0][0]}: {left_out[0][1]}")
    acc, acc_norm = correct / n, correct_norm / n
    return dict(acc=acc, acc_norm=acc_norm, acc_se=standard_error(acc, n), acc_norm_se=standard_error(acc_norm, n),
                items=n, left_out=left_out, chance=chance / n)


def standard_error(p, n):
    """Of a mean of n scores of 0 or 1 whose mean is p: their sample standard deviation over sqrt(n)."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float('nan')


def main(argv):
    cfg = configure(DEFAULTS, argv, __file__)
    for key, least in (('limit', 0), ('batch_size', 1)):
        if cfg[key] < least:
            raise ConfigError(f"{key}={cfg[key]} is out of range: {least} or more")
    check_device(cfg['device'])
    device = pick_device(cfg['device'])
    dtype, _ = pick_dtype(cfg['dtype'], torch.device(device).type)
    path, ckpt_path = cfg['input'], f"{cfg['out_dir']}/{cfg['ckpt']}"
    if not os.path.exists(path) and path != DEFAULT_INPUT:
        raise ConfigError(f"--input={path}: no such file")
    model, ckpt, encode, _ = load_model(ckpt_path, device)  # before a download: a wrong out_dir fails at once
    if not os.path.exists(path):
        download(path, URL)
    items = read_items(path, cfg['limit'])
    autocast = (nullcontext() if dtype == 'float32'
                else torch.autocast(torch.device(device).type, dtype=getattr(torch, dtype)))
    try:
        r = evaluate(model, items, encode, ckpt['meta']['vocab_size'], device, autocast, cfg['batch_size'])
    except Exception as e:
        if out_of_memory(e) is None:
            raise
        raise TrainError(f"out of memory on {device} scoring batch_size={cfg['batch_size']} items at once: a "
                         f"lower batch_size") from None
    iteration = f", iteration {ckpt['iter_num']}" if 'iter_num' in ckpt else ''
    se = {k: 'n/a (one item)' if math.isnan(r[k]) else f"{r[k]:.4f}" for k in ('acc_se', 'acc_norm_se')}
    print(f"hellaswag: acc {r['acc']:.4f} ± {se['acc_se']}, acc_norm {r['acc_norm']:.4f} ± {se['acc_norm_se']} "
          f"over {r['items']:,} items of {path} ({ckpt_path}{iteration}, {dtype}; chance {r['chance']:.2f})")
    if r['left_out']:
        index, why = r['left_out'][0]
        print(f"hellaswag: {len(r['left_out']):,} of {len(items):,} items left out, not scored (the first, item "
              f"{index}: {why}): the accuracies are over the rest")
    return r


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (ConfigError, TrainError) as e:
        sys.exit(f"hellaswag.py: error: {e}")
