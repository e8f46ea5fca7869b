"""
Failure tests for train.py: each injects a fault (an interruption, a full disk, a NaN, a hostile or broken
checkpoint, a changed config, bad data, an earlier run in out_dir, data with another vocabulary, an out_dir
or data file the system refuses, a failed metrics write, a config value out of range) and checks the
documented guarantee (README, "Resuming and failures") against a reference that a wrong implementation
would not meet: an uninterrupted run, the bytes of the previous checkpoint, the weights before a skipped
step, scripted evaluation losses, and so on. Tiny models and datasets; CPU, float32.

    python -m pytest -q test_failures.py
"""
import copy
import dataclasses
import errno
import glob
import io
import json
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import model as model_module
import prepare_data
import train
from configurator import ConfigError, configure
from conftest import assert_same, deterministic, load, read_metrics, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
V = 40
TINY = ['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
        '--batch_size=4', '--eval_iters=2', '--log_interval=1', '--warmup_iters=2', '--learning_rate=1e-2',
        '--min_lr=1e-3']


# ----------------------------------------------------------------------------------------------------
# helpers

def write_data(d, vocab=V, n_train=2000, n_val=400, train_tokens=None, val_tokens=None, seed=0, **meta_over):
    """train.bin / val.bin of uniform random ids in [0, vocab) (or the ids given) and a char-level meta.json."""
    rng = np.random.default_rng(seed)
    tr = rng.integers(0, vocab, n_train) if train_tokens is None else train_tokens
    va = rng.integers(0, vocab, n_val) if val_tokens is None else val_tokens
    return write_dataset(d, tr, va, vocab, **meta_over)


@pytest.fixture
def data(tmp_path):
    return write_data(tmp_path / 'data')


def args(data_dir, out_dir, *extra):
    return TINY + [f'--data_dir={data_dir}', f'--out_dir={out_dir}', *extra]


def read_bytes(path):
    with open(path, 'rb') as f:
        return f.read()


def all_finite(state_dict):
    return all(bool(torch.isfinite(t).all()) for t in state_dict.values())


@pytest.fixture
def save_log(monkeypatch):
    """Wrap train.save_checkpoint: record (file name, iter_num, bytes written) of every successful save."""
    log = []
    real = train.save_checkpoint

    def save_checkpoint(path, state):
        real(path, state)
        log.append((os.path.basename(path), state['iter_num'], read_bytes(path)))
    monkeypatch.setattr(train, 'save_checkpoint', save_checkpoint)
    return log


def signal_at(monkeypatch, iters, signum=signal.SIGTERM):
    """Make the process signal itself (a real signal, through train.py's handler) during the training
    step that produces each iteration number in `iters` (counted from the first step of this main())."""
    real = train.train_step
    state = {'calls': 0}

    def train_step(*a, **k):
        out = real(*a, **k)
        state['calls'] += 1
        if state['calls'] in iters:
            os.kill(os.getpid(), signum)
        return out
    monkeypatch.setattr(train, 'train_step', train_step)


def signal_in_evaluation(monkeypatch, n, signum=signal.SIGTERM, times=1):
    """Make the process signal itself `times` times during the nth evaluation of this main() (estimate_loss's nth
    call, counted from 1). Returns the list that gets an entry per evaluation."""
    real, calls = train.estimate_loss, []

    def estimate_loss(*a, **k):
        calls.append(1)
        if len(calls) == n:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return real(*a, **k)
    monkeypatch.setattr(train, 'estimate_loss', estimate_loss)
    return calls


