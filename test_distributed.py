"""
Multi-process tests for train.py under torchrun (2 processes, gloo on the CPU), each against a single-process run of
the same global batch as the reference: DDP and FSDP2 must log the same per-step and eval losses and end with the
same weights (under DDP the gradients are views of its all-reduce buckets, and a step broadcasts nothing; FSDP
gathers each block's weights twice per micro-step, the last one's once: a spy on train_step, GRADIENT_SPY);
checkpoints must resume across process counts (2 -> 1 and 1 -> 2); only process 0 prints, logs and writes in out_dir
(every torchrun run is watched for writes of the other processes: WORKER); the token counts and tokens/s are the
whole job's; eval averages over all processes; SIGTERM to the launcher stops both processes at one step with a
checkpoint that resumes; gradient_accumulation_steps not divisible by the number of processes is a clear error; each
of 3 processes has its own RNG state, from scratch and resumed from a 1-process checkpoint. Batches' split of the
windows among processes is checked in-process against the one-process draw.

    python -m pytest -q test_distributed.py

Each torchrun launch costs a few seconds (three Python processes import torch), so the runs are made
once, in module-scoped fixtures, and shared by the tests that read them.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import write_dataset
from model import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(1)  # the tiny models here; see test_train.py
# PYTHONFAULTHANDLER: a run that hangs is sent SIGABRT before it is killed, and each of its Python processes
# prints where every thread stood into the log that the failing test shows
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONFAULTHANDLER='1')
TORCHRUN = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py']
V = 40
# lr_decay_iters is fixed: left at 0 it follows max_iters, which would change the schedule between a run
# stopped at 3 and one run to 6.
FLAGS = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=4',
         '--gradient_accumulation_steps=2', '--eval_interval=3', '--eval_iters=4', '--log_interval=1',
         '--device=cpu', '--dtype=float32', '--warmup_iters=0', '--learning_rate=1e-2', '--lr_decay_iters=6',
         '--dropout=0']
RUN_TIMEOUT = 300  # seconds; a run here takes 3-10 s, 50 s on a loaded 2-core machine, more with a cold disk
# the whole job's figures, whatever its processes (bits per byte: over every process's share of an evaluation, the
# repeats of weight 0 left out, which test_eval_iters_not_divisible_by_processes has)
CLOSE_KEYS = ('loss', 'grad_norm', 'train_loss', 'val_loss', 'train_bpb', 'val_bpb')
# Under torchrun each worker runs train.py (as __main__: AS_SCRIPT, or imported: GRADIENT_SPY) through this script,
# written next to out_dir. Processes other than 0 first install an audit hook that notes in <out_dir>.writes-<rank>
# each file they open for writing, make, rename, truncate or remove in out_dir: process 0 alone writes there
# (checkpoints, metrics, the plot, the write probe, an earlier run moved aside, metrics.jsonl cut back on a resume).
# Two processes writing one file race (one's os.replace finds the other's .tmp gone), and most of the time nothing
# else shows it. What the hook cannot see: writes from C++ that take a path (torch.save(obj, path): train.py saves
# through an open file) and calls relative to a directory descriptor.
WORKER = '''import os, runpy, sys
out_dir, here, rank = os.path.abspath({out_dir!r}), {here!r}, int(os.environ['RANK'])
if rank:
    note = os.open(f'{{out_dir}}.writes-{{rank}}', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # before the hook
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path):
        return isinstance(path, (str, bytes, os.PathLike)) and \\
            (os.path.abspath(os.fsdecode(path)) + os.sep).startswith(out_dir + os.sep)

    def hook(event, args):
        if event == 'open':  # builtins.open (mode 'w', 'a', 'r+', ...) and os.open (flags)
            paths = args[:1] if (args[1] and set(args[1]) & set('wax+')) or (args[2] or 0) & WRITE else []
        else:
            paths = {{'os.rename': args[:2], 'os.remove': args[:1], 'os.rmdir': args[:1], 'os.mkdir': args[:1],
                     'os.truncate': args[:1]}}.get(event, [])
        if any(inside(p) for p in paths):
            os.write(note, f'{{event}} {{[os.fsdecode(p) for p in paths]}}\\n'.encode())
    sys.addaudithook(hook)
sys.path.insert(0, here)
{entry}'''
# WORKER's entries: train.py as `python train.py` runs it, or GRADIENT_SPY
AS_SCRIPT = "runpy.run_path(os.path.join(here, 'train.py'), run_name='__main__')\n"
# An entry that also notes, before and after each train_step, what the parameters' gradients are, and how many
# all-gathers FSDP2 made in the step: in <out_dir>.grads-<rank>
GRADIENT_SPY = '''import json, train
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
real, seen, gathered, broadcasts = train.train_step, [], [], [0]
real_gather, real_broadcast = fsdp_group.foreach_all_gather, dist._broadcast_coalesced

def gather(fsdp_params, *args, **kwargs):  # the parameters of one fully_shard module gathered whole: which one
    fqn = fsdp_params[0]._param_fqn
    gathered.append('.'.join(fqn.split('.')[:2]) if fqn.startswith('blocks.') else 'root')
    return real_gather(fsdp_params, *args, **kwargs)

def broadcast(*args, **kwargs):  # DDP's: the weights from process 0 as it is built, its buffers before a forward
    broadcasts[0] += 1
    return real_broadcast(*args, **kwargs)

def gradients(model):
    grads = [p.grad for p in model.parameters()]
    kept = [g for g in grads if g is not None]
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in kept}
    return dict(params=len(grads), none=len(grads) - len(kept), zero=all(not g.any() for g in kept),
                storages=len(storages), storage_bytes=sum(storages.values()),
                grad_bytes=sum(g.numel() * g.element_size() for g in kept))

def spy(model, *args, **kwargs):
    before, gathers, sent = gradients(model), len(gathered), broadcasts[0]
    out = real(model, *args, **kwargs)
    seen.append(dict(before=before, after=gradients(model), gathers=gathered[gathers:],
                     broadcasts=broadcasts[0] - sent))
    return out

train.train_step, fsdp_group.foreach_all_gather, dist._broadcast_coalesced = spy, gather, broadcast
code = train.main(sys.argv[1:])
with open(f'{out_dir}.grads-{rank}', 'w') as f:
    json.dump(seen, f)
sys.exit(code)
'''
# An entry in which process 1 alone cannot count the bytes of the tokens (its tokenizer would not load there)
ONE_WITHOUT_BYTES = '''import train
if rank == 1:
    def token_bytes(meta):
        raise ValueError("the tokenizer cannot be loaded on this process's host")
    train.token_bytes = token_bytes
sys.exit(train.main(sys.argv[1:]))
'''


# ----------------------------------------------------------------------------------------------------
# helpers

def write_data(d, vocab=V, n_train=4000, n_val=800, seed=0):
    """train.bin / val.bin of uniform random ids in [0, vocab) and a char-level meta.json whose characters are of
    1 and 3 UTF-8 bytes, in turns: the bytes per token of each process's share of an evaluation differ, and its
    bits per byte are the whole job's only when the processes add up their counts."""
    rng = np.random.default_rng(seed)
    chars = ''.join(chr(0x4e00 + i if i % 2 else 0x21 + i) for i in range(vocab))
    return write_dataset(d, rng.integers(0, vocab, n_train), rng.integers(0, vocab, n_val), vocab, chars=chars)


