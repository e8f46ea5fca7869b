"""
Tests for bench.py on the CPU, in seconds: the ladder's JSON on a tiny model; every rung that changes
only speed ends at the fp32 baseline's loss, and that check does catch a rung that breaks the math; the
separate-QKV attention of the first rungs against model.py's fused one; the batch search and the
settings fit mode prints; fit mode's message on the CPU; the presets against the training configs, a
timed step as one optimizer step of all its micro-batches, and staged data (one step's batches, read once);
the activation memory count against sizes computed from the shapes (checkpointing full and selective per
block, the logits the chunked loss drops); .ci/gpu's commands against bench.py's and train.py's own checks.

    python -m pytest -q test_bench.py
"""
import collections
import importlib.util
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import bench
import train
from configurator import configure
import model as model_module
from model import GPT, CausalSelfAttention, GPTConfig, rope_cache

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(1)  # tiny models: one thread is as fast, and immune to a busy machine
# random tokens (data/ is not in a fresh clone); no compile: ~20 s for each compiled rung
TINY = ['--preset=tiny', '--compile=False', '--device=cpu', '--data_dir=no-such-dir']
TOL = 1e-5  # fp32 rungs that change only speed end within ~3e-7 of the baseline's loss on the CPU
ROW_KEYS = {'rung', 'name', 'precision', 'settings', 'status', 'reason', 'builds_on', 'ms_per_iter',
            'tokens_per_sec', 'mfu', 'peak_mem_mb', 'activation_mb', 'optimizer_state_mb', 'loss',
            'speedup_vs_baseline', 'speedup_vs_prev', 'mfu_peak', 'losses'}
META_KEYS = {'command', 'date', 'device', 'torch', 'model', 'params', 'batch_size', 'block_size',
             'gradient_accumulation_steps', 'tokens_per_iter', 'step_note', 'warmup', 'steps', 'repeats', 'data',
             'rungs', 'variants'}


def run_ladder(out, *flags):
    assert bench.main([*TINY, f'--out={out}', *flags]) == 0
    with open(os.path.join(out, 'bench.json')) as f:
        return json.load(f)


@pytest.fixture(scope='module')
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    return run_ladder(str(out)), out


def test_ladder_writes_every_rung_with_the_documented_keys(result):
    report, out = result
    assert META_KEYS <= set(report) and report['command'].startswith('python bench.py --preset=tiny')
    assert [r['rung'] for r in report['rungs']] == list(range(1, len(bench.LADDER) + len(bench.MEMORY) + 1))
    for r in report['rungs']:
        assert set(r) == ROW_KEYS, r['name']
        if r['status'] == 'ok':
            assert r['ms_per_iter'] > 0 and r['tokens_per_sec'] > 0 and r['loss'] > 0 and r['reason'] is None
            assert r['activation_mb'] > 0  # measured on the CPU as on a GPU
            assert r['mfu'] is None and r['peak_mem_mb'] is None  # n/a on the CPU, never a made-up figure
        else:
            assert r['reason'], f"rung {r['name']} is {r['status']} without a reason"
    status = {r['name']: r['status'] for r in report['rungs']}
    for name in ('+ TF32', '+ bf16 autocast', '+ fused AdamW', '+ torch.compile', '+ FP8 linears'):
        assert status[name] == 'skipped', name  # CUDA only, off on the CPU, or --compile=False
    for name in ('fp32 eager', '+ SDPA flash', '+ chunked loss', '+ act. ckpt full', '+ act. ckpt selective'):
        assert status[name] == 'ok', name
    # vs baseline: over the first rung that ran (fp32 eager), every rung's; the timings differ, so a speedup over
    # any other rung (each over itself: 1.0) would not match
    ok = [r for r in report['rungs'] if r['status'] == 'ok']
    assert ok[0]['name'] == 'fp32 eager' and len({r['ms_per_iter'] for r in ok}) > 1
    for r in ok:
        assert r['speedup_vs_baseline'] == pytest.approx(ok[0]['ms_per_iter'] / r['ms_per_iter']), r['name']
    saved = {r['name']: r['activation_mb'] for r in report['rungs']}
    assert saved['+ act. ckpt full'] < saved['+ act. ckpt selective'] < saved['+ chunked loss']  # the rung built on
    md = open(out / 'bench.md').read()
    assert report['command'] in md and report['device'] in md and md.count('\n| ') == len(report['rungs']) + 1
    pytest.importorskip('matplotlib')
    assert (out / 'bench.png').stat().st_size > 1000


def test_many_timed_steps_give_each_rungs_mean_loss_over_their_last_half(result, tmp_path):
    # Reference: bench.json's losses, averaged here over the last half of the 20 timed steps (2 x 10), for the two
    # rungs that ran, and the second's difference to the first; the default 2 x 2 steps (the module's run) give no
    # such line, where one step's noise would be all it says.
    report = run_ladder(str(tmp_path), '--rungs=1,4', '--steps=10', '--repeats=2')
    (one, four) = [r for r in report['rungs'] if r['status'] == 'ok']
    assert (one['rung'], four['rung']) == (1, 4) and len(one['losses']) == len(four['losses']) == 20
    m1, m4 = (sum(r['losses'][10:]) / 10 for r in (one, four))
    want = (f"loss, mean of the last 10 of the 20 timed steps: rung 1 {m1:.5f}; rung 4 {m4:.5f} "
            f"({(m4 / m1 - 1) * 100:+.2f}% against rung 1)")
    assert open(tmp_path / 'bench.md').read().endswith('\n\n' + want + '\n')
    assert 'loss, mean' not in open(result[1] / 'bench.md').read()


def test_loss_means_start_at_20_timed_steps():
    # Reference: the docstring: from 20 timed steps on, each rung's mean over the last half. Made-up losses: 1 to 20
    # and twice that, means of the last 10 by hand 15.5 and 31 (+100%); 19 steps give no line; rungs that did not
    # run (no losses) are left out.
    rows = [dict(rung=1, status='ok', losses=[float(i) for i in range(1, 21)]),
            dict(rung=2, status='skipped', losses=None), dict(rung=3, status='failed', losses=None),
            dict(rung=4, status='ok', losses=[2.0 * i for i in range(1, 21)])]
    assert bench.loss_means(rows) == ('loss, mean of the last 10 of the 20 timed steps: rung 1 15.50000; rung 4 '
                                      '31.00000 (+100.00% against rung 1)')
    # a difference that rounds to 0 is +0.00%, not -0.00%
    rows[3]['losses'] = [i - 1e-6 for i in rows[0]['losses']]
    assert bench.loss_means(rows).endswith('rung 4 15.50000 (+0.00% against rung 1)')
    for r in rows[::3]:
        r['losses'] = r['losses'][:19]
    assert bench.loss_means(rows) == ''


def test_speed_only_rungs_keep_the_baseline_loss(result):
    rungs = [r for r in result[0]['rungs'] if r['status'] == 'ok']
    baseline = rungs[0]['loss']
    fp32 = [r for r in rungs if r['settings']['dtype'] == 'float32' and r['settings']['optimizer'] == 'adamw']
    assert len(fp32) >= 4  # baseline, SDPA flash, fused QKV, activation checkpointing
    for r in fp32:
        assert abs(r['loss'] - baseline) < TOL, (r['name'], r['loss'], baseline)
        # each timed step's loss, in order (the tiny preset: 3 repeats of 2 steps), the last one the rung's loss
        assert len(r['losses']) == 6 and r['losses'][-1] == r['loss'], r['name']
        assert max(abs(a - b) for a, b in zip(r['losses'], rungs[0]['losses'])) < TOL, r['name']
    assert len(set(rungs[0]['losses'])) == 6  # 6 steps, 6 different batches
    for r in rungs:  # 8-bit optimizer states: close, not equal
        assert abs(r['loss'] - baseline) < 1e-2, (r['name'], r['loss'], baseline)


def test_rungs_runs_only_those_with_the_settings_of_the_whole_ladder(result, tmp_path):
    # Reference: the whole ladder's rows. A rung run alone (--rungs) has the settings it has in the whole
    # ladder, the rungs before it included, and so the same loss; the others are listed as not run.
    full = {r['rung']: r for r in result[0]['rungs']}
    part = {r['rung']: r for r in run_ladder(str(tmp_path), '--rungs=1,7,10')['rungs']}
    assert part.keys() == full.keys()
    for i, r in part.items():
        assert r['settings'] == full[i]['settings'], i
        if i in (1, 7, 10):
            assert r['status'] == 'ok' and abs(r['loss'] - full[i]['loss']) < TOL, i
        else:
            assert r['status'] == 'not run' and r['ms_per_iter'] is None, i
    # vs prev: over the rung a rung builds on, when it ran. Rungs 2-6 did not, so rung 7 has no such rung (1 lacks
    # their changes); the memory rungs build on the last of the ladder that ran (8 is skipped here: compile off)
    assert part[7]['speedup_vs_prev'] is None and part[7]['builds_on'] is None
    assert part[10]['speedup_vs_prev'] == pytest.approx(part[7]['ms_per_iter'] / part[10]['ms_per_iter'])
    assert part[10]['builds_on'] == full[7]['name']
    for bad, words in (('0,3', 'numbered 1 to 12'), ('x', 'rung numbers separated by commas')):
        with pytest.raises(bench.ConfigError, match=words):
            bench.setup([*TINY, f'--rungs={bad}'])


@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise'])
def test_fp8_rung_converts_with_the_recipe_asked_for(monkeypatch, recipe):
    # Reference: the recipe given on the command line reaches train.convert_to_fp8 (faked here: FP8 needs a
    # GPU of capability 8.9) and the rung's precision names it; a recipe train.py does not know is an error.
    seen = []
    monkeypatch.setattr(train, 'convert_to_fp8', lambda model, r, device: seen.append(r) or False)
    env = bench.setup([*TINY, f'--fp8_recipe={recipe}'])
    s = {**bench.BASE, 'fp8': True}
    with pytest.raises(bench.BenchError, match='no linear layer is large enough'):
        bench.run_rung(s, env)
    assert seen == [recipe]
    assert bench.precision(s, env.fp8_recipe) == f'fp32 + FP8 linears ({recipe})'
    with pytest.raises(bench.ConfigError, match="fp8_recipe='columnwise'"):
        bench.setup([*TINY, '--fp8_recipe=columnwise'])


def test_profile_mode_writes_the_shares_of_each_kind(tmp_path, monkeypatch):
    # Reference: the kinds of known kernel names (CUDA's, as the profiler reports them), and on the CPU a
    # profile whose shares cover all the operator time: the optimizer's step and the matmuls are there, the
    # optimizer's share holding at least all the time the profiler's call tree puts under Optimizer.step.
    names = {'sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64': 'matmul',
             'nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN': 'matmul',
             'void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>': 'attention',
             'cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3': 'attention',
             'void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>':
                 'optimizer',
             'triton_red_fused__log_softmax_backward_data_mul_0': 'elementwise and other',
             'triton_poi_fused_add_mul_rsqrt_1': 'elementwise and other',
             'Memcpy HtoD (Pageable -> Device)': 'memory copy',
             # inductor's fused kernels name the ops they fuse: a fused cast is no memory copy (seen on an H100)
             'triton_poi_fused__to_copy_add_cat_flip_mul_transpose_unsqueeze_view_8': 'elementwise and other',
             'triton_tem_fused_mm_0': 'matmul',
             # FP8 (torchao, compiled; names from .ci/triton_code.py --fp8=tensorwise): the casts feeding _scaled_mm
             # and the absolute maxima of the scales, alone or fused into a norm; the FP8 matmul itself
             'triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_t_view_5': 'elementwise with FP8 casts',
             'triton_red_fused_abs_max_t_3': 'elementwise with FP8 casts',
             'triton_red_fused_abs_add_embedding_max_mean_mul_pow_rsqrt_1': 'elementwise with FP8 casts',
             'sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cgasize1x2x1_warpgroupsize1x1x1': 'matmul',
             'aten::_scaled_mm': 'matmul'}
    for name, kind in names.items():
        assert bench.kind_of(name) == kind, name
    profiles, run_rung = [], bench.run_rung
    monkeypatch.setattr(bench, 'run_rung', lambda *a, **k: profiles.append(run_rung(*a, **k)) or profiles[-1])
    assert bench.main([*TINY, f'--out={tmp_path}', '--mode=profile']) == 0
    text = (tmp_path / 'profile.md').read_text()
    shares = dict(re.findall(r'^\| ([a-z ]+) \| [\d,.]+ \| ([\d.]+)% \|$', text, re.M))
    assert {'optimizer', 'matmul', 'attention'} <= set(shares), text
    assert sum(map(float, shares.values())) == pytest.approx(100, abs=0.5)
    assert 'top operators by time' in text and '`aten::mm`' in text
    # each listed operator's kind is the one the shares count its time under: the rows of a kind add up to no
    # more than the kind's time (AdamW's sqrt once counted as elementwise, in rows alone above that share)
    times = dict(re.findall(r'^\| ([a-z ]+) \| ([\d,.]+) \| [\d.]+% \|$', text, re.M))
    rows = re.findall(r'^\| `[^`]+` \| ([a-z ]+) \| ([\d,.]+) \|', text, re.M)
    assert rows and any(kind == 'optimizer' for kind, _ in rows)
    for kind in {kind for kind, _ in rows}:
        listed = [float(ms.replace(',', '')) for k, ms in rows if k == kind]
        assert sum(listed) <= float(times[kind].replace(',', '')) + 0.05 * len(listed), kind

    def under_step(e):
        return e is not None and (e.name.startswith('Optimizer.step') or under_step(e.cpu_parent))
    step_ms = sum(e.self_cpu_time_total for e in profiles[0]['timed'].events()
                  if e.device_type == torch.autograd.DeviceType.CPU and under_step(e)) / 1000
    assert step_ms > 0 and float(times['optimizer'].replace(',', '')) >= step_ms - 0.051  # (clipping's ops: more)


def fake_kernel(name, start, end):
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, kernels=[],
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def fake_cpu_call(name, parent=None, kernels=()):
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CPU, cpu_parent=parent,
                           kernels=[SimpleNamespace(name=k.name, duration=k.time_range.elapsed_us()) for k in kernels])


def test_kernel_times_count_each_kernel_once_and_the_optimizers_by_launcher():
    # Reference: times summed by hand from a CUDA profile made up here. The CPU operators that launched the
    # kernels (and their parents) carry the kernels' time too, as the profiler reports it; counted, they
    # would double the total (as the first GPU run's table did). 'triton_poi_fused_add_0' runs in the
    # forward and inside Optimizer.step: 30 us of it is the optimizer's, 10 us elementwise.
    mm, add_fwd, add_opt, add_opt2, attn = (
        fake_kernel('nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT', 0, 100),
        fake_kernel('triton_poi_fused_add_0', 90, 100),  # overlaps the matmul: busy time counts it once
        fake_kernel('triton_poi_fused_add_0', 200, 215), fake_kernel('triton_poi_fused_add_0', 215, 230),
        fake_kernel('cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7', 120, 160))
    # the profiler hangs each kernel on the operator (or inductor's per-kernel record) that launched it
    step = fake_cpu_call('Optimizer.step#AdamW.step')
    forward = fake_cpu_call('CompiledFunction')
    launchers = [fake_cpu_call('aten::mm', fake_cpu_call('aten::linear', forward), [mm]),
                 fake_cpu_call('triton_poi_fused_add_0', forward, [add_fwd]),
                 fake_cpu_call('aten::add_', step, [add_opt, add_opt2]),
                 fake_cpu_call('aten::_scaled_dot_product_cudnn_attention', forward, [attn])]
    # a GPU-side annotation spans kernels and the gaps between them: neither a kernel nor busy time
    annotation = fake_kernel('Optimizer.step#AdamW.step', 0, 1000)
    annotation.is_user_annotation = True
    events = [step, forward, *launchers, attn, add_opt2, annotation, mm, add_opt, add_fwd]  # any order
    spent, calls, shares, kind, busy_ms = bench.kernel_times(events)
    assert spent == {mm.name: 100, add_fwd.name: 40, attn.name: 40}
    assert calls == {mm.name: 1, add_fwd.name: 3, attn.name: 1}
    assert shares == {'matmul': 100, 'optimizer': 30, 'elementwise and other': 10, 'attention': 40}
    assert kind == {mm.name: 'matmul', add_fwd.name: 'optimizer', attn.name: 'attention'}
    assert busy_ms == pytest.approx((100 + 40 + 30) / 1000)


def test_kernel_times_count_attention_and_casts_by_their_launcher():
    # Reference: the kinds by what launched each kernel, by hand. cuDNN's attention backward launches helper kernels
    # whose names say nothing of attention (their times under "elementwise" in 2026-11-26's H100 profile: 96 calls
    # each, as many as the attention backward's); a copy kernel under aten::_to_copy that stays on the device is a
    # cast (elementwise), the host-to-device copy under it a memory copy, the same copy kernel under clone a memory
    # copy; inductor's fused transpose, named after the attention op it came from, is elementwise.
    copy = ('void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)'
            '::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>')
    dot, dq, cast, clone, h2d, fused = (
        fake_kernel('void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, vo...', 0,
                    10),
        fake_kernel('void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsign...', 10,
                    30),
        fake_kernel(copy, 30, 60), fake_kernel(copy, 60, 65), fake_kernel('Memcpy HtoD (Pinned -> Device)', 65, 75),
        fake_kernel('triton_poi_fused__scaled_dot_product_cudnn_attention_backward_transpose_view_3', 75, 80))
    backward = fake_cpu_call('aten::_scaled_dot_product_cudnn_attention_backward',
                             fake_cpu_call('CompiledFunctionBackward'))
    to_copy = fake_cpu_call('aten::_to_copy', fake_cpu_call('aten::to'))
    launchers = [fake_cpu_call('aten::_cudnn_attention_backward', backward, [dot, dq]),
                 fake_cpu_call('aten::copy_', to_copy, [cast, h2d]),
                 fake_cpu_call('aten::copy_', fake_cpu_call('aten::clone'), [clone]),
                 fake_cpu_call(fused.name, fake_cpu_call('CompiledFunctionBackward'), [fused])]
    spent, calls, shares, kind, _ = bench.kernel_times([*launchers, dot, dq, cast, clone, h2d, fused])
    assert shares == {'attention': 30, 'elementwise and other': 30 + 5, 'memory copy': 5 + 10}
    assert kind == {dot.name: 'attention', dq.name: 'attention', copy: 'elementwise and other',
                    h2d.name: 'memory copy', fused.name: 'elementwise and other'}
    assert bench.kind_of('triton_poi_fused__scaled_dot_product_flash_attention_backward_transpose_view_3') == \
        'elementwise and other'


