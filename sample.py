"""
Print text from a trained model. The model's shape and the tokenizer come from the checkpoint.

    python sample.py --out_dir=out-small
    python sample.py --out_dir=out-small --ckpt=best.pt --start="ROMEO:" --num_samples=2 --top_p=0.95

Flags are read by configurator.py, like train.py's; --ckpt picks ckpt.pt (the latest) or best.pt (the lowest val
loss); --start=FILE:prompt.txt reads the prompt from a file. A prompt longer than the model's block_size is cut to
its last block_size tokens, with a note on stderr. A sample ends at the data's end-of-text token (meta.json's
eot_token: tiktoken's <|endoftext|>, an hf tokenizer's eos), which is not printed; --stop_at_eot=False prints every
token drawn, past it. The samples are one batch: out of memory is an error that asks for fewer (num_samples).
"""
import os
import sys
from contextlib import nullcontext

import torch

from configurator import configure, ConfigError
from model import GPT, GPTConfig
from prepare_data import get_tokenizer
from train import TrainError, check_device, compiled_note, load_checkpoint, out_of_memory, pick_device, pick_dtype

DEFAULTS = dict(
    out_dir='out',
    ckpt='ckpt.pt',          # 'ckpt.pt' (latest) or 'best.pt' (lowest val loss)
    start='\n',              # the prompt, or FILE:path
    num_samples=3,
    max_new_tokens=500,
    temperature=0.8,         # 0: greedy
    top_k=200,               # 0: off
    top_p=1.0,               # 1.0: off
    seed=1337,
    stop_at_eot=True,        # end a sample at the end-of-text token (BPE data that has one)
    device='auto',
    dtype='auto',
)


def main(argv):
    cfg = configure(DEFAULTS, argv, __file__)
    for key, ok, wanted in (
            ('num_samples', cfg['num_samples'] >= 1, 'at least 1'),
            ('max_new_tokens', cfg['max_new_tokens'] >= 0, '0 or more'),
            ('temperature', 0 <= cfg['temperature'] <= torch.finfo(torch.float32).max, '0 (greedy) or more, finite'),
            ('top_k', cfg['top_k'] >= 0, '0 (off) or more'),
            ('top_p', 0 < cfg['top_p'] <= 1, 'above 0, at most 1 (off)'),
            ('seed', 0 <= cfg['seed'] < 2**63, 'from 0 to 2**63 - 1')):
        if not ok:
            raise ConfigError(f"{key}={cfg[key]} is out of range: {wanted}")
    check_device(cfg['device'])
    device = pick_device(cfg['device'])
    device_type = torch.device(device).type
    dtype, _ = pick_dtype(cfg['dtype'], device_type)
    model, ckpt, encode, decode = load_model(f"{cfg['out_dir']}/{cfg['ckpt']}", device)
    meta = ckpt['meta']

    prompt = cfg['start']
    if prompt.startswith('FILE:'):
        try:
            with open(prompt[5:], encoding='utf-8', newline='') as f:  # its line ends as they are (\r\n too)
                prompt = f.read()
        except (OSError, ValueError) as e:  # missing, unreadable, not UTF-8
            raise ConfigError(f"--start={cfg['start']}: cannot read {prompt[5:]} ({e})") from None
    try:
        ids = encode(prompt)
    except ValueError as e:
        raise ConfigError(f"--start: {e}") from None
    if not ids:
        raise ConfigError("--start is empty: give at least one character of prompt")
    if len(ids) > model.config.block_size:
        print(f"sample.py: the prompt's {len(ids)} tokens are cut to the model's block_size, its last "
              f"{model.config.block_size}", file=sys.stderr)
        ids = ids[-model.config.block_size:]
    stop = meta.get('eot_token') if cfg['stop_at_eot'] else None  # None: char data, an hf tokenizer without eos
    generator = torch.Generator(device).manual_seed(cfg['seed'])
    autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type, dtype=getattr(torch, dtype))
    try:
        x = torch.tensor(ids, dtype=torch.long, device=device).repeat(cfg['num_samples'], 1)  # the samples: a batch
        with autocast:
            y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'],
                               top_k=cfg['top_k'] or None, top_p=cfg['top_p'], vocab_limit=meta['vocab_size'],
                               generator=generator, stop_token=stop)
    except Exception as e:
        if out_of_memory(e) is None:
            raise
        raise TrainError(f"out of memory on {device} generating num_samples={cfg['num_samples']} samples at once "
                         f"(one batch, {len(ids) + cfg['max_new_tokens']} tokens each): fewer samples, or a lower "
                         f"max_new_tokens") from None
    try:
        for row in y.tolist():
            if stop in row[len(ids):]:  # the text before the sample's first stop (the prompt may hold one)
                row = row[:row.index(stop, len(ids))]
            print(decode(row))
            print('-' * 80)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted (the recipe of Python's docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def load_model(path, device):
    """(the model on device in eval mode, the checkpoint, encode, decode): a train.py checkpoint's model and its data's
    tokenizer (hellaswag.py reads checkpoints with it too). Each way a file can fail is a TrainError naming it."""
    ckpt = load_checkpoint(path)  # to the CPU: the optimizer's state never reaches the device
    if missing := [k for k in ('model', 'model_args', 'meta') if k not in ckpt]:
        raise TrainError(f"{path} is not a checkpoint of train.py: it lacks {', '.join(missing)}")
    try:
        model = GPT(GPTConfig(**ckpt['model_args']))
    except (TypeError, ValueError) as e:  # a key GPTConfig lacks, or a shape it refuses (not written by train.py)
        raise TrainError(f"{path}: its model_args do not make a model.py config: {e}") from None
    try:
        model.load_state_dict(ckpt['model'])
    except RuntimeError as e:  # names missing, unexpected or misshapen
        raise TrainError(f"{path}: its weights do not fit its model_args{compiled_note(ckpt['model'])}: "
                         f"{' '.join(str(e).split())[:500]}") from None
    model.to(device).eval()
    try:
        encode, decode = get_tokenizer(ckpt['meta'])
    except ValueError as e:  # a tokenizer that cannot be had here (tiktoken's files offline, a moved tokenizer.json)
        raise TrainError(f"{path}: its tokenizer: {e}") from None
    return model, ckpt, encode, decode


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (ConfigError, TrainError) as e:
        sys.exit(f"sample.py: error: {e}")