def descendants(pid):
    """Process ids below pid (from /proc), children first: torchrun's workers are its children."""
    children = {}
    for entry in (os.listdir('/proc') if os.path.isdir('/proc') else []):
        if entry.isdigit():
            try:
                with open(f'/proc/{entry}/stat') as f:
                    ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc):
    """SIGKILL a launcher we started and the workers it started (found before the launcher dies), after a
    SIGABRT that makes each one print its Python stacks (PYTHONFAULTHANDLER). Returns what was still running
    (pid, state, command line): which of the processes hung."""
    pids = descendants(proc.pid) + [proc.pid]
    alive = []
    for pid in pids:
        try:
            with open(f'/proc/{pid}/stat') as f:
                state = f.read().rsplit(')', 1)[1].split()[0]
            with open(f'/proc/{pid}/cmdline') as f:
                alive.append(f"{pid} [{state}] {f.read().replace(chr(0), ' ')[:100]}")
        except OSError:
            pass
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
            if sig == signal.SIGABRT:
                time.sleep(1)  # one process at a time writes its stacks: they do not interleave in the log
    proc.wait()
    return alive


class Launch:
    """train.py in 1 or 2 processes, stdout and stderr together in out_dir.log (a file, not a pipe: a
    pipe nobody reads would block a long run)."""

    def __init__(self, nproc, out_dir, data_dir, *extra, torchrun=None, entry=AS_SCRIPT):
        self.out_dir, self.nproc = str(out_dir), nproc
        self.log_path = self.out_dir + '.log'
        via_torchrun = nproc > 1 if torchrun is None else torchrun
        self.audited = via_torchrun and nproc > 1  # train.py through WORKER: what processes 1, 2, ... write in out_dir
        self.script = self.out_dir + '.worker.py' if self.audited else 'train.py'  # what the workers run
        if self.audited:
            with open(self.script, 'w') as f:
                f.write(WORKER.format(out_dir=self.out_dir, here=HERE, entry=entry))
        launcher = TORCHRUN[:-2] + [f'--nproc_per_node={nproc}', self.script]
        cmd = (launcher if via_torchrun else [sys.executable, 'train.py']) + \
            FLAGS + [f'--data_dir={data_dir}', f'--out_dir={out_dir}', *extra]
        self.cmd = ' '.join(cmd)
        self._log = open(self.log_path, 'w')
        self.proc = subprocess.Popen(cmd, cwd=HERE, env=ENV, stdout=self._log, stderr=subprocess.STDOUT)
        self.rc, self.timed_out, self.started = None, False, time.time()

    def wait(self, timeout=RUN_TIMEOUT):
        self.timeout = timeout
        try:
            self.rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.last_output = os.path.getmtime(self.log_path) - self.started  # a hang, or only slow?
            self.alive = kill_tree(self.proc)
            self.rc = self.proc.returncode
        self._log.close()
        with open(self.log_path) as f:
            self.output = f.read()
        return self

    def describe(self):
        state = (f"TIMED OUT (waited {self.timeout} s; its last output {self.last_output:.0f} s after the start), "
                 f"still running: {'; '.join(self.alive)} (killed)"
                 if self.timed_out else f'exit {self.rc}')
        return f"{self.cmd}\n-> {state}; output (tail):\n{self.output[-(16000 if self.timed_out else 4000):]}"

    def check(self):
        assert self.rc == 0 and not self.timed_out, self.describe()
        self.check_only_process_zero_wrote()
        return self

    def check_only_process_zero_wrote(self):
        """Processes 1, 2, ... made, wrote, renamed or removed nothing in out_dir (WORKER's notes)."""
        for rank in range(1, self.nproc if self.audited else 1):
            with open(f'{self.out_dir}.writes-{rank}') as f:  # (missing: the hook never ran)
                notes = f.read()
            assert not notes, f"process {rank} wrote in out_dir, which is process 0's alone:\n{notes}" + \
                self.describe()

    def metrics(self):
        with open(os.path.join(self.out_dir, 'metrics.jsonl')) as f:
            return [json.loads(line) for line in f]

    def ckpt(self, name='ckpt.pt'):
        return torch.load(os.path.join(self.out_dir, name), map_location='cpu', weights_only=True)


def run(nproc, out_dir, data_dir, *extra, timeout=RUN_TIMEOUT, torchrun=None, entry=AS_SCRIPT):
    return Launch(nproc, out_dir, data_dir, *extra, torchrun=torchrun, entry=entry).wait(timeout)


def kind(record):
    return 'eval' if 'val_loss' in record else 'train' if 'loss' in record else f'unknown {sorted(record)}'


def assert_metrics_close(got, want, rel=1e-5, where=''):
    """The same lines (iteration and kind) in the same order; losses and gradient norms within rel; lr and tokens
    equal."""
    assert [(kind(r), r['iter']) for r in got] == [(kind(r), r['iter']) for r in want], where
    for g, w in zip(got, want):
        # the tokens trained on so far (the plots' x axis): the whole job's, not one process's share
        assert g['tokens'] == w['tokens'], f"{where} iter {w['iter']} tokens: {g['tokens']} vs {w['tokens']}"
        for key in CLOSE_KEYS:
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=rel, abs=0), \
                    f"{where} iter {w['iter']} {key}: {g[key]!r} vs {w[key]!r}"
        if 'lr' in w:
            assert g['lr'] == pytest.approx(w['lr'], rel=1e-12), f"{where} iter {w['iter']} lr"


