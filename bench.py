"""
Benchmark the speed-ups of model.py and train.py as an ablation ladder, each rung adding one optimization
to the rung before, then the memory options, each alone on top of the last rung; or (--mode=fit) find the
largest micro-batch that fits in GPU memory (its tries in child processes: FitTries); or (--mode=profile)
profile one rung's step (the top rung, or --rungs=N): its kernels by time and the share of matmuls, attention,
memory copies, elementwise (with FP8: the kernels that cast to it apart) and optimizer, and the device's idle
time, with its longest gaps and the kernels after them. Steps, optimizer and data are train.py's.

    python bench.py                                  # CPU: a 0.9M-parameter model, a few minutes on 2 cores
    python bench.py                                  # GPU: the 124M GPT-2 shape, 16 x 1024 tokens x 32 micro-batches
    python bench.py --preset=tiny --compile=False    # seconds; presets: tiny, small, gpt2
    python bench.py --batch_size=8 --n_layer=24 --steps=20 --out=bench_h100
    python bench.py --rungs=8,12 --n_layer=18 --n_head=16 --n_embd=2048   # some rungs only: bf16 vs FP8 at 1.01B
    python bench.py --rungs=8,12 --fp8_recipe=rowwise   # the FP8 rung with rowwise scaling (default tensorwise)
    python bench.py --rungs=8,12 --n_layer=16 --n_head=32 --n_kv_head=8 --n_embd=2048 --mlp_hidden=8192
                                                     # Llama 3.2 1B's blocks (1.08B with GPT-2's vocabulary)
    python bench.py --mode=fit --tokens_per_step=524288   # GPU only: the batch_size and accumulation to use
    python bench.py --mode=profile                   # bench_out/profile.md: where the compiled 124M step goes
    python bench.py --mode=profile --rungs=12 --n_layer=18 --n_head=16 --n_embd=2048   # FP8's step at 1.01B
    python bench.py --rungs=8 --compile_mode=max-autotune --sdpa_backend=flash   # the top rung, one change at a time
    python bench.py --rungs=8 --coordinate_descent_tuning=True   # inductor's kernels tuned as they compile
    python bench.py --rungs=8 --rope=halves --loss_chunk_tokens=0                # (variants: see DEFAULTS)
    python bench.py --rungs=8 --stage_data=True      # the top rung without data loading: what loading costs
    python bench.py --rungs=8 --residual=autocast    # the residual stream in bf16 (model.autocast_residual)

The ladder:
  1 fp32 eager       float32, SDPA's unfused math kernel (SDPBackend.MATH), separate q/k/v projections
                     (SeparateQKVAttention below), AdamW unfused (foreach kernels on CUDA), no compile
  2 + TF32           float32 matmuls on TF32 tensor cores (CUDA only)
  3 + bf16 autocast  mixed precision as train.pick_dtype chooses it: bf16, or fp16 + GradScaler on GPUs
                     without bf16; off on the CPU (as in train.py) unless --dtype=bfloat16
  4 + SDPA flash     scaled_dot_product_attention picks its kernel (flash / memory-efficient)
  5 + fused QKV      one matmul for q, k and v: model.py's attention
  6 + fused AdamW    the whole optimizer step in one kernel (CUDA only, as configure_optimizer does)
  7 + chunked loss   model.py's ChunkedCrossEntropy: the loss a chunk of tokens at a time, never all the
                     logits at once (rungs 1-6 compute the plain loss over all of them, loss_chunk_tokens=0)
  8 + torch.compile  the model compiled (default mode)
  then, each alone on top of rung 8: activation checkpointing 'full' and 'selective', 8-bit AdamW
  (bitsandbytes), FP8 linear layers (torchao; CUDA capability >= 8.9).
A rung that cannot run here is listed as skipped, with the reason; the ladder goes on from the rung
before it. All rungs start from the same weights and train on the same batches (data_dir's train.bin, or
seeded random tokens), so a rung that breaks the math shows in the loss: the float32 rungs agree to ~1e-6.
A step is one optimizer step of `gradient_accumulation_steps` micro-batches, as in train.py: the gpt2
preset takes config/train_gpt2.py's 16 x 1024 x 32 = 524,288 tokens per step, so the optimizer, clipping
and the per-step sync weigh what they weigh in that run (tiny and small: one micro-batch per step, as
config/train_small.py does; --gradient_accumulation_steps sets it for any preset).
Each rung: `warmup` steps untimed, then the median of `repeats` device-synchronized timings of `steps`
steps. MFU: model.estimate_mfu, against the peak of the rung's matmuls, named in each cell (mfu_peak): TF32 for
float32 with TF32, bf16 for bf16 (FP8 too, as train.py), fp16 for fp16; n/a for float32 without TF32 (no such
peak listed), on a GPU model.PEAK_FLOPS does not list and off CUDA. Peak memory:
torch.cuda.max_memory_allocated over the timed steps (n/a on CPU); with CUDA graphs (--compile_mode=reduce-overhead
or max-autotune) over the rung's warm-up too, which records the graphs and allocates their memory (max-autotune:
and its benchmarks' buffers). Activation memory (activation_mb, on every device): the bytes saved for backward in
one micro-step, after the timed steps (activation_bytes). Loss: the last timed step's (`loss`), and in bench.json
each timed step's, in order (`losses`: averaged over many steps, they compare two precisions' training better
than one step's loss; from 20 timed steps on, bench.md gives each rung's mean over the last half: loss_means).
The learning rate is train.py's, constant, or warmed up linearly over the first steps (--lr_warmup).
Written to out/: bench.json, bench.md and bench.png (tokens/s, peak and activation memory), with device,
torch, model, batch, date and command line (fit: fit.json; profile: profile.md); an earlier run's are moved to
out/previous-<date-time>-<random>/ as this run first writes (keep_earlier). A rung that fails (out of memory, say)
makes the exit code 1, after the ladder has run on and its results are written. On the CPU, --threads sets torch's
threads (a busy machine can be faster on fewer).
"""
import collections
import gc
import itertools
import json
import math
import multiprocessing
import os
import pickle
import platform
import shlex
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.checkpoint import CheckpointPolicy

import model as model_module
import train
from configurator import ConfigError, configure
from model import GPT, GPTConfig, apply_rotary, attend, rotary_tables

DEFAULTS = dict(
    mode='ladder',          # 'ladder'; 'fit': the largest micro-batch that fits in GPU memory; 'profile': one
                            # rung's step under torch.profiler, its kernels by time and by kind
    rungs='',               # ladder: the rungs to run, by number ('1,8,12'); the others are listed as not run
                            # but still build the settings of the rungs after them. '' = all. profile: the rung
                            # ('12': FP8 on top of rung 8); '' = the top rung that runs here
    preset='auto',          # 'auto' (gpt2 on CUDA, small elsewhere), 'tiny', 'small' or 'gpt2'
    device='auto',          # as in train.py
    dtype='auto',           # rung 3: 'auto' (train.pick_dtype), 'bfloat16' or 'float16'
    compile=True,           # False skips the torch.compile rung (the memory rungs then run eager)
    n_layer=0, n_head=0, n_embd=0, vocab_size=0, block_size=0, batch_size=0,  # 0: the preset's
    warmup=0, steps=0,                                                        # 0: the preset's
    repeats=3,              # timings of `steps` optimizer steps, of which the median counts
    n_kv_head=0,            # 0: n_head
    mlp_hidden=0,           # the MLP's hidden width; 0: GPTConfig's (8/3 n_embd for SwiGLU, in 64s)
    fp8_recipe='tensorwise',  # the FP8 rung's scaling, as train.py's: 'tensorwise' or 'rowwise'
    # variants, to measure one change at a time (recorded in bench.json's meta and fit.json's bench_variants):
    compile_mode='default',  # the compiled rungs' (8 on) torch.compile mode: 'default', 'reduce-overhead' (CUDA
                             # graphs), 'max-autotune' or 'max-autotune-no-cudagraphs'
    coordinate_descent_tuning=False,  # the compiled rungs: True tunes each Triton kernel's block sizes by timing
                             # them as it compiles (inductor's coordinate_descent_tuning, without max-autotune's GEMMs)
    sdpa_backend='auto',     # rungs 4 on: 'auto' (SDPA picks), or only 'cudnn', 'flash' or 'efficient'
    loss_chunk_tokens=-1,    # the chunked-loss rungs: -1 model.py's chunk size; 0 the plain loss there too
    rope='flip',             # every rung: 'flip' (model.apply_rotary) or 'halves' (rope_halves, the textbook form)
    residual='float32',      # rungs under autocast, the residual stream: 'float32' (as autocast leaves it), or
                             # 'autocast': in autocast's dtype (model.autocast_residual)
    stage_data=False,        # True: a step's micro-batches loaded once and kept on the device (StagedBatches), so
                             # the steps run without data loading; the difference to False is what loading costs
                             # (the loss then comes from one step's batches over and over: compare only timings)
    gradient_accumulation_steps=0,                                            # 0: the preset's
    lr_warmup=0,            # every rung's learning rate (train.py's learning_rate) warmed up linearly over this many
                            # steps, warm-up ones first, as train.get_lr does, then constant; 0: constant throughout
    data_dir='data/shakespeare_char',  # its train.bin if there (and within vocab_size), else random tokens
    seed=1337,
    threads=0,              # torch's CPU threads; 0: its default. NOTE: on a busy machine 1 can be faster
    tokens_per_step=524288,  # fit mode: the tokens of one optimizer step (GPT-2: 0.5M)
    out='bench_out',
)
PRESETS = {  # shape, batch and timing (warmup and steps in optimizer steps)
    'tiny': dict(n_layer=2, n_head=2, n_embd=32, vocab_size=128, block_size=32, batch_size=4,
                 gradient_accumulation_steps=1, warmup=1, steps=2),
    'small': dict(n_layer=4, n_head=4, n_embd=128, vocab_size=128, block_size=128, batch_size=32,
                  gradient_accumulation_steps=1, warmup=2, steps=10),
    # config/train_gpt2.py's model and step (a test checks that they agree). A step is 32 micro-steps: by the
    # FLOPs count about 0.9 s on an H100 at 50% MFU, many times that in the fp32 rungs; so 1 + 3 x 1 per rung
    'gpt2': dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, batch_size=16,
                 gradient_accumulation_steps=32, warmup=1, steps=1)}
