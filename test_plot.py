"""
Tests for plot.py and for what train.py logs besides metrics.jsonl: out_dir/metrics.png, redrawn at each
evaluation, and Weights & Biases (offline). References: the records of metrics.jsonl, read here without
plot.py; the PNG file format; the records in wandb's own run file.

    python -m pytest -q test_plot.py
"""
import builtins
import glob
import json
import os
import re
import struct
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import plot
import train
from configurator import ConfigError
from conftest import read_metrics, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ['--device=cpu', '--dtype=float32', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
        '--batch_size=4', '--eval_iters=2', '--log_interval=1', '--warmup_iters=2', '--learning_rate=1e-2']
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'

RECORDS = [  # what train.py writes: evaluations and training lines (mfu is null on a CPU)
    {'iter': 0, 'tokens': 0, 'train_loss': 3.7, 'val_loss': 3.71},
    {'iter': 1, 'tokens': 32, 'loss': 3.69, 'grad_norm': 2.5, 'lr': 1e-3, 'tokens_per_sec': 900.0, 'mfu': None,
     'peak_mem_mb': 1.0},
    {'iter': 2, 'tokens': 64, 'loss': 3.5, 'grad_norm': 1.25, 'lr': 2e-3, 'tokens_per_sec': 1000.0, 'mfu': None,
     'peak_mem_mb': 1.5},
    {'iter': 2, 'tokens': 64, 'train_loss': 3.4, 'val_loss': 3.45},
    # an older file: no tokens, no grad_norm
    {'iter': 3, 'loss': 3.3, 'lr': 1.5e-3, 'tokens_per_sec': 1100.0, 'mfu': 0.1, 'peak_mem_mb': 2.0},
]


def tiny_data(root):
    ids = np.random.default_rng(0).integers(0, 40, 2400)
    return write_dataset(root / 'data', ids[:2000], ids[2000:], 40)


def png_size(path):
    """(width, height) from the PNG header; an error if the file is not a PNG."""
    with open(path, 'rb') as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b'IHDR', f"{path} is not a PNG"
    return struct.unpack('>II', head[16:24])


def write_metrics(out_dir, records):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    return str(out_dir)


def line_data(ax, label):
    lines = [ln for ln in ax.lines if ln.get_label() == label]
    assert len(lines) == 1, [ln.get_label() for ln in ax.lines]
    return list(lines[0].get_xdata()), list(lines[0].get_ydata())

# ----------------------------------------------------------------------------------------------------
# plot.py


def test_series_are_the_records_fields():
    # reference: each field's records picked out by hand
    curves = plot.series(RECORDS)
    assert sorted(curves) == ['grad_norm', 'loss', 'lr', 'peak_mem_mb', 'tokens_per_sec', 'train_loss', 'val_loss']
    assert curves['loss'] == ([1, 2, 3], [32, 64, None], [3.69, 3.5, 3.3])
    assert curves['val_loss'] == ([0, 2], [0, 64], [3.71, 3.45])
    assert curves['train_loss'] == ([0, 2], [0, 64], [3.7, 3.4])
    assert curves['lr'] == ([1, 2, 3], [32, 64, None], [1e-3, 2e-3, 1.5e-3])
    assert curves['tokens_per_sec'][2] == [900.0, 1000.0, 1100.0]
    assert curves['grad_norm'] == ([1, 2], [32, 64], [2.5, 1.25]) and curves['peak_mem_mb'][2] == [1.0, 1.5, 2.0]
    # zeros are values (a schedule that starts or ends at lr 0); only null is left out
    zeros = plot.series([{'iter': 0, 'tokens': 0, 'loss': 0.0, 'lr': 0.0, 'tokens_per_sec': 0.0}])
    assert zeros == {k: ([0], [0], [0.0]) for k in ('loss', 'lr', 'tokens_per_sec')}
    # a null is no point (a grad norm that was not finite, a step's loss left out): the curve goes on around it
    nulls = plot.series([{'iter': 1, 'tokens': 8, 'loss': 3.9, 'grad_norm': None},
                         {'iter': 2, 'tokens': 16, 'loss': None, 'grad_norm': 1.5},
                         {'iter': 3, 'tokens': 24, 'loss': 3.7, 'grad_norm': None}])
    assert nulls == {'loss': ([1, 3], [8, 24], [3.9, 3.7]), 'grad_norm': ([2], [16], [1.5])}