def assert_tensors_close(got, want, atol, where, scaled=False):
    """Nested dicts/lists of tensors and plain values: plain tensors (no DTensor shards) of the same shape
    and dtype within atol (scaled: atol times the tensor's largest magnitude, for the optimizer's moments,
    which are far smaller than 1); everything else equal."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{where}: {type(got).__name__}, expected a plain torch.Tensor"
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{where}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        bound = atol * (want.double().abs().max().item() if scaled and want.numel() else 1.0)
        assert diff <= bound, f"{where}: max abs difference {diff:.3g} > {bound:.3g}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), \
            f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"
        for k in want:
            assert_tensors_close(got[k], want[k], atol, f'{where}[{k!r}]', scaled)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tensors_close(g, w, atol, f'{where}[{i}]', scaled)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12), f"{where}: {got!r} vs {want!r}"
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def assert_same_state(got, want, where):
    """Weights within 1e-5, the optimizer state (whole tensors keyed by parameter name) within 1e-5 of each
    tensor's scale, the data sampler's generator identical: a checkpoint does not depend on the number of
    processes that wrote it. (On the CPU in float32 all of it is in fact bitwise equal today.)"""
    assert got['iter_num'] == want['iter_num'] and got['tokens'] == want['tokens'], where
    assert_tensors_close(got['model'], want['model'], 1e-5, f'{where} model')
    assert_tensors_close(got['optimizer'], want['optimizer'], 1e-5, f'{where} optimizer', scaled=True)
    assert torch.equal(got['batches']['generator'], want['batches']['generator']), f'{where}: batches state'


def log_lines(output, pattern):
    """The iterations of the lines matching `iter N: <pattern>` in the combined output, in order."""
    return [int(m) for m in re.findall(rf'^iter (\d+): {pattern}', output, re.M)]


# ----------------------------------------------------------------------------------------------------
# runs, shared by the tests

@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return tmp_path_factory.mktemp('dist')


@pytest.fixture(scope='module')
def data(root):
    return write_data(root / 'data')


@pytest.fixture(scope='module')
def single6(root, data):
    """The reference: one process, 6 iterations (eval at 0, 3, 6)."""
    return run(1, root / 'single6', data, '--max_iters=6').check()


@pytest.fixture(scope='module')
def single3(root, data):
    """One process stopped at 3 (copied, then resumed under torchrun by the 1 -> 2 tests)."""
    return run(1, root / 'single3', data, '--max_iters=3').check()


@pytest.fixture(scope='module', params=['ddp', 'fsdp'])
def par6(request, root, data):
    """Two processes, 6 iterations, DDP or FSDP2."""
    p = request.param
    r = run(2, root / f'{p}6', data, '--max_iters=6', f'--parallelism={p}').check()
    r.parallelism = p
    return r


@pytest.fixture(scope='module')
def accum4(root, data):
    """Runs to 6 with gradient_accumulation_steps=4, by process count and parallelism: with 2 processes each
    one takes 2 micro-steps per step (with FLAGS' 2, one each: its first micro-step is also its last)."""
    cache = {}

    def get(nproc, parallelism='ddp'):
        if (nproc, parallelism) not in cache:
            cache[nproc, parallelism] = run(nproc, root / f'accum4_{nproc}_{parallelism}', data, '--max_iters=6',
                                            '--gradient_accumulation_steps=4', f'--parallelism={parallelism}').check()
        return cache[nproc, parallelism]
    return get


@pytest.fixture(scope='module', params=['ddp-2to1', 'fsdp-2to1', 'ddp-1to2', 'fsdp-1to2'])
def resumed(request, root, data, single3):
    """A run to 3 iterations in one process count, resumed to 6 in the other."""
    p, direction = request.param.split('-')
    out = root / request.param
    if direction == '2to1':
        # the first run starts over an earlier run's files, which process 0 alone moves aside
        shutil.copytree(single3.out_dir, out)
        first = run(2, out, data, '--max_iters=3', f'--parallelism={p}').check()
        second = run(1, out, data, '--max_iters=6', f'--parallelism={p}', '--init_from=resume').check()
    else:
        shutil.copytree(single3.out_dir, out)
        first = single3
        second = run(2, out, data, '--max_iters=6', f'--parallelism={p}', '--init_from=resume').check()
    return SimpleNamespace(name=request.param, first=first, second=second, world_after=2 if direction == '1to2' else 1,
                           earlier=single3.out_dir)


# ----------------------------------------------------------------------------------------------------
# 1, 5: DDP and FSDP2 match one process

def test_two_processes_log_the_single_process_losses(par6, single6):
    # Reference: the single-process run of the same global batch (2 x 4 windows per step, same draws).
    assert_metrics_close(par6.metrics(), single6.metrics(), where=par6.parallelism)
    assert [r['iter'] for r in par6.metrics() if kind(r) == 'train'] == [1, 2, 3, 4, 5, 6]


def test_eval_losses_are_averaged_over_all_processes(par6, single6):
    # Reference: the single-process eval losses. Each process evaluates half of the eval_iters batches; a
    # rank-0-only mean, or one not divided by eval_iters, would differ from these.
    got = [r for r in par6.metrics() if kind(r) == 'eval']
    want = [r for r in single6.metrics() if kind(r) == 'eval']
    assert [r['iter'] for r in got] == [r['iter'] for r in want] == [0, 3, 6]
    for g, w in zip(got, want):
        for key in ('train_loss', 'val_loss'):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=0), (par6.parallelism, g['iter'], key)
    # the printed eval lines agree with the logged ones
    printed = re.findall(r'^iter (\d+): train loss ([\d.]+), val loss ([\d.]+)', par6.output, re.M)
    assert [(int(i), float(t), float(v)) for i, t, v in printed] == \
        [(r['iter'], round(r['train_loss'], 4), round(r['val_loss'], 4)) for r in got]


@pytest.mark.parametrize('accum', [2, 4])
def test_two_processes_end_with_the_single_process_weights(par6, single6, accum4, accum):
    # Reference: the single-process checkpoint. FSDP's must hold whole tensors under the plain parameter
    # names (gathered from the shards), the same optimizer state and the same data position.
    # accum=4: 2 micro-steps per process, so the gradients must be all-reduced on the last one of each step
    # (synced on the first, the second's gradients would stay this process's own and the weights differ).
    p = par6.parallelism
    par, single = (par6, single6) if accum == 2 else (accum4(2, p), accum4(1))
    got, want = par.ckpt(), single.ckpt()
    assert got['iter_num'] == 6
    assert_same_state(got, want, f'{p} accum={accum}')
    assert got['model_args'] == want['model_args']
    # best.pt: the weights at the best eval (iteration 6 here, the loss falls), also whole
    assert_tensors_close(par.ckpt('best.pt')['model'], single.ckpt('best.pt')['model'], 1e-5,
                         f'{p} accum={accum} best.pt model')
    if accum == 4:
        assert_metrics_close(par.metrics(), single.metrics(), where=f'{p} accum=4')


