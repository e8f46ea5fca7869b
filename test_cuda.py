"""
Tests for the CUDA paths of train.py and model.py, in two parts.

Part 1 runs everywhere, with CUDA's pieces faked where the CPU must stand in for them: the CUDA RNG state of
a checkpoint written with 8 visible GPUs restored with 1; every parameter of torchao's CPU-offload AdamW
taking the scheduled learning rate after a resume; a resumed paged_adamw8bit keeping its state in (fake)
paged buffers, without leaking the buffers of a phantom step; DDP + compile + activation checkpointing
turning Dynamo's DDP graph splitting off; an out-of-memory error in the compile warm-up stopping the run
with advice instead of falling back to eager; gradients accumulated over micro-steps copied out of CUDA graph
memory (emulated), and only then; no graph compiled after the compile warm-up (a batch of one
included); the peak FLOP/s of each GPU, by the name CUDA reports; one read of a device value per optimizer
step, none per micro-step. Each is checked against a reference: the uninterrupted run, the state saved,
Dynamo's own compiles, datasheet figures, the ops that make the host wait.

Part 2 needs a CUDA GPU (skipped without one): a small real model (4 layers x 256 wide, block 256) trained for
24 iterations in each branch (bf16 with fused AdamW, fp16 with a GradScaler, compile default and
reduce-overhead, adamw8bit, paged_adamw8bit, muon, optimizer_offload and fused AdamW without clipping as its
reference, FP8 tensorwise and rowwise under compile, activation checkpointing full and selective under
compile) and resumed from its iteration-12 checkpoint: the loss falls, the resumed run repeats the
uninterrupted one, compile made no graph break, peak memory is reported; reduce-overhead (CUDA graphs) with
gradient accumulation trains as compile's default mode; deterministic=True repeats a compiled bf16 run bit for bit
(not run on a GPU yet). Also: one process under torchrun
matches the plain run, 2-process DDP with compile and activation checkpointing stays compiled, sample.py
samples from an FP8-trained checkpoint; and, not run on a GPU yet: a step waits for the GPU once (CUDA's sync
debug mode), bench.py's peak memory under CUDA graphs holds the activations and is each rung's own, bench.py's
profile names what launched the kernel after each long idle gap. On one H100:
63 passed in 144 s under `pytest -n 8` (pytest-xdist; the runs share the GPU), before the CPU-only offload test
and the import of Dynamo's device interface above. It prints a summary table and, when $OUT is set, writes it to
$OUT/test_cuda_summary.md (one file per xdist worker).

    python -m pytest -q test_cuda.py            # or -n 8, with pytest-xdist
"""
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

# cuBLAS is deterministic only with a fixed workspace, set before CUDA starts (Part 2 runs deterministic)
os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# Dynamo's CUDA device interface copies torch.cuda.current_device (and others) when it is first imported. Imported
# while a test below fakes them (FakeCudaRng), it would keep the fake for the rest of the process: on the GPU a
# later compiled run then asked for a device of the fake's (seen once under pytest -n 8 on an H100: 'Device index
# value 2 is out of index range [0, 1)', and compile fell back to eager). Imported here, it holds the real ones.
import torch._dynamo.device_interface  # noqa: E402,F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import model as model_module  # noqa: E402
import train  # noqa: E402
from conftest import (assert_rmsnorm_rounded_once, assert_same, read_metrics, rmsnorm_bf16_case,  # noqa: E402
                      write_dataset)
from model import GPT, GPTConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA = torch.cuda.is_available()
if not CUDA:
    torch.set_num_threads(1)  # the tiny models of Part 1: one thread is as fast and avoids OpenMP stalls
NO_SCALER = torch.amp.GradScaler('cpu', enabled=False)
V = 40


def write_data(d, vocab=V, period=23, n_train=2300, n_val=460, seed=0):
    """train.bin / val.bin: a random sequence of `period` ids repeated (learnable), char-level meta.json."""
    pattern = np.random.default_rng(seed).integers(0, vocab, period)
    return write_dataset(d, np.resize(pattern, n_train), np.resize(pattern, n_val), vocab)


def main_capture(argv):
    """train.main(argv) in this process; returns (exit code, stdout)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = train.main(argv)
    return code, buf.getvalue()


def opt_cfg(**overrides):
    """train.py's config with the values configure_optimizer reads."""
    return SimpleNamespace(**dict(train.DEFAULTS, learning_rate=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95,
                                  **overrides))


def tiny_model(seed=0):
    torch.manual_seed(seed)
    # n_embd=64: every matrix has >= 4096 elements (large for torchao's offload and bitsandbytes' 8-bit
    # state, and for the fake pager below), every norm fewer
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        d = torch.randint(64, (4, 17), generator=g)
        out.append(SimpleNamespace(next=lambda d=d: (d[:, :-1], d[:, 1:])))
    return out


