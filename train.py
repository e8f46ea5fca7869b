"""
Train a GPT on the token files that prepare_data.py writes. Read top to bottom: the defaults, the pieces
of a training run (device and dtype, data, schedule and optimizer, FP8, step and eval, checkpoints, processes),
the config checks, then main(): setup() builds and checks everything once, report() prints what the run is,
and train_loop() runs a loop free of option branches.

    python prepare_data.py && python train.py config/train_small.py       # CPU, a few minutes on 2 cores
    python train.py config/train_shakespeare_char.py --compile=True       # one GPU
    python train.py config/train_small.py --init_from=resume              # continue out_dir/ckpt.pt
    python train.py --init_from=hf:models/SmolLM2-135M --data_dir=data/smol --block_size=512  # finetune
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py  # 8 GPUs, DDP
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py --parallelism=fsdp

Every default below can be overridden by config files and --key=value flags (configurator.py: unknown
keys and wrong types are errors; check_config: values out of range are errors; setting_warnings: a setting
that has no effect in this run, or a learning-rate schedule cut short, is named). Features, each findable by name:
- device and dtype chosen once (pick_device, pick_dtype): cuda > mps > cpu; bf16 autocast where the GPU
  has it, else fp16 with a GradScaler; float32 on CPU (bf16 on request: dtype=bfloat16, or
  dtype=bfloat16_if_native where the CPU has bf16 units: cpu_has_bf16); TF32 matmuls on CUDA.
- data (read_meta, load_tokens, Batches): memory-mapped token files, checked before training; seeded
  random windows; pinned memory and non-blocking copies on CUDA; the next batch is prefetched; the first
  short_block_iters steps can train on shorter windows, growing to block_size (window_at, in_windows).
- train_step: gradient accumulation (loss / k per micro-step; under CUDA graphs the first gradients copied out
  of the graphs' memory: gradients_out_of_cuda_graphs), gradient clipping, a guard that keeps
  non-finite losses and gradients away from the weights (max_nonfinite_steps in a row stop the run; weights
  that are not finite are never saved: weights_finite).
- configure_optimizer (weight decay on matrices only): AdamW, fused on CUDA; bitsandbytes' 8-bit AdamW
  (adamw8bit; paged_adamw8bit, refused where its state would not fit in free GPU memory, and paged again on
  resume: make_paged_state, restore_paged_state); Muon for the blocks' matrices (muon_split, muon_momentum,
  muon_ns_steps; its Newton-Schulz in bf16 where native: muon_ns_dtype); torchao's CPU-offload AdamW. get_lr:
  warmup + cosine or WSD. Label smoothing.
- FP8 (convert_to_fp8, fp8_layer_filter, cast_first): torchao float8 training of the large linear layers.
- autocast_residual: the residual stream in autocast's dtype (model.autocast_residual).
- activation checkpointing (full or selective), torch.compile (every shape of a step or an evaluation
  compiled before training: in_windows, eval_warm_up; loud fallback to eager if it fails, a stop with advice
  if it runs out of memory), periodic eval (also at iteration 0: eval_at_start; eval_iters=0: the whole val
  split, Windows).
- deterministic=True (deterministic_algorithms): torch's deterministic algorithms, and with them inductor's
  deterministic mode, for the run: a compiled CPU run repeats bit for bit on any number of threads.
- init_from=hf:PATH (model_shape, start_from_hf; the mapping is export.py's): start from the weights of a
  Hugging Face Llama or Qwen3 directory, its shape taken from its config.json.
- checkpoints (save_checkpoint, load_checkpoint): atomic writes, latest (ckpt.pt) and best (best.pt),
  loaded with weights_only=True and their CRC-32s checked (check_crc); exact resume including data and RNG
  state (on the CPU bit for bit, eager, and compiled on one thread or with deterministic=True:
  deterministic_algorithms, README), with the changed
  settings printed (config_diff); refused on data with another vocabulary (vocabulary_mismatch), on another
  shape (SHAPE_KEYS) or optimizer (OPTIMIZER_KEYS), or on a model setting this model.py lacks; the best val loss
  starts over when what it depends on changes (EVAL_KEYS, eval_changes, the data's token counts), the earlier
  best.pt moved aside (move_best_aside); a learning rate the changes make jump is a warning; a resume cuts
  metrics.jsonl back to its checkpoint (truncate_metrics); a scratch run moves an earlier run's files aside
  instead of overwriting them (move_aside); one run at a time in an out_dir (lock_out_dir).
- file-system failures: data files read and out_dir written once at start (check_readable, probe_out_dir);
  every later OSError is a one-line error naming the file, except a metrics line, which is only a warning; a
  reader of stdout that goes away (| head) does not stop the run (say).
- SIGTERM/SIGINT: finish the step, save, exit with the command that resumes (a second one: exit at once).
  Out of memory in a step or an evaluation: a one-line error with what to change (memory_advice) and the last
  checkpoint (last_checkpoint).
- torchrun: DDP or FSDP2 (parallelism), gloo on CPU; under DDP the gradients are views of its all-reduce
  buckets (grad_views), buffers are not broadcast, and compile with activation checkpointing makes one graph
  (optimize_ddp off); FSDP2 shards each block (the last stays unsharded after its forward) and refuses float16,
  optimizers other than AdamW, and CUDA-graph compile modes with accumulation; in one process parallelism is a
  warning; gradient_accumulation_steps is the global count;
  every process draws the same windows and takes its share (Batches), so results and checkpoints do not
  depend on the number of processes.
- logging: loss, gradient norm (before clipping), lr, ms/iter, tokens/s, MFU, peak memory, time left (evals_left:
  evaluations to come counted); out_dir/metrics.jsonl gets the loss, grad_norm, lr, tokens/s, MFU, peak memory
  and the eval losses and bits per byte (tokens_per_byte), each line with the tokens so far and time_s (wall
  seconds since train.py started: START_TIME), drawn into out_dir/metrics.png at the evaluations at least
  PLOT_EVERY_S apart and at the last (plot_metrics, with plot.py) and, with wandb_log=True, sent to Weights &
  Biases (start_wandb);
  the optimizer state's bytes per parameter and where it lives (state_where: GPU, CPU or paged managed memory).
"""
import time

START_TIME = time.time()  # first of all, before the heavy imports: time_s counts from here (see log_metrics)

import collections  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import zipfile  # noqa: E402
from contextlib import contextmanager, nullcontext, suppress  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,  # noqa: E402
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

# ----------------------------------------------------------------------------------------------------
# defaults: every name here can be set from a config file or a --key=value flag
# I/O
out_dir = 'out'                 # ckpt.pt (latest, for resume), best.pt (best val loss), metrics.jsonl and .png
data_dir = 'data/shakespeare_char'  # train.bin, val.bin and meta.json from prepare_data.py
init_from = 'scratch'           # 'scratch', 'resume' from out_dir/ckpt.pt, or 'hf:PATH': the weights of a
                                # Hugging Face Llama/Qwen3 directory (model shape from its config.json)
eval_interval = 250             # evaluate and save a checkpoint every this many iterations
eval_iters = 50                 # batches per split in each evaluation; 0: the whole val split (Windows, below)
eval_at_start = True            # evaluate at iteration 0 of a new run (scratch or hf:, before any step) too
log_interval = 10               # iterations between log lines
wandb_log = False               # also send metrics.jsonl's records to Weights & Biases (process 0)
wandb_project = 'gpt'
wandb_run_name = ''             # '': wandb picks a name
seed = 1337
# model (model.GPTConfig)
n_layer = 12
n_head = 12
n_kv_head = 0                   # 0: n_head (multi-head attention); fewer: grouped-query attention
n_embd = 768
head_dim = 0                    # channels per attention head; 0: n_embd // n_head
mlp_hidden = 0                  # the MLP's hidden width; 0: 8/3 n_embd (4 n_embd for gelu and relu2), a multiple of 64
block_size = 1024
vocab_size = 0                  # 0: the dataset's vocabulary, rounded up to a multiple of 64
dropout = 0.0
qk_norm = False
tie_embeddings = True
mlp = 'swiglu'                  # 'swiglu', 'geglu', 'gelu' or 'relu2' (ReLU squared)
rope_base = 10000.0
logit_softcap = 0.0             # > 0: logits = softcap * tanh(logits / softcap) (Gemma 2); 0: off
zero_init_proj = False          # the projections into the residual stream (attn.proj, mlp.down) start at zero
x0_mix = False                  # each block after the first adds a learned multiple of the token embeddings
label_smoothing = 0.0           # the training loss logged includes it; evaluations report the plain loss
# batch: tokens per optimizer step = batch_size * block_size * gradient_accumulation_steps
batch_size = 12
gradient_accumulation_steps = 1
short_block_size = 0            # > 0: start on windows of this many tokens, doubled at equal steps up to block_size
short_block_iters = 0           # until this iteration (each drawn window cut into pieces: the same tokens per step)
# optimizer
optimizer = 'adamw'             # 'adamw', 'adamw8bit', 'paged_adamw8bit' (bitsandbytes) or 'muon'
muon_split = False              # muon: orthogonalize q, k, v and gate, up as separate matrices (see Muon)
muon_ns_steps = 5               # muon: Newton-Schulz iterations per step (fewer: cheaper, rougher orthogonalization)
muon_momentum = 0.95            # muon: the momentum of its matrices (Nesterov); beta1 is its AdamW groups'
muon_dtype = 'auto'             # muon: Newton-Schulz in 'float32' or 'bfloat16'; 'auto': bf16 where the device
                                # multiplies bf16 natively (CUDA; CPUs with AVX512-BF16 or AMX), else float32
optimizer_offload = False       # keep AdamW's state in CPU memory (torchao; one CUDA GPU)
learning_rate = 6e-4            # muon uses it too: its updates are scaled to AdamW's RMS
weight_decay = 0.1              # applied to matrices only, never to norms
beta1 = 0.9                     # AdamW's (muon: its AdamW groups'; its matrices' is muon_momentum)
beta2 = 0.95
grad_clip = 1.0                 # clip the global gradient norm to this; 0 disables clipping
# learning rate: linear warmup, then a decay to min_lr at lr_decay_iters, then min_lr
max_iters = 5000
warmup_iters = 100
lr_decay_iters = 0              # 0: max_iters
min_lr = 6e-5
lr_schedule = 'cosine'          # 'cosine' decay, or 'wsd': stable at learning_rate, then a linear decay
wsd_decay_frac = 0.2            # wsd: the decay takes this last fraction of lr_decay_iters
# system
device = 'auto'                 # 'auto' (cuda, then mps, then cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = 'auto'                  # 'auto', 'float32', 'bfloat16', 'float16' (fp16 uses a GradScaler), or
                                # 'bfloat16_if_native': bf16 where the device multiplies it natively, else float32
compile = False                 # torch.compile the model
compile_mode = 'default'        # 'default', 'reduce-overhead' (CUDA graphs), 'max-autotune' or
                                # 'max-autotune-no-cudagraphs' (GEMM and kernel autotuning, minutes of compile)
deterministic = False           # torch.use_deterministic_algorithms (and inductor's deterministic mode): on the CPU
                                # the same command repeats bit for bit, compiled on any number of threads too (the
                                # embedding's gradient summed in order, not by atomic adds); on a GPU no cuDNN
                                # attention, and not verified yet; an op without a deterministic kernel is an error
activation_checkpointing = 'none'  # 'none', 'full' (recompute each block) or 'selective' (all but matmuls)
autocast_residual = False       # under bf16/fp16 autocast, the residual stream in that dtype, not float32: fewer
                                # bytes per step (1.05x at 124M on an H100), each block's update rounded to it
fp8 = False                     # train the large linear layers in FP8 (torchao; CUDA capability >= 8.9)
fp8_recipe = 'tensorwise'       # 'tensorwise' or 'rowwise' scaling
max_nonfinite_steps = 10        # stop after this many consecutive steps with a NaN/inf loss or gradient
parallelism = 'ddp'             # under torchrun: 'ddp' (replicate the model) or 'fsdp' (FSDP2: shard it)
DEFAULTS = {k: v for k, v in dict(globals()).items()
            if k == k.lower() and not k.startswith('_') and isinstance(v, (bool, int, float, str))}
# ----------------------------------------------------------------------------------------------------

from configurator import configure, ConfigError, read_config_file  # noqa: E402
from model import GPT, GPTConfig, peak_flops  # noqa: E402
from prepare_data import HFTokenizer, get_tokenizer, os_reason, probe_dir, token_bytes, vocabulary  # noqa: E402

MODEL_KEYS = list(GPTConfig().to_dict())
# what a resumed run must not change (dropout may; zero_init_proj only chose the initial weights)
SHAPE_KEYS = [k for k in MODEL_KEYS if k not in ('dropout', 'zero_init_proj')]
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, keyed by parameter name
PEAK_LABEL = {'bfloat16': 'bf16', 'float16': 'fp16', 'float32': 'TF32'}  # the peak MFU is stated against
# a drawing of metrics.png takes 0.3 to 1 s of CPU: evaluations seconds apart (small models, tests) would spend
# their time drawing, so they redraw it at most this often
PLOT_EVERY_S = 30
CHECKPOINT_KEYS = ('model', 'optimizer', 'scaler', 'iter_num', 'best_val_loss', 'config', 'model_args', 'meta',
                   'batches', 'rng', 'evaluated')
# what a resumed run must not change for the checkpoint's optimizer state to load
OPTIMIZER_KEYS = ('optimizer', 'optimizer_offload')
# what the val losses depend on besides the model: changed on resume, the best val loss so far no longer compares
EVAL_KEYS = ('data_dir', 'eval_iters', 'batch_size', 'block_size', 'seed')
# what only the start of a run reads (its initial weights, its evaluation at iteration 0): nothing on resume
START_KEYS = ('zero_init_proj', 'eval_at_start')


class TrainError(RuntimeError):
    """A problem with the run's inputs: reported as one clear message, without a traceback (report_error). Under
    torchrun each process prints its own: an error may be one process's alone (a file it cannot read)."""


class PeerError(TrainError):
    """This process stops because another one stopped with an error that it prints: nothing to print here."""


def stop_together(r, message):
    """The error of a stop that every process makes at the same point, from figures they agreed on (a collective):
    process 0's TrainError, which it prints, and the others' PeerError; both marked `together`: under torchrun every
    process waits in main until process 0 has printed it (torchrun stops them all once one has exited)."""
    error = TrainError(message) if r.master else PeerError(message)
    error.together = True
    return error


# ----------------------------------------------------------------------------------------------------
# device and dtype

def pick_device(name):
    if name != 'auto':
        return name
    if torch.cuda.is_available():
        return 'cuda'
    if torch.backends.mps.is_available():
        return 'mps'
    return 'cpu'


def pick_dtype(name, device_type):
    """The compute dtype, and why it was chosen."""
    if name not in CHOICES['dtype']:
        raise TrainError(f"dtype={name!r}: expected one of {', '.join(map(repr, CHOICES['dtype']))}")
    # (not emulated: by default torch counts a GPU before Ampere (V100, T4) as bf16 where it can hold bf16 tensors)
    cuda_bf16 = device_type == 'cuda' and torch.cuda.is_bf16_supported(including_emulation=False)
    if name == 'bfloat16_if_native':
        if cuda_bf16 or (device_type == 'cpu' and cpu_has_bf16()):
            return 'bfloat16', f'this {"GPU supports bf16" if cuda_bf16 else "CPU has " + CPU_BF16}'
        return 'float32', f'no native bf16 on this {device_type}: float32'
    if name != 'auto':
        return name, 'as configured' + emulated_note(name, device_type)
    if device_type == 'cuda':
        if cuda_bf16:
            return 'bfloat16', 'this GPU supports bf16'
        return 'float16', 'this GPU has no bf16: fp16 with a GradScaler'
    return 'float32', f'mixed precision is left off on {device_type} by default'