def test_bits_per_byte_left_out_by_every_process_when_one_cannot_count_them(root, data, single3):
    # Reference: the single-process run's losses. Counting the bytes takes a collective per split: were process 1
    # alone to skip it (its tokenizer would not load), process 0 would wait for it, and the run hang. Every process
    # leaves bits per byte out instead, process 0 says why in its report, and training goes on as it would.
    r = run(2, root / 'one_without_bytes', data, '--max_iters=3', entry=ONE_WITHOUT_BYTES, timeout=150).check()
    assert '\nbits per byte: not reported: another process could not count them\n' in r.output, r.describe()
    assert ("process 1: bits per byte not reported: the tokenizer cannot be loaded on this process's host\n"
            in r.output), r.describe()
    got, want = r.metrics(), single3.metrics()
    assert not [g for g in got if 'val_bpb' in g] and [w for w in want if 'val_bpb' in w]
    assert_metrics_close(got, [{k: v for k, v in w.items() if not k.endswith('_bpb')} for w in want])


@pytest.mark.parametrize('case', ['ddp', 'ddp_compiled', 'ddp_resumed', 'fsdp'])
def test_each_steps_gradients_and_collectives_under_ddp_and_fsdp(case, root, data, single3):
    # DDP runs with gradient_as_bucket_view: every gradient is a view of the bucket DDP all-reduces (this model's
    # 140 KB of gradients fit its first, of 1 MiB: one storage for all of them, of their size), zeroed, before the
    # first step (compiled: after the compile's warm-up; resumed: after the optimizer state's load) and after each
    # step. Gradients of their own (a second copy beside the buckets), or dropped to None (the next backward would
    # allocate them again, beside the buckets: DDP alone makes them views at its first all-reduce, after a first
    # step that holds them twice) would fail. FSDP drops its gradients after each step. With 2 micro-steps per
    # process, the first one's gradients are added into the views (no_sync). That the results are the single
    # process's: the tests above.
    # FSDP gathers each block's weights for its forward and again for its backward, all but the last block's, whose
    # backward follows its forward (reshard_after_forward=False), and the root's (embeddings, final norm, head) once:
    # the root, blocks 0 to n_layer - 1, then n_layer - 2 down to 0, each micro-step (resharding the last block too
    # would gather it once more; keeping another block whole, another block would be missing). DDP broadcasts
    # nothing during a step: RoPE's tables, the model's only buffers, are the same in every process (by default DDP
    # would send process 0's before the forward of each step's last micro-step)
    out, extra = root / f'grads_{case}', ['--gradient_accumulation_steps=4', '--max_iters=3']
    if case == 'ddp_compiled':
        extra.append('--compile=True')
    if case == 'ddp_resumed':
        shutil.copytree(single3.out_dir, out)
        extra = ['--gradient_accumulation_steps=4', '--max_iters=5', '--init_from=resume']
    parallelism = 'fsdp' if case == 'fsdp' else 'ddp'
    r = run(2, out, data, *extra, f'--parallelism={parallelism}', entry=GRADIENT_SPY).check()
    n_layer, micro_steps = int(FLAGS[0].removeprefix('--n_layer=')), 2  # 4 micro-batches a step, 2 per process
    blocks = [f'blocks.{i}' for i in range(n_layer)]
    micro_step = ['root', *blocks, *blocks[-2::-1]] if parallelism == 'fsdp' else []
    for rank in range(2):
        with open(f'{r.out_dir}.grads-{rank}') as f:
            seen = json.load(f)
        assert len(seen) == (2 if case == 'ddp_resumed' else 3), (rank, seen)
        sent = [(step.pop('gathers'), step.pop('broadcasts')) for step in seen]
        assert sent == [(micro_step * micro_steps, 0)] * len(seen), (case, rank, seen)
        for step in seen:
            for when, grads in step.items():
                want = (dict(grads, none=0, zero=True, storages=1, storage_bytes=grads['grad_bytes'])
                        if parallelism == 'ddp' else
                        dict(grads, none=grads['params'], zero=True, storages=0, storage_bytes=0, grad_bytes=0))
                assert grads == want, (case, rank, when, seen)


# ----------------------------------------------------------------------------------------------------
# 4: only process 0 prints and logs

def test_only_rank_zero_prints_and_logs(par6, single6):
    out = par6.output
    # Reference: one line per iteration, as in the single-process run's output.
    assert log_lines(out, 'loss ') == [1, 2, 3, 4, 5, 6], out[-3000:]
    assert log_lines(out, 'train loss ') == [0, 3, 6], out[-3000:]
    assert log_lines(single6.output, 'loss ') == [1, 2, 3, 4, 5, 6]
    for pattern in (r'^config:$', r'^model: ', r'^optimizations:$', r'^done: '):
        assert len(re.findall(pattern, out, re.M)) == 1, (pattern, out[-3000:])
    assert f'{"FSDP2" if par6.parallelism == "fsdp" else "DDP"}, 2 processes' in out
    assert 'broadcast_buffers' not in out  # torch 2.13's deprecation, a FutureWarning from every process
    # the optimizer state per parameter that a process holds, as in one process (FSDP: its shards, about half)
    state = r'optimizer state: ([0-9.]+) bytes per parameter \(adamw\)'
    (one,), [(two, held)] = (re.findall(state + ', ', single6.output),
                             re.findall(state + r', [0-9.,]+ MiB per process \(its ([0-9,]+) parameters\)', out))
    total = sum(p.numel() for p in GPT(GPTConfig(**single6.ckpt()['model_args'])).parameters())
    held = int(held.replace(',', ''))
    assert float(two) == pytest.approx(float(one), rel=0.05), out[-3000:]
    assert held == total if par6.parallelism == 'ddp' else total / 2 <= held < 0.6 * total, (held, total)
    # metrics.jsonl: exactly one line per logged iteration, in the loop's order
    assert [(kind(r), r['iter']) for r in par6.metrics()] == \
        [('eval', 0)] + [('train', i) for i in (1, 2, 3)] + [('eval', 3)] + \
        [('train', i) for i in (4, 5, 6)] + [('eval', 6)]
    # one RNG state per process, each its own (the processes are seeded seed + rank)
    for name in ('ckpt.pt', 'best.pt'):
        rng = par6.ckpt(name)['rng']
        assert len(rng) == 2, name
        assert not torch.equal(rng[0]['torch'], rng[1]['torch']), name
    assert len(single6.ckpt()['rng']) == 1
    # only process 0 writes files: nothing else in out_dir
    assert sorted(os.listdir(par6.out_dir)) == ['best.pt', 'ckpt.pt', 'metrics.jsonl', 'metrics.png']