def test_cpu_profile_counts_attention_and_casts_by_their_callers():
    # Reference: a CPU profile of a cast, a clone, a matmul and attention, forward and backward, fused (the CPU's
    # flash kernel) and by the math path; the operators' own times, summed here from the profiler's events by their
    # callers: whatever runs inside the fused attention op is attention's (its backward's copies, its allocations);
    # the math path's bmm and softmax count by their names, as its backward (BmmBackward0, outside any attention op)
    # does; the copy_ inside _to_copy is a cast (elementwise), the copy_ inside clone a memory copy.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    q, w, x = torch.randn(1, 2, 64, 16, requires_grad=True), torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        x.to(torch.bfloat16), x.clone(), x @ w
    spent, calls, shares, kind, _ = bench.operator_times(prof)

    def callers(e):
        return [] if e is None else [e.name, *callers(e.cpu_parent)]
    expected = collections.defaultdict(collections.Counter)  # name -> its time by kind
    fused = {'aten::_scaled_dot_product_flash_attention_for_cpu', 'aten::_scaled_dot_product_flash_attention_for_cpu_'
             'backward', 'aten::scaled_dot_product_attention'}  # (the last: dispatches to either path)
    for e in prof.events():
        names = callers(e)
        if e.self_cpu_time_total > 0:
            expected[e.name][('attention' if fused & set(names) and 'aten::_scaled_dot_product_attention_math' not in
                              names[1:] else
                              'elementwise and other' if e.name == 'aten::copy_' and 'aten::_to_copy' in names else
                              'memory copy' if e.name == 'aten::copy_' else
                              'matmul' if e.name in ('aten::mm', 'aten::bmm') else
                              bench.kind_of(e.name))] += e.self_cpu_time_total
    assert shares == +sum(expected.values(), collections.Counter()) and shares['attention'] and shares['matmul']
    # a name's kind in the table: the kind of most of its time (aten::copy_: the cast's, the clone's, attention's)
    assert kind == {name: max(times, key=times.get) for name, times in expected.items()}
    assert kind['aten::bmm'] == 'matmul' and kind['aten::mm'] == 'matmul'
    assert expected['aten::zeros']['attention'] > 0  # the fused backward's allocations


def test_kind_of_cpu_operators_and_copy_kernels():
    # Reference: names as torch's profiler reports them: the CPU operators of the matmuls; the foreach operators of
    # gradient clipping and the GradScaler's unscale, which run outside Optimizer.step (the optimizer's by name);
    # CUDA's memset and its plain copy kernel (memory copies), where a cast to bf16 computes (elementwise)
    names = {'aten::mm': 'matmul', 'aten::addmm': 'matmul', 'aten::bmm': 'matmul',
             'aten::_foreach_norm': 'optimizer', 'aten::_foreach_mul_': 'optimizer',
             'aten::_amp_foreach_non_finite_check_and_unscale_': 'optimizer',
             'Memset (Device)': 'memory copy',
             'void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)'
             '::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>': 'memory copy',
             'void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIterat'
             'orBase&)::{lambda(float)#1}>': 'elementwise and other'}
    for name, kind in names.items():
        assert bench.kind_of(name) == kind, name


def test_fp8_cast_kernels_are_not_inductors_gemm_templates():
    # Reference: FP8_CASTS' comment: inductor's kernels less its GEMM templates (triton_tem_) cast to FP8; a
    # template that computes the FP8 matmul (max-autotune's, named for the _scaled_mm it replaces) is a matmul
    assert bench.kind_of('triton_tem_fused__scaled_mm_0') == 'matmul'
    assert bench.kind_of('triton_tem_fused__scaled_mm_abs_max_1') == 'matmul'
    assert bench.kind_of('triton_poi_fused__scaled_mm__to_copy_0') == 'elementwise with FP8 casts'


def test_kernel_times_busy_time_is_the_union_of_the_kernels():
    # Reference: intervals by hand. Kernels at 0-100, 20-60 (inside the first), 80-120 and 150-160 us cover
    # 0-120 and 150-160: 130 us; a kernel launched wholly from Optimizer.step leaves its name's kind no time
    # (no kind of 0 us is listed)
    kernels = [fake_kernel('nvjet_a', 0, 100), fake_kernel('triton_poi_fused_mul_0', 20, 60),
               fake_kernel('nvjet_b', 80, 120), fake_kernel('triton_poi_fused_add_1', 150, 160)]
    step = fake_cpu_call('Optimizer.step#AdamW.step')
    launcher = fake_cpu_call('aten::add_', step, kernels[3:])
    spent, calls, shares, kind, busy_ms = bench.kernel_times([launcher, step, *kernels[::-1]])
    assert busy_ms == pytest.approx(130 / 1000)
    assert shares == {'matmul': 140, 'elementwise and other': 40, 'optimizer': 10}
    assert kind['triton_poi_fused_add_1'] == 'optimizer'
    _, _, shares, _, busy_ms = bench.kernel_times([launcher, step, kernels[3]])
    assert shares == {'optimizer': 10} and busy_ms == pytest.approx(10 / 1000)


def host_call(id, name, parent=None):  # a host call (an op, a record_function): linked to nothing itself
    return SimpleNamespace(id=id, name=name, device_type=torch.autograd.DeviceType.CPU, cpu_parent=parent,
                           linked_correlation_id=0, kernels=[])


def launched(kernel, launcher):  # as the profiler records a launch: the kernel linked, and given to its launcher
    kernel.linked_correlation_id = launcher.id if launcher else 0
    if launcher:
        launcher.kernels.append(SimpleNamespace(name=kernel.name, duration=kernel.time_range.elapsed_us()))
    return kernel


def test_idle_gaps_are_the_times_between_the_kernels_with_what_launched_the_next():
    # Reference: intervals by hand. Kernels cover 0-100 and 80-120 (two streams overlap), then 150-160, then
    # 400-500, inside a GPU-side annotation that spans them all (no kernel). Gaps: 120-150 (30 us, before the
    # optimizer's kernel) and 160-400 (240 us, before the next step's first kernel, launched from a compiled region
    # four calls deep: shown outermost two, the launcher). The runtime's launch call carries the launcher's id
    # number too (another count), linked to a call: never taken for the launcher. A kernel whose launcher is not
    # among the events says so. Before the first kernel and after the last: not a gap between kernels. torch
    # 2.11's events carry no link: the same gaps from the profiler's own records (kernel_links).
    region = host_call(7, 'Torch-Compiled Region: 0/1')
    forward = host_call(8, 'CompiledFunction', region)
    inner = host_call(9, 'aten::_unsafe_view', forward)
    embedding = host_call(10, 'triton_poi_fused_embedding_0', inner)
    step = host_call(11, 'Optimizer.step#AdamW.step')
    adam = host_call(12, 'aten::_fused_adamw_', step)
    runtime = SimpleNamespace(id=10, name='cudaLaunchKernel', device_type=torch.autograd.DeviceType.CPU,
                              cpu_parent=None, linked_correlation_id=12, kernels=[])
    kernels = [launched(fake_kernel('nvjet_a', 0, 100), None), launched(fake_kernel('nvjet_b', 80, 120), None),
               launched(fake_kernel('multi_tensor_apply_kernel<FusedAdamMathFunctor>', 150, 160), adam),
               launched(fake_kernel('triton_poi_fused_embedding_0', 400, 500), embedding)]
    annotation = fake_kernel('bench step', 0, 500)
    annotation.is_user_annotation = True
    events = [kernels[3], runtime, step, annotation, region, *kernels[:3], forward, inner, embedding, adam]
    assert bench.idle_gaps(events) == [
        (240, 'triton_poi_fused_embedding_0',
         'Torch-Compiled Region: 0/1 > CompiledFunction > ... > triton_poi_fused_embedding_0'),
        (30, 'multi_tensor_apply_kernel<FusedAdamMathFunctor>', 'Optimizer.step#AdamW.step > aten::_fused_adamw_')]
    links, linked = {}, bench.idle_gaps(events)
    for i, k in enumerate(kernels):  # (kernel ids: their own count)
        k.id, links[100 + i] = 100 + i, k.__dict__.pop('linked_correlation_id')
    assert bench.idle_gaps(events, links) == linked
    assert bench.idle_gaps(events)[0][2] == bench.idle_gaps(events)[1][2] == 'not known'
    kernels[2].linked_correlation_id = 99
    assert bench.idle_gaps(events, links)[1][2] == 'not known'
    assert bench.idle_gaps(kernels[:2]) == [] and bench.idle_gaps([]) == []
    # profile.md's rows: a wall of 1 ms, 230 us of it busy (0-120, 150-160, 400-500): 770 us idle, 270 of it between
    # kernels, 500 before the first and after the last; the optimizer's kernel still without its launcher
    summary, table = bench.idle_rows(events, 1.0, (120 + 10 + 100) / 1000, links)
    assert summary == ['| device idle (wall time no kernel covers) | 0.8 | 77.0% of wall |',
                       '| of which between kernels, in 2 gaps | 0.3 | 27.0% of wall |',
                       "| of which before the first kernel (the host starting the step: its batch, the forward's "
                       "launch) and after the last | 0.5 | 50.0% of wall |"]
    assert table[3:] == ['| 240.0 | `triton_poi_fused_embedding_0` | `Torch-Compiled Region: 0/1 > CompiledFunction'
                         ' > ... > triton_poi_fused_embedding_0` |',
                         '| 30.0 | `multi_tensor_apply_kernel<FusedAdamMathFunctor>` | `not known` |']
    assert bench.idle_rows(kernels[:2], 0.2, 0.12) == (
        ['| device idle (wall time no kernel covers) | 0.1 | 40.0% of wall |',
         '| of which between kernels, in 0 gaps | 0.0 | 0.0% of wall |',
         "| of which before the first kernel (the host starting the step: its batch, the forward's launch) and "
         "after the last | 0.1 | 40.0% of wall |"], [])


def test_idle_gaps_neither_invent_nor_miss_a_gap_and_show_a_short_launcher_chain_whole():
    # Reference: intervals by hand. Kernels at 0-100, 20-60 (inside the first: it ends no covered span), 100-130
    # (starting as the first ends: no gap) and 140-150: one gap, 130-140 (10 us). Its kernel was launched three
    # calls deep: all three shown, nothing elided. The runtime's launch call that carries the launcher's id number
    # (another count) and launched no kernel is never taken for it, wherever it comes in the events.
    step = host_call(1, 'Optimizer.step#AdamW.step')
    foreach = host_call(2, 'aten::_foreach_add_', step)
    add = host_call(3, 'aten::add_', foreach)
    runtime = SimpleNamespace(id=3, name='cudaLaunchKernel', device_type=torch.autograd.DeviceType.CPU,
                              cpu_parent=None, linked_correlation_id=1, kernels=[])
    kernels = [launched(fake_kernel('nvjet_a', 0, 100), None), launched(fake_kernel('triton_poi_fused_mul_0', 20, 60),
               None), launched(fake_kernel('nvjet_b', 100, 130), None),
               launched(fake_kernel('multi_tensor_apply_kernel', 140, 150), add)]
    events = [step, foreach, add, runtime, *kernels[::-1]]
    assert bench.idle_gaps(events) == [
        (10, 'multi_tensor_apply_kernel', 'Optimizer.step#AdamW.step > aten::_foreach_add_ > aten::add_')]


def test_idle_rows_count_every_gap_and_list_the_ten_longest():
    # Reference: intervals by hand. 13 kernels of 10 us, the i-th gap between them i us long (1 to 12 us: 78 us in
    # all); a wall of 1 ms, 130 us of it busy. The summary counts all 12 gaps and their 78 us; the table lists the
    # ten longest, 12 down to 3 us. A wall shorter than the busy time (the profiler's clock against the host's)
    # leaves no idle time, never a negative one.
    kernels, start = [], 0
    for i in range(13):
        kernels.append(launched(fake_kernel(f'k{i}', start, start + 10), None))
        start += 10 + i + 1
    summary, table = bench.idle_rows(kernels, 1.0, 130 / 1000)
    assert summary[0] == '| device idle (wall time no kernel covers) | 0.9 | 87.0% of wall |'
    assert summary[1] == '| of which between kernels, in 12 gaps | 0.1 | 7.8% of wall |'
    assert summary[2].endswith('| 0.8 | 79.2% of wall |')
    assert table[3:] == [f'| {us:.1f} | `k{us}` | `not known` |' for us in range(12, 2, -1)]
    summary, _ = bench.idle_rows(kernels[:1], 0.005, 10 / 1000)
    assert summary[0] == '| device idle (wall time no kernel covers) | 0.0 | 0.0% of wall |'
    assert summary[2].endswith('| 0.0 | 0.0% of wall |')