CPU_BF16 = 'bf16 dot products: AVX512-BF16 or AMX'


def emulated_note(name, device_type):
    """What a reason adds when bf16 is asked of a CPU without bf16 units."""
    slow = name == 'bfloat16' and device_type == 'cpu' and not cpu_has_bf16()
    return '; this CPU has no bf16 dot products: emulated, slower than float32' if slow else ''


def cpu_has_bf16():
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). There a small model's bf16 matmuls run
    about 2x float32's speed; elsewhere they are emulated: a training step under bf16 autocast ran 1.5x
    (AVX-512) to 8x (AVX2) slower than in float32, Newton-Schulz about 10x.
    NOTE: torch's only probes are private helpers; a missing one counts as no."""
    return any(getattr(torch.cpu, f, lambda: False)() for f in ('_is_avx512_bf16_supported', '_is_amx_tile_supported'))


# ----------------------------------------------------------------------------------------------------
# data

def check_readable(path, missing):
    """Open path and read a byte, so that a file that is missing or cannot be read is an error now, naming it."""
    try:
        with open(path, 'rb') as f:
            f.read(1)
    except FileNotFoundError:
        raise TrainError(f"{path} not found: {missing}") from None
    except OSError as e:  # a data_dir that is a file, a file without read permission, an I/O error
        raise TrainError(f"{path} cannot be read: {os_reason(e, path)}") from None


def read_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    check_readable(path, f"prepare the data first, e.g. `python prepare_data.py --data_dir={shlex.quote(data_dir)}`")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise TrainError(f"{path} is not readable JSON ({e}): prepare the data again") from None
    if not isinstance(meta, dict):
        raise TrainError(f"{path} holds {type(meta).__name__}, not the object prepare_data.py writes: prepare the data "
                         f"again")
    missing = [k for k in ('tokenizer', 'vocab_size', 'dtype', 'train_tokens', 'val_tokens') if k not in meta]
    if meta.get('tokenizer') == 'char' and 'chars' not in meta:  # decoding needs them
        missing.append('chars')
    if missing:
        raise TrainError(f"{path} lacks {', '.join(missing)}: prepare the data again")
    wrong = [f"{k}={meta[k]!r}" for k in ('vocab_size', 'train_tokens', 'val_tokens')
             if type(meta[k]) is not int or meta[k] < 0]
    if meta['dtype'] not in ('uint16', 'uint32'):
        wrong.append(f"dtype={meta['dtype']!r}")
    if meta['tokenizer'] == 'char' and (not isinstance(meta['chars'], str) or len(meta['chars']) != meta['vocab_size']):
        wrong.append(f"{len(meta['chars'])} chars for vocab_size={meta['vocab_size']}" if isinstance(meta['chars'], str)
                     else f"chars={str(meta['chars'])[:40]}")
    if wrong:
        raise TrainError(f"{path} holds {', '.join(wrong)} (expected counts, dtype 'uint16' or 'uint32', and a "
                         f"character per id): prepare the data again")
    return meta


def load_tokens(data_dir, split, meta, block_size, vocab_size):
    """Memory-map data_dir/{split}.bin after checking it against meta.json and the model."""
    path = os.path.join(data_dir, f'{split}.bin')
    check_readable(path, f"prepare the data again: `python prepare_data.py --data_dir={shlex.quote(data_dir)}` with "
                         f"the --input and --tokenizer it was made with (meta.json: tokenizer {meta['tokenizer']!r})")
    itemsize = np.dtype(meta['dtype']).itemsize
    size = os.path.getsize(path)
    expected = meta.get(f'{split}_tokens')
    if size % itemsize or size // itemsize != expected:
        raise TrainError(f"{path} has {size} bytes, but meta.json says {expected} tokens of {meta['dtype']} "
                         f"({expected * itemsize} bytes): the files do not belong together; prepare again")
    if expected < block_size + 1:
        raise TrainError(f"{path} holds {expected} tokens, fewer than block_size + 1 = {block_size + 1}: "
                         f"use more text or a smaller block_size")
    tokens = np.memmap(path, dtype=meta['dtype'], mode='r')
    top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))
    if top >= min(vocab_size, meta['vocab_size']):
        raise TrainError(f"{path} holds token id {top}, but the vocabulary has {meta['vocab_size']} ids "
                         f"(meta.json) and the model {vocab_size}: the data and the config do not match")
    return tokens


class Batches:
    """Random windows of block_size + 1 tokens, drawn by a seeded generator, one batch prefetched.

    Each draw takes `groups` micro-batches of batch_size windows for the whole job (an optimizer step's
    worth when training); process `rank` of `world` keeps micro-batches rank, rank + world, ... Every
    process draws the same windows, so what a step sees does not depend on the number of processes.
    state_dict() is the generator's state before the draw of the prefetched batch: restored, it makes a
    run draw exactly the batches the original run would have drawn next.
    """

    def __init__(self, tokens, batch_size, block_size, device, seed, groups=1, rank=0, world=1):
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.device, self.seed = torch.device(device), seed
        self.groups, self.rank, self.world = groups, rank, world
        self.eval_total = groups  # what eval_batches' weights add up to, over all processes
        self.share = len(range(rank, groups, world))  # micro-batches of each draw that are this rank's
        if self.share == 0:
            raise ValueError(f"process {rank} of {world} gets no micro-batch of a draw of {groups}")
        self.generator = torch.Generator()
        self.reset()

    def reset(self):
        self.generator.manual_seed(self.seed)
        self.queue = []
        self._prefetch()

    def _prefetch(self):
        if not self.queue:
            self.state = self.generator.get_state()
            starts = torch.randint(len(self.tokens) - self.block_size, (self.groups, self.batch_size),
                                   generator=self.generator)
            self.queue = starts[self.rank::self.world].tolist()
        T = self.block_size
        buf = torch.from_numpy(np.stack([self.tokens[s:s + T + 1] for s in self.queue.pop(0)]).astype(np.int64))
        if self.device.type == 'cuda':  # page-locked memory lets the copy overlap with compute
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        else:
            buf = buf.to(self.device)
        self.next_batch = buf[:, :-1], buf[:, 1:]  # inputs and targets, (B, T) each

    def next(self):
        batch = self.next_batch
        self._prefetch()
        return batch

    def state_dict(self):
        return {'generator': self.state}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.queue = []
        self._prefetch()

    def eval_batches(self):
        """An evaluation's batches of this process, each with its weight in the mean over all `groups`
        (eval_total): its share of one draw, from the start, then a repeat of weight 0 where the groups do not
        divide evenly, so that every process runs as many forwards (under FSDP each one is a collective)."""
        self.reset()
        for i in range(math.ceil(self.groups / self.world)):
            yield (*self.next(), 1) if i < self.share else (*self.next_batch, 0)


class Windows:
    """Every non-overlapping window of block_size + 1 tokens of a split, in order, batch_size windows per
    forward: the loss over the whole split (all but its last (len - 1) % block_size tokens, too few for a
    window), with no sampling noise. Process `rank` of `world` takes batches rank, rank + world, ..."""

    def __init__(self, tokens, batch_size, block_size, device, rank=0, world=1):
        self.tokens, self.batch_size, self.block_size, self.device = tokens, batch_size, block_size, device
        self.rank, self.world = rank, world
        self.count = (len(tokens) - 1) // block_size  # windows; load_tokens makes it at least 1
        self.eval_total = self.count  # what eval_batches' weights add up to, over all processes
        self.n_batches = math.ceil(self.count / batch_size)

    def batch(self, i):
        """Inputs and targets of the i-th batch of windows, (B, T) each: one contiguous slice of the tokens."""
        T, first, last = self.block_size, i * self.batch_size, min(self.count, (i + 1) * self.batch_size)
        buf = torch.from_numpy(self.tokens[first * T:last * T + 1].astype(np.int64))
        return buf[:-1].view(-1, T).to(self.device), buf[1:].view(-1, T).to(self.device)

    def eval_batches(self):
        """This process's batches, each weighted by its windows (all of equal length) in the mean over all
        `count` of them (eval_total); a process left without a batch repeats the first one with weight 0, so
        that every process runs as many forwards (under FSDP each one is a collective)."""
        for i in range(self.rank, self.world * math.ceil(self.n_batches / self.world), self.world):
            x, y = self.batch(i if i < self.n_batches else 0)
            yield x, y, (x.size(0) if i < self.n_batches else 0)


def eval_splits(cfg, train_tokens, val_tokens, device, rank, world):
    """What each evaluation measures: eval_iters seeded batches of each split, or with eval_iters=0 every window
    of the val split (the train split, 9 times larger on the default data, is then left out)."""
    if cfg.eval_iters == 0:
        return {'val': Windows(val_tokens, cfg.batch_size, cfg.block_size, device, rank, world)}
    return {split: Batches(tokens, cfg.batch_size, cfg.block_size, device, cfg.seed + i, cfg.eval_iters, rank, world)
            for i, (split, tokens) in enumerate([('train', train_tokens), ('val', val_tokens)], start=1)}


def eval_warm_up(splits):
    """A batch of each shape and layout this process's evaluations call the model with, for compile_model to
    compile before training: its first batch of each split and, for Windows, the split's last, which can hold
    fewer windows. As many on every process (under FSDP each forward is a collective)."""
    for batches in splits.values():
        yield next(batches.eval_batches())[:2]
        if isinstance(batches, Windows):
            yield batches.batch(batches.n_batches - 1)


def window_at(it, cfg):
    """The window length that iteration `it` trains on: short_block_size, doubled at equal steps of
    short_block_iters (64, 128 for block_size 256: each for half of them), then block_size."""
    if not cfg.short_block_size or it >= cfg.short_block_iters:
        return cfg.block_size
    doublings = (cfg.block_size // cfg.short_block_size).bit_length() - 1
    return cfg.short_block_size << (it * doublings // cfg.short_block_iters)


def in_windows(x, y, window):
    """A (B, T) micro-batch as (B * T / window, window): the same tokens, less context. At the full length it is
    left as it is: a reshape there can change its strides (a batch of one's), which then fail the guards of the
    graph compiled for it, and Dynamo compiles another."""
    if not window or window == x.size(1):
        return x, y
    return x.reshape(-1, window), y.reshape(-1, window)


# ----------------------------------------------------------------------------------------------------
# optimization

def get_lr(it, cfg):
    """Linear warmup for warmup_iters, a decay to min_lr at lr_decay_iters, min_lr after. The decay is
    lr_schedule's: 'cosine' from the end of warmup; 'wsd' (warmup-stable-decay, Hägele et al. 2024,
    https://arxiv.org/abs/2405.18392) holds learning_rate, then decays linearly over the last
    wsd_decay_frac of lr_decay_iters."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    if cfg.lr_schedule == 'wsd':
        start = max(cfg.warmup_iters, decay_iters - round(cfg.wsd_decay_frac * decay_iters))
        ratio = max(0, it - start) / max(1, decay_iters - start)
        return cfg.learning_rate - ratio * (cfg.learning_rate - cfg.min_lr)
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def optimizers(optimizer):
    """The torch optimizers inside an optimizer (several for Muon's Optimizers)."""
    return list(getattr(optimizer, 'optimizers', [optimizer]))


class Optimizers:
    """Several optimizers stepped as one: Muon for the blocks' matrices, AdamW for the rest."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):  # looked up each time: loading a state dict replaces the groups
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with adjust_lr_fn='match_rms_adamw' (Jordan 2024; Liu et al. 2025): nesterov
    momentum, Newton-Schulz orthogonalization, the step scaled by 0.2 sqrt(max(A, B)) to AdamW's RMS, decoupled
    weight decay. Two things torch's cannot do:
    - parts: a fused matrix listed with its row counts ({param: [q, k, v]} for the QKV projection, [gate, up]
      for a gated MLP) is orthogonalized and scaled part by part, as if each part were a matrix of its own,
      as modded-nanogpt does with separate matrices;
    - cost on small matrices: all matrices (or parts) of one shape go through Newton-Schulz together, as
      batched matmuls, in ns_dtype (None: bf16 on CUDA as torch, float32 elsewhere; train.py passes
      muon_ns_dtype's choice: bf16 where native, see cpu_has_bf16).
    The state is torch's ('momentum_buffer' per matrix; the groups' settings are the constructor's, which
    train.py's resume keeps), so the momentum of either optimizer's checkpoint loads into the other.
    """

    def __init__(self, params, lr, weight_decay, momentum=0.95, ns_steps=5, parts=None, ns_dtype=None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps))
        self.parts, self.ns_dtype = parts or {}, ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mu = group['lr'], group['weight_decay'], group['momentum']
            jobs = collections.defaultdict(list)  # (part shape, device) -> [(param, part's rows, update part)]
            for p in group['params']:
                if p.grad is None:
                    continue
                if 'momentum_buffer' not in self.state[p]:
                    self.state[p]['momentum_buffer'] = torch.zeros_like(p)
                buf = self.state[p]['momentum_buffer']
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu)  # nesterov
                p.mul_(1 - lr * wd)
                sizes = self.parts.get(p, [p.size(0)])
                for rows, part in zip(p.split(sizes), update.split(sizes)):
                    jobs[part.shape, p.device].append((rows, part))
            for (shape, device), parts in jobs.items():
                dtype = self.ns_dtype or getattr(torch, torch_ns_dtype(device.type))
                ortho = newton_schulz(torch.stack([part for _, part in parts]), group['ns_steps'], dtype)
                for (rows, _), o in zip(parts, ortho):
                    rows.add_(o.to(rows.dtype), alpha=-lr * 0.2 * math.sqrt(max(shape)))
        return loss


def newton_schulz(G, steps, dtype=torch.float32):
    """Keller Jordan's quintic Newton-Schulz iteration on each matrix of G (N, A, B), as torch.optim.Muon runs
    it: about U V^T for G = U S V^T (singular values end up in roughly 0.7 to 1.2, which trains as well)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:  # the Gram matrix X X^T of the wide orientation is the smaller one
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # spectral norm at most 1
    for _ in range(steps):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)  # a X + (b A + c A^2) X
    return X.mT if tall else X


def torch_ns_dtype(device_type):
    """Newton-Schulz's dtype by torch.optim.Muon's rule: bf16 on CUDA, float32 elsewhere. Muon's own without
    ns_dtype, and every run's before muon_dtype existed."""
    return 'bfloat16' if device_type == 'cuda' else 'float32'


def muon_ns_dtype(setting, device_type):
    """The name of Muon's Newton-Schulz dtype for muon_dtype=setting, and why. 'auto': bf16 on CUDA (as
    torch.optim.Muon) and where the CPU multiplies bf16 natively (cpu_has_bf16), float32 elsewhere."""
    if setting != 'auto':  # check_config allows 'float32' and 'bfloat16'
        return setting, 'as configured' + emulated_note(setting, device_type)
    if device_type == 'cuda':
        return 'bfloat16', 'as torch.optim.Muon on CUDA'
    if device_type == 'cpu' and cpu_has_bf16():
        return 'bfloat16', 'this CPU has ' + CPU_BF16
    return 'float32', f'{device_type} has no native bf16 matmul'


def configure_optimizer(model, cfg, device_type, fused=None):
    """The optimizer named by cfg.optimizer, with weight decay on matrices (embeddings, linear weights) only.

    adamw: torch's AdamW, fused on CUDA (8 bytes of state per parameter); with optimizer_offload, torchao's
    CPUOffloadOptimizer keeps that state in CPU memory and steps there. adamw8bit, paged_adamw8bit:
    bitsandbytes' 8-bit AdamW (about 2 bytes per parameter; small tensors stay 32-bit, as bitsandbytes
    decides; paged state lives in CUDA managed memory). muon: Muon (see the class) on the blocks' matrices,
    AdamW on everything else (embeddings, head, norms, x0_scale); muon_split orthogonalizes the parts of the
    fused matrices separately. fused=False asks for torch's default AdamW kernels (multi-tensor on CUDA) instead
    of the fused one, as bench.py's early rungs do.
    """
    fused = (device_type == 'cuda') if fused is None else fused
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{'params': [p for n, p in params if p.dim() >= 2], 'weight_decay': cfg.weight_decay},
              {'params': [p for n, p in params if p.dim() < 2], 'weight_decay': 0.0}]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    if cfg.optimizer == 'muon':
        hidden = [p for n, p in params if p.dim() == 2 and n.startswith('blocks.')]
        groups[0]['params'] = [p for n, p in params if p.dim() >= 2 and not n.startswith('blocks.')]
        parts = model.fused_parts() if cfg.muon_split else {}
        muon = Muon(hidden, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                    ns_steps=cfg.muon_ns_steps, parts=parts,
                    ns_dtype=getattr(torch, muon_ns_dtype(cfg.muon_dtype, device_type)[0]))
        return Optimizers(muon, torch.optim.AdamW(groups, **kwargs, fused=fused or None))
    if cfg.optimizer in ('adamw8bit', 'paged_adamw8bit'):
        bnb = import_bitsandbytes(cfg.optimizer, device_type)
        if cfg.optimizer == 'paged_adamw8bit':
            need, free = 2 * sum(p.numel() for n, p in params), torch.cuda.mem_get_info()[0]
            if need > free:  # managed memory beyond what the card has free can hang the GPU
                raise TrainError(f"paged_adamw8bit needs about {need / 2**30:.1f} GiB of GPU memory for its "
                                 f"state, and {free / 2**30:.1f} GiB is free")
        cls = bnb.optim.PagedAdamW8bit if cfg.optimizer == 'paged_adamw8bit' else bnb.optim.AdamW8bit
        return cls(groups, **kwargs)
    if cfg.optimizer_offload:
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError as e:
            raise TrainError(f"optimizer_offload=True needs torchao ({e}): `pip install torchao`") from None
        return CPUOffloadOptimizer(groups, torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs, fused=fused or None)  # None: torch's default kernels