def test_throughput_counts_the_tokens_of_all_processes(par6):
    # Reference: a step's tokens (batch_size x block_size x gradient_accumulation_steps, all processes' micro-batches)
    # over the printed time per step. One process's share per second would be half of it (the MFU, per process,
    # divides by the processes itself: test_train.py).
    cfg = par6.ckpt()['config']
    step_tokens = cfg['batch_size'] * cfg['block_size'] * cfg['gradient_accumulation_steps']
    printed = re.findall(r'^iter (\d+): loss [\d.]+, grad norm \S+, lr \S+, ([\d.]+) ms/iter, ([\d,]+) tok/s',
                         par6.output, re.M)
    logged = {r['iter']: r['tokens_per_sec'] for r in par6.metrics() if kind(r) == 'train'}
    assert [int(i) for i, _, _ in printed] == sorted(logged) == [1, 2, 3, 4, 5, 6], par6.output[-3000:]
    for i, ms, tok_s in printed:
        ms, tok_s = float(ms), int(tok_s.replace(',', ''))
        want = step_tokens * 1000 / ms  # ms is rounded to 0.1: want is within 0.05 / ms of the exact figure
        assert abs(tok_s - want) <= want * 0.06 / ms + 1, (par6.parallelism, i, tok_s, want)
        assert abs(logged[int(i)] - tok_s) <= 0.5, (par6.parallelism, i)


# ----------------------------------------------------------------------------------------------------
# 2: checkpoints resume across process counts

def test_resume_across_process_counts(resumed, single6):
    # Reference: the uninterrupted single-process run to 6. The run stopped at 3 (in one process count)
    # and resumed to 6 (in the other) must log the same losses and end with the same state.
    r = resumed
    assert 'resuming from' in r.second.output and 'at iteration 3' in r.second.output, r.second.describe()
    # the change of process count is said, with what becomes of the RNG streams (the data's draw is the same)
    said = {2: "resuming on 2 processes, the checkpoint's run had 1: the data goes on as it would have; RNG streams "
               "(dropout's masks) go on in process 0, the others' start anew from seed + rank + iteration",
            1: "resuming on 1 process, the checkpoint's run had 2: the data goes on as it would have; RNG streams "
               "(dropout's masks) go on in process 0, the others' are dropped"}[r.world_after]
    assert r.second.output.count(said) == 1, r.second.describe()
    assert_metrics_close(r.second.metrics(), single6.metrics(), where=r.name)
    got = r.second.ckpt()
    assert_same_state(got, single6.ckpt(), r.name)
    assert len(got['rng']) == r.world_after, r.name
    if r.world_after == 2:
        # process 1, which the one-process checkpoint lacks, is seeded afresh: a copy of process 0's restored state
        # would give both processes the same dropout masks from here on
        assert not torch.equal(got['rng'][0]['torch'], got['rng'][1]['torch']), r.name
    else:
        # the 2-process first run started over an earlier run (single3's files): moved aside whole, into one
        # folder (two processes moving them would race, and split them or fail)
        moved = [d for d in os.listdir(r.second.out_dir) if d.startswith('previous-')]
        assert len(moved) == 1, (r.name, sorted(os.listdir(r.second.out_dir)))
        assert sorted(os.listdir(os.path.join(r.second.out_dir, moved[0]))) == sorted(os.listdir(r.earlier)), r.name


def test_resume_with_dropout_gives_each_process_its_own_rng_state(root, data):
    # Reference: the same 2-process DDP run with dropout 0.2, uninterrupted. Each process draws its own dropout
    # masks (seeded seed + rank); stopped at 2 and resumed, each must take back its own saved RNG state, or the
    # masks of process 1 after the resume are process 0's and the losses differ.
    drop = ['--dropout=0.2', '--eval_interval=2', '--lr_decay_iters=4']
    straight = run(2, root / 'drop_straight', data, *drop, '--max_iters=4').check()
    first = run(2, root / 'drop_resumed', data, *drop, '--max_iters=2').check()
    rng = first.ckpt()['rng']
    assert len(rng) == 2 and not torch.equal(rng[0]['torch'], rng[1]['torch'])
    second = run(2, root / 'drop_resumed', data, *drop, '--max_iters=4', '--init_from=resume').check()
    assert 'at iteration 2' in second.output and 'resuming on' not in second.output, second.describe()
    assert_metrics_close(second.metrics(), straight.metrics(), where='dropout resume')
    assert_same_state(second.ckpt(), straight.ckpt(), 'dropout resume')


@pytest.mark.parametrize('start', ['scratch', 'resume_1to3'])
def test_three_processes_each_get_their_own_rng_state(start, root, data, request):
    # Reference: the other processes' RNG states in the checkpoint, which must all differ: each process draws its
    # own dropout masks from its own (these runs have dropout 0, so only the states are compared). Seeded seed +
    # rank from scratch; on a resume with more processes than the checkpoint's, each new process seed + rank +
    # iteration. A seed that tells process 0 from the others but not 1 from 2, which two processes cannot show,
    # would give processes 1 and 2 the same masks.
    out = root / f'three_{start}'
    extra = ['--gradient_accumulation_steps=3', '--max_iters=1']
    if start == 'resume_1to3':
        shutil.copytree(request.getfixturevalue('single3').out_dir, out)
        extra = ['--gradient_accumulation_steps=3', '--max_iters=4', '--init_from=resume']
    r = run(3, out, data, *extra).check()
    rng = [state['torch'] for state in r.ckpt()['rng']]
    assert len(rng) == 3, r.describe()
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert not torch.equal(rng[i], rng[j]), (start, i, j)
    # the seeds themselves (dropout 0: nothing draws from them before the save): a new process of a resume at
    # iteration 3 seeded as a scratch run's would repeat that run's first masks
    seed = r.ckpt()['config']['seed']
    for rank in (1, 2):
        want = seed + rank + (3 if start == 'resume_1to3' else 0)
        assert torch.equal(rng[rank], torch.Generator().manual_seed(want).get_state()), (start, rank)