def file_round_trip(state):
    """state through torch.save and a weights_only torch.load, as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resume_matches_straight(make_optimizer, lrs, stop, grad_clip=1.0):
    """Train a tiny model for len(lrs) steps at the learning rates lrs, set as train_loop sets them (on
    optimizer.param_groups); and again, stopped after `stop` steps, the model and optimizer state saved and
    loaded into new ones with train.load_optimizer_state, then on. Returns (straight, resumed) optimizers
    and the names of the parameters whose weights differ at the end."""
    data = batches(len(lrs))

    def steps(model, opt, todo):
        for i in todo:
            for group in opt.param_groups:
                group['lr'] = lrs[i]
            _, _, ok = train.train_step(model, opt, NO_SCALER, data[i], 1, contextlib.nullcontext(), grad_clip)
            assert ok

    model_a = tiny_model()
    opt_a = make_optimizer(model_a)
    steps(model_a, opt_a, range(stop))
    saved_model = file_round_trip(model_a.state_dict())
    r_a = SimpleNamespace(cfg=opt_cfg(optimizer_offload=hasattr(opt_a, 'd_opt')), optimizer=opt_a, model=model_a,
                          device='cpu')
    saved_opt = file_round_trip(train.optimizer_state(r_a))
    steps(model_a, opt_a, range(stop, len(lrs)))

    model_b = tiny_model(seed=1)  # other initial weights: the loaded ones must replace them
    model_b.load_state_dict(saved_model)
    opt_b = make_optimizer(model_b)  # built after the weights are loaded, as train.setup does
    train.load_optimizer_state(SimpleNamespace(cfg=r_a.cfg, optimizer=opt_b, model=model_b), saved_opt)
    steps(model_b, opt_b, range(stop, len(lrs)))
    differ = [n for (n, a), b in zip(model_a.named_parameters(), model_b.parameters()) if not torch.equal(a, b)]
    return opt_a, opt_b, differ


# ====================================================================================================
# Part 1: everywhere, CUDA faked where needed
# ----------------------------------------------------------------------------------------------------
# 1. the CUDA RNG state: this process's own GPU, restored whatever the number of GPUs

class FakeCudaRng:
    """torch.cuda's RNG functions for `count` visible GPUs, each with its own generator state (16 bytes, as
    CUDA's Philox state), the current device `current`; a device index past the count is an error, as in
    CUDA (so set_rng_state_all with more states than GPUs fails, like the real one)."""

    def __init__(self, monkeypatch, count, current=0, salt=0):
        self.count, self.current = count, current
        self.states = [torch.full((16,), 10 * salt + i + 1, dtype=torch.uint8) for i in range(count)]
        for name in ('is_available', 'device_count', 'current_device', 'get_rng_state', 'set_rng_state',
                     'get_rng_state_all', 'set_rng_state_all', 'is_current_stream_capturing'):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return True

    def is_current_stream_capturing(self):  # asked by torch's optimizers once CUDA is available; a CUDA build of
        return False                        # torch on a machine without a driver would fail asking the real one

    def device_count(self):
        return self.count

    def current_device(self):
        return self.current

    def index(self, device):
        index = device if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} ({self.count} visible)")
        return index

    def get_rng_state(self, device='cuda'):
        return self.states[self.index(device)].clone()

    def set_rng_state(self, new_state, device='cuda'):
        self.states[self.index(device)] = new_state.clone()

    def get_rng_state_all(self):
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, new_states):
        for i, s in enumerate(new_states):
            self.set_rng_state(s, i)


def test_rng_state_saves_this_process_gpu_and_restores_it_on_a_smaller_node(monkeypatch, tmp_path):
    # Reference: the generator state of the process's own GPU (device 5 of 8) when saved; resumed where one
    # GPU is visible, that GPU must take exactly that state, where the old code raised on the 8 states.
    saver = FakeCudaRng(monkeypatch, count=8, current=5)
    state = train.rng_state()
    assert torch.equal(state['cuda'], saver.states[5])
    train.save_checkpoint(str(tmp_path / 'ckpt.pt'), {'rng': [state]})
    loaded = train.load_checkpoint(str(tmp_path / 'ckpt.pt'))['rng'][0]

    resumer = FakeCudaRng(monkeypatch, count=1, current=0, salt=3)
    assert not torch.equal(resumer.states[0], saver.states[5])
    train.set_rng_state(loaded)
    assert torch.equal(resumer.states[0], saver.states[5])


@pytest.mark.parametrize('count, current, want', [(1, 0, 0), (4, 3, 3), (8, 5, 5)])
def test_rng_state_of_an_older_checkpoint_with_every_gpu(monkeypatch, count, current, want):
    # Reference: checkpoints written before held get_rng_state_all()'s list (8 GPUs seen); the process
    # resuming on device `current` takes that device's entry and leaves the other GPUs alone.
    old = FakeCudaRng(monkeypatch, count=8, salt=1)
    state = dict(train.rng_state(), cuda=old.get_rng_state_all())
    new = FakeCudaRng(monkeypatch, count=count, current=current, salt=2)
    before = [s.clone() for s in new.states]
    train.set_rng_state(state)
    assert torch.equal(new.states[current], old.states[want])
    assert all(torch.equal(new.states[i], before[i]) for i in range(count) if i != current)


def test_rng_state_of_an_older_checkpoint_from_fewer_gpus_takes_the_first(monkeypatch):
    # Reference: a list shorter than this process's device index (a 1-GPU run resumed on cuda:1): its entry 0.
    old = FakeCudaRng(monkeypatch, count=1, salt=1)
    state = dict(train.rng_state(), cuda=old.get_rng_state_all())
    new = FakeCudaRng(monkeypatch, count=2, current=1, salt=2)
    train.set_rng_state(state)
    assert torch.equal(new.states[1], old.states[0])


def test_rng_state_with_a_gpu_entry_restores_on_a_machine_without_cuda(monkeypatch):
    # Reference: the CPU draws right after the save. A GPU run's state resumed where CUDA is not available (a
    # CPU-only machine) restores Python's, numpy's and torch's generators and leaves CUDA alone.
    state = dict(train.rng_state(), cuda=torch.full((16,), 7, dtype=torch.uint8))
    want = (torch.rand(3).tolist(), np.random.rand(2).tolist())

    def no_cuda(*a, **k):
        raise AssertionError('CUDA touched on a machine without it')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    for name in ('current_device', 'set_rng_state', 'get_rng_state'):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    train.set_rng_state(state)
    assert (torch.rand(3).tolist(), np.random.rand(2).tolist()) == want


def test_run_written_with_8_gpus_resumes_with_1(monkeypatch, tmp_path):
    # Reference: the whole path, train.main: a run that saw 8 GPUs (its own being cuda:2) stops at 4; the
    # resumed run sees one GPU and must restore that GPU from the saved state of cuda:2, and finish.
    data = write_data(tmp_path / 'data')
    argv = ['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
            '--batch_size=4', '--eval_iters=2', '--eval_interval=4', f'--data_dir={data}',
            f'--out_dir={tmp_path / "o"}']
    saver = FakeCudaRng(monkeypatch, count=8, current=2)
    assert main_capture(argv + ['--max_iters=4'])[0] == 0
    saved = train.load_checkpoint(str(tmp_path / 'o' / 'ckpt.pt'))['rng'][0]['cuda']
    assert torch.equal(saved, saver.states[2])
    resumer = FakeCudaRng(monkeypatch, count=1, salt=5)
    code, out = main_capture(argv + ['--max_iters=6', '--init_from=resume'])
    assert code == 0 and 'resuming from' in out
    assert torch.equal(resumer.states[0], saver.states[2])


# ----------------------------------------------------------------------------------------------------
# 2. torchao's CPU-offload AdamW after a resume: every parameter takes the scheduled learning rate

class FakeStream:
    """What CPUOffloadOptimizer uses of a CUDA stream, done synchronously (the copies are CPU copies here)."""

    def wait_stream(self, stream):
        pass

    def record_event(self):
        return SimpleNamespace(synchronize=lambda: None)

    def synchronize(self):
        pass


@pytest.fixture
def cpu_offload(monkeypatch):
    """torchao's CPUOffloadOptimizer, built by train.configure_optimizer on the CPU. Faked: its check that a
    CUDA device exists, CUDA streams, and pinned memory (no allocator for it without CUDA)."""
    offload = pytest.importorskip('torchao.optim.cpu_offload', reason='torchao is not installed')
    monkeypatch.setattr(offload, 'get_available_devices', lambda: ['cpu', 'cuda'])
    monkeypatch.setattr(torch.cuda, 'Stream', FakeStream)
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, 'stream', lambda stream: contextlib.nullcontext())
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, 'empty_like', lambda *a, pin_memory=False, **k: empty_like(*a, **k))
    return lambda model: train.configure_optimizer(model, opt_cfg(optimizer_offload=True, grad_clip=0.0), 'cuda')


LRS = [1e-2, 8e-3, 5e-3, 2e-3, 1e-3, 4e-4]  # a schedule in which every step has its own learning rate


def test_offload_optimizer_resume_sets_every_learning_rate(cpu_offload):
    # Reference: the uninterrupted run. Resumed after 3 of 6 steps, every weight must end bitwise equal to
    # it; before the fix the norms (in torchao's inner on-GPU optimizer) kept the checkpoint's lr.
    opt_a, opt_b, differ = resume_matches_straight(cpu_offload, LRS, stop=3, grad_clip=0.0)
    assert type(opt_b).__name__ == 'CPUOffloadOptimizer'
    assert opt_b.d_opt is not None and len(opt_b.optim_dict) == 5  # the norms inside, the 5 matrices outside
    assert differ == []
    # and the lr the optimizers really read is this run's, in every one of them
    for opt in [opt_b.d_opt, *opt_b.optim_dict.values()]:
        assert [g['lr'] for g in opt.param_groups] == [LRS[-1]] * len(opt.param_groups)


def test_offload_optimizer_steps_as_torch_adamw(cpu_offload):
    # Reference: torch's AdamW with the same groups and settings (train.configure_optimizer without offload).
    # On the H100 the offload branch of Part 2 ended at loss 1.03 where fused AdamW ended at 0.16 (it runs
    # without gradient clipping); here, with CUDA's streams faked, the offload optimizer's arithmetic is AdamW's.
    data = batches(12)
    weights, types = [], []
    for make in (cpu_offload, lambda m: train.configure_optimizer(m, opt_cfg(grad_clip=0.0), 'cpu')):
        model = tiny_model()
        opt = make(model)
        for d in data:
            assert train.train_step(model, opt, NO_SCALER, d, 1, contextlib.nullcontext(), 0.0)[2]
        weights.append([p.detach().clone() for p in model.parameters()])
        types.append(type(opt).__name__)
    assert types == ['CPUOffloadOptimizer', 'AdamW']
    for (name, initial), a, b in zip(tiny_model().named_parameters(), *weights):
        assert not torch.equal(b, initial), name  # trained
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


class OffloadLike(torch.optim.Optimizer):
    """The structure of torchao's CPUOffloadOptimizer that decides where a learning rate lands, for machines
    without torchao: tensors under minimal_size in an inner optimizer d_opt built from dicts it keeps
    (d_param_groups), one optimizer per larger tensor (optim_dict), param_groups listing the kept dicts and
    then the per-tensor optimizers' groups, load_state_dict handing each inner optimizer its part."""

    def __init__(self, groups, minimal_size=4096, **kwargs):
        self.d_param_groups, self.optim_dict = [], {}
        for group in groups:
            params = group.pop('params')
            for p in params:
                if p.numel() >= minimal_size:
                    self.optim_dict[p] = torch.optim.AdamW([{'params': [p], **group}], **kwargs)
            small = [p for p in params if p.numel() < minimal_size]
            if small:
                self.d_param_groups.append({'params': small, **group})
        self.d_opt = torch.optim.AdamW(self.d_param_groups, **kwargs) if self.d_param_groups else None

    @property
    def param_groups(self):
        return sum((opt.param_groups for opt in self.optim_dict.values()), start=self.d_param_groups)

    def step(self, closure=None):
        for opt in [self.d_opt, *self.optim_dict.values()]:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in [self.d_opt, *self.optim_dict.values()]:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {'offloaded': [opt.state_dict() for opt in self.optim_dict.values()],
                'on-device': self.d_opt.state_dict()}

    def load_state_dict(self, state_dict):
        for opt, part in zip(self.optim_dict.values(), state_dict['offloaded']):
            opt.load_state_dict(part)
        self.d_opt.load_state_dict(state_dict['on-device'])