def import_bitsandbytes(name, device_type):
    """bitsandbytes, after one 8-bit step on the device proves that its native library works."""
    if name == 'paged_adamw8bit' and device_type != 'cuda':
        raise TrainError(f"optimizer={name} needs CUDA (its state lives in CUDA managed memory); use adamw8bit")
    # NOTE: on a CPU with AVX512-BF16, bitsandbytes' import warns that a 4-bit inference kernel (another package's)
    # is missing; the 8-bit optimizers never use it
    logging.getLogger('bitsandbytes.backends.cpu.ops').setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
        probe = torch.zeros(4096, device=device_type, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        bnb.optim.AdamW8bit([probe]).step()
    except Exception as e:
        raise TrainError(f"optimizer={name} needs bitsandbytes, which "
                         + ("is not installed" if isinstance(e, ImportError) else "cannot run here")
                         + f" ({type(e).__name__}: {e}). Install it with `pip install bitsandbytes`, or use "
                         f"optimizer=adamw") from None
    return bnb


def state_tensors(optimizer):
    """The optimizer's state tensors (moments, quantization maps, ...), each once. For torchao's
    CPUOffloadOptimizer, those of the optimizers it holds: one on the GPU for the small tensors, one on the
    CPU for each large one."""
    opts = []
    for opt in optimizers(optimizer):
        inner = [getattr(opt, 'd_opt', None), *getattr(opt, 'optim_dict', {}).values()]
        opts += [o for o in inner if o is not None] or [opt]
    seen = {}
    for opt in opts:
        for state in getattr(opt, 'state', {}).values():
            for t in state.values():
                if torch.is_tensor(t):
                    t = local(t)
                    seen[t.device, t.data_ptr()] = t
    return list(seen.values())


def local(t):
    """What this process holds of a tensor: an FSDP-sharded DTensor's shard, any other tensor whole."""
    return t.to_local() if hasattr(t, 'to_local') else t


def local_params(model):
    """The parameters this process holds: all of them, or under FSDP its shards' elements."""
    return sum(local(p).numel() for p in model.parameters())


def optimizer_state_bytes(optimizer):
    """Bytes of optimizer state (moments, quantization maps, ...), each tensor counted once."""
    return sum(t.numel() * t.element_size() for t in state_tensors(optimizer))


def state_where(optimizer):
    """Where the optimizer's state lives, as shares of its bytes; '' before the state exists."""
    where = {}
    for t in state_tensors(optimizer):
        place = ('paged CUDA managed memory' if getattr(t, 'is_paged', False)  # bitsandbytes' paged buffers
                 else 'GPU memory' if t.device.type == 'cuda' else f'{t.device.type.upper()} memory')
        where[place] = where.get(place, 0) + t.numel() * t.element_size()
    total = sum(where.values()) or 1
    return ', '.join(f'{100 * n / total:.3g}% {place}' for place, n in sorted(where.items(), key=lambda kv: -kv[1]))


def optimizer_state(r):
    """The optimizer's state dict, keyed by parameter name, so that it loads under any number of processes."""
    if r.cfg.optimizer_offload:  # torchao's offload optimizer has a state dict of its own
        return r.optimizer.state_dict()
    opts = optimizers(r.optimizer)
    # NOTE: before the first step there is no state, and get_optimizer_state_dict would make some by
    # taking a zero-gradient step, which counts as a step in AdamW's bias correction
    if not agree(any(opt.state for opt in opts), r.device):
        return None
    return get_optimizer_state_dict(r.model, opts, options=FULL_STATE)


def load_optimizer_state(r, state):
    """Load a checkpoint's optimizer state into r.optimizer, then put back this run's settings (betas,
    weight decay, ...) where they are read."""
    optimizer, opts = r.optimizer, optimizers(r.optimizer)
    settings = [{k: v for k, v in group.items() if k != 'params'} for group in optimizer.param_groups]
    if r.cfg.optimizer_offload:  # torchao's offload optimizer has a state dict of its own
        optimizer.load_state_dict(state)
        # NOTE: its param_groups lists the dicts that its on-GPU optimizer (the tensors under minimal_size:
        # the norms) was built with, and load_state_dict gave that optimizer new ones: without this, the
        # learning rate set each step would never reach those parameters again
        if optimizer.d_opt is not None:
            optimizer.d_param_groups = optimizer.d_opt.param_groups
    else:
        paged = [make_paged_state(opt) for opt in opts]
        set_optimizer_state_dict(r.model, opts, state, options=FULL_STATE)
        for opt, buffers in zip(opts, paged):
            restore_paged_state(opt, buffers)
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)


def make_paged_state(opt):
    """For a bitsandbytes paged optimizer: create its state now, as its first step would (the large tensors
    in paged CUDA managed memory), and return the paged buffers by (parameter, key); {} for the others.

    NOTE: left to itself, set_optimizer_state_dict creates the state by a zero-gradient step, whose paged
    buffers bitsandbytes never frees, and bitsandbytes' load_state_dict then puts the loaded state in
    ordinary GPU memory: the resumed run would no longer be paged. With the state already there, that
    step is not taken, and restore_paged_state puts the loaded values back into these buffers.
    """
    if not getattr(opt, 'is_paged', False):
        return {}
    for gindex, group in enumerate(opt.param_groups):
        for pindex, p in enumerate(group['params']):
            opt.init_state(group, p, gindex, pindex)
    return {(p, key): t for p, state in opt.state.items() for key, t in state.items() if getattr(t, 'is_paged', False)}


def restore_paged_state(opt, buffers):
    """Copy the loaded state into the paged buffers of make_paged_state and put those back in the state."""
    for (p, key), buf in buffers.items():
        loaded = opt.state[p].get(key)
        if loaded is None or loaded.shape != buf.shape or loaded.dtype != buf.dtype:
            raise TrainError(f"the checkpoint's optimizer state does not fit paged_adamw8bit ({key}: "
                             f"{None if loaded is None else (loaded.dtype, tuple(loaded.shape))}, expected "
                             f"{(buf.dtype, tuple(buf.shape))}): resume with the optimizer the run started with")
        buf.copy_(loaded)
        opt.state[p][key] = buf


# ----------------------------------------------------------------------------------------------------
# FP8

def fp8_layer_filter(recipe):
    """The linear layers worth training in FP8: dims multiples of 16 (a hardware requirement), large
    enough that the FP8 matmul outruns its casts (thresholds from torchao's H100 tables for each
    recipe), and never the output head (kept in bf16 for the loss' precision, and tied to the embedding
    by default)."""
    def keep(module, fqn):
        if not isinstance(module, torch.nn.Linear) or fqn == 'lm_head':
            return False
        N, K = module.weight.shape  # out, in
        if N % 16 or K % 16:
            return False
        if recipe == 'tensorwise':
            return not (K <= 4096 and N <= 1024)
        return N > 2048 and K > 1024 and not (N <= 4096 and K <= 2048)
    return keep


def convert_to_fp8(model, recipe, device):
    """Swap the layers fp8_layer_filter keeps for torchao's Float8Linear (made cast_first); returns their names."""
    device = torch.device(device)
    if device.type != 'cuda' or torch.cuda.get_device_capability(device) < (8, 9):
        where = torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type
        raise TrainError(f"fp8=True needs a CUDA GPU of compute capability 8.9 or newer (H100, H200, L4, "
                         f"RTX 4090, ...); this run is on {where}. Set fp8=False")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    except ImportError as e:
        raise TrainError(f"fp8=True needs torchao ({e}): `pip install torchao`") from None
    keep = fp8_layer_filter(recipe)
    names = [fqn for fqn, module in model.named_modules() if keep(module, fqn)]
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    cast_first_class = cast_first(Float8Linear, matmul_with_hp_or_float8_args)
    for module in model.modules():
        if type(module) is Float8Linear:
            module.__class__ = cast_first_class
    return names


def cast_first(Float8Linear, matmul_with_hp_or_float8_args):
    """torchao's Float8Linear, whose weight, under compile and autocast, is cast to autocast's dtype before
    torchao's FP8 matmul (its forward's function) gets it, as FSDP's bf16 policy hands it over. Given the float32
    weight, the compiled backward casts the weight's gradient to float32 transposed, then copies it back: one more
    float32 read and write of every FP8 weight per micro-step (405 MB per block at 1.01B: .ci/triton_code.py's code
    for an H100, BENCHMARKS.md); given bf16, one cast. The FP8 values and scales then come from the bf16 weight (as
    under FSDP). In eager, the bf16 copy would be saved for the backward (2 bytes per weight), so there the layer is
    torchao's as it is; and so it is without autocast (float32 runs; FSDP, whose weights arrive in bf16)."""
    class CastFirst(Float8Linear):
        def forward(self, input):
            device = input.device.type
            if not (torch.compiler.is_compiling() and torch.is_autocast_enabled(device)):
                return super().forward(input)
            dtype = torch.get_autocast_dtype(device)
            output = matmul_with_hp_or_float8_args.apply(input.to(dtype), self.weight.to(dtype).t(),
                                                         self.linear_mm_config, self.config)
            return output if self.bias is None else output + self.bias.to(output.dtype)
    CastFirst.__name__ = CastFirst.__qualname__ = f'{Float8Linear.__name__}CastFirst'
    return CastFirst


# ----------------------------------------------------------------------------------------------------
# a training step, an evaluation

def train_step(model, optimizer, scaler, batches, accum_steps, autocast, grad_clip, label_smoothing=0.0,
               grad_sync=lambda last: nullcontext(), window=None, grad_views=False):
    """One optimizer step over this process's accum_steps micro-batches, each (B, T) micro-batch trained
    as (B * T / window, window) when a window is given (short_block_size: the same tokens, less context).

    Returns (loss, grad_norm, ok): the mean loss over the step's micro-batches (of all processes) and the
    gradient norm before clipping, as tensors, and whether the step reached the weights. A non-finite
    loss or gradient norm skips the update (with fp16, the GradScaler also skips overflowing steps).
    grad_sync(last) is the context of each micro-step: under DDP/FSDP it all-reduces gradients on the
    last one only. grad_views: the gradients are views of DDP's all-reduce buckets (gradient_as_bucket_view),
    zeroed in place after the step, not dropped, so that they stay views. NOTE: `ok` costs one host-device
    sync per optimizer step, none per micro-step (fp16's GradScaler adds three after the micro-steps: its
    scale twice, its found-inf flag).
    """
    loss_sum = 0.0
    for micro in range(accum_steps):
        x, y = in_windows(*batches.next(), window)
        with grad_sync(micro == accum_steps - 1):
            with autocast:
                _, loss = model(x, y, label_smoothing=label_smoothing)
            loss = loss / accum_steps  # DDP/FSDP average over processes: the mean over all micro-batches
            scaler.scale(loss).backward()
        loss_sum = loss_sum + loss.detach()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
        loss_sum = loss_sum / dist.get_world_size()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    norm = norm.full_tensor() if hasattr(norm, 'full_tensor') else norm  # FSDP: a DTensor
    # fp16: an overflowing gradient is the GradScaler's to skip, a NaN loss is ours
    finite = torch.isfinite(loss_sum) if scaler.is_enabled() else torch.isfinite(loss_sum) & torch.isfinite(norm)
    ok, scale = bool(finite), scaler.get_scale()  # the scale is 1.0 when the scaler is off
    if ok:
        scaler.step(optimizer)
    scaler.update()
    ok = ok and scaler.get_scale() >= scale  # the scaler lowers its scale when it skips a step
    optimizer.zero_grad(set_to_none=not grad_views)
    return loss_sum, norm, ok


def records_cuda_graphs(compile_mode, device_type):
    """Whether torch.compile's mode records CUDA graphs on this device (reduce-overhead, max-autotune on CUDA)."""
    return device_type == 'cuda' and torch._inductor.list_mode_options(compile_mode).get('triton.cudagraphs', False)


def gradients_out_of_cuda_graphs(model, compile_mode, device_type, accum_steps):
    """NOTE: under CUDA graphs (compile modes reduce-overhead and max-autotune) the backward's gradients are
    outputs in the graphs' own memory, which the next replay, the next micro-step's forward, overwrites: a
    gradient kept across micro-steps to accumulate is an error, or silently wrong (pytorch/pytorch#169545; torch
    2.11 to 2.13). With accumulation, a hook copies each parameter's first gradient of a step out of that memory;
    the later ones add into the copy (one copy of the gradients per step). Returns whether it applies."""
    if not (records_cuda_graphs(compile_mode, device_type) and accum_steps > 1):
        return False
    for p in model.parameters():
        # p.grad is None until a step's first gradient (train_step zeroes with set_to_none); under DDP it is a view
        # of its bucket throughout, which each gradient is added into in place: nothing to copy
        if p.requires_grad:
            p.register_hook(lambda grad, p=p: grad.clone() if p.grad is None else grad)
    return True