SDPA_BACKENDS = {'auto': None, 'cudnn': SDPBackend.CUDNN_ATTENTION, 'flash': SDPBackend.FLASH_ATTENTION,
                 'efficient': SDPBackend.EFFICIENT_ATTENTION}
SHAPE = ('n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'vocab_size', 'block_size')


class BenchError(RuntimeError):
    """A request bench.py cannot carry out: reported as one message, without a traceback."""


# ----------------------------------------------------------------------------------------------------
# the attention before QKV fusion (rungs 1-4); model.py keeps only the fused one

class SeparateQKVAttention(nn.Module):
    """model.CausalSelfAttention with three projections for q, k and v instead of one fused matmul.
    Its weights are copies of the fused weight's slices, so both compute the same function."""

    def __init__(self, fused):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = H, Hkv, D = fused.n_head, fused.n_kv_head, fused.head_dim
        weights = fused.qkv.weight.detach().split([H * D, Hkv * D, Hkv * D])  # rows: [q, k, v]
        self.q, self.k, self.v = (nn.Linear(w.size(1), w.size(0), bias=False, device='meta') for w in weights)
        for linear, w in zip((self.q, self.k, self.v), weights):
            linear.weight = nn.Parameter(w.clone())
        self.proj, self.q_norm, self.k_norm, self.dropout = fused.proj, fused.q_norm, fused.k_norm, fused.dropout

    def forward(self, x, cos, sin, cache=None, layer=0):
        assert cache is None, "training only: generate with model.py's attention"
        B, T, C = x.size()
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.q(x).view(B, T, H, D), self.k(x).view(B, T, Hkv, D), self.v(x).view(B, T, Hkv, D)
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or Hkv, T, D)
        y = attend(q, k, v, is_causal=True, enable_gqa=(H != Hkv), dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H * D)
        return F.dropout(self.proj(y), self.dropout, self.training)


def rope_halves(x, cos, sin):
    """model.apply_rotary in the textbook form (--rope=halves): each head's two halves, four products, one cat,
    where model.py multiplies whole heads by its tables and by a copy with the halves swapped (flip)."""
    cos, sin = rotary_tables(cos, sin) if cos.dim() == 2 else (cos, sin)  # [cos, cos] and [-sin, sin]
    half = x.size(-1) // 2
    c, s = cos[..., :half].to(x.dtype), sin[..., half:].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@contextmanager
def rope_variant(name):
    """--rope=halves: rope_halves in place of apply_rotary, in model.py and here, for the duration ('flip': as is)."""
    global apply_rotary
    if name == 'flip':
        yield
        return
    saved = model_module.apply_rotary, apply_rotary
    model_module.apply_rotary = apply_rotary = rope_halves
    try:
        yield
    finally:
        model_module.apply_rotary, apply_rotary = saved


class StagedBatches:
    """--stage_data: the first `count` batches of a train.Batches (one optimizer step's), kept on the device and
    served in turn, so that the timed steps read nothing from the token file and copy nothing to the device.
    The steps then train on those batches again and again: their loss is not comparable with a loaded run's."""

    def __init__(self, batches, count):
        self.staged, self.served = [batches.next() for _ in range(count)], 0

    def next(self):
        self.served += 1
        return self.staged[(self.served - 1) % len(self.staged)]


# ----------------------------------------------------------------------------------------------------
# activation memory: the bytes autograd keeps from the forward pass for the backward pass

def storages(t):
    """The storages a saved tensor holds: its own, or for a wrapper subclass (FP8's) those of its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        return [s for name in t.__tensor_flatten__()[0] for s in storages(getattr(t, name))]
    return [t.untyped_storage()]


class SelectiveSaves(TorchDispatchMode):
    """Selective checkpointing keeps the outputs of the ops its policy saves in a cache of its own, out of
    sight of the saved-tensor hooks: this sees them, as the policy picks them (on top of its caching mode)."""

    def __init__(self, policy, count):
        super().__init__()
        self.policy, self.count = policy, count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.policy(None, func, *args, **kwargs) in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.count(t)
        return out


def activation_bytes(model, forward, eager=True):
    """forward()'s result and the bytes it saved for backward: every tensor packed by the saved-tensor hooks,
    each storage once (views and repeats share it), at its storage's full size, except the model's
    parameters and buffers (weights, not activations; their low-precision copies under autocast do count),
    and in eager mode what selective checkpointing caches. Compiled, that cache is the graph's saved tensors."""
    weights = {s.data_ptr() for t in (*model.parameters(), *model.buffers()) for s in storages(t)}
    held = {}

    def count(t):
        for s in storages(t):
            if s.data_ptr() not in weights:
                held[s.data_ptr()] = s.nbytes()
        return t

    @contextmanager
    def on_top(caching, saves):
        with caching, saves:
            yield

    real = model_module.create_selective_checkpoint_contexts

    def counted(policy):  # model.py's selective checkpointing contexts, with SelectiveSaves on top
        caching, cached = real(policy)
        return on_top(caching, SelectiveSaves(policy, count)), cached
    model_module.create_selective_checkpoint_contexts = counted if eager else real
    try:
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            out = forward()
    finally:
        model_module.create_selective_checkpoint_contexts = real
    return out, sum(held.values())


# ----------------------------------------------------------------------------------------------------
# the rungs: what each one changes, why one cannot run here, and one rung's run

BASE = dict(tf32=False, dtype='float32', attention='math', fused_qkv=False, fused_adamw=False, chunked_loss=False,
            compile=False, checkpointing='none', optimizer='adamw', fp8=False)
LADDER = [('fp32 eager', {}), ('+ TF32', dict(tf32=True)), ('+ bf16 autocast', dict(dtype='mixed')),
          ('+ SDPA flash', dict(attention='auto')), ('+ fused QKV', dict(fused_qkv=True)),
          ('+ fused AdamW', dict(fused_adamw=True)), ('+ chunked loss', dict(chunked_loss=True)),
          ('+ torch.compile', dict(compile=True))]
MEMORY = [('+ act. ckpt full', dict(checkpointing='full')), ('+ act. ckpt selective', dict(checkpointing='selective')),
          ('+ 8-bit AdamW', dict(optimizer='adamw8bit')), ('+ FP8 linears', dict(fp8=True))]
# what each rung measures: the table's column, the key in the rung's row (bench.json), the format in the table
COLUMNS = {'ms/iter': ('ms_per_iter', '{:.1f}'), 'tokens/s': ('tokens_per_sec', '{:,.0f}'), 'MFU': ('mfu', '{:.1%}'),
           'peak mem MB': ('peak_mem_mb', '{:,.0f}'), 'activations MB': ('activation_mb', '{:,.2f}'),
           'opt. state MB': ('optimizer_state_mb', '{:,.2f}'),
           'vs baseline': ('speedup_vs_baseline', '{:.2f}x'), 'vs prev': ('speedup_vs_prev', '{:.2f}x'),
           'loss': ('loss', '{:.5f}')}