def test_cli_overlays_runs_in_one_png(tmp_path, monkeypatch, capsys):
    other = [dict(r, **{k: v * 2 for k, v in r.items() if 'loss' in k}) for r in RECORDS]
    a, b = write_metrics(tmp_path / 'run_a', RECORDS), write_metrics(tmp_path / 'run_b', other)
    out = tmp_path / 'compare.png'
    figures, draw = [], plot.draw
    monkeypatch.setattr(plot, 'draw', lambda runs, path, **k: figures.append(draw(runs, path, **k)) or figures[-1])
    plot.main([a, b + '/', f'--out={out}'])
    assert f'wrote {out}' in capsys.readouterr().out
    assert png_size(out) == (1200, 640) and sorted(os.listdir(tmp_path)) == ['compare.png', 'run_a', 'run_b']
    # the figure's curves are the files' records: the losses by iteration (with the run's name) and by tokens; the
    # gradient norm, lr, tokens/s and peak memory by iteration
    by_iter, by_tokens, norm, lr, speed, memory = figures[0].axes
    for run, records in ((a, RECORDS), (b, other)):
        for field in plot.LOSSES:  # each loss curve by iteration, and by tokens (found by its values) in its color
            rows = [r for r in records if field in r]
            [it] = [ln for ln in by_iter.lines if ln.get_label() == f'{run}: {field}']
            assert (list(it.get_xdata()), list(it.get_ydata())) == ([r['iter'] for r in rows], [r[field] for r in rows])
            known = [r for r in rows if 'tokens' in r]
            [tok] = [ln for ln in by_tokens.lines if list(ln.get_ydata()) == [r[field] for r in known]]
            assert list(tok.get_xdata()) == [r['tokens'] for r in known] and tok.get_color() == it.get_color(), field
        for ax, field in ((norm, 'grad_norm'), (lr, 'lr'), (speed, 'tokens_per_sec'), (memory, 'peak_mem_mb')):
            rows = [r for r in records if field in r]
            assert line_data(ax, run) == ([r['iter'] for r in rows], [r[field] for r in rows]), field
    # each run in one color of its own, in every panel
    colors = {run: {ln.get_color() for ax in figures[0].axes for ln in ax.lines if ln.get_label().startswith(run)}
              for run in (a, b)}
    assert all(len(c) == 1 for c in colors.values()) and colors[a] != colors[b], colors
    assert [ax.get_xlabel() for ax in figures[0].axes] == ['iteration', 'tokens'] + ['iteration'] * 4
    assert [ax.get_title() for ax in figures[0].axes] == [
        'loss vs iteration', 'loss vs tokens', 'gradient norm vs iteration', 'learning rate vs iteration',
        'tokens/s vs iteration', 'peak memory (MB) vs iteration']
    assert [ax.get_yscale() for ax in figures[0].axes] == ['linear'] * 2 + ['log'] + ['linear'] * 3
    tokens_lines = {tuple(ln.get_ydata()): list(ln.get_xdata()) for ln in by_tokens.lines}
    assert tokens_lines[(3.71, 3.45)] == [0, 64] and tokens_lines[(3.69, 3.5)] == [32, 64]  # no tokens: left out
    # the legend: each run's loss fields, by the run's normalised name (b was given as b/)
    assert [t.get_text() for t in by_iter.get_legend().get_texts()] == \
        [f'{os.path.normpath(run)}: {field}' for run in (a, b) for field in ('loss', 'train_loss', 'val_loss')]