@torch.no_grad()
def estimate_loss(model, splits, autocast):
    """Mean loss over each split's batches (Batches: a draw of `groups`; Windows: all its windows), shared among
    processes (each one's eval_batches, weighted); the same every time."""
    model.eval()
    out = {}
    for name, batches in splits.items():
        total = torch.zeros((), device=batches.device)
        for x, y, weight in batches.eval_batches():
            with autocast:
                _, loss = model(x, y)
            total += loss.float() * weight
        if dist.is_initialized():
            dist.all_reduce(total)
        out[name] = (total / batches.eval_total).item()
    model.train()
    return out


def tokens_per_byte(meta, splits, device):
    """({split: its evaluation's target tokens / their bytes of text}, the report's line). An evaluation's
    mean loss, in nats per token, times this, over ln 2, is its bits per byte: a figure that compares across
    tokenizers, as the loss does not. The bytes are prepare_data.token_bytes'; counted once, over the batches of
    every process, since each evaluation draws the same ones. Where any process lacks the bytes (a tokenizer whose
    bytes per token are unknown, or that cannot be loaded here: any error, which never ends the run): {} and the
    line says why; a process other than 0 prints its own reason."""
    table = why = None
    try:
        table = torch.from_numpy(token_bytes(meta)).to(device)
    except Exception as e:
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if dist.is_initialized() and dist.get_rank():  # process 0's report can only say that another one failed
            say(f"process {dist.get_rank()}: bits per byte not reported: {why}", file=sys.stderr)
    if not agree(table is not None, device):  # all processes count, or none: a count is a collective
        return {}, f"bits per byte: not reported: {why or 'another process could not count them'}"
    out = {}
    for name, batches in splits.items():
        counts = torch.zeros(2, dtype=torch.int64, device=device)  # tokens, bytes
        for _, y, weight in batches.eval_batches():
            if weight:
                counts[0] += y.numel()
                counts[1] += table[y].sum()
        if dist.is_initialized():
            dist.all_reduce(counts)
        tokens, nbytes = counts.tolist()
        if nbytes:
            out[name] = tokens / nbytes
    if not out:
        return out, 'bits per byte: not reported: the evaluated targets stand for no bytes of text'
    per_token = ', '.join(f"{name} {1 / ratio:.3f}" for name, ratio in out.items())
    return out, f"bits per byte = eval loss / ln 2 / bytes per token ({per_token})"


# ----------------------------------------------------------------------------------------------------
# checkpoints

def save_checkpoint(path, state):
    """Write to a temporary file in the same directory, fsync it, then rename it over path.

    A crash or an error (disk full) mid-save leaves the previous checkpoint at path untouched.
    """
    tmp = f'{path}.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        space = ''
        if isinstance(e, RuntimeError):  # torch's writer's words name no cause ('[enforce
            with suppress(OSError):  # fail at inline_container.cc:672] . unexpected pos'): a full disk shows here
                free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
                space = f"; {free / 2**20:,.1f} MiB free on its disk, the part written included"
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, Exception):
            raise TrainError(f"could not save checkpoint {path}: {e}{space} (the previous {path}, if any, "
                             f"is intact)") from e
        raise
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass  # not every platform can fsync a directory


def load_checkpoint(path):
    """torch.load to the CPU with weights_only=True: tensors and plain data only; nothing in the file runs code.
    What it returns is a dict (a file that holds anything else is refused); which entries it needs, its reader
    checks."""
    if not os.path.exists(path):
        earlier = moved_copies(path)
        raise TrainError(f"no checkpoint at {path}" + (f"; earlier ones were moved aside: the latest is {earlier[-1]}"
                                                       if earlier else ''))
    check_readable(path, '')  # a directory, a file without read permission: one line naming it
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        code = re.search(r'GLOBAL (\S+)', str(e))  # the pickle names a function or class to import
        if code:
            raise TrainError(f"refusing to load {path}: besides tensors and plain data it asks to import "
                             f"{code.group(1)}, which could run code when loaded") from None
        with open(path, 'rb') as f:
            zipped = f.read(4) == b'PK\x03\x04'  # torch.save writes a zip archive
        if not zipped:  # torch's message for these is about weights_only's allowed types, which misleads
            raise TrainError(f"{path} is not a checkpoint: not the zip archive torch.save writes (another kind of "
                             f"file, or one a failure left empty or cut short)") from None
        detail = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        raise TrainError(f"checkpoint {path} is corrupt or truncated: {detail}") from None
    if not isinstance(ckpt, dict):  # torch.save of a tensor, say: its readers would test names against it
        raise TrainError(f"{path} is not a checkpoint: it holds a {type(ckpt).__name__}, not a dict of named entries")
    check_crc(path)
    return ckpt


def moved_copies(path):
    """The copies of the file at path that were moved aside (move_aside: its folder's previous-*/), oldest first."""
    folder, name = os.path.split(path)
    return sorted(glob.glob(os.path.join(glob.escape(folder), 'previous-*', name)))


def check_crc(path):
    """torch.load reads a checkpoint's archive structure, not the CRC-32 that torch.save writes for each record:
    bytes damaged inside the tensors' data (a bad copy, a bad disk) loaded without a word. zipfile checks them
    (a record without one, CRC 0, is written so: torch.utils.serialization.config.save.compute_crc32=False)."""
    with open(path, 'rb') as f:
        if f.read(4) != b'PK\x03\x04':  # torch's legacy format, which torch.load has read (torch's own test)
            return
    try:
        with zipfile.ZipFile(path) as archive:
            for record in archive.infolist():
                if record.CRC:
                    with archive.open(record) as f:  # raises BadZipFile at the end of a record whose CRC differs
                        while f.read(1 << 24):
                            pass
    except (zipfile.BadZipFile, OSError) as e:
        raise TrainError(f"checkpoint {path} is corrupt: {e} (damaged in a copy or on disk)") from None


def compiled_note(state):
    """What a message about a state dict's names adds where they are a compiled model's (torch.compile's
    _orig_mod. prefix), else ''."""
    compiled = any(k.startswith('_orig_mod.') for k in state)
    return " (its names start with _orig_mod.: saved from a compiled model)" if compiled else ''


def rng_state():
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {'python': random.getstate(), 'numpy': [keys.tolist(), pos, has_gauss, gauss],
             'torch': torch.get_rng_state()}
    if torch.cuda.is_available():  # this process's own GPU: a resume may see fewer GPUs than this run
        state['cuda'] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state):
    random.setstate(state['python'])
    keys, pos, has_gauss, gauss = state['numpy']
    np.random.set_state(('MT19937', np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        cuda, index = state['cuda'], torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):  # an older checkpoint: the states of all the GPUs it saw
            cuda = cuda[index] if index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, index)