def test_offload_like_optimizer_resume_sets_every_learning_rate():
    # Reference: as above, the uninterrupted run, with an optimizer built like torchao's (checked against the
    # real one where torchao is installed); here it runs everywhere.
    def make(model):
        params = list(model.named_parameters())
        groups = [{'params': [p for n, p in params if p.dim() >= 2], 'weight_decay': 0.1},
                  {'params': [p for n, p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return OffloadLike(groups, lr=1e-2, betas=(0.9, 0.95))
    _, opt_b, differ = resume_matches_straight(make, LRS, stop=3)
    assert differ == []
    assert [g['lr'] for g in opt_b.d_opt.param_groups] == [LRS[-1]] * len(opt_b.d_opt.param_groups)


# ----------------------------------------------------------------------------------------------------
# 3. paged_adamw8bit after a resume: its state stays paged, no buffers leak

@pytest.fixture
def fake_pager(monkeypatch):
    """bitsandbytes' paged optimizer on the CPU. A paged buffer is what bitsandbytes' F.get_paged returns, a
    CPU tensor over CUDA managed memory flagged is_paged: here a CPU tensor flagged so, for tensors of >= 4096
    elements (bitsandbytes pages >= 1e5 on CUDA; the tiny model has none that large). Prefetching is a
    no-op; train.py's CUDA checks (a probe step on the GPU, free GPU memory) pass. Returns the list of every
    paged buffer made."""
    bnb = pytest.importorskip('bitsandbytes', reason='bitsandbytes is not installed')
    made = []

    def get_state_buffer(self, p, dtype=torch.float32):
        buf = torch.zeros_like(p, dtype=dtype)
        if self.is_paged and p.numel() >= 4096:
            buf.is_paged = True
            made.append(buf)
        return buf
    monkeypatch.setattr(bnb.optim.optimizer.Optimizer8bit, 'get_state_buffer', get_state_buffer)
    monkeypatch.setattr(bnb.functional, 'prefetch_tensor', lambda A, to_cpu=False: None)
    monkeypatch.setattr(train, 'import_bitsandbytes', lambda name, device_type: bnb)
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda *a: (1 << 40, 1 << 40))
    return made


def test_paged_optimizer_resumes_paged_without_leaking(fake_pager):
    # Reference: the uninterrupted run (bitwise equal weights after the resume), the number of paged tensors
    # of the state (two moments per matrix: each made once, in use, and no more), and the share of the
    # state's bytes in them computed from the shapes.
    make = lambda model: train.configure_optimizer(model, opt_cfg(optimizer='paged_adamw8bit'), 'cuda')  # noqa: E731
    made = fake_pager
    opt_a, opt_b, differ = resume_matches_straight(make, LRS, stop=3)
    assert type(opt_b).__name__ == 'PagedAdamW8bit'
    assert differ == []
    in_use = set()
    for opt in (opt_a, opt_b):
        matrices = [p for g in opt.param_groups for p in g['params'] if p.numel() >= 4096]
        assert len(matrices) == 5
        paged = [opt.state[p][k] for p in matrices for k in ('state1', 'state2')]
        assert all(getattr(t, 'is_paged', False) and t.dtype == torch.uint8 for t in paged)
        in_use |= {id(t) for t in paged}
    # every paged buffer made (by run A, then by the resumed run B) is in use: none leaked
    assert len(made) == len(in_use) == 2 * 2 * 5 and {id(t) for t in made} == in_use
    # where the state lives, as the start-up report and the log say it
    paged_bytes = 2 * sum(p.numel() for p in matrices)
    total = train.optimizer_state_bytes(opt_b)
    assert train.state_where(opt_b).startswith(f"{100 * paged_bytes / total:.3g}% paged CUDA managed memory, ")


def test_paged_resume_of_a_state_that_does_not_fit_is_an_error(fake_pager):
    # Reference: a checkpoint whose state for one matrix is 32-bit (not what paged_adamw8bit keeps for it)
    # must be refused with an error naming the optimizer, never copied into the 8-bit buffer with a cast.
    cfg = opt_cfg(optimizer='paged_adamw8bit')
    model = tiny_model()
    opt = train.configure_optimizer(model, cfg, 'cuda')
    train.train_step(model, opt, NO_SCALER, batches(1)[0], 1, contextlib.nullcontext(), 1.0)
    state = file_round_trip(train.optimizer_state(SimpleNamespace(cfg=cfg, optimizer=opt, model=model, device='cpu')))
    quant = state['state']['blocks.0.mlp.up.weight']['__bnb_optimizer_quant_state__']
    quant['state1'] = quant['state1'].float()
    resumed = train.configure_optimizer(model, cfg, 'cuda')
    with pytest.raises(train.TrainError, match=r'paged_adamw8bit \(state1: \(torch.float32'):
        train.load_optimizer_state(SimpleNamespace(cfg=cfg, optimizer=resumed, model=model), state)


# ----------------------------------------------------------------------------------------------------
# 4, 5. compile: DDP with activation checkpointing; out of memory in the warm-up

def warm_up_run(model, iter_num=0, world=1, **cfg):
    """What train.compile_model reads of a run: `model` on the CPU, compile on, one real batch for the training
    call and the evaluation."""
    x, y = batches(1)[0].next()
    return SimpleNamespace(cfg=opt_cfg(compile=True, **cfg), iter_num=iter_num, world=world, model=model,
                           wrapped=model, grad_views=False, device='cpu', device_type='cpu', accum_steps=1,
                           optimizer=train.configure_optimizer(model, opt_cfg(), 'cpu'),
                           batches=SimpleNamespace(next_batch=(x, y)), autocast=contextlib.nullcontext(),
                           eval_splits={'val': SimpleNamespace(eval_batches=lambda: iter([(x, y, 1)]))})


def compile_run(monkeypatch, world=1, parallelism='ddp', checkpointing='none', compiled=None, iter_num=0, **cfg):
    """train.compile_model on a tiny model with torch.compile replaced: it records Dynamo's optimize_ddp at
    the time of the call and returns `compiled` (default: the module itself, run eagerly)."""
    seen = {}

    def fake_compile(module, mode=None):
        seen['optimize_ddp'] = torch._dynamo.config.optimize_ddp
        return module if compiled is None else compiled
    monkeypatch.setattr(torch, 'compile', fake_compile)
    model = tiny_model()
    model.activation_checkpointing = checkpointing
    r = warm_up_run(model, iter_num, world, activation_checkpointing=checkpointing, parallelism=parallelism, **cfg)
    # NOTE: Dynamo's config, not monkeypatch: monkeypatch's undo would delete the key from Dynamo's config
    with torch._dynamo.config.patch(optimize_ddp=True):  # the default, restored after
        return seen, train.compile_model(r)


@pytest.mark.parametrize('world, parallelism, checkpointing, split', [
    (2, 'ddp', 'full', False), (2, 'ddp', 'selective', False), (2, 'ddp', 'none', True), (1, 'ddp', 'full', True),
    (2, 'fsdp', 'full', True)])
def test_ddp_graph_split_is_off_with_activation_checkpointing(monkeypatch, world, parallelism, checkpointing, split):
    # Reference: the issue's rule. Dynamo's DDP graph splitter cannot split checkpointed blocks, so under DDP
    # with activation checkpointing optimize_ddp must be off when torch.compile runs, and the start-up
    # report's compile line says so; everywhere else it is left on (it overlaps the all-reduce).
    seen, (model, note) = compile_run(monkeypatch, world, parallelism, checkpointing)
    assert seen['optimize_ddp'] is split
    assert note.startswith('on (mode default)')
    assert ('optimize_ddp off' in note) is (not split)


class Shapes(torch.nn.Module):
    """A compiled model that records the shape of each training call's input, then runs the model."""

    def __init__(self, model):
        super().__init__()
        self.model, self.shapes = model, []

    def forward(self, x, y=None, **kwargs):
        if self.training:
            self.shapes.append(tuple(x.shape))
        return self.model(x, y, **kwargs)


@pytest.mark.parametrize('iter_num, max_iters, want', [
    (0, 100, [(4, 16), (16, 4), (8, 8)]),  # every window, block_size first
    (3, 100, [(4, 16), (16, 4), (8, 8)]), (4, 100, [(4, 16), (8, 8)]),  # resumed: the windows still ahead
    (0, 2, [(4, 16), (16, 4)]),  # a run that ends in the first window
    (8, 100, [(4, 16)])])
def test_compile_warms_up_every_window_still_ahead(monkeypatch, iter_num, max_iters, want):
    # Reference: the windows by hand. block_size 16, short_block_size 4 doubled halfway through short_block_iters=8:
    # iterations 0-3 train on 4 tokens ((4, 16) reshaped to (16, 4)), 4-7 on 8, then 16. Each shape is compiled
    # before training, so that no step's time in the log includes a compile.
    model = Shapes(tiny_model())
    _, (compiled, note) = compile_run(monkeypatch, compiled=model, iter_num=iter_num, block_size=16,
                                      short_block_size=4, short_block_iters=8, max_iters=max_iters)
    assert compiled is model and model.shapes == want and note.startswith('on')


@pytest.mark.parametrize('batch_size, short_block_size, eval_iters, label_smoothing', [
    (1, 0, 2, 0.0), (1, 4, 2, 0.0), (3, 0, 2, 0.0), (3, 4, 2, 0.0), (3, 0, 2, 0.1),
    (1, 0, 0, 0.0), (3, 0, 0, 0.0), (3, 4, 0, 0.0)])  # eval_iters=0: every window of the val split: 28, the last of
# 10 batches of 3 holds one
def test_no_step_compiles_after_the_warm_up(tmp_path, monkeypatch, batch_size, short_block_size, eval_iters,
                                            label_smoothing):
    # Reference: Dynamo itself, which compiles a graph whenever a call fails the guards of those it has (a shape, a
    # stride, grad mode, an argument such as label_smoothing). A run's compiles all belong in compile_model's warm-up,
    # none in the training steps and evaluations after it (in the timed figures; a failure there would stop the run
    # instead of falling back to eager). Both once failed this: the warm-up reshaped a batch of one to (1,
    # block_size), another row stride, so the first step compiled again; it evaluated on a training batch, whose
    # stride the whole split's windows (eval_iters=0) do not share, nor its last batch's size.
    graphs, at_warm_up = [], []

    def counting_compile(module, mode=None):
        def backend(gm, example_inputs):  # Dynamo's graph as it is, run eagerly: no code generation
            graphs.append(gm)
            return gm.forward
        return real_compile(module, backend=backend)

    def warm_up(r):
        out = real_warm_up(r)
        at_warm_up.append(len(graphs))
        return out
    real_compile, real_warm_up = torch.compile, train.compile_model
    monkeypatch.setattr(torch, 'compile', counting_compile)
    monkeypatch.setattr(train, 'compile_model', warm_up)
    data = write_data(tmp_path / 'data')
    argv = ['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=16',
            f'--batch_size={batch_size}', f'--short_block_size={short_block_size}', '--short_block_iters=4',
            '--max_iters=8', '--eval_interval=4', f'--eval_iters={eval_iters}', f'--label_smoothing={label_smoothing}',
            '--compile=True', f'--data_dir={data}', f'--out_dir={tmp_path / "o"}']
    torch._dynamo.reset()
    try:
        code, out = main_capture(argv)
    finally:
        torch._dynamo.reset()
    assert code == 0 and 'compile           on' in out
    assert at_warm_up == [len(graphs)] and len(graphs) >= 2  # at least one for training, one for evaluation


class Raising:
    """A compiled model whose first call raises `error`."""

    def __init__(self, error):
        self.error = error

    def __call__(self, *args, **kwargs):
        raise self.error


def context_oom():
    """An out-of-memory error that another was raised while handling (its __context__, no `from`)."""
    try:
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.2 GiB free')
    except torch.OutOfMemoryError:
        try:
            raise RuntimeError('compiling the backward failed')
        except RuntimeError as outer:
            return outer


def wrapped_oom():
    """An out-of-memory error inside another, as torch.compile wraps errors of its backend."""
    try:
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.2 GiB free')
    except torch.OutOfMemoryError as e:
        try:
            raise RuntimeError("backend='inductor' raised:") from e
        except RuntimeError as outer:
            return outer


@pytest.mark.parametrize('error', [
    lambda: torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB'),
    lambda: RuntimeError('CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 79.1 GiB total)'),
    wrapped_oom, context_oom], ids=['OutOfMemoryError', 'RuntimeError', 'wrapped', 'context'])
def test_out_of_memory_in_compile_stops_with_advice(tmp_path, monkeypatch, capsys, error):
    # Reference: the advice the issue lists, in one line, and no fallback: no warning, no training.
    monkeypatch.setattr(torch, 'compile', lambda module, mode=None: Raising(error()))
    data = write_data(tmp_path / 'data')
    argv = ['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
            '--batch_size=4', '--eval_iters=2', '--max_iters=2', '--compile=True', f'--data_dir={data}',
            f'--out_dir={tmp_path / "o"}']
    with pytest.raises(train.TrainError) as e:
        main_capture(argv)
    message = str(e.value)
    assert '\n' not in message and 'out of memory' in message and 'CUDA out of memory. Tried to allocate' in message
    for advice in ('batch_size=4', 'gradient_accumulation_steps', 'activation_checkpointing'):  # (bench.py: on CUDA)
        assert advice in message, advice
    assert 'UNCOMPILED' not in capsys.readouterr().err
    assert not os.path.exists(tmp_path / 'o' / 'metrics.jsonl')


class FailsInEval:
    """A compiled model that trains (the module itself, eagerly) but fails in eval mode: the compile warm-up
    fails after its backward."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        if not self.module.training:
            raise RuntimeError('inductor: lowering the eval graph failed')
        return self.module(*args, **kwargs)

    def eval(self):
        self.module.eval()
        return self

    def train(self, mode=True):
        self.module.train(mode)
        return self


@pytest.mark.parametrize('fails', [False, True], ids=['compiled', 'fallback-after-backward'])
def test_compile_warm_up_leaves_no_trace(monkeypatch, capsys, fails):
    # Reference: the model, its gradients and the RNG as they were before compile_model (a model with dropout
    # 0.2, whose training forward draws from the RNG). The warm-up's backward and its eval call must leave
    # nothing behind, compiled or not: no gradient for the first step to add to, the model in training mode
    # (dropout on), the same random draws next.
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64, dropout=0.2))
    monkeypatch.setattr(torch, 'compile', lambda module, mode=None: FailsInEval(module) if fails else module)
    r = warm_up_run(model)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    compiled, note = train.compile_model(r)
    assert note.startswith('FAILED') if fails else note.startswith('on')
    assert ('UNCOMPILED' in capsys.readouterr().err) is fails
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(p.grad is None for p in model.parameters())


def test_other_compile_failures_still_fall_back_loudly(monkeypatch, capsys):
    # Reference: the documented behaviour for a compile failure that is not out of memory, and the error that compile
    # raised, its type and its text: the warning is all a user has to act on (file a bug, change compile_mode);
    # 'UNCOMPILED' alone does not say why.
    _, (model, note) = compile_run(monkeypatch, compiled=Raising(RuntimeError('inductor: lowering failed')))
    assert note.startswith('FAILED') and isinstance(model, GPT)
    err = capsys.readouterr().err
    assert 'UNCOMPILED' in err and 'RuntimeError: inductor: lowering failed' in err


class FailsInBackward:
    """A compiled model whose training call runs the module eagerly but whose backward fails at the token
    embedding's output, after the gradients of every layer above it have been accumulated (as a compiled
    backward that fails in one of several graphs would: the later graphs' gradients are in place by then)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        def boom(grad):
            raise RuntimeError('inductor: compiling the backward graph failed')

        def hook(mod, inputs, output):
            output.register_hook(boom)
        handle = self.module.wte.register_forward_hook(hook)
        try:
            return self.module(*args, **kwargs)
        finally:
            handle.remove()


def test_compile_failure_in_the_backward_leaves_no_gradient(monkeypatch, capsys):
    # Reference: the model's gradients before compile_model (none). A warm-up whose backward fails after some
    # gradients were accumulated falls back to eager, and the first step (train_step zeroes gradients only after
    # its update) must start from none: leftovers would be added to its gradient.
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64))
    monkeypatch.setattr(torch, 'compile', lambda module, mode=None: FailsInBackward(module))
    r = warm_up_run(model)
    compiled, note = train.compile_model(r)
    assert note.startswith('FAILED') and compiled is model
    assert 'UNCOMPILED' in capsys.readouterr().err
    assert model.training and all(p.grad is None for p in model.parameters())