# ----------------------------------------------------------------------------------------------------
# 3: gradient_accumulation_steps must split evenly among the processes

def test_accumulation_not_divisible_by_processes_is_an_error(root, data):
    r = run(2, root / 'accum3', data, '--max_iters=2', '--gradient_accumulation_steps=3')
    assert r.rc != 0 and not r.timed_out, r.describe()
    errors = re.findall(r'^train\.py: error: (.*)$', r.output, re.M)
    assert errors, r.describe()
    assert all('gradient_accumulation_steps' in e for e in errors), errors  # the key is named
    assert not log_lines(r.output, '') and not os.path.exists(os.path.join(r.out_dir, 'ckpt.pt'))


# ----------------------------------------------------------------------------------------------------
# 5 (uneven shares): eval_iters not divisible by the number of processes

@pytest.fixture(scope='module')
def eval_data(root, data):
    """The data of an eval-only run with a given eval_iters: `data`, except for the whole-split eval
    (eval_iters=0, train.Windows), which gets a val split of 600 tokens: 18 windows of 32 + 1, 5 batches of 4
    (the last one half full), not divisible by 2 processes (data's 800 tokens make 6 batches)."""
    odd = write_data(root / 'data_odd_val', n_val=600)
    return lambda eval_iters: data if eval_iters else odd


@pytest.fixture(scope='module')
def single_eval(root, eval_data):
    """The single-process eval losses at iteration 0 for a given eval_iters (max_iters=0: eval only)."""
    cache = {}

    def get(eval_iters):
        if eval_iters not in cache:
            cache[eval_iters] = run(1, root / f'single_eval{eval_iters}', eval_data(eval_iters), '--max_iters=0',
                                    f'--eval_iters={eval_iters}').check().metrics()
        return cache[eval_iters]
    return get


HANG_TIMEOUT = 30  # seconds; these runs take about 6 s


@pytest.mark.parametrize('parallelism, eval_iters', [('ddp', 5), ('fsdp', 5), ('ddp', 1), ('fsdp', 0)])
def test_eval_iters_not_divisible_by_processes(parallelism, eval_iters, root, eval_data, single_eval):
    # eval_iters=5 with 2 processes: process 0 evaluates 3 batches, process 1 evaluates 2; eval_iters=1:
    # process 1 evaluates none; eval_iters=0 (the whole val split, 5 batches of windows): process 0 evaluates
    # 3, process 1 2 and a repeat of weight 0. Reference: the single-process eval losses over the same batches;
    # for eval_iters=1, which leaves a process without a batch, main's config error (its line alone: the run prints
    # its config, eval_iters' line included, before any error). Not acceptable: a hang (under FSDP every forward is
    # a collective all-gather, so a process with one forward more than the other waits for a partner that never
    # comes), a crash with a traceback, or any other error.
    r = run(2, root / f'{parallelism}_eval{eval_iters}', eval_data(eval_iters), '--max_iters=0',
            f'--eval_iters={eval_iters}', f'--parallelism={parallelism}', timeout=HANG_TIMEOUT)
    assert not r.timed_out, (f"HANG: eval_iters={eval_iters} under {parallelism} with 2 processes did not "
                             f"finish in {HANG_TIMEOUT} s (it takes about 6 s when it works)\n" + r.describe())
    if eval_iters == 1:
        assert r.rc != 0 and re.findall(r'^train\.py: error: (.*)$', r.output, re.M) == [
            'eval_iters=1 is the global number of eval batches, shared among the processes: give at least one to '
            'each of the 2'], r.describe()
        return
    assert r.rc == 0, r.describe()
    want = single_eval(eval_iters)
    assert len(want) == 1 and kind(want[0]) == 'eval'
    assert_metrics_close(r.metrics(), want, where=f'{parallelism} eval_iters={eval_iters}')


@pytest.mark.parametrize('late', [0, 1.5])
def test_a_config_error_is_printed_once(root, eval_data, late):
    # Reference: the README ("Only process 0 prints"): a config error, every process's alike, once, not once per
    # process; also where process 0, which prints it, starts 1.5 s after the other (a loaded node): torchrun stops
    # every process once one has exited, and the other one, left silent, exited first
    entry = f"import time\ntime.sleep({late} if rank == 0 else 0)\n" + AS_SCRIPT
    r = Launch(2, root / f'config_error{late}', eval_data(2), '--gradient_accumulation_steps=3',
               entry=entry).wait(HANG_TIMEOUT)
    assert r.rc != 0 and not r.timed_out, r.describe()
    assert r.output.count('train.py: error: gradient_accumulation_steps=3 is the global number') == 1, r.describe()


# An entry in which process 1 alone cannot read the train split (its file system refuses it: a permission, a
# failing disk), where process 0 reads it
ONE_CANNOT_READ = '''if rank == 1:
    def deny(event, args):
        if event == 'open' and str(args[0]).endswith('train.bin'):
            raise PermissionError(13, 'Permission denied')
    sys.addaudithook(deny)
''' + AS_SCRIPT