def test_kernel_links_are_the_profilers_own_records():
    # Reference: the profiler's records, made up here: a kernel's correlation id and its launcher's; records of
    # the host are no kernels. A CPU profile has none; a profile without its records gives none.
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    record = lambda device, id, link: SimpleNamespace(device_type=lambda: device, correlation_id=lambda: id,  # noqa: E731
                                                      linked_correlation_id=lambda: link)
    results = SimpleNamespace(events=lambda: [record(cuda, 100, 12), record(cpu, 12, 0), record(cpu, 100, 12),
                                              record(cuda, 101, 10)])
    assert bench.kernel_links(SimpleNamespace(profiler=SimpleNamespace(kineto_results=results))) == {100: 12, 101: 10}
    assert bench.kernel_links(SimpleNamespace()) == {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    assert bench.kernel_links(prof) == {}  # read without an error, as on a GPU: no kernel here


def test_profile_mode_profiles_the_top_rung_for_its_steps(tmp_path, monkeypatch):
    # Reference: the docstring's ladder on the CPU with --dtype=bfloat16 and compile off: the top rung is rung 7
    # (bf16, SDPA's choice of kernel, fused QKV, chunked loss; TF32 and fused AdamW are CUDA only). Its steps are
    # counted: the preset's warm-up step and 2 steps, profiled once (not repeated); the wall time is those 2 steps
    # of 128 tokens at the tokens/s reported; MFU against a made-up bf16 peak of 1e9 FLOP/s, by hand.
    monkeypatch.setattr(model_module, 'peak_flops', lambda device, dtype='bfloat16': 1e9)
    settings, steps, real_run_rung, real_step = [], [], bench.run_rung, train.train_step
    monkeypatch.setattr(bench, 'run_rung', lambda s, env, **kw: settings.append(dict(s)) or real_run_rung(s, env, **kw))
    monkeypatch.setattr(train, 'train_step', lambda *args: steps.append(1) or real_step(*args))
    assert bench.main([*TINY, f'--out={tmp_path}', '--mode=profile', '--dtype=bfloat16']) == 0
    assert settings == [{**bench.BASE, 'dtype': 'bfloat16', 'attention': 'auto', 'fused_qkv': True,
                         'chunked_loss': True}]
    assert len(steps) == 1 + 2
    text = (tmp_path / 'profile.md').read_text()
    assert '- rung: bf16 autocast; fused_qkv, chunked_loss\n' in text
    calls = dict(re.findall(r'^\| `([^`]+)` \| [a-z ]+ \| [\d,.]+ \| [\d.]+% \| (\d+) \|$', text, re.M))
    assert calls['Optimizer.step#AdamW.step'] == '2'  # one optimizer step per profiled step
    wall, tokens_per_sec, mfu = re.search(r'^- profiled: 2 step\(s\) after 1 warm-up step\(s\): ([\d,.]+) ms wall, '
                                          r'([\d,]+) tokens/s, MFU ([\d,.]+)% of the bf16 peak$', text, re.M).groups()
    tokens_per_sec = float(tokens_per_sec.replace(',', ''))
    assert float(wall.replace(',', '')) == pytest.approx(2 * 128 / tokens_per_sec * 1000, rel=0.02, abs=0.06)
    flops = GPT(bench.setup(TINY).config).flops_per_token()
    assert float(mfu.replace(',', '')) / 100 == pytest.approx(flops * tokens_per_sec / 1e9, rel=0.01)


def test_rung_settings_are_the_ladders(result):
    # Reference: the settings each row of the ladder's run recorded (TINY on the CPU: TF32, bf16, fused AdamW,
    # compile and FP8 skipped), the rungs the profile mode reads by number, and the reasons of the skipped ones
    report, _ = result
    env = bench.setup(TINY)
    for row in report['rungs']:
        name, settings, reason = bench.rung_settings(row['rung'], env)
        assert (name, settings) == (row['name'], row['settings']), row['rung']
        assert reason == (row['reason'] if row['status'] == 'skipped' else None), row['rung']
    env.mixed = 'float16'  # a GPU without bf16 (train.pick_dtype): rung 3 is fp16 autocast, named so as in the ladder
    assert bench.rung_settings(3, env)[:2] == ('+ fp16 autocast', {**bench.BASE, 'dtype': 'float16'})


def test_the_mlp_width_is_a_shape_setting(tmp_path):
    # Reference: GPTConfig's own sizes: the tiny preset's 8/3 x 32 rounded up to 64s is 128; set, it is the
    # model's (the MLP's three matrices: 3 x 32 x 96 parameters per block), and the report names it
    assert bench.setup(TINY).config.mlp_hidden == 128
    env = bench.setup([*TINY, '--mlp_hidden=96'])
    assert env.config.mlp_hidden == 96 and env.meta['model']['mlp_hidden'] == 96
    assert env.meta['params'] == bench.setup(TINY).meta['params'] - 2 * 3 * 32 * (128 - 96)
    report = run_ladder(str(tmp_path), '--mlp_hidden=96', '--rungs=1')
    assert report['model']['mlp_hidden'] == 96
    assert 'mlp_hidden=96' in (tmp_path / 'bench.md').read_text()
    with pytest.raises(bench.ConfigError, match=re.escape('mlp_hidden=-1 must be at least 0')):
        bench.setup([*TINY, '--mlp_hidden=-1'])


def test_profile_mode_profiles_the_rung_it_is_given(tmp_path, monkeypatch):
    # Reference: rung 9 is full checkpointing on top of the top rung that runs here (rung 7 on the CPU with
    # bf16 and compile off: the settings of test_profile_mode_profiles_the_top_rung_for_its_steps); a rung that
    # cannot run here stops with its reason; several rungs are refused, before any measurement.
    settings, real_run_rung = [], bench.run_rung
    monkeypatch.setattr(bench, 'run_rung', lambda s, env, **kw: settings.append(dict(s)) or real_run_rung(s, env, **kw))
    assert bench.main([*TINY, f'--out={tmp_path}', '--mode=profile', '--dtype=bfloat16', '--rungs=9']) == 0
    assert settings == [{**bench.BASE, 'dtype': 'bfloat16', 'attention': 'auto', 'fused_qkv': True,
                         'chunked_loss': True, 'checkpointing': 'full'}]
    text = (tmp_path / 'profile.md').read_text()
    assert text.startswith('# bench.py: profile of rung 9 (+ act. ckpt full)\n')
    assert '- rung: bf16 autocast; fused_qkv, chunked_loss\n' in text  # (checkpointing: not a True setting)
    with pytest.raises(bench.BenchError, match=re.escape('rung 12 (+ FP8 linears) cannot run here: needs CUDA')):
        bench.main([*TINY, f'--out={tmp_path}', '--mode=profile', '--rungs=12'])
    with pytest.raises(bench.BenchError, match=re.escape('rung 8 (+ torch.compile) cannot run here: off (--compile')):
        bench.main([*TINY, f'--out={tmp_path}', '--mode=profile', '--rungs=8'])
    with pytest.raises(bench.ConfigError, match=re.escape('rungs=[8, 12]: --mode=profile profiles one rung')):
        bench.main([*TINY, f'--out={tmp_path}', '--mode=profile', '--rungs=8,12'])
    assert len(settings) == 1


class KVSwapped(bench.SeparateQKVAttention):
    def __init__(self, fused):
        super().__init__(fused)
        self.k, self.v = self.v, self.k


def non_causal(*args, **kwargs):
    return F.scaled_dot_product_attention(*args, **{**kwargs, 'is_causal': False})


@pytest.mark.parametrize('bug', ['k and v swapped', 'non-causal attention', 'no rotary embedding'])
def test_the_loss_check_catches_a_rung_that_breaks_the_math(bug, tmp_path, monkeypatch):
    # the same bug in the separate-QKV attention of rungs 1-4: the fused rungs after them must disagree
    if bug == 'k and v swapped':
        monkeypatch.setattr(bench, 'SeparateQKVAttention', KVSwapped)
    elif bug == 'non-causal attention':
        monkeypatch.setattr(bench, 'attend', non_causal)
    else:  # the subtlest: on this tiny model it moves the loss by ~3e-5, under a 1e-4 tolerance
        monkeypatch.setattr(bench, 'apply_rotary', lambda x, cos, sin: x)
    loss = {r['name']: r['loss'] for r in run_ladder(str(tmp_path))['rungs']}
    assert abs(loss['fp32 eager'] - loss['+ SDPA flash']) < TOL
    assert abs(loss['fp32 eager'] - loss['+ fused QKV']) > TOL


def test_a_failing_rung_is_reported_and_the_ladder_goes_on(tmp_path, monkeypatch, capsys):
    run_rung = bench.run_rung

    def flaky(s, env):
        if s['checkpointing'] == 'full':
            raise RuntimeError('CUDA out of memory (simulated)')
        return run_rung(s, env)
    monkeypatch.setattr(bench, 'run_rung', flaky)
    # the ladder goes on and writes everything, then exits 1 naming the rung (a script sees that one failed)
    assert bench.main([*TINY, f'--out={tmp_path}']) == 1
    assert capsys.readouterr().err == ("bench.py: 1 rung(s) failed: 9 + act. ckpt full: RuntimeError: CUDA out of "
                                       "memory (simulated)\n")
    report = json.load(open(tmp_path / 'bench.json'))
    assert report['complete'] and (tmp_path / 'bench.png').exists()
    rows = {r['name']: r for r in report['rungs']}
    assert rows['+ act. ckpt full']['status'] == 'failed'
    assert rows['+ act. ckpt full']['reason'] == 'RuntimeError: CUDA out of memory (simulated)'
    assert rows['+ act. ckpt selective']['status'] == 'ok'
    assert rows['+ act. ckpt selective']['builds_on'] == '+ chunked loss'  # the last ladder rung that ran


@pytest.mark.parametrize('mode', ['ladder', 'profile'])
def test_an_earlier_runs_results_are_moved_aside_not_overwritten(tmp_path, capsys, mode):
    # Reference: the first run's files, byte for byte, in the one previous-* folder the second run names; the
    # second run's own files in out/ (a chart of the first beside the second's table misled); a mode moves only
    # the files it writes (a profile leaves a ladder's results where they are)
    flags = [*TINY, f'--out={tmp_path}', '--rungs=1', f'--mode={mode}']
    names = bench.OUTPUTS[mode]
    assert bench.main(flags) == 0
    first = {name: (tmp_path / name).read_bytes() for name in names}
    (tmp_path / 'other.md').write_text('not a result of this mode')
    other = 'profile.md' if mode == 'ladder' else 'bench.md'
    (tmp_path / other).write_text('the other mode')
    capsys.readouterr()
    assert bench.main(flags) == 0
    [keep] = tmp_path.glob('previous-*')
    assert {p.name: p.read_bytes() for p in keep.iterdir()} == first
    assert all((tmp_path / name).exists() for name in names)
    assert (tmp_path / other).read_text() == 'the other mode' and (tmp_path / 'other.md').exists()
    assert f"{tmp_path} held an earlier run's {', '.join(names)}: moved to {keep}" in capsys.readouterr().out
    # a run that stops before it writes (a rung that cannot run here) moves nothing
    now = {name: (tmp_path / name).read_bytes() for name in names}
    if mode == 'profile':
        with pytest.raises(bench.BenchError, match='rung 12 .* cannot run here'):
            bench.main([*flags, '--rungs=12'])
        assert {name: (tmp_path / name).read_bytes() for name in names} == now
        assert len(list(tmp_path.glob('previous-*'))) == 1


def test_variants_that_do_nothing_off_cuda_are_said_so(tmp_path, capsys):
    # Reference: torch.compile's modes (only reduce-overhead and max-autotune record CUDA graphs, only on CUDA;
    # max-autotune also tunes the CPU's GEMMs) and inductor's coordinate-descent tuning (Triton kernels only): on
    # the CPU the first and the last do nothing, which the run says at its start and the report in its variants
    # line (it read 'compile mode reduce-overhead' as though it had taken effect); on CUDA no such word
    assert bench.main([*TINY, f'--out={tmp_path}', '--rungs=1', '--compile_mode=reduce-overhead',
                       '--coordinate_descent_tuning=True']) == 0
    out = capsys.readouterr().out
    assert ("warning: compile_mode='reduce-overhead' has no effect on cpu: CUDA graphs only, so it compiles as "
            "'default' does") in out
    assert "warning: coordinate_descent_tuning=True has no effect on cpu: it tunes Triton kernels" in out
    meta = json.load(open(tmp_path / 'bench.json'))
    assert ("compile mode reduce-overhead (no effect on cpu: CUDA graphs only, so it compiles as 'default' does) + "
            "coordinate-descent tuning (no effect on cpu: it tunes Triton kernels, which only CUDA runs)"
            in (tmp_path / 'bench.md').read_text())
    for mode in ('reduce-overhead', 'max-autotune'):
        variants = dict(meta['variants'], compile_mode=mode)
        line = bench.variants_line(dict(meta, variants=variants, device_type='cuda'), [])
        assert f'compile mode {mode} + coordinate-descent tuning (read by no rung' in line and 'no effect' not in line
        assert bench.no_effect(variants, 'cuda') == {}
    assert list(bench.no_effect(dict(meta['variants'], compile_mode='max-autotune'), 'cpu')) == [
        'coordinate_descent_tuning']


def test_an_interrupted_ladder_exits_130_keeping_the_rungs_that_finished(tmp_path):
    # Reference: what the first rung wrote before Ctrl-C came in the second; the interrupt's one line, no traceback
    # (it printed 30 lines of one), and the exit code of a process SIGINT stopped (128 + 2)
    script = """import os, runpy, sys, train
out, real = sys.argv[1], train.train_step
def step(*args):  # Ctrl-C once a rung's results are written
    if os.path.exists(os.path.join(out, 'bench.json')):
        raise KeyboardInterrupt
    return real(*args)
train.train_step = step
sys.argv = ['bench.py', *sys.argv[2:], f'--out={out}']
runpy.run_path('bench.py', run_name='__main__')
"""
    proc = subprocess.run([sys.executable, '-c', script, str(tmp_path), *TINY, '--rungs=1,4', '--threads=1'],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(bench.__file__)))
    assert proc.returncode == 130 and 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("bench.py: interrupted; what was written is kept (bench.json and bench.md: the "
                                   "rungs that finished; fit.json: the variants that did)")
    report = json.load(open(tmp_path / 'bench.json'))
    assert report['complete'] is False and [r['status'] for r in report['rungs']] == ['ok']
    assert '- incomplete: the rungs after rung 1 have not run (yet)' in (tmp_path / 'bench.md').read_text()