def why_skip(change, env):
    cuda = env.device_type == 'cuda'
    if 'tf32' in change and not cuda:
        return 'CUDA only: TF32 is a tensor-core format'
    if 'dtype' in change and env.mixed == 'float32':
        return f"{env.mixed_reason} (train.pick_dtype); --dtype=bfloat16 measures it anyway"
    if 'fused_adamw' in change and not cuda:
        return 'CUDA only: train.configure_optimizer fuses AdamW on CUDA'
    if 'compile' in change and not env.compile:
        return 'off (--compile=False)'
    if 'fp8' in change and not (cuda and torch.cuda.get_device_capability(env.device) >= (8, 9)):
        return 'needs CUDA compute capability >= 8.9 (H100, H200, L4, RTX 4090)'
    return None


def precision(s, fp8_recipe):
    text = {'float32': 'fp32 (TF32 matmuls)' if s['tf32'] else 'fp32', 'bfloat16': 'bf16 autocast',
            'float16': 'fp16 autocast + GradScaler'}[s['dtype']]
    return (text + (f' + FP8 linears ({fp8_recipe})' if s['fp8'] else '') +
            (', 8-bit AdamW' if s['optimizer'] != 'adamw' else ''))


def run_rung(s, env, timed=nullcontext):
    """Train from env.state with settings s on env's batches: timings, memory and the final loss. The timed
    steps run inside timed() (profile mode: torch.profiler), whose result is returned as 'timed'."""
    torch._dynamo.reset()  # drop the last rung's graphs: a fresh compile, never the cache limit's eager fallback
    gc.collect()
    if env.device_type == 'cuda':
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)  # this rung's peak, never an earlier one's
        torch.set_float32_matmul_precision('high' if s['tf32'] else 'highest')
    autocast = nullcontext() if s['dtype'] == 'float32' else torch.autocast(env.device_type, getattr(torch, s['dtype']))
    scaler = torch.amp.GradScaler(env.device_type, enabled=(s['dtype'] == 'float16'))
    with torch.device(env.device):
        model = GPT(env.config)
    model.load_state_dict(env.state)
    if not s['fused_qkv']:
        for block in model.blocks:
            block.attn = SeparateQKVAttention(block.attn)
    model.activation_checkpointing = s['checkpointing']
    model.loss_chunk_tokens = env.loss_chunk_tokens if s['chunked_loss'] else 0  # 0: the plain loss
    model.autocast_residual = env.residual == 'autocast'  # (no effect on the float32 rungs: no autocast)
    cfg = SimpleNamespace(**{**train.DEFAULTS, **{k: v for k, v in vars(env).items() if k in train.DEFAULTS},
                             'optimizer': s['optimizer'], 'fp8': s['fp8'], 'compile': s['compile'],
                             'activation_checkpointing': s['checkpointing'], 'dtype': s['dtype']})
    try:
        if s['fp8'] and not train.convert_to_fp8(model, cfg.fp8_recipe, env.device):
            raise BenchError('no linear layer is large enough to gain from FP8 (train.fp8_layer_filter)')
        # rungs 1-5 step AdamW with torch's default (multi-tensor) kernels, fused from rung 6 on (CUDA only)
        optimizer = train.configure_optimizer(model, cfg, env.device_type,
                                              fused=s['fused_adamw'] and env.device_type == 'cuda')
    except train.TrainError as e:  # no bitsandbytes, no torchao, ...: the rung is skipped
        raise BenchError(str(e).removesuffix(', or use optimizer=adamw')) from None  # (train.py's advice, not ours)
    mode = None if env.compile_mode == 'default' else env.compile_mode
    if s['compile']:  # (CUDA graphs keep no gradient across micro-steps: train.py's copy, as in its runs)
        train.gradients_out_of_cuda_graphs(model, env.compile_mode, env.device_type, env.gradient_accumulation_steps)
    net = torch.compile(model, mode=mode) if s['compile'] else model
    batches = train.Batches(env.tokens, env.batch_size, env.block_size, env.device, env.seed,
                            env.gradient_accumulation_steps)
    if env.stage_data:
        batches = StagedBatches(batches, env.gradient_accumulation_steps)
    # the learning rate: train.get_lr's warm-up (none at lr_warmup=0), then constant (a decay to min_lr=learning_rate)
    schedule = SimpleNamespace(**{**vars(cfg), 'warmup_iters': env.lr_warmup, 'min_lr': cfg.learning_rate})
    count = itertools.count()

    def step():
        lr = train.get_lr(next(count), schedule)
        for group in optimizer.param_groups:
            group['lr'] = lr
        return train.train_step(net, optimizer, scaler, batches, env.gradient_accumulation_steps, autocast,
                                cfg.grad_clip)
    times = []
    backend = SDPBackend.MATH if s['attention'] == 'math' else SDPA_BACKENDS[env.sdpa_backend]
    # NOTE: SDPA's backend is not in torch.compile's cache keys (torch 2.11 to 2.13): a graph an earlier run
    # compiled with another backend would come back from the cache, its attention kernels with it
    inductor = {'force_disable_caches': True} if s['compile'] and backend else {}
    if s['compile'] and env.coordinate_descent_tuning:
        inductor['coordinate_descent_tuning'] = True
    with sdpa_kernel([backend]) if backend else nullcontext(), inductor_config.patch(inductor):
        for _ in range(env.warmup):  # compiles, allocates the optimizer state, warms the caches
            step()
        if env.device_type == 'cuda':
            torch.cuda.synchronize()
            if not (s['compile'] and train.records_cuda_graphs(env.compile_mode, env.device_type)):
                # NOTE: CUDA graphs allocate their memory while recording (the warm-up), and replays reuse it
                # unallocated: a peak over the timed steps alone left out the activations (1.9 of 9.7 GB at 124M)
                torch.cuda.reset_peak_memory_stats(env.device)
        losses = []
        with timed() as watcher:
            for _ in range(env.repeats):
                t0 = time.perf_counter()
                for _ in range(env.steps):
                    losses.append(step()[0])
                losses[-1].item()  # waits for the device (CUDA, MPS) to finish
                times.append((time.perf_counter() - t0) / env.steps)
        losses = [loss.item() for loss in losses]
        peak = torch.cuda.max_memory_allocated(env.device) / 2**20 if env.device_type == 'cuda' else None
        x, y = batches.next()  # one more micro-step, untimed, to count what it saves for backward
        with autocast:
            micro_loss, saved = activation_bytes(model, lambda: net(x, y)[1], eager=not s['compile'])
        scaler.scale(micro_loss).backward()
        optimizer.zero_grad(set_to_none=True)
    ms = 1000 * statistics.median(times)
    tokens_per_sec = env.batch_size * env.block_size * env.gradient_accumulation_steps / (ms / 1000)
    # NOTE: float32 without TF32 (rung 1) has no peak in PEAK_FLOPS: the TF32 one would understate it several-fold
    plain_fp32 = s['dtype'] == 'float32' and not s['tf32']
    mfu = None if plain_fp32 else model.estimate_mfu(tokens_per_sec, env.device, s['dtype'], env.block_size)
    return dict(ms_per_iter=ms, tokens_per_sec=tokens_per_sec, loss=losses[-1], losses=losses,
                mfu=mfu, mfu_peak=train.PEAK_LABEL[s['dtype']] if mfu is not None else None,
                peak_mem_mb=peak,  # over the timed steps only (CUDA graphs: and the warm-up)
                activation_mb=saved / 2**20, optimizer_state_mb=train.optimizer_state_bytes(optimizer) / 2**20,
                **({'timed': watcher} if watcher is not None else {}))


def rung_name(name, change):
    """A rung's name, as its resolved change makes it: rung 3 is fp16 autocast where the GPU lacks bf16."""
    return name.replace('bf16', 'fp16') if change.get('dtype') == 'float16' else name


def resolved(change, env):
    """A rung's change with 'mixed' made the dtype it is here: train.pick_dtype's, or bfloat16 where that is
    float32 (what rung 3 is, when it is skipped too)."""
    mixed = 'bfloat16' if env.mixed == 'float32' else env.mixed
    return {k: mixed if v == 'mixed' else v for k, v in change.items()}