def test_bpb_draws_the_bits_per_byte_in_place_of_the_losses(tmp_path, monkeypatch, capsys):
    # Reference: the records' train_bpb and val_bpb, picked out by hand: with --bpb the first two panels hold them
    # (by iteration, with the run's name, and by tokens), titled so, and no loss; the other panels are unchanged.
    # A run whose metrics.jsonl holds no bits per byte (an older run) is an error naming the file, before drawing.
    records = [dict(r, train_bpb=r['train_loss'] * 1.4, val_bpb=r['val_loss'] * 1.5) if 'val_loss' in r else r
               for r in RECORDS]
    a, out = write_metrics(tmp_path / 'a', records), tmp_path / 'bpb.png'
    figures, draw = [], plot.draw
    monkeypatch.setattr(plot, 'draw', lambda runs, path, **k: figures.append(draw(runs, path, **k)) or figures[-1])
    plot.main([a, '--bpb', f'--out={out}'])
    by_iter, by_tokens, norm, *_ = figures[0].axes
    for field in ('train_bpb', 'val_bpb'):
        rows = [r for r in records if field in r]
        assert line_data(by_iter, f'{a}: {field}') == ([r['iter'] for r in rows], [r[field] for r in rows])
        [tok] = [ln for ln in by_tokens.lines if list(ln.get_ydata()) == [r[field] for r in rows]]
        assert list(tok.get_xdata()) == [r['tokens'] for r in rows]
    assert len(by_iter.lines) == len(by_tokens.lines) == 2 and png_size(out) == (1200, 640)
    assert [ax.get_title() for ax in figures[0].axes[:3]] == [
        'bits per byte vs iteration', 'bits per byte vs tokens', 'gradient norm vs iteration']
    assert line_data(norm, a) == ([1, 2], [2.5, 1.25])
    old, young, out = (write_metrics(tmp_path / 'old', RECORDS), write_metrics(tmp_path / 'young', RECORDS[1:3]),
                       tmp_path / 'none.png')
    for run, why in ((old, "the run's report says why ('bits per byte: not reported'), or it predates them"),
                     (young, "the run has not evaluated yet")):  # training lines only, so far
        with pytest.raises(SystemExit) as e:
            plot.main([a, run, '--bpb', f'--out={out}'])
        assert e.value.code == 1 and not out.exists() and len(figures) == 1
        assert (f"plot.py: error: --bpb: {os.path.join(run, 'metrics.jsonl')} holds no bits per byte: {why}\n"
                == capsys.readouterr().err)


def test_a_single_evaluation_is_drawn_as_visible_points(tmp_path):
    # Reference: matplotlib draws a line through one point as nothing unless it has a marker: each evaluation
    # curve of a run with one evaluation has one, of a size above 0, by iteration and by tokens; so does every
    # curve of a run with one training line (its loss, gradient norm, learning rate, tokens/s, peak memory: their
    # panels looked empty), and a curve of several points keeps its plain line
    def markers(lines):
        return [ln.get_marker() not in ('None', 'none', '', ' ', None) and ln.get_markersize() > 0 for ln in lines]
    fig = plot.draw({'run': RECORDS[:1]}, str(tmp_path / 'one.png'))
    lines = fig.axes[0].lines + fig.axes[1].lines
    assert sorted(list(ln.get_ydata()) for ln in lines) == [[3.7], [3.7], [3.71], [3.71]]
    assert all(markers(lines))
    fig = plot.draw({'run': RECORDS[:2]}, str(tmp_path / 'one.png'))
    lines = [ln for ax in fig.axes for ln in ax.lines]
    assert sorted(list(ln.get_ydata()) for ln in lines) == sorted(
        [[3.7], [3.7], [3.71], [3.71], [3.69], [3.69], [2.5], [1e-3], [900.0], [1.0]])
    assert all(markers(lines))
    fig = plot.draw({'run': RECORDS}, str(tmp_path / 'all.png'))
    assert not any(markers(fig.axes[0].lines[:1] + [ln for ax in fig.axes[2:] for ln in ax.lines]))  # (loss first)


def test_a_metrics_file_given_itself_and_blank_lines_are_read(tmp_path, capsys):
    # Reference: the records as written. A run named by its metrics.jsonl, not its out_dir (it read
    # out/metrics.jsonl/metrics.jsonl), plots as its out_dir does; a blank line (an editor's, a concatenation's)
    # is no record and no error
    run = write_metrics(tmp_path / 'run', [])
    with open(os.path.join(run, 'metrics.jsonl'), 'w') as f:
        f.write(json.dumps(RECORDS[0]) + '\n\n' + ''.join(json.dumps(r) + '\n' for r in RECORDS[1:]) + '\n')
    path = os.path.join(run, 'metrics.jsonl')
    assert plot.read_metrics(run) == plot.read_metrics(path) == RECORDS
    plot.main([path, f'--out={tmp_path / "x.png"}'])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'x.png'}: {path}\n"
    with pytest.raises(SystemExit):
        plot.main([path, '--bpb', f'--out={tmp_path / "y.png"}'])
    assert f"--bpb: {path} holds no bits per byte" in capsys.readouterr().err