@pytest.mark.parametrize('n_kv_head, qk_norm', [(4, False), (2, True), (1, False)])
def test_separate_qkv_attention_matches_fused(n_kv_head, qk_norm):
    config = GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=32,
                       qk_norm=qk_norm)
    torch.manual_seed(0)
    fused = CausalSelfAttention(config)
    if qk_norm:  # random gains, so a norm that the variant dropped shows
        for norm in (fused.q_norm, fused.k_norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    separate = bench.SeparateQKVAttention(fused)
    assert torch.equal(torch.cat([separate.q.weight, separate.k.weight, separate.v.weight]), fused.qkv.weight)
    assert separate.q.weight.data_ptr() != fused.qkv.weight.data_ptr()  # copies: the rungs train their own
    x = torch.randn(2, 16, 32)
    cos, sin = rope_cache(16, config.head_dim, config.rope_base)
    y_fused, y_separate = fused(x, cos, sin), separate(x, cos, sin)
    torch.testing.assert_close(y_separate, y_fused, atol=1e-6, rtol=1e-5)
    (y_fused ** 2).sum().backward()
    (y_separate ** 2).sum().backward()
    grads = torch.cat([separate.q.weight.grad, separate.k.weight.grad, separate.v.weight.grad])
    torch.testing.assert_close(grads, fused.qkv.weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize('chunk', [16, 0, -1])
def test_variants_reach_the_rungs_they_name(tmp_path, monkeypatch, chunk):
    # Reference: what each rung asks of SDPA, torch.compile and the loss, recorded as it runs: --sdpa_backend on
    # the rungs from 4 on (the math kernel before them), --compile_mode and --coordinate_descent_tuning on the compile
    # rung (inductor's setting, as the loss runs), --loss_chunk_tokens on the chunked-loss rungs only (0: the plain
    # loss there too; -1: model.py's size, 2^21 at 128 tokens).
    seen, real_kernel, real_apply = [], bench.sdpa_kernel, model_module.ChunkedCrossEntropy.apply
    real_run_rung = bench.run_rung

    def run_rung(s, env, **kwargs):
        seen.append(('rung', s['chunked_loss'], s['compile']))
        return real_run_rung(s, env, **kwargs)

    def apply(*args):
        seen.append(('chunk', args[4], bench.inductor_config.coordinate_descent_tuning))
        return real_apply(*args)
    monkeypatch.setattr(bench, 'run_rung', run_rung)
    monkeypatch.setattr(bench, 'sdpa_kernel', lambda kernels: seen.append(('sdpa', *kernels)) or real_kernel(kernels))
    monkeypatch.setattr(torch, 'compile', lambda m, mode=None: seen.append(('compile', mode)) or m)
    monkeypatch.setattr(model_module.ChunkedCrossEntropy, 'apply', apply)
    ropes, real_rope = [], bench.rope_halves
    monkeypatch.setattr(bench, 'rope_halves', lambda *args: ropes.append(1) or real_rope(*args))
    flags = ['--rungs=1,4,7,8', '--compile=True', '--sdpa_backend=flash', '--compile_mode=max-autotune',
             '--coordinate_descent_tuning=True', f'--loss_chunk_tokens={chunk}', '--rope=halves']
    report = run_ladder(tmp_path, *flags)
    assert model_module.apply_rotary is bench.apply_rotary and bench.apply_rotary.__name__ == 'apply_rotary'  # again
    # rung 1 (separate q, k, v) and rungs 4-8 alike: 2 layers x (q, k) x (1 warm-up + 3 x 2 timed steps + 1 counted)
    assert len(ropes) == 4 * 2 * 2 * 8
    assert [r['status'] for r in report['rungs'] if r['rung'] in (1, 4, 7, 8)] == ['ok'] * 4
    math, flash = ('sdpa', torch.nn.attention.SDPBackend.MATH), ('sdpa', torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    size = 2 ** 21 if chunk < 0 else chunk
    eager, tuned = ([('chunk', size, on)] if size else [] for on in (False, True))
    steps = [e for i, e in enumerate(seen) if i == 0 or e != seen[i - 1]]  # one entry for a run of equal ones
    assert steps == [('rung', False, False), math, ('rung', False, False), flash, ('rung', True, False), flash, *eager,
                     ('rung', True, True), ('compile', 'max-autotune'), flash, *tuned]
    assert not bench.inductor_config.coordinate_descent_tuning  # as it was
    assert report['variants'] == dict(compile_mode='max-autotune', coordinate_descent_tuning=True, sdpa_backend='flash',
                                      rope='halves', loss_chunk_tokens=size, residual='float32', stage_data=False)
    md = open(tmp_path / 'bench.md').read()
    # the chunk as it splits a 4 x 32 micro-batch; the residual variant is read by no rung: every one is float32
    chunk_words = (f'{size:,} tokens' + (' (one chunk: a micro-batch is 128 tokens)' if size >= 128 else '')
                   if size else '0 (the plain loss)')
    assert (f'- variants: compile mode max-autotune + coordinate-descent tuning (no effect on cpu: it tunes Triton '
            f'kernels, which only CUDA runs), SDPA backend flash, RoPE halves, '
            f'loss chunk {chunk_words}, '
            'residual stream float32 (read by no rung that ran), data loaded as train.py does') in md


def test_a_chosen_sdpa_backend_is_compiled_not_taken_from_the_cache(tmp_path, monkeypatch):
    # Reference: the attention ops that run (the profiler records each one the compiled code calls). SDPA's backend is
    # not in torch.compile's cache keys: a graph compiled earlier under another backend came back from the cache, its
    # kernels with it (the first run below leaves the CPU's flash kernel there). 'flash' stands for the math kernel
    # here, which the CPU tells apart from its flash one: compiled, it is matmuls and a softmax. The graph is the one
    # CUDA compiles with the plain loss: torch's rms_norm, no autograd.Function, which the cache would refuse
    # (model.py's CPU RMSNorm and the chunked loss are such Functions).
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path / 'cache'))
    monkeypatch.setattr(model_module.RMSNorm, 'forward', model_module.RMSNorm.fused_forward)
    flags = ['--rungs=8', '--compile=True', '--steps=1', '--repeats=1', '--warmup=1', '--loss_chunk_tokens=0']
    flash_op = 'aten::_scaled_dot_product_flash_attention_for_cpu'

    def attention_ops(out, *more):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            report = run_ladder(tmp_path / out, *flags, *more)
        assert [r['status'] for r in report['rungs'] if r['rung'] == 8] == ['ok']
        return {e.key for e in prof.key_averages() if 'scaled_dot_product' in e.key}
    assert flash_op in attention_ops('auto')  # compiled, and cached, with the flash kernel
    monkeypatch.setitem(bench.SDPA_BACKENDS, 'flash', torch.nn.attention.SDPBackend.MATH)
    assert flash_op not in attention_ops('forced', '--sdpa_backend=flash')


def test_residual_variant_reaches_the_autocast_rungs(tmp_path, monkeypatch):
    # Reference: the dtype each block receives, recorded per rung as it runs: with --residual=autocast, bf16 on the
    # bf16 autocast rung (3), float32 on the float32 rung (1, no autocast); float32 on both without it.
    import model as model_module
    seen, real_run_rung, real_block = [], bench.run_rung, model_module.Block.forward
    monkeypatch.setattr(bench, 'run_rung', lambda s, env, **kw: seen.append(('rung', s['dtype'])) or
                        real_run_rung(s, env, **kw))
    monkeypatch.setattr(model_module.Block, 'forward', lambda self, x, *a, **k: seen.append(x.dtype) or
                        real_block(self, x, *a, **k))
    for residual, want, line in [('float32', torch.float32, 'residual stream float32,'),
                                 ('autocast', torch.bfloat16, "residual stream in autocast's dtype,")]:
        seen.clear()
        report = run_ladder(tmp_path / residual, '--rungs=1,3', '--dtype=bfloat16', f'--residual={residual}')
        assert report['variants']['residual'] == residual
        assert line in open(tmp_path / residual / 'bench.md').read()
        rung3 = seen.index(('rung', 'bfloat16'))
        assert seen[0] == ('rung', 'float32') and set(seen[1:rung3]) == {torch.float32}
        assert set(seen[rung3 + 1:]) == {want}


@pytest.mark.parametrize('stage', [False, True])
def test_staged_data_loads_one_step_of_batches_and_serves_it_in_turn(monkeypatch, stage):
    # Reference: the token-file reads counted (train.Batches._prefetch), the batches each forward gets, and the
    # first step's batches as a fresh train.Batches draws them.
    # Staged: one read when Batches starts and one per micro-batch of one step, then each step gets those same
    # micro-batches in the same order. Loaded: a read for every micro-batch, every one of them new.
    env = bench.setup([*TINY, '--gradient_accumulation_steps=3', '--warmup=1', '--steps=2', '--repeats=2',
                       f'--stage_data={stage}'])
    assert env.meta['variants']['stage_data'] is stage
    fresh = train.Batches(env.tokens, env.batch_size, env.block_size, env.device, env.seed,
                          env.gradient_accumulation_steps)
    first_step = [fresh.next()[0] for _ in range(3)]  # what train.py's first step would train on
    reads, inputs, real_prefetch, real_forward = [], [], train.Batches._prefetch, GPT.forward
    monkeypatch.setattr(train.Batches, '_prefetch', lambda self: reads.append(1) or real_prefetch(self))
    monkeypatch.setattr(GPT, 'forward', lambda self, idx, *a, **k: inputs.append(idx.clone()) or
                        real_forward(self, idx, *a, **k))
    bench.run_rung(bench.BASE, env)
    micro = 3 * (1 + 2 * 2) + 1  # (warmup + repeats x steps) x 3 micro-batches, and the one that counts activations
    assert len(inputs) == micro
    distinct = len({tuple(x.flatten().tolist()) for x in inputs})
    # the first step gets the first batches of a fresh train.Batches with the run's seed, in order, staged or not
    for i, want in enumerate(first_step):
        assert torch.equal(inputs[i], want), i
    if stage:
        assert len(reads) == 1 + 3 and distinct == 3
        assert all(torch.equal(x, inputs[i % 3]) for i, x in enumerate(inputs))
    else:
        assert len(reads) == 1 + micro and distinct == micro


def test_rope_halves_rotates_as_model_py_does():
    # Reference: model.apply_rotary, float64, from the (T, D/2) angles' cos and sin and from rotary_tables' tables
    from model import apply_rotary, rotary_tables
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_cache(16, 8, 10000.0))
    want = apply_rotary(x, cos, sin)
    torch.testing.assert_close(bench.rope_halves(x, cos, sin), want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(bench.rope_halves(x, *rotary_tables(cos, sin)), want, rtol=1e-14, atol=1e-14)


def test_largest_batch_doubles_then_bisects():
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= 37
    assert bench.largest_batch(fits, 1000) == 37 and len(tried) <= 14
    assert bench.largest_batch(lambda b: True, 48) == 48
    assert bench.largest_batch(lambda b: False, 48) == 0


@pytest.mark.parametrize('n, micro, expected', [(512, 24, (16, 32)), (512, 512, (512, 1)), (512, 1000, (512, 1)),
                                                (12, 5, (4, 3)), (7, 3, (1, 7)), (5, 1, (1, 5)),
                                                (512, 0, (None, None))])
def test_split_step(n, micro, expected):
    assert bench.split_step(n, micro) == expected


def test_profile_md_on_cuda_lists_the_longest_idle_gaps(tmp_path, monkeypatch):
    # Reference: a made-up CUDA profile: kernels at 0-100 and 150-160 us (the second launched from AdamW's step),
    # so one gap of 50 us before the optimizer's kernel (0.5 ms of wall: 10%); profile.md holds the idle summary
    # and the table of the longest gaps (idle_rows, here by hand), not only the kinds.
    step = host_call(1, 'Optimizer.step#AdamW.step')
    launcher = host_call(2, 'aten::_fused_adamw_', step)
    mm = launched(fake_kernel('nvjet_a', 0, 100), None)
    adam = launched(fake_kernel('multi_tensor_apply_kernel', 150, 160), launcher)
    events = [step, launcher, mm, adam]
    prof = type('Prof', (), {'events': lambda self: events})()
    monkeypatch.setattr(bench, 'why_skip', lambda change, env: None)
    monkeypatch.setattr(bench, 'rung_settings', lambda number, env: ('+ made up', dict(bench.BASE), None))
    monkeypatch.setattr(bench, 'run_rung', lambda s, env, timed=None: dict(
        timed=prof, ms_per_iter=0.5 / env.steps, tokens_per_sec=1000.0, mfu=None, mfu_peak=None))
    env = bench.setup([*TINY, f'--out={tmp_path}', '--mode=profile'])
    env.device_type = 'cuda'
    assert bench.profile(env) == 0
    text = (tmp_path / 'profile.md').read_text()
    assert '| of which between kernels, in 1 gaps | 0.1 | 10.0% of wall |\n' in text
    assert ("| longest device idle gaps (us) | the kernel after it | launched from (the host's calls) |\n"
            "|---:|---|---|\n"
            "| 50.0 | `multi_tensor_apply_kernel` | `Optimizer.step#AdamW.step > aten::_fused_adamw_` |\n") in text


def fit_env(tmp_path, tokens_per_step, monkeypatch, start='fork'):
    """A tiny ladder's namespace from bench.setup, for calling fit() on the CPU (setup refuses --mode=fit without
    CUDA), with tokens_per_step set afterwards (a ladder refuses the flag). fit's children are forked: they run
    with the test's stand-ins, which a spawned child would not have (what they do in a child stays there)."""
    env = bench.setup([*TINY, f'--out={tmp_path}'])
    env.tokens_per_step = tokens_per_step
    monkeypatch.setattr(bench, 'FIT_START', start)
    return env


def child_record(path, item):
    """Appends item to path as a line of JSON: what a stand-in saw in fit's child process, for the test to read."""
    with open(path, 'a') as f:
        f.write(json.dumps(item) + '\n')


def child_records(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_fit_finds_the_largest_batch_for_each_variant(tmp_path, monkeypatch, capsys):
    # no GPU here: a stand-in for run_rung that runs out of memory past a limit that depends on the settings
    limits = {('none', 'adamw'): 20, ('full', 'adamw'): 50, ('none', 'adamw8bit'): 61}

    def fake_run_rung(s, env):
        if (s['checkpointing'], s['optimizer']) not in limits:
            raise bench.BenchError('optimizer=adamw8bit needs bitsandbytes')
        if env.batch_size > limits[s['checkpointing'], s['optimizer']]:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory')
    env = fit_env(tmp_path, 2048, monkeypatch)  # 64 sequences of 32 tokens
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    assert bench.fit(env) == 0
    variants = json.load(open(tmp_path / 'fit.json'))['variants']
    assert [v['micro_batch'] for v in variants] == [20, 50, 61, None]
    assert [(v['batch_size'], v['gradient_accumulation_steps']) for v in variants] == [(16, 4), (32, 2), (32, 2),
                                                                                         (None, None)]
    assert variants[3]['note'] == 'skipped: optimizer=adamw8bit needs bitsandbytes'
    # each size that ran out of memory, with the error, for the record: doubling to 32, then bisecting 16..32
    assert variants[0]['failures'] == [{'batch_size': b, 'error': 'OutOfMemoryError: CUDA out of memory'}
                                       for b in (32, 24, 22, 21)]
    printed = capsys.readouterr().out
    assert '--batch_size=32 --gradient_accumulation_steps=2' in printed
    # a skipped variant says so, without a micro-batch (it printed 'largest micro-batch None')
    assert '  act. ckpt full + 8-bit AdamW skipped: optimizer=adamw8bit needs bitsandbytes\n' in printed, printed
    assert json.load(open(tmp_path / 'fit.json'))['bench_variants']['sdpa_backend'] == 'auto'
    assert json.load(open(tmp_path / 'fit.json'))['complete'] is True


def test_fit_cut_short_keeps_the_variants_it_finished(tmp_path, monkeypatch):
    # Reference: the first variant's search, done before the cut. A fit run stopped in its second variant (a
    # time limit's signal, Ctrl-C) left no fit.json at all: it was written once, at the end.
    def fake_run_rung(s, env):
        if s['checkpointing'] == 'full':
            raise KeyboardInterrupt
        if env.batch_size > 20:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory')
    env = fit_env(tmp_path, 2048, monkeypatch)
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    with pytest.raises(KeyboardInterrupt):
        bench.fit(env)
    record = json.load(open(tmp_path / 'fit.json'))
    assert record['complete'] is False and [v['variant'] for v in record['variants']] == ['as is']
    assert (record['variants'][0]['micro_batch'], record['variants'][0]['batch_size']) == (20, 16)


@pytest.mark.parametrize('mode, flag, key', [
    ('fit', '--warmup=2', 'warmup'), ('fit', '--steps=2', 'steps'), ('fit', '--repeats=5', 'repeats'),
    ('fit', '--rungs=8', 'rungs'), ('fit', '--batch_size=8', 'batch_size'),
    ('fit', '--gradient_accumulation_steps=4', 'gradient_accumulation_steps'),
    ('profile', '--tokens_per_step=4096', 'tokens_per_step'), ('profile', '--lr_warmup=3', 'lr_warmup')])
def test_each_setting_a_mode_sets_itself_is_refused_alone(mode, flag, key):
    # Reference: the docstring and fit_steps: fit searches the micro-batch itself, eager, on rung 7 (no rungs), each
    # try one warm-up and one timed step of 2 micro-steps, once; profile times one rung's steps of batch_size x
    # block_size x gradient_accumulation_steps, never tokens_per_step (fit's), and reports no loss (lr_warmup,
    # which only the losses would show). Each such setting alone, without another beside it, is an error that
    # names it, not a silent no-op.
    with pytest.raises(bench.ConfigError, match=re.escape(f'--mode={mode} does not read {key}: it ')):
        bench.read_args([f'--mode={mode}', flag])


@pytest.mark.parametrize('argv', [
    ['--mode=fit', '--tokens_per_step=65536'],
    ['--mode=fit', '--sdpa_backend=flash', '--residual=autocast', '--stage_data=True', '--loss_chunk_tokens=0',
     '--rope=halves', '--dtype=float16', '--fp8_recipe=rowwise'],
    ['--mode=profile', '--rungs=8', '--compile_mode=max-autotune', '--coordinate_descent_tuning=True', '--warmup=2',
     '--steps=5', '--batch_size=8', '--gradient_accumulation_steps=2', '--stage_data=True'],
    ['--rungs=8', '--compile_mode=reduce-overhead', '--coordinate_descent_tuning=True', '--lr_warmup=30',
     '--steps=150', '--repeats=1', '--warmup=2']])
def test_the_settings_a_mode_reads_are_not_refused(argv):
    # Reference: the docstring's examples and DEFAULTS' comments: fit reads tokens_per_step (the step it splits) and
    # the variants that change what a try runs, eager; profile runs one rung's steps as the ladder runs them,
    # compiled or not, with its warm-up, steps and batch (not lr_warmup: it reports no loss); the ladder reads all
    # but tokens_per_step
    a = bench.read_args(argv)
    for flag in argv:
        key, value = flag[2:].split('=')
        assert str(a[key]).replace(' ', '') in (value, f'[{value}]'), key


@pytest.mark.parametrize('flags, message', [
    (['--n_head=3'], 'GPTConfig: n_embd=32 is not divisible by n_head=3'),
    (['--n_layer=-1'], 'GPTConfig: n_layer=-1 must be positive'),
    (['--threads=-1'], 'threads=-1: must be at least 0'),
    (['--seed=-1'], 'seed=-1: must be between 0 and 2**63 - 1'),  # (it was numpy's traceback, where data is missing)
    (['--seed=9223372036854775808'], 'seed=9223372036854775808: must be between 0 and 2**63 - 1'),
    (['--device=foo'], "device='foo': expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    (['--device=cpu:3'], "device='cpu:3': expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),  # (it ran as cpu)
    (['--device=cuda:7'], "device='cuda:7', but this machine has"),
    # the other counts' message: without it every rung failed in train.Batches, after the whole setup
    (['--gradient_accumulation_steps=-1'], 'gradient_accumulation_steps=-1 must be at least 1'),
    # the ladder is numbered from 1: rung 0 ran none of it, and in profile mode (LADDER + MEMORY)[-1], the FP8 rung
    # on the fp32 baseline, a rung the ladder never builds
    (['--rungs=0'], "rungs=[0]: the ladder's rungs are numbered 1 to 12"),
    (['--mode=profile', '--rungs=0'], "rungs=[0]: the ladder's rungs are numbered 1 to 12"),
    # rung 3's dtype is 'auto', 'bfloat16' or 'float16' (DEFAULTS' comment); train.py's other choices made rung 3 a
    # float32 rung, skipped as 'as configured': a ladder without its mixed-precision rung
    (['--dtype=float32'], "dtype='float32': expected one of 'auto', 'bfloat16', 'float16'"),
    (['--dtype=bfloat16_if_native'], "dtype='bfloat16_if_native': expected one of 'auto', 'bfloat16', 'float16'"),
    (['--sdpa_backend=cudnn'], "sdpa_backend='cudnn' is a CUDA kernel; on cpu: 'auto' or 'flash'"),
    (['--sdpa_backend=efficient'], "sdpa_backend='efficient' is a CUDA kernel"),
    (['--mode=fit', '--compile_mode=max-autotune'], 'compile_mode does not apply'),
    (['--mode=fit', '--coordinate_descent_tuning=True'], 'coordinate_descent_tuning does not apply'),
    (['--mode=profile', '--rungs=1', '--repeats=5'], '--mode=profile does not read repeats: it profiles one rung '
                                                     '(the top one, or --rungs=N), once'),
    (['--mode=fit', '--steps=3', '--batch_size=8'], '--mode=fit does not read batch_size, steps, compile: it '
                                                    'searches the micro-batch'),  # (compile: TINY's)
    (['--mode=fit', '--compile=False'], '--mode=fit does not read compile: it searches the micro-batch, eager'),
    (['--tokens_per_step=4096'], '--mode=ladder does not read tokens_per_step: it times steps of batch_size x'),
    (['--loss_chunk_tokens=-2'], "loss_chunk_tokens=-2: -1 (model.py's), 0 (the plain loss) or a size"),
    (['--rope=rotate'], "rope='rotate': expected one of 'flip', 'halves'"),
    # 0 is the preset's value: the message says so, not only 'at least 1'
    (['--warmup=-1'], "warmup=-1 must be at least 1 (0: the preset's, 1)"),
    (['--repeats=0'], 'repeats=0 must be at least 1'),  # (no preset sets repeats: 0 is no default of it)
    (['--out='], "out='': must be a directory, not empty")])
def test_a_bad_setting_is_a_config_error_naming_it(flags, message):
    # Reference: the messages of GPTConfig and of train.check_device, which train.py gives for the same values
    # (a ConfigError is printed as one line, where these were tracebacks of ValueError or RuntimeError), and bench.py's
    # own for a setting or variant that cannot apply
    with pytest.raises(bench.ConfigError, match=re.escape(message)):
        bench.setup([*TINY, *flags])


def test_the_report_records_the_run_conditions(result):
    # Reference: the run's flags (the tiny preset on the CPU), the torch that ran it with its threads (one, as this
    # file sets them), and the model built from the recorded shape, its parameters counted once each (the tied head
    # is the embedding)
    report, _ = result
    assert (report['preset'], report['device_type']) == ('tiny', 'cpu')
    assert report['torch'] == torch.__version__ and re.fullmatch(r'cpu: .+, 1 threads', report['device'])
    assert report['memory'] == 'n/a on cpu' and report['runtime_s'] >= 0
    model = GPT(GPTConfig(**report['model']))
    assert report['params'] == sum(p.numel() for p in model.parameters())
    assert (report['batch_size'], report['block_size'], report['gradient_accumulation_steps']) == (4, 32, 1)


def test_setup_defaults_and_limits():
    # Reference: the docstring and DEFAULTS: on the CPU 'auto' is the small preset; the rungs are numbered 1 to 12
    # (8 of the ladder, 4 memory rungs); random tokens (no data here) draw from the whole vocabulary; --threads sets
    # torch's CPU threads
    env = bench.setup(['--device=cpu', '--data_dir=no-such-dir'])
    assert env.preset == 'small' and {k: getattr(env, k) for k in bench.PRESETS['small']} == bench.PRESETS['small']
    assert bench.setup([*TINY, '--rungs=12,1']).rungs == [1, 12]
    with pytest.raises(bench.ConfigError, match='numbered 1 to 12'):
        bench.setup([*TINY, '--rungs=13'])
    env = bench.setup(TINY)
    assert env.tokens.min() == 0 and env.tokens.max() == env.vocab_size - 1
    threads = torch.get_num_threads()
    try:
        bench.setup([*TINY, '--threads=3'])
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize('flag, message', [
    ('--repeats=0', 'repeats=0 must be at least 1'), ('--warmup=-1', 'warmup=-1 must be at least 1'),
    ('--steps=-1', 'steps=-1 must be at least 1'), ('--batch_size=-1', 'batch_size=-1 must be at least 1'),
    ('--residual=bfloat16', "residual='bfloat16': expected one of 'float32', 'autocast'"),
    ('--mode=sweep', "mode='sweep': expected one of 'ladder', 'fit', 'profile'")])
def test_a_setting_out_of_range_is_a_config_error(flag, message):
    # Reference: the DEFAULTS comments: a median needs a repeat, compile compiles in the warm-up, the choices listed
    with pytest.raises(bench.ConfigError, match=re.escape(message)):
        bench.setup([*TINY, flag])


def test_fit_tries_micro_steps_that_hold_the_gradients(tmp_path, monkeypatch):
    # Reference: train.py's micro-steps after a step's first run their forward and backward while the gradients of
    # the ones before are held (4 bytes per parameter). A try of fit mode must run such a micro-step, or the
    # largest batch it finds can run out of memory in train.py with gradient accumulation.
    forward, seen = GPT.forward, tmp_path / 'held.jsonl'

    def spy(self, idx, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            child_record(seen, any(p.grad is not None for p in self.parameters()))
        return forward(self, idx, *args, **kwargs)
    monkeypatch.setattr(GPT, 'forward', spy)
    monkeypatch.setattr(bench, 'largest_batch', lambda fits, n: 2 if fits(2) else 0)  # one try per variant
    env = fit_env(tmp_path, 2048, monkeypatch)
    assert bench.fit(env) == 0
    held = child_records(seen)
    assert held and any(held), held


def test_mfu_names_the_peak_it_is_measured_against(tmp_path, monkeypatch):
    # Reference: a made-up GPU peak of 1e12 FLOP/s for bf16 and 5e11 for TF32 (model.peak_flops: float32 is TF32's);
    # MFU by hand: flops_per_token at block_size times tokens/s over the peak of the rung's matmuls. Rung 1 (float32
    # without TF32) has no peak listed: n/a, not a figure against the TF32 peak (several times too low)
    monkeypatch.setattr(model_module, 'peak_flops', lambda device, dtype='bfloat16': {'bfloat16': 1e12,
                                                                                       'float32': 5e11}[dtype])
    report = run_ladder(str(tmp_path), '--rungs=1,3', '--dtype=bfloat16', '--steps=1', '--repeats=1')
    first, third = report['rungs'][0], report['rungs'][2]
    flops = GPT(GPTConfig(**report['model'])).flops_per_token()
    assert (first['mfu'], first['mfu_peak'], third['mfu_peak']) == (None, None, 'bf16')
    assert third['mfu'] == pytest.approx(flops * third['tokens_per_sec'] / 1e12, rel=1e-9)
    table = (tmp_path / 'bench.md').read_text()
    assert f"| {third['mfu']:.1%} of bf16 |" in table and '| 1 | fp32 eager | fp32 | ' in table
    assert 'vs baseline: over rung 1 (fp32 eager), the first that ran' in table


def fake_device_memory(monkeypatch, allocated, outside=lambda: 0):
    """A made-up 80 GiB GPU for fit(): torch's allocator holds allocated() bytes and reserves 1 GiB, and outside()
    bytes are in use outside it (what the driver's free memory shows)."""
    total = 80 << 30
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda device=None: allocated())
    monkeypatch.setattr(torch.cuda, 'memory_reserved', lambda device=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device=None: (total - (1 << 30) - outside(), total))
    monkeypatch.setattr(torch.cuda, 'empty_cache', lambda: None)


def test_fit_records_what_a_try_left_allocated_and_starts_afresh_after_a_failure(tmp_path, monkeypatch):
    # Reference: a made-up GPU on which the try of 4 fits but leaves 2 GiB allocated and 4 GiB in use outside torch's
    # allocator, and each try past 6 fails with ALLOC_FAILED (cuBLAS), leaving 3 and 5 GiB: the try after the 4 (8,
    # the same process) finds what it left, and the tries after a failure (6, 7) run in a new process, which finds
    # nothing of the failed one's. Each try's held and outside bytes and each failure are recorded, and the row
    # says what the search saw.
    allocated, outside = [0], [0]

    def fake_run_rung(s, env):
        if env.batch_size > 6:
            allocated[0], outside[0] = 3 << 30, 5 << 30
            raise RuntimeError('CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`')
        if env.batch_size == 4:
            allocated[0], outside[0] = 2 << 30, 4 << 30
    env = fit_env(tmp_path, 2048, monkeypatch)
    env.device_type = 'cuda'
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    fake_device_memory(monkeypatch, lambda: allocated[0], lambda: outside[0])
    assert bench.fit(env) == 0
    first = json.load(open(tmp_path / 'fit.json'))['variants'][0]
    assert first['micro_batch'] == 6
    assert first['held_before_try'] == [0, 0, 0, 2 << 30, 0, 0]  # 1, 2, 4, 8 | 6 | 7: a process for each bar
    assert first['outside_torch_before_try'] == [0, 0, 0, 4 << 30, 0, 0]
    assert [(f['batch_size'], f['left_allocated']) for f in first['failures']] == [(8, 3 << 30), (7, 3 << 30)]
    assert 'ALLOC_FAILED' in first['failures'][0]['error']
    assert first['note'] == ("(up to 2.0 GiB still allocated before a try: a leak) (up to 4.0 GiB of device memory "
                             "in use outside torch's allocator before a try) (a failed try left up to 3.0 GiB "
                             "allocated: the next ran in a new process)")
    assert allocated == [0] and outside == [0]  # (this process ran no try)
    assert multiprocessing.active_children() == []  # each child joined, the last one too


def test_fit_is_not_misled_by_what_a_failed_try_leaves_behind(tmp_path, monkeypatch):
    # Reference: the largest size that fits, 37 (of 64). A stand-in for pytorch/pytorch#82218: a try that runs
    # out of memory leaves its tensors in its process for good, so that every later try there runs out of memory
    # too. In one process the search would answer 32, the last size that fit before the first failure (64).
    leaked = []

    def fake_run_rung(s, env):
        if leaked or env.batch_size > 37:
            leaked.append(env.batch_size)
            raise torch.cuda.OutOfMemoryError('CUDA out of memory')
    env = fit_env(tmp_path, 2048, monkeypatch)
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    monkeypatch.setattr(bench, 'FIT_VARIANTS', bench.FIT_VARIANTS[:1])
    assert bench.fit(env) == 0
    first = json.load(open(tmp_path / 'fit.json'))['variants'][0]
    assert first['micro_batch'] == 37 and [f['batch_size'] for f in first['failures']] == [64, 48, 40, 38]


def test_fit_notes_no_leak_for_what_every_process_holds(tmp_path, monkeypatch):
    # Reference: fit_variant's thresholds as its comments give them: a leak is more than 1 GiB still allocated
    # before a try, and memory outside torch's allocator is worth a note past 2 GiB, more than the CUDA contexts
    # and the libraries' handles take. A made-up GPU on which every try finds 256 MiB allocated (what torch holds
    # for cuBLAS's workspaces) and 1.5 GiB in use outside torch (fit's CUDA context and its child's): the search's
    # own note alone, '' for a micro-batch of 20 below the step's 64 sequences.
    def fake_run_rung(s, env):
        if env.batch_size > 20:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory')
    env = fit_env(tmp_path, 2048, monkeypatch)
    env.device_type = 'cuda'
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    monkeypatch.setattr(bench, 'FIT_VARIANTS', bench.FIT_VARIANTS[:1])
    fake_device_memory(monkeypatch, lambda: 256 << 20, lambda: 3 << 29)
    monkeypatch.setattr(bench.gc, 'collect', lambda: 0)  # (fast: nothing to collect in a stand-in)
    assert bench.fit(env) == 0
    first = json.load(open(tmp_path / 'fit.json'))['variants'][0]
    assert first['micro_batch'] == 20 and first['failures'] and first['note'] == ''
    assert set(first['held_before_try']) == {256 << 20} and set(first['outside_torch_before_try']) == {3 << 29}


class TwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_fit_says_when_a_try_ended_its_process(tmp_path, monkeypatch):
    # Reference: a try whose process dies without an answer (an exit, a signal) or raises what the parent could
    # not rebuild stops that variant's search, saying so (the exit code, the signal, the exception's text), as any
    # error that is not out of memory does; the next variant's tries run in a new process.
    def fake_run_rung(s, env):
        if s['checkpointing'] == 'full' and env.batch_size == 4:
            os._exit(3)
        if s['optimizer'] == 'adamw8bit' and env.batch_size == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if s['checkpointing'] == 'selective':
            raise TwoArguments('one', 'two')  # pickles, but does not unpickle: TwoArguments('one and two') fails
    env = fit_env(tmp_path, 256, monkeypatch)  # 8 sequences
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    monkeypatch.setattr(bench, 'FIT_VARIANTS', [*bench.FIT_VARIANTS[:3], ('selective', dict(checkpointing='selective')),
                                                ('as is, again', {})])
    assert bench.fit(env) == 0
    rows = json.load(open(tmp_path / 'fit.json'))['variants']
    assert [r['micro_batch'] for r in rows] == [8, None, None, None, 8]
    ended = "failed: RuntimeError: fit's child process ended without an answer to the try of batch_size="
    assert rows[1]['note'] == ended + '4 (exit code 3)'
    assert rows[2]['note'] == ended + '2 (killed by signal 9)'
    assert rows[3]['note'] == 'failed: RuntimeError: TwoArguments: one and two'
    assert multiprocessing.active_children() == []


def test_fit_notes_the_largest_leak_of_its_failed_tries():
    # Reference: by hand. A step of 8 sequences: 1 and 2 fit, 4 fails leaving 2 GiB allocated, 3 fails leaving
    # 0.1 GiB: the note names the largest leak a failure left (2.0 GiB), whichever failure left less.
    left = {4: 2 << 30, 3: (1 << 30) // 10}

    def tries(s, batch):
        fits = batch <= 2
        return dict(fits=fits, error=None if fits else 'OutOfMemoryError: CUDA out of memory', held=0, outside=0,
                    left=None if fits else left[batch])
    row = bench.fit_variant({}, 8, tries)
    assert row['micro_batch'] == 2 and [f['batch_size'] for f in row['failures']] == [4, 3]
    assert row['note'] == '(a failed try left up to 2.0 GiB allocated: the next ran in a new process)'


def test_fit_names_the_exit_code_of_a_child_that_exited_0_without_an_answer(tmp_path, monkeypatch):
    # Reference: the child's exit status as multiprocessing reports it: 0 is an exit code, not a signal (only
    # negative codes are signals).
    monkeypatch.setattr(bench, 'run_rung', lambda s, env: os._exit(0))
    env = fit_env(tmp_path, 64, monkeypatch)
    tries = bench.FitTries(env)
    try:
        with pytest.raises(RuntimeError, match=r'the try of batch_size=1 \(exit code 0\)$'):
            tries({}, 1)
    finally:
        tries.close()


def test_fit_child_builds_its_run_from_the_command_line(monkeypatch):
    # Reference: what fit() sets in its own process before a try (fit_steps: 1 warm-up step, 1 timed step of 2
    # micro-steps, 1 repeat) and main's RoPE form (--rope=halves), which a spawned child must set again from the
    # command line; then the answer to each try and to None. Here the child's function runs in a thread.
    seen = []

    def fake_run_rung(s, env):
        seen.append((env.warmup, env.steps, env.repeats, env.gradient_accumulation_steps, env.batch_size,
                     model_module.apply_rotary is bench.rope_halves, s))
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    parent, child = multiprocessing.Pipe()
    thread = threading.Thread(target=bench.fit_child, args=(child, None, [*TINY, '--rope=halves']))
    thread.start()
    parent.send(({'a': 1}, 3))
    assert parent.recv() == dict(fits=True, error=None, held=None, outside=None, left=None)
    parent.send(None)
    thread.join(60)
    assert not thread.is_alive() and seen == [(1, 1, 1, 2, 3, True, {'a': 1})]
    assert model_module.apply_rotary is not bench.rope_halves  # (restored)


def test_fit_tries_run_in_a_spawned_process_built_from_the_command_line(tmp_path, monkeypatch):
    # Reference: the tiny ladder's model trains on the CPU at 1, 2 and 4 sequences, so the whole step of 4 fits; the
    # tries run in a child process that spawned a fresh interpreter and rebuilt the run from env.argv, as on CUDA
    # (a fork would carry CUDA's state over). What this process's run_rung would do is never called.
    assert bench.FIT_START == 'spawn'  # the module's own, as CUDA runs it
    monkeypatch.setattr(bench, 'run_rung', lambda s, env: pytest.fail('a try ran in the parent process'))
    env = fit_env(tmp_path, 128, monkeypatch, start='spawn')  # 4 sequences of 32 tokens
    monkeypatch.setattr(bench, 'FIT_VARIANTS', bench.FIT_VARIANTS[:1])
    assert bench.fit(env) == 0 and multiprocessing.active_children() == []
    first = json.load(open(tmp_path / 'fit.json'))['variants'][0]
    assert (first['micro_batch'], first['note'], first['failures']) == (4, 'the whole step fits in one micro-batch', [])


def test_fit_mode_on_the_cpu_says_it_needs_a_gpu():
    with pytest.raises(bench.BenchError, match='needs a CUDA GPU'):
        bench.main(['--mode=fit', '--device=cpu'])
    proc = subprocess.run([sys.executable, 'bench.py', '--mode=fit', '--device=cpu'], cwd=HERE,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr
    assert proc.stderr.startswith('bench.py: error: --mode=fit needs a CUDA GPU'), proc.stderr


def test_largest_batch_reaches_a_cap_that_is_a_power_of_two():
    # Reference: every size up to the cap fits, so the cap is the answer (64 = 2^6: the doubling reaches it exactly)
    for cap in (1, 2, 64):
        assert bench.largest_batch(lambda b: True, cap) == cap, cap
        assert bench.largest_batch(lambda b: b <= cap, 4 * cap) == cap, cap


def test_fit_notes_whole_steps_failures_and_leaks(tmp_path, monkeypatch):
    # Reference: made-up memory limits, by variant, on a made-up GPU: 'as is' fits the whole step of 64 sequences
    # (2050 tokens of 32: 64 whole sequences, 2048 tokens); 'act. ckpt full' runs out of memory even at 1 sequence;
    # '8-bit AdamW' fails in another way (not memory: the search stops and says so); the last runs out of memory
    # past 5 sequences with a two-line message (recorded: its first line), and its second try (2) finds 3 GiB
    # still allocated (a leak, whatever the later tries find). Each try runs the top ladder rung that runs eager
    # (rung 7) with the variant's change.
    # tries: 'as is' 1, 2, ..., 64; 'act. ckpt full' 1; '8-bit AdamW' 1; the last 1, 2, 4, 8, then 6, 5; the try of
    # 1 in the last variant leaves 3 GiB allocated, which its process's next try (2) finds
    seen, leaked = tmp_path / 'tries.jsonl', [0]

    def fake_run_rung(s, env):
        child_record(seen, s)
        last = s['checkpointing'] == 'full' and s['optimizer'] == 'adamw8bit'
        leaked[0] = 3 << 30 if last and env.batch_size == 1 else 0
        if last:
            if env.batch_size > 5:
                raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB\nGPU 0 details')
        elif s['checkpointing'] == 'full':
            raise torch.cuda.OutOfMemoryError('CUDA out of memory')
        elif s['optimizer'] == 'adamw8bit':
            raise RuntimeError('cuDNN error: CUDNN_STATUS_BAD_PARAM')
    env = fit_env(tmp_path, 2050, monkeypatch)
    env.device_type = 'cuda'
    monkeypatch.setattr(bench, 'run_rung', fake_run_rung)
    fake_device_memory(monkeypatch, lambda: leaked[0])
    monkeypatch.setattr(bench.gc, 'collect', lambda: 0)  # (fast: nothing to collect in a stand-in)
    assert bench.fit(env) == 0
    record = json.load(open(tmp_path / 'fit.json'))
    assert record['tokens_per_step'] == 64 * 32
    for key in ('command', 'date', 'device', 'torch', 'model', 'params', 'block_size', 'data'):
        assert record[key] == env.meta[key], key
    whole, none, other, last = record['variants']
    assert (whole['micro_batch'], whole['batch_size'], whole['gradient_accumulation_steps']) == (64, 64, 1)
    assert whole['note'] == 'the whole step fits in one micro-batch' and whole['failures'] == []
    assert (none['micro_batch'], none['batch_size'], none['gradient_accumulation_steps']) == (0, None, None)
    assert none['note'] == 'does not fit even at batch_size=1'
    assert other['micro_batch'] is None and other['note'] == 'failed: RuntimeError: cuDNN error: CUDNN_STATUS_BAD_PARAM'
    assert (last['micro_batch'], last['batch_size'], last['gradient_accumulation_steps']) == (5, 4, 16)
    assert last['held_before_try'] == [0, 3 << 30, 0, 0, 0, 0] and whole['held_before_try'] == [0] * 7
    assert whole['outside_torch_before_try'] == [0] * 7  # (1 GiB reserved by torch is no memory outside it)
    assert last['note'] == '(up to 3.0 GiB still allocated before a try: a leak)'
    assert last['failures'][0] == {'batch_size': 8, 'error': 'OutOfMemoryError: CUDA out of memory. Tried to '
                                                             'allocate 2.00 GiB', 'left_allocated': 0}
    rung7 = {**bench.BASE, 'tf32': True, 'dtype': env.mixed, 'attention': 'auto', 'fused_qkv': True,
             'fused_adamw': True, 'chunked_loss': True}
    tries = child_records(seen)
    assert len(tries) == 7 + 1 + 1 + 6 and whole['settings'] == tries[0] == rung7
    assert last['settings'] == tries[-1] == {**rung7, 'checkpointing': 'full', 'optimizer': 'adamw8bit'}
    assert all(t == rung7 for t in tries[:7])  # 1, 2, ..., 64 for 'as is'


def test_fit_takes_a_step_of_at_least_one_sequence(tmp_path, monkeypatch):
    # Reference: a step holds whole sequences, at least one: 16 tokens asked of 32-token sequences is one sequence
    monkeypatch.setattr(bench, 'run_rung', lambda s, env: None)  # every size fits
    env = fit_env(tmp_path, 16, monkeypatch)
    assert bench.fit(env) == 0
    record = json.load(open(tmp_path / 'fit.json'))
    assert record['tokens_per_step'] == 32
    for v in record['variants']:
        assert (v['micro_batch'], v['batch_size'], v['gradient_accumulation_steps']) == (1, 1, 1), v['variant']
        assert v['note'] == 'the whole step fits in one micro-batch', v['variant']


# ----------------------------------------------------------------------------------------------------
# the ladder's bookkeeping, on a stand-in for run_rung (no training: a fraction of a second)

def stand_in_ladder(monkeypatch, *flags, fail=lambda s: None):
    """bench.ladder's rows with run_rung replaced: the k-th rung run takes 100 / k ms (each faster than the last),
    or raises what fail(settings) returns. Also returns the settings each rung ran with, in order, and the env."""
    ran = []

    def run_rung(s, env, **kwargs):
        ran.append(dict(s))
        error = fail(s)
        if error:
            raise error
        ms = 100 / len(ran)
        return dict(ms_per_iter=ms, tokens_per_sec=env.batch_size * env.block_size / (ms / 1000), loss=1.0,
                    mfu=None, mfu_peak=None, peak_mem_mb=None, activation_mb=len(ran) / 8, optimizer_state_mb=0.25)
    monkeypatch.setattr(bench, 'run_rung', run_rung)
    env = bench.setup([*TINY, *flags])
    return bench.ladder(env), ran, env


def test_each_rung_builds_on_the_last_rung_that_ran(monkeypatch):
    # Reference: the ladder as the module's docstring lists it, on the CPU with compile on: 2 (TF32), 3 (bf16, off
    # on the CPU), 6 (fused AdamW) and 12 (FP8) are skipped there; 11 (8-bit AdamW) raises BenchError here (as
    # without bitsandbytes) and is skipped with its message. Each ladder rung adds its change to the last that ran,
    # each memory rung its own alone to rung 8; vs prev is over the rung it builds on, vs baseline over rung 1.
    rows, ran, _ = stand_in_ladder(monkeypatch, '--compile=True', fail=lambda s: bench.BenchError(
        'optimizer=adamw8bit needs bitsandbytes') if s['optimizer'] == 'adamw8bit' else None)
    by = {r['rung']: r for r in rows}
    assert [r['status'] for r in rows] == ['ok', 'skipped', 'skipped', 'ok', 'ok', 'skipped', 'ok', 'ok', 'ok',
                                           'ok', 'skipped', 'skipped']
    assert by[11]['reason'] == 'optimizer=adamw8bit needs bitsandbytes'
    base = dict(bench.BASE)
    want = {1: base}
    want[4] = dict(want[1], attention='auto')
    want[5] = dict(want[4], fused_qkv=True)
    want[7] = dict(want[5], chunked_loss=True)
    want[8] = dict(want[7], compile=True)
    want.update({9: dict(want[8], checkpointing='full'), 10: dict(want[8], checkpointing='selective'),
                 11: dict(want[8], optimizer='adamw8bit'), 12: dict(want[8], fp8=True)})
    for i, settings in want.items():
        assert by[i]['settings'] == settings, i
    assert ran == [want[i] for i in (1, 4, 5, 7, 8, 9, 10, 11)]  # 12 is skipped before it runs
    # rung 3, skipped on the CPU, is listed as the bf16 rung it would be (train.pick_dtype says float32 here)
    assert by[3]['settings']['dtype'] == 'bfloat16' and by[3]['precision'] == 'bf16 autocast'
    assert by[11]['precision'] == 'fp32, 8-bit AdamW' and by[12]['precision'] == 'fp32 + FP8 linears (tensorwise)'
    builds_on = {1: None, 4: 1, 5: 4, 7: 5, 8: 7, 9: 8, 10: 8}
    for i, b in builds_on.items():
        r = by[i]
        assert r['builds_on'] == (b and by[b]['name']), i
        assert r['speedup_vs_baseline'] == pytest.approx(by[1]['ms_per_iter'] / r['ms_per_iter']), i
        # rung 1 builds on nothing: 1.0x over itself
        assert r['speedup_vs_prev'] == pytest.approx(by[b]['ms_per_iter'] / r['ms_per_iter'] if b else 1.0), i
    for i in (2, 3, 6, 11, 12):
        assert all(by[i][key] is None for key, _ in bench.COLUMNS.values()), i


def test_the_fp16_rung_is_named_for_fp16(monkeypatch):
    # Reference: the docstring's rung 3: fp16 + GradScaler where bf16 is not used (--dtype=float16 here), and the
    # rungs after it keep that dtype
    rows, ran, _ = stand_in_ladder(monkeypatch, '--dtype=float16')
    by = {r['rung']: r for r in rows}
    assert by[3]['status'] == 'ok' and by[3]['name'] == '+ fp16 autocast'
    assert by[3]['precision'] == 'fp16 autocast + GradScaler' and by[3]['settings']['dtype'] == 'float16'
    assert by[1]['name'] == 'fp32 eager' and by[1]['precision'] == 'fp32'
    assert all(s['dtype'] == 'float16' for s in ran[1:]) and ran[0]['dtype'] == 'float32'


def test_rungs_left_out_build_on_nothing_measured(monkeypatch):
    # Reference: --rungs=1,4,9 over the whole ladder's settings. Rungs left out have no figures and build on nothing;
    # rung 4 builds on rung 1 (2 and 3 are skipped on the CPU in any case); rung 9 builds on rung 7, which did not
    # run, so it has no rung to compare with.
    rows, ran, _ = stand_in_ladder(monkeypatch, '--rungs=1,4,9')
    by = {r['rung']: r for r in rows}
    for r in rows:
        if r['rung'] in (1, 4, 9):
            assert r['status'] == 'ok', r['rung']
        else:
            assert (r['status'], r['reason'], r['builds_on']) == ('not run', 'not in --rungs', None), r['rung']
            assert all(r[key] is None for key, _ in bench.COLUMNS.values()), r['rung']
    assert by[4]['builds_on'] == 'fp32 eager'
    assert by[4]['speedup_vs_prev'] == pytest.approx(by[1]['ms_per_iter'] / by[4]['ms_per_iter'])
    assert by[9]['builds_on'] is None and by[9]['speedup_vs_prev'] is None
    assert by[9]['settings'] == {**bench.BASE, 'attention': 'auto', 'fused_qkv': True, 'chunked_loss': True,
                                 'checkpointing': 'full'}


def test_rung_settings_and_names_agree_with_a_compiled_ladder(monkeypatch):
    # Reference: the ladder's own rows, on the CPU with compile on and bf16 asked for (rung 8 runs, so the memory
    # rungs that profile mode reads by number build on the compiled rung), and the docstring's names: rung 3 is
    # '+ bf16 autocast' where it runs bf16 (fp16 only where train.pick_dtype gives fp16)
    rows, _, env = stand_in_ladder(monkeypatch, '--compile=True', '--dtype=bfloat16')
    assert {r['rung']: r['name'] for r in rows}[3] == '+ bf16 autocast'
    for row in rows:
        name, settings, reason = bench.rung_settings(row['rung'], env)
        assert (name, settings) == (row['name'], row['settings']), row['rung']
        assert reason == (row['reason'] if row['status'] == 'skipped' else None), row['rung']
    assert bench.rung_settings(9, env)[1]['compile'] is True and bench.rung_settings(3, env)[0] == '+ bf16 autocast'


def table_cells(md):
    """The markdown table of bench.md: its header and its rows, each a list of cells."""
    lines = [ln for ln in md.splitlines() if ln.startswith('| ')]
    return [ln[2:-2].split(' | ') for ln in lines[0:1]][0], [ln[2:-2].split(' | ') for ln in lines[1:]]


def test_table_cells_show_each_rows_figures(result):
    # Reference: bench.json's rows, each figure read back from its cell within the rounding of the cell's
    # decimals; on the CPU MFU and peak memory are n/a (no such figure there), a rung that did not run has '-'
    report, out = result
    header, cells = table_cells(open(out / 'bench.md').read())
    columns = {'ms/iter': ('ms_per_iter', 0.05), 'tokens/s': ('tokens_per_sec', 0.5),
               'activations MB': ('activation_mb', 0.005), 'opt. state MB': ('optimizer_state_mb', 0.005),
               'vs baseline': ('speedup_vs_baseline', 0.005), 'vs prev': ('speedup_vs_prev', 0.005),
               'loss': ('loss', 5e-6)}
    assert header[:3] == ['#', 'rung', 'precision'] and header[-1] == 'note'
    assert set(header[3:-1]) == {*columns, 'MFU', 'peak mem MB'}
    assert len(cells) == len(report['rungs'])
    for r, row in zip(report['rungs'], cells):
        assert len(row) == len(header), row
        cell = dict(zip(header, row))
        assert (cell['#'], cell['rung'], cell['precision']) == (str(r['rung']), r['name'], r['precision'])
        if r['status'] != 'ok':
            assert all(cell[c] == '-' for c in header[3:-1]), row
            assert cell['note'].startswith(f"{r['status']}: ") and r['reason'], row
            continue
        assert cell['MFU'] == 'n/a' and cell['peak mem MB'] == 'n/a' and cell['note'] == ''
        for name, (key, tol) in columns.items():
            assert abs(float(cell[name].rstrip('x').replace(',', '')) - r[key]) <= tol * 1.001, (r['name'], name)
    assert report['rungs'][0]['speedup_vs_prev'] == 1.0 and cells[0][header.index('vs prev')] == '1.00x'


def test_a_failed_rung_with_a_long_reason_keeps_the_table_whole(monkeypatch, tmp_path):
    # Reference: the error as raised. A failing rung's reason keeps the error's text (up to 300 characters), and
    # the table's note has no '|' or line break that would split its row; a rung that ran first counts as the
    # baseline, not one that failed; a failed rung read the variants it ran with (compile mode here).
    error = 'boom | with a pipe\nand a second line ' + 'x' * 100
    rows, _, env = stand_in_ladder(monkeypatch, '--compile=True', '--compile_mode=max-autotune', fail=lambda s:
                                   RuntimeError(error) if s['attention'] == 'math' or s['compile'] else None)
    by = {r['rung']: r for r in rows}
    assert by[1]['status'] == by[8]['status'] == 'failed' and by[4]['status'] == 'ok'
    assert by[1]['reason'] == by[8]['reason'] == f'RuntimeError: {error}'
    md = bench.markdown(rows, env.meta)
    header, cells = table_cells(md)
    assert [len(row) for row in cells] == [len(header)] * len(rows)
    assert cells[0][-1].startswith('failed: RuntimeError: boom') and cells[0][-1].endswith('x' * 100)
    assert 'vs baseline: over rung 4 (+ SDPA flash), the first that ran' in md
    assert by[5]['speedup_vs_baseline'] == pytest.approx(by[4]['ms_per_iter'] / by[5]['ms_per_iter'])
    assert 'compile mode max-autotune,' in md and 'max-autotune (read by no rung' not in md


def test_the_report_counts_parameters_in_millions(result):
    # Reference: 124,475,904 parameters (GPT-2's 124M) are 124.48M: a million is 10^6
    report, _ = result
    md = bench.markdown(report['rungs'], dict(report, params=124_475_904))
    assert '; 124.48M parameters' in md


def test_variants_line_marks_what_no_rung_that_ran_reads():
    # Reference: which rungs read each variant, from the DEFAULTS comments: compile_mode the compiled rungs,
    # sdpa_backend those not on the math kernel, loss_chunk_tokens the chunked-loss rungs, residual those under
    # autocast; rope and stage_data every rung. A chunk as large as a micro-batch (batch_size x block_size tokens,
    # whatever the accumulation) is one chunk.
    meta = dict(batch_size=4, block_size=32, gradient_accumulation_steps=8, device_type='cpu', variants=dict(
        compile_mode='default', coordinate_descent_tuning=False, sdpa_backend='auto', rope='flip',
        loss_chunk_tokens=128, residual='float32', stage_data=True))
    none = '(read by no rung that ran)'
    line = bench.variants_line(meta, [bench.BASE])
    assert line == (f'- variants: compile mode default {none}, SDPA backend auto {none}, RoPE flip, loss chunk 128 '
                    f'tokens (one chunk: a micro-batch is 128 tokens) {none}, residual stream float32 {none}, '
                    'data staged on the device (no loading)')
    each = {'compile mode default': dict(compile=True), 'SDPA backend auto': dict(attention='auto'),
            'loss chunk 128 tokens (one chunk: a micro-batch is 128 tokens)': dict(chunked_loss=True),
            'residual stream float32': dict(dtype='bfloat16')}
    for part, change in each.items():  # one rung that reads only this one
        line = bench.variants_line(meta, [bench.BASE, {**bench.BASE, **change}])
        assert f'{part},' in line or line.endswith(part), part
        assert line.count(none) == 3, part
    top = {**bench.BASE, 'dtype': 'bfloat16', 'attention': 'auto', 'chunked_loss': True, 'compile': True}
    meta['variants'].update(loss_chunk_tokens=127, stage_data=False)
    line = bench.variants_line(meta, [top])
    assert none not in line and 'loss chunk 127 tokens,' in line and 'data loaded as train.py does' in line


def test_why_skip_on_each_kind_of_device(monkeypatch):
    # Reference: the docstring's ladder. On the CPU: TF32 and fused AdamW are CUDA only, bf16 off (pick_dtype) and FP8
    # needs a GPU; --compile=False skips the compile rung. On a GPU (faked: env and capability): nothing skipped at
    # capability 9.0 (H100) or 8.9 (L4, RTX 4090); FP8 alone at 8.0 (A100).
    changes = {name: change for name, change in bench.LADDER + bench.MEMORY}

    def skipped(capability=None, **env):
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device=None: capability)
        env = SimpleNamespace(**{'device': 'cpu', 'dtype': 'auto', 'mixed_reason': 'why', 'compile': True, **env})
        return {name for name, change in changes.items() if bench.why_skip(change, env)}
    assert skipped(device_type='cpu', mixed='float32') == {'+ TF32', '+ bf16 autocast', '+ fused AdamW',
                                                          '+ FP8 linears'}
    assert skipped(device_type='cpu', mixed='bfloat16', dtype='bfloat16', compile=False) == {
        '+ TF32', '+ fused AdamW', '+ FP8 linears', '+ torch.compile'}
    gpu = dict(device='cuda', device_type='cuda', mixed='bfloat16')
    assert skipped((9, 0), **gpu) == skipped((8, 9), **gpu) == set()
    assert skipped((8, 0), **gpu) == {'+ FP8 linears'}
    assert skipped((7, 0), **{**gpu, 'mixed': 'float16'}) == {'+ FP8 linears'}  # a V100: fp16 + GradScaler


def test_the_chart_draws_tokens_peak_and_activation_memory(monkeypatch, tmp_path):
    # Reference: the rows' figures, as drawn: the three panels' bars (a figure that is n/a drawn as 0), each bar
    # named for the row whose figure it draws (its rung, its name, a status other than ok), each panel for its figure
    pytest.importorskip('matplotlib')
    import matplotlib.axes
    drawn, labels, real_barh, real_xlabel = [], [], matplotlib.axes.Axes.barh, matplotlib.axes.Axes.set_xlabel
    monkeypatch.setattr(matplotlib.axes.Axes, 'barh', lambda self, names, values, **kw: drawn.append(
        (list(names), list(values))) or real_barh(self, names, values, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, 'set_xlabel', lambda self, text, *a, **kw: labels.append(text)
                        or real_xlabel(self, text, *a, **kw))
    rows, _, env = stand_in_ladder(monkeypatch)
    bench.plot(rows, env.meta, str(tmp_path / 'bench.png'))
    assert len(drawn) == 3 and all(len(names) == len(rows) for names, _ in drawn)
    assert [values for _, values in drawn] == [[r[key] or 0 for r in rows] for key in (
        'tokens_per_sec', 'peak_mem_mb', 'activation_mb')]
    assert any(drawn[2][1]) and not any(drawn[1][1])  # activations measured on the CPU, peak memory n/a
    for names, _ in drawn:
        assert [n.split('. ', 1)[0] for n in names] == [str(r['rung']) for r in rows]
        assert all(r['name'] in n and n.endswith('' if r['status'] == 'ok' else f"({r['status']})")
                   for n, r in zip(names, rows)), names
    assert labels[0] == 'tokens/s' and labels[1].startswith('peak memory')
    assert labels[2].startswith('saved for backward')


# ----------------------------------------------------------------------------------------------------
# the step: presets against the training configs, a timed step as one optimizer step

@pytest.mark.parametrize('preset, config', [('small', 'config/train_small.py'), ('gpt2', 'config/train_gpt2.py')])
def test_presets_take_the_model_and_step_of_their_training_config(preset, config):
    # Reference: the training config itself, read as train.py reads it (its vocabulary comes from the data
    # for the small config, so only the gpt2 one is compared on it)
    want = configure(train.DEFAULTS, [os.path.join(HERE, config)])
    keys = ['n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'gradient_accumulation_steps']
    keys += ['vocab_size'] if preset == 'gpt2' else []
    assert {k: bench.PRESETS[preset][k] for k in keys} == {k: want[k] for k in keys}
    p = bench.PRESETS[preset]
    tokens = p['batch_size'] * p['block_size'] * p['gradient_accumulation_steps']
    assert bench.step_note(preset, tokens) == f'as in {config}'
    assert bench.step_note(preset, tokens // 4).startswith(f'NOT the {tokens:,} tokens per step of {config}')
    assert '4x what they weigh' in bench.step_note(preset, tokens // 4)


def test_a_step_larger_than_the_configs_is_not_its_step():
    # Reference: the docstring: config/train_gpt2.py's step is 16 x 1024 x 32 = 524,288 tokens. Twice as many is not
    # that step either: per token, the optimizer step weighs half what it weighs there.
    note = bench.step_note('gpt2', 2 * 524288)
    assert note.startswith('NOT the 524,288 tokens per step of config/train_gpt2.py') and '0.5x what they weigh' in note


def test_a_timed_step_is_one_optimizer_step_of_all_its_micro_batches(monkeypatch):
    # Reference: counting the calls. Each timed step must be one train.train_step over
    # gradient_accumulation_steps micro-batches (one optimizer step), and the rung's tokens/s must count them all.
    env = bench.setup([*TINY, '--gradient_accumulation_steps=3', '--warmup=2', '--steps=2', '--repeats=2'])
    assert env.meta['tokens_per_iter'] == 4 * 32 * 3 and 'tiny' in env.meta['step_note']
    assert bench.setup(TINY).gradient_accumulation_steps == 1  # a CPU preset keeps one micro-batch per step
    calls, forwards, real_step, real_forward = [], [], train.train_step, GPT.forward

    def train_step(*args):
        calls.append(args[4])  # accum_steps
        return real_step(*args)

    def forward(self, *args, **kwargs):
        forwards.append(1)
        return real_forward(self, *args, **kwargs)
    monkeypatch.setattr(train, 'train_step', train_step)
    monkeypatch.setattr(GPT, 'forward', forward)
    row = bench.run_rung(bench.BASE, env)
    assert calls == [3] * (2 + 2 * 2)  # warmup + repeats x steps optimizer steps, 3 micro-batches each
    assert len(forwards) == 3 * len(calls) + 1  # and the untimed micro-step that counts the activations
    assert row['tokens_per_sec'] == pytest.approx(4 * 32 * 3 / (row['ms_per_iter'] / 1000))


def test_lr_warmup_warms_every_rung_up_as_train_py_then_holds_the_rate(monkeypatch, tmp_path):
    # Reference: train.get_lr with warmup_iters=3 for the first 3 steps (warm-up steps first, each rung from its
    # first), train.py's learning_rate after; without --lr_warmup every step at learning_rate. The report says which.
    lrs, real_step = [], train.train_step

    def train_step(net, optimizer, *args):
        lrs.append([group['lr'] for group in optimizer.param_groups])
        return real_step(net, optimizer, *args)
    monkeypatch.setattr(train, 'train_step', train_step)
    lr = train.DEFAULTS['learning_rate']
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'warmup_iters': 3, 'max_iters': 100})
    want = [train.get_lr(i, cfg) for i in range(3)] + [lr] * 3
    assert want[0] < want[1] < want[2] < lr
    for flags, rate in [(['--lr_warmup=3'], want), ([], [lr] * 6)]:
        env = bench.setup([*TINY, '--warmup=2', '--steps=2', '--repeats=2', *flags])
        for _ in range(2):  # a second rung starts over
            lrs.clear()
            bench.run_rung(bench.BASE, env)
            assert lrs[0] and lrs == [[pytest.approx(r, rel=1e-12)] * len(lrs[0]) for r in rate]
        line = 'learning rate 0.0006, ' + ('warmed up over the first 3 steps, the warm-up steps included' if flags
                                          else 'constant')
        assert line in bench.markdown([], env.meta)
    with pytest.raises(bench.ConfigError, match=r'lr_warmup=-1: must be at least 0'):
        bench.setup([*TINY, '--lr_warmup=-1'])
    with pytest.raises(bench.ConfigError, match=r'--mode=fit does not read lr_warmup'):
        bench.setup(['--mode=fit', '--lr_warmup=3'])


@pytest.mark.parametrize('steps, repeats, durations, want', [
    (2, 3, [0.2, 0.4, 0.1, 0.1, 0.9, 0.7], 300), (1, 4, [0.4, 0.1, 0.3, 0.2], 250), (1, 4, [0.4, 0.1, 0.3, 1.0], 350)])
def test_a_rungs_time_is_the_median_repeat_per_step(monkeypatch, steps, repeats, durations, want):
    # Reference: the median by hand, with a made-up clock that only the steps advance. Three repeats of two steps
    # taking 0.2 + 0.4, 0.1 + 0.1 and 0.9 + 0.7 s are 0.3, 0.1 and 0.8 s per step: the median is 300 ms (the mean
    # would be 400, the least 100). Four repeats of one step: the mean of the middle two, (0.2 + 0.3) / 2 = 250 ms
    # (the higher middle one would be 300, the lower 200); of 0.4, 0.1, 0.3 and 1.0 s, 350 ms (the mean 450)
    clock, ticks = [0.0], iter([5.0, *durations])  # the warm-up step first
    real_step = train.train_step

    def train_step(*args):
        out = real_step(*args)
        clock[0] += next(ticks)
        return out
    env = bench.setup([*TINY, '--warmup=1', f'--steps={steps}', f'--repeats={repeats}'])
    monkeypatch.setattr(train, 'train_step', train_step)
    monkeypatch.setattr(bench, 'time', SimpleNamespace(perf_counter=lambda: clock[0]))
    row = bench.run_rung(bench.BASE, env)
    assert row['ms_per_iter'] == pytest.approx(want)
    assert row['tokens_per_sec'] == pytest.approx(4 * 32 / (want / 1000))


def test_each_precision_has_its_mfu_peak_and_only_fp16_scales_the_loss(monkeypatch):
    # Reference: made-up GPU peaks of 1e12 FLOP/s for bf16, 2e12 for fp16 and 5e11 for TF32 (model.peak_flops:
    # float32 is TF32's); MFU by hand, flops_per_token at block_size times tokens/s over the peak of the rung's
    # matmuls, named as train.py names them. The GradScaler is for fp16 alone (the docstring's rung 3).
    peaks = {'bfloat16': 1e12, 'float16': 2e12, 'float32': 5e11}
    monkeypatch.setattr(model_module, 'peak_flops', lambda device, dtype='bfloat16': peaks[dtype])
    scalers, real_scaler = [], torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, 'GradScaler', lambda device, enabled=True: scalers.append(enabled) or
                        real_scaler(device, enabled=enabled))
    env = bench.setup([*TINY, '--warmup=1', '--steps=1', '--repeats=1'])
    flops = GPT(env.config).flops_per_token()
    for s, label in [({'tf32': True}, 'TF32'), ({'dtype': 'bfloat16'}, 'bf16'), ({'dtype': 'float16'}, 'fp16')]:
        s = {**bench.BASE, **s}
        row = bench.run_rung(s, env)
        peak = peaks[s['dtype']]
        assert row['mfu'] == pytest.approx(flops * row['tokens_per_sec'] / peak, rel=1e-9), label
        assert row['mfu_peak'] == label
    assert scalers == [False, False, True]


def test_rungs_before_fused_qkv_run_separate_projections(monkeypatch):
    # Reference: the attention modules' calls, counted: separate q, k, v projections (SeparateQKVAttention) until the
    # fused QKV rung, model.py's fused attention from it on; 2 layers x (1 warm-up + 1 timed step + 1 counted)
    calls, real_separate, real_fused = [], bench.SeparateQKVAttention.forward, CausalSelfAttention.forward
    monkeypatch.setattr(bench.SeparateQKVAttention, 'forward', lambda self, *a, **k: calls.append('separate') or
                        real_separate(self, *a, **k))
    monkeypatch.setattr(CausalSelfAttention, 'forward', lambda self, *a, **k: calls.append('fused') or
                        real_fused(self, *a, **k))
    env = bench.setup([*TINY, '--warmup=1', '--steps=1', '--repeats=1'])
    for fused, want in ((False, 'separate'), (True, 'fused')):
        calls.clear()
        bench.run_rung({**bench.BASE, 'fused_qkv': fused}, env)
        assert calls == [want] * (2 * 3), fused


def test_memory_figures_are_in_mib(monkeypatch):
    # Reference: a MB of the table is 2^20 bytes (as torch.cuda.max_memory_allocated / 2**20): the activation bytes
    # as activation_bytes returned them, and AdamW's state by hand: two float32 moments per parameter and a
    # float32 step count per parameter tensor (separate q, k, v: two more tensors per layer than the fused qkv)
    counted, real = [], bench.activation_bytes

    def activation_bytes(*args, **kwargs):
        out = real(*args, **kwargs)
        counted.append(out[1])
        return out
    monkeypatch.setattr(bench, 'activation_bytes', activation_bytes)
    env = bench.setup([*TINY, '--warmup=1', '--steps=1', '--repeats=1'])
    model = GPT(env.config)
    params, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    for fused, extra in ((False, 2 * env.config.n_layer), (True, 0)):
        counted.clear()
        row = bench.run_rung({**bench.BASE, 'fused_qkv': fused}, env)
        assert len(counted) == 1 and row['activation_mb'] == counted[0] / 2**20
        assert row['optimizer_state_mb'] == (8 * params + 4 * (tensors + extra)) / 2**20, fused


@pytest.mark.parametrize('compile_mode, compiled, reset_after_warmup', [
    ('default', False, True), ('default', True, True), ('reduce-overhead', False, True),
    ('reduce-overhead', True, False), ('max-autotune', True, False)])
def test_peak_memory_is_the_rungs_own_and_covers_what_cuda_graphs_allocate(monkeypatch, compile_mode, compiled,
                                                                           reset_after_warmup):
    # Reference: the docstring's peak-memory rules, on a made-up GPU (the calls to torch.cuda recorded, the model
    # on the CPU): the peak is reset as a rung starts (never an earlier rung's) and again after its warm-up, except
    # on a compiled rung whose mode records CUDA graphs (reduce-overhead, max-autotune), whose graphs allocate
    # their memory in the warm-up; it is read after the timed steps, before the untimed micro-step that counts the
    # activations.
    calls, real_step, real_activation_bytes = [], train.train_step, bench.activation_bytes
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda device=None: calls.append('reset'))
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda device=None: calls.append('peak') or 3 << 20)
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: None)
    monkeypatch.setattr(torch.cuda, 'empty_cache', lambda: None)
    monkeypatch.setattr(torch, 'compile', lambda m, mode=None: m)
    monkeypatch.setattr(train, 'train_step', lambda *args: calls.append('step') or real_step(*args))
    monkeypatch.setattr(bench, 'activation_bytes', lambda *a, **k: calls.append('activations') or
                        real_activation_bytes(*a, **k))
    env = bench.setup([*TINY, '--warmup=2', '--steps=1', '--repeats=2', f'--compile_mode={compile_mode}'])
    env.device_type = 'cuda'  # (env.device stays the CPU)
    precision = torch.get_float32_matmul_precision()
    try:
        row = bench.run_rung({**bench.BASE, 'compile': compiled}, env)
    finally:
        torch.set_float32_matmul_precision(precision)
    warmup, timed = ['step'] * 2, ['step'] * 2
    assert calls == ['reset', *warmup, *(['reset'] if reset_after_warmup else []), *timed, 'peak', 'activations']
    assert row['peak_mem_mb'] == 3


# ----------------------------------------------------------------------------------------------------
# activation memory: bench.activation_bytes against sizes computed from the shapes

B, T, V, C, H = 2, 16, 512, 32, 4
N = B * T


def saved_bytes(n_layer, checkpointing='none', loss_chunk_tokens=None, **overrides):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=n_layer, n_head=H, n_embd=C, **overrides))
    model.activation_checkpointing = checkpointing
    if loss_chunk_tokens is not None:
        model.loss_chunk_tokens = loss_chunk_tokens
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    loss, saved = bench.activation_bytes(model, lambda: model(x, y)[1])
    loss.backward()  # the saved tensors were usable: backward ran on them
    return saved, model.config