class InfGrad(torch.autograd.Function):
    """Identity forward (the loss stays finite), infinite gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float('inf')


def poison_forward(monkeypatch, bad_calls, kind='nan'):
    """Wrap GPT.forward: the training forward calls (0-based, micro-steps included) in bad_calls return a
    NaN loss ('nan') or a finite loss with an infinite gradient ('infgrad'). Evaluation is untouched."""
    real = model_module.GPT.forward
    calls = {'n': 0}

    def forward(self, idx, targets=None, **kw):
        logits, loss = real(self, idx, targets, **kw)
        if self.training and targets is not None:
            i = calls['n']
            calls['n'] += 1
            if bad_calls(i) if callable(bad_calls) else i in bad_calls:
                loss = loss * float('nan') if kind == 'nan' else InfGrad.apply(loss)
        return logits, loss
    monkeypatch.setattr(model_module.GPT, 'forward', forward)


def record_steps(monkeypatch):
    """Wrap train.train_step: record (ok, loss, params before, params after, optimizer state before/after)."""
    steps = []
    real = train.train_step

    def train_step(model, optimizer, *a, **k):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt_before = copy.deepcopy(optimizer.state_dict())
        loss, norm, ok = real(model, optimizer, *a, **k)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps.append(dict(ok=ok, loss=float(loss), norm=float(norm), before=before, after=after,
                          opt_before=opt_before, opt_after=copy.deepcopy(optimizer.state_dict())))
        return loss, norm, ok
    monkeypatch.setattr(train, 'train_step', train_step)
    return steps


def run_cli(*argv, timeout=120):
    return subprocess.run([sys.executable, 'train.py', *argv], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------------------------------
# 1. exact resume

RESUME_FLAGS = ['--dropout=0.2', '--gradient_accumulation_steps=2', '--eval_interval=4', '--lr_decay_iters=10',
                '--seed=7']


@pytest.fixture(scope='module')
def reference_run(tmp_path_factory):
    """The uninterrupted run: 10 iterations, evaluations at 0, 4, 8, the final iteration 10 saved."""
    root = tmp_path_factory.mktemp('reference')
    data_dir = write_data(root / 'data')
    out = root / 'straight'
    assert train.main(args(data_dir, out, *RESUME_FLAGS, '--max_iters=10')) == 0
    return data_dir, out


@pytest.mark.parametrize('how', ['eval-checkpoint', 'final-iter-not-eval', 'sigterm-mid-interval',
                                 'sigterm-at-eval-iteration', 'sigterm-during-eval'])
def test_resume_is_bit_exact(reference_run, tmp_path, monkeypatch, capsys, how):
    # Reference: the same 10 iterations run straight through (dropout 0.2 and 2 micro-steps, so the
    # torch RNG, the sampler's generator and the accumulation all have to be restored). Every logged
    # loss, lr and evaluation and every tensor of the final ckpt.pt and best.pt must be equal.
    data_dir, straight = reference_run
    out = tmp_path / 'out'
    first = args(data_dir, out, *RESUME_FLAGS, '--max_iters=10')
    if how == 'eval-checkpoint':          # stopped by max_iters at an evaluation (ckpt from the eval)
        assert train.main(args(data_dir, out, *RESUME_FLAGS, '--max_iters=4')) == 0
        stopped_at = 4
    elif how == 'final-iter-not-eval':    # max_iters=6 is no multiple of eval_interval: 6 must be saved (and
        # evaluated, as the end of that run: its one extra line is checked and left out of the comparison)
        assert train.main(args(data_dir, out, *RESUME_FLAGS, '--max_iters=6')) == 0
        stopped_at = 6
    elif how == 'sigterm-during-eval':    # during the evaluation at 4: the run stops after it, with no step more
        with monkeypatch.context() as m:
            signal_in_evaluation(m, 2)  # the evaluations at 0 and 4
            assert train.main(first) == 128 + signal.SIGTERM
        stopped_at = 4
    else:                                 # a SIGTERM during the step to iteration 3 (or 8, an eval iteration)
        stopped_at = 3 if how == 'sigterm-mid-interval' else 8
        with monkeypatch.context() as m:
            signal_at(m, {stopped_at})
            assert train.main(first) == 128 + signal.SIGTERM
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == stopped_at
    capsys.readouterr()
    assert train.main(args(data_dir, out, *RESUME_FLAGS, '--max_iters=10', '--init_from=resume')) == 0
    assert f'resuming from {out / "ckpt.pt"} at iteration {stopped_at}' in capsys.readouterr().out

    want, got = deterministic(read_metrics(straight)), deterministic(read_metrics(out))
    if how == 'final-iter-not-eval':
        assert [r['iter'] for r in got if 'val_loss' in r] == [0, 4, 6, 8, 10]
        got = [r for r in got if not ('val_loss' in r and r['iter'] == 6)]
    assert [r['iter'] for r in got if 'loss' in r] == list(range(1, 11))
    assert got == want, f"metrics differ after resuming at {stopped_at}:\nstraight {want}\nresumed  {got}"
    a, b = load(straight / 'ckpt.pt'), load(out / 'ckpt.pt')
    assert a['iter_num'] == b['iter_num'] == 10
    assert_same(a['model'], b['model'], 'model')
    assert_same(a['optimizer'], b['optimizer'], 'optimizer')
    assert_same(a['batches'], b['batches'], 'batches')
    assert_same(a['rng'], b['rng'], 'rng states of every process')
    assert a['best_val_loss'] == b['best_val_loss']
    ba, bb = load(straight / 'best.pt'), load(out / 'best.pt')
    assert ba['iter_num'] == bb['iter_num']
    assert_same(ba['model'], bb['model'], 'best.pt model')
    # the comparison is sensitive: training moved the weights after the stop
    assert not torch.equal(ckpt['model']['wte.weight'], b['model']['wte.weight'])


def test_fp16_resume_is_bit_exact_with_the_scaler_state(data, tmp_path, capsys):
    # Reference: the same 4 iterations in float16 (CPU autocast with a GradScaler) run straight through. Stopped
    # at 2 and resumed, the run must log the same losses and end with equal weights, optimizer state and
    # GradScaler state: the scaler's growth tracker counts the good steps at this scale, 4 straight through,
    # where a resume that started a fresh scaler would end with 2.
    def fp16(out, *extra):
        return [a for a in args(data, out, *RESUME_FLAGS, '--eval_interval=2', *extra)
                if not a.startswith('--dtype=')] + ['--dtype=float16']
    straight, out = tmp_path / 'straight', tmp_path / 'out'
    assert train.main(fp16(straight, '--max_iters=4')) == 0
    assert 'GradScaler on' in capsys.readouterr().out
    assert train.main(fp16(out, '--max_iters=2')) == 0
    assert train.main(fp16(out, '--max_iters=4', '--init_from=resume')) == 0
    assert f'resuming from {out / "ckpt.pt"} at iteration 2' in capsys.readouterr().out
    want, got = deterministic(read_metrics(straight)), deterministic(read_metrics(out))
    assert [r['iter'] for r in got if 'loss' in r] == list(range(1, 5))
    assert got == want, f"straight {want}\nresumed  {got}"
    a, b = load(straight / 'ckpt.pt'), load(out / 'ckpt.pt')
    assert a['iter_num'] == b['iter_num'] == 4
    assert a['scaler']['_growth_tracker'] == 4 and a['scaler']['scale'] == 2.0 ** 16  # no step overflowed
    assert_same(a['scaler'], b['scaler'], 'scaler')
    assert_same(a['model'], b['model'], 'model')
    assert_same(a['optimizer'], b['optimizer'], 'optimizer')


# ----------------------------------------------------------------------------------------------------
# 2. atomic checkpoints

def disk_full(written=b'PK\x03\x04 half a checkpoint'):
    def save(obj, f, *a, **k):
        f.write(written)  # some bytes reach the temporary file first
        f.flush()
        raise OSError(28, 'No space left on device')
    return save


@pytest.mark.parametrize('where', ['torch.save', 'fsync', 'replace'])
def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    # Reference: the bytes of the previous checkpoint, read before the failing save.
    path = str(tmp_path / 'ckpt.pt')
    old = {'model': {'w': torch.arange(6.0)}, 'iter_num': 1}
    train.save_checkpoint(path, old)
    before = read_bytes(path)
    if where == 'torch.save':
        monkeypatch.setattr(torch, 'save', disk_full())
    else:
        def fail(*a, **k):
            raise OSError(28, 'No space left on device')
        monkeypatch.setattr(os, where, fail)
    with pytest.raises(train.TrainError) as e:
        train.save_checkpoint(path, {'model': {'w': torch.zeros(6)}, 'iter_num': 2})
    monkeypatch.undo()
    assert path in str(e.value) and 'No space left on device' in str(e.value)
    assert read_bytes(path) == before
    assert_same(load(path), old)
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt']  # no ckpt.pt.tmp left behind


def test_save_fsyncs_the_whole_file_then_renames_then_fsyncs_the_directory(tmp_path, monkeypatch):
    # Reference: what a durable atomic write needs, in order: every byte of the temporary file on disk (fsync
    # when its size is the final file's), then the rename, then an fsync of the directory that makes the rename
    # itself durable; no descriptor left open.
    if not os.path.isdir('/proc/self/fd'):
        pytest.skip('needs /proc to tell which file a descriptor is')
    path = str(tmp_path / 'ckpt.pt')
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(('fsync', os.readlink(f'/proc/self/fd/{fd}'), os.fstat(fd).st_size))
        return real_fsync(fd)

    def replace(a, b):
        events.append(('replace', os.fspath(a), os.fspath(b)))
        return real_replace(a, b)
    open_fds = len(os.listdir('/proc/self/fd'))
    monkeypatch.setattr(os, 'fsync', fsync)
    monkeypatch.setattr(os, 'replace', replace)
    train.save_checkpoint(path, {'model': {'w': torch.arange(5000.0)}, 'iter_num': 3})
    monkeypatch.undo()
    size = os.path.getsize(path)
    assert events[:2] == [('fsync', path + '.tmp', size), ('replace', path + '.tmp', path)], events
    assert len(events) == 3 and events[2][:2] == ('fsync', str(tmp_path)), events
    assert len(os.listdir('/proc/self/fd')) == open_fds
    assert load(path)['iter_num'] == 3


def test_first_save_failing_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    monkeypatch.setattr(torch, 'save', disk_full())
    with pytest.raises(train.TrainError, match='ckpt.pt'):
        train.save_checkpoint(path, {'iter_num': 0})
    assert os.listdir(tmp_path) == []


def test_interrupt_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # A KeyboardInterrupt (not an Exception) mid-write: it propagates unchanged, the old file is intact.
    path = str(tmp_path / 'ckpt.pt')
    train.save_checkpoint(path, {'iter_num': 1, 'w': torch.ones(3)})
    before = read_bytes(path)

    def interrupted(obj, f, *a, **k):
        f.write(b'partial')
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, 'save', interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint(path, {'iter_num': 2, 'w': torch.zeros(3)})
    assert read_bytes(path) == before
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt']


def test_disk_full_during_a_run_keeps_the_older_checkpoint(data, tmp_path, monkeypatch, save_log):
    # Reference: ckpt.pt's bytes right after the last save that succeeded (iteration 2); the third save
    # of ckpt.pt (iteration 4) fails with ENOSPC after writing part of the file.
    out = tmp_path / 'out'
    real_save = torch.save
    n = {'ckpt': 0}

    def save(obj, f, *a, **k):
        if getattr(f, 'name', '').endswith('ckpt.pt.tmp'):
            n['ckpt'] += 1
            if n['ckpt'] == 3:
                return disk_full()(obj, f)
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, 'save', save)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=2', '--max_iters=6'))
    assert str(out / 'ckpt.pt') in str(e.value) and 'No space left' in str(e.value)
    last = [b for name, it, b in save_log if name == 'ckpt.pt']
    assert [it for name, it, b in save_log if name == 'ckpt.pt'] == [0, 2]
    assert read_bytes(out / 'ckpt.pt') == last[-1]
    assert load(out / 'ckpt.pt')['iter_num'] == 2
    assert not glob.glob(str(out / '*.tmp'))
    monkeypatch.setattr(torch, 'save', real_save)
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=6', '--init_from=resume')) == 0
    assert load(out / 'ckpt.pt')['iter_num'] == 6


# ----------------------------------------------------------------------------------------------------
# 3. preemption: real signals to a real process

SLOW = ['--device=cpu', '--dtype=float32', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32',
        '--batch_size=16', '--eval_iters=2', '--log_interval=1', '--eval_interval=50', '--warmup_iters=2']


def wait_for_training_line(proc, metrics, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"train.py ended (rc {proc.returncode}) before it could be signalled:\n{out}\n{err}")
        if os.path.exists(metrics):
            with open(metrics) as f:
                if any('"loss"' in line for line in f):
                    return
        time.sleep(0.02)
    proc.kill()
    pytest.fail('no training line in metrics.jsonl within the timeout')


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_signal_saves_and_prints_the_resume_command(data, tmp_path, capsys, signum):
    # Reference: metrics.jsonl's last training line (the iteration the run reached) and max_iters.
    out = tmp_path / 'out'
    argv = SLOW + [f'--data_dir={data}', f'--out_dir={out}', '--max_iters=60']
    proc = subprocess.Popen([sys.executable, 'train.py', *argv], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_training_line(proc, out / 'metrics.jsonl')
        t = time.time()
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=30)
        elapsed = time.time() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, f"rc {proc.returncode}\n{stdout[-2000:]}\n{stderr[-2000:]}"
    assert elapsed < 10, f"took {elapsed:.1f}s to stop"
    assert 'Traceback' not in stderr
    resume_lines = [ln.strip() for ln in stdout.splitlines() if '--init_from=resume' in ln]
    assert resume_lines, stdout[-2000:]
    last_iter = [r['iter'] for r in read_metrics(out) if 'loss' in r][-1]
    ckpt = load(out / 'ckpt.pt')
    assert 0 < ckpt['iter_num'] == last_iter < 60
    if signum == signal.SIGTERM:  # the printed command's arguments finish the run
        cmd = resume_lines[-1].split()
        assert cmd[:2] == ['python', 'train.py']
        capsys.readouterr()
        assert train.main(cmd[2:]) == 0  # in-process: one interpreter start less
        assert f'at iteration {last_iter}' in capsys.readouterr().out
        assert load(out / 'ckpt.pt')['iter_num'] == 60
        train_iters = [r['iter'] for r in read_metrics(out) if 'loss' in r]
        assert train_iters == list(range(1, 61))  # each iteration logged once, none lost, none repeated


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
@pytest.mark.parametrize('local_rank', [None, '1'])
def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(data, tmp_path, monkeypatch, capfd, save_log,
                                                                      signum, local_rank):
    # Reference: ckpt.pt's bytes as saved at the evaluation at iteration 2. Both signals come during the evaluation
    # at 4 (one that could take minutes): the first would stop after it, the second stops the run there, 128 +
    # signum, before anything is saved (it waited for the whole evaluation, then saved and exited). A plain run that
    # inherited a LOCAL_RANK from its environment (no torchrun: no WORLD_SIZE) says so as any plain run.
    monkeypatch.delenv('WORLD_SIZE', raising=False)
    if local_rank:
        monkeypatch.setenv('LOCAL_RANK', local_rank)
    calls = signal_in_evaluation(monkeypatch, 3, signum, times=2)
    out = tmp_path / 'out'
    with pytest.raises(SystemExit) as e:
        train.main(args(data, out, '--eval_interval=2', '--max_iters=8'))
    assert e.value.code == 128 + signum and len(calls) == 3
    assert [(name, it) for name, it, _ in save_log][-1] == ('ckpt.pt', 2)
    assert read_bytes(out / 'ckpt.pt') == save_log[-1][2] and not glob.glob(str(out / '*.tmp'))
    err = capfd.readouterr().err
    assert f'{signal.Signals(signum).name} received: stopping after this step or evaluation' in err
    assert f'{signal.Signals(signum).name} received again: stopping now, without saving' in err


def test_last_iteration_is_saved(data, tmp_path, save_log):
    # max_iters=7 with eval_interval=3: evaluations at 0, 3, 6; the run must still end with ckpt.pt at 7.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=3', '--max_iters=7')) == 0
    assert [it for name, it, _ in save_log if name == 'ckpt.pt'] == [0, 3, 6, 7]
    assert load(out / 'ckpt.pt')['iter_num'] == 7


# ----------------------------------------------------------------------------------------------------
# 4. non-finite losses and gradients

@pytest.mark.parametrize('accum', [1, 2])
def test_isolated_nan_steps_are_skipped_and_the_run_finishes(data, tmp_path, monkeypatch, capsys, accum):
    # NaN loss in micro-step 1 of step 3 and micro-step 0 of steps 6 and 7 (two in a row, under the
    # limit of 3). Reference: the weights and optimizer state right before each skipped step.
    bad_steps = {3, 6, 7}
    micro = {3: accum - 1, 6: 0, 7: 0}
    poison_forward(monkeypatch, {(s - 1) * accum + micro[s] for s in bad_steps})
    steps = record_steps(monkeypatch)
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=4', '--max_iters=9', '--max_nonfinite_steps=3',
                           f'--gradient_accumulation_steps={accum}')) == 0
    assert [s['ok'] for s in steps] == [i not in bad_steps for i in range(1, 10)]
    for i, s in enumerate(steps, 1):
        if s['ok']:
            assert any(not torch.equal(s['before'][n], s['after'][n]) for n in s['before']), i
        else:
            assert math.isnan(s['loss'])
            assert_same(s['before'], s['after'], f'params around skipped step {i}')
            assert_same(s['opt_before'], s['opt_after'], f'optimizer around skipped step {i}')
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 9 and all_finite(ckpt['model'])
    assert_same({n: ckpt['model'][n] for n in steps[-1]['after']}, steps[-1]['after'])  # (tied lm_head left out)
    logged = [r['iter'] for r in read_metrics(out) if 'loss' in r]
    assert logged == [i for i in range(1, 10) if i not in bad_steps]
    # the log lines count the skipped steps so far: 1 after step 3, 3 after steps 6 and 7
    printed = capsys.readouterr()
    said = {int(m[0]): int(m[1]) for m in re.findall(r'^iter (\d+): loss .*, (\d+) steps skipped$', printed.out, re.M)}
    assert said == {4: 1, 5: 1, 8: 3, 9: 3}, said
    assert all(math.isfinite(r[k]) for r in read_metrics(out) for k in ('loss', 'val_loss') if k in r)
    # each skip named on stderr by what was not finite: the loss (its gradients NaN too, so the norm)
    skipped = re.findall(r'^iter (\d+): non-finite (.*): step skipped \((\d+) in a row\)$', printed.err, re.M)
    assert skipped == [(str(i), 'loss nan and gradient norm nan', n) for i, n in ((3, '1'), (6, '1'), (7, '2'))]


def test_infinite_gradient_with_finite_loss_is_skipped(data, tmp_path, monkeypatch, capsys):
    # The loss of step 4 is finite, its gradient infinite: the norm guard, not the loss guard, must act, and the
    # message names the norm alone (it said 'non-finite loss 4.17 or gradient norm nan')
    poison_forward(monkeypatch, {3}, kind='infgrad')
    steps = record_steps(monkeypatch)
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=10', '--max_iters=6')) == 0
    s = steps[3]
    assert math.isfinite(s['loss']) and not math.isfinite(s['norm'])
    assert 'iter 4: non-finite gradient norm nan: step skipped (1 in a row)\n' in capsys.readouterr().err
    assert not s['ok']
    assert_same(s['before'], s['after'], 'params around the inf-gradient step')
    assert_same(s['opt_before'], s['opt_after'], 'optimizer around the inf-gradient step')
    assert [x['ok'] for x in steps] == [True, True, True, False, True, True]
    assert all_finite(load(out / 'ckpt.pt')['model'])


def test_weights_with_a_nan_or_inf_are_not_saved(tmp_path):
    # Reference: a model with one non-finite element in one tensor (every other element of it and every other
    # tensor finite) must not be written: an error naming the iteration and the file, and no file.
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=V, n_layer=1, n_head=2, n_embd=16))
    assert train.weights_finite(model)
    path = str(tmp_path / 'ckpt.pt')
    for bad in (float('nan'), float('inf')):
        with torch.no_grad():
            model.blocks[0].mlp.down.weight[3, 5] = bad
        assert not train.weights_finite(model)
        want = f'iteration 7: the weights hold NaN/inf; not saving {path}'
        with pytest.raises(train.TrainError, match=re.escape(want)):
            train.save(SimpleNamespace(model=model, device='cpu', iter_num=7, world=1, master=True), path)
        assert os.listdir(tmp_path) == []


def test_consecutive_nan_steps_stop_with_the_last_good_checkpoint(data, tmp_path, monkeypatch, save_log):
    # Every training step from step 6 on is NaN; max_nonfinite_steps=3 stops the run at iteration 8.
    # Reference: ckpt.pt's bytes right after its last save (the evaluation at iteration 4).
    poison_forward(monkeypatch, lambda i: i >= 5)
    out = tmp_path / 'out'
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=4', '--max_iters=20', '--max_nonfinite_steps=3'))
    msg = str(e.value)
    assert 'iteration 8' in msg and '3 consecutive' in msg, msg
    assert str(out / 'ckpt.pt') in msg and '(iteration 4)' in msg, msg
    name, it, saved = [x for x in save_log if x[0] == 'ckpt.pt'][-1]
    assert it == 4
    assert read_bytes(out / 'ckpt.pt') == saved
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 4 and all_finite(ckpt['model']) and all_finite(load(out / 'best.pt')['model'])
    assert not glob.glob(str(out / '*.tmp'))


def test_nan_steps_right_after_a_resume_name_the_checkpoint_resumed_from(data, tmp_path, monkeypatch):
    # Reference: the iteration of the checkpoint the run resumed from (4): it is the last good one when every
    # step after the resume is NaN and the run stops before saving again.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=4', '--max_iters=4')) == 0
    poison_forward(monkeypatch, lambda i: True)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=4', '--max_iters=20', '--max_nonfinite_steps=2',
                        '--init_from=resume'))
    assert 'iteration 6: 2 consecutive' in str(e.value) and f"{out / 'ckpt.pt'} (iteration 4)" in str(e.value), \
        str(e.value)
    assert load(out / 'ckpt.pt')['iter_num'] == 4


def test_nan_steps_before_any_checkpoint_say_that_none_was_saved(data, tmp_path, monkeypatch):
    # Reference: the files in out_dir: without the evaluation at iteration 0 no checkpoint exists when the run
    # stops at iteration 2, and the message must not name one (it said "ckpt.pt (iteration None)").
    poison_forward(monkeypatch, lambda i: True)
    out = tmp_path / 'out'
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=4', '--max_iters=20', '--max_nonfinite_steps=2',
                        '--eval_at_start=False'))
    assert 'No checkpoint was saved yet' in str(e.value) and 'ckpt.pt' not in str(e.value), str(e.value)
    assert not os.path.exists(out / 'ckpt.pt')


OOM = 'CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.20 GiB free.'


def raise_in_forward(monkeypatch, when, error):
    """Wrap GPT.forward: the call for which when(training, n) holds (n counts that mode's calls, from 0)
    raises error() instead."""
    real, calls = model_module.GPT.forward, {True: 0, False: 0}

    def forward(self, idx, targets=None, **kw):
        n, calls[self.training] = calls[self.training], calls[self.training] + 1
        if when(self.training, n):
            raise error()
        return real(self, idx, targets, **kw)
    monkeypatch.setattr(model_module.GPT, 'forward', forward)


@pytest.mark.parametrize('where, flags, advice', [
    ('step', [], ['lower batch_size=4 and raise gradient_accumulation_steps',
                  'activation_checkpointing=selective or full']),
    ('step', ['--activation_checkpointing=selective'], ['lower batch_size=4', 'activation_checkpointing=full']),
    ('step', ['--activation_checkpointing=full'], ['lower batch_size=4']),
    ('step', ['--batch_size=1', '--activation_checkpointing=full'],
     ['batch_size is 1 already', 'a new run with optimizer=adamw8bit']),
    ('evaluation', [], ['lower batch_size=4'])])
def test_out_of_memory_in_the_loop_stops_with_advice_and_the_last_checkpoint(data, tmp_path, monkeypatch, save_log,
                                                                            where, flags, advice):
    # Reference: the last save's iteration and bytes (the evaluation at iteration 4), and advice that fits the
    # run's settings: no more checkpointing advised to a run that checkpoints every block, nor to an evaluation
    # (no_grad: nothing to checkpoint), no smaller batch than 1, no bench.py (fit mode needs CUDA) on the CPU. The
    # 6th training forward is iteration 6's; the 5th evaluation forward is the first of the evaluation at 4 (2 per
    # split at 0).
    raise_in_forward(monkeypatch, lambda training, n: training == (where == 'step') and n == (5 if training else 4),
                     lambda: torch.OutOfMemoryError(OOM))
    out = tmp_path / 'out'
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=4', '--max_iters=20', *flags))
    message = str(e.value)
    at = 'in the training step after iteration 5' if where == 'step' else 'in the evaluation at iteration 4'
    assert '\n' not in message and f'out of memory on cpu {at} ({OOM})' in message, message
    for needle in advice + [f"{out / 'ckpt.pt'} (iteration {0 if where == 'evaluation' else 4})"]:
        assert needle in message, (needle, message)
    assert message.count('activation_checkpointing=') == sum('activation_checkpointing=' in a for a in advice)
    assert ('optimizer=' in message) == (advice[0] == 'batch_size is 1 already') and 'bench.py' not in message
    assert ('raise gradient_accumulation_steps' in message) == (advice[0] != 'batch_size is 1 already')
    name, it, saved = [x for x in save_log if x[0] == 'ckpt.pt'][-1]
    assert read_bytes(out / 'ckpt.pt') == saved and it == (0 if where == 'evaluation' else 4)


@pytest.mark.parametrize('world, parallelism, advised', [(1, 'ddp', True), (1, 'fsdp', True), (2, 'ddp', True),
                                                         (2, 'fsdp', False)])
def test_out_of_memory_advice_names_8bit_adamw_where_the_run_could_use_it(world, parallelism, advised):
    # Reference: where adamw8bit runs: not under FSDP, which refuses optimizers other than AdamW; FSDP is in use only
    # with more than one process (alone, parallelism='fsdp' has no effect: the run trains as one process)
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'batch_size': 1, 'parallelism': parallelism})
    r = SimpleNamespace(cfg=cfg, device_type='cpu', model_config=model_module.GPTConfig(), dtype='float32',
                        world=world)
    message = train.memory_advice(RuntimeError('DefaultCPUAllocator: not enough memory'), r)
    assert ('a new run with optimizer=adamw8bit' in message) == advised, message


@pytest.mark.parametrize('dtype, model_args, fits', [
    ('bfloat16', {}, True), ('float16', {}, True), ('float32', {}, False),
    ('bfloat16', {'tie_embeddings': False}, False), ('bfloat16', {'head_dim': 32}, False)])
def test_out_of_memory_advice_on_cuda_runs_fit_mode_on_the_runs_model_and_step(dtype, model_args, fits):
    # Reference: bench.py's own reading of the advised command and the model it builds from it: the run's model
    # (GQA and a padded vocabulary included), precision and tokens per optimizer step. A model or a precision that
    # bench.py cannot build (untied head, head_dim set, float32) gets no command: its batch would be another's.
    import bench
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'batch_size': 6, 'block_size': 256, 'gradient_accumulation_steps': 5})
    config = model_module.GPTConfig(n_layer=3, n_head=8, n_kv_head=2, n_embd=128, vocab_size=320, block_size=256,
                                    **model_args)
    r = SimpleNamespace(cfg=cfg, device_type='cuda', model_config=config, dtype=dtype, world=1)
    message = train.memory_advice(torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB'), r)
    found = re.search(r'`python bench.py (--mode=fit [^`]*)`', message)
    assert bool(found) == fits, message
    if fits:
        a = bench.read_args(found.group(1).split())
        assert a['mode'] == 'fit' and a['tokens_per_step'] == 6 * 256 * 5
        assert model_module.GPTConfig(**{k: a[k] for k in bench.SHAPE}) == config, (found.group(1), config)
        assert a['dtype'] == {'bfloat16': 'auto', 'float16': 'float16'}[dtype]  # auto: bf16 on a GPU that has it


def test_the_cpu_allocators_failure_is_out_of_memory_too(data, tmp_path, monkeypatch):
    # Reference: the error a CPU allocation too large raises (a RuntimeError, not torch.OutOfMemoryError, and
    # without the words "out of memory"): the same one-line advice as CUDA's, quoting it
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as e:
        refused = e
    assert not isinstance(refused, torch.OutOfMemoryError) and 'out of memory' not in str(refused).lower()
    raise_in_forward(monkeypatch, lambda training, n: training and n == 5, lambda: refused)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, tmp_path / 'out', '--eval_interval=4', '--max_iters=20'))
    message = str(e.value)
    assert message.startswith(f"out of memory on cpu in the training step after iteration 5 ({str(refused)[:300]}): "
                              f"lower batch_size=4"), message


def test_another_error_in_the_loop_is_not_called_out_of_memory(data, tmp_path, monkeypatch):
    # Reference: the error raised, unchanged: only an out-of-memory error becomes the advice.
    raise_in_forward(monkeypatch, lambda training, n: training and n == 2, lambda: RuntimeError('CUDA error: illegal'))
    with pytest.raises(RuntimeError, match='^CUDA error: illegal$'):
        train.main(args(data, tmp_path / 'out', '--eval_interval=4', '--max_iters=20'))


def test_resume_before_any_evaluation_says_there_is_no_val_loss(data, tmp_path, monkeypatch, capsys):
    # Reference: the checkpoint's best_val_loss, inf when no evaluation ran (it printed "best val loss inf").
    out = tmp_path / 'out'
    signal_at(monkeypatch, {2})
    assert train.main(args(data, out, '--eval_interval=100', '--max_iters=10', '--eval_at_start=False')) == 128 + 15
    assert load(out / 'ckpt.pt')['best_val_loss'] == math.inf
    monkeypatch.undo()
    capsys.readouterr()
    assert train.main(args(data, out, '--eval_interval=100', '--max_iters=10', '--init_from=resume')) == 0
    said = capsys.readouterr().out
    assert f"resuming from {out / 'ckpt.pt'} at iteration 2 (no val loss yet)" in said and 'inf' not in said, said


@pytest.mark.parametrize('world, local, want', [
    (1, None, ['python', 'train.py']), (2, None, ['torchrun', '--nproc_per_node=2', 'train.py']),
    (8, '4', ['torchrun', '--nnodes=2', '--nproc_per_node=4', 'train.py'])])
def test_resume_command_runs_this_script_as_launched(monkeypatch, tmp_path, world, local, want):
    # Reference: torchrun's own variables (LOCAL_WORLD_SIZE: the processes of one node; a command that started
    # the global count on each node would start twice as many) and this file's path from the working directory.
    if local:
        monkeypatch.setenv('LOCAL_WORLD_SIZE', local)
    else:
        monkeypatch.delenv('LOCAL_WORLD_SIZE', raising=False)
    monkeypatch.chdir(HERE)
    command = train.resume_command(['--out_dir=o x', '--init_from=scratch'], world)
    assert command.startswith(' '.join(want) + " '--out_dir=o x' --init_from=resume"), command
    assert command.endswith('options the run was started with') == (local is not None)
    monkeypatch.chdir(os.path.dirname(HERE))
    assert f' {os.path.basename(HERE)}/train.py ' in train.resume_command([], world)
    monkeypatch.chdir(tmp_path)  # not above this file: its absolute path
    assert f' {os.path.join(HERE, "train.py")} ' in train.resume_command([], world)


def test_checkpoint_that_is_a_directory_is_an_error_naming_it(data, tmp_path):
    os.makedirs(tmp_path / 'out' / 'ckpt.pt')
    with pytest.raises(train.TrainError, match=r'ckpt\.pt cannot be read: Is a directory'):
        train.main(args(data, tmp_path / 'out', '--init_from=resume'))


def test_missing_token_file_advice_is_a_command_that_pastes(tmp_path):
    # Reference: the shell's own reading of the advised command (shlex): a data_dir with a space stays one argument.
    data = write_data(tmp_path / 'my data')
    os.remove(os.path.join(data, 'train.bin'))
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, tmp_path / 'out'))
    command = re.search(r'`([^`]*)`', str(e.value)).group(1)
    assert shlex.split(command) == ['python', 'prepare_data.py', f'--data_dir={data}'], str(e.value)
    assert "tokenizer 'char'" in str(e.value)


# ----------------------------------------------------------------------------------------------------
# 5. safe loading

class OpenFile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


class System:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}',))


def assert_resume_refused(data, out, path):
    """Loading path, and resuming from it, are errors naming it; the file and metrics.jsonl stay as they were."""
    before = read_bytes(path), read_bytes(out / 'metrics.jsonl')
    with pytest.raises(train.TrainError) as e:
        train.load_checkpoint(str(path))
    assert str(path) in str(e.value)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))
    assert str(path) in str(e.value)
    assert (read_bytes(path), read_bytes(out / 'metrics.jsonl')) == before


@pytest.mark.parametrize('how', ['torch.save-open', 'torch.save-os.system', 'pickle-open'])
def test_malicious_checkpoint_is_refused(data, tmp_path, how):
    # Reference: the marker file the payload would create. A real run writes ckpt.pt first, so that the
    # metrics and best.pt of a real run are there too; then ckpt.pt is replaced by the hostile file.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    marker = tmp_path / 'PWNED'
    ckpt = load(out / 'ckpt.pt')
    payload = OpenFile(str(marker)) if how.endswith('open') else System(str(marker))
    ckpt['config'] = payload
    path = out / 'ckpt.pt'
    if how.startswith('torch.save'):
        torch.save(ckpt, path)
    else:
        with open(path, 'wb') as f:
            pickle.dump({'iter_num': 2, 'x': payload}, f)
    assert_resume_refused(data, out, path)
    assert not marker.exists()
    if how.startswith('pickle'):  # no zip archive: 'not a checkpoint' (torch's unpickler stops before the global)
        return
    # a real checkpoint's archive: the error says why, naming the function it asks to import (open, or os.system:
    # posix.system on Linux), not 'corrupt or truncated'
    with pytest.raises(train.TrainError) as e:
        train.load_checkpoint(str(path))
    name = 'open' if how.endswith('open') else 'system'
    msg = str(e.value)
    assert msg.startswith(f'refusing to load {path}'), msg
    assert re.search(rf'asks to import \w+\.{name}, which could run code', msg), msg


def flipped_in_a_tensor(data):
    """A checkpoint's bytes with one byte flipped in the middle of its largest tensor's data, where torch.load reads
    no structure (the archive's records, found by zipfile)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # (not data.pkl, the pickle, which can be the largest)
        record = max((r for r in archive.infolist() if '/data/' in r.filename), key=lambda r: r.file_size)
    name_length, extra_length = struct.unpack('<HH', data[record.header_offset + 26:record.header_offset + 30])
    start = record.header_offset + 30 + name_length + extra_length  # past the record's local header
    broken = bytearray(data)
    broken[start + record.file_size // 2] ^= 0x7f
    return bytes(broken)


@pytest.mark.parametrize('how', ['truncated', 'garbage', 'empty', 'flipped'])
def test_broken_checkpoint_is_an_error_not_a_fresh_start(data, tmp_path, how):
    # Reference: metrics.jsonl and ckpt.pt as they were before the resume attempt. A byte flipped inside a tensor's
    # data loaded without a word (torch.load reads no CRC): it fails the record's CRC-32, which torch.save wrote
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    path = out / 'ckpt.pt'
    real = read_bytes(path)
    broken = {'truncated': real[:len(real) // 2], 'garbage': np.random.default_rng(0).bytes(5000),
              'empty': b'', 'flipped': flipped_in_a_tensor(real)}[how]
    if how == 'flipped':
        assert isinstance(torch.load(io.BytesIO(broken), weights_only=True), dict)  # torch's own load takes it
    path.write_bytes(broken)
    assert_resume_refused(data, out, path)
    assert read_bytes(path) == broken
    # a zip archive cut short is a corrupt checkpoint; bytes that are no zip archive at all, not a checkpoint
    # (torch's own message there is about weights_only's allowed types, which misleads)
    with pytest.raises(train.TrainError, match={'truncated': 'corrupt or truncated', 'flipped': re.escape(
            f"checkpoint {path} is corrupt: Bad CRC-32 for file '")}.get(
            how, 'is not a checkpoint: not the zip archive torch.save writes')):
        train.load_checkpoint(str(path))
    assert not glob.glob(str(out / 'previous-*'))


def test_checkpoints_written_without_crcs_or_in_torchs_legacy_format_load(tmp_path):
    # Reference: the state saved. torch.save gives each record a CRC-32 unless
    # torch.utils.serialization.config.save.compute_crc32 is False (then every record's is 0: nothing to check, not a
    # corrupt file); torch's legacy format is no zip archive and has none
    from torch.utils.serialization import config
    state = {'model': {'w': torch.arange(6.0)}, 'iter_num': 3}
    config.save.compute_crc32 = False  # (not monkeypatch: its undo deletes a config module's entry)
    try:
        torch.save(state, tmp_path / 'no_crc.pt')
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(tmp_path / 'no_crc.pt') as archive:
        assert {r.CRC for r in archive.infolist()} == {0}
    torch.save(state, tmp_path / 'legacy.pt', _use_new_zipfile_serialization=False)
    assert read_bytes(tmp_path / 'legacy.pt')[:4] != b'PK\x03\x04'
    for name in ('no_crc.pt', 'legacy.pt'):
        assert_same(train.load_checkpoint(str(tmp_path / name)), state, name)


def test_truncated_checkpoint_cli_exits_nonzero_without_traceback(data, tmp_path):
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    path = out / 'ckpt.pt'
    real = read_bytes(path)
    path.write_bytes(real[:len(real) // 2])
    metrics_before = read_bytes(out / 'metrics.jsonl')
    proc = run_cli(*args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))
    assert proc.returncode != 0
    assert 'Traceback' not in proc.stderr and str(path) in proc.stderr, proc.stderr
    assert read_bytes(out / 'metrics.jsonl') == metrics_before


def test_checkpoint_without_the_training_state_is_an_error_naming_the_file(data, tmp_path):
    # A loadable file that is not a training checkpoint (a bare model state_dict saved as ckpt.pt)
    # is a corrupt checkpoint too: an error naming the file, not a KeyError traceback.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    path = out / 'ckpt.pt'
    ckpt = load(path)
    torch.save(ckpt['model'], path)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))
    assert str(path) in str(e.value)
    # Reference: the entries a resume reads; a checkpoint lacking any one of them is refused naming it
    for key in ('model', 'optimizer', 'scaler', 'iter_num', 'best_val_loss', 'config', 'model_args', 'meta',
                'batches', 'rng', 'evaluated'):
        torch.save({k: v for k, v in ckpt.items() if k != key}, path)
        with pytest.raises(train.TrainError, match=re.escape(f'{path} is not a training checkpoint of this script: '
                                                             f'it lacks {key}')):
            train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))
    # a file that loads but holds no dict (a tensor, None): it was a traceback from the test of its names
    for value in (torch.zeros(3), None, [1, 2]):
        torch.save(value, path)
        with pytest.raises(train.TrainError, match=re.escape(f'{path} is not a checkpoint: it holds a '
                                                             f'{type(value).__name__}, not a dict of named entries')):
            train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))