def test_missing_or_empty_metrics_are_errors_naming_them(tmp_path, capsys):
    good = write_metrics(tmp_path / 'good', RECORDS)
    empty = write_metrics(tmp_path / 'empty', [])
    for bad, message in ((str(tmp_path / 'nothing'), 'not found'), (empty, 'is empty')):
        with pytest.raises(SystemExit) as e:
            plot.main([good, bad, f'--out={tmp_path / "x.png"}'])
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert f"plot.py: error: {os.path.join(bad, 'metrics.jsonl')} " in err and message in err
    assert not (tmp_path / 'x.png').exists()
    with open(os.path.join(good, 'metrics.jsonl'), 'a') as f:
        f.write('{"iter": 4, "lo')  # a line being written: left out
    assert plot.read_metrics(good) == RECORDS
    with open(os.path.join(good, 'metrics.jsonl'), 'a') as f:
        f.write('ss": 1\n{"iter": 5}\n')
    with pytest.raises(ValueError, match=r'metrics\.jsonl, line 6: not a JSON record'):
        plot.read_metrics(good)
    binary = write_metrics(tmp_path / 'binary', RECORDS)  # bytes that are not UTF-8 (it was a UnicodeDecodeError
    with open(os.path.join(binary, 'metrics.jsonl'), 'ab') as f:  # naming no file)
        f.write(b'\xff\xfe\n')
    with pytest.raises(ValueError, match=rf'metrics\.jsonl, line {len(RECORDS) + 1}: not a JSON record'):
        plot.read_metrics(binary)
    for line in ('[1, 2]', '{"loss": 1.0}'):  # JSON, but not a record of train.py
        odd = write_metrics(tmp_path / 'odd', [])
        with open(os.path.join(odd, 'metrics.jsonl'), 'w') as f:
            f.write(json.dumps(RECORDS[0]) + '\n' + line + '\n')
        with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2: not a record of train\.py"):
            plot.read_metrics(odd)


def test_a_json_string_holding_bytes_that_are_not_utf8_is_not_a_record(tmp_path):
    # Reference: json.loads of the line's bytes, which refuses them (RFC 8259: JSON text is UTF-8); read as text with
    # U+FFFD in their place, the line would pass as a record. A bad line inside the file, not a last line being written
    odd = write_metrics(tmp_path / 'odd', [])
    bad = b'{"iter": 1, "note": "caf\xe9"}\n'
    with pytest.raises(ValueError):
        json.loads(bad)
    with open(os.path.join(odd, 'metrics.jsonl'), 'wb') as f:
        f.write(json.dumps(RECORDS[0]).encode() + b'\n' + bad + json.dumps(RECORDS[1]).encode() + b'\n')
    message = f"{os.path.join(odd, 'metrics.jsonl')}, line 2: not a JSON record: {bad.decode('utf-8', 'replace')!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        plot.read_metrics(odd)