@pytest.mark.parametrize('n_kv_head', [H, 2])
def test_activation_bytes_per_block_full_selective_none(n_kv_head):
    # Reference: what one more block adds, computed from the shapes (fp32, N = B * T tokens).
    # 'full' keeps only the block's input (N, C). 'selective' keeps that input and the outputs of the ops its
    # policy saves: the qkv matmul (N, (H + 2 Hkv) D), attention's output (N, C) and log-sum-exp (B, H, T),
    # the projection (N, C), the MLP's up (N, 2 hidden) and down (N, C) matmuls. 'none' keeps more than both.
    per_block = {}
    for mode in ('none', 'selective', 'full'):
        (two, config), (three, _) = (saved_bytes(n, mode, n_kv_head=n_kv_head) for n in (2, 3))
        per_block[mode] = three - two
    D, hidden = config.head_dim, config.mlp_hidden
    assert per_block['full'] == 4 * N * C
    assert per_block['selective'] == 4 * (N * C + N * (H + 2 * n_kv_head) * D + N * C + B * H * T + N * C
                                          + N * 2 * hidden + N * C)
    assert per_block['none'] > per_block['selective'] > per_block['full']
    totals = [saved_bytes(2, mode, n_kv_head=n_kv_head)[0] for mode in ('full', 'selective', 'none')]
    assert totals == sorted(totals) and len(set(totals)) == 3