def test_missing_checkpoint_on_resume_is_an_error(data, tmp_path):
    out = tmp_path / 'out'
    with pytest.raises(train.TrainError, match='no checkpoint at'):
        train.main(args(data, out, '--init_from=resume', '--max_iters=2'))
    assert not (out / 'metrics.jsonl').exists()


def test_real_checkpoint_loads_with_weights_only(data, tmp_path, monkeypatch):
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--dropout=0.1', '--eval_interval=2', '--max_iters=3')) == 0
    for name in ('ckpt.pt', 'best.pt'):
        ckpt = torch.load(out / name, map_location='cpu', weights_only=True)
        assert {'model', 'optimizer', 'scaler', 'iter_num', 'best_val_loss', 'rng', 'batches'} <= ckpt.keys()
    # and load_checkpoint is what asks for weights_only=True
    seen = []
    real = torch.load

    def spy(*a, **k):
        seen.append(k.get('weights_only'))
        return real(*a, **k)
    monkeypatch.setattr(torch, 'load', spy)
    assert train.load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 3
    assert seen == [True]


# ----------------------------------------------------------------------------------------------------
# 6. config changes on resume

def test_resume_with_another_model_shape_lists_each_difference(data, tmp_path):
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    ckpt_bytes, metrics_bytes = read_bytes(out / 'ckpt.pt'), read_bytes(out / 'metrics.jsonl')
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume',
                        '--n_layer=2', '--n_embd=32'))
    msg = str(e.value)
    assert 'n_layer: 1 -> 2' in msg and 'n_embd: 16 -> 32' in msg, msg
    assert str(out / 'ckpt.pt') in msg
    assert read_bytes(out / 'ckpt.pt') == ckpt_bytes and read_bytes(out / 'metrics.jsonl') == metrics_bytes


@pytest.fixture(scope='module')
def run2(tmp_path_factory):
    """A run of 2 iterations (evaluated and saved at 0 and 2) on its own data: copy its out_dir to resume it."""
    root = tmp_path_factory.mktemp('run2')
    data_dir = write_data(root / 'data')
    assert train.main(args(data_dir, root / 'out', '--eval_interval=2', '--max_iters=2')) == 0
    return data_dir, root / 'out'


@pytest.mark.parametrize('flag, change', [('--mlp=geglu', "mlp: 'swiglu' -> 'geglu'"),
                                          ('--rope_base=500.0', 'rope_base: 10000.0 -> 500.0'),
                                          ('--logit_softcap=30.0', 'logit_softcap: 0.0 -> 30.0')])
def test_resume_with_another_model_of_the_same_tensor_shapes_is_refused(run2, tmp_path, flag, change):
    # Reference: the setting as changed. These keys leave every tensor's shape as it was, so the weights would
    # load without a word into another model (a GeGLU MLP, other RoPE frequencies, a cap on the logits)
    data_dir, run = run2
    out = shutil.copytree(run, tmp_path / 'out')
    before = read_bytes(out / 'ckpt.pt')
    with pytest.raises(train.TrainError, match=re.escape(change)) as e:
        train.main(args(data_dir, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume', flag))
    assert 'has another shape than this config' in str(e.value) and read_bytes(out / 'ckpt.pt') == before


def test_resume_of_a_model_with_a_setting_this_model_py_lacks_is_refused(run2, tmp_path):
    # Reference: the field written here, as a newer model.py would save a feature this one lacks: resumed without
    # it, the model would silently be another one (it resumed, and trained on)
    data_dir, run = run2
    out = shutil.copytree(run, tmp_path / 'out')
    ckpt = load(out / 'ckpt.pt')
    ckpt['model_args']['sliding_window'] = 128
    torch.save(ckpt, out / 'ckpt.pt')
    before = read_bytes(out / 'ckpt.pt')
    with pytest.raises(train.TrainError, match="has settings this model.py does not know: sliding_window=128"):
        train.main(args(data_dir, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))
    assert read_bytes(out / 'ckpt.pt') == before


def test_resume_with_another_dropout_or_zero_init_proj_goes_on(run2, tmp_path, capsys):
    # Reference: train.py's rule for what a resumed run may change: dropout (regularisation, no weight) and
    # zero_init_proj (it only chose the initial weights); the resume says so and ends at iteration 4.
    data_dir, run = run2
    out = shutil.copytree(run, tmp_path / 'out')
    capsys.readouterr()
    assert train.main(args(data_dir, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume',
                           '--dropout=0.1', '--zero_init_proj=True')) == 0
    stdout = capsys.readouterr().out
    assert 'dropout: 0.0 -> 0.1' in stdout and 'zero_init_proj: False -> True' in stdout, stdout
    assert load(out / 'ckpt.pt')['iter_num'] == 4


def test_resume_with_changed_training_settings_works_and_prints_them(data, tmp_path, capsys):
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4')) == 0
    capsys.readouterr()
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=6', '--init_from=resume',
                           '--learning_rate=0.02', '--zero_init_proj=True', '--eval_at_start=False')) == 0
    stdout = capsys.readouterr().out
    assert 'learning_rate: 0.01 -> 0.02\n' in stdout and 'max_iters: 4 -> 6\n' in stdout, stdout
    # what only a run's start reads is listed as having no effect (the weights and iteration 0 are behind it)
    for key in ('zero_init_proj', 'eval_at_start'):
        assert re.search(rf'{key}: (True|False) -> (True|False)  \(no effect on a resumed run\)\n', stdout), stdout
    assert load(out / 'ckpt.pt')['iter_num'] == 6
    # Reference: the cosine schedule by hand with the new settings: at it=4 of warmup 2, decay to 6,
    # halfway down from 0.02 to min_lr 0.001.
    lr5 = [r['lr'] for r in read_metrics(out) if r.get('iter') == 5 and 'lr' in r]
    assert lr5 == [pytest.approx(0.001 + 0.5 * (0.02 - 0.001), rel=1e-12)]


@pytest.mark.parametrize('max_iters', [4, 2])
def test_resume_of_a_finished_run_says_there_is_nothing_to_train(data, tmp_path, capsys, max_iters):
    # Reference: the finished run's files, byte for byte: resumed with its own max_iters (or a lower one), a run
    # trains nothing and changes nothing, and says why rather than only "done".
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4')) == 0
    before = run_files(out)
    capsys.readouterr()
    assert train.main(args(data, out, '--eval_interval=2', f'--max_iters={max_iters}', '--init_from=resume')) == 0
    printed = capsys.readouterr()
    assert (f"nothing to train: max_iters={max_iters}, and the checkpoint is at iteration 4; a max_iters above 4 "
            f"trains on\n") in printed.out, printed.out
    assert run_files(out) == before
    assert 'warning' not in printed.err  # not the schedule's: at max_iters=2, that the rate only warms up


def test_reduce_overhead_off_cuda_is_a_warning(data, tmp_path, monkeypatch, capsys):
    # Reference: what the mode does: it records CUDA graphs, which no other device has, so elsewhere it compiles as
    # the default mode does; the run says so, as of any setting without effect (compile itself is not needed here)
    monkeypatch.setattr(train, 'compile_model', lambda r: (r.wrapped, f'on (mode {r.cfg.compile_mode})'))
    for mode, warned in (('reduce-overhead', True), ('max-autotune', False)):  # CPU GEMM templates: it tunes
        assert train.main(args(data, tmp_path / mode, '--max_iters=3', '--compile=True', f'--compile_mode={mode}')) == 0
        warnings = re.findall(r'^warning: (.*)$', capsys.readouterr().err, re.M)
        assert warnings == (["compile_mode='reduce-overhead' has no effect on cpu: it records CUDA graphs, which only "
                             "CUDA has, so this run compiles as compile_mode='default' does"] if warned else [])


def test_resume_counts_the_tokens_each_iteration_took(data, tmp_path):
    # Reference: tokens by hand: 2 iterations of 4 x 8, then 2 of 8 x 8 x 2 micro-batches after a resume that
    # changed the batch, then 2 of 4 x 8 again; before the count, metrics.jsonl multiplied the iteration by the
    # batch of now (320), and a count taken from the iteration and the checkpoint's batch would start the third
    # part at 4 x 128 = 512
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume', '--batch_size=8',
                           '--gradient_accumulation_steps=2')) == 0
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=6', '--init_from=resume')) == 0
    tokens = {r['iter']: r['tokens'] for r in read_metrics(out)}
    assert tokens == {0: 0, 1: 32, 2: 64, 3: 64 + 128, 4: 64 + 256, 5: 320 + 32, 6: 320 + 64}
    assert load(out / 'ckpt.pt')['tokens'] == 320 + 64