class DrawsOnTheGpu(torch.nn.Module):
    """A compiled model that runs the module and, at each call, advances the (faked) CUDA generator of device 0, as
    dropout on the GPU draws from it."""

    def __init__(self, module, rng):
        super().__init__()
        self.module, self.rng = module, rng

    def forward(self, *args, **kwargs):
        self.rng.states[0] = self.rng.states[0] + 1
        return self.module(*args, **kwargs)


def test_compile_warm_up_leaves_the_gpus_rng_as_it_was(monkeypatch):
    # Reference: the CUDA generator's state before compile_model (CUDA faked: FakeCudaRng). The warm-up's dropout
    # draws on the GPU must not shift the run's random draws there (a resumed run repeats its draws), as on the CPU
    # (test_cuda's test_compile_warm_up_leaves_no_trace).
    rng = FakeCudaRng(monkeypatch, 1)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64))
    monkeypatch.setattr(torch, 'compile', lambda module, mode=None: DrawsOnTheGpu(module, rng))
    r = warm_up_run(model)
    r.device, r.device_type = 'cuda:0', 'cuda'  # (the model and its batches stay on the CPU)
    before = torch.cuda.get_rng_state('cuda:0')
    _, note = train.compile_model(r)
    assert note.startswith('on') and torch.equal(torch.cuda.get_rng_state('cuda:0'), before)


# ----------------------------------------------------------------------------------------------------
# 6. peak FLOP/s by device name

T = 1e12
# name as torch.cuda.get_device_name returns it -> (bf16, fp8) dense peak in TFLOP/s from the datasheets
# (the sparse headline figures halved), None where the card is not known or has no FP8
DEVICES = {
    'NVIDIA H100 80GB HBM3': (989.5, 1979), 'NVIDIA H100 PCIe': (756.5, 1513), 'NVIDIA H100 NVL': (835.5, 1670.5),
    'NVIDIA H200': (989.5, 1979), 'NVIDIA H200 NVL': (835.5, 1670.5), 'NVIDIA H800': (989.5, 1979),
    'NVIDIA H800 PCIe': (756.5, 1513), 'NVIDIA GH200 480GB': (989.5, 1979),
    'NVIDIA A100-SXM4-80GB': (312, None), 'NVIDIA A100-SXM4-40GB': (312, None), 'NVIDIA A100 80GB PCIe': (312, None),
    'NVIDIA A100-PCIE-40GB': (312, None), 'A100-SXM4-40GB': (312, None),  # older drivers: no 'NVIDIA '
    'NVIDIA L40S': (362.05, 733), 'NVIDIA L40': (181.05, 362), 'NVIDIA L4': (121, 242.5),
    'NVIDIA GeForce RTX 4090': (165.2, 330.3),
    # not in the table: no MFU rather than another card's
    'NVIDIA GeForce RTX 3090': (None, None), 'Tesla V100-SXM2-16GB': (None, None), 'NVIDIA A10G': (None, None),
    'NVIDIA A10': (None, None), 'NVIDIA A40': (None, None), 'NVIDIA GeForce RTX 4090 D': (None, None),
    'NVIDIA GeForce RTX 4090 Laptop GPU': (None, None), 'NVIDIA H100 80GB HBM3 MIG 1g.10gb': (None, None),
    'NVIDIA A100-SXM4-40GB MIG 3g.20gb': (None, None), 'NVIDIA B200': (None, None),
}