def test_the_chunked_loss_saves_the_logits():
    # Reference: the plain loss keeps the fp32 log-probabilities (N, V), the targets (N, int64) and
    # cross-entropy's total weight (a float); the chunked loss keeps the head's gradient (V, C) instead, and the
    # count of tokens not ignored (a float). The head's input that the plain loss keeps and the input gradient
    # that the chunked loss keeps are both (N, C).
    plain, _ = saved_bytes(2, loss_chunk_tokens=0)
    for chunk in (7, 1024):  # chunks that do not divide N, and one chunk for all
        chunked, _ = saved_bytes(2, loss_chunk_tokens=chunk)
        assert plain - chunked == 4 * N * V + 8 * N + 4 - 4 * V * C - 4


def test_activation_bytes_counts_each_storage_once_and_no_weights():
    # Reference: sizes by hand. Views of one storage count once, at the storage's size; a parameter saved
    # for backward counts nothing; a wrapper subclass (as FP8's tensors are) counts its inner tensors.
    from torch.testing._internal.two_tensor import TwoTensor
    layer = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(6, 8, requires_grad=True)

    def forward():
        h = x * 2  # (6, 8), saved by the matmul (with the weight) and, as a view, by the second product
        p = layer(h) * h[:3].repeat(2, 1)  # saves layer(h) and the repeat, each (6, 8)
        return (p * h.view(48)[:8]).sum()  # saves p (6, 8) and a view of h
    _, saved = bench.activation_bytes(layer, forward)
    assert saved == 4 * 6 * 8 * 4  # h once, layer(h), the repeat, p; never the weight
    w = torch.randn(2, 8, requires_grad=True)

    def a_slice():
        big = x.repeat(4, 1)  # (24, 8); the product saves only a view of its first 2 rows, which holds it all
        return (big[:2] * w).sum()  # saves big[:2] and w (2, 8)
    _, saved = bench.activation_bytes(layer, a_slice)
    assert saved == (24 * 8 + 2 * 8) * 4  # big's whole storage, not the (2, 8) view's size
    t, u = (TwoTensor(torch.randn(5, 3), torch.randn(5, 3), requires_grad=True) for _ in range(2))
    _, saved = bench.activation_bytes(layer, lambda: (t * u).sum())
    assert saved == 4 * 5 * 3 * 4  # both operands of the product, each a pair of (5, 3) tensors