@pytest.mark.parametrize('case', ['no_checkpoint', 'one_process_cannot_read', 'process_zero_alone', 'nonfinite'])
def test_each_error_is_printed_by_the_process_that_finds_it(case, root, eval_data):
    # Reference: the README ("Only process 0 prints"): an error of the files, by each process that finds it: a
    # missing checkpoint by both processes, a data file that process 1 alone cannot read by process 1 (printed by
    # process 0 alone, it was never printed: process 0 read it; and process 0, left alone in a collective, prints no
    # traceback), an out_dir that process 0 alone creates and cannot (a file in its path) by process 0, once: the
    # other's "process 0 stopped with an error" would say nothing more, and process 0 prints before the other leaves
    # (torchrun stops every process once one exited). A stop that both processes agree on (non-finite steps, whose
    # losses and norms they share), once, by no process's name (it is both's). One process's error names its process:
    # each process's line reads the same otherwise (an out-of-memory "on cpu" from each, in one log)
    extra, entry = [], AS_SCRIPT
    if case == 'no_checkpoint':
        extra, error, by = ['--init_from=resume'], f"no checkpoint at {root / 'error_no_checkpoint'}", ['0', '1']
    elif case == 'one_process_cannot_read':  # (process 0 then says that it lost process 1, if it can before torchrun
        # stops it: not a traceback)
        entry, error, by = ONE_CANNOT_READ, 'train.bin cannot be read: Permission denied', ['1']
    elif case == 'process_zero_alone':
        (root / 'error_file').write_text('a file, not a directory')
        extra, error, by = [f"--out_dir={root / 'error_file' / 'out'}"], 'out_dir ', ['0']
    else:  # AdamW's steps of 1e30 make the weights overflow: NaN gradients from the second step on
        extra = ['--learning_rate=1e30', '--max_nonfinite_steps=2', '--max_iters=8', '--eval_interval=100']
        error, by = 'iteration 3: 2 consecutive steps with a non-finite loss or gradient; stopping.', ['']
    r = Launch(2, root / f'error_{case}', eval_data(2), '--gradient_accumulation_steps=2', *extra,
               entry=entry).wait(HANG_TIMEOUT)
    assert r.rc != 0 and not r.timed_out, r.describe()
    lines = re.findall(r'^train\.py: error: (?:process (\d) of 2: )?(.*)$', r.output, re.M)  # (process, error)
    lost = [who for who, line in lines if line.startswith('lost the connection to another process')]
    printed = [(who, line) for who, line in lines if not line.startswith('lost the connection to another process')]
    assert sorted(who for who, _ in printed) == by and all(error in line for _, line in printed), r.describe()
    assert all(lost), r.describe()  # one process's: which one
    assert 'process 0 stopped' not in r.output, r.describe()  # (torchrun's own traceback follows: its workers failed)
    assert not re.search(r'File ".*train\.py", line', r.output), r.describe()


@pytest.mark.parametrize('rank, local_rank, world, printed', [('0', '0', '4', True), ('2', '0', '4', True),
                                                             ('3', '1', '4', False), (None, '1', None, True)])