@pytest.mark.parametrize('name', DEVICES)
def test_peak_flops_by_device_name(monkeypatch, name):
    # Reference: the dense peaks of the vendors' datasheets and the Ada whitepaper (RTX 4090: bf16 with
    # fp32 accumulate), typed in here; float32 matmuls run as TF32 at half the bf16 peak. Each device's own: a
    # node whose second GPU is an A100 (a process of torchrun on cuda:1 gets the A100's peak)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_name',
                        lambda device=None: 'NVIDIA A100-SXM4-80GB' if torch.device(device).index == 1 else name)
    bf16, fp8 = DEVICES[name]
    approx = lambda x: None if x is None else pytest.approx(x * T, rel=1e-9)  # noqa: E731
    assert model_module.peak_flops('cuda', 'bfloat16') == approx(bf16)
    assert model_module.peak_flops('cuda:0', 'float16') == approx(bf16)
    assert model_module.peak_flops('cuda:1', 'bfloat16') == approx(312)
    assert model_module.peak_flops('cuda', 'float32') == approx(None if bf16 is None else bf16 / 2)
    assert model_module.peak_flops('cuda', 'float8') == approx(fp8)
    assert model_module.peak_flops('cpu', 'bfloat16') is None


@pytest.mark.parametrize('flags, windows', [((), [8, 8]),
                                             (('--short_block_size=2', '--short_block_iters=4'), [2, 2, 4, 4, 8, 8]),
                                             (('--fp8=True',), [8, 8])],
                         ids=['whole', 'short windows', 'fp8'])
def test_mfu_is_logged_with_the_peak_it_is_against(tmp_path, monkeypatch, flags, windows):
    # Reference: the metrics line's own tokens/s and the model's FLOPs per token, at the window the step trained
    # on, over a peak given here (the CPU has none, so one is faked for float32, low enough that the percent shows:
    # some 0.3% here; and FP8's at 4x); the log line and the report name the TF32 peak, and the log line gives the
    # logged MFU in percent. The windows by hand: block_size 8, or short_block_size 2 doubled halfway through
    # short_block_iters=4 (iterations 1, 2 train on 2 tokens, 3, 4 on 4), whole from there; the attention FLOPs of a
    # token grow with its window, so another window's FLOPs give another MFU. An FP8 run's MFU is against its
    # autocast dtype's peak, not FP8's (torchtitan's convention: FP8 and bf16 runs on one scale), as its report line
    # says; its layers are stood in for by none (the CPU has no FP8 matmul): the MFU is train.py's arithmetic alone.
    peaks = {'float32': 1e11, 'float8': 4e11}
    monkeypatch.setattr(model_module, 'peak_flops', lambda device, dtype='bfloat16': peaks.get(dtype))
    monkeypatch.setattr(train, 'peak_flops', model_module.peak_flops)
    monkeypatch.setattr(train, 'convert_to_fp8', lambda model, recipe, device: [])
    data = write_data(tmp_path / 'data')
    code, out = main_capture(['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=16',
                              '--block_size=8', '--batch_size=4', '--eval_iters=2', f'--max_iters={len(windows)}',
                              '--log_interval=1', *flags, f'--data_dir={data}', f'--out_dir={tmp_path / "o"}'])
    assert code == 0
    fp8 = "; this FP8 run's too, not of the FP8 peak (0.4 TFLOP/s)" if '--fp8=True' in flags else ''
    assert f'MFU               of the TF32 peak, 0.1 TFLOP/s (cpu){fp8}\n' in out
    ckpt = train.load_checkpoint(str(tmp_path / 'o' / 'ckpt.pt'))
    model = GPT(GPTConfig(**ckpt['model_args']))
    records = [r for r in read_metrics(tmp_path / 'o') if 'loss' in r]
    assert [r['iter'] for r in records] == list(range(1, len(windows) + 1))
    for record, window in zip(records, windows):
        want = model.flops_per_token(window) * record['tokens_per_sec'] / peaks['float32']
        assert record['mfu'] == pytest.approx(want, rel=1e-12), record['iter']
    printed = [float(m) for m in re.findall(r'^iter \d+: loss .*, mfu ([\d.]+)% of TF32 peak, ', out, re.M)]
    assert printed == [round(100 * r['mfu'], 1) for r in records] and min(printed) > 0, printed


# ----------------------------------------------------------------------------------------------------
# 7. the host waits for the GPU once per optimizer step

class HostReads(TorchDispatchMode):
    """Records the ops that make the host wait for the device: reading a tensor's value on the host (.item(),
    bool(), float(): _local_scalar_dense), and those whose output size depends on the values (nonzero, boolean-mask
    indexing). On the CPU they cost nothing, so nothing else shows them there; .tolist(), .numpy() and .cpu() run
    no op there, so only the GPU test below sees those. Not while `paused` is set."""
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
    INDEX = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}

    def __init__(self):
        super().__init__()
        self.reads, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = func in self.INDEX and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if not self.paused and (func in self.READS or masks):
            self.reads.append('read')
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('setting', ['adamw', 'label_smoothing', 'grad_clip=0', 'bf16', 'checkpointing', 'muon',
                                     'fp16'])
def test_a_step_reads_device_values_after_its_micro_steps(setting):
    # Reference: train_step's promise, one host-device sync per optimizer step (whether the step was finite, which
    # decides if the optimizer steps) and none per micro-step: a GPU keeps its queue of kernels full only if the
    # host never waits for it in between. fp16's GradScaler adds three of its own: its scale, before and after
    # the step (a lower one means it skipped the step), and its found-inf flag in scaler.step. Recorded in order
    # with each micro-batch drawn, over 3 steps of 3 micro-batches of a model whose loss runs in 4 chunks (label
    # smoothing: its second branch), in each setting that changes the step's code. AdamW's own step is left out:
    # torch's reads its step counters with .item(), tensors that stay on the host on a GPU too, and fused AdamW
    # (train.py's on CUDA) reads none.
    model = tiny_model()
    model.loss_chunk_tokens = 16  # 4 x 16 tokens per micro-batch
    model.activation_checkpointing = 'full' if setting == 'checkpointing' else 'none'
    optimizer = train.configure_optimizer(model, opt_cfg(optimizer='muon' if setting == 'muon' else 'adamw'), 'cpu')
    counter = HostReads()

    def paused(step):
        def run(*args, **kwargs):
            counter.paused = True
            try:
                return step(*args, **kwargs)
            finally:
                counter.paused = False
        return run
    for o in train.optimizers(optimizer):  # Muon's own step (Newton-Schulz) is counted
        if isinstance(o, torch.optim.AdamW):
            o.step = paused(o.step)
    micro = batches(1)[0]
    drawn = SimpleNamespace(next=lambda: (counter.reads.append('micro-batch'), micro.next())[1])
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(setting)
    autocast = torch.autocast('cpu', dtype=dtype) if dtype else contextlib.nullcontext()
    scaler = torch.amp.GradScaler('cpu', enabled=setting == 'fp16')
    with counter:
        for _ in range(3):
            _, _, ok = train.train_step(model, optimizer, scaler, drawn, 3, autocast,
                                        0.0 if setting == 'grad_clip=0' else 1.0,
                                        0.1 if setting == 'label_smoothing' else 0.0)
            assert ok
    assert counter.reads == (['micro-batch'] * 3 + ['read'] * (4 if setting == 'fp16' else 1)) * 3


class GraphMemoryLinear(torch.autograd.Function):
    """x @ w.T whose weight gradient is handed out as a CUDA graph replay hands out its outputs: a view of one
    buffer that the next replay (here: the next forward) writes over."""
    @staticmethod
    def forward(ctx, x, w, buffer):
        buffer.fill_(float('nan'))  # the replay's memory reused
        ctx.save_for_backward(x, w)
        ctx.buffer = buffer
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        ctx.buffer.copy_(grad.flatten(0, -2).t() @ x.flatten(0, -2))
        return grad @ w, ctx.buffer.view_as(ctx.buffer), None


class GraphMemoryModel(torch.nn.Module):
    """A linear regression whose weight gradient lives in graph memory (graphed=True), or in memory of its own."""
    def __init__(self, graphed):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        self.graphed, self.buffer = graphed, torch.empty(3, 4)

    def forward(self, x, y, label_smoothing=0.0):
        out = GraphMemoryLinear.apply(x, self.weight, self.buffer) if self.graphed else x @ self.weight.t()
        return None, ((out - y) ** 2).mean()