def test_activation_bytes_leaves_out_buffers_and_counts_prefer_save(monkeypatch):
    # Reference: sizes by hand. A buffer saved for backward is the model's, not an activation (as a parameter);
    # a selective checkpointing policy that prefers to save an op's output keeps it as one that must does.
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer('scale', torch.randn(6, 8))
    module, x = Scaled(), torch.randn(6, 8, requires_grad=True)
    _, saved = bench.activation_bytes(module, lambda: (x * module.scale).sum())  # saves the buffer only
    assert saved == 0
    _, saved = bench.activation_bytes(module, lambda: (x * module.scale.clone()).sum())  # a copy is an activation
    assert saved == 4 * 6 * 8
    must, _ = saved_bytes(2, 'selective')
    policy, asked = model_module._selective_policy, []

    def prefer(*args, **kwargs):
        decision = policy(*args, **kwargs)
        asked.append(decision)
        return CheckpointPolicy.PREFER_SAVE if decision == CheckpointPolicy.MUST_SAVE else decision
    monkeypatch.setattr(model_module, '_selective_policy', prefer)
    preferred, _ = saved_bytes(2, 'selective')
    assert CheckpointPolicy.MUST_SAVE in asked and preferred == must


TRAIN_FIT = ['--batch_size=8', '--gradient_accumulation_steps=4']