def test_a_config_error_is_printed_by_the_first_process_of_each_node(tmp_path, rank, local_rank, world, printed):
    # Reference: the environment torchrun gives process 2 of 4 on two nodes of two (RANK 2, LOCAL_RANK 0): a config
    # error can be one node's alone (a device it lacks), and each node's log is its own, so its first process
    # prints it; the node's others exit 1 silently. (Before, only RANK 0 printed: node 2's log said nothing.) A
    # plain run that inherited a LOCAL_RANK from its job's environment, without torchrun's WORLD_SIZE, prints it.
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')}
    env.update({k: v for k, v in (('RANK', rank), ('LOCAL_RANK', local_rank), ('WORLD_SIZE', world)) if v})
    proc = subprocess.run([sys.executable, os.path.join(HERE, 'train.py'), '--learning_rat=1e-3',
                           f'--out_dir={tmp_path}'], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == ("train.py: error: unknown config key 'learning_rat' in flag '--learning_rat=1e-3'; did you "
                           "mean 'learning_rate'?\n" if printed else ''), proc.stderr


# ----------------------------------------------------------------------------------------------------
# 6: Batches splits the one-process draw among the processes (in-process, no torchrun)

@pytest.mark.parametrize('groups', [4, 6, 3])
def test_batches_split_the_single_process_draw(groups):
    from train import Batches
    tokens = np.arange(3000, dtype=np.uint16)  # a window's first token is its start: easy to compare
    B, T, steps, world = 3, 8, 5, 2

    def draws(rank, w):
        b = Batches(tokens, B, T, 'cpu', seed=7, groups=groups, rank=rank, world=w)
        assert b.share == len(range(rank, groups, w))
        return [[b.next() for _ in range(b.share)] for _ in range(steps)]

    ref = draws(0, 1)
    parts = [draws(r, world) for r in range(world)]
    for step in range(steps):
        assert len(ref[step]) == groups
        union = {}
        for rank in range(world):
            for j, (x, y) in enumerate(parts[rank][step]):
                union[rank + j * world] = (x, y)  # rank r holds micro-batches r, r + world, ...
        assert sorted(union) == list(range(groups))
        for m, (x, y) in enumerate(ref[step]):
            ux, uy = union[m]
            assert x.shape == (B, T) and x.dtype == torch.int64
            assert torch.equal(ux, x) and torch.equal(uy, y), (groups, step, m)
            assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
    # the draws do differ between steps and micro-batches (a constant batch would pass the above)
    firsts = {tuple(x[:, 0].tolist()) for step in ref for x, _ in step}
    assert len(firsts) == steps * groups


def test_batches_with_no_share_for_a_process():
    # groups=1, world=2 (what eval_iters=1 would give under 2 processes; train.py refuses that config):
    # process 1 has no micro-batch of the draw. Reference: process 0 draws exactly the one-process
    # batches, and Batches refuses to build a sampler that could never yield a batch.
    from train import Batches
    tokens = np.arange(3000, dtype=np.uint16)
    ref = Batches(tokens, 3, 8, 'cpu', seed=7, groups=1, rank=0, world=1)
    r0 = Batches(tokens, 3, 8, 'cpu', seed=7, groups=1, rank=0, world=2)
    for _ in range(3):
        assert torch.equal(r0.next()[0], ref.next()[0])
    with pytest.raises(ValueError, match='no micro-batch'):
        Batches(tokens, 3, 8, 'cpu', seed=7, groups=1, rank=1, world=2)


def test_batches_draw_every_start_that_leaves_a_whole_window():
    # Reference: the starts by hand. A window is tokens[s : s + T + 1], so len - T starts fit: T + 2 tokens
    # give starts 0 and 1, both drawn in 200 windows (each missed with probability 2^-200); T + 1 tokens
    # give start 0 only, and still a batch (x[:, 0] is the start: the tokens are 0, 1, 2, ...).
    from train import Batches
    T = 8
    b = Batches(np.arange(T + 2, dtype=np.uint16), 4, T, 'cpu', seed=7)
    starts = {s for _ in range(50) for s in b.next()[0][:, 0].tolist()}
    assert starts == {0, 1}
    x, y = Batches(np.arange(T + 1, dtype=np.uint16), 4, T, 'cpu', seed=7).next()
    assert x.tolist() == [list(range(T))] * 4 and y.tolist() == [list(range(1, T + 1))] * 4


@pytest.mark.parametrize('rank, world', [(0, 1), (0, 2), (1, 2)])
def test_batches_state_dict_reproduces_the_next_batches(rank, world):
    from train import Batches
    tokens = np.arange(3000, dtype=np.uint16)
    B, T, groups = 3, 8, 4
    make = lambda seed: Batches(tokens, B, T, 'cpu', seed=seed, groups=groups, rank=rank, world=world)  # noqa: E731
    b = make(7)
    for _ in range(3 * b.share):  # three steps
        b.next()
    state = b.state_dict()
    expected = [b.next() for _ in range(4 * b.share)]
    # restored into a sampler seeded differently, and through torch.save / weights_only load
    path = os.path.join(os.environ.get('TMPDIR', '/tmp'), f'batches-state-{os.getpid()}-{rank}-{world}.pt')
    torch.save(state, path)
    try:
        state = torch.load(path, weights_only=True)
    finally:
        os.remove(path)
    c = make(99)
    c.next()
    c.load_state_dict(state)
    for i, (x, y) in enumerate(expected):
        cx, cy = c.next()
        assert torch.equal(cx, x) and torch.equal(cy, y), i
    # a state saved by a 2-process run continues the 1-process draw, and the other way
    other = Batches(tokens, B, T, 'cpu', seed=1, groups=groups, rank=0, world=3 - world)
    other.load_state_dict(state)
    full = Batches(tokens, B, T, 'cpu', seed=1, groups=groups, rank=0, world=1)
    full.load_state_dict(state)
    whole = [full.next() for _ in range(groups)]
    for j in range(other.share):
        assert torch.equal(other.next()[0], whole[j * (3 - world)][0])
    for j in range(b.share):
        assert torch.equal(expected[j][0], whole[rank + j * world][0])


# ----------------------------------------------------------------------------------------------------
# 7: SIGTERM to the launcher

def wait_for_a_training_line(launch, seconds=90):
    """Until the run's metrics.jsonl has a training line, the run ends, or `seconds` pass."""
    metrics, deadline = os.path.join(launch.out_dir, 'metrics.jsonl'), time.time() + seconds
    while time.time() < deadline and launch.proc.poll() is None:
        if os.path.exists(metrics):
            with open(metrics) as f:
                if any('"loss"' in line for line in f):
                    return
        time.sleep(0.1)


def test_sigterm_stops_both_processes_at_one_step_and_resumes(root, data):
    out = root / 'sigterm'
    long_run = ['--eval_interval=1000', '--lr_decay_iters=1000']  # eval at 0 only; a fixed schedule
    launch = Launch(2, out, data, *long_run, '--max_iters=1000')
    try:
        wait_for_a_training_line(launch)
        assert launch.proc.poll() is None, "the run ended before the signal:\n" + launch.wait(1).describe()
        launch.proc.send_signal(signal.SIGTERM)  # to the launcher only; it forwards it to the workers
        launch.wait(90)
    finally:
        if launch.rc is None:
            launch.wait(0)
    out_text = launch.output
    assert not launch.timed_out, launch.describe()
    assert launch.rc != 0, launch.describe()
    saved = re.findall(r'^SIGTERM: saved .*ckpt\.pt at iteration (\d+)\. Resume with:', out_text, re.M)
    assert len(saved) == 1, launch.describe()
    assert out_text.count('SIGTERM received: stopping after this step') == 1, launch.describe()  # not one per process
    stopped = int(saved[0])
    assert 1 <= stopped < 1000
    # both workers exited by themselves within the launcher's grace period, without a traceback
    assert 'forcefully exiting via 9' not in out_text, launch.describe()
    assert not re.search(r'File ".*train\.py", line', out_text), launch.describe()
    ckpt = launch.ckpt()
    assert ckpt['iter_num'] == stopped and len(ckpt['rng']) == 2
    launch.check_only_process_zero_wrote()  # the save at the signal too
    lines = launch.metrics()
    assert [r['iter'] for r in lines if kind(r) == 'train'] == list(range(1, stopped + 1))

    # the checkpoint resumes (here in one process) and repeats an uninterrupted run's losses and weights
    end = stopped + 2
    resumed = run(1, out, data, *long_run, f'--max_iters={end}', '--init_from=resume').check()
    reference = run(1, root / 'sigterm_ref', data, *long_run, f'--max_iters={end}').check()
    assert_metrics_close(resumed.metrics(), reference.metrics(), where='sigterm resume')
    assert_same_state(resumed.ckpt(), reference.ckpt(), 'sigterm resume')


def test_sigterm_to_one_worker_stops_both_processes_at_one_step(root, data):
    # Reference: the rule in train_loop: a signal that reaches any one process (a scheduler or a user that signals
    # one worker's pid) stops them all after the same step, with one checkpoint of that step; the other process
    # must not go on training alone until max_iters.
    out = root / 'sigterm_one'
    long_run = ['--eval_interval=1000', '--lr_decay_iters=1000']
    launch = Launch(2, out, data, *long_run, '--max_iters=1000')
    try:
        workers = []
        wait_for_a_training_line(launch)
        for pid in descendants(launch.proc.pid):
            with open(f'/proc/{pid}/cmdline') as f:
                cmd = f.read().split(chr(0))
            if launch.script in cmd and 'torch.distributed.run' not in cmd:
                workers.append(pid)
        assert launch.proc.poll() is None and len(workers) == 2, launch.wait(1).describe()
        os.kill(workers[-1], signal.SIGTERM)  # one worker only
        launch.wait(90)
    finally:
        if launch.rc is None:
            launch.wait(0)
    assert not launch.timed_out and launch.rc != 0, launch.describe()
    saved = re.findall(r'^SIGTERM: saved .*ckpt\.pt at iteration (\d+)\. Resume with:', launch.output, re.M)
    assert len(saved) == 1 and 1 <= int(saved[0]) < 1000, launch.describe()
    assert launch.ckpt()['iter_num'] == int(saved[0])
    assert [r['iter'] for r in launch.metrics() if kind(r) == 'train'][-1] == int(saved[0])
    launch.check_only_process_zero_wrote()  # the signalled process 1 leaves the save to process 0


def test_one_process_under_torchrun_is_the_plain_run(root, data, single6):
    # torchrun with one process takes the plain run's path (no process group, no DDP wrapper), so its
    # metrics equal the plain run's exactly, and it says that parallelism is off.
    r = run(1, root / 'torchrun1', data, '--max_iters=6', torchrun=True).check()
    assert 'parallelism       off (one process)' in r.output
    assert_metrics_close(r.metrics(), single6.metrics(), rel=0, where='torchrun, 1 process')