@pytest.mark.parametrize('copied', [False, True])
def test_accumulated_gradients_survive_cuda_graph_memory(copied):
    # Reference: the same steps with gradients in memory of their own. Under CUDA graphs the backward's outputs
    # live in the graphs' memory, which the next micro-step's forward overwrites, and autograd keeps the first
    # gradient of a step as the parameter's .grad (pytorch/pytorch#169545): accumulated over 3 micro-steps, the
    # gradient is then wrong without the copy of train.gradients_out_of_cuda_graphs, and right with it.
    data = torch.Generator().manual_seed(1)
    micro = [(torch.randn(2, 5, 4, generator=data), torch.randn(2, 5, 3, generator=data)) for _ in range(6)]
    weights = {}
    for graphed in (False, True):
        model = GraphMemoryModel(graphed)
        if graphed and copied:
            assert train.gradients_out_of_cuda_graphs(model, 'reduce-overhead', 'cuda', 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = SimpleNamespace(next=iter(micro).__next__)
        for _ in range(2):
            _, _, ok = train.train_step(model, optimizer, NO_SCALER, batches, 3, contextlib.nullcontext(), 0.0)
            assert ok
        weights[graphed] = model.weight.detach()
    assert torch.allclose(weights[True], weights[False], rtol=0, atol=1e-6) == copied, weights


@pytest.mark.parametrize('mode, device_type, accum_steps, applies', [
    ('reduce-overhead', 'cuda', 2, True), ('max-autotune', 'cuda', 2, True),
    ('max-autotune-no-cudagraphs', 'cuda', 2, False), ('default', 'cuda', 2, False),
    ('reduce-overhead', 'cpu', 2, False), ('reduce-overhead', 'cuda', 1, False)])
def test_gradients_are_copied_only_under_cuda_graphs_with_accumulation(mode, device_type, accum_steps, applies):
    # Reference: torch.compile's documented modes (only reduce-overhead and max-autotune record CUDA graphs, and
    # only on CUDA); without accumulation every gradient is used before the next forward: nothing to copy.
    model = GraphMemoryModel(graphed=False)
    assert train.gradients_out_of_cuda_graphs(model, mode, device_type, accum_steps) == applies
    assert bool(model.weight._backward_hooks) == applies


class Joined(Exception):
    """Raised where main() would join the other processes: every check before it passed."""


@pytest.mark.parametrize('flags, refused', [
    (['--parallelism=fsdp', '--compile_mode=reduce-overhead', '--gradient_accumulation_steps=4'], True),
    (['--parallelism=fsdp', '--compile_mode=max-autotune', '--gradient_accumulation_steps=4'], True),
    (['--parallelism=fsdp', '--compile_mode=max-autotune-no-cudagraphs', '--gradient_accumulation_steps=4'], False),
    (['--parallelism=fsdp', '--compile_mode=reduce-overhead', '--gradient_accumulation_steps=2'], False),
    (['--parallelism=ddp', '--compile_mode=reduce-overhead', '--gradient_accumulation_steps=4'], False)])
def test_fsdp_refuses_cuda_graphs_with_accumulation(monkeypatch, flags, refused):
    # Reference: where the kept gradients live. FSDP2 accumulates into the gradients of its unsharded parameters,
    # out of reach of gradients_out_of_cuda_graphs' hooks on the sharded ones, so a CUDA graph's next replay would
    # overwrite them: refused, before any process joins. Without CUDA graphs, with one micro-batch per process
    # (2 over 2), or under DDP (where the hooks apply), the run goes on to join the others.
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setattr(train, 'pick_device', lambda name: 'cuda')
    monkeypatch.setattr(torch.cuda, 'set_device', lambda device: None)

    def join(*args, **kwargs):
        raise Joined
    monkeypatch.setattr(train.dist, 'init_process_group', join)
    with pytest.raises(train.ConfigError if refused else Joined) as e:
        train.main(['--compile=True', *flags])
    mode = flags[1].split('=')[1]
    if refused:
        assert str(e.value).startswith(f"compile_mode={mode!r} records CUDA graphs"), e.value
        assert "use compile_mode='default' or 'max-autotune-no-cudagraphs'" in str(e.value)


# ====================================================================================================
# Part 2: on a CUDA GPU

gpu = pytest.mark.skipif(not CUDA, reason='needs a CUDA GPU')
SMALL = ['--n_layer=4', '--n_head=4', '--n_embd=256', '--block_size=256', '--batch_size=16']
# FP8 converts only layers large enough to gain (train.fp8_layer_filter): rowwise needs N > 4096 or K > 2048
WIDE = ['--n_layer=2', '--n_head=16', '--n_embd=2048', '--block_size=256', '--batch_size=8']
COMMON = ['--device=cuda', '--max_iters=24', '--eval_interval=12', '--eval_iters=4', '--log_interval=1',
          '--warmup_iters=4', '--lr_decay_iters=24', '--learning_rate=3e-3', '--min_lr=3e-4', '--dropout=0.0']
BRANCHES = {  # name: (flags, modules it needs, what the start-up report must say)
    'bf16 + fused AdamW': (SMALL + ['--dtype=bfloat16'], (), ['precision         bfloat16', 'fused AdamW']),
    'fp16 + GradScaler': (SMALL + ['--dtype=float16'], (), ['precision         float16', 'GradScaler on']),
    'compile default': (SMALL + ['--compile=True'], (), []),
    'compile reduce-overhead': (SMALL + ['--compile=True', '--compile_mode=reduce-overhead'], (), []),
    'adamw8bit': (SMALL + ['--optimizer=adamw8bit'], ('bitsandbytes',), []),
    'paged_adamw8bit': (SMALL + ['--optimizer=paged_adamw8bit'], ('bitsandbytes',), []),
    'muon': (SMALL + ['--optimizer=muon'], (), []),
    'optimizer_offload': (SMALL + ['--optimizer_offload=True', '--grad_clip=0'], ('torchao',),
                          ['stepped on the CPU (torchao)']),
    'bf16 + fused AdamW, grad_clip=0': (SMALL + ['--grad_clip=0'], (), ['fused AdamW']),  # offload's reference
    'fp8 tensorwise + compile': (WIDE + ['--fp8=True', '--fp8_recipe=tensorwise', '--compile=True',
                                         '--learning_rate=1e-3'], ('torchao',), ['fp8               tensorwise: ']),
    'fp8 rowwise + compile': (WIDE + ['--fp8=True', '--fp8_recipe=rowwise', '--compile=True', '--learning_rate=1e-3'],
                              ('torchao',), ['fp8               rowwise: ']),
    'act. ckpt full + compile': (SMALL + ['--activation_checkpointing=full', '--compile=True'], (), []),
    'act. ckpt selective + compile': (SMALL + ['--activation_checkpointing=selective', '--compile=True'], (), []),
}
# Relative tolerance of a resumed run's losses against the uninterrupted run's. The runs are in one process
# with deterministic algorithms on (torch.use_deterministic_algorithms, cuBLAS workspace fixed above), so
# the same kernels see the same inputs: bit for bit is expected everywhere; the summary shows the difference.
RESUME_TOL = 0.0
SUMMARY = []


@pytest.fixture(scope='module')
def gpu_data(tmp_path_factory):
    """A char-level dataset of 64 ids: a random sequence of 97 repeated (learnable in a few dozen steps)."""
    return write_data(tmp_path_factory.mktemp('cuda') / 'data', vocab=64, period=97, n_train=300_000, n_val=30_000)


@pytest.fixture(scope='module', autouse=True)
def summary(request):
    """After the module: the table of SUMMARY to the terminal and, when $OUT is set, to $OUT/test_cuda_summary.md."""
    yield
    if not SUMMARY:
        return
    lines = [f"test_cuda.py on {torch.cuda.get_device_name()}, torch {torch.__version__}", '',
             '| branch | loss first -> last | resumed vs straight (max rel. diff of losses) | peak MB | seconds |',
             '|---|---|---|---|---|']
    lines += [f"| {r['branch']} | {r['first']:.4f} -> {r['last']:.4f} | {r['diff']} | {r['peak']} | "
              f"{r['seconds']:.0f} |" for r in SUMMARY]
    text = '\n'.join(lines) + '\n'
    capture = request.config.pluginmanager.getplugin('capturemanager')  # shown even when the tests pass
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print('\n' + text)
    if os.environ.get('OUT'):
        worker = os.environ.get('PYTEST_XDIST_WORKER')  # under pytest -n: one file per worker
        name = f"test_cuda_summary{'-' + worker if worker else ''}.md"
        with open(os.path.join(os.environ['OUT'], name), 'w') as f:
            f.write(text)


@pytest.fixture
def deterministic_cuda():
    """Deterministic kernels while the test runs (index_add, cuBLAS, ...): a resumed run and the uninterrupted one
    then compute alike. warn_only: an op without such a kernel warns and runs as it is (cuDNN's attention stays
    eligible, by torch's sdp_utils; the runs have matched exactly so far). train.py's deterministic=True is strict:
    test_deterministic_runs_repeat_bit_for_bit_on_the_gpu."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def gpu_run(argv):
    """train.main(argv) in this process, from a fresh Dynamo (no recompile limit across runs); returns
    (stdout, Dynamo's graph breaks, seconds)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    code, out = main_capture(argv)
    assert code == 0, out[-3000:]
    return out, dict(torch._dynamo.utils.counters['graph_break']), time.time() - t0


def straight_and_resumed(tmp_path, monkeypatch, data, flags):
    """The uninterrupted run of 24 iterations, its checkpoint of iteration 12 kept aside, and a run resumed
    from that checkpoint to 24. Returns both runs' (stdout, graph breaks, seconds, metrics)."""
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    save = train.save_checkpoint

    def save_and_keep_12(path, state):
        save(path, state)
        if state['iter_num'] == 12 and path.endswith('ckpt.pt'):
            os.makedirs(resumed, exist_ok=True)
            shutil.copy(path, resumed / 'ckpt.pt')
    monkeypatch.setattr(train, 'save_checkpoint', save_and_keep_12)
    argv = COMMON + flags + [f'--data_dir={data}']
    a = gpu_run(argv + [f'--out_dir={straight}'])
    assert (resumed / 'ckpt.pt').exists()
    b = gpu_run(argv + [f'--out_dir={resumed}', '--init_from=resume'])
    return [(*run, read_metrics(out)) for run, out in ((a, straight), (b, resumed))]


def losses(metrics, after=0):
    return {(r['iter'], k): r[k] for r in metrics if r['iter'] > after for k in ('loss', 'val_loss') if k in r}


@gpu
@pytest.mark.parametrize('branch', BRANCHES)
def test_branch_trains_and_resumes(branch, tmp_path, monkeypatch, gpu_data, deterministic_cuda):
    # Reference: the uninterrupted run. The resumed run's losses from iteration 13 on must equal its losses
    # (RESUME_TOL); the loss must fall; compile must be on with no graph break; peak memory and MFU logged.
    flags, needs, says = BRANCHES[branch]
    for module in needs:
        pytest.importorskip(module, reason=f'{branch} needs {module}')
    (out_a, breaks_a, sec_a, m_a), (out_b, breaks_b, sec_b, m_b) = straight_and_resumed(tmp_path, monkeypatch,
                                                                                        gpu_data, flags)
    train_a = [r for r in m_a if 'loss' in r]
    want, got = losses(m_a, after=12), losses(m_b, after=12)
    diff = max(abs(got[k] - want[k]) / abs(want[k]) for k in want) if got.keys() == want.keys() else math.inf
    peak = max(r['peak_mem_mb'] for r in train_a)
    SUMMARY.append(dict(branch=branch, first=train_a[0]['loss'], last=train_a[-1]['loss'], peak=f'{peak:,.0f}',
                        diff='exact' if diff == 0 else f'{diff:.2e}', seconds=sec_a + sec_b))

    iters = [r['iter'] for r in train_a]  # fp16: the GradScaler's first steps may overflow, skipped, unlogged
    assert iters == sorted(set(iters)) and iters[-1] == 24 and len(iters) >= (20 if '--dtype=float16' in flags else 24)
    assert all(math.isfinite(r['loss']) for r in train_a)
    assert train_a[-1]['loss'] < 0.5 * train_a[0]['loss'], [r['loss'] for r in train_a]
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    assert diff <= RESUME_TOL, f"resumed vs straight: max relative difference {diff:.3g}\n{got}\n{want}"
    assert 'resuming from' in out_b and 'at iteration 12' in out_b
    assert all(r['peak_mem_mb'] > 0 for r in train_a) and 'peak mem' in out_a
    assert all(r['mfu'] is None or 0 < r['mfu'] < 1 for r in train_a)
    if model_module.peak_flops('cuda', 'bfloat16'):
        assert all(r['mfu'] is not None for r in train_a)
        assert ('of fp16 peak' if '--dtype=float16' in flags else 'of bf16 peak') in out_a
    for words in says:
        assert words in out_a, words
    if '--compile=True' in flags:
        for out, breaks in ((out_a, breaks_a), (out_b, breaks_b)):
            assert '  compile           on (mode' in out, out[:5000]
            assert breaks == {}, breaks
    if '--fp8=True' in flags:
        line = next(ln for ln in out_a.splitlines() if ln.startswith('  fp8 '))
        assert 'none large enough' not in line and ' 0 linear layers' not in line, line
    if branch == 'paged_adamw8bit':  # the resumed run's state is where a new run's is: paged
        for out in (out_a, out_b):
            line = next(ln for ln in out.splitlines() if ln.startswith('optimizer state: '))
            assert 'paged CUDA managed memory' in line, line
        line = next(ln for ln in out_b.splitlines() if ln.startswith('  optimizer state '))
        assert 'paged CUDA managed memory' in line and 'from the first step' not in line, line


@gpu
def test_cuda_graphs_with_accumulation_train_as_compile_default(tmp_path, gpu_data, deterministic_cuda):
    # Reference: compile's default mode, the same kernels without CUDA graphs, 2 micro-steps per step. Under
    # reduce-overhead the first micro-step's gradients were kept in the graphs' memory, overwritten by the second
    # forward (pytorch/pytorch#169545): an error, or other losses. The copy must leave the losses as they are.
    runs, outs = {}, {}
    for mode in ('default', 'reduce-overhead'):
        out_dir = tmp_path / mode
        outs[mode], breaks, seconds = gpu_run(COMMON + SMALL + [
            '--compile=True', f'--compile_mode={mode}', '--gradient_accumulation_steps=2',
            f'--data_dir={gpu_data}', f'--out_dir={out_dir}'])
        assert breaks == {}, breaks
        # CUDA graphs recorded (else the comparison shows nothing): inductor counts each graph it leaves without
        skips = torch._dynamo.utils.counters['inductor']['cudagraph_skips']
        assert skips == 0, f"{mode}: {skips} graphs without CUDA graphs"
        runs[mode] = losses(read_metrics(out_dir))
    assert "first gradients copied out of the CUDA graphs" in outs['reduce-overhead']
    assert "copied out" not in outs['default']
    want, got = runs['default'], runs['reduce-overhead']
    assert got.keys() == want.keys() and len(want) >= 24, (sorted(got), sorted(want))
    diff = max(abs(got[k] - want[k]) / abs(want[k]) for k in want)
    trained = [v for (it, k), v in sorted(want.items()) if k == 'loss']
    SUMMARY.append(dict(branch='compile reduce-overhead, accumulation 2 (vs default)', first=trained[0],
                        last=trained[-1], peak='', diff='exact' if diff == 0 else f'{diff:.2e}', seconds=seconds))
    assert trained[-1] < 0.5 * trained[0], trained
    assert diff <= 1e-4, f"reduce-overhead vs default: max relative difference {diff:.3g}\n{got}\n{want}"


@gpu
def test_deterministic_runs_repeat_bit_for_bit_on_the_gpu(tmp_path, gpu_data):
    # Reference: the first run. With deterministic=True (torch's deterministic algorithms, strict: flash attention's
    # backward, inductor's scatter of the embedding's gradient and cuBLAS in a fixed order; an op without such a
    # kernel is an error naming it), a second run of the same compiled bf16 command, dropout on, must end with the
    # same weights and optimizer state bit for bit, and leave torch's setting as it was.
    assert not torch.are_deterministic_algorithms_enabled()
    ckpts, seconds = [], 0.0
    for run in 'ab':
        out, breaks, sec = gpu_run(COMMON + SMALL + ['--dtype=bfloat16', '--compile=True', '--deterministic=True',
                                                     '--dropout=0.1', '--max_iters=8', '--eval_interval=8',
                                                     f'--data_dir={gpu_data}', f'--out_dir={tmp_path / run}'])
        assert breaks == {} and not torch.are_deterministic_algorithms_enabled(), breaks
        ckpts.append(torch.load(tmp_path / run / 'ckpt.pt', weights_only=True))
        seconds += sec
    trained = [r['loss'] for r in read_metrics(tmp_path / 'a') if 'loss' in r]
    assert ckpts[0]['iter_num'] == 8 and trained[-1] < trained[0], trained
    assert_same(ckpts[1]['model'], ckpts[0]['model'], 'model')
    assert_same(ckpts[1]['optimizer'], ckpts[0]['optimizer'], 'optimizer')
    SUMMARY.append(dict(branch='deterministic=True, compiled bf16 (run b vs a)', first=trained[0], last=trained[-1],
                        peak='', diff='exact', seconds=seconds))


@gpu
def test_bench_peak_memory_under_cuda_graphs_counts_their_activations(tmp_path):
    # Reference: the bytes saved for backward that bench.py counts itself (activation_mb, saved-tensor hooks): a
    # training step's peak holds at least one micro-step's activations. CUDA graphs allocate theirs while
    # recording, in the warm-up, and reuse them unallocated: a peak over the timed steps alone (1,898 MB at 124M
    # on an H100, against 9,701 MB without graphs and 6,128 MB of activations) missed them. And each rung's peak
    # is its own: full checkpointing (rung 9), run after rung 8, still shows the memory it saves.
    import bench

    def ladder(rungs):
        out = tmp_path / rungs
        torch._dynamo.utils.counters.clear()
        assert bench.main(['--preset=small', f'--rungs={rungs}', '--compile_mode=reduce-overhead', '--batch_size=256',
                           '--gradient_accumulation_steps=2', '--steps=2', '--repeats=1', '--data_dir=no-such-dir',
                           f'--out={out}']) == 0
        with open(out / 'bench.json') as f:
            result = json.load(f)
        assert 'records the CUDA graphs' in result['memory']
        return {r['rung']: r for r in result['rungs'] if r['status'] == 'ok'}

    row = ladder('8')[8]
    skips = torch._dynamo.utils.counters['inductor']['cudagraph_skips']
    assert skips == 0, f"{skips} graphs without CUDA graphs: the peak would hold the activations anyway"
    assert row['peak_mem_mb'] >= row['activation_mb'] > 0, row
    rows = ladder('8,9')
    assert sorted(rows) == [8, 9], rows
    assert rows[9]['activation_mb'] < rows[8]['activation_mb'] / 2, rows
    assert rows[9]['peak_mem_mb'] < rows[8]['peak_mem_mb'], rows


@gpu
def test_bench_profile_finds_what_launched_each_idle_gap(tmp_path):
    # Reference: the profiler's own links. Each of the longest idle gaps names the host call that launched the
    # kernel after it (a kernel's linked_correlation_id is its launcher's id: bench.idle_gaps); a wrong link names
    # none, 'not known'. Two steps: the gap between them ends at the second step's first kernel. The idle time is
    # the gaps between kernels plus what comes before the first and after the last.
    import bench
    assert bench.main(['--preset=small', '--mode=profile', '--rungs=7', '--steps=2', '--data_dir=no-such-dir',
                       f'--out={tmp_path}']) == 0
    text = (tmp_path / 'profile.md').read_text()

    def ms(what):
        return float(re.search(rf'^\| {what} [^|]*\| ([\d,.]+) \|', text, re.M).group(1).replace(',', ''))
    idle, between, edges = ms('device idle'), ms('of which between'), ms('of which before')
    assert idle == pytest.approx(between + edges, abs=0.11), text
    gaps = re.findall(r'^\| [\d,.]+ \| `([^`]+)` \| `([^`]+)` \|$', text, re.M)
    assert gaps, text
    assert all(calls != 'not known' for _, calls in gaps), text  # (2026-11-27's H100 profile: all 10 named)


@gpu
def test_a_float32_run_on_cuda_takes_tf32_matmuls(tmp_path, gpu_data):
    # Reference: torch's switch, read back: a CUDA run sets float32 matmuls to 'high' (README: "TF32 matmuls ... are
    # on for CUDA"), whatever the process had ('highest' here, torch's default); eager, one step
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    try:
        gpu_run(COMMON + SMALL + ['--dtype=float32', '--compile=False', '--max_iters=1', '--eval_interval=1',
                                  f'--data_dir={gpu_data}', f'--out_dir={tmp_path / "o"}'])
        assert torch.get_float32_matmul_precision() == 'high'
    finally:
        torch.set_float32_matmul_precision(precision)


@gpu
def test_sample_from_an_fp8_checkpoint(tmp_path, gpu_data):
    # Reference: sample.py's contract: num_samples rows of the prompt plus max_new_tokens characters of the
    # dataset's vocabulary, from a checkpoint trained with FP8 layers (saved as plain nn.Linear weights).
    pytest.importorskip('torchao', reason='FP8 needs torchao')
    import sample
    out_dir = tmp_path / 'fp8'
    gpu_run(COMMON + WIDE + ['--fp8=True', '--max_iters=4', f'--data_dir={gpu_data}', f'--out_dir={out_dir}'])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        sample.main([f'--out_dir={out_dir}', f'--start={chr(0x100)}', '--num_samples=2', '--max_new_tokens=50'])
    rows = [row for row in buf.getvalue().split('\n' + '-' * 80 + '\n') if row.strip()]
    vocab = {chr(0x100 + i) for i in range(64)}
    assert len(rows) == 2 and all(len(row) == 51 and set(row) <= vocab for row in rows), rows


@gpu
def test_sample_on_cuda_prints_the_cpus_greedy_text_and_seeds_its_draws(tmp_path, capsys):
    # Reference: greedy decoding on the CPU by GPT.generate, float32, from the same checkpoint: sample.py on CUDA
    # prints the same text (its model and cache moved to the device). At temperature 1 the same seed prints the same
    # text and another seed another (its generator on the device: CUDA's multinomial refuses a CPU one).
    import sample
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=32, block_size=16)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # far from uniform, so that CUDA's rounding cannot change an argmax (checked below)
    chars = ''.join(chr(0x100 + i) for i in range(32))
    train.save_checkpoint(str(tmp_path / 'ckpt.pt'), {'model': model.state_dict(), 'model_args': model.config.to_dict(),
                                                      'meta': dict(tokenizer='char', vocab_size=32, chars=chars)})
    ids = model.generate(torch.zeros(1, 1, dtype=torch.long), 12, temperature=0)
    with torch.no_grad():
        top2 = model(ids[:, :-1])[0][0].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-2  # every greedy choice by a clear margin
    greedy = ''.join(chars[i] for i in ids[0].tolist())

    def run(*flags):
        capsys.readouterr()
        sample.main([f'--out_dir={tmp_path}', '--device=cuda', '--dtype=float32', '--num_samples=1',
                     '--max_new_tokens=12', f'--start={chars[0]}', *flags])
        return capsys.readouterr().out
    assert run('--temperature=0') == greedy + '\n' + '-' * 80 + '\n'
    drawn = [run('--temperature=1', '--top_k=0', f'--seed={seed}') for seed in (1, 1, 2)]
    assert drawn[0] == drawn[1] != drawn[2], drawn


@gpu
def test_rmsnorm_of_bf16_input_with_a_float32_weight_on_the_gpu():
    # Reference: the formula in float64 on the bf16 input, as test_train.py's CPU test has it
    # (conftest.assert_rmsnorm_rounded_once). What autocast_residual feeds the norms (and qk_norm always: a
    # matmul's bf16 output) must be float32 math rounded once; torch's fused kernel takes one dtype, and the mixed
    # pair must not fall back to its composite with a warning on every call.
    assert_rmsnorm_rounded_once(*rmsnorm_bf16_case('cuda', C=64))


def subprocess_run(cmd, out_dir, timeout=300):
    log = f'{out_dir}.log'
    with open(log, 'w') as f:
        rc = subprocess.run(cmd, cwd=HERE, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    with open(log) as f:
        output = f.read()
    assert rc == 0, output[-4000:]
    return output


@gpu
def test_one_process_under_torchrun_matches_the_plain_run(tmp_path, gpu_data):
    # Reference: the plain run. One process under torchrun must run the same path on the same GPU. The two
    # are separate processes without deterministic kernels (flash attention's backward adds atomically):
    # what comes before the first backward (iteration 0's evaluation, iteration 1's loss) is equal exactly,
    # the later losses within 1e-2 relative, the learning rates exactly.
    argv = COMMON + SMALL + ['--dtype=bfloat16', '--max_iters=12', f'--data_dir={gpu_data}']
    t0 = time.time()
    plain = subprocess_run([sys.executable, 'train.py', *argv, f'--out_dir={tmp_path / "plain"}'], tmp_path / 'plain')
    under = subprocess_run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1',
                            'train.py', *argv, f'--out_dir={tmp_path / "torchrun"}'], tmp_path / 'torchrun')
    want, got = read_metrics(tmp_path / 'plain'), read_metrics(tmp_path / 'torchrun')
    lw, lg = losses(want, after=-1), losses(got, after=-1)
    diff = max(abs(lg[k] - lw[k]) / abs(lw[k]) for k in lw) if lg.keys() == lw.keys() else math.inf
    train_w = [r for r in want if 'loss' in r]
    SUMMARY.append(dict(branch='torchrun, 1 process (vs the plain run)', first=train_w[0]['loss'],
                        last=train_w[-1]['loss'], diff='exact' if diff == 0 else f'{diff:.2e}',
                        peak=f"{max(r['peak_mem_mb'] for r in train_w):,.0f}", seconds=time.time() - t0))
    assert 'parallelism       off (one process)' in plain and 'parallelism       off (one process)' in under
    assert [(r['iter'], sorted(r)) for r in got] == [(r['iter'], sorted(r)) for r in want]
    assert lg[0, 'val_loss'] == lw[0, 'val_loss'] and lg[1, 'loss'] == lw[1, 'loss']
    assert diff <= 1e-2, f"{lg}\n{lw}"
    assert [r.get('lr') for r in got] == [r.get('lr') for r in want]