def rope_probe():
    spec = importlib.util.spec_from_file_location('rope_probe', os.path.join(HERE, '.ci', 'rope_probe.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rope_probe_refuses_an_unknown_form(capsys):
    # Reference: its FORMS; a misspelt form in .ci/gpu would cost a step of a lent GPU's time for nothing
    probe = rope_probe()
    assert probe.parse_args(['--only=flip,flip_heads']).only == 'flip,flip_heads'
    with pytest.raises(SystemExit):
        probe.parse_args(['--only=flip,flip_head'])
    assert '--only: no form flip_head' in capsys.readouterr().err


def ci_gpu(tmp_path, part, data=True, libraries=True):
    """.ci/gpu's part run with stand-ins: the script copied into tmp_path (it empties bench_out/ where it lives), a
    python that records its arguments in calls.jsonl (as `python -c`, it answers part d's read of fit.json: batch,
    accumulation; it fails an import of bitsandbytes without `libraries`), nvidia-smi, and a timeout that records
    each step's limit in limits and runs the step. With `data`, an empty data/shakespeare_char/train.bin."""
    os.makedirs(tmp_path / '.ci')
    script = tmp_path / '.ci' / 'gpu'
    script.write_text(open(os.path.join(HERE, '.ci', 'gpu')).read())
    if data:
        os.makedirs(tmp_path / 'data' / 'shakespeare_char')
        (tmp_path / 'data' / 'shakespeare_char' / 'train.bin').write_bytes(b'')
    bin_dir, log = tmp_path / 'bin', tmp_path / 'calls.jsonl'
    os.makedirs(bin_dir)
    (bin_dir / 'python').write_text(f"#!{sys.executable}\nimport json, sys\n"
                                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                                    f"if {not libraries} and 'import bitsandbytes' in sys.argv[-1]: sys.exit(1)\n"
                                    f"print('8 4' if sys.argv[1] == '-c' else '')\n")
    (bin_dir / 'nvidia-smi').write_text('#!/bin/sh\n')
    limits = tmp_path / 'limits'
    (bin_dir / 'timeout').write_text(f'#!/bin/sh\n[ "$1" = -k ] && echo "$3" >> {limits} && shift 3 && exec "$@"\n'
                                     'exit 99\n')  # .ci/gpu calls it as timeout -k 10 LIMIT COMMAND...
    for name in ('python', 'nvidia-smi', 'timeout'):
        os.chmod(bin_dir / name, 0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / 'out'))
    return subprocess.run(['bash', str(script), part], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize('part', 'abcdefghi')
def test_ci_gpu_commands_are_valid_settings(part, tmp_path, monkeypatch):
    # Reference: bench.py's and train.py's own checks. .ci/gpu runs only where a GPU is lent, seldom: a flag
    # renamed or mistyped there would cost a step of that time. Its commands are recorded (ci_gpu's stand-ins)
    # and each one's settings checked; the steps' time limits add up to the 580 s the script promises, so that a
    # part fits one 10-minute device command.
    done = ci_gpu(tmp_path, part)
    log, limits = tmp_path / 'calls.jsonl', tmp_path / 'limits'
    assert done.returncode == 0, done.stderr
    assert os.path.exists(tmp_path / 'out' / f'gpu-{part}.tgz')
    steps = [line for line in done.stdout.splitlines() if ': rc ' in line]  # steps.txt's lines, as .ci/gpu tees them
    assert steps and all(': rc 0 in ' in line for line in steps), done.stdout  # each ran, under its limit
    assert 0 < sum(int(s) for s in open(limits).read().split()) <= 580, open(limits).read()
    with tarfile.open(tmp_path / 'out' / f'gpu-{part}.tgz') as archive:  # steps.txt: a line per step
        assert archive.extractfile(f'{part}/steps.txt').read().decode().splitlines() == steps
    assert len(steps) == len(open(limits).read().split())
    calls = [json.loads(line) for line in open(log)]
    scripts = [c for c in calls if c[0] in ('bench.py', 'train.py', '.ci/rope_probe.py')]
    assert scripts and all(c[0] in ('bench.py', 'train.py', '.ci/rope_probe.py', '-c') or c[:2] == ['-m', 'pytest']
                           for c in calls), calls
    monkeypatch.chdir(HERE)  # config files are named from the repository's root
    assert part != 'd' or ['train.py', *TRAIN_FIT] in [c[:1] + c[-2:] for c in scripts]  # train_fit's run is checked
    for script_name, *argv in scripts:
        if script_name == 'bench.py':
            bench.read_args(argv)
        elif script_name == '.ci/rope_probe.py':
            rope_probe().parse_args(argv)  # an unknown form exits (argparse's error)
        else:
            cfg = SimpleNamespace(**configure(train.DEFAULTS, argv))
            train.check_config(cfg)
            assert train.setting_warnings(cfg, 1) == [], argv  # a setting that changes nothing is a mistake there
    for call in calls:
        if call[:2] == ['-m', 'pytest']:
            assert os.path.exists(os.path.join(HERE, call[-1])), call


@pytest.mark.parametrize('part, data, libraries, message', [
    ('a', False, True, 'no data/shakespeare_char/train.bin: run python prepare_data.py'),
    ('f', True, False, 'part f needs bitsandbytes and torchao'),
    ('d', True, False, 'part d needs bitsandbytes and torchao'),
])
def test_ci_gpu_stops_before_any_step_without_its_data_or_libraries(tmp_path, part, data, libraries, message):
    # Reference: no step ran (no limit recorded, no archive). Without the data bench.py would measure random
    # tokens, whose losses compare nothing; without the libraries the 8-bit and FP8 rungs are skipped
    done = ci_gpu(tmp_path, part, data, libraries)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / 'limits') and not os.path.exists(tmp_path / 'out')
    assert ci_gpu(tmp_path / 'e', 'e', data, libraries).returncode == (0 if data else 2)  # e needs no libraries


def test_a_rung_without_bitsandbytes_is_skipped_with_advice_for_bench(tmp_path, monkeypatch):
    # Reference: train.py's own message for the missing library, less its advice to train with optimizer=adamw,
    # a setting bench.py does not have (a rung's optimizer is the rung's).
    monkeypatch.setitem(sys.modules, 'bitsandbytes', None)  # an import of it fails, as where it is not installed
    with pytest.raises(train.TrainError) as e:
        train.configure_optimizer(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8)),
                                  SimpleNamespace(**{**train.DEFAULTS, 'optimizer': 'adamw8bit'}), 'cpu')
    rung = {r['rung']: r for r in run_ladder(str(tmp_path), '--rungs=11')['rungs']}[11]
    assert rung['status'] == 'skipped' and str(e.value).endswith(', or use optimizer=adamw')
    assert rung['reason'] == str(e.value).removesuffix(', or use optimizer=adamw'), rung['reason']


def test_a_ladder_cut_short_keeps_the_rungs_that_ran(tmp_path, monkeypatch):
    # .ci/gpu cuts a step at its time limit (SIGTERM ends bench.py at once); what ran before must be on disk.
    # Reference: the same rung in a ladder that ran to its end (the same losses, step by step), marked complete
    whole = run_ladder(str(tmp_path / 'whole'), '--rungs=1')
    real, ran = bench.run_rung, []

    def cut_after_one(trial, env):
        if ran:
            raise KeyboardInterrupt  # an exception no rung catches: the process ends here
        ran.append(trial)
        return real(trial, env)
    monkeypatch.setattr(bench, 'run_rung', cut_after_one)
    with pytest.raises(KeyboardInterrupt):
        bench.main([*TINY, f'--out={tmp_path / "cut"}', '--rungs=1,4'])
    with open(tmp_path / 'cut' / 'bench.json') as f:
        cut = json.load(f)
    assert (cut['complete'], whole['complete']) == (False, True)
    assert [(r['rung'], r['status']) for r in cut['rungs']] == [(1, 'ok')]
    assert cut['rungs'][0]['losses'] == whole['rungs'][0]['losses'] and len(whole['rungs'][0]['losses']) > 1
    text = (tmp_path / 'cut' / 'bench.md').read_text()
    assert '- incomplete: the rungs after rung 1 have not run (yet)' in text and '\n| 1 | fp32 eager |' in text
    assert 'incomplete' not in (tmp_path / 'whole' / 'bench.md').read_text()
    assert not list((tmp_path / 'cut').glob('*.tmp'))


def test_an_out_that_cannot_be_written_is_an_error_before_any_measurement(tmp_path, monkeypatch):
    # Reference: the ladder never starts (it wrote its results into out only at the end, after every rung).
    (tmp_path / 'a_file').write_text('x')
    monkeypatch.setattr(bench, 'ladder', lambda env: pytest.fail('measured before out was checked'))
    with pytest.raises(train.TrainError, match=re.escape(f"out {tmp_path / 'a_file'} is a file, not a directory")):
        bench.main([*TINY, f'--out={tmp_path / "a_file"}'])


# ----------------------------------------------------------------------------------------------------
# what a seventh mutation run of bench.py found unchecked (its flags' ranges: test_a_bad_setting_is_a_config_error_
# naming_it): the median and the loss means by hand, each rung's TF32 and autocast as torch reads them, bench.md's and
# the chart's words

def test_only_the_tf32_rungs_run_their_float32_matmuls_on_tf32(monkeypatch):
    # Reference: the docstring's rung 2 (float32 matmuls on TF32 tensor cores) and torch's own setting for it,
    # torch.get_float32_matmul_precision ('high': TF32, 'highest': full float32), read as each step runs, on a
    # made-up GPU (the calls to torch.cuda faked, the model on the CPU, as test_bench's peak-memory test does)
    seen, real_step = [], train.train_step
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda device=None: None)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: None)
    monkeypatch.setattr(torch.cuda, 'empty_cache', lambda: None)
    monkeypatch.setattr(train, 'train_step', lambda *args: seen.append(torch.get_float32_matmul_precision()) or
                        real_step(*args))
    env = bench.setup([*TINY, '--warmup=1', '--steps=1', '--repeats=1'])
    env.device_type = 'cuda'  # (env.device stays the CPU)
    precision = torch.get_float32_matmul_precision()
    try:
        for tf32, want in ((True, 'high'), (False, 'highest'), (True, 'high')):
            seen.clear()
            bench.run_rung({**bench.BASE, 'tf32': tf32}, env)
            assert seen == [want] * 2, tf32  # the warm-up step and the timed one
    finally:
        torch.set_float32_matmul_precision(precision)


def test_the_auto_preset_is_gpt2_on_cuda_only(monkeypatch):
    # Reference: DEFAULTS' comment and the docstring: 'auto' is gpt2 on CUDA, small elsewhere; on a Mac (MPS, faked:
    # train's device check and pick) that is small, not GPT-2's 124M model at 524,288 tokens a step
    monkeypatch.setattr(train, 'check_device', lambda device: None)
    monkeypatch.setattr(train, 'pick_device', lambda device: 'mps')
    env = bench.setup(['--device=mps', '--data_dir=no-such-dir'])
    assert (env.device_type, env.preset) == ('mps', 'small')
    assert {k: getattr(env, k) for k in bench.PRESETS['small']} == bench.PRESETS['small']


def test_loss_means_over_an_odd_number_of_timed_steps_take_the_last_half():
    # Reference: the means by hand. 21 timed steps (e.g. 3 repeats x 7 steps) with losses 1 to 21 and three times
    # that: the last half is the last 10 (21 // 2), 12 to 21, mean 16.5, and 49.5 (+200%); steps 11 to 21, or a sum
    # of 11 losses over 10, would be another figure.
    rows = [dict(rung=1, status='ok', losses=[float(i) for i in range(1, 22)]),
            dict(rung=4, status='ok', losses=[3.0 * i for i in range(1, 22)])]
    assert bench.loss_means(rows) == ('loss, mean of the last 10 of the 21 timed steps: rung 1 16.50000; rung 4 '
                                      '49.50000 (+200.00% against rung 1)')


def test_the_report_states_its_timing_and_its_mb_as_mib():
    # Reference: the run's flags, as the docstring words a rung's timing ('warmup' steps untimed, then the median of
    # `repeats` timings of `steps` steps: 5 timings of 2 steps here); the columns' figures are bytes / 2**20
    # (test_bench's test_memory_figures_are_in_mib): the report must say so, or its 'MB' reads as 10^6 bytes
    env = bench.setup([*TINY, '--warmup=1', '--steps=2', '--repeats=5'])
    md = bench.markdown([], env.meta)
    assert '- timing: median of 5 x 2 steps after 1 warm-up steps;' in md
    assert '; MB: 2^20 bytes;' in md and '| peak mem MB | activations MB | opt. state MB |' in md


def test_the_precision_column_names_tf32(monkeypatch):
    # Reference: the docstring's rung 2 (float32 matmuls on TF32 tensor cores) and the precisions by hand: TF32 is
    # named wherever the rung's float32 matmuls use it, rung 2 listed so where it is skipped (the CPU) too
    rows, _, _ = stand_in_ladder(monkeypatch)
    by = {r['rung']: r for r in rows}
    assert (by[1]['precision'], by[2]['precision']) == ('fp32', 'fp32 (TF32 matmuls)')
    tf32 = {**bench.BASE, 'tf32': True}
    assert bench.precision(tf32, 'rowwise') == 'fp32 (TF32 matmuls)'
    assert bench.precision({**tf32, 'optimizer': 'adamw8bit'}, 'rowwise') == 'fp32 (TF32 matmuls), 8-bit AdamW'
    assert bench.precision({**tf32, 'dtype': 'bfloat16', 'fp8': True}, 'rowwise') == 'bf16 autocast + FP8 linears ' \
                                                                                      '(rowwise)'


def test_threads_0_keeps_torchs_own_count():
    # Reference: DEFAULTS' comment ('threads: torch's CPU threads; 0: its default'): torch's count as it was before
    # setup, here 2 (set by hand), not 1 or any other
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        env = bench.setup(TINY)
        assert env.threads == 0 and torch.get_num_threads() == 2 and env.meta['device'].endswith(', 2 threads')
    finally:
        torch.set_num_threads(threads)


def test_an_incomplete_report_names_the_last_rung_it_has(monkeypatch):
    # Reference: the rows as the ladder saved them after its fifth rung (rungs 1 to 5, two of them skipped on the
    # CPU): the rungs after rung 5 have not run; the first row's rung (1) would be wrong
    rows, _, env = stand_in_ladder(monkeypatch)
    md = bench.markdown(rows[:5], {**env.meta, 'complete': False})
    assert '\n- incomplete: the rungs after rung 5 have not run (yet)\n' in md
    assert 'incomplete' not in bench.markdown(rows, {**env.meta, 'complete': True})


def test_bench_md_names_torch_and_its_table_is_well_formed(monkeypatch):
    # Reference: the docstring (bench.md records device, torch, ...: the torch that ran it, torch.__version__) and
    # GitHub's table syntax: the delimiter row has one cell for each header cell, or the table is not rendered
    rows, _, env = stand_in_ladder(monkeypatch)
    lines = bench.markdown(rows, env.meta).splitlines()
    assert f"- device: {env.meta['device']}; torch {torch.__version__}" in lines
    header = next(i for i, ln in enumerate(lines) if ln.startswith('| # |'))
    cells = [ln.strip('|').split('|') for ln in lines[header:header + 2 + len(rows)]]
    assert all(re.fullmatch(r'-+:?', c) for c in cells[1]), lines[header + 1]  # the delimiter row
    assert [len(c) for c in cells] == [len(bench.COLUMNS) + 4] * (2 + len(rows))


def test_the_skip_reasons_say_why_and_the_advice_they_give_works(monkeypatch):
    # Reference: the docstring's ladder (rung 2: TF32 tensor cores, CUDA only; rung 3: as train.pick_dtype chooses,
    # off on the CPU unless --dtype=bfloat16) and train.pick_dtype's own reason; the advice checked by following it:
    # with --dtype=bfloat16 rung 3 runs
    rows, _, env = stand_in_ladder(monkeypatch)
    by = {r['rung']: r for r in rows}
    assert by[2]['status'] == by[3]['status'] == 'skipped'
    assert 'CUDA only' in by[2]['reason'] and 'TF32' in by[2]['reason']
    assert by[3]['reason'].startswith(train.pick_dtype('auto', 'cpu')[1]) and '--dtype=bfloat16' in by[3]['reason']
    rows, _, _ = stand_in_ladder(monkeypatch, '--dtype=bfloat16')
    assert {r['rung']: r['status'] for r in rows}[3] == 'ok'


def test_each_rung_computes_under_the_autocast_of_its_dtype(monkeypatch):
    # Reference: torch's own autocast state (torch.is_autocast_enabled, torch.get_autocast_dtype), read in every
    # forward of the rung (its steps and the micro-step that counts the activations): none for float32, bf16 for
    # the bf16 rung, fp16 for the fp16 one (the docstring's rung 3: fp16 + GradScaler)
    seen, real_forward = [], GPT.forward
    monkeypatch.setattr(GPT, 'forward', lambda self, *a, **k: seen.append(
        torch.get_autocast_dtype('cpu') if torch.is_autocast_enabled('cpu') else None) or real_forward(self, *a, **k))
    env = bench.setup([*TINY, '--warmup=1', '--steps=1', '--repeats=1'])
    for dtype, want in (('float32', None), ('bfloat16', torch.bfloat16), ('float16', torch.float16)):
        seen.clear()
        bench.run_rung({**bench.BASE, 'dtype': dtype}, env)
        assert seen == [want] * 3, dtype  # the warm-up step, the timed one, the counted micro-step


def test_the_chart_names_its_run_and_why_peak_memory_is_empty_off_cuda(monkeypatch, tmp_path):
    # Reference: the docstring: bench.png, like bench.json and bench.md, records device, torch, model, batch, date
    # and command line (the meta's own values, in its title); peak memory is n/a on the CPU (no figure: its panel is
    # bars of 0), which the panel's label says, on CUDA the plain label
    pytest.importorskip('matplotlib')
    import matplotlib.axes
    import matplotlib.figure
    said = []
    for cls, name in ((matplotlib.axes.Axes, 'set_xlabel'), (matplotlib.figure.Figure, 'suptitle')):
        monkeypatch.setattr(cls, name, lambda self, text, *a, real=getattr(cls, name), name=name, **kw: said.append(
            (name, text)) or real(self, text, *a, **kw))
    rows, _, env = stand_in_ladder(monkeypatch)
    meta = env.meta
    for device_type, want in (('cpu', 'peak memory (MB): n/a on cpu'), ('cuda', 'peak memory (MB)')):
        said.clear()
        bench.plot(rows, {**meta, 'device_type': device_type}, str(tmp_path / f'{device_type}.png'))
        assert [text for name, text in said if name == 'set_xlabel'][1] == want, device_type
        assert [text.splitlines() for name, text in said if name == 'suptitle'] == [[
            f"{meta['device']}, torch {torch.__version__}, {meta['params'] / 1e6:.2f}M params, "
            f"{meta['tokens_per_iter']:,} tokens/iter, {meta['date']}", meta['command']]]