def test_metrics_that_cannot_be_read_are_an_error_naming_them_and_training_goes_on(tmp_path, monkeypatch):
    # Reference: the errno's own words (os.strerror); plot's open refuses metrics.jsonl, as chmod cannot for root.
    # The error was a PermissionError traceback out of plot.read_metrics, and out of train.py's drawing
    refused, real_open = [], builtins.open

    def refusing_open(path, mode='r', *args, **kwargs):
        if os.path.basename(path) == 'metrics.jsonl' and mode == 'rb':
            refused.append(path)
            raise PermissionError(13, os.strerror(13))
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr(plot, 'open', refusing_open, raising=False)
    good = write_metrics(tmp_path / 'good', RECORDS)
    with pytest.raises(ValueError, match=re.escape(f"{os.path.join(good, 'metrics.jsonl')} cannot be read: "
                                                   f"{os.strerror(13)}")):
        plot.read_metrics(good)
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    assert train.main(TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=2']) == 0
    assert len(refused) == 2 and read_metrics(out)[-1]['iter'] == 2 and not (out / 'metrics.png').exists()


def test_cli_errors_name_what_the_user_gave(tmp_path, capsys):
    # a PNG that cannot be written names the --out path given (not its .tmp), a run given twice is an error
    good = write_metrics(tmp_path / 'good', RECORDS)
    unwritable, png = tmp_path / 'no-dir' / 'x.png', tmp_path / 'x.png'
    for args, message in (([good, f'--out={unwritable}'], f'plot.py: error: cannot write {unwritable}: '),
                          ([good, good + '/', f'--out={png}'], f'plot.py: error: {good}/ is given twice')):
        with pytest.raises(SystemExit) as e:
            plot.main(args)
        assert e.value.code == 1 and message in capsys.readouterr().err
    assert not (tmp_path / 'x.png').exists()


def test_cli_writes_the_format_of_the_out_extension(tmp_path, capsys):
    # Reference: each format's file signature (a PDF named .pdf held PNG bytes); an extension matplotlib cannot
    # write is an error naming it, before anything is written
    good = write_metrics(tmp_path / 'good', RECORDS)
    for name, signature in (('a.pdf', b'%PDF'), ('a.svg', b'<?xml'), ('a.PNG', PNG_SIGNATURE), ('a', PNG_SIGNATURE)):
        plot.main([good, f'--out={tmp_path / name}'])
        with open(tmp_path / name, 'rb') as f:
            assert f.read(len(signature)) == signature, name
    for name in ('a.xyz', 'a.pgf'):  # (matplotlib writes pgf only where LaTeX is installed: a traceback otherwise)
        with pytest.raises(SystemExit) as e:
            plot.main([good, f'--out={tmp_path / name}'])
        assert e.value.code == 1
        fmt = name.split('.')[1]
        assert f"plot.py: error: --out={tmp_path / name}: plot.py writes no '{fmt}' images" in capsys.readouterr().err
        assert not (tmp_path / name).exists()
    with pytest.raises(SystemExit):  # before the runs are read: a run that is not there is not the error named
        plot.main([str(tmp_path / 'nothing'), f'--out={tmp_path / "a.xyz"}'])
    assert "writes no 'xyz' images" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# train.py: metrics.png


def test_training_redraws_metrics_png_at_each_evaluation(tmp_path, monkeypatch):
    # evaluations at 0 and 2, then the end at 3: three drawings, each of metrics.jsonl as it was then
    monkeypatch.setattr(train, 'PLOT_EVERY_S', 0)  # evaluations a few ms apart may all redraw
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    drawn, draw = [], plot.draw

    def spy(runs, path):
        fig = draw(runs, path)
        drawn.append((runs, read_metrics(out), open(path, 'rb').read(), fig.axes[0]))
        return fig
    monkeypatch.setattr(plot, 'draw', spy)
    assert train.main(TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=3']) == 0
    assert [records[-1]['iter'] for _, records, _, _ in drawn] == [0, 2, 3]
    for runs, records, png, by_iter in drawn:
        assert runs == {str(out): records}  # the whole file, as it stood
        evals = [r for r in records if 'val_loss' in r]
        assert line_data(by_iter, f'{out}: val_loss') == ([r['iter'] for r in evals], [r['val_loss'] for r in evals])
    pngs = [png for _, _, png, _ in drawn]
    assert all(png.startswith(PNG_SIGNATURE) for png in pngs) and len(set(pngs)) == 3  # redrawn each time
    assert (out / 'metrics.png').read_bytes() == pngs[-1] and not (out / 'metrics.png.tmp').exists()
    records = read_metrics(out)
    assert [r['tokens'] for r in records] == [r['iter'] * 4 * 8 for r in records]  # batch 4 x block 8


def test_failed_plot_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    # a full disk while the PNG is written: half a file, then an error
    from matplotlib.figure import Figure

    def savefig(self, path, **kwargs):
        with open(path, 'wb') as f:
            f.write(PNG_SIGNATURE)
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(Figure, 'savefig', savefig)
    monkeypatch.setattr(train, 'PLOT_EVERY_S', 0)
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    assert train.main(TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=3']) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if 'warning' in ln]
    assert warnings == [f"warning: could not draw {out / 'metrics.png'} (OSError: [Errno 28] No space left on "
                        f"device); training goes on"] * 3  # evaluations at 0 and 2, the end at 3
    assert sorted(os.listdir(out)) == ['best.pt', 'ckpt.pt', 'metrics.jsonl']  # no half-written PNG
    assert read_metrics(out)[-1]['iter'] == 3 and train.load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 3


def test_fast_evaluations_redraw_at_most_every_plot_every_s(tmp_path, monkeypatch):
    # evaluations at 0, 2, 4 within PLOT_EVERY_S of the start: one drawing, at the end, of every record;
    # a second run from scratch moves the first one's plot aside with its other files
    monkeypatch.setattr(train, 'PLOT_EVERY_S', 3600)  # however slow the machine: the default is 30
    drawn, draw = [], plot.draw
    monkeypatch.setattr(plot, 'draw', lambda runs, path: drawn.append(runs) or draw(runs, path))
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    flags = TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=5']
    assert train.main(flags) == 0
    assert drawn == [{str(out): read_metrics(out)}] and read_metrics(out)[-1]['iter'] == 5
    first = (out / 'metrics.png').read_bytes()
    assert train.main(flags + ['--seed=2']) == 0
    [previous] = glob.glob(str(out / 'previous-*'))
    assert open(os.path.join(previous, 'metrics.png'), 'rb').read() == first


def test_plot_metrics_redraws_once_its_last_drawing_is_plot_every_s_old(tmp_path, monkeypatch):
    # Reference: a clock by hand, PLOT_EVERY_S 30 from a start at 0: evaluations at 31 (30 s since the start: a
    # drawing), 32 (1 s since it: none), 62 (31 s: a drawing), 70 (8 s: none), then the last (final: a drawing)
    monkeypatch.setattr(train, 'PLOT_EVERY_S', 30)
    clock = [0.0]
    monkeypatch.setattr(train.time, 'time', lambda: clock[0])
    drawn = []
    monkeypatch.setattr(plot, 'draw', lambda runs, path: drawn.append(clock[0]))
    monkeypatch.setattr(plot, 'read_metrics', lambda out_dir: [{'iter': 0, 'loss': 1.0}])
    r = SimpleNamespace(master=True, plotted_at=0.0, cfg=SimpleNamespace(out_dir=str(tmp_path)),
                        plot_path=str(tmp_path / 'metrics.png'))
    for t in (31, 32, 62, 70):
        clock[0] = t
        train.plot_metrics(r)
    clock[0] = 71
    train.plot_metrics(r, final=True)
    assert drawn == [31, 62, 71]


# ----------------------------------------------------------------------------------------------------
# train.py: wandb, and what train.py imports


def run_python(code, env=None, timeout=120):
    proc = subprocess.run([sys.executable, '-c', code], cwd=HERE, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS='1', **(env or {})))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_train_imports_wandb_only_when_wandb_log_is_on(tmp_path, monkeypatch):
    # every import statement that runs during a training run with wandb_log=False (the default)
    imported, real_import = [], builtins.__import__

    def record_import(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, '__import__', record_import)
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    assert train.main(TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=2']) == 0
    assert 'plot' in imported and not [name for name in imported if name.split('.')[0] == 'wandb']


def test_plot_and_a_training_run_work_without_matplotlib(tmp_path):
    # Reference: the records of metrics.jsonl as written (RECORDS) and as read here with json; matplotlib made
    # unimportable (None in sys.modules), as where it is not installed: plot imports and reads without it, and the
    # run's drawing is one warning (train.py imports plot outside its try block)
    data, out, good = tiny_data(tmp_path), tmp_path / 'out', write_metrics(tmp_path / 'good', RECORDS)
    flags = TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=2']
    blocked = ['matplotlib', 'matplotlib.pyplot', 'matplotlib.figure', 'matplotlib.backends',
               'matplotlib.backends.backend_agg', 'matplotlib.backend_bases']
    proc = run_python(f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\nimport plot, train\n"
                      f"assert plot.read_metrics({good!r}) == {RECORDS!r}\nassert train.main({flags!r}) == 0\n"
                      f"print(plot.read_metrics({str(out)!r}))")
    warnings = [ln for ln in proc.stderr.splitlines() if 'could not draw' in ln]
    assert warnings == [f"warning: could not draw {out / 'metrics.png'} (ModuleNotFoundError: import of matplotlib."
                        f"backends.backend_agg halted; None in sys.modules); training goes on"], proc.stderr[-3000:]
    records = read_metrics(out)
    assert [(r['iter'], 'val_loss' in r) for r in records] == [(0, True), (1, False), (2, False), (2, True)]
    assert proc.stdout.splitlines()[-1] == repr(records) and not (out / 'metrics.png').exists()


def read_wandb_records(path):
    """The records of a .wandb run file: wandb's LevelDB-style log (a 7-byte header, then 32 KiB blocks of
    records, each with a 7-byte header: CRC, length, type; types 2-4 are the first, middle and last parts of a
    record split across blocks) of wandb_internal Record protobufs."""
    from wandb.proto import wandb_internal_pb2
    with open(path, 'rb') as f:
        data = f.read()
    assert data[:4] == b':W&B', f"{path} is not a wandb run file"
    records, pos, part = [], 7, b''
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        if kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            records.append(wandb_internal_pb2.Record.FromString(part))
            part = b''
    return records


def test_wandb_offline_logs_the_records_of_metrics_jsonl(tmp_path):
    pytest.importorskip('wandb')
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    flags = TINY + [f'--data_dir={data}', f'--out_dir={out}', '--eval_interval=2', '--max_iters=3',
                    '--wandb_log=True', '--wandb_run_name=tiny-offline', '--wandb_project=gpt-tests']
    run_python(f"import sys, train\n"
               f"assert 'wandb' not in sys.modules and 'matplotlib' not in sys.modules  # nothing slow at start-up\n"
               f"assert train.main({flags!r}) == 0",
               env={'WANDB_MODE': 'offline', 'WANDB_DIR': str(tmp_path), 'WANDB_SILENT': 'true'})
    [run_file] = glob.glob(str(tmp_path / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
    records = read_wandb_records(run_file)
    history = [{item.key or '.'.join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof('record_type') == 'history']
    logged = [{k: v for k, v in row.items() if not k.startswith('_')} for row in history]
    assert logged == read_metrics(out) and len(logged) == 6  # evaluations at 0, 2, 3 (the end); training 1, 2, 3
    [run] = [r.run for r in records if r.WhichOneof('record_type') == 'run']
    assert (run.project, run.display_name) == ('gpt-tests', 'tiny-offline')
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config['n_embd'] == 16 and config['wandb_log'] is True


def test_wandb_that_cannot_start_a_run_is_an_error_without_a_traceback(tmp_path):
    # Reference: wandb itself, online without an API key (a HOME of its own, no login; it refuses at once, offline).
    # It was wandb's traceback; now train.py's one-line error with wandb's own words and the ways out
    pytest.importorskip('wandb')
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    env = {k: v for k, v in os.environ.items() if not k.startswith('WANDB_')}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path), OMP_NUM_THREADS='1')
    proc = subprocess.run([sys.executable, 'train.py', *TINY, f'--data_dir={data}', f'--out_dir={out}',
                           '--wandb_log=True'], cwd=HERE, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("train.py: error: wandb_log=True: wandb could not start a run: No API key "), \
        proc.stderr[-3000:]
    assert "`wandb login`; WANDB_MODE=offline" in proc.stderr


def test_wandb_only_in_process_0_and_imported_only_when_on(monkeypatch):
    calls = []
    fake = SimpleNamespace(init=lambda **kwargs: calls.append(kwargs) or 'run')
    monkeypatch.setitem(sys.modules, 'wandb', fake)
    cfg = SimpleNamespace(wandb_log=True, wandb_project='p', wandb_run_name='')
    assert train.start_wandb(SimpleNamespace(cfg=cfg, master=False)) is None and calls == []
    assert train.start_wandb(SimpleNamespace(cfg=cfg, master=True)) == 'run'
    assert calls == [dict(project='p', name=None, config=vars(cfg))]
    monkeypatch.setitem(sys.modules, 'wandb', None)  # any import of wandb now fails
    off = SimpleNamespace(wandb_log=False, wandb_project='p', wandb_run_name='')
    assert train.start_wandb(SimpleNamespace(cfg=off, master=True)) is None


def test_wandb_log_without_wandb_is_an_error_before_training(tmp_path, monkeypatch):
    find_spec = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'wandb' else find_spec(name, *a))
    data, out = tiny_data(tmp_path), tmp_path / 'out'
    with pytest.raises(ConfigError, match=r'wandb_log=True needs wandb: `pip install wandb`'):
        train.main(TINY + [f'--data_dir={data}', f'--out_dir={out}', '--wandb_log=True'])
    assert not out.exists()