@gpu
def test_ddp_compile_with_activation_checkpointing_stays_compiled(tmp_path):
    # Reference: the start-up report of both processes' run (2 processes, gloo on the CPU: one GPU cannot
    # hold two NCCL ranks): compile on, Dynamo's DDP graph split off, no fallback warning, training done.
    # 'selective': 'full' is checked in one process above.
    data = write_data(tmp_path / 'data')
    out = subprocess_run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          'train.py', '--device=cpu', '--dtype=float32', '--n_layer=2', '--n_head=2', '--n_embd=32',
                          '--block_size=32', '--batch_size=4', '--gradient_accumulation_steps=2', '--eval_iters=4',
                          '--max_iters=3', '--compile=True', '--activation_checkpointing=selective',
                          f'--data_dir={data}', f'--out_dir={tmp_path / "ddp"}'], tmp_path / 'ddp')
    assert 'parallelism       DDP, 2 processes' in out
    assert 'compile           on (mode default), one graph under DDP (optimize_ddp off' in out, out[-4000:]
    assert 'UNCOMPILED' not in out and 'done: 3 iterations' in out


@gpu
@pytest.mark.parametrize('setting', ['adamw', 'label_smoothing', 'muon'])
def test_a_cuda_step_synchronizes_once(setting):
    # Reference: CUDA's own count of the calls that wait for the GPU (torch.cuda.set_sync_debug_mode warns at each),
    # over 3 steps of 3 micro-batches under bf16 autocast, after one step that creates the optimizer's state: one
    # per step, whether the step was finite. The CPU test above counts the ops that would; this one also sees
    # fused AdamW's step and the copies.
    model = tiny_model().cuda()
    model.loss_chunk_tokens = 16  # 4 x 16 tokens per micro-batch: 4 chunks
    optimizer = train.configure_optimizer(model, opt_cfg(optimizer='muon' if setting == 'muon' else 'adamw'), 'cuda')
    x, y = (t.cuda() for t in batches(1)[0].next())
    micro = SimpleNamespace(next=lambda: (x, y))
    scaler = torch.amp.GradScaler('cuda', enabled=False)
    smoothing = 0.1 if setting == 'label_smoothing' else 0.0

    def step():
        return train.train_step(model, optimizer, scaler, micro, 3, torch.autocast('cuda', dtype=torch.bfloat16),
                                1.0, smoothing)[2]
    assert step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try:
            oks = [step() for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode('default')
    # one warning per synchronizing call; a process's first also warns once that the mode is a prototype
    syncs = [str(w.message) for w in caught if 'called a synchronizing CUDA operation' in str(w.message)]
    assert oks == [True] * 3 and len(syncs) == 3, syncs