def config_diff(old, new, keys):
    return [f"  {k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def eval_changes(old, new):
    """The EVAL_KEYS that differ between two configs (dicts) in what the val loss measures: data_dir by the
    directory it names, not by its spelling; batch_size and seed not where both evaluate every window of the val
    split, in order (eval_iters=0: Windows)."""
    every = old.get('eval_iters') == new.get('eval_iters') == 0
    return [k for k in EVAL_KEYS if not (every and k in ('batch_size', 'seed'))
            and (os.path.realpath(old[k]) != os.path.realpath(new[k]) if k == 'data_dir' and old.get(k)
                 else old.get(k) != new.get(k))]


def weights_finite(model):
    return all(bool(torch.isfinite(local(p)).all()) for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# processes: agreement, memory, signals

def agree(flag, device, every=True):
    """One bool for all processes: whether the flag is true in every process (every=True) or in any."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if every else dist.ReduceOp.MAX)
    return bool(t)


def on_master(r, work):
    """Run work() on process 0, which alone writes files, then stop every process with its TrainError, if it
    raised one: none is left waiting for the others at the next collective."""
    error = None
    if r.master:
        try:
            work()
        except TrainError as e:
            error = e
            if r.world > 1:  # now: the others leave once they have this agreement, which comes after it
                report_error(e)
    if not agree(error is None, r.device):
        raise error or PeerError("process 0 stopped with an error (it prints it)")


def peak_memory_mb(device_type):
    if device_type == 'cuda':
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak: KB on Linux
    return rss / 2**20 if sys.platform == 'darwin' else rss / 2**10


def resume_command(argv, world):
    """The command line that resumes this run: its arguments with --init_from=resume, the script's path from
    here, under torchrun as many processes per node (LOCAL_WORLD_SIZE) and nodes as now."""
    local = int(os.environ.get('LOCAL_WORLD_SIZE', world))
    nodes = world // local
    launcher = ['python'] if world == 1 else ['torchrun', *([f'--nnodes={nodes}'] if nodes > 1 else []),
                                              f'--nproc_per_node={local}']
    script = os.path.relpath(__file__)
    script = os.path.abspath(__file__) if script.startswith('..') else script
    command = shlex.join(launcher + [script] + [a for a in argv if not a.startswith('--init_from=')]
                         + ['--init_from=resume'])
    return command + ('  # on each node, with the rendezvous options the run was started with' if nodes > 1 else '')


@contextmanager
def stop_on_signals(notify=True):
    """While inside, SIGTERM and SIGINT set stop['signal'] instead of killing the process; a second one stops it
    at once (SystemExit: a save under way is cleaned up, the last checkpoint stays as it was). notify: say so on
    stderr (under torchrun, which signals every process, the first process of each node does)."""
    stop = {}

    def request_stop(signum, frame):
        name = signal.Signals(signum).name
        if 'signal' in stop:  # an evaluation or a save can take minutes: the user insists
            if notify:
                os.write(2, f"\n{name} received again: stopping now, without saving\n".encode())
            raise SystemExit(128 + signum)
        stop['signal'] = signum
        if notify:
            os.write(2, f"\n{name} received: stopping after this step or evaluation (again: at once, without "
                        f"saving)\n".encode())
    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ----------------------------------------------------------------------------------------------------
# config checks: every value in its range, named when it is not, before anything is read or built

CHOICES = {'init_from': ('scratch', 'resume', 'hf:PATH'), 'activation_checkpointing': ('none', 'full', 'selective'),
           'optimizer': ('adamw', 'adamw8bit', 'paged_adamw8bit', 'muon'), 'fp8_recipe': ('tensorwise', 'rowwise'),
           'compile_mode': ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'),
           'parallelism': ('ddp', 'fsdp'),
           'dtype': ('auto', 'float32', 'bfloat16', 'float16', 'bfloat16_if_native'),
           'lr_schedule': ('cosine', 'wsd'), 'mlp': ('swiglu', 'geglu', 'gelu', 'relu2'),
           'muon_dtype': ('auto', 'float32', 'bfloat16')}
# (keys, test(value, cfg), what the value must be). Every float must also be finite: an inf can only come
# from an overflowing literal (1e999), and each key has a finite way to say what inf would (grad_clip=0).
RANGES = [
    (('batch_size', 'block_size', 'gradient_accumulation_steps', 'n_layer', 'n_head', 'n_embd', 'eval_interval',
      'log_interval', 'max_nonfinite_steps', 'muon_ns_steps'), lambda v, c: v >= 1, 'at least 1'),
    (('short_block_size',), lambda v, c: v == 0 or (0 < v < c.block_size and c.block_size % v == 0
                                                     and (c.block_size // v).bit_count() == 1),
     '0 (off) or block_size ({block_size}) divided by a power of 2 (2, 4, 8, ...)'),
    (('max_iters', 'short_block_iters', 'warmup_iters', 'lr_decay_iters', 'n_kv_head', 'vocab_size', 'mlp_hidden',
      'eval_iters', 'logit_softcap'), lambda v, c: v >= 0,
     'at least 0 (see its comment at the top of train.py for what 0 means)'),
    (('head_dim',), lambda v, c: v >= 0 and v % 2 == 0,
     '0 (n_embd // n_head) or a positive even number (RoPE rotates channel pairs)'),
    (('learning_rate',), lambda v, c: v > 0, 'greater than 0'),
    (('weight_decay', 'grad_clip'), lambda v, c: v >= 0, 'at least 0 (grad_clip=0 disables clipping)'),
    # min_lr above learning_rate would turn the cosine "decay" into a rise after warmup: never what was meant
    (('min_lr',), lambda v, c: 0 <= v <= c.learning_rate,
     'between 0 and learning_rate ({learning_rate}); min_lr = learning_rate keeps the rate constant after warmup'),
    (('dropout', 'label_smoothing', 'beta1', 'beta2', 'muon_momentum'), lambda v, c: 0 <= v < 1,
     'at least 0 and less than 1'),
    (('wsd_decay_frac',), lambda v, c: 0 < v <= 1, 'greater than 0 and at most 1 (1: the decay takes all of '
                                                   'lr_decay_iters after warmup)'),
    (('rope_base',), lambda v, c: v > 1, 'greater than 1 (the rotation frequencies are base^(-2i/d))'),
    (('seed',), lambda v, c: 0 <= v < 2**63, 'between 0 and 2**63 - 1'),
    (('out_dir', 'data_dir'), lambda v, c: v != '', 'a directory, not empty'),
]


def check_config(cfg):
    """Raise a ConfigError naming the first setting that is not one of its CHOICES or outside its RANGES, or a
    device this machine does not have. What depends on the number of processes is checked in main, what needs the
    data, the model or the device in setup."""
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed and not (key == 'init_from' and is_hf(cfg) and cfg.init_from[3:]):
            raise ConfigError(f"{key}={getattr(cfg, key)!r}: expected one of {', '.join(map(repr, allowed))}")
    for keys, ok, what in RANGES:
        for key in keys:
            value = getattr(cfg, key)
            finite = not isinstance(value, float) or math.isfinite(value)
            if not (finite and ok(value, cfg)):
                raise ConfigError(f"{key}={value!r}: must be " + ('' if finite else 'finite and ')
                                  + what.format(**vars(cfg)))
    check_device(cfg.device)


def say(*args, file=None, **kwargs):
    """print (to stdout, or file), which a reader that has gone (`| head`) does not stop: the run goes on, its
    lines in metrics.jsonl (a BrokenPipeError here ended it without saving)."""
    stream = file or sys.stdout
    if stream is None:  # (a closed stdout: Python has none)
        return
    try:
        print(*args, file=stream, **kwargs)
        stream.flush()  # (where a pipe buffers the line, its error shows here)
    except BrokenPipeError:  # Python's recipe: the rest of this stream goes nowhere
        with suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


# out_dir's real path -> the descriptor that holds its lock in this process (lock_out_dir)
OUT_DIR_LOCKS = {}


def lock_out_dir(out_dir):
    """Lock out_dir for this run (flock on the directory itself, which the system releases when the process ends,
    however it ends): a second train.py into the same out_dir is an error, not two runs writing over each other's
    checkpoints and metrics. On a file system that cannot lock, the run goes on with a warning."""
    try:
        import fcntl
    except ImportError:  # (Windows)
        return
    unlock_out_dir(out_dir)  # this process's own, from a main() before (tests call it in-process)
    fd = None
    try:
        fd = os.open(out_dir, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if fd is not None:
            os.close(fd)
        if isinstance(e, BlockingIOError):
            raise TrainError(f"out_dir {out_dir} is in use by another train.py run (it holds the directory's lock): "
                             f"two runs there would write over each other's checkpoints and metrics. Let it finish, "
                             f"stop it, or choose another out_dir") from None
        say(f"warning: out_dir {out_dir} cannot be locked ({os_reason(e, out_dir)}; a file system without locks?): "
            f"another train.py run into it would not be stopped", file=sys.stderr)
        return
    OUT_DIR_LOCKS[os.path.realpath(out_dir)] = fd


def unlock_out_dir(out_dir):
    if (fd := OUT_DIR_LOCKS.pop(os.path.realpath(out_dir), None)) is not None:
        os.close(fd)


def check_device(name):
    """Raise a ConfigError unless name is 'auto' or a device this machine has (bench.py and sample.py check
    theirs with it too)."""
    if name == 'auto':
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ('cpu', 'cuda', 'mps') or (device.type != 'cuda' and device.index):
        raise ConfigError(f"device={name!r}: expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
    if device.type == 'cuda' and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device={name!r}, but this machine has {torch.cuda.device_count()} CUDA devices "
                          f"that torch can use")
    if device.type == 'mps' and not torch.backends.mps.is_available():
        raise ConfigError(f"device={name!r}, but MPS is not available here")


# settings that only one choice of another reads: set away from their default under another choice, they
# would change nothing, and report() says so rather than let a run look like it used them
APPLIES_ONLY = {'muon_split': ('optimizer', 'muon'), 'muon_ns_steps': ('optimizer', 'muon'),
                'muon_dtype': ('optimizer', 'muon'), 'muon_momentum': ('optimizer', 'muon'),
                'wsd_decay_frac': ('lr_schedule', 'wsd'), 'compile_mode': ('compile', True),
                'fp8_recipe': ('fp8', True), 'wandb_project': ('wandb_log', True),
                'wandb_run_name': ('wandb_log', True)}


def setting_warnings(cfg, world, trains=True):
    """Warnings for the APPLIES_ONLY settings that are set but not read in this run (zero_init_proj too, under
    init_from=hf:; parallelism where the run's `world` is one process), for a learning-rate schedule cut short (no
    decay, or not to its end; not where the run `trains` no step: a resume at or past max_iters), for a new run
    that neither trains nor evaluates, for max-autotune under deterministic, for half of the short-block pair set
    without the other, and for short blocks that last the whole run."""
    warnings = [f"{key}={getattr(cfg, key)!r} has no effect: it applies to {other}={choice!r}, and this run has "
                f"{other}={getattr(cfg, other)!r}" for key, (other, choice) in APPLIES_ONLY.items()
                if getattr(cfg, key) != DEFAULTS[key] and getattr(cfg, other) != choice]
    warnings += [f"{key}={getattr(cfg, key)!r} has no effect: {other}=0" for key, other in
                 (('short_block_size', 'short_block_iters'), ('short_block_iters', 'short_block_size'))
                 if getattr(cfg, key) and not getattr(cfg, other)]
    if world == 1 and cfg.parallelism != DEFAULTS['parallelism']:
        warnings.append(f"parallelism={cfg.parallelism!r} has no effect: one process runs the whole model; it applies "
                        f"under torchrun, with more than one process")
    if trains:  # not on a resume with no step left to take: its schedule is moot
        warnings += schedule_warnings(cfg)
    if is_hf(cfg) and cfg.zero_init_proj != DEFAULTS['zero_init_proj']:
        warnings.append(f"zero_init_proj={cfg.zero_init_proj!r} has no effect: the weights come from "
                        f"init_from={cfg.init_from}")
    if cfg.max_iters == 0 and not cfg.eval_at_start and cfg.init_from != 'resume':
        warnings.append("max_iters=0 and eval_at_start=False: the run neither trains nor evaluates (it writes its "
                        "initial weights to out_dir/ckpt.pt, an earlier run's files moved aside first)")
    if cfg.deterministic and cfg.compile and cfg.compile_mode.startswith('max-autotune'):
        warnings.append(f"compile_mode={cfg.compile_mode!r} with deterministic=True tunes little: inductor's "
                        f"deterministic mode takes the GEMMs and the reductions' block sizes without timing them")
    if cfg.short_block_size and cfg.short_block_iters >= cfg.max_iters > 0:
        warnings.append(f"short_block_iters={cfg.short_block_iters} covers all max_iters={cfg.max_iters} "
                        f"iterations: no step trains on whole windows of block_size={cfg.block_size}, which the "
                        f"evaluation uses")
    return warnings


def schedule_warnings(cfg):
    """A warning for a learning-rate schedule cut short (a quick try of a long run's config), which trains at a rate
    its config never meant: no decay, or not to its end; else none."""
    if cfg.warmup_iters >= cfg.max_iters > 0:
        return [f"warmup_iters={cfg.warmup_iters} is at least max_iters={cfg.max_iters}: the learning rate "
                f"only warms up, to {get_lr(cfg.max_iters - 1, cfg):.2e} at the last step "
                f"(learning_rate={cfg.learning_rate:.2e}), and never decays"]
    if 0 < cfg.lr_decay_iters <= cfg.warmup_iters and cfg.min_lr < cfg.learning_rate:
        return [f"lr_decay_iters={cfg.lr_decay_iters} is at most warmup_iters={cfg.warmup_iters}: the "
                f"learning rate drops from its warmup straight to min_lr={cfg.min_lr:.2e}"]
    if cfg.lr_decay_iters > cfg.max_iters > 0 and cfg.min_lr < cfg.learning_rate:
        last = get_lr(cfg.max_iters - 1, cfg)
        return [f"lr_decay_iters={cfg.lr_decay_iters} is above max_iters={cfg.max_iters}: the learning rate "
                + ("has not started its decay (wsd) by the last step, so it never reaches"
                   if last == cfg.learning_rate else f"ends at {last:.2e} at the last step, not at")
                + f" min_lr={cfg.min_lr:.2e} (lr_decay_iters=0: max_iters; a resume "
                f"with a larger max_iters goes on along the same schedule)"]
    return []


# ----------------------------------------------------------------------------------------------------
# a run: main() joins the processes, setup() builds and checks the run's pieces once, report() says what
# they are, train_loop() runs it

def main(argv):
    """Check the config, join the other processes under torchrun, run, leave."""
    cfg = SimpleNamespace(**configure(DEFAULTS, argv, __file__))
    check_config(cfg)
    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain run is process 0 of 1
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    if cfg.gradient_accumulation_steps % world:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is the global number of "
                          f"micro-batches per step and must be divisible by the number of processes ({world})")
    if 0 < cfg.eval_iters < world:
        raise ConfigError(f"eval_iters={cfg.eval_iters} is the global number of eval batches, shared among the "
                          f"processes: give at least one to each of the {world}")
    if cfg.wandb_log and importlib.util.find_spec('wandb') is None:  # found now, imported by start_wandb
        raise ConfigError("wandb_log=True needs wandb: `pip install wandb` (WANDB_MODE=offline logs without a "
                          "network), or set wandb_log=False")
    device = pick_device(cfg.device)
    if (world > 1 and cfg.parallelism == 'fsdp' and cfg.compile and cfg.gradient_accumulation_steps > world
            and records_cuda_graphs(cfg.compile_mode, torch.device(device).type)):
        # FSDP2 accumulates into gradients of its unsharded parameters, which the copy cannot reach
        raise ConfigError(f"compile_mode={cfg.compile_mode!r} records CUDA graphs, whose next replay overwrites the "
                          f"gradients FSDP keeps across micro-steps: with parallelism='fsdp' and gradient "
                          f"accumulation use compile_mode='default' or 'max-autotune-no-cudagraphs'")
    if world > 1 and torch.device(device).type == 'cuda':
        device = f"cuda:{os.environ['LOCAL_RANK']}"  # one GPU per process, whatever index was asked for
    if torch.device(device).type == 'cuda' and torch.device(device).index is not None:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group('nccl' if torch.device(device).type == 'cuda' else 'gloo')
    restore = deterministic_algorithms(cfg.deterministic)
    try:
        r = setup(cfg, argv, device, rank, world)
        report(r)
        code = 1  # what the wandb run records if the loop raises
        try:
            code = train_loop(r)
        except Exception as e:  # in a step or an evaluation: a clear message, not a traceback
            oom = None if isinstance(e, TrainError) else out_of_memory(e)
            if oom is None:
                raise
            evaluating = not r.model.training  # estimate_loss leaves the model in eval mode when it fails
            where = 'in the evaluation at' if evaluating else 'in the training step after'
            raise TrainError(f"out of memory on {r.device} {where} iteration {r.iter_num} "
                             f"{memory_advice(oom, r, evaluating)}. {last_checkpoint(r)}") from None
        finally:
            if r.wandb:
                r.wandb.finish(exit_code=code)
        if world > 1:
            dist.barrier()  # leave together: no process tears down the group while another still uses it
        return code
    except (ConfigError, TrainError) as e:
        if world > 1:  # printed now, before the teardown below: torchrun stops every process once one has exited
            report_error(e)
            if getattr(e, 'together', False):
                dist.barrier()  # the others leave once process 0 has printed it (stop_together)
        raise
    except RuntimeError as e:
        gone = next((s for s in PEER_GONE if s in str(e)), None) if world > 1 else None
        if gone:  # in a collective: one line, not a traceback
            raise TrainError(f"lost the connection to another process ({gone.lower()}): it may have stopped with an "
                             f"error of its own, in its log") from None
        raise
    finally:
        restore()  # as it was: tests call main in-process
        unlock_out_dir(cfg.out_dir)
        if dist.is_initialized():
            # The model goes before the process group that DDP's reducer (or FSDP) holds. Freed after it, when
            # main returned, the group's last reference went from C++ with the GIL held, and its gloo threads
            # could deadlock with that: now and then an exit under torchrun on the CPU hung after "done:".
            r = None
            gc.collect()
            dist.destroy_process_group()


def deterministic_algorithms(on):
    """For this run (deterministic=True): torch's deterministic algorithms, set before the first cuBLAS call, whose
    deterministic mode needs CUBLAS_WORKSPACE_CONFIG. torch's switch sets inductor's deterministic mode too: no kernel
    config and no GEMM picked by timing where the choice changes the numerics (a reduction's block sizes,
    max-autotune's GEMMs). Returns a function that puts the switch back as it was, for main."""
    if not on:
        return lambda: None
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
    torch.use_deterministic_algorithms(True)
    return lambda: torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def setup(cfg, argv, device, rank, world):
    """The run's pieces, as a namespace: data, model, wrappers, optimizer, resumed state. Everything is
    checked here, before the first step."""
    r = SimpleNamespace(cfg=cfg, argv=argv, device=device, rank=rank, world=world, master=rank == 0)
    r.say = say if r.master else (lambda *args, **kwargs: None)  # process 0 prints, logs and writes files
    r.accum_steps = cfg.gradient_accumulation_steps // world  # this process's share of the micro-batches

    # ---- precision
    r.device_type = device_type = torch.device(device).type
    r.dtype, r.dtype_reason = pick_dtype(cfg.dtype, device_type)
    if device_type == 'cuda':
        torch.set_float32_matmul_precision('high')  # TF32 for float32 matmuls
    ptdtype = getattr(torch, r.dtype)
    r.autocast = nullcontext() if r.dtype == 'float32' else torch.autocast(device_type, dtype=ptdtype)
    r.scaler = torch.amp.GradScaler(device_type, enabled=(r.dtype == 'float16'))

    # ---- data, checked before anything is built
    model_args = model_shape(cfg, argv)
    r.meta = meta = read_meta(cfg.data_dir)
    r.vocab = model_args['vocab_size'] or 64 * math.ceil(meta['vocab_size'] / 64)
    if r.vocab < meta['vocab_size']:
        theirs = f"the dataset's vocabulary ({meta['vocab_size']}, {cfg.data_dir}/meta.json)"
        if is_hf(cfg):  # the model's, which no vocab_size flag may change (model_shape)
            path = cfg.init_from[3:]
            raise TrainError(f"the model's vocab_size={r.vocab} ({path}/config.json) is smaller than {theirs}: "
                             f"finetune on data prepared with the model's tokenizer{tokenizer_advice(path)}")
        raise TrainError(f"vocab_size={r.vocab} is smaller than {theirs}")
    train_tokens = load_tokens(cfg.data_dir, 'train', meta, cfg.block_size, r.vocab)
    val_tokens = load_tokens(cfg.data_dir, 'val', meta, cfg.block_size, r.vocab)
    r.batches = Batches(train_tokens, cfg.batch_size, cfg.block_size, device, cfg.seed,
                        cfg.gradient_accumulation_steps, rank, world)
    r.eval_splits = eval_splits(cfg, train_tokens, val_tokens, device, rank, world)
    r.eval_tokens_per_byte, r.bpb_line = tokens_per_byte(meta, r.eval_splits, device)
    on_master(r, lambda: probe_out_dir(cfg.out_dir))  # now, not at the first checkpoint, after training
    on_master(r, lambda: lock_out_dir(cfg.out_dir))  # (main unlocks it)

    # ---- model
    model_args['vocab_size'] = r.vocab
    try:
        r.model_config = GPTConfig(**model_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    r.model = model = GPT(r.model_config).to(device)  # the original module: checkpoints are saved from it
    model.activation_checkpointing = cfg.activation_checkpointing
    model.autocast_residual = cfg.autocast_residual
    torch.manual_seed(cfg.seed + rank)  # different dropout masks in each process
    r.fp8_note = 'off'
    if cfg.fp8:  # before sharding and compile, like every conversion of the model
        names = convert_to_fp8(model, cfg.fp8_recipe, device)
        r.fp8_note = f"{cfg.fp8_recipe}: {len(names)} linear layers ({', '.join(names) or 'none large enough'})"
    if world > 1 and cfg.parallelism == 'fsdp' and cfg.optimizer != 'adamw':
        raise ConfigError(f"optimizer={cfg.optimizer!r} does not work on FSDP's sharded parameters: "
                          f"use parallelism='ddp' or optimizer='adamw'")
    unmet = [f"{need}, not {have}" for need, have, met in (
        ("optimizer='adamw'", f"optimizer={cfg.optimizer!r}", cfg.optimizer == 'adamw'),
        ("one process", f"{world} processes", world == 1), ("a CUDA GPU", f"device {device}", device_type == 'cuda'),
        ("bfloat16 or float32", r.dtype, r.dtype != 'float16'),
        ("grad_clip=0 (the gradients are copied to the CPU during the backward pass, before they could be clipped)",
         f"grad_clip={cfg.grad_clip}", cfg.grad_clip == 0)) if not met]
    if cfg.optimizer_offload and unmet:
        raise ConfigError(f"optimizer_offload=True needs {'; '.join(unmet)}")

    # ---- parallelism: FSDP2 shards parameters, gradients and optimizer state (here, before the weights load into
    # its shards); DDP replicates the model (below, once the checkpoint is loaded and freed)
    r.wrapped, r.grad_sync, r.parallel_note = model, (lambda last: nullcontext()), 'off (one process)'
    r.grad_views = False
    if world > 1 and cfg.parallelism == 'fsdp':
        if r.dtype == 'float16':
            raise ConfigError("parallelism='fsdp' runs in bfloat16 or float32, not float16: set dtype")
        # FSDP's mixed-precision policy computes in ptdtype and reduces gradients in float32; it takes the
        # place of autocast
        policy = MixedPrecisionPolicy(param_dtype=ptdtype, reduce_dtype=torch.float32)
        for i, block in enumerate(model.blocks):  # the last block's backward follows its forward (only the final
            # norm, the head and the loss between): kept whole after its forward, it is not gathered again for it
            fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(model.blocks) - 1)
        fully_shard(model, mp_policy=policy)  # the root's weights (embeddings, head) stay whole until the backward
        r.autocast = nullcontext()
        # the gradients are reduce-scattered after the last micro-step only; until then FSDP accumulates them whole,
        # in float32 (reduce_dtype), on every process: less communication, the whole model's gradients in memory
        r.grad_sync = lambda last: model.set_requires_gradient_sync(last) or nullcontext()
        r.parallel_note = f'FSDP2, {world} processes'

    ckpt = start_or_resume(r)
    # ---- optimizer, built after the weights are loaded (the CPU-offload optimizer copies them)
    r.optimizer = configure_optimizer(model, cfg, device_type)
    if ckpt is not None and ckpt['optimizer'] is not None:
        load_optimizer_state(r, ckpt['optimizer'])
    del ckpt  # free its memory
    if world > 1 and cfg.parallelism == 'ddp':
        # gradient_as_bucket_view: each gradient is a view of the bucket DDP all-reduces, not a tensor of its own
        # beside it: the gradients' size less memory per process. Zero gradients given now become views as DDP
        # builds its buckets (else at its first all-reduce, after a first step that holds them twice); from then
        # on nothing sets them to None (grad_views: train_step, compile_model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        # no buffer sync: the model's buffers (RoPE's tables) are computed alike in every process and never change,
        # so DDP need not send process 0's before each step's forward (forward_sync_buffers from torch 2.13 on, which
        # deprecates broadcast_buffers, with a warning from every process)
        sync = 'forward_sync_buffers' if 'forward_sync_buffers' in inspect.signature(DDP).parameters else \
            'broadcast_buffers'
        r.wrapped = wrapped = DDP(model, device_ids=[torch.device(device)] if device_type == 'cuda' else None,
                                  gradient_as_bucket_view=True, **{sync: False})
        r.grad_views = True
        r.grad_sync = lambda last: nullcontext() if last else wrapped.no_sync()  # all-reduce once per step
        r.parallel_note = f'DDP, {world} processes'
    r.compiled, r.compile_note = compile_model(r)
    r.wandb = start_wandb(r)
    if cfg.init_from != 'resume':  # last: a start that fails on any check above leaves the earlier run where it was
        try:
            on_master(r, lambda: move_earlier_run(r))
        except TrainError:
            if r.wandb:  # started above: main's finish comes after setup
                r.wandb.finish(exit_code=1)
            raise
    return r


def start_or_resume(r):
    """Resume from out_dir/ckpt.pt (model, scaler, data and counters; returns the checkpoint for the
    optimizer), or start afresh (setup then moves an earlier run's files aside). Sets the run's paths and
    counters."""
    cfg, say = r.cfg, r.say
    r.ckpt_path, r.best_path = os.path.join(cfg.out_dir, 'ckpt.pt'), os.path.join(cfg.out_dir, 'best.pt')
    r.metrics_path = os.path.join(cfg.out_dir, 'metrics.jsonl')
    r.plot_path, r.plotted_at = os.path.join(cfg.out_dir, 'metrics.png'), time.time()  # first drawn PLOT_EVERY_S in
    r.iter_num, r.tokens, r.best_val_loss, r.rng, r.metrics_lost = 0, 0, math.inf, None, 0
    r.best_reset = False  # a resume that resets the best val loss: its first best.pt moves the earlier aside
    r.saved_iter = None  # the iteration of the last checkpoint written (or resumed from)
    r.last_eval = None if cfg.eval_at_start else 0  # iteration 0 counts as evaluated: the loop skips it
    r.init_from = cfg.init_from  # where the weights started, recorded in every checkpoint
    if cfg.init_from != 'resume':  # an earlier run's files are moved aside at the end of setup
        if is_hf(cfg):
            r.init_from = start_from_hf(r)
        return None
    if not os.path.exists(r.ckpt_path) and (earlier := moved_copies(r.ckpt_path)):
        raise TrainError(f"no checkpoint at {r.ckpt_path}; a scratch run moved an earlier run's aside: to continue "
                         f"the latest, --out_dir={shlex.quote(os.path.dirname(earlier[-1]))} --init_from=resume")
    ckpt = load_checkpoint(r.ckpt_path)
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt]
    if missing:
        raise TrainError(f"{r.ckpt_path} is not a training checkpoint of this script: it lacks {', '.join(missing)}")
    mismatch = vocabulary_mismatch(ckpt['meta'], r.meta)
    if mismatch:  # same-sized vocabularies pass the shape check, and every id would mean another token
        raise TrainError(f"{r.ckpt_path} was trained on another vocabulary than {cfg.data_dir}: {mismatch}. Resume "
                         f"or finetune only on data prepared with the checkpoint's tokenizer and vocabulary")
    unknown = [f"{k}={v!r}" for k, v in ckpt['model_args'].items() if k not in MODEL_KEYS]
    if unknown:  # a newer model.py's feature: resumed without it, the model would silently be another one
        raise TrainError(f"the model in {r.ckpt_path} has settings this model.py does not know: {', '.join(unknown)}; "
                         f"resume with the model.py that wrote it")
    shape_diff = config_diff(complete_model_args(ckpt['model_args']), r.model_config.to_dict(), SHAPE_KEYS)
    if shape_diff:
        raise TrainError(f"the model in {r.ckpt_path} has another shape than this config:\n"
                         + "\n".join(shape_diff) + "\nresume with the config the run started with")
    # a setting that the checkpoint's version lacked had its default's behaviour then, except muon_dtype: before
    # it, Newton-Schulz ran in bf16 on CUDA and in float32 elsewhere, which 'auto' changes on a CPU with bf16 units
    saved = {**DEFAULTS, **ckpt['config']}
    before = torch_ns_dtype(r.device_type)
    if 'muon_dtype' not in ckpt['config'] and muon_ns_dtype(cfg.muon_dtype, r.device_type)[0] != before:
        saved['muon_dtype'] = before
    changed = config_diff(saved, vars(cfg), [k for k in DEFAULTS if k not in ('init_from', 'seed', *START_KEYS)])
    changed += [f"{line}  (no effect on a resumed run)" for line in config_diff(saved, vars(cfg), START_KEYS)]
    changed += [f"{line}  (the data sampler and the checkpoint's RNG streams go on as saved; it reaches only what "
                f"starts anew: sampled evaluation batches, RNG streams of processes the checkpoint lacked)"
                for line in config_diff(saved, vars(cfg), ['seed'])]
    if changed:
        say("resuming with changed settings (checkpoint -> now):\n" + "\n".join(changed))
    if optimizer_diff := config_diff(saved, vars(cfg), OPTIMIZER_KEYS):
        raise TrainError(f"{r.ckpt_path} holds the state of another optimizer than this config's:\n"
                         + "\n".join(optimizer_diff) + "\nresume with the checkpoint's optimizer settings")
    set_model_state_dict(r.model, ckpt['model'], options=FULL_STATE)
    if ckpt['scaler'] and r.scaler.is_enabled():  # a bf16/fp32 run's scaler state is empty: start afresh
        r.scaler.load_state_dict(ckpt['scaler'])
    r.batches.load_state_dict(ckpt['batches'])
    r.iter_num, r.best_val_loss, r.rng = ckpt['iter_num'], ckpt['best_val_loss'], ckpt['rng']
    r.saved_iter = r.iter_num
    # (a checkpoint from before the count: its tokens per iteration, every iteration)
    r.tokens = ckpt.get('tokens', r.iter_num * tokens_per_iter(SimpleNamespace(**saved)))
    r.init_from = ckpt.get('init_from', 'scratch')
    r.last_eval = r.iter_num if ckpt['evaluated'] else None
    say(f"resuming from {r.ckpt_path} at iteration {r.iter_num} ({best_val_text(r.best_val_loss)})")
    was, now = get_lr(r.iter_num, SimpleNamespace(**saved)), get_lr(r.iter_num, cfg)
    if r.iter_num < cfg.max_iters and not math.isclose(was, now, rel_tol=1e-6):  # (max_iters: lr_decay_iters=0's)
        say(f"warning: the learning rate of iteration {r.iter_num} is {now:.3e} under this run's schedule, "
            f"{was:.3e} under the checkpoint's: it changes at once, by the settings above")
    same_dir = os.path.realpath(saved['data_dir']) == os.path.realpath(cfg.data_dir)  # (another: eval_changes says)
    data_changed = [f"{k} {ckpt['meta'][k]} -> {r.meta[k]}" for k in ('train_tokens', 'val_tokens')
                    if same_dir and k in ckpt['meta'] and k in r.meta and ckpt['meta'][k] != r.meta[k]]
    if data_changed:  # prepared again (another input, another val_fraction): same vocabulary, other tokens
        say(f"warning: {cfg.data_dir} holds other data than the checkpoint's run trained on (meta.json: "
            f"{', '.join(data_changed)}): the training batches go on at the checkpoint's place in it")
    if len(r.rng) != r.world:  # the data does not depend on it (Batches); the RNG streams do (train_loop)
        kept = min(len(r.rng), r.world)
        say(f"resuming on {r.world} process{'es' * (r.world > 1)}, the checkpoint's run had {len(r.rng)}: the data "
            f"goes on as it would have; RNG streams (dropout's masks) go on in process{'es' * (kept > 1)} "
            f"0{f' to {kept - 1}' * (kept > 1)}" + (", the others' start anew from seed + rank + iteration"
                                                   if r.world > kept else ", the others' are dropped"))
    if r.iter_num >= cfg.max_iters:  # the run's own config again, to go on: it ends where it started
        say(f"nothing to train: max_iters={cfg.max_iters}, and the checkpoint is at iteration {r.iter_num}; a "
            f"max_iters above {r.iter_num} trains on")
    changed = eval_changes(saved, vars(cfg)) + (["the data (meta.json)"] if data_changed else [])
    if changed and r.best_val_loss < math.inf:
        say(f"best val loss reset: {', '.join(changed)} changed, which decide{'s' * (len(changed) == 1)} what the "
            f"val loss measures; the next evaluation's model is written to {r.best_path} (the earlier one moved "
            f"aside then)")
        r.best_val_loss, r.best_reset = math.inf, True
        r.last_eval = None  # its evaluation measured something else: evaluate again if its iteration is one to evaluate
    on_master(r, lambda: truncate_metrics(r.metrics_path, r.iter_num, say))
    return ckpt


def best_val_text(loss):
    """The best val loss for a message: a number, or that no evaluation has given one yet."""
    return f"best val loss {loss:.4f}" if loss < math.inf else "no val loss yet"


def complete_model_args(model_args):
    """A checkpoint's model_args with every field of GPTConfig, sizes derived as GPTConfig derives them: what an
    older checkpoint lacks takes its default, which rebuilds the model it saved."""
    try:
        return GPTConfig(**model_args).to_dict()
    except (TypeError, ValueError):  # values GPTConfig refuses: compared as they are, and named by the shape check
        return model_args


def vocabulary_mismatch(ckpt_meta, data_meta):
    """None if a checkpoint's vocabulary (prepare_data.vocabulary) is the data's, else what differs, briefly."""
    (kind, old), (new_kind, new) = vocabulary(ckpt_meta), vocabulary(data_meta)
    if (kind, old) == (new_kind, new):
        return None
    if kind == new_kind == 'char' and old and new:
        a, b = set(old), set(new)

        def only(chars):
            return repr(''.join(sorted(chars))[:40]) + ('...' if len(chars) > 40 else '') if chars else 'none'
        return (f"the checkpoint has {len(old)} characters, the data {len(new)}; only in the checkpoint's: "
                f"{only(a - b)}; only in the data's: {only(b - a)}" if a != b else
                f"the same {len(old)} characters, in another order")
    return f"the checkpoint's is {describe_vocabulary(ckpt_meta)}, the data's {describe_vocabulary(data_meta)}"


def describe_vocabulary(meta):
    kind, value = vocabulary(meta)
    if kind == 'char':
        return f"char level ({len(value or '')} characters)"
    if kind == 'hf':
        return f"{meta['tokenizer']} (tokenizer.json sha256 {str(value)[:12]}...)"
    return f"tiktoken {value}"


def probe_out_dir(out_dir, key='out_dir'):
    """Create out_dir and write a probe file there (prepare_data.probe_dir); errors name it as the setting key
    (export.py: hf_dir)."""
    try:
        probe_dir(out_dir, key)
    except ValueError as e:
        raise TrainError(str(e)) from None


def move_aside(out_dir, paths):
    """Move those of paths that exist to out_dir/previous-<date-time>-<random>/, never overwrite them (bench.py
    too, for its results). Returns that folder, or None where none of them existed."""
    found = [p for p in paths if os.path.exists(p)]
    if not found:
        return None
    keep = None
    try:
        keep = tempfile.mkdtemp(prefix=time.strftime('previous-%Y%m%d-%H%M%S-'), dir=out_dir)
        for p in found:
            shutil.move(p, keep)
    except OSError as e:
        if keep:  # (made): removed only if nothing had moved yet, as os.rmdir refuses a folder that is not empty
            with suppress(OSError):
                os.rmdir(keep)
        moved = f"; those moved so far are in {keep}" if keep and os.path.isdir(keep) else ''
        raise TrainError(f"could not move the earlier run's files in {out_dir} aside ({os_reason(e)}); "
                         f"nothing was overwritten{moved}") from None
    return keep


def move_best_aside(r):
    """A resume that resets the best val loss keeps the best.pt of what it measured before, moved aside as its own
    first best.pt is written (a resume at another batch_size wrote a worse model over it). Until then it stays in
    place: a resumed run that stops before, and a resume after it on the old settings, have it where it was."""
    if keep := move_aside(r.cfg.out_dir, [r.best_path]):
        r.say(f"{r.best_path}, the best under the checkpoint's settings, moved to {keep}")


def move_earlier_run(r):
    """Move an earlier run's files in out_dir aside (move_aside), its export (export.py's default hf_dir, out_dir/hf)
    with them, unless this run starts from that export (init_from=hf:out_dir/hf)."""
    had_checkpoint = os.path.exists(r.ckpt_path)
    export = os.path.join(r.cfg.out_dir, 'hf')
    source = is_hf(r.cfg) and os.path.realpath(r.cfg.init_from[3:]) == os.path.realpath(export)
    if keep := move_aside(r.cfg.out_dir, (r.ckpt_path, r.best_path, r.metrics_path, r.plot_path,
                                          *([] if source else [export]))):
        resumable = f" (to continue it: --out_dir={shlex.quote(keep)} --init_from=resume)" if had_checkpoint else ''
        r.say(f"{r.cfg.out_dir} held an earlier run: moved its files to {keep}{resumable}")


def truncate_metrics(path, iter_num, say):
    """Drop the lines of metrics.jsonl logged after the checkpoint (the resumed run logs them again) and any
    line a crash cut short. Written to a temporary file and renamed, so that a failure loses no line."""
    if not os.path.exists(path):
        return
    tmp, kept, unreadable = f'{path}.tmp', [], 0
    try:
        with open(path, 'rb') as f:  # bytes: a line a failure left with bytes that are not UTF-8 is unreadable too
            for line in f:
                try:
                    line = line.decode('utf-8')
                    if json.loads(line)['iter'] <= iter_num:
                        kept.append(line.rstrip('\n') + '\n')  # a last line may lack its newline
                except (ValueError, KeyError, TypeError):  # (UnicodeDecodeError is a ValueError)
                    unreadable += 1
        with open(tmp, 'w', encoding='utf-8') as f:
            f.writelines(kept)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise TrainError(f"cannot rewrite {path} for the resumed run: {os_reason(e, path)}") from None
    if unreadable:
        say(f"{path}: dropped {unreadable} unreadable line(s), cut short by an earlier failure")


def is_hf(cfg):
    return cfg.init_from.startswith('hf:')


def model_shape(cfg, argv):
    """GPTConfig's arguments, from the config; vocab_size 0 means the dataset's, padded.

    Under init_from=hf:PATH the shape is PATH/config.json's (export.hf_model_args): a shape key that a config
    file or flag sets (argv, not its default) to another value is an error naming both; block_size and dropout
    stay the run's, block_size at most max_position_embeddings. Resuming a run that started so keeps the
    checkpoint's shape for the keys that argv leaves unset (the resume command names none), block_size and
    dropout excepted: those are the run's settings, which the data and the resume check read too."""
    args = {k: getattr(cfg, k) for k in MODEL_KEYS if hasattr(cfg, k)}
    explicit = {a[2:].partition('=')[0] for a in argv if a.startswith('--')}
    explicit.update(k for a in argv if not a.startswith('--') for k in read_config_file(a))
    if cfg.init_from == 'resume':
        shape = hf_checkpoint_shape(cfg.out_dir) or {}
        return {**args, **{k: v for k, v in shape.items() if k not in (*explicit, 'dropout', 'block_size')}}
    if not is_hf(cfg):
        return args
    from export import HF_KEYS, hf_model_args  # the mapping lives with the export
    path = cfg.init_from[3:]
    try:
        shape, max_len = hf_model_args(path)
    except ValueError as e:
        raise TrainError(f"init_from={cfg.init_from}: {e}") from None
    for key, value in shape.items():
        if key in explicit and resolved(shape, key, args.get(key)) != value:
            raise ConfigError(f"{key}={args[key]!r} contradicts the model's {key}={value!r} ({HF_KEYS[key]} in "
                              f"{path}/config.json): leave {key} unset, or set it to the model's")
    if cfg.block_size > max_len:
        raise ConfigError(f"block_size={cfg.block_size} is longer than max_position_embeddings={max_len} of "
                          f"{path}/config.json")
    return {**args, **shape}


def resolved(shape, key, value):
    """What value means for key in a model of this shape: GPTConfig's reading of a 0 (n_kv_head=0 is n_head)."""
    try:
        return getattr(GPTConfig(**{**shape, key: value}), key)
    except ValueError:
        return value


def hf_checkpoint_shape(out_dir):
    """The model_args of out_dir/ckpt.pt if its run started from a Hugging Face model, else None. A look through
    mmap, which reads no tensor; a missing or broken file is start_or_resume's to report."""
    try:
        ckpt = torch.load(os.path.join(out_dir, 'ckpt.pt'), mmap=True, weights_only=True)
        return ckpt['model_args'] if str(ckpt.get('init_from')).startswith('hf:') else None
    except Exception:
        return None


# text of many kinds (words, digits, punctuation, whitespace runs, accents, CJK, an emoji) that two tokenizers
# encode alike only if they are the same one, for hf_vocabulary_mismatch
PROBE_TEXT = ("The quick brown fox, 1,234,567 times: don't STOP!\n\n\tIt's 3.14159 -- caf\u00e9 na\u00efve "
              "\u00fcber \u201cquoted\u201d \u65e5\u672c\u8a9e \U0001f600  two  spaces   three\r\n<|x|> end")


def hf_vocabulary_mismatch(path, data_meta):
    """What differs between the vocabulary of the model directory at path and the data's, where both can be
    told: a character-level export (its char_vocab.json) against the data's characters; a tokenizer.json against
    the data's of hf:PATH (by sha256), against char-level data (always), and against tiktoken's (by the ids each
    gives PROBE_TEXT: an export of a tiktoken run converts it to a tokenizer.json that gives the same ids). None
    where they agree, or where only the sizes can be compared (no tokenizer file; tiktoken's file not loadable)."""
    chars_path, tokenizer_path = os.path.join(path, 'char_vocab.json'), os.path.join(path, 'tokenizer.json')
    try:
        if os.path.isfile(chars_path):
            with open(chars_path, encoding='utf-8') as f:
                chars = ''.join(json.load(f))
            return vocabulary_mismatch(dict(tokenizer='char', vocab_size=len(chars), chars=chars), data_meta)
        if not os.path.isfile(tokenizer_path):
            return None
        if data_meta['tokenizer'].startswith('hf:'):
            with open(tokenizer_path, 'rb') as f:
                sha = hashlib.sha256(f.read()).hexdigest()
            theirs = data_meta.get('tokenizer_sha256')
            return None if sha == theirs else (f"{tokenizer_path} has sha256 {sha[:12]}..., the data's tokenizer.json "
                                               f"{str(theirs)[:12]}...")
        if data_meta['tokenizer'] == 'char':
            return f"the model has {tokenizer_path}, the data is {describe_vocabulary(data_meta)}"
        with open(tokenizer_path, encoding='utf-8') as f:
            ours = HFTokenizer(f.read()).encode_ordinary(PROBE_TEXT)
    except Exception as e:  # tokenizers' errors are plain Exceptions
        raise TrainError(f"cannot read the vocabulary of {path}: {e}") from None
    try:
        theirs = get_tokenizer(data_meta)[0](PROBE_TEXT)
    except ValueError:  # tiktoken's file cannot be had here: only the sizes compare
        return None
    if ours == theirs:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (f"{tokenizer_path} and the data's {describe_vocabulary(data_meta)} encode the same text to other ids "
            f"(from token {at}: {ours[at:at + 3]} against {theirs[at:at + 3]})")


def tokenizer_advice(path):
    """How to prepare data for the model directory at path, where it holds a tokenizer prepare_data.py can use."""
    if os.path.isfile(os.path.join(path, 'tokenizer.json')):
        return f" (prepare_data.py --tokenizer=hf:{path})"
    if os.path.isfile(os.path.join(path, 'char_vocab.json')):
        return f" (character level, with the characters of {path}/char_vocab.json)"
    return ''


def start_from_hf(r):
    """Load the weights of init_from=hf:PATH into the model; training then goes on as from scratch (iteration
    0, a fresh optimizer). Returns the start that the checkpoints record."""
    from export import load_hf_weights
    path = r.cfg.init_from[3:]
    if mismatch := hf_vocabulary_mismatch(path, r.meta):
        raise TrainError(f"init_from={r.cfg.init_from}: the model's vocabulary is not {r.cfg.data_dir}'s: "
                         f"{mismatch}. Finetune only on data prepared with the model's tokenizer"
                         f"{tokenizer_advice(path)}")
    try:
        state = load_hf_weights(path, r.model_config)
    except ValueError as e:
        raise TrainError(f"init_from={r.cfg.init_from}: {e}") from None
    set_model_state_dict(r.model, state, options=FULL_STATE)
    r.say(f"weights from {path} ({r.model.num_params() / 1e6:.2f}M parameters), a fresh optimizer")
    return 'hf:' + os.path.abspath(path)


def compile_model(r):
    """torch.compile the wrapped model and compile it now, on real batches of every shape that training and
    evaluation will call it with, so that no step's time holds a compile and a failure shows before training. A
    failure is reported loudly and the run goes on eager. Running out of memory is not a compile failure: it
    stops the run with advice, and never falls back. Returns (the model to call, a note)."""
    cfg = r.cfg
    if not cfg.compile:
        return r.wrapped, 'off'
    note = f'on (mode {cfg.compile_mode})'
    if r.world > 1 and cfg.parallelism == 'ddp' and cfg.activation_checkpointing != 'none':
        # NOTE: Dynamo's DDP optimizer splits the graph at DDP's buckets, to overlap the all-reduce with the
        # backward, and cannot split checkpointed blocks (a higher-order op, pytorch/pytorch#104674): compile
        # would fail and the run train eager. One graph instead: gradients are all-reduced after the backward.
        torch._dynamo.config.optimize_ddp = False
        note += ', one graph under DDP (optimize_ddp off for activation checkpointing: no all-reduce overlap)'
    if gradients_out_of_cuda_graphs(r.model, cfg.compile_mode, r.device_type, r.accum_steps):
        note += ", each step's first gradients copied out of the CUDA graphs (accumulation)"
    compiled = torch.compile(r.wrapped, mode=None if cfg.compile_mode == 'default' else cfg.compile_mode)
    # short_block_size: each window's shape is compiled now too, not at its first step (in the timed figures)
    windows = {window_at(i, cfg) for i in range(r.iter_num, min(cfg.max_iters, cfg.short_block_iters))}
    try:  # compilation happens at the first call
        with torch.random.fork_rng(devices=[r.device] if r.device_type == 'cuda' else []):
            x, y = r.batches.next_batch  # a real batch (same shapes and strides), not consumed
            for window in [x.size(1)] + sorted(windows - {x.size(1)}):  # block_size first
                with r.autocast:
                    compiled(*in_windows(x, y, window), label_smoothing=cfg.label_smoothing)[1].backward()
                # no gradient kept across calls (CUDA graphs: see above); DDP's bucket views zeroed in place
                r.optimizer.zero_grad(set_to_none=not r.grad_views)
            compiled.eval()
            with torch.no_grad(), r.autocast:
                for batch in eval_warm_up(r.eval_splits):  # their strides are not the training batches' (Windows)
                    compiled(*batch)
            compiled.train()
    except Exception as e:
        oom = out_of_memory(e)
        if oom is not None:
            raise TrainError(f"out of memory in the first (compiling) step on {r.device} {memory_advice(oom, r)}"
                             ) from None
        bar = '!' * 100
        print(f"{bar}\nWARNING: torch.compile failed; training continues UNCOMPILED (slower, same math).\n"
              f"{type(e).__name__}: {str(e)[:2000]}\n{bar}", file=sys.stderr)
        r.model.train()
        compiled, note = r.wrapped, 'FAILED, running eager (see the warning above)'
    # the warm-up's gradients: the first step starts from none (under DDP from zeroed bucket views)
    r.optimizer.zero_grad(set_to_none=not r.grad_views)
    return compiled, note


def memory_advice(oom, r, evaluating=False):
    """The line of an out-of-memory error that says so, in brackets, then what would help this run: in an
    evaluation (no_grad) activation checkpointing would not."""
    cfg, c = r.cfg, r.model_config
    first = next((ln for ln in str(oom).splitlines() if is_oom_text(ln)), type(oom).__name__)
    ways = [f"lower batch_size={cfg.batch_size} and raise gradient_accumulation_steps (same tokens per step)"
            if cfg.batch_size > 1 else "batch_size is 1 already: a shorter block_size or a smaller model"]
    if not evaluating:
        ways += {'none': ["activation_checkpointing=selective or full"],
                 'selective': ["activation_checkpointing=full"]}.get(cfg.activation_checkpointing, [])
        if cfg.batch_size == 1 and cfg.optimizer == 'adamw' and not (r.world > 1 and cfg.parallelism == 'fsdp'):
            ways.append("a new run with optimizer=adamw8bit (2 bytes of optimizer state per parameter, not 8)")
    advice = f"({first[:300]}): {'; or '.join(ways)}"
    # bench.py's fit mode measures its own model (these six settings, the others at their defaults) in bf16 or fp16
    shape = {k: getattr(c, k) for k in ('n_layer', 'n_head', 'n_kv_head', 'n_embd', 'vocab_size', 'block_size')}
    if r.device_type == 'cuda' and r.dtype in ('bfloat16', 'float16') and GPTConfig(**shape) == c:
        flags = [f'--{k}={v}' for k, v in shape.items()] + [f'--tokens_per_step={tokens_per_iter(cfg)}']
        flags += ['--dtype=float16'] if r.dtype == 'float16' else []
        advice += f"; `python bench.py --mode=fit {' '.join(flags)}` finds the largest batch_size that fits"
    return advice


def last_checkpoint(r):
    """What a run stopped by an error can resume from, for its message."""
    if r.saved_iter is None:
        return "No checkpoint was saved yet"
    return f"The last good checkpoint is {r.ckpt_path} (iteration {r.saved_iter})"


def out_of_memory(e):
    """The out-of-memory error that e is or was raised from (torch.compile wraps errors), else None."""
    for _ in range(20):  # the chain of causes, never a cycle
        if e is None:
            return None
        if isinstance(e, torch.OutOfMemoryError) or is_oom_text(str(e)):
            return e
        e = e.__cause__ or e.__context__
    return None


def is_oom_text(text):  # CUDA's and MPS's words, and the CPU allocator's
    return 'out of memory' in text.lower() or "can't allocate memory" in text


def start_wandb(r):
    """wandb_log=True: a Weights & Biases run in process 0, which gets the records that metrics.jsonl gets;
    else None. wandb is imported here only (it is optional, and slow to import)."""
    if not (r.cfg.wandb_log and r.master):
        return None
    import wandb
    try:
        return wandb.init(project=r.cfg.wandb_project, name=r.cfg.wandb_run_name or None, config=vars(r.cfg))
    except Exception as e:  # no API key, no network, a bad project name: wandb's own words, without its traceback
        raise TrainError(f"wandb_log=True: wandb could not start a run: {e} (`wandb login`; WANDB_MODE=offline logs "
                         f"without an account; or set wandb_log=False)") from None


def report(r):
    """Print the resolved config, the model and which optimizations are on (and why any is off)."""
    cfg, say, model = r.cfg, r.say, r.model
    # the model's keys as built: resolved from 0 (n_kv_head, vocab_size, ...) or read from init_from=hf:PATH; its
    # fields that are no setting (norm_eps, Llama 3's RoPE scaling: only a config.json sets them) apart
    built = r.model_config.to_dict()
    shown = {**vars(cfg), **{k: v for k, v in built.items() if k in vars(cfg)}}
    width = max(map(len, shown))
    say("config:\n" + "\n".join(f"  {k:<{width}} = {v!r}" for k, v in shown.items()))
    say("model fields that are not config keys (init_from=hf:PATH reads them from config.json): "
        + ", ".join(f"{k}={v!r}" for k, v in built.items() if k not in vars(cfg)))
    say(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.flops_per_token() / 1e6:.1f} MFLOP per "
        f"token, vocab {r.vocab} ({r.meta['tokenizer']}, {r.meta['vocab_size']} used), "
        f"{tokens_per_iter(cfg):,} tokens per iteration")
    say(r.bpb_line)
    cuda = r.device_type == 'cuda'
    say("optimizations:")
    say(f"  device            {r.device}")
    say(f"  precision         {r.dtype} ({r.dtype_reason})" + (', GradScaler on' if r.scaler.is_enabled() else ''))
    say(f"  TF32 matmuls      {'on' if cuda else 'off (CUDA only)'}")
    say("  attention         F.scaled_dot_product_attention (flash/memory-efficient kernels on CUDA"
        + ('; float32 under CPU autocast: model.attend' if r.device_type == 'cpu' and r.dtype != 'float32' else '')
        + ")")
    fused = any(getattr(opt, 'defaults', {}).get('fused') for opt in optimizers(r.optimizer))
    say(f"  optimizer         {cfg.optimizer}" + (', fused AdamW' if fused else '')
        + (', stepped on the CPU (torchao)' if cfg.optimizer_offload else '')
        + (", Newton-Schulz in {} ({})".format(*muon_ns_dtype(cfg.muon_dtype, r.device_type))
           if cfg.optimizer == 'muon' else ''))
    where = state_where(r.optimizer)  # a resumed run's state is there already, a new run's comes at its first step
    if not where:
        where = ('paged CUDA managed memory for the large tensors (bitsandbytes), GPU memory for the rest'
                 if cfg.optimizer == 'paged_adamw8bit' else 'CPU memory (torchao), GPU memory for the smallest tensors'
                 if cfg.optimizer_offload else 'GPU memory' if cuda else f'{r.device_type.upper()} memory')
        where += ', from the first step'
    say(f"  optimizer state   {where}")
    peak, fp8_peak = peak_flops(r.device, r.dtype), peak_flops(r.device, 'float8')
    gpu = torch.cuda.get_device_name(r.device) if cuda else r.device_type
    mfu = f"of the {PEAK_LABEL[r.dtype]} peak, {peak / 1e12:,.1f} TFLOP/s ({gpu})" if peak else f"n/a ({gpu})"
    if cfg.fp8 and peak and fp8_peak:  # torchtitan's convention: FP8 and bf16 runs on one scale
        mfu += f"; this FP8 run's too, not of the FP8 peak ({fp8_peak / 1e12:,.1f} TFLOP/s)"
    say(f"  MFU               {mfu}")
    say(f"  fp8               {r.fp8_note}")
    say(f"  parallelism       {r.parallel_note}")
    say(f"  compile           {r.compile_note}")
    say(f"  act. checkpoint   {cfg.activation_checkpointing}")
    residual, residual_warning = residual_stream(cfg.autocast_residual, r.dtype,
                                                 r.world > 1 and cfg.parallelism == 'fsdp')
    say(f"  residual stream   {residual}")
    say(f"  pinned memory     {'on' if cuda else 'off (CUDA only)'}")
    # setting_warnings, and autocast_residual's, which needs the run's dtype (dtype='auto' is resolved at setup)
    warnings = setting_warnings(cfg, r.world, trains=r.iter_num < cfg.max_iters)
    warnings += [residual_warning] if residual_warning else []
    if cfg.compile and cfg.compile_mode == 'reduce-overhead' and not cuda:
        warnings.append(f"compile_mode='reduce-overhead' has no effect on {r.device_type}: it records CUDA graphs, "
                        f"which only CUDA has, so this run compiles as compile_mode='default' does")
    for warning in warnings:
        say(f"warning: {warning}", file=sys.stderr)


def residual_stream(autocast_residual, dtype, fsdp):
    """(the residual stream's dtype as the report names it, a warning where autocast_residual=True changes
    nothing, or None). Under FSDP the mixed-precision policy, not autocast, computes the whole model in dtype."""
    if dtype == 'float32':
        return 'float32', ("autocast_residual=True has no effect: this run computes in float32, without autocast"
                           if autocast_residual else None)
    if fsdp:
        return f"{dtype} (FSDP's policy: all of the model in it)", (
            f"autocast_residual=True has no effect: FSDP's mixed-precision policy computes the whole model, its "
            f"residual stream too, in {dtype}" if autocast_residual else None)
    return (f"{dtype} (autocast_residual)" if autocast_residual else 'float32 (autocast_residual off)'), None


def evals_left(it, cfg):
    """The evaluations at iterations it to max_iters (the one at `it` runs before its step): every eval_interval,
    and one at max_iters."""
    return cfg.max_iters // cfg.eval_interval - (it - 1) // cfg.eval_interval + (cfg.max_iters % cfg.eval_interval > 0)


def tokens_per_iter(cfg):
    return cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps


def save(r, *paths):
    """Checkpoint the run to each path. Every process takes part (FSDP gathers the shards); process 0 writes."""
    if not agree(weights_finite(r.model), r.device):
        raise stop_together(r, f"iteration {r.iter_num}: the weights hold NaN/inf; not saving {', '.join(paths)}")
    rngs = [rng_state()]
    if r.world > 1:
        rngs = [None] * r.world
        dist.all_gather_object(rngs, rng_state())
    state = {'model': get_model_state_dict(r.model, options=FULL_STATE),
             'optimizer': optimizer_state(r),
             'scaler': r.scaler.state_dict(), 'iter_num': r.iter_num, 'tokens': r.tokens,
             'best_val_loss': r.best_val_loss,
             'config': vars(r.cfg), 'model_args': r.model_config.to_dict(), 'meta': r.meta,
             'batches': r.batches.state_dict(), 'rng': rngs, 'argv': list(r.argv), 'init_from': r.init_from,
             'evaluated': r.last_eval == r.iter_num}
    on_master(r, lambda: [save_checkpoint(path, state) for path in paths])
    r.saved_iter = r.iter_num


def log_metrics(r, record):
    """Append record to out_dir/metrics.jsonl as one JSON line (process 0). A failed write is a warning, never
    the end of a run that can still save its checkpoints, which hold all that a resume needs. Each record gets
    time_s, the wall seconds since train.py started (START_TIME; it leaves out the interpreter's own start-up
    before the first line runs, about 20 ms); an eval line is stamped after the evaluation, so time_s counts it."""
    if not r.master:
        return
    record = {**record, 'time_s': round(time.time() - START_TIME, 3)}
    if r.wandb:  # the same records to Weights & Biases, whether or not the file takes them
        r.wandb.log(record)
    start = None
    try:
        with open(r.metrics_path, 'a') as f:
            start = f.tell()
            f.write(json.dumps(record) + '\n')
    except OSError as e:
        if start is not None:  # take back a half-written line, so that the next line starts on its own
            with suppress(OSError):
                os.truncate(r.metrics_path, start)
        if not r.metrics_lost:  # one warning per stretch of failures, not one per line
            say(f"warning: cannot write {r.metrics_path} ({os_reason(e, r.metrics_path)}); training goes on, "
                f"its lines are printed but not logged until a write succeeds", file=sys.stderr)
        r.metrics_lost += 1
        return
    if r.metrics_lost:
        r.say(f"{r.metrics_path} is written again; {r.metrics_lost} line(s) were lost")
        r.metrics_lost = 0


def plot_metrics(r, final=False):
    """Redraw out_dir/metrics.png from metrics.jsonl in process 0: at an evaluation once the last drawing is
    PLOT_EVERY_S old, and at the end (final). A plot that cannot be written is a warning: it is never worth
    the run."""
    if not r.master or not (final or time.time() - r.plotted_at >= PLOT_EVERY_S):
        return
    r.plotted_at = time.time()
    import plot  # and matplotlib (a second) in plot.draw, at the first drawing rather than at start-up
    try:
        records = plot.read_metrics(r.cfg.out_dir)
    except ValueError:  # metrics.jsonl missing or empty: log_metrics has warned about that already
        return
    try:
        plot.draw({r.cfg.out_dir: records}, r.plot_path)
    except Exception as e:
        say(f"warning: could not draw {r.plot_path} ({type(e).__name__}: {e}); training goes on", file=sys.stderr)


def evaluate(r):
    """Evaluate, log, draw, checkpoint (best.pt too when the val loss improved); returns the seconds it all took."""
    start = time.time()
    losses = estimate_loss(r.compiled, r.eval_splits, r.autocast)
    bpb = {k: loss * r.eval_tokens_per_byte[k] / math.log(2) for k, loss in losses.items()
           if k in r.eval_tokens_per_byte}
    r.say(f"iter {r.iter_num}: " + ', '.join(f"{split} loss {loss:.4f}" for split, loss in losses.items())
          + (f", val bpb {bpb['val']:.4f}" if 'val' in bpb else ''))
    log_metrics(r, {'iter': r.iter_num, 'tokens': r.tokens, **{f'{k}_loss': loss for k, loss in losses.items()},
                    **{f'{k}_bpb': v for k, v in bpb.items()}})
    plot_metrics(r, final=r.iter_num >= r.cfg.max_iters)  # the last one is drawn whatever the time
    r.last_eval = r.iter_num
    improved = losses['val'] < r.best_val_loss
    r.best_val_loss = min(r.best_val_loss, losses['val'])
    if improved and r.best_reset:  # the first best.pt since a resume's reset: the earlier one kept
        on_master(r, lambda: move_best_aside(r))
        r.best_reset = False
    save(r, *([r.best_path] if improved else []), r.ckpt_path)
    return time.time() - start


def stopped(r, stop):
    """If a signal reached any process (all stop at the same point): the checkpoint saved, unless this iteration's
    is, the command that resumes printed, and the exit code returned; else None."""
    if not agree(bool(stop), r.device, every=False):
        return None
    if r.saved_iter != r.iter_num:
        save(r, r.ckpt_path)
    signum = stop.get('signal', signal.SIGTERM)  # a process the signal did not reach says SIGTERM
    r.say(f"{signal.Signals(signum).name}: saved {r.ckpt_path} at iteration {r.iter_num}. Resume with:\n"
          f"  {resume_command(r.argv, r.world)}")
    return 128 + signum


def train_loop(r):
    """The training loop: evaluate and checkpoint every eval_interval and at the end, step, log; returns the
    exit code."""
    cfg, say, world = r.cfg, r.say, r.world
    with stop_on_signals(notify=first_on_node()) as stop:
        if r.rng is not None and r.rank < len(r.rng):  # each process its own RNG state
            set_rng_state(r.rng[r.rank])
        elif r.rng is not None:  # more processes than the checkpoint's run had
            torch.manual_seed(cfg.seed + r.rank + r.iter_num)
        state_reported = False
        bad_steps, skipped = 0, 0
        t0, t0_iter, eval_s = time.time(), r.iter_num, 0.0
        while True:
            # every eval_interval, and at the end (max_iters need not be a multiple of it)
            if (r.iter_num % cfg.eval_interval == 0 or r.iter_num >= cfg.max_iters) and r.last_eval != r.iter_num:
                eval_s = evaluate(r)  # evaluation, plot and checkpoints: the time left counts those to come
                if r.iter_num < cfg.max_iters and (code := stopped(r, stop)) is not None:  # a signal during the
                    return code  # evaluation: no step after it (after the last one, the run ends as it would)
                t0, t0_iter = time.time(), r.iter_num  # keep evaluation out of the throughput figures
            if r.iter_num >= cfg.max_iters:
                break
            lr = get_lr(r.iter_num, cfg)
            for group in r.optimizer.param_groups:
                group['lr'] = lr
            window = window_at(r.iter_num, cfg)
            loss, norm, ok = train_step(r.compiled, r.optimizer, r.scaler, r.batches, r.accum_steps, r.autocast,
                                        cfg.grad_clip, cfg.label_smoothing, r.grad_sync, window, r.grad_views)
            r.iter_num, r.tokens = r.iter_num + 1, r.tokens + tokens_per_iter(cfg)
            bad_steps = 0 if ok else bad_steps + 1
            if not ok:
                skipped += 1
                loss, norm = loss.item(), norm.item()
                bad = ' and '.join(f"{name} {value}" for name, value in (('loss', loss), ('gradient norm', norm))
                                   if not math.isfinite(value))  # else fp16's GradScaler found the overflow
                say(f"iter {r.iter_num}: non-finite {bad or f'gradients (loss {loss}, gradient norm {norm})'}: "
                    f"step skipped ({bad_steps} in a row)", file=sys.stderr)
                if bad_steps >= cfg.max_nonfinite_steps:  # (the losses and norms are every process's alike)
                    raise stop_together(r, f"iteration {r.iter_num}: {bad_steps} consecutive steps with a non-finite "
                                           f"loss or gradient; stopping. {last_checkpoint(r)}; lower learning_rate or "
                                           f"check the data")
            elif r.iter_num % cfg.log_interval == 0:
                loss, norm = torch.stack((loss, norm)).tolist()  # the one sync of a log step
                n, dt = r.iter_num - t0_iter, time.time() - t0  # n >= 1: t0_iter is set before a step
                ms_per_iter, tokens_per_sec = 1000 * dt / n, tokens_per_iter(cfg) * n / dt
                # per GPU, at the mean window of the steps since t0 (FLOPs per token are linear in it)
                mean_window = sum(window_at(i, cfg) for i in range(t0_iter, r.iter_num)) / n
                mfu = r.model.estimate_mfu(tokens_per_sec / world, r.device, r.dtype, mean_window)
                mem = peak_memory_mb(r.device_type)
                left = (cfg.max_iters - r.iter_num) * ms_per_iter / 1000 + evals_left(r.iter_num, cfg) * eval_s
                say(f"iter {r.iter_num}: loss {loss:.4f}, grad norm {norm:.4g}, lr {lr:.2e}, "
                    f"{ms_per_iter:.1f} ms/iter, {tokens_per_sec:,.0f} tok/s, "
                    + (f"mfu {100 * mfu:.1f}% of {PEAK_LABEL[r.dtype]} peak, " if mfu is not None else '')
                    + f"peak mem {mem:,.0f} MB, {int(left // 60)}m{int(left % 60):02d}s left"
                    + (f", {skipped} steps skipped" if skipped else ''))
                log_metrics(r, {'iter': r.iter_num, 'tokens': r.tokens, 'loss': loss, 'grad_norm': norm, 'lr': lr,
                                'tokens_per_sec': tokens_per_sec, 'mfu': mfu, 'peak_mem_mb': mem})
                if not state_reported:  # the state exists once a step has run
                    held, state_bytes = local_params(r.model), optimizer_state_bytes(r.optimizer)
                    say(f"optimizer state: {state_bytes / held:.2f} bytes per parameter ({cfg.optimizer}), "
                        + (f"{state_bytes / 2**20:,.1f} MiB per process (its {held:,} parameters), "
                           if world > 1 else '')
                        + state_where(r.optimizer))
                    state_reported = True
                t0, t0_iter = time.time(), r.iter_num
            if (code := stopped(r, stop)) is not None:
                return code
        if r.saved_iter != r.iter_num:
            save(r, r.ckpt_path)
        say(f"done: {r.iter_num} iterations, {best_val_text(r.best_val_loss)}; checkpoints in {cfg.out_dir}")
        return 0


# what a collective raises (gloo) when another process has exited (after an error of its own, which it prints) or
# the connection dropped
PEER_GONE = ('Connection closed by peer', 'Connection reset by peer')
CONFIG_ERROR_WAIT_S = 3  # under torchrun, how long the processes that leave a config error to another to print wait


def first_on_node():
    """Whether this process speaks for its node: a plain run (one that inherited a LOCAL_RANK too), or under torchrun
    (WORLD_SIZE) the node's first process, LOCAL_RANK 0."""
    return int(os.environ.get('WORLD_SIZE', 1)) == 1 or os.environ.get('LOCAL_RANK', '0') == '0'


def report_error(e):
    """Print a ConfigError or TrainError once, as one write of the whole line (sys.exit(message) writes the newline
    apart): under torchrun the processes share stderr, and two processes' errors would otherwise run together on one
    line. Under torchrun a config error is every process's alike, or at least every process's of one node (a device
    it lacks): each node's first process prints it, in that node's log. A TrainError can be one process's alone:
    each prints its own, named by its process, but a PeerError, whose process stops because another stopped with an
    error it prints; a stop all agreed on (stop_together) is printed by process 0, unnamed."""
    if getattr(e, 'reported', False) or isinstance(e, PeerError):
        return
    e.reported = True
    if isinstance(e, ConfigError) and not first_on_node():
        # torchrun stops every process once one has exited: this one waits, so that the first process of its node,
        # which prints the error and may have started a second later, is not stopped before it has
        time.sleep(CONFIG_ERROR_WAIT_S)
        return
    world = int(os.environ.get('WORLD_SIZE', 1))
    who = ''  # a config error and an agreed stop are every process's; any other error is one process's: which one
    if world > 1 and isinstance(e, TrainError) and not getattr(e, 'together', False):
        who = f"process {os.environ.get('RANK', '?')} of {world}: "
    sys.stderr.write(f"train.py: error: {who}{e}\n")
    sys.stderr.flush()


if __name__ == '__main__':
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, TrainError) as e:
        report_error(e)
        sys.exit(1)