def ladder(env, save=lambda rows: None):
    """Every rung of the ladder, as rows (bench.json's); save(rows) after each one that runs."""
    rows, s, prev, baseline, top = [], dict(BASE), None, None, None
    for i, (name, change) in enumerate(LADDER + MEMORY, start=1):
        top = top or ((s, prev) if i > len(LADDER) else None)  # the memory rungs build on the last rung that ran
        base, base_row = top or (s, prev)
        change = resolved(change, env)
        trial = {**base, **change}
        row = dict(rung=i, name=rung_name(name, change),
                   precision=precision(trial, env.fp8_recipe), settings=trial, status='ok',
                   reason=why_skip(change, env), builds_on=base_row and base_row['name'],
                   mfu_peak=None, losses=None, **{key: None for key, _ in COLUMNS.values()})
        if env.rungs and i not in env.rungs:
            row.update(status='not run', reason='not in --rungs', builds_on=None)
            if not (top or why_skip(change, env)):  # a rung left out still builds the next ones, and the next
                s, prev = trial, None                 # rung that runs has no measured rung to compare with
            rows.append(row)
            continue
        try:
            if row['reason']:
                row['status'] = 'skipped'
            else:
                row.update(run_rung(trial, env))
        except BenchError as e:
            row.update(status='skipped', reason=str(e))
        except Exception as e:  # out of memory, a compile failure: the ladder goes on without this rung
            row.update(status='failed', reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
        if row['status'] == 'ok':
            baseline = baseline or row
            row['speedup_vs_baseline'] = baseline['ms_per_iter'] / row['ms_per_iter']
            row['speedup_vs_prev'] = (base_row['ms_per_iter'] / row['ms_per_iter'] if base_row else
                                      None if prev is None and i > 1 else 1.0)
            s, prev = (s, prev) if top else (trial, row)
        print(f"{i:2d} {row['name']:<22} " + (f"{row['ms_per_iter']:9.1f} ms/iter, loss {row['loss']:.5f}"
              if row['status'] == 'ok' else f"{row['status']}: {row['reason']}"), flush=True)
        rows.append(row)
        save(rows)
    return rows


# ----------------------------------------------------------------------------------------------------
# report: markdown and chart (the JSON is the rows themselves)

# the variants that only some rungs read, and which: a variant no rung that ran reads is marked so in the report
VARIANT_READ_BY = {'compile_mode': lambda s: s['compile'], 'sdpa_backend': lambda s: s['attention'] != 'math',
                   'loss_chunk_tokens': lambda s: s['chunked_loss'], 'residual': lambda s: s['dtype'] != 'float32'}


def no_effect(variants, device_type):
    """The variants that do nothing on this device (what they are for only CUDA has), each with the reason."""
    if device_type == 'cuda':
        return {}
    notes = {'compile_mode': variants['compile_mode'] == 'reduce-overhead' and
             f"no effect on {device_type}: CUDA graphs only, so it compiles as 'default' does",
             'coordinate_descent_tuning': variants['coordinate_descent_tuning'] and
             f"no effect on {device_type}: it tunes Triton kernels, which only CUDA runs"}
    return {key: note for key, note in notes.items() if note}


def variants_line(meta, ran):
    """The variants of meta, as a line of the report; ran: the settings of the rungs that ran."""
    v = meta['variants']
    micro = meta['batch_size'] * meta['block_size']
    chunk = ("0 (the plain loss)" if not v['loss_chunk_tokens'] else f"{v['loss_chunk_tokens']:,} tokens" + (
        f" (one chunk: a micro-batch is {micro:,} tokens)" if v['loss_chunk_tokens'] >= micro else ''))
    residual = "in autocast's dtype" if v['residual'] == 'autocast' else 'float32'
    data = 'staged on the device (no loading)' if v['stage_data'] else 'loaded as train.py does'
    notes = no_effect(v, meta['device_type'])
    tuned = ' + coordinate-descent tuning' if v['coordinate_descent_tuning'] else ''
    tuned += f" ({notes['coordinate_descent_tuning']})" if 'coordinate_descent_tuning' in notes else ''
    mode = f" ({notes['compile_mode']})" if 'compile_mode' in notes else ''
    parts = {'compile_mode': f"compile mode {v['compile_mode']}{mode}{tuned}",
             'sdpa_backend': f"SDPA backend {v['sdpa_backend']}", 'rope': f"RoPE {v['rope']}",
             'loss_chunk_tokens': f"loss chunk {chunk}", 'residual': f"residual stream {residual}",
             'stage_data': f"data {data}"}
    for key, reads in VARIANT_READ_BY.items():
        if not any(reads(s) for s in ran):
            parts[key] += ' (read by no rung that ran)'
    return "- variants: " + ', '.join(parts.values())


LOSS_MEAN_STEPS = 20  # timed steps from which the report gives each rung's mean loss over the last half


def markdown(rows, meta):
    shape = ', '.join(f"{k}={meta['model'][k]}" for k in SHAPE)
    first = next((r for r in rows if r['status'] == 'ok'), None)
    baseline = f"rung {first['rung']} ({first['name']}), the first that ran" if first else 'no rung (none ran)'
    lines = ["# bench.py: ablation ladder", "", f"- command: `{meta['command']}`", f"- date: {meta['date']}",
             *([f"- incomplete: the rungs after rung {rows[-1]['rung']} have not run (yet)"]
               if meta.get('complete') is False else []),
             f"- device: {meta['device']}; torch {meta['torch']}",
             f"- model: {shape}; {meta['params'] / 1e6:.2f}M parameters",
             f"- step (iter): one optimizer step of {meta['batch_size']} x {meta['block_size']} tokens x "
             f"{meta['gradient_accumulation_steps']} micro-batches = {meta['tokens_per_iter']:,} tokens; "
             f"{meta['step_note']}",
             f"- data: {meta['data']}", variants_line(meta, [r['settings'] for r in rows if r['status'] in
                                                              ('ok', 'failed')]),
             f"- timing: median of {meta['repeats']} x {meta['steps']} steps after {meta['warmup']} warm-up steps; "
             f"peak memory: {meta['memory']}; vs baseline: over {baseline}; vs prev: over the rung it builds on; "
             f"loss: the last timed step's (its forward, before its update); MB: 2^20 bytes; "
             f"learning rate {train.DEFAULTS['learning_rate']:g}, "
             + (f"warmed up over the first {meta['lr_warmup']} steps, the warm-up steps included"
                if meta.get('lr_warmup') else "constant"),
             "- activations: the bytes saved for backward in one micro-step, each storage once, parameters and "
             "buffers excluded (bench.activation_bytes)", "",
             '| # | rung | precision | ' + ' | '.join(COLUMNS) + ' | note |',
             '|---:|---|---|' + '---:|' * len(COLUMNS) + '---|']
    for r in rows:
        ok = r['status'] == 'ok'
        cells = ['-' if not ok else 'n/a' if r[key] is None else spec.format(r[key]) for key, spec in COLUMNS.values()]
        if ok and r['mfu'] is not None:
            cells[list(COLUMNS).index('MFU')] += f" of {r['mfu_peak']}"  # the peak it is measured against
        note = '' if ok else f"{r['status']}: {r['reason']}".replace('|', '/').replace('\n', ' ')
        lines.append('| ' + ' | '.join([str(r['rung']), r['name'], r['precision'], *cells, note]) + ' |')
    means = loss_means(rows)
    return '\n'.join(lines + (['', means] if means else [])) + '\n'


def loss_means(rows):
    """With LOSS_MEAN_STEPS timed steps or more: a line with each rung's mean loss over the last half of them,
    against the first rung's (a precision's training compared, where one step's loss is noise); else ''."""
    ok = [r for r in rows if r['status'] == 'ok' and len(r['losses'] or ()) >= LOSS_MEAN_STEPS]
    if not ok:
        return ''
    n = len(ok[0]['losses']) // 2  # every rung times the same steps
    means = [(r['rung'], sum(r['losses'][-n:]) / n) for r in ok]
    (first, ref), rest = means[0], means[1:]
    return (f"loss, mean of the last {n} of the {len(ok[0]['losses'])} timed steps: rung {first} {ref:.5f}"
            + ''.join(f"; rung {rung} {m:.5f} ({round((m / ref - 1) * 100, 2) + 0.0:+.2f}% against rung {first})"
                      for rung, m in rest))


def plot(rows, meta, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    names = [f"{r['rung']}. {r['name']}" + ('' if r['status'] == 'ok' else f" ({r['status']})") for r in rows]
    memory = 'peak memory (MB)' + ('' if meta['device_type'] == 'cuda' else f": n/a on {meta['device_type']}")
    fig, axes = plt.subplots(1, 3, figsize=(16, 1.6 + 0.4 * len(rows)), sharey=True)
    for ax, key, label in zip(axes, ('tokens_per_sec', 'peak_mem_mb', 'activation_mb'),
                              ('tokens/s', memory, 'saved for backward, one micro-step (MB)')):
        ax.barh(names, [r[key] or 0 for r in rows])
        ax.set_xlabel(label)
        ax.set_xlim(left=0)
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=''))  # 400k, not 400000 (they overlap)
    axes[0].invert_yaxis()
    fig.suptitle(f"{meta['device']}, torch {meta['torch']}, {meta['params'] / 1e6:.2f}M params, "
                 f"{meta['tokens_per_iter']:,} tokens/iter, {meta['date']}\n{meta['command']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# fit mode

def largest_batch(fits, cap):
    """The largest batch in [0, cap] that fits: doubling from 1, then bisection (fits must be monotone)."""
    lo, hi = 0, 1
    while hi <= cap and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, cap + 1)  # the smallest size known not to fit, or past the cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def split_step(n, micro_batch):
    """batch_size <= micro_batch and gradient_accumulation_steps whose product is n sequences."""
    if micro_batch < 1:
        return None, None
    accum = next(k for k in range(-(-n // micro_batch), n + 1) if n % k == 0)  # the fewest that divide n
    return n // accum, accum


FIT_VARIANTS = [('as is', {}), ('act. ckpt full', dict(checkpointing='full')),
                ('8-bit AdamW', dict(optimizer='adamw8bit')),
                ('act. ckpt full + 8-bit AdamW', dict(checkpointing='full', optimizer='adamw8bit'))]
FIT_START = 'spawn'  # how fit's child processes start: a fresh interpreter (CUDA cannot be used across a fork)


def fit_steps(env):
    """A try's steps: step 2 holds the optimizer state; its second micro-step the gradients too, as train.py's
    micro-steps after the first do (4 bytes per parameter: a batch that fits without them can run out of memory
    with accumulation)."""
    env.warmup, env.steps, env.repeats, env.gradient_accumulation_steps = 1, 1, 1, 2
    return env


def still_allocated(device):
    """The CUDA memory torch holds allocated once garbage is collected and its cache emptied: what is left."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def try_batch(s, env):
    """One try of fit mode, in this process: does a step of env.batch_size sequences with settings s fit? With the
    memory torch still holds allocated before the try and the device memory in use outside its allocator, and
    after a try that failed, what it left allocated."""
    held = outside = None
    if env.device_type == 'cuda':  # what an earlier try in this process left allocated
        held = still_allocated(env.device)
        # and the device memory in use that torch's allocator does not hold (CUDA contexts, this one and fit's
        # parent's; libraries' own allocations, other processes): what the driver counts as used, less what torch
        # reserved
        free, total = torch.cuda.mem_get_info(env.device)
        outside = total - free - torch.cuda.memory_reserved(env.device)
    result = dict(fits=True, error=None, held=held, outside=outside, left=None)
    try:
        run_rung(s, env)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or cuBLAS failing to get its workspace
        if not (isinstance(e, torch.cuda.OutOfMemoryError) or 'ALLOC_FAILED' in str(e)):
            raise
        result.update(fits=False, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    if not result['fits'] and env.device_type == 'cuda':  # (the error and its frames gone by now)
        result['left'] = still_allocated(env.device)
    return result


def fit_child(conn, env, argv):
    """A child process of fit mode: runs the tries its parent sends, (settings, batch_size), with try_batch, and
    answers each with its result, until one does not fit or raises (answered with the exception), or the parent
    sends None or goes away. env is the parent's where the process was forked, else it is built from argv."""
    try:
        env = env or fit_steps(setup(argv))
        with rope_variant(env.rope):  # (main's, in the parent)
            while True:
                try:
                    job = conn.recv()
                except EOFError:  # the parent is gone
                    return
                if job is None:
                    return
                s, env.batch_size = job
                result = try_batch(s, env)
                conn.send(result)
                if not result['fits']:
                    return
    except BaseException as e:  # a KeyboardInterrupt too: the parent stops as it would have
        try:
            pickle.loads(pickle.dumps(e))  # an exception the parent could not rebuild is sent as its text
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        try:
            conn.send(e)
        except OSError:  # the parent is gone
            pass


class FitTries:
    """fit's tries, each in a child process: a try that runs out of memory in the backward pass can leave that
    step's tensors allocated for good (pytorch/pytorch#82218, open), and later tries in the same process get only
    what is left: the 2026-11-24 search on an H100 found micro-batches of 53, 12 and 66 for the variants after the
    first, which need less memory than its 184 (a few GB left to each, by arithmetic on those sizes). So the child
    that ran a try that failed is replaced by a new one for the next try; tries that fit run on in the same child.
    fit.json keeps, for each try, what an earlier one left allocated (held) and, for each failure, what it left
    after its error (left_allocated): the leak itself, where there is one."""

    def __init__(self, env):
        self.env, self.child, self.conn = env, None, None

    def __call__(self, s, batch):
        if self.child is None:
            context = multiprocessing.get_context(FIT_START)
            self.conn, theirs = context.Pipe()
            env = self.env if FIT_START == 'fork' else None  # a spawned child builds its own from the command line
            self.child = context.Process(target=fit_child, args=(theirs, env, self.env.argv), daemon=True)
            self.child.start()
            theirs.close()
        try:
            self.conn.send((s, batch))
            answer = self.conn.recv()
        except (EOFError, OSError):  # the child died (killed, a crash) without an answer
            code = self.close()
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise RuntimeError(f"fit's child process ended without an answer to the try of batch_size={batch} "
                               f"({how})") from None
        except BaseException:
            self.close()
            raise
        if isinstance(answer, BaseException) or not answer['fits']:
            self.close()  # the child has returned: the next try gets a fresh process
            if isinstance(answer, BaseException):
                raise answer
        return answer

    def close(self):
        """Ends the child, if there is one; its exit code."""
        if self.child is None:
            return None
        try:
            self.conn.send(None)  # (a child still waiting for a try returns)
        except OSError:
            pass
        self.child.join(60)
        if self.child.is_alive():
            self.child.kill()
            self.child.join()
        code, self.child = self.child.exitcode, None
        self.conn.close()
        return code


def fit_variant(s, n, tries):
    """fit.json's row for settings s: the largest micro-batch of at most n sequences that fits, each size tried by
    tries, with each failure and what the search saw of leaks and of memory outside torch."""
    failures, held, outside = [], [], []

    def fits(batch):
        result = tries(s, batch)
        if result['held'] is not None:  # (CUDA only)
            held.append(result['held'])
            outside.append(result['outside'])
        if result['error']:
            left = {} if result['left'] is None else {'left_allocated': result['left']}  # (CUDA only)
            failures.append(dict(batch_size=batch, error=result['error'], **left))
        return result['fits']
    row = dict(settings=s, micro_batch=None, batch_size=None, gradient_accumulation_steps=None, note='',
               failures=failures, held_before_try=held, outside_torch_before_try=outside)
    try:
        best = largest_batch(fits, n)
        row.update(zip(('micro_batch', 'batch_size', 'gradient_accumulation_steps'), (best, *split_step(n, best))),
                   note='' if 0 < best < n else 'the whole step fits in one micro-batch' if best else
                   'does not fit even at batch_size=1')
    except Exception as e:
        row['note'] = f"skipped: {e}" if isinstance(e, BenchError) else f"failed: {type(e).__name__}: {e}"
    notes = [row['note']] if row['note'] else []
    if held and max(held) > 2**30:  # a fitting size is then too small: the search is not to be trusted
        notes.append(f"(up to {max(held) / 2**30:.1f} GiB still allocated before a try: a leak)")
    if outside and max(outside) > 2 * 2**30:  # more than a CUDA context and the libraries' handles take
        notes.append(f"(up to {max(outside) / 2**30:.1f} GiB of device memory in use outside torch's allocator "
                     f"before a try)")
    left = [f['left_allocated'] for f in failures if 'left_allocated' in f]
    if left and max(left) > 2**30:  # the leak FitTries keeps from the next try (pytorch/pytorch#82218)
        notes.append(f"(a failed try left up to {max(left) / 2**30:.1f} GiB allocated: the next ran in a new "
                     f"process)")
    row['note'] = ' '.join(notes)
    return row


def fit(env):
    # rung 7: eager, since compile would recompile for every size; compiled code usually needs less memory
    s = {**BASE, 'tf32': True, 'dtype': env.mixed, 'attention': 'auto', 'fused_qkv': True, 'fused_adamw': True,
         'chunked_loss': True}
    fit_steps(env)
    n = max(1, env.tokens_per_step // env.block_size)  # sequences per optimizer step: no need to go past them
    print(f"fit: {env.meta['device']}, {env.meta['params'] / 1e6:.1f}M params, block_size {env.block_size}, "
          f"{precision(s, env.fp8_recipe)}, eager; {n * env.block_size:,} tokens per optimizer step")
    variants = []
    os.makedirs(env.out, exist_ok=True)
    keep = ('command', 'date', 'device', 'torch', 'model', 'params', 'block_size', 'data')
    record = dict({k: env.meta[k] for k in keep}, bench_variants=env.meta['variants'],
                  tokens_per_step=n * env.block_size, complete=False, variants=variants)
    tries = FitTries(env)
    try:
        for name, change in FIT_VARIANTS:
            row = dict(variant=name, **fit_variant({**s, **change}, n, tries))
            variants.append(row)
            largest = '' if row['micro_batch'] is None else f"largest micro-batch {row['micro_batch']}: "  # skipped
            batch, accum = row['batch_size'], row['gradient_accumulation_steps']
            flags = f"--batch_size={batch} --gradient_accumulation_steps={accum} " if batch else ''
            print(f"  {name:<28} {largest}{flags}{row['note']}", flush=True)
            record['complete'] = len(variants) == len(FIT_VARIANTS)
            # after each variant, whole: a run cut short keeps its rows
            keep_earlier(env)
            write_whole(os.path.join(env.out, 'fit.json'), json.dumps(record, indent=1))
    finally:  # (else a daemon child ends with this process, or at its pipe's end)
        tries.close()
    return 0


# ----------------------------------------------------------------------------------------------------
# profile mode

# kernel (or CPU operator) name -> kind; the first pattern that matches wins, in this order. What launched it decides
# first (launcher_kind): whatever Optimizer.step launches is the optimizer's, whatever an attention op launches is
# attention; by name the foreach kernels outside the step are the optimizer's too: gradient clipping's norm and
# scaling and the GradScaler's unscale, the rest of the update
KINDS = [('optimizer', ('adam', 'muon', 'optimizer', 'foreach', 'multi_tensor', 'newton')),
         ('attention', ('flash', 'fmha', 'attention', 'sdpa')),
         ('matmul', ('gemm', 'matmul', 'cutlass', 'nvjet', 'xmma', 'wgmma', 'aten::mm', 'aten::addmm', 'aten::bmm',
                     'aten::baddbmm', 'aten::linear', 'scaled_mm', 'triton_tem_')),
         ('elementwise and other', ('triton_',)),  # inductor's fused kernels, whatever ops their names list
         # copies that only move bytes; a cast (bfloat16_copy_kernel_cuda) computes, and counts as elementwise
         ('memory copy', ('memcpy', 'memset', 'direct_copy_kernel', 'aten::copy_', 'aten::cat', 'aten::clone')),
         ('elementwise and other', ('',))]


# inductor's kernels (triton_, less its GEMM templates, triton_tem_) that cast to FP8 or find a tensor's absolute
# maximum for the FP8 scale, by the ops their names list (nothing else in the step takes an abs). NOTE: by name
# only, this is not what FP8 costs: the casts fuse into the kernels around them (a norm, SwiGLU's backward), whose
# work then counts here too, and FP8's extra copies of the weights' gradients (transposed, fp32) are named as
# bf16's casts are. What FP8 adds is the FP8 rung's elementwise time, both kinds, less rung 8's
FP8_CASTS = ('_scaled_mm', '_abs_')


def kind_of(name):
    name = name.lower()
    if name.startswith('triton_') and not name.startswith('triton_tem_'):  # inductor's fused kernels, named after
        if any(p in name for p in FP8_CASTS):  # the ops they fuse: a transpose of attention's gradient is no attention
            return 'elementwise with FP8 casts'
        if not any(p in name for p in KINDS[0][1]):  # (a compiled optimizer's keep its name)
            return 'elementwise and other'
    return next(kind for kind, patterns in KINDS if any(p in name for p in patterns))


def launcher_kind(event):
    """The kind that the host calls around event (a CPU operator, or the call that launched a kernel), itself
    included, give its time whatever its name: 'optimizer' inside Optimizer.step; 'attention' inside a fused
    attention op (cuDNN's helper kernels, cudnn::fusion::compute_dot_do_o and convert_dq_to_16bits); 'cast' inside
    aten::_to_copy (see kind_in); None: its name decides. NOTE: not inside the math backend's op: its backward runs
    as autograd's BmmBackward0 and SoftmaxBackward0, outside any attention op, so both directions count by name
    (matmul, elementwise), as the rungs with attention='math' always have."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    if any(name.startswith('Optimizer.step') for name in names):
        return 'optimizer'
    if 'aten::_scaled_dot_product_attention_math' not in names and \
            any(name.startswith('aten::') and 'attention' in name for name in names):
        return 'attention'
    return 'cast' if 'aten::_to_copy' in names else None


def kind_in(name, launcher):
    """The kind of a kernel or operator called name, given its launcher_kind. A copy under aten::_to_copy that
    stays on its device changes the dtype: it computes, as elementwise work (on the CPU a cast is aten::copy_)."""
    if launcher in ('optimizer', 'attention'):
        return launcher
    kind = kind_of(name)
    if launcher == 'cast' and kind == 'memory copy' and not any(p in name.lower() for p in ('memcpy', 'memset')):
        return 'elementwise and other'
    return kind


def device_kernels(events):
    """The profiler's CUDA kernels (and copies), by start time; not GPU-side annotations, which span kernels and
    the gaps between them."""
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if e.device_type == cuda and not getattr(e, 'is_user_annotation', False)]
    return sorted(kernels, key=lambda e: e.time_range.start)


def kernel_times(events):
    """From the profiler's events: each CUDA kernel's device time and calls by name, the time of each kind (a
    host call that launched a kernel decides first, whatever its name: launcher_kind), each name's kind, and
    the milliseconds that at least one kernel covers. CPU operators count only as launchers, never as time."""
    cuda = torch.autograd.DeviceType.CUDA
    spent, calls, shares = (collections.Counter() for _ in range(3))
    launched = collections.defaultdict(collections.Counter)  # name -> time by kind, of the kernels a launcher decides
    busy, end = 0.0, -math.inf
    for e in device_kernels(events):
        start, stop = max(e.time_range.start, end), e.time_range.end  # the union of the kernels' intervals
        busy, end = busy + max(0.0, stop - start), max(end, stop)
        spent[e.name] += e.time_range.elapsed_us()
        calls[e.name] += 1
    for e in events:  # the CPU calls that launched kernels (Kernel: name, device, duration)
        if e.device_type != cuda and e.kernels and (launcher := launcher_kind(e)):
            for k in e.kernels:
                launched[k.name][kind_in(k.name, launcher)] += k.duration
    by_name = collections.defaultdict(collections.Counter)  # name -> its time by kind
    for name, t in spent.items():
        for kind, us in launched[name].items():
            by_name[name][kind] += min(us, t - sum(by_name[name].values()))
        by_name[name][kind_of(name)] += t - sum(by_name[name].values())  # launched where its name decides
    for times in by_name.values():
        shares.update(times)
    shares = +shares  # drop the kinds with no time
    return spent, calls, shares, majority_kind(by_name), busy / 1000


def operator_times(prof):
    """kernel_times' figures for a CPU profile, of its operators' own CPU time (busy: their sum)."""
    spent, calls, shares = (collections.Counter() for _ in range(3))
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            spent[e.key] += e.self_cpu_time_total  # one key can have several rows (by device, annotation)
            calls[e.key] += e.count
    by_name = collections.defaultdict(collections.Counter)  # name -> its time by kind
    for e in prof.events():
        if e.self_cpu_time_total > 0 and e.device_type == torch.autograd.DeviceType.CPU:
            by_name[e.name][kind_in(e.name, launcher_kind(e))] += e.self_cpu_time_total
    for times in by_name.values():
        shares.update(times)
    kind = {**{name: kind_of(name) for name in spent}, **majority_kind(by_name)}
    return spent, calls, +shares, kind, sum(spent.values()) / 1000


def majority_kind(by_name):
    """{name: the kind that most of its time counts under} of {name: Counter(kind: time)}: a listed kernel's or
    operator's kind is the one the shares count (most of) its time under."""
    return {name: max(times, key=times.get) for name, times in by_name.items()}


def shorten(name, width=90):
    return name if len(name) <= width else name[:width - 3] + '...'


def kernel_links(prof):
    """{a kernel's id: the id of the host call that launched it}, from the profiler's own records (torch 2.11's
    events do not carry it; 2.13's do, as linked_correlation_id); {} where they cannot be read."""
    results = getattr(getattr(prof, 'profiler', None), 'kineto_results', None)
    cuda = torch.autograd.DeviceType.CUDA
    return {} if results is None else {k.correlation_id(): k.linked_correlation_id() for k in results.events()
                                       if k.device_type() == cuda}


def idle_gaps(events, links=None):
    """The device's idle intervals between its first kernel and its last (the wall time no kernel covers, less
    what comes before the first and after the last), longest first: (us, the kernel that ends the gap, the
    host's calls that launched it, outermost first: 'CompiledFunction > triton_poi_fused_embedding_0'). A gap
    before a step's forward is one that ends at the forward's first kernel (more than one step profiled).
    A kernel's launcher: its linked_correlation_id (torch 2.13) or links' entry for it (kernel_links), the id of
    a host call that the profiler gave kernels (the runtime's launch calls link to it too, and their ids are of
    another count)."""
    host = {e.id: e for e in events if e.device_type != torch.autograd.DeviceType.CUDA and e.kernels}
    gaps, end = [], None
    for e in device_kernels(events):
        if end is not None and e.time_range.start > end:
            link = getattr(e, 'linked_correlation_id', None)
            launcher, calls = host.get((links or {}).get(e.id, 0) if link is None else link), []
            while launcher is not None:
                calls.insert(0, launcher.name)
                launcher = launcher.cpu_parent
            calls = calls if len(calls) <= 3 else [*calls[:2], '...', calls[-1]]  # the outermost, the launcher
            gaps.append((e.time_range.start - end, e.name, ' > '.join(map(shorten, calls)) or 'not known'))
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    return sorted(gaps, key=lambda gap: -gap[0])


def idle_rows(events, wall_ms, busy_ms, links=None):
    """profile.md's rows of the device's idle time (CUDA): its lines in the table of kinds, and the table of the
    longest gaps between kernels (idle_gaps)."""
    gaps = idle_gaps(events, links)
    idle, between = max(0.0, wall_ms - busy_ms), sum(us for us, _, _ in gaps) / 1000
    edges = max(0.0, idle - between)
    summary = [f"| device idle (wall time no kernel covers) | {idle:,.1f} | {idle / wall_ms:.1%} of wall |",
               f"| of which between kernels, in {len(gaps):,} gaps | {between:,.1f} | "
               f"{between / wall_ms:.1%} of wall |",
               f"| of which before the first kernel (the host starting the step: its batch, the forward's launch) "
               f"and after the last | {edges:,.1f} | {edges / wall_ms:.1%} of wall |"]
    table = ['', "| longest device idle gaps (us) | the kernel after it | launched from (the host's calls) |",
             '|---:|---|---|'] + [f"| {us:,.1f} | `{shorten(name)}` | `{calls}` |" for us, name, calls in gaps[:10]]
    return summary, table if gaps else []


def rung_settings(number, env):
    """Rung `number` (1-based) as the ladder builds it: its name, its settings (the changes of the ladder's rungs
    up to it that can run here; a memory rung's on top of all of them) and why it cannot run here (None: it can).
    NOTE: a ladder whose rung fails while it runs builds the memory rungs on the last rung that ran; this cannot
    know of such a failure, and builds them on all the ladder's rungs that can run here."""
    name, change = (LADDER + MEMORY)[number - 1]
    s = dict(BASE)
    for _, before in LADDER[:min(number, len(LADDER))]:
        if not why_skip(before, env):
            s.update(resolved(before, env))
    change = resolved(change, env)
    return rung_name(name, change), {**s, **change}, why_skip(change, env)


def profile(env):
    """One rung's optimizer steps under torch.profiler (--rungs=N; by default the top rung that runs here): the
    kernels (CUDA) or operators (CPU) that take the most time, and the share of each kind, with the device's idle
    time (CUDA: the step's wall time that no kernel covers: launch gaps, data loading, host syncs) and its
    longest gaps (idle_gaps). Writes out/profile.md."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    cuda = env.device_type == 'cuda'
    top = max(i for i, (_, change) in enumerate(LADDER, start=1) if not why_skip(change, env))  # the top that runs
    number = env.rungs[0] if env.rungs else top
    name, s, reason = rung_settings(number, env)
    if reason:
        raise BenchError(f"rung {number} ({name}) cannot run here: {reason}")
    env.repeats = 1
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    row = run_rung(s, env, timed=lambda: torch_profile(activities=activities))
    prof, wall_ms = row['timed'], row['ms_per_iter'] * env.steps
    if cuda:
        spent, calls, shares, kind, busy_ms = kernel_times(prof.events())
        what = 'kernel'
    else:
        spent, calls, shares, kind, busy_ms = operator_times(prof)
        what = 'operator'
    total = sum(spent.values()) or 1.0
    meta = env.meta
    lines = [f'# bench.py: profile of rung {number} ({name})', '', f"- command: `{meta['command']}`",
             f"- date: {meta['date']}",
             f"- device: {meta['device']}; torch {meta['torch']}", f"- model: {meta['params'] / 1e6:.2f}M parameters; "
             f"{meta['tokens_per_iter']:,} tokens per step ({meta['batch_size']} x {meta['block_size']} x "
             f"{meta['gradient_accumulation_steps']})", f"- rung: {precision(s, env.fp8_recipe)}; " + ', '.join(
                 k for k, v in s.items() if v is True), variants_line(meta, [s]),
             f"- profiled: {env.steps} step(s) after {env.warmup} warm-up "
             f"step(s): {wall_ms:,.1f} ms wall, {row['tokens_per_sec']:,.0f} tokens/s" + (
                 f", MFU {row['mfu']:.1%} of the {row['mfu_peak']} peak" if row['mfu'] else ''), '',
             '| kind | time (ms) | share |', '|---|---:|---:|']
    lines += [f"| {kind} | {t / 1000:,.1f} | {t / total:.1%} |" for kind, t in shares.most_common()]
    idle, gaps = idle_rows(prof.events(), wall_ms, busy_ms, kernel_links(prof)) if cuda else ([], [])
    lines += idle + ['', f'| top {what}s by time | kind | time (ms) | share | calls |', '|---|---|---:|---:|---:|']
    for name, t in spent.most_common(25):
        lines.append(f"| `{shorten(name)}` | {kind[name]} | {t / 1000:,.1f} | {t / total:.1%} | {calls[name]} |")
    lines += gaps
    text = '\n'.join(lines) + '\n'
    os.makedirs(env.out, exist_ok=True)
    keep_earlier(env)
    with open(os.path.join(env.out, 'profile.md'), 'w') as f:
        f.write(text)
    print(text + f"\nwrote {env.out}/profile.md")
    return 0


# ----------------------------------------------------------------------------------------------------

def device_name(device_type, device):
    if device_type == 'cuda':
        return torch.cuda.get_device_name(device)
    info = open('/proc/cpuinfo').read().splitlines() if os.path.exists('/proc/cpuinfo') else []
    cpu = next((ln.split(':', 1)[1].strip() for ln in info if ln.startswith('model name')), platform.machine())
    return f"{device_type}: {cpu}, {torch.get_num_threads()} threads"


def step_note(preset, tokens_per_iter):
    """Whether a step here is the step of the training config the preset mirrors."""
    config = {'small': 'config/train_small.py', 'gpt2': 'config/train_gpt2.py'}.get(preset)
    p = PRESETS[preset]
    tokens = p['batch_size'] * p['block_size'] * p['gradient_accumulation_steps']
    if config is None:
        return 'the tiny preset mirrors no training config'
    if tokens_per_iter == tokens:
        return f"as in {config}"
    return (f"NOT the {tokens:,} tokens per step of {config}: per token, the optimizer step, clipping and the "
            f"per-step sync weigh {tokens / tokens_per_iter:.3g}x what they weigh in that run")


def read_args(argv):
    """The settings of argv (config files, then --key=value flags) over DEFAULTS, checked as far as they can be
    without the device: each choice among its own, the rungs parsed and in range, no setting the mode does not
    read (the counts that a preset resolves are checked in setup)."""
    a = configure(DEFAULTS, argv, __file__)
    choices = {'mode': ('ladder', 'fit', 'profile'), 'preset': ('auto', *PRESETS),
               'dtype': ('auto', 'bfloat16', 'float16'), 'fp8_recipe': train.CHOICES['fp8_recipe'],
               'compile_mode': train.CHOICES['compile_mode'], 'sdpa_backend': tuple(SDPA_BACKENDS),
               'rope': ('flip', 'halves'), 'residual': ('float32', 'autocast')}
    for key, allowed in choices.items():
        if a[key] not in allowed:
            raise ConfigError(f"{key}={a[key]!r}: expected one of {', '.join(map(repr, allowed))}")
    for key in ('compile_mode', 'coordinate_descent_tuning'):
        if a['mode'] == 'fit' and a[key] != DEFAULTS[key]:
            raise ConfigError(f"--mode=fit runs eager (compile would recompile at every size): {key} does not apply")
    # what a mode sets itself, so that a setting it would ignore is no silent no-op
    own = {'ladder': (('tokens_per_step',), 'times steps of batch_size x block_size x gradient_accumulation_steps'),
           'profile': (('repeats', 'tokens_per_step', 'lr_warmup'), 'profiles one rung (the top one, or --rungs=N), '
                       'once'),
           'fit': (('rungs', 'batch_size', 'gradient_accumulation_steps', 'warmup', 'steps', 'repeats', 'compile',
                    'lr_warmup'),
                   'searches the micro-batch, eager, each try one warm-up and one timed step of 2 micro-steps')}
    keys, what = own[a['mode']]
    if unread := [k for k in keys if a[k] != DEFAULTS[k]]:
        raise ConfigError(f"--mode={a['mode']} does not read {', '.join(unread)}: it {what}")
    total = len(LADDER) + len(MEMORY)
    try:
        a['rungs'] = sorted({int(r) for r in str(a['rungs']).replace(' ', '').split(',') if r})
    except ValueError:
        raise ConfigError(f"rungs={a['rungs']!r}: expected rung numbers separated by commas, e.g. '1,8,12'") from None
    if any(not 1 <= r <= total for r in a['rungs']):
        raise ConfigError(f"rungs={a['rungs']}: the ladder's rungs are numbered 1 to {total}")
    if a['mode'] == 'profile' and len(a['rungs']) > 1:
        raise ConfigError(f"rungs={a['rungs']}: --mode=profile profiles one rung; run it once for each")
    if a['threads'] < 0:
        raise ConfigError(f"threads={a['threads']}: must be at least 0 (0: torch's default)")
    if not 0 <= a['seed'] < 2**63:
        raise ConfigError(f"seed={a['seed']}: must be between 0 and 2**63 - 1, as in train.py")
    if a['lr_warmup'] < 0:
        raise ConfigError(f"lr_warmup={a['lr_warmup']}: must be at least 0 (0: a constant learning rate)")
    if a['loss_chunk_tokens'] < -1:
        raise ConfigError(f"loss_chunk_tokens={a['loss_chunk_tokens']}: -1 (model.py's), 0 (the plain loss) or a size")
    if not a['out']:
        raise ConfigError("out='': must be a directory, not empty")
    return a


def setup(argv):
    """The resolved settings, the data, the initial weights and the conditions to record, as one namespace."""
    a = read_args(argv)
    train.check_device(a['device'])
    a['device'] = train.pick_device(a['device'])
    device_type = torch.device(a['device']).type
    if a['mode'] == 'fit' and device_type != 'cuda':
        raise BenchError(f"--mode=fit needs a CUDA GPU: it raises the micro-batch until GPU memory runs out. This "
                         f"run is on {device_type}, whose RAM it does not probe; set batch_size by hand there")
    torch.set_num_threads(a['threads'] or torch.get_num_threads())
    a['preset'] = a['preset'] if a['preset'] != 'auto' else 'gpt2' if device_type == 'cuda' else 'small'
    preset = PRESETS[a['preset']]
    a.update({k: a[k] or v for k, v in preset.items()})
    for key in ('batch_size', 'block_size', 'gradient_accumulation_steps', 'warmup', 'steps', 'repeats'):
        if a[key] < 1:  # warmup too: torch.compile compiles in the first step
            default = f" (0: the preset's, {preset[key]})" if key in preset else ''
            raise ConfigError(f"{key}={a[key]} must be at least 1{default}")
    if a['sdpa_backend'] in ('cudnn', 'efficient') and device_type != 'cuda':
        raise ConfigError(f"sdpa_backend={a['sdpa_backend']!r} is a CUDA kernel; on {device_type}: 'auto' or 'flash'")
    try:
        config = GPTConfig(**{k: a[k] for k in SHAPE})
    except ValueError as e:  # a shape GPTConfig rejects, with its reason
        raise ConfigError(str(e)) from None
    env = SimpleNamespace(**a, device_type=device_type, config=config, argv=list(argv))  # argv: fit's children
    env.mixed, env.mixed_reason = train.pick_dtype(a['dtype'], device_type)
    try:
        meta = train.read_meta(env.data_dir)
        env.tokens = train.load_tokens(env.data_dir, 'train', meta, env.block_size, env.vocab_size)
        data = f"{env.data_dir}/train.bin ({meta['tokenizer']} tokens)"
    except train.TrainError as e:
        env.tokens = np.random.default_rng(env.seed).integers(0, env.vocab_size, 1 << 20, dtype=np.int32)
        data = f"seeded random tokens ({e})"
    torch.manual_seed(env.seed)
    model = GPT(env.config)
    env.state = model.state_dict()  # on the CPU, copied into every rung's model
    if env.loss_chunk_tokens < 0:  # model.py's size for this shape
        env.loss_chunk_tokens = model.loss_chunk_tokens
    memory = f'n/a on {device_type}'
    if device_type == 'cuda':
        memory = 'torch.cuda.max_memory_allocated over the timed steps'
        if train.records_cuda_graphs(env.compile_mode, device_type):
            memory += " (compiled rungs: and the rung's warm-up, which records the CUDA graphs)"
    env.meta = dict(command=' '.join(['python bench.py', *map(shlex.quote, argv)]),
                    date=time.strftime('%Y-%m-%d %H:%M %Z'), device=device_name(device_type, env.device),
                    device_type=device_type, torch=torch.__version__, preset=env.preset, model=env.config.to_dict(),
                    params=model.num_params(), batch_size=env.batch_size, block_size=env.block_size,
                    gradient_accumulation_steps=env.gradient_accumulation_steps,
                    tokens_per_iter=env.batch_size * env.block_size * env.gradient_accumulation_steps,
                    step_note=step_note(env.preset, env.batch_size * env.block_size * env.gradient_accumulation_steps),
                    warmup=env.warmup, steps=env.steps, repeats=env.repeats, lr_warmup=env.lr_warmup, data=data,
                    variants=dict(compile_mode=env.compile_mode,
                                  coordinate_descent_tuning=env.coordinate_descent_tuning,
                                  sdpa_backend=env.sdpa_backend, rope=env.rope,
                                  loss_chunk_tokens=env.loss_chunk_tokens, residual=env.residual,
                                  stage_data=env.stage_data),
                    memory=memory)
    return env


OUTPUTS = {'ladder': ('bench.json', 'bench.md', 'bench.png'), 'fit': ('fit.json',), 'profile': ('profile.md',)}


def main(argv):
    env = setup(argv)
    train.probe_out_dir(env.out, 'out')  # now, not after minutes of measurements
    for key, note in no_effect(env.meta['variants'], env.device_type).items():
        print(f"warning: {key}={env.meta['variants'][key]!r} has {note}")
    with rope_variant(env.rope):
        return {'ladder': run_ladder, 'fit': fit, 'profile': profile}[env.mode](env)


def keep_earlier(env):
    """Before this run's first write: an earlier run's results in out/ (this mode's files) moved aside, never
    overwritten nor left beside this run's (a chart of another run). A run that stops before it writes (a rung that
    cannot run here) moves nothing."""
    if not getattr(env, 'kept', False):
        if keep := train.move_aside(env.out, [os.path.join(env.out, name) for name in OUTPUTS[env.mode]]):
            print(f"{env.out} held an earlier run's {', '.join(OUTPUTS[env.mode])}: moved to {keep}")
        env.kept = True


def write_whole(path, text):
    """Write text to path through a temporary file: a process killed meanwhile leaves the file as it was."""
    with open(f'{path}.tmp', 'w') as f:
        f.write(text)
    os.replace(f'{path}.tmp', path)


def run_ladder(env):
    meta = env.meta
    print(f"bench: {meta['device']}, torch {meta['torch']}, preset {env.preset}, {meta['params'] / 1e6:.2f}M "
          f"params, {meta['tokens_per_iter']:,} tokens/iter; data: {meta['data']}", flush=True)
    t0 = time.time()
    os.makedirs(env.out, exist_ok=True)

    def save(rows, complete=False):  # after every rung: a run cut short (a time limit, a crash) keeps its rows
        keep_earlier(env)
        meta.update(runtime_s=round(time.time() - t0, 1), complete=complete)
        write_whole(os.path.join(env.out, 'bench.json'), json.dumps(dict(meta, rungs=rows), indent=1))
        write_whole(os.path.join(env.out, 'bench.md'), table := markdown(rows, meta))
        return table
    rows = ladder(env, save)
    table = save(rows, complete=True)
    note = plot(rows, meta, os.path.join(env.out, 'bench.png'))
    print(f"\nwrote {env.out}/bench.json, bench.md" + (f"; {note}" if note else ", bench.png") + "\n\n" + table)
    if failed := [r for r in rows if r['status'] == 'failed']:  # (skipped is by design: the rung cannot run here)
        print(f"bench.py: {len(failed)} rung(s) failed: " + '; '.join(f"{r['rung']} {r['name']}: {r['reason']}"
                                                                     for r in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, BenchError, train.TrainError) as e:
        sys.exit(f"bench.py: error: {e}")
    except KeyboardInterrupt:  # what finished is written: bench.json and bench.md after each rung, fit.json after each
        print("\nbench.py: interrupted; what was written is kept (bench.json and bench.md: the rungs that finished; "
              "fit.json: the variants that did)", file=sys.stderr)
        sys.exit(130)