def test_resume_of_a_checkpoint_from_before_the_token_count_counts_its_own_batch(data, tmp_path):
    # Reference: tokens by hand. A checkpoint without 'tokens' (written before train.py counted them): its 2
    # iterations took 4 x 8 tokens each, by its own config's batch, not by the resumed run's 8 x 8 (which would give
    # 128 at iteration 2); from there 64 per iteration
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    ckpt = load(out / 'ckpt.pt')
    del ckpt['tokens']
    torch.save(ckpt, out / 'ckpt.pt')
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume',
                           '--batch_size=8')) == 0
    tokens = {r['iter']: r['tokens'] for r in read_metrics(out)}
    assert tokens == {0: 0, 1: 32, 2: 64, 3: 64 + 64, 4: 64 + 128}


@pytest.mark.parametrize('change', ['data_dir', '--seed=2', '--eval_iters=3', '--batch_size=2', 'prepared again'])
def test_resume_with_other_validation_data_resets_the_best_val_loss(data, tmp_path, monkeypatch, capsys, save_log,
                                                                     change):
    # Reference: best.pt's saves. Evaluated on other val data (data_dir changed, or prepared again in its place:
    # meta.json's token counts), or on other val batches (the seed, the number or the size of the eval batches
    # changed), a loss above the old best (4.5 > 4.0) is the best so far on what is measured now: best.pt is
    # written, and the reset said; resumed on the same data and batches, it is not
    # (test_best_keeps_the_best_weights_and_ckpt_the_latest). The earlier best.pt is moved aside, byte for byte (a
    # worse model replaced it). The checkpoint's own iteration (2) is evaluated again, on what is measured now; so
    # is a finished run's (4), which has no evaluation to come.
    out = tmp_path / 'out'
    # (other data of other sizes: data_dir's change alone is named, the directory being another)
    other, extra = (write_data(tmp_path / 'other', seed=1, n_val=300), []) if change == 'data_dir' else (data, [change])
    scripted_eval(monkeypatch, [5.0, 4.0])
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    best = read_bytes(out / 'best.pt')
    if change == 'prepared again':
        extra = []
        write_data(data, n_train=2100, n_val=500, seed=1)  # the same vocabulary, other token counts
    save_log.clear()
    scripted_eval(monkeypatch, [4.5, 4.7])
    capsys.readouterr()
    assert train.main(args(other, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume', *extra)) == 0
    key = 'the data (meta.json)' if change == 'prepared again' else change.removeprefix('--').split('=')[0]
    printed = capsys.readouterr().out
    assert (f"best val loss reset: {key} changed, which decides what the val loss measures; the next evaluation's "
            f"model is written to {out / 'best.pt'} (the earlier one moved aside then)") in printed
    assert (f"warning: {data} holds other data than the checkpoint's run trained on (meta.json: train_tokens 2000 "
            f"-> 2100, val_tokens 400 -> 500): the training batches go on at the checkpoint's place in it"
            in printed) == (change == 'prepared again')
    assert ('holds other data' in printed) == (change == 'prepared again')
    [keep] = glob.glob(str(out / 'previous-*'))
    assert os.listdir(keep) == ['best.pt'] and read_bytes(os.path.join(keep, 'best.pt')) == best
    assert f"{out / 'best.pt'}, the best under the checkpoint's settings, moved to {keep}" in printed
    assert [(name, it) for name, it, _ in save_log] == [('best.pt', 2), ('ckpt.pt', 2), ('ckpt.pt', 4)]
    assert load(out / 'best.pt')['best_val_loss'] == 4.5
    save_log.clear()
    scripted_eval(monkeypatch, [4.9])
    assert train.main(args(other, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume', *extra,
                           '--eval_iters=4')) == 0  # (after any eval_iters in extra: the last flag counts)
    assert [(name, it) for name, it, _ in save_log] == [('best.pt', 4), ('ckpt.pt', 4)]
    assert 'done: 4 iterations, best val loss 4.9000' in capsys.readouterr().out


@pytest.mark.parametrize('change', ['--batch_size=2', '--seed=2', 'data_dir'])
def test_resume_that_measures_the_same_val_loss_keeps_the_best(data, tmp_path, monkeypatch, capsys, save_log, change):
    # Reference: best.pt's saves, as test_best_keeps_the_best_weights_and_ckpt_the_latest has them. With eval_iters=0
    # both runs measure every window of the val split in order, whatever the batch and the seed (Windows); data_dir
    # spelled otherwise names the same files. A worse loss (4.5 > 4.0) must not replace the best weights; with
    # sampled batches, batch_size and seed do reset the best (test_resume_with_other_validation_data_resets_...)
    out = tmp_path / 'out'
    extra = [f'--data_dir={os.path.join(os.path.relpath(data), ".")}'] if change == 'data_dir' else [change]
    scripted_eval(monkeypatch, [5.0, 4.0])
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2', '--eval_iters=0')) == 0
    save_log.clear()
    scripted_eval(monkeypatch, [4.5, 4.7])
    capsys.readouterr()
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume', '--eval_iters=0',
                           *extra)) == 0
    assert 'best val loss reset' not in capsys.readouterr().out
    assert [(name, it) for name, it, _ in save_log] == [('ckpt.pt', 4)]
    assert load(out / 'best.pt')['best_val_loss'] == 4.0


@pytest.mark.parametrize('flag, change', [('--optimizer=muon', "optimizer: 'adamw' -> 'muon'"),
                                          ('--optimizer=adamw8bit', "optimizer: 'adamw' -> 'adamw8bit'")])
def test_resume_with_another_optimizer_is_an_error_naming_it(data, tmp_path, flag, change):
    # Reference: the setting as changed; before, the optimizer state failed to load with a KeyError from torch
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    before = read_bytes(out / 'ckpt.pt')
    with pytest.raises(train.TrainError, match=re.escape(change)) as e:
        train.main(args(data, out, '--max_iters=4', '--init_from=resume', flag))
    assert 'holds the state of another optimizer' in str(e.value) and read_bytes(out / 'ckpt.pt') == before


def test_resume_that_turns_optimizer_offload_on_is_refused(run2, tmp_path, capsys):
    # Reference: the setting as changed. torchao's offload optimizer has a state dict of its own: a plain
    # AdamW checkpoint does not load into it. optimizer_offload needs CUDA, so the check is called directly, with
    # the resumed run's pieces as setup() built them on the CPU and optimizer_offload=True in the config.
    data_dir, run = run2
    out = shutil.copytree(run, tmp_path / 'out')
    cfg = SimpleNamespace(**train.configure(train.DEFAULTS, args(data_dir, out, '--init_from=resume'), train.__file__))
    r = train.setup(cfg, [], 'cpu', 0, 1)
    r.cfg = SimpleNamespace(**{**vars(cfg), 'optimizer_offload': True})
    with pytest.raises(train.TrainError, match=re.escape('optimizer_offload: False -> True')) as e:
        train.start_or_resume(r)
    assert 'holds the state of another optimizer' in str(e.value)


def test_a_cpu_device_with_an_index_trains(data, tmp_path):
    # Reference: the run ends normally; torch.cuda.set_device('cpu:0') was an error
    assert train.main(args(data, tmp_path / 'out', '--device=cpu:0', '--max_iters=1')) == 0


NEW_MODEL_KEYS = ('head_dim', 'mlp_hidden', 'rope_scaling_factor', 'rope_low_freq_factor', 'rope_high_freq_factor',
                  'rope_original_max_len')


def test_checkpoint_from_before_the_size_fields_resumes_and_samples(data, tmp_path, capsys):
    # A checkpoint written before head_dim, mlp_hidden and the RoPE scaling were GPTConfig fields and settings lacks
    # them in model_args and config. Reference: the same checkpoint with them. sample.py prints the same text from
    # both; the old one resumes with no shape difference and no changed setting but max_iters; a changed head_dim
    # is still a shape difference.
    import sample
    new, old = tmp_path / 'new', tmp_path / 'old'
    assert train.main(args(data, new, '--eval_interval=2', '--max_iters=2')) == 0
    ckpt = load(new / 'ckpt.pt')
    assert ckpt['model_args']['head_dim'] == 8 and ckpt['config']['head_dim'] == 0  # n_embd 16, 2 heads
    old.mkdir()
    shutil.copy(new / 'metrics.jsonl', old)
    train.save_checkpoint(str(old / 'ckpt.pt'), {
        **ckpt, 'model_args': {k: v for k, v in ckpt['model_args'].items() if k not in NEW_MODEL_KEYS},
        'config': {k: v for k, v in ckpt['config'].items() if k not in NEW_MODEL_KEYS} | {'out_dir': str(old)}})
    texts = []
    for out in (new, old):
        capsys.readouterr()
        sample.main([f'--out_dir={out}', '--device=cpu', '--num_samples=1', '--max_new_tokens=20',
                     f"--start={ckpt['meta']['chars'][:3]}"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 20
    assert train.main(args(data, old, '--eval_interval=2', '--max_iters=4', '--init_from=resume')) == 0
    stdout = capsys.readouterr().out
    changed = stdout.split('resuming with changed settings (checkpoint -> now):\n')[1].split('\nresuming from')[0]
    assert changed.strip() == 'max_iters: 2 -> 4', stdout
    assert load(old / 'ckpt.pt')['iter_num'] == 4
    with pytest.raises(train.TrainError, match=r'head_dim: 8 -> 4'):
        train.main(args(data, new, '--eval_interval=2', '--max_iters=4', '--init_from=resume', '--head_dim=4'))


# ----------------------------------------------------------------------------------------------------
# 7. bad data, caught before training starts

def bad_data(kind, d):
    """Write a broken dataset to d; return the file the error must name and other strings it must hold."""
    d = str(d)
    p = lambda name: os.path.join(d, name)  # noqa: E731
    if kind == 'missing-train.bin':
        write_data(d)
        os.remove(p('train.bin'))
        return p('train.bin'), []
    if kind == 'missing-val.bin':
        write_data(d)
        os.remove(p('val.bin'))
        return p('val.bin'), []
    if kind == 'missing-meta.json':
        write_data(d)
        os.remove(p('meta.json'))
        return p('meta.json'), ['prepare_data.py']
    if kind == 'train-shorter-than-block':        # block_size 8 needs 9 tokens
        write_data(d, train_tokens=np.arange(8) % V)
        return p('train.bin'), ['8 tokens', '9']
    if kind == 'val-empty':
        write_data(d, val_tokens=np.zeros(0))
        return p('val.bin'), ['0 tokens', '9']
    if kind == 'token-id-past-vocab':             # id 200 with a vocabulary of 84 (model 128)
        tokens = np.random.default_rng(0).integers(0, 84, 2000)
        tokens[1234] = 200
        write_data(d, vocab=84, train_tokens=tokens)
        return p('train.bin'), ['200', '84']
    if kind == 'token-id-in-padding':             # id 100: inside the model's 128, outside meta's 84
        tokens = np.random.default_rng(0).integers(0, 84, 400)
        tokens[-1] = 100
        write_data(d, vocab=84, val_tokens=tokens)
        return p('val.bin'), ['100', '84']
    if kind == 'token-id-at-the-vocab-size':     # id 84, the first past meta's 84 ids (0 to 83; model 128)
        tokens = np.random.default_rng(0).integers(0, 84, 2000)
        tokens[7] = 84
        write_data(d, vocab=84, train_tokens=tokens)
        return p('train.bin'), ['id 84', '84 ids']
    if kind == 'meta-count-mismatch':
        write_data(d, n_train=2000, train_tokens=None)
        meta = json.load(open(p('meta.json')))
        meta['train_tokens'] = 2003
        json.dump(meta, open(p('meta.json'), 'w'))
        return p('train.bin'), ['4000 bytes', '2003']
    if kind == 'odd-byte-count':
        write_data(d, n_val=400)
        with open(p('val.bin'), 'ab') as f:
            f.write(b'\x01')
        return p('val.bin'), ['801 bytes', '400']
    if kind == 'meta-without-token-counts':
        write_data(d)
        meta = json.load(open(p('meta.json')))
        del meta['train_tokens'], meta['val_tokens']
        json.dump(meta, open(p('meta.json'), 'w'))
        return p('meta.json'), ['train_tokens']
    if kind == 'meta-not-json':
        write_data(d)
        with open(p('meta.json'), 'w') as f:
            f.write('{"tokenizer": "char", "vocab_')  # cut short
        return p('meta.json'), []
    if kind == 'meta-wrong-values':               # hand-edited: a dtype numpy lacks, a count as a string
        write_data(d)
        meta = json.load(open(p('meta.json')))
        meta.update(dtype='uint17', train_tokens='2000')
        json.dump(meta, open(p('meta.json'), 'w'))
        return p('meta.json'), ["train_tokens='2000'", "dtype='uint17'"]
    if kind in ('meta-null', 'meta-without-chars', 'meta-short-chars'):  # sample.py could not decode (a traceback)
        write_data(d)
        meta = json.load(open(p('meta.json')))
        if kind == 'meta-without-chars':
            del meta['chars']
        meta = None if kind == 'meta-null' else dict(meta, chars=meta['chars'][:5]) if 'chars' in meta else meta
        json.dump(meta, open(p('meta.json'), 'w'))
        return p('meta.json'), {'meta-null': ['NoneType'], 'meta-without-chars': ['lacks chars'],
                                'meta-short-chars': ['5 chars for vocab_size=40']}[kind]
    raise AssertionError(kind)


BAD_DATA = ['missing-train.bin', 'missing-val.bin', 'missing-meta.json', 'train-shorter-than-block', 'val-empty',
            'token-id-past-vocab', 'token-id-in-padding', 'token-id-at-the-vocab-size', 'meta-count-mismatch',
            'odd-byte-count', 'meta-without-token-counts', 'meta-not-json', 'meta-wrong-values', 'meta-null',
            'meta-without-chars', 'meta-short-chars']


@pytest.mark.parametrize('kind', BAD_DATA)
def test_bad_data_is_caught_before_training(tmp_path, kind):
    # Reference: the file at fault and the numbers involved; nothing written to out_dir.
    d, out = tmp_path / 'data', tmp_path / 'out'
    path, needles = bad_data(kind, d)
    with pytest.raises(train.TrainError) as e:
        train.main(args(d, out, '--eval_interval=2', '--max_iters=2'))
    msg = str(e.value)
    assert path in msg and all(s in msg for s in needles), msg
    assert not (out / 'ckpt.pt').exists() and not (out / 'metrics.jsonl').exists()


# ----------------------------------------------------------------------------------------------------
# 8. best and latest

def scripted_eval(monkeypatch, val_losses):
    """Replace train.estimate_loss: the k-th evaluation returns val_losses[k]; snapshot the model each time."""
    snapshots = []
    losses = iter(val_losses)

    def estimate_loss(model, splits, autocast):
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        v = next(losses)
        return {'train': v + 0.5, 'val': v}
    monkeypatch.setattr(train, 'estimate_loss', estimate_loss)
    return snapshots


def test_the_checkpoint_before_the_first_step_changes_nothing(data, tmp_path):
    # Reference: the same run without the evaluation and checkpoint at iteration 0 (eval_at_start=False). Saved
    # before any step, the optimizer has no state yet: the checkpoint holds None rather than the state of a
    # zero-gradient step taken to make one (which AdamW's bias correction would count), and training goes on
    # with the same losses and ends with the same weights and optimizer state.
    a, b = tmp_path / 'a', tmp_path / 'b'
    assert train.main(args(data, a, '--eval_interval=3', '--max_iters=3')) == 0
    assert train.main(args(data, b, '--eval_interval=3', '--max_iters=3', '--eval_at_start=False')) == 0
    assert [r['iter'] for r in read_metrics(a) if 'val_loss' in r] == [0, 3]
    assert [r['iter'] for r in read_metrics(b) if 'val_loss' in r] == [3]
    train_lines = lambda out: [r for r in deterministic(read_metrics(out)) if 'loss' in r]  # noqa: E731
    assert train_lines(a) == train_lines(b)
    ca, cb = load(a / 'ckpt.pt'), load(b / 'ckpt.pt')
    assert_same(ca['model'], cb['model'], 'model')
    assert_same(ca['optimizer'], cb['optimizer'], 'optimizer')


def test_best_keeps_the_best_weights_and_ckpt_the_latest(data, tmp_path, monkeypatch, save_log):
    # Evaluations at 0, 2, 4, 6, 8, 10 with val losses that go down to 3.0 at iteration 4, then up, and back to
    # 3.0 at 8: a tie, not better, keeps iteration 4's. Reference: the model's weights as each scripted evaluation
    # saw them, and best.pt's bytes at its save.
    out = tmp_path / 'out'
    snaps = scripted_eval(monkeypatch, [5.0, 4.0, 3.0, 3.5, 3.0, 3.2])
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=10')) == 0
    assert [it for name, it, _ in save_log if name == 'best.pt'] == [0, 2, 4]
    best_bytes = [b for name, it, b in save_log if name == 'best.pt'][-1]
    assert read_bytes(out / 'best.pt') == best_bytes
    best, latest = load(out / 'best.pt'), load(out / 'ckpt.pt')
    assert best['iter_num'] == 4 and best['best_val_loss'] == 3.0
    assert_same(best['model'], snaps[2], 'best.pt model vs weights at iteration 4')
    assert latest['iter_num'] == 10 and latest['best_val_loss'] == 3.0
    assert_same(latest['model'], snaps[5], 'ckpt.pt model vs weights at iteration 10')
    assert not torch.equal(best['model']['wte.weight'], latest['model']['wte.weight'])
    assert [r['val_loss'] for r in read_metrics(out) if 'val_loss' in r] == [5.0, 4.0, 3.0, 3.5, 3.0, 3.2]

    # resumed: the best val loss comes from the checkpoint, so a worse evaluation (3.1 at 12) does not
    # overwrite best.pt, and a better one (2.0 at 14) does
    save_log.clear()
    snaps = scripted_eval(monkeypatch, [3.1, 2.0])
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=14', '--init_from=resume')) == 0
    assert [(name, it) for name, it, _ in save_log] == [('ckpt.pt', 12), ('best.pt', 14), ('ckpt.pt', 14)]
    best = load(out / 'best.pt')
    assert best['iter_num'] == 14 and best['best_val_loss'] == 2.0
    assert_same(best['model'], snaps[1])


# ----------------------------------------------------------------------------------------------------
# 9. an earlier run in out_dir

def run_files(out):
    return {name: read_bytes(out / name) for name in ('ckpt.pt', 'best.pt', 'metrics.jsonl', 'metrics.png')}


def test_scratch_run_moves_an_earlier_run_aside(data, tmp_path, capsys):
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2', '--seed=1')) == 0
    first = run_files(out)
    capsys.readouterr()
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=3', '--seed=2')) == 0
    kept = glob.glob(str(out / 'previous-*'))
    assert len(kept) == 1
    assert {name: read_bytes(os.path.join(kept[0], name)) for name in first} == first
    assert load(out / 'ckpt.pt')['iter_num'] == 3  # the new run's own files
    assert [r['iter'] for r in read_metrics(out) if 'loss' in r] == [1, 2, 3]
    # the flags it prints continue the earlier run (iteration 2), not the new one (it said: use --init_from=resume)
    flags = re.search(r'to continue it: (--out_dir=\S+ --init_from=resume)\)', capsys.readouterr().out).group(1)
    assert train.main(TINY + [f'--data_dir={data}', '--eval_interval=2', '--max_iters=4', *flags.split()]) == 0
    assert 'resuming from' in capsys.readouterr().out and load(os.path.join(kept[0], 'ckpt.pt'))['iter_num'] == 4
    # an earlier run without a checkpoint has nothing to continue: no such flags
    os.remove(out / 'ckpt.pt')
    os.remove(out / 'best.pt')
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=1')) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if 'held an earlier run' in ln)
    assert 'continue' not in line and 'init_from' not in line, line


def test_a_start_that_fails_leaves_the_earlier_run_in_place(data, tmp_path):
    # Reference: the earlier run's files, byte for byte, where they were. Checks that come late in setup (an optimizer
    # this device cannot run; so do wandb's start and init_from=hf:'s vocabulary, test_hf.py) used to fail after the
    # files had been moved aside, and a retry that failed again moved them once more
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    before = run_files(out)
    for _ in range(2):
        with pytest.raises(train.TrainError, match='optimizer=paged_adamw8bit needs CUDA'):
            train.main(args(data, out, '--eval_interval=2', '--max_iters=2', '--optimizer=paged_adamw8bit'))
    assert run_files(out) == before and not glob.glob(str(out / 'previous-*'))


def test_resume_without_a_checkpoint_names_the_one_moved_aside(data, tmp_path):
    # Reference: the folders a scratch run moved the earlier runs into: the resume names the latest one's checkpoint
    # (in an out_dir whose name holds glob's brackets)
    out = tmp_path / 'out[1]'
    for folder in ('previous-20250101-120000-a', 'previous-20250102-090000-b'):
        (out / folder).mkdir(parents=True)
        (out / folder / 'ckpt.pt').write_bytes(b'')
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--init_from=resume'))
    assert str(e.value) == (f"no checkpoint at {out}/ckpt.pt; a scratch run moved an earlier run's aside: to continue "
                            f"the latest, --out_dir={shlex.quote(f'{out}/previous-20250102-090000-b')} "
                            f"--init_from=resume")


def test_two_scratch_restarts_in_the_same_second_keep_both_runs(data, tmp_path, monkeypatch):
    # previous-<date-time> has a one-second resolution: three scratch runs within one second (simulated
    # by freezing the clock that names the folder) must still keep both earlier runs.
    monkeypatch.setattr(time, 'strftime', lambda fmt, *a: 'previous-20250101-120000')
    out = tmp_path / 'out'
    runs = []
    for seed in (1, 2, 3):
        assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2', f'--seed={seed}')) == 0
        runs.append(run_files(out))
    kept = sorted(glob.glob(str(out / 'previous-*')))
    assert len(kept) == 2
    assert sorted([{n: read_bytes(os.path.join(k, n)) for n in runs[0]} for k in kept], key=str) == \
        sorted(runs[:2], key=str)


# ----------------------------------------------------------------------------------------------------
# the command line

def test_cli_misspelled_flag_is_one_line_without_traceback():
    proc = run_cli('--learning_rat=1')
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "'learning_rat'" in lines[0] and "'learning_rate'" in lines[0]
    assert 'Traceback' not in proc.stderr + proc.stdout


def test_config_error_in_process():
    with pytest.raises(ConfigError, match="learning_rate"):
        train.main(['--learning_rat=1'])
    # a bool written in lower case: the message says how to write it
    with pytest.raises(ConfigError, match=re.escape("got 'true' (str), expected bool (default False): write True or "
                                                    "False")):
        train.main(['--compile=true'])


# ----------------------------------------------------------------------------------------------------
# review findings

def test_resume_applies_changed_optimizer_settings(data, tmp_path):
    # Reference: the values given on the resumed run's command line. The optimizer's saved param groups
    # must not silently keep the checkpoint's weight decay and betas while the run prints the change.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume',
                           '--weight_decay=0.0', '--beta2=0.5')) == 0
    groups = torch.load(out / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
    assert {g['weight_decay'] for g in groups} == {0.0}
    assert {tuple(g['betas']) for g in groups} == {(0.9, 0.5)}


def test_fp16_scaler_skips_are_counted_and_leave_the_weights(monkeypatch):
    # An fp16 step whose loss is finite but whose gradient overflows is skipped by the GradScaler; the
    # guard must report it as a skipped step (ok False), and the weights must not move.
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=V, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler('cpu')
    x = torch.randint(V, (4, 8))
    batches = type('B', (), {'next': lambda self: (x, x)})()
    model.wte.weight.register_hook(lambda g: torch.full_like(g, float('inf')))
    before = [p.detach().clone() for p in model.parameters()]
    autocast = torch.autocast('cpu', dtype=torch.float16)
    loss, _, ok = train.train_step(model, opt, scaler, batches, 1, autocast, 1.0)
    assert torch.isfinite(loss) and not ok
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_resume_from_a_float32_checkpoint(data, tmp_path):
    # A float32 run saves an empty GradScaler state; resuming it in fp16 starts a fresh scaler instead of
    # failing with "The source state dict is empty".
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    argv = [a for a in args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume')
            if not a.startswith('--dtype=')] + ['--dtype=float16']
    assert train.main(argv) == 0
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4


def test_impossible_model_shape_is_a_config_error(data, tmp_path):
    # n_embd=16 with n_head=5: GPTConfig's check, reported as a config error naming the fields
    with pytest.raises(ConfigError, match=r"n_embd=16.*n_head=5"):
        train.main(args(data, tmp_path / 'out', '--n_head=5', '--max_iters=1'))


# ----------------------------------------------------------------------------------------------------
# 10. vocabularies: a checkpoint resumes only on data whose token ids mean the same tokens

PANGRAM = 'the quick brown fox jumps over the lazy dog\n'  # 26 letters, space and newline: 28 characters


@pytest.fixture(scope='module')
def char_runs(tmp_path_factory):
    """Three char-level datasets prepared by prepare_data.py and a run of 2 iterations on the first:
    'a' (28 characters), 'subset' (the same text without q and z: 26 characters, also padded to 64 ids),
    'new_text' (other lines, the same 28 characters)."""
    from prepare_data import prepare
    root = tmp_path_factory.mktemp('vocab')
    texts = {'a': PANGRAM * 60, 'subset': PANGRAM.replace('q', 'k').replace('z', 's') * 60,
             'new_text': 'lazy dogs jump over the quick brown fox\n' * 60}
    for name, text in texts.items():
        (root / f'{name}.txt').write_text(text)
        prepare(input=str(root / f'{name}.txt'), tokenizer='char', data_dir=str(root / name))
    assert train.main(args(root / 'a', root / 'out', '--eval_interval=2', '--max_iters=2')) == 0
    return root


def test_resume_on_another_character_set_of_the_same_size_is_refused(char_runs, tmp_path):
    # Reference: the two texts' character sets (q and z only in the checkpoint's), the padded vocabulary both
    # share (64, so the shape check passes), and ckpt.pt and metrics.jsonl as they were.
    out = tmp_path / 'out'
    shutil.copytree(char_runs / 'out', out)
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['model_args']['vocab_size'] == 64 and len(ckpt['meta']['chars']) == 28
    before = read_bytes(out / 'ckpt.pt'), read_bytes(out / 'metrics.jsonl')
    with pytest.raises(train.TrainError) as e:
        train.main(args(char_runs / 'subset', out, '--eval_interval=2', '--max_iters=4', '--init_from=resume'))
    msg = str(e.value)
    assert str(out / 'ckpt.pt') in msg and str(char_runs / 'subset') in msg, msg
    assert "28 characters, the data 26" in msg and "only in the checkpoint's: 'qz'" in msg, msg
    assert "only in the data's: none" in msg and '\n' not in msg, msg
    assert (read_bytes(out / 'ckpt.pt'), read_bytes(out / 'metrics.jsonl')) == before


def test_resume_on_new_text_with_the_same_vocabulary_goes_on(char_runs, tmp_path, capsys):
    # Finetuning: other text, the same characters. The run resumes at iteration 2, says that data_dir
    # changed, and its checkpoint now names the new data.
    out = tmp_path / 'out'
    shutil.copytree(char_runs / 'out', out)
    capsys.readouterr()
    assert train.main(args(char_runs / 'new_text', out, '--eval_interval=2', '--max_iters=4',
                           '--init_from=resume')) == 0
    stdout = capsys.readouterr().out
    assert 'at iteration 2' in stdout and f"data_dir: '{char_runs / 'a'}' -> '{char_runs / 'new_text'}'" in stdout
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 4 and ckpt['meta']['sources'] == [str(char_runs / 'new_text.txt')]


CHARS = ''.join(chr(0x100 + i) for i in range(V))
META = {
    'char': dict(tokenizer='char', vocab_size=V, chars=CHARS),
    'char-other': dict(tokenizer='char', vocab_size=V, chars=CHARS[:-1] + 'z'),
    'char-reordered': dict(tokenizer='char', vocab_size=V, chars=CHARS[::-1]),
    'gpt2': dict(tokenizer='gpt2', vocab_size=50257, eot_token=50256),
    'gpt2-other-data': dict(tokenizer='gpt2', vocab_size=50257, eot_token=50256, sources=['other.txt']),
    'cl100k_base': dict(tokenizer='cl100k_base', vocab_size=100277, eot_token=100257),
    'hf': dict(tokenizer='hf:a/tokenizer.json', vocab_size=V, tokenizer_sha256='ab' * 32),
    'hf-same-file-elsewhere': dict(tokenizer='hf:b/tokenizer.json', vocab_size=V, tokenizer_sha256='ab' * 32),
    'hf-other-file': dict(tokenizer='hf:a/tokenizer.json', vocab_size=V, tokenizer_sha256='cd' * 32),
}


@pytest.mark.parametrize('ckpt, data, needles', [
    ('char', 'char', None),
    ('gpt2', 'gpt2-other-data', None),
    ('hf', 'hf-same-file-elsewhere', None),
    ('char', 'char-other', ['40 characters, the data 40', f"checkpoint's: {CHARS[-1]!r}", "data's: 'z'"]),
    ('char', 'char-reordered', ['the same 40 characters, in another order']),
    ('char', 'gpt2', ['char level (40 characters)', 'tiktoken gpt2']),
    ('gpt2', 'cl100k_base', ['tiktoken gpt2', 'tiktoken cl100k_base']),
    ('hf', 'hf-other-file', ['abababababab', 'cdcdcdcdcdcd']),
    ('hf', 'gpt2', ['hf:a/tokenizer.json', 'tiktoken gpt2']),
])
def test_vocabulary_mismatch_names_both(ckpt, data, needles):
    # Reference: what tells the vocabularies apart (characters, encoding names, tokenizer.json hashes);
    # None where the ids mean the same tokens (the same tokenizer, other data; the same file elsewhere).
    msg = train.vocabulary_mismatch(META[ckpt], META[data])
    if needles is None:
        assert msg is None
    else:
        assert msg and all(s in msg for s in needles) and '\n' not in msg, msg


def test_vocabulary_mismatch_lists_up_to_40_characters_in_full():
    # Reference: the rule in the message: up to 40 differing characters listed whole, more cut at 40 with '...'.
    # 40 other characters: all 40 shown, without '...'; 41: the first 40, then '...'.
    other = ''.join(chr(0x200 + i) for i in range(41))
    for n in (40, 41):
        msg = train.vocabulary_mismatch(dict(META['char'], vocab_size=n, chars=CHARS[:n] if n == 40 else CHARS + 'z'),
                                        dict(META['char'], vocab_size=n, chars=other[:n]))
        assert f"only in the data's: {other[:40]!r}" + ('...' if n == 41 else ';') in msg + ';', msg


def test_sample_decodes_with_the_checkpoints_vocabulary(data, tmp_path, capsys):
    # Reference: the text sample.py prints while the training data is in place. It must print the same when
    # the data directory is gone and when it holds another vocabulary of the same size: the tokenizer comes
    # from the checkpoint.
    import sample
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    chars = load(out / 'ckpt.pt')['meta']['chars']
    argv = [f'--out_dir={out}', '--device=cpu', '--num_samples=2', '--max_new_tokens=30', f'--start={chars[:3]}']

    def sample_text():
        capsys.readouterr()
        sample.main(argv)
        return capsys.readouterr().out

    reference = sample_text()
    samples = reference.split('\n' + '-' * 80 + '\n')
    assert samples[-1] == '' and len(samples) == 3
    assert all(len(s) == 33 and s.startswith(chars[:3]) and set(s) <= set(chars) for s in samples[:2]), samples
    shutil.rmtree(data)
    assert sample_text() == reference
    write_data(data, chars=''.join(chr(0x400 + i) for i in range(V)))
    assert sample_text() == reference


def test_sample_errors_name_the_device_the_checkpoint_and_the_tokenizer(data, tmp_path, capsys, monkeypatch):
    # Reference: the messages. Without these checks a device this machine lacks was reported as a corrupt
    # checkpoint (it was loaded onto that device), a .pt file without the training entries and a tokenizer that
    # cannot be loaded here (tiktoken's files offline) were tracebacks; a prompt longer than block_size was
    # cut without a word
    import sample
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    base = [f'--out_dir={out}', '--device=cpu', '--max_new_tokens=2', '--num_samples=1']
    with pytest.raises(ConfigError, match=re.escape("device='cuda:7', but this machine has")):
        sample.main([*base, '--device=cuda:7'])
    ckpt = load(out / 'ckpt.pt')
    torch.save({'model': ckpt['model']}, out / 'weights.pt')
    with pytest.raises(train.TrainError, match=re.escape(f"{out}/weights.pt is not a checkpoint of train.py: it "
                                                         f"lacks model_args, meta")):
        sample.main([*base, '--ckpt=weights.pt'])
    torch.save({**ckpt, 'meta': dict(tokenizer='gpt2', vocab_size=V)}, out / 'bpe.pt')
    monkeypatch.setattr(sample, 'get_tokenizer', lambda meta: prepare_data.load_bpe('no-such-encoding'))
    with pytest.raises(train.TrainError, match=re.escape(f"{out}/bpe.pt: its tokenizer: tokenizer 'no-such-encoding' "
                                                         "could not be loaded")) as e:
        sample.main([*base, '--ckpt=bpe.pt'])
    # what to do about it, without prepare_data.py's advice (a --tokenizer flag sample.py does not have)
    assert str(e.value).endswith("(TIKTOKEN_CACHE_DIR sets where): load it once where there is one")
    monkeypatch.undo()
    # checkpoints train.py does not write: a model_args key model.py lacks, a shape GPTConfig refuses, a compiled
    # model's weight names (as export.py says them; they were tracebacks)
    torch.save({**ckpt, 'model_args': {**ckpt['model_args'], 'bias': True}}, out / 'unknown.pt')
    with pytest.raises(train.TrainError, match=re.escape(f"{out}/unknown.pt: its model_args do not make a model.py "
                                                         "config: ") + ".*'bias'"):
        sample.main([*base, '--ckpt=unknown.pt'])
    torch.save({**ckpt, 'model_args': {**ckpt['model_args'], 'n_head': 5, 'head_dim': 0}}, out / 'shape.pt')
    with pytest.raises(train.TrainError, match=re.escape(f"{out}/shape.pt: its model_args do not make a model.py "
                                                         "config: GPTConfig: n_embd=16 is not divisible by n_head=5")):
        sample.main([*base, '--ckpt=shape.pt'])
    torch.save({**ckpt, 'model': {f'_orig_mod.{k}': v for k, v in ckpt['model'].items()}}, out / 'compiled.pt')
    with pytest.raises(train.TrainError, match=re.escape(f"{out}/compiled.pt: its weights do not fit its model_args "
                                                         "(its names start with _orig_mod.: saved from a compiled "
                                                         "model): Error(s) in loading state_dict for GPT: Missing")):
        sample.main([*base, '--ckpt=compiled.pt'])
    capsys.readouterr()
    sample.main([*base, f'--start={ckpt["meta"]["chars"][0] * 20}'])  # block_size 8
    assert "the prompt's 20 tokens are cut to the model's block_size, its last 8" in capsys.readouterr().err
    # 2**47 samples of one token: 2**50 bytes, more than any address space, so the CPU allocator refuses at once
    with pytest.raises(train.TrainError, match=re.escape(f"out of memory on cpu generating num_samples={2**47} "
                                                         f"samples at once (one batch, 3 tokens each): fewer")):
        sample.main([*base, f'--num_samples={2**47}', f'--start={ckpt["meta"]["chars"][0]}'])


# ----------------------------------------------------------------------------------------------------
# 11. file-system failures: one line naming the path, before training where they can be seen then

def oserror(code, path=None):
    return OSError(code, os.strerror(code), *([os.fspath(path)] if path is not None else []))


def fail_for(monkeypatch, owner, name, match, code):
    """Make owner.name(path, ...) raise OSError(code) when match(path), and call through otherwise."""
    real = getattr(owner, name)

    def fake(path, *a, **k):
        if match(os.fspath(path)):
            raise oserror(code, path)
        return real(path, *a, **k)
    monkeypatch.setattr(owner, name, fake)


def no_model(monkeypatch):
    """Building the model fails the test: the checks must come before it."""
    def built(*a, **k):
        raise AssertionError('the model was built before the failing check')
    monkeypatch.setattr(train, 'GPT', built)


OUT_DIR_FAULTS = ['a-file', 'under-a-file', 'mkdir-EACCES', 'probe-open-EACCES', 'probe-write-ENOSPC',
                  'probe-fsync-ENOSPC', 'read-only-dir']


@pytest.mark.parametrize('fault', OUT_DIR_FAULTS)
def test_out_dir_that_cannot_be_written_is_an_error_before_the_model(data, tmp_path, monkeypatch, fault):
    # Reference: the path and the OS's reason in one line, raised before the model is built; no probe file
    # left behind; a file at out_dir's path untouched.
    out = tmp_path / 'out'
    inside = lambda p: os.path.dirname(p) == str(out)  # noqa: E731
    if fault == 'a-file':
        out.write_bytes(b'notes')
        reason = 'is a file, not a directory'
    elif fault == 'under-a-file':
        (tmp_path / 'notes').write_bytes(b'notes')
        out = tmp_path / 'notes' / 'out'
        reason = 'Not a directory'
    elif fault == 'mkdir-EACCES':
        fail_for(monkeypatch, os, 'mkdir', lambda p: p == str(out), errno.EACCES)
        reason = 'Permission denied'
    elif fault == 'probe-open-EACCES':
        fail_for(monkeypatch, os, 'open', inside, errno.EACCES)
        reason = 'Permission denied'
    elif fault in ('probe-write-ENOSPC', 'probe-fsync-ENOSPC'):
        if not os.path.isdir('/proc/self/fd'):
            pytest.skip('needs /proc to tell which file a descriptor is')
        name = fault.split('-')[1]
        real = getattr(os, name)

        def full(fd, *a):
            if inside(os.readlink(f'/proc/self/fd/{fd}')):
                raise oserror(errno.ENOSPC)
            return real(fd, *a)
        monkeypatch.setattr(os, name, full)
        reason = 'No space left on device'
    else:
        if os.geteuid() == 0:
            pytest.skip('root writes to read-only directories')
        out.mkdir()
        out.chmod(0o555)
        reason = 'Permission denied'
    no_model(monkeypatch)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--max_iters=2'))
    monkeypatch.undo()
    msg = str(e.value)
    assert str(out) in msg and reason in msg and '\n' not in msg, msg
    if out.is_dir():
        assert os.listdir(out) == []
    if fault == 'a-file':
        assert read_bytes(out) == b'notes'


@pytest.mark.parametrize('fault', ['meta.json', 'train.bin', 'val.bin', 'chmod-train.bin', 'data_dir-a-file'])
def test_unreadable_data_is_an_error_naming_the_file(data, tmp_path, monkeypatch, fault):
    # Reference: the file and the OS's reason, before the model is built and before out_dir is created.
    out = tmp_path / 'out'
    if fault == 'data_dir-a-file':
        shutil.rmtree(data)
        with open(data, 'w') as f:
            f.write('notes')
        path, reason = os.path.join(data, 'meta.json'), 'Not a directory'
    elif fault.startswith('chmod-'):
        if os.geteuid() == 0:
            pytest.skip('root reads files without read permission')
        path, reason = os.path.join(data, 'train.bin'), 'Permission denied'
        os.chmod(path, 0)
    else:
        path, reason = os.path.join(data, fault), 'Permission denied'
        import builtins
        fail_for(monkeypatch, builtins, 'open', lambda p: p == path, errno.EACCES)
    no_model(monkeypatch)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--max_iters=2'))
    monkeypatch.undo()
    msg = str(e.value)
    assert path in msg and reason in msg and '\n' not in msg, msg
    assert not out.exists()


class HalfWritten:
    """A file whose write() puts half the text on disk, then fails as a full disk does."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, text):
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        raise oserror(errno.ENOSPC)

    def writelines(self, lines):
        self.write(''.join(lines))


def metrics_faults(monkeypatch, failing, modes=('a',)):
    """Opened in one of `modes`, the files named metrics.jsonl* fail: the writes numbered in `failing`
    (0-based; 'all' for every one) write half their line, then raise ENOSPC."""
    import builtins
    real_open, count = builtins.open, {'n': 0}

    def fake(file, mode='r', *a, **k):
        f = real_open(file, mode, *a, **k)
        if os.path.basename(os.fspath(file)).startswith('metrics.jsonl') and mode in modes:
            count['n'] += 1
            if failing == 'all' or count['n'] - 1 in failing:
                return HalfWritten(f)
        return f
    monkeypatch.setattr(builtins, 'open', fake)


@pytest.mark.parametrize('failing', [{3, 4}, 'all'], ids=['two-lines', 'every-line'])
def test_failed_metrics_writes_warn_and_the_run_goes_on(data, tmp_path, monkeypatch, capsys, failing):
    # Reference: the same run without the fault: the same weights in ckpt.pt and best.pt (the fault must not
    # change training), its metrics lines less the lost ones, and never a half line. One warning naming
    # the file for a stretch of failures; when writes work again, the number of lines lost.
    flags = ['--eval_interval=3', '--max_iters=6']
    straight, out = tmp_path / 'straight', tmp_path / 'out'
    assert train.main(args(data, straight, *flags)) == 0
    want = deterministic(read_metrics(straight))
    metrics_faults(monkeypatch, failing)
    capsys.readouterr()
    assert train.main(args(data, out, *flags)) == 0
    monkeypatch.undo()
    stdout, stderr = capsys.readouterr()
    warnings = [ln for ln in stderr.splitlines() if 'warning' in ln]
    assert len(warnings) == 1 and str(out / 'metrics.jsonl') in warnings[0], stderr
    assert 'No space left on device' in warnings[0]
    for name in ('ckpt.pt', 'best.pt'):
        a, b = load(straight / name), load(out / name)
        assert a['iter_num'] == b['iter_num'] and (name == 'best.pt' or b['iter_num'] == 6)
        assert_same(a['model'], b['model'], f'{name} model')
    if failing == 'all':
        assert read_bytes(out / 'metrics.jsonl') == b''
    else:
        assert deterministic(read_metrics(out)) == [r for i, r in enumerate(want) if i not in failing]
        assert f"{out / 'metrics.jsonl'} is written again; 2 line(s) were lost" in stdout
        assert stdout.count('is written again') == 1, stdout  # once, at the first line that is written again


def test_failed_metrics_rewrite_on_resume_loses_nothing(data, tmp_path, monkeypatch):
    # A resume rewrites metrics.jsonl without the lines logged after the checkpoint. A full disk during that
    # rewrite is an error naming the file, and metrics.jsonl and ckpt.pt keep every byte.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=4', '--max_iters=6')) == 0
    torch.save({**load(out / 'ckpt.pt'), 'iter_num': 4}, out / 'ckpt.pt')  # a checkpoint older than the log
    before = read_bytes(out / 'metrics.jsonl'), read_bytes(out / 'ckpt.pt')
    metrics_faults(monkeypatch, 'all', modes=('w', 'a', 'r+', 'wb', 'ab'))
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=4', '--max_iters=8', '--init_from=resume'))
    monkeypatch.undo()
    assert str(out / 'metrics.jsonl') in str(e.value) and 'No space left on device' in str(e.value)
    assert (read_bytes(out / 'metrics.jsonl'), read_bytes(out / 'ckpt.pt')) == before
    assert sorted(os.listdir(out)) == ['best.pt', 'ckpt.pt', 'metrics.jsonl', 'metrics.png']  # the first run's


def test_resume_drops_a_metrics_line_cut_short(data, tmp_path, capsys):
    # A crash (or a full disk) mid-line leaves half a JSON line at the end of metrics.jsonl. Reference: the
    # uninterrupted run's lines; the resumed run drops the half line, says so, and logs the same lines.
    flags = ['--eval_interval=2', '--lr_decay_iters=6']
    straight, out = tmp_path / 'straight', tmp_path / 'out'
    assert train.main(args(data, straight, *flags, '--max_iters=6')) == 0
    assert train.main(args(data, out, *flags, '--max_iters=4')) == 0
    with open(out / 'metrics.jsonl', 'a') as f:
        f.write('{"iter": 5, "loss": 3.1')
    capsys.readouterr()
    assert train.main(args(data, out, *flags, '--max_iters=6', '--init_from=resume')) == 0
    assert 'dropped 1 unreadable line' in capsys.readouterr().out
    assert deterministic(read_metrics(out)) == deterministic(read_metrics(straight))


@pytest.mark.parametrize('how', ['no-newline', 'not-an-object', 'no-iter', 'not-utf8', 'deleted'])
def test_resume_keeps_metrics_whatever_the_end_of_the_file(data, tmp_path, capsys, how):
    # Reference: the uninterrupted run's lines. The last line may lack its newline (a crash between the record
    # and its newline): kept, and the next line starts on a line of its own. A line that is JSON but no record
    # (a number, an object without 'iter') is dropped as unreadable, as is one with bytes that are not UTF-8 (a
    # failure's garbage: it was a UnicodeDecodeError traceback, and the run could not resume). A deleted
    # metrics.jsonl is no reason to stop: the resumed run writes its own lines.
    flags = ['--eval_interval=2', '--lr_decay_iters=6']
    straight, out = tmp_path / 'straight', tmp_path / 'out'
    assert train.main(args(data, straight, *flags, '--max_iters=6')) == 0
    assert train.main(args(data, out, *flags, '--max_iters=4')) == 0
    path = out / 'metrics.jsonl'
    if how == 'no-newline':
        path.write_bytes(read_bytes(path).rstrip(b'\n'))
    elif how == 'deleted':
        path.unlink()
    elif how == 'not-utf8':
        with open(path, 'ab') as f:
            f.write(b'{"iter": 5, "loss\xff\xfe\n')
    else:
        with open(path, 'a') as f:
            f.write('12\n' if how == 'not-an-object' else '{"loss": 3.1}\n')
    capsys.readouterr()
    assert train.main(args(data, out, *flags, '--max_iters=6', '--init_from=resume')) == 0
    want = deterministic(read_metrics(straight))
    if how == 'deleted':
        assert deterministic(read_metrics(out)) == [r for r in want if r['iter'] > 4]
        return
    assert ('dropped 1 unreadable line' in capsys.readouterr().out) == (how != 'no-newline')
    assert deterministic(read_metrics(out)) == want


def test_failed_move_of_an_earlier_run_is_an_error_and_keeps_it(data, tmp_path, monkeypatch):
    # Reference: the earlier run's bytes, still in place after a move that failed; no empty previous-* folder.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    before = run_files(out)
    fail_for(monkeypatch, shutil, 'move', lambda p: True, errno.EACCES)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, out, '--eval_interval=2', '--max_iters=2', '--seed=2'))
    monkeypatch.undo()
    assert str(out) in str(e.value) and 'Permission denied' in str(e.value) and '\n' not in str(e.value)
    assert run_files(out) == before and not glob.glob(str(out / 'previous-*'))


def test_out_dir_error_under_torchrun_stops_every_process(data, tmp_path):
    # Process 0 alone probes out_dir; the other one must not hang at the next collective, nor write.
    # Reference: both processes end; process 0 prints a one-line error naming itself, the path and the reason, the
    # other nothing ("process 0 stopped with an error" would say nothing more).
    out = tmp_path / 'out'
    out.write_bytes(b'notes')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
           *args(data, out, '--max_iters=2', '--gradient_accumulation_steps=2')]
    proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS='1'))
    output = proc.stdout + proc.stderr
    errors = re.findall(r'^train\.py: error: (.*)$', output, re.M)
    assert proc.returncode != 0 and errors == [f'process 0 of 2: out_dir {out} is a file, not a directory'], \
        output[-3000:]
    assert read_bytes(out) == b'notes'


# ----------------------------------------------------------------------------------------------------
# 12. config values out of range: an error naming the key before anything is read or built

NAN, INF = float('nan'), float('inf')
BAD_VALUES = {  # key: values that make no sense for it (eval_iters=0 means the whole val split)
    'batch_size': [0, -1], 'block_size': [0, -8], 'gradient_accumulation_steps': [0, -2], 'n_layer': [0, -1],
    'n_head': [0, -2], 'n_embd': [0, -16], 'eval_interval': [0, -1], 'eval_iters': [-1], 'log_interval': [0, -1],
    'max_nonfinite_steps': [0, -1], 'max_iters': [-1], 'warmup_iters': [-1], 'lr_decay_iters': [-1],
    'n_kv_head': [-1], 'vocab_size': [-64], 'seed': [-1, 2**63], 'head_dim': [-2, 3], 'mlp_hidden': [-1],
    'learning_rate': [0.0, -1e-3, NAN, INF], 'min_lr': [-1e-5, 0.02, NAN, INF],
    'weight_decay': [-0.1, NAN, INF], 'grad_clip': [-1.0, NAN, INF],
    'dropout': [-0.1, 1.0, NAN, INF], 'label_smoothing': [-0.1, 1.0, NAN, INF],
    'beta1': [-0.1, 1.0, NAN, INF], 'beta2': [-0.5, 1.0, 1.5, NAN], 'muon_momentum': [-0.1, 1.0, NAN],
    'rope_base': [1.0, 0.5, 0.0, -10000.0, NAN, INF],
    'out_dir': [''], 'data_dir': [''],
    'muon_ns_steps': [0, -1], 'logit_softcap': [-1.0, NAN, INF],
    'short_block_size': [-4, 3, 8, 16], 'short_block_iters': [-1],  # block_size 8: 8 / 2**k only
    'wsd_decay_frac': [0.0, 1.5, -0.1, NAN], 'lr_schedule': ['linear'], 'mlp': ['relu'],
    'init_from': ['resum', 'hf:'], 'optimizer': ['adam'], 'activation_checkpointing': ['some'], 'dtype': ['fp16'],
    'compile_mode': ['fast'], 'fp8_recipe': ['blockwise'], 'parallelism': ['tp'], 'muon_dtype': ['fp32', 'float16'],
    'device': ['gpu', 'meta', 'cuda', 'cuda:7', 'mps'],
}


def test_every_numeric_setting_has_a_range():
    # A new int or float setting must get a range in train.RANGES, and a bad value here.
    numeric = {k for k, v in train.DEFAULTS.items() if type(v) in (int, float)}
    ranged = {k for keys, _, _ in train.RANGES for k in keys}
    assert numeric <= ranged, f"no range for {sorted(numeric - ranged)}"
    assert ranged | set(train.CHOICES) | {'device'} == set(BAD_VALUES)


@pytest.mark.parametrize('key, value', [(k, v) for k, values in BAD_VALUES.items() for v in values])
def test_bad_value_is_an_error_naming_the_key_before_anything_is_read(data, tmp_path, monkeypatch, key, value):
    # Reference: the key and the value at the start of a one-line ConfigError; no data read, no out_dir made.
    # NaN has no literal, so each value is put in after configure() parsed the flags.
    real = train.configure
    monkeypatch.setattr(train, 'configure', lambda defaults, *a: {**real(defaults, *a), key: value})
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # the same answer on a GPU machine
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: False)

    def read_meta(*a):
        raise AssertionError('the data was read before the config was checked')
    monkeypatch.setattr(train, 'read_meta', read_meta)
    out = tmp_path / 'out'
    with pytest.raises(ConfigError) as e:
        train.main(args(data, out, '--max_iters=2'))
    msg = str(e.value)
    assert msg.startswith(f'{key}={value!r}') and '\n' not in msg, msg
    assert not out.exists()


def test_bad_value_from_the_command_line(data, tmp_path):
    # The same through the flags: 1e999 is how a literal reaches inf; min_lr above learning_rate names both.
    with pytest.raises(ConfigError, match=r'^learning_rate=inf: must be finite and greater than 0'):
        train.main(args(data, tmp_path / 'out', '--learning_rate=1e999'))
    with pytest.raises(ConfigError, match=r'^min_lr=0\.5: .*learning_rate \(0\.01\)'):
        train.main(args(data, tmp_path / 'out', '--min_lr=0.5'))


@pytest.mark.parametrize('flags, named', [
    (['--optimizer=adamw', '--muon_split=True', '--muon_ns_steps=3', '--muon_dtype=float32', '--muon_momentum=0.9'],
     ['muon_split=True', 'muon_ns_steps=3', "muon_dtype='float32'", 'muon_momentum=0.9']),
    (['--lr_schedule=cosine', '--wsd_decay_frac=0.4'], ['wsd_decay_frac=0.4']),
    (['--optimizer=muon', '--muon_split=True', '--lr_schedule=wsd', '--wsd_decay_frac=0.4'], []),
    (['--compile_mode=max-autotune', '--fp8_recipe=rowwise', '--wandb_project=p', '--wandb_run_name=r'],
     ["compile_mode='max-autotune'", "fp8_recipe='rowwise'", "wandb_project='p'", "wandb_run_name='r'"]),
    (['--parallelism=fsdp'], ["parallelism='fsdp'"]),
    (['--parallelism=ddp'], []),
])
def test_a_setting_that_this_run_does_not_read_is_a_warning(data, tmp_path, capsys, flags, named):
    # Reference: the flags given. A Muon-only setting under AdamW, the WSD decay fraction under cosine, a
    # compile mode without compile, an FP8 recipe without FP8, wandb's names without wandb, FSDP in one process,
    # change nothing: the run goes on (max_iters=0: set-up and the first evaluation only) and says so on stderr,
    # once per setting, naming it and what it applies to; the same settings where they apply, none.
    assert train.main(args(data, tmp_path / 'out', '--max_iters=0', *flags)) == 0
    warnings = re.findall(r'^warning: (.*has no effect.*)$', capsys.readouterr().err, re.M)
    assert [w.split(' ')[0] for w in warnings] == named, warnings
    applies = {'muon': "optimizer='muon'", 'wsd': "lr_schedule='wsd'", 'compile': 'compile=True', 'fp8': 'fp8=True',
               'wandb': 'wandb_log=True', 'parallelism': 'under torchrun'}
    assert all(next(v for k, v in applies.items() if w.startswith(k)) in w for w in warnings), warnings


@pytest.mark.parametrize('flags, want', [
    (['--short_block_size=4'], 'short_block_size=4 has no effect: short_block_iters=0'),
    (['--short_block_iters=5'], 'short_block_iters=5 has no effect: short_block_size=0'),
    (['--short_block_size=4', '--short_block_iters=2'], 'short_block_iters=2 covers all max_iters=2 iterations'),
    (['--short_block_size=4', '--short_block_iters=1'], None),
    (['--short_block_size=4', '--short_block_iters=2', '--max_iters=0'], None),  # no step: no short window either
])
def test_a_short_block_setting_that_cannot_work_as_meant_is_a_warning(data, tmp_path, capsys, flags, want):
    # Reference: the flags given. Short windows need both a length and a number of iterations (one alone changes
    # nothing), and short windows for every iteration leave the whole windows that the evaluation uses untrained.
    # The run goes on and says so on stderr, naming the settings; a schedule that ends in time, nothing.
    assert train.main(args(data, tmp_path / 'out', '--max_iters=2', '--warmup_iters=1', *flags)) == 0
    warnings = re.findall(r'^warning: (.*)$', capsys.readouterr().err, re.M)
    assert len(warnings) == (1 if want else 0) and all(w.startswith(want) for w in warnings), warnings


@pytest.mark.parametrize('mode, deterministic, compiled, warned', [
    ('max-autotune', True, True, True), ('max-autotune-no-cudagraphs', True, True, True),
    ('default', True, True, False), ('max-autotune', False, True, False), ('reduce-overhead', True, True, False),
    ('max-autotune', True, False, False),
])
def test_max_autotune_under_deterministic_is_a_warning(mode, deterministic, compiled, warned):
    # Reference: inductor's deterministic mode (set with torch's deterministic algorithms) picks max-autotune's GEMMs
    # without timing them (select_algorithm: pick_deterministic_choice): a run that asks for both is told it tunes
    # little, naming the mode; the default mode, CUDA graphs alone, max-autotune without deterministic or without
    # compile (a warning of its own), nothing.
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'compile': compiled, 'compile_mode': mode,
                             'deterministic': deterministic, 'max_iters': 10, 'warmup_iters': 2})
    warnings = [w for w in train.setting_warnings(cfg, 1) if 'deterministic' in w]
    assert warnings == ([f"compile_mode={mode!r} with deterministic=True tunes little: inductor's deterministic mode "
                         f"takes the GEMMs and the reductions' block sizes without timing them"] if warned else [])


@pytest.mark.parametrize('flags, want', [
    (['--max_iters=2'], 'warmup_iters=2 is at least max_iters=2: the learning rate only warms up, to 6.67e-03 at '
                        'the last step (learning_rate=1.00e-02), and never decays'),
    (['--max_iters=3', '--lr_decay_iters=2'], 'lr_decay_iters=2 is at most warmup_iters=2: the learning rate drops '
                                              'from its warmup straight to min_lr=1.00e-03'),
    (['--max_iters=4', '--lr_decay_iters=8'], 'lr_decay_iters=8 is above max_iters=4: the learning rate ends at '
                                              '9.40e-03 at the last step, not at min_lr=1.00e-03 (lr_decay_iters=0: '
                                              'max_iters; a resume with a larger max_iters goes on along the same '
                                              'schedule)'),
    (['--max_iters=4', '--lr_decay_iters=10', '--lr_schedule=wsd'], 'lr_decay_iters=10 is above max_iters=4: the '
                                                                    'learning rate has not started its decay (wsd) by '
                                                                    'the last step, so it never reaches '
                                                                    'min_lr=1.00e-03 '),
    (['--max_iters=3'], None),
    (['--max_iters=3', '--lr_decay_iters=3'], None),
    (['--max_iters=3', '--lr_decay_iters=2', '--min_lr=1e-2'], None),  # min_lr = learning_rate: a constant rate
    (['--max_iters=3', '--lr_decay_iters=5', '--min_lr=1e-2'], None),
])
def test_a_learning_rate_schedule_cut_short_is_a_warning(data, tmp_path, capsys, flags, want):
    # Reference: the schedule by hand (warmup_iters=2, learning_rate 1e-2: the rate of step i < 2 is
    # 1e-2 * (i + 1) / 3). A warmup as long as the run ends at 2/3 of learning_rate with no decay; a decay that
    # ends before the warmup does goes straight to min_lr; a cosine decay over steps 2 to 8 is at 1e-3 + 9e-3 *
    # (1 + cos(pi / 6)) / 2 = 9.40e-3 at step 3; WSD's decay over the last 20% of 10 steps starts at step 8. The run
    # goes on and says so; a schedule that fits, nothing.
    assert train.main(args(data, tmp_path / 'out', *flags)) == 0
    warnings = re.findall(r'^warning: (.*)$', capsys.readouterr().err, re.M)
    assert len(warnings) == bool(want) and all(w.startswith(want) for w in warnings), warnings


@pytest.mark.parametrize('flags, want', [
    (['--max_iters=0', '--eval_at_start=False'], 'max_iters=0 and eval_at_start=False: the run neither trains nor '
                                                 'evaluates (it writes its initial weights to out_dir/ckpt.pt, an '
                                                 "earlier run's files moved aside first)"),
    (['--max_iters=0'], None),
    (['--max_iters=3', '--eval_at_start=False'], None),
])
def test_a_run_that_does_nothing_is_a_warning(data, tmp_path, capsys, flags, want):
    # Reference: the evaluations the run logs. max_iters=0 only evaluates, at iteration 0, which eval_at_start=False
    # skips: the run goes on, does nothing, and says so; with either setting alone it evaluates.
    assert train.main(args(data, tmp_path / 'out', *flags)) == 0
    warnings = re.findall(r'^warning: (.*)$', capsys.readouterr().err, re.M)
    assert warnings == ([want] if want else []), warnings
    logged = read_metrics(tmp_path / 'out') if os.path.exists(tmp_path / 'out' / 'metrics.jsonl') else []
    assert bool(want) == (not [r for r in logged if 'val_loss' in r])
    assert load(tmp_path / 'out' / 'ckpt.pt')['iter_num'] == (3 if '--max_iters=3' in flags else 0)  # as it says


def test_a_resume_with_nothing_to_do_is_not_warned_as_a_new_run(data, tmp_path, capsys):
    # Reference: the warning's own words, which hold for a new run (it writes its initial weights, moves an earlier
    # run aside): a resume with max_iters=0 and eval_at_start=False does neither (nothing to train, said as such)
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--max_iters=2')) == 0
    saved = read_bytes(out / 'ckpt.pt')
    capsys.readouterr()
    assert train.main(args(data, out, '--max_iters=0', '--eval_at_start=False', '--init_from=resume')) == 0
    captured = capsys.readouterr()
    assert 'neither trains nor evaluates' not in captured.err and 'nothing to train' in captured.out
    assert read_bytes(out / 'ckpt.pt') == saved


def test_a_resume_without_the_shape_flags_of_its_start_is_refused(data, tmp_path):
    # Reference: train.py's docstring: a resume is refused on another shape; only a run started from hf: keeps its
    # checkpoint's shape. A scratch run of 2 layers resumed without --n_layer (the config's default: 12) is another
    # shape, named, and its checkpoint stays as it was
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--max_iters=2', '--n_layer=2')) == 0
    saved = read_bytes(out / 'ckpt.pt')
    flags = [f for f in args(data, out, '--max_iters=4', '--init_from=resume') if not f.startswith('--n_layer=')]
    with pytest.raises(train.TrainError, match=r'another shape than this config:\n  n_layer: 2 -> 12'):
        train.main(flags)
    assert read_bytes(out / 'ckpt.pt') == saved


def test_a_cuda_device_index_past_the_last_is_an_error(monkeypatch):
    # Reference: CUDA's indices run from 0 to the count less 1: with 2 devices cuda:1 is one, cuda:2 is not
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    train.check_device('cuda:1')
    with pytest.raises(ConfigError, match="device='cuda:2'"):
        train.check_device('cuda:2')


EDGES = {  # valid values at the edge of their range; the zeros (each with its meaning of 0) share a run
    'zeros': ['--grad_clip=0', '--dropout=0', '--label_smoothing=0', '--weight_decay=0', '--beta1=0', '--beta2=0',
              '--min_lr=0', '--seed=0', '--lr_decay_iters=0', '--n_kv_head=0', '--vocab_size=0', '--eval_interval=1',
              '--head_dim=0', '--mlp_hidden=0'],
    'warmup_iters=0': ['--warmup_iters=0'], 'min_lr=learning_rate': ['--min_lr=1e-2'], 'max_iters=0': ['--max_iters=0'],
    # the upper and the open edges: the largest seed, a WSD decay over all of lr_decay_iters, rope_base just over 1
    'highest': ['--seed=9223372036854775807', '--lr_schedule=wsd', '--wsd_decay_frac=1', '--rope_base=1.0001'],
}


@pytest.mark.parametrize('edge', EDGES)
def test_valid_edge_values_still_run(data, tmp_path, edge):
    # Reference: the schedule and the loop by hand: 3 steps, evaluations at 0 and 2 and the final 3 saved;
    # warmup_iters=0 starts at learning_rate, min_lr=learning_rate stays there; max_iters=0 only evaluates.
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=3', *EDGES[edge])) == 0
    lines, ckpt = read_metrics(out), load(out / 'ckpt.pt')
    if edge == 'max_iters=0':
        assert ckpt['iter_num'] == 0 and [r['iter'] for r in lines] == [0]
        return
    assert ckpt['iter_num'] == 3 and all_finite(ckpt['model'])
    assert [r['iter'] for r in lines if 'loss' in r] == [1, 2, 3]
    assert all(math.isfinite(r['loss']) for r in lines if 'loss' in r)
    lrs = [r['lr'] for r in lines if 'lr' in r]
    if edge == 'warmup_iters=0':
        assert lrs[0] == pytest.approx(1e-2, rel=1e-12)
    if edge in ('min_lr=learning_rate', 'highest'):  # warmup over 2 iterations, then constant (WSD: its decay from
        # the end of the warmup, at 0 of its 1 iteration)
        assert lrs == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2], rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# 13. what a sixth mutation run of train.py found unchecked: signals at the last evaluation, errors under
# torchrun (the process group faked), warnings' conditions, the log line's units

@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_a_signal_during_the_last_evaluation_ends_the_run_as_it_would(data, tmp_path, monkeypatch, capsys, save_log,
                                                                      signum):
    # Reference: the run without a signal (test_last_iteration_is_saved): exit code 0, "done:", ckpt.pt written once at
    # max_iters. A signal that comes during the evaluation at max_iters, after which no step is left, changes nothing:
    # the run ends as it would have (train_loop: "after the last one, the run ends as it would"), not with 128 + signum
    # and a command that resumes a finished run.
    calls = signal_in_evaluation(monkeypatch, 3, signum)  # evaluations at 0, 2 and 4 = max_iters
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4')) == 0
    captured = capsys.readouterr()
    assert len(calls) == 3 and 'done: 4 iterations' in captured.out
    assert '--init_from=resume' not in captured.out
    assert [it for name, it, _ in save_log if name == 'ckpt.pt'] == [0, 2, 4]


def under_torchrun(monkeypatch, rank, local_rank, world):
    """The environment torchrun gives a process (RANK, LOCAL_RANK, WORLD_SIZE)."""
    for k, v in (('RANK', rank), ('LOCAL_RANK', local_rank), ('WORLD_SIZE', world)):
        monkeypatch.setenv(k, str(v))


def test_an_error_of_one_process_names_it_by_its_global_rank(monkeypatch, capsys):
    # Reference: the environment torchrun gives process 2 of 4 on two nodes of two (RANK 2, LOCAL_RANK 0): its own
    # error names process 2, the one the job's other messages call it by (RANK), not its place on its node (0, which
    # process 0 on the first node is too); an agreed stop is unnamed, and a PeerError is not printed.
    under_torchrun(monkeypatch, 2, 0, 4)
    train.report_error(train.TrainError('data/train.bin cannot be read: Permission denied'))
    train.report_error(train.stop_together(SimpleNamespace(master=True), 'iteration 3: stopping'))
    train.report_error(train.PeerError('process 0 stopped with an error (it prints it)'))
    assert capsys.readouterr().err == ("train.py: error: process 2 of 4: data/train.bin cannot be read: Permission "
                                       "denied\ntrain.py: error: iteration 3: stopping\n")


# gloo's words when the other end of a collective has gone: its exit closed the connection, or reset it
GLOO_LOST = ['[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40771',
             '[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:40771: Connection reset by '
             'peer']


@pytest.mark.parametrize('text, said', list(zip(GLOO_LOST, ['connection closed by peer', 'connection reset by peer'])))
def test_a_collective_that_lost_another_process_is_one_line(data, tmp_path, monkeypatch, text, said):
    # Reference: gloo's two messages for a peer that has gone (GLOO_LOST) and main's line for them. Process 0 of 2,
    # the process group faked (none is joined), whose setup's collective raises gloo's error: either one is the
    # one-line TrainError, not a traceback; another RuntimeError stays itself.
    under_torchrun(monkeypatch, 0, 0, 2)
    monkeypatch.setattr(train.dist, 'init_process_group', lambda *a, **k: None)

    def setup(*a, **k):
        raise RuntimeError(text)
    monkeypatch.setattr(train, 'setup', setup)
    with pytest.raises(train.TrainError) as e:
        train.main(args(data, tmp_path / 'out', '--gradient_accumulation_steps=2'))
    assert str(e.value) == (f"lost the connection to another process ({said}): it may have stopped with an error of "
                            f"its own, in its log")
    monkeypatch.setattr(train, 'setup', lambda *a, **k: [][1])  # an IndexError: a bug, shown with its traceback
    with pytest.raises(IndexError):
        train.main(args(data, tmp_path / 'out', '--gradient_accumulation_steps=2'))


@pytest.mark.parametrize('together', [True, False])
def test_an_agreed_stop_waits_until_process_0_has_printed_it(data, tmp_path, monkeypatch, capsys, together):
    # Reference: stop_together's docstring: under torchrun every process waits in main (a barrier) until process 0
    # has printed an agreed stop, since torchrun stops them all once one has exited; an error of one process alone
    # waits for none (the others are not at that barrier: it would hang). Process 0 of 2, the group faked.
    under_torchrun(monkeypatch, 0, 0, 2)
    monkeypatch.setattr(train.dist, 'init_process_group', lambda *a, **k: None)
    barriers = []
    monkeypatch.setattr(train.dist, 'barrier', lambda *a, **k: barriers.append(capsys.readouterr().err))
    error = (train.stop_together(SimpleNamespace(master=True), 'iteration 3: stopping') if together
             else train.TrainError('out_dir out cannot be written'))

    def setup(*a, **k):
        raise error
    monkeypatch.setattr(train, 'setup', setup)
    with pytest.raises(train.TrainError):
        train.main(args(data, tmp_path / 'out', '--gradient_accumulation_steps=2'))
    printed = "train.py: error: iteration 3: stopping\n"
    assert barriers == ([printed] if together else []), barriers  # printed before the barrier, once


def test_a_resume_before_any_evaluation_resets_no_best_val_loss(data, tmp_path, capsys):
    # Reference: the checkpoint's best_val_loss, inf: a run that neither trained nor evaluated (max_iters=0,
    # eval_at_start=False) has no best val loss, so a resume that changes what the val loss measures (batch_size)
    # resets none and says nothing of it; the same change after an evaluation does (the line, for comparison).
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--max_iters=0', '--eval_at_start=False')) == 0
    assert train.load_checkpoint(str(out / 'ckpt.pt'))['best_val_loss'] == float('inf')
    capsys.readouterr()
    assert train.main(args(data, out, '--max_iters=2', '--batch_size=2', '--init_from=resume')) == 0
    assert 'best val loss reset' not in capsys.readouterr().out
    assert train.main(args(data, out, '--max_iters=4', '--batch_size=4', '--init_from=resume')) == 0
    assert 'best val loss reset: batch_size changed' in capsys.readouterr().out


@pytest.mark.parametrize('batch', [1, 3])
def test_in_windows_leaves_a_whole_window_batch_as_it_is(batch):
    # Reference: the batch as Batches makes it (inputs and targets sliced from one (B, T + 1) buffer: strides
    # (T + 1, 1)), and the docstring of in_windows: at the full length the micro-batch is left as it is, its strides
    # too (a reshape gives a batch of one the strides (T, 1), which fail the guards of the graph compiled for the
    # batch, and Dynamo compiles another); at a shorter window, the same tokens in rows of that window.
    T = 8
    buf = torch.arange(batch * (T + 1)).view(batch, T + 1)
    x, y = buf[:, :-1], buf[:, 1:]
    wx, wy = train.in_windows(x, y, T)
    assert (wx.shape, wx.stride(), wy.stride()) == (x.shape, x.stride(), y.stride())
    assert wx is x and wy is y
    sx, sy = train.in_windows(x, y, 4)
    assert torch.equal(sx, x.reshape(batch * 2, 4)) and torch.equal(sy, y.reshape(batch * 2, 4))


@pytest.mark.parametrize('world, parallelism, warned', [(1, 'fsdp', True), (2, 'fsdp', False), (4, 'fsdp', False),
                                                        (1, 'ddp', False), (2, 'ddp', False)])
def test_parallelism_is_a_warning_only_in_one_process(world, parallelism, warned):
    # Reference: setting_warnings' docstring: parallelism has no effect where the run is one process; under torchrun
    # (world > 1) it chooses DDP or FSDP, and an FSDP run is told nothing of the kind.
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'parallelism': parallelism, 'max_iters': 10, 'warmup_iters': 2})
    warnings = [w for w in train.setting_warnings(cfg, world) if w.startswith('parallelism=')]
    assert warnings == ([f"parallelism={parallelism!r} has no effect: one process runs the whole model; it applies "
                         f"under torchrun, with more than one process"] if warned else [])


@pytest.mark.parametrize('init_from, warned', [('scratch', False), ('resume', False), ('hf:models/SmolLM2-135M', True)])
def test_zero_init_proj_is_a_warning_only_from_hf_weights(init_from, warned):
    # Reference: setting_warnings' docstring: zero_init_proj has no effect under init_from=hf: (the weights come from
    # there); a new run from scratch is what it is for (its initial projections at zero), and a resume's change of
    # it is said by the resume itself (START_KEYS), not as this warning.
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'zero_init_proj': True, 'init_from': init_from,
                                   'max_iters': 10, 'warmup_iters': 2})
    warnings = [w for w in train.setting_warnings(cfg, 1) if w.startswith('zero_init_proj')]
    assert warnings == ([f"zero_init_proj=True has no effect: the weights come from init_from={init_from}"]
                        if warned else [])


def test_metrics_time_s_is_the_seconds_since_start_to_the_millisecond(tmp_path, monkeypatch):
    # Reference: a fake clock at START_TIME + 12.3456 s and + 0.4 s: each record gets time_s 12.346 and 0.4, the wall
    # seconds since train.py started to the millisecond (README: "the time to a loss can be read off any run"; in
    # whole seconds every line of a short run's first second would read 0), its own fields kept as given.
    now = [train.START_TIME + 12.3456]
    monkeypatch.setattr(train, 'time', SimpleNamespace(time=lambda: now[0]))
    r = SimpleNamespace(master=True, wandb=None, metrics_path=str(tmp_path / 'metrics.jsonl'), metrics_lost=0)
    train.log_metrics(r, {'iter': 3, 'tokens': 96, 'loss': 2.5})
    now[0] = train.START_TIME + 0.4
    train.log_metrics(r, {'iter': 4, 'tokens': 128, 'loss': 2.25})
    assert read_metrics(tmp_path) == [{'iter': 3, 'tokens': 96, 'loss': 2.5, 'time_s': 12.346},
                                      {'iter': 4, 'tokens': 128, 'loss': 2.25, 'time_s': 0.4}]


def test_a_signal_during_an_evaluation_saves_its_checkpoint_once(data, tmp_path, monkeypatch, capsys, save_log):
    # Reference: stopped's docstring: a signal saves the checkpoint "unless this iteration's is". One that comes during
    # the evaluation at iteration 2 (which writes ckpt.pt and best.pt at 2) stops the run there, with 128 + SIGTERM
    # and the resume command, and ckpt.pt at 2 is written once: a second save of the same state (minutes for a large
    # model) is only time lost.
    signal_in_evaluation(monkeypatch, 2)  # the evaluation at 2
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=8')) == 128 + signal.SIGTERM
    assert 'SIGTERM: saved' in capsys.readouterr().out
    assert [(name, it) for name, it, _ in save_log if name == 'ckpt.pt'] == [('ckpt.pt', 0), ('ckpt.pt', 2)]


# ----------------------------------------------------------------------------------------------------
# 14. what a new user's pass over train.py found: two runs in one out_dir, a resume's schedule and data changed
# under it, a reader of the output gone, a checkpoint save with no cause named

def test_a_second_run_in_an_out_dir_in_use_is_refused_before_it_touches_it(data, tmp_path):
    # Reference: flock's semantics (a lock per open file description: the descriptor opened here stands for another
    # run's) and the earlier run's files byte for byte. Both a scratch run (it moved the running run's files aside)
    # and a resume (it cut metrics.jsonl back) are refused while another holds out_dir; a run that ends, or fails
    # after taking the lock, releases it.
    import fcntl
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    with open(out / 'metrics.jsonl', 'a') as f:
        f.write(json.dumps({'iter': 3, 'loss': 1.0}) + '\n')  # a line past the checkpoint, which a resume cuts
    before = run_files(out)
    other = os.open(out, os.O_RDONLY)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a lock the run leaked fails here, never hangs)
    try:
        for extra in ([], ['--init_from=resume']):
            with pytest.raises(train.TrainError, match=re.escape(
                    f"out_dir {out} is in use by another train.py run (it holds the directory's lock): two runs there "
                    f"would write over each other's checkpoints and metrics")):
                train.main(args(data, out, '--eval_interval=2', '--max_iters=4', *extra))
            assert run_files(out) == before and not glob.glob(str(out / 'previous-*'))
    finally:
        os.close(other)
    def released():
        probe = os.open(out, os.O_RDONLY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no BlockingIOError
        finally:
            os.close(probe)
    with pytest.raises(train.TrainError, match='another shape'):  # fails in setup, after taking the lock
        train.main(args(data, out, '--max_iters=4', '--init_from=resume', '--n_layer=2'))
    released()  # (else a notebook whose main raised held it until its kernel restarts)
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume')) == 0
    released()


def test_an_out_dir_that_cannot_be_locked_trains_with_a_warning(data, tmp_path, monkeypatch, capsys):
    # Reference: the run's own end (its checkpoint at max_iters). A file system without locks (flock: ENOLCK) is no
    # reason to refuse a run; it says that another one would not be stopped
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, 'No locks available')
    monkeypatch.setattr(fcntl, 'flock', no_locks)
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    assert load(out / 'ckpt.pt')['iter_num'] == 2
    assert (f"warning: out_dir {out} cannot be locked (No locks available; a file system without locks?): another "
            f"train.py run into it would not be stopped") in capsys.readouterr().err


@pytest.mark.parametrize('where', ['setup', 'evaluation'])
def test_a_resume_whose_best_val_loss_reset_stops_before_its_best_leaves_best_pt(data, tmp_path, monkeypatch, where):
    # Reference: best.pt's bytes. A resume that would reset the best val loss (batch_size) but stops before it
    # writes a best.pt of its own (a check late in setup, compile's; its first evaluation) moves nothing aside.
    # The checkpoint still holds the old best val loss, so a resume on the old settings resets nothing: had best.pt
    # moved, it would never be written again by losses above that best
    out = tmp_path / 'out'
    assert train.main(args(data, out, '--eval_interval=2', '--max_iters=2')) == 0
    best = read_bytes(out / 'best.pt')

    def fail(*args):
        raise train.TrainError(f'{where}: a failure after the checkpoint has loaded')
    with monkeypatch.context() as patch:
        patch.setattr(train, 'compile_model' if where == 'setup' else 'estimate_loss', fail)
        with pytest.raises(train.TrainError, match='after the checkpoint has loaded'):
            train.main(args(data, out, '--eval_interval=2', '--max_iters=4', '--init_from=resume', '--batch_size=2'))
    assert read_bytes(out / 'best.pt') == best and not glob.glob(str(out / 'previous-*'))


@pytest.mark.parametrize('flags, jumps', [(['--max_iters=8'], True),
                                          (['--max_iters=8', '--lr_decay_iters=4', '--min_lr=2e-3'], True),
                                          (['--max_iters=8', '--lr_decay_iters=4'], False), ([], False),
                                          (['--min_lr=2e-3'], False)])
def test_a_resume_whose_schedule_moves_the_learning_rate_warns_with_both(data, tmp_path, capsys, flags, jumps):
    # Reference: train.get_lr under each run's settings. With lr_decay_iters=0 the decay follows max_iters, so a
    # resume that raises max_iters took the rate from its floor back up at once, without a word; so does another
    # floor; a decay that ends where it did (lr_decay_iters set) or no change keeps the rate, and says nothing; so
    # does a resume with nothing to train (max_iters as it was), whatever its rate would be
    out = tmp_path / 'out'
    first = args(data, out, '--eval_interval=2', '--max_iters=4', '--lr_decay_iters=0', '--warmup_iters=1')
    assert train.main(first) == 0
    capsys.readouterr()
    assert train.main([*first, '--init_from=resume', *flags]) == 0
    saved = SimpleNamespace(**configure(train.DEFAULTS, first))
    now = SimpleNamespace(**configure(train.DEFAULTS, [*first, *flags]))
    line = (f"warning: the learning rate of iteration 4 is {train.get_lr(4, now):.3e} under this run's schedule, "
            f"{train.get_lr(4, saved):.3e} under the checkpoint's: it changes at once, by the settings above")
    assert (line in capsys.readouterr().out) == jumps
    assert (abs(train.get_lr(4, now) / train.get_lr(4, saved) - 1) > 0.01) == (jumps or '--min_lr=2e-3' in flags)


def test_a_changed_seed_on_resume_reaches_only_what_starts_anew(data, tmp_path, capsys):
    # Reference: the losses of a resume without the change, from a copy of the same checkpoint. The data sampler
    # and RNG streams go on from the checkpoint's (it said the seed "takes effect" as other settings do): the
    # training losses after it are the same; the line says so
    a, b = tmp_path / 'a', tmp_path / 'b'
    assert train.main(args(data, a, '--eval_interval=2', '--max_iters=2', '--dropout=0.1')) == 0
    shutil.copytree(a, b)
    capsys.readouterr()
    assert train.main(args(data, a, '--eval_interval=10', '--max_iters=4', '--dropout=0.1', '--init_from=resume')) == 0
    assert train.main(args(data, b, '--eval_interval=10', '--max_iters=4', '--dropout=0.1', '--init_from=resume',
                           '--seed=9')) == 0
    printed = capsys.readouterr().out
    assert ("\n  seed: 1337 -> 9  (the data sampler and the checkpoint's RNG streams go on as saved; it reaches only "
            "what starts anew: sampled evaluation batches, RNG streams of processes the checkpoint lacked)\n"
            ) in printed and printed.count('seed: 1337 -> 9') == 1
    losses = [{r['iter']: r['loss'] for r in read_metrics(out) if 'loss' in r} for out in (a, b)]
    assert losses[0] == losses[1] and set(losses[0]) == {1, 2, 3, 4}


def test_a_reader_of_the_output_that_goes_away_does_not_stop_the_run(data, tmp_path):
    # Reference: the checkpoint at max_iters and every training line in metrics.jsonl. With stdout a pipe whose
    # reader closed it (`| head`), the next line printed raised BrokenPipeError: a traceback, nothing saved after
    # the last evaluation
    out = tmp_path / 'out'
    proc = subprocess.Popen([sys.executable, 'train.py', *args(data, out, '--eval_interval=100', '--max_iters=60')],
                            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and 'Traceback' not in err and 'BrokenPipe' not in err, err
    assert load(out / 'ckpt.pt')['iter_num'] == 60
    assert [r['iter'] for r in read_metrics(out) if 'loss' in r] == list(range(1, 61))


def test_a_save_that_torch_cannot_finish_names_the_free_space(tmp_path, monkeypatch):
    # Reference: the free space the file system reports (faked: 3 MiB). torch's writer on a full disk says
    # '[enforce fail at inline_container.cc:672] . unexpected pos ...', no cause; an OSError names its own
    # (No space left on device), and gets no figure
    def full(state, f):
        f.write(b'PK\x03\x04 part of it')
        raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 146368 vs 146256')
    monkeypatch.setattr(torch, 'save', full)
    monkeypatch.setattr(shutil, 'disk_usage', lambda path: SimpleNamespace(total=1 << 30, used=0, free=3 << 20))
    path = tmp_path / 'ckpt.pt'
    with pytest.raises(train.TrainError, match=re.escape(
            f"could not save checkpoint {path}: [enforce fail at inline_container.cc:672] . unexpected pos 146368 vs "
            f"146256; 3.0 MiB free on its disk, the part written included (the previous {path}, if any, is intact)")):
        train.save_checkpoint(str(path), {})
    assert os.listdir(tmp_path) == []

    def no_space(state, f):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(torch, 'save', no_space)
    with pytest.raises(train.TrainError) as e:
        train.save_checkpoint(str(path), {})
    assert 'No space left on device' in str(e.value) and 'MiB free' not in str(e.value)


def test_the_config_printed_at_start_holds_the_config_keys_and_apart_the_models_other_fields(data, tmp_path,
                                                                                              capsys):
    # Reference: train.DEFAULTS (the keys a flag can set) and GPTConfig's fields. norm_eps and Llama 3's RoPE
    # scaling were printed among the config keys, where a flag setting them is an unknown key; a key resolved from
    # 0 shows its value as built (n_kv_head, vocab_size)
    assert train.main(args(data, tmp_path / 'out', '--max_iters=0')) == 0
    out = capsys.readouterr().out
    block = out.split('config:\n')[1].split('\nmodel fields')[0].splitlines()
    shown = dict(line.split(' = ') for line in (ln.strip() for ln in block))
    shown = {k.strip(): v for k, v in shown.items()}
    assert list(shown) == list(train.DEFAULTS)
    assert shown['n_kv_head'] == '2' and shown['vocab_size'] == '64'  # (TINY: 2 heads; 40 characters, in 64s)
    fields = {f.name: f.default for f in dataclasses.fields(model_module.GPTConfig) if f.name not in train.DEFAULTS}
    assert set(fields) == {'norm_eps', 'rope_scaling_factor', 'rope_low_freq_factor', 'rope_high_freq_factor',
                           'rope_original_max_len'}
    assert ("model fields that are not config keys (init_from=hf:PATH reads them from config.json): "
            + ", ".join(f"{k}={v!r}" for k, v in fields.items())) in out


def test_say_silences_only_the_stream_whose_reader_went_away(monkeypatch, capsys):
    # Reference: the pipe's own end. A broken stderr (its reader gone) goes to /dev/null from then on, and stdout
    # still prints (the recipe had put /dev/null on stdout whatever the stream); a closed stdout (Python has None
    # for it) is no AttributeError
    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = os.fdopen(write_end, 'w')
    try:
        train.say('lost', file=broken)  # EPIPE: its descriptor now /dev/null's
        train.say('lost too', file=broken)
        assert os.path.samefile(f'/proc/self/fd/{write_end}', os.devnull)
    finally:
        broken.close()
    train.say('still printed')
    assert capsys.readouterr().out == 'still printed\n'
    monkeypatch.setattr(sys, 'stdout', None)
    train.say('nowhere')
