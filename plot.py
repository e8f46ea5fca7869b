"""
Plot training runs from their out_dir/metrics.jsonl: train and val loss (with --bpb: the evaluations' bits per
byte, which compare runs with different tokenizers) against iterations and against tokens; the gradient norm, the
learning rate, tokens/s and peak memory against iterations. train.py draws out_dir/metrics.png with it at its
evaluations; on the command line it overlays several runs in one image, to compare settings (speed against memory,
say); --out's extension picks the format (png, pdf, svg, ...). A run still training plots too: the last line of its
metrics.jsonl, if not yet whole, is left out (read_metrics).

    python plot.py out-small                          # -> compare.png
    python plot.py out-a out-b out-c --out=ab.pdf     # one color per run
    python plot.py out-char out-gpt2 --bpb            # runs on one text with different tokenizers

matplotlib (Agg backend, no display needed) is imported when drawing only (draw(), and main() for the formats
it writes): train.py pays for matplotlib at its first evaluation, not at start-up.
"""
import argparse
import json
import os
import sys

# the curves of each run: the record field, the panels it is drawn in, its style
LOSSES = {'loss': dict(lw=0.8, alpha=0.45),                      # training lines: the step's loss
          'train_loss': dict(ls='--', marker='.', ms=5),         # evaluations
          'val_loss': dict(marker='o', ms=3.5)}
BPB = {'train_bpb': LOSSES['train_loss'], 'val_bpb': LOSSES['val_loss']}  # in their place, with --bpb
# the panels after those of the losses, by iteration: the record field, its title
BY_ITERATION = {'grad_norm': 'gradient norm', 'lr': 'learning rate', 'tokens_per_sec': 'tokens/s',
                'peak_mem_mb': 'peak memory (MB)'}


def metrics_path(run):
    """A run's metrics.jsonl: run is its out_dir, or the file itself."""
    return run if os.path.isfile(run) else os.path.join(run, 'metrics.jsonl')


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl (or of out_dir, the file itself), in order. A missing or empty file,
    or a line that is not a JSON object, is an error naming it; blank lines are skipped; a last line without its
    newline (being written right now) is left out."""
    path = metrics_path(out_dir)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: {out_dir} is not the out_dir of a training run (yet)")
    records = []
    try:
        with open(path, 'rb') as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():  # (an editor's or a concatenation's)
            continue
        line = raw.decode('utf-8', errors='replace')
        try:
            record = json.loads(raw)  # (bytes that are not UTF-8: a ValueError too)
        except ValueError:
            if line.endswith('\n'):
                raise ValueError(f"{path}, line {n}: not a JSON record: {line[:80]!r}") from None
            continue
        if not isinstance(record, dict) or 'iter' not in record:
            raise ValueError(f"{path}, line {n}: not a record of train.py (an object with 'iter'): {line[:80]!r}")
        records.append(record)
    if not records:
        raise ValueError(f"{path} is empty: the run has logged nothing yet")
    return records


def series(records):
    """The run's curves: {field: (iterations, tokens, values)} for each field of LOSSES, BPB and BY_ITERATION that
    the records hold (tokens None where a record has none). Null values are left out."""
    curves = {}
    for record in records:
        for field in (*LOSSES, *BPB, *BY_ITERATION):
            if record.get(field) is not None:
                iters, tokens, values = curves.setdefault(field, ([], [], []))
                iters.append(record['iter'])
                tokens.append(record.get('tokens'))
                values.append(record[field])
    return curves


def visible(xs, style):
    """style, with a marker where the curve is one point: matplotlib draws a line through one point as nothing."""
    return {**style, 'marker': style.get('marker') or 'o', 'ms': style.get('ms', 3.5)} if len(xs) == 1 else style


def draw(runs, path, bpb=False):
    """Draw runs ({label: records}) into an image at path, in the format of its extension (PNG without one):
    written to path.tmp, then renamed over path, so a reader never sees half a file. bpb: bits per byte in the
    first two panels, in place of the losses. Returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # see the module docstring
    from matplotlib.figure import Figure
    fig = Figure(figsize=(15, 8))
    FigureCanvasAgg(fig)  # Agg: renders to a file, no display needed
    axes = fig.subplots(2, 3)
    by_iter, by_tokens, *others = axes.flat
    panels = dict(zip(BY_ITERATION, others))
    shown, measure = (BPB, 'bits per byte') if bpb else (LOSSES, 'loss')
    for i, (label, records) in enumerate(runs.items()):
        color, curves = f'C{i % 10}', series(records)
        for field, style in shown.items():
            if field in curves:
                iters, tokens, values = curves[field]
                by_iter.plot(iters, values, color=color, label=f'{label}: {field}', **visible(iters, style))
                known = [(t, v) for t, v in zip(tokens, values) if t is not None]
                by_tokens.plot([t for t, _ in known], [v for _, v in known], color=color, **visible(known, style))
        for field, ax in panels.items():
            if field in curves:
                iters, _, values = curves[field]
                ax.plot(iters, values, color=color, label=label, **visible(iters, dict(lw=1)))
    titles = [(measure, 'iteration'), (measure, 'tokens'), *((title, 'iteration') for title in BY_ITERATION.values())]
    for ax, (title, x) in zip(axes.flat, titles):
        ax.set_title(f'{title} vs {x}', fontsize=10)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    panels['grad_norm'].set_yscale('log')  # early in a run it can spike to 10x and more of where it settles
    by_iter.legend(fontsize=8, loc='upper right')  # a fixed place: loc='best' searches every point
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, top=0.95, wspace=0.2, hspace=0.3)
    tmp = f'{path}.tmp'
    try:
        fig.savefig(tmp, format=image_format(path), dpi=80)  # (tmp's extension is .tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return fig


def image_format(path):
    return os.path.splitext(path)[1][1:].lower() or 'png'


def main(argv=None):
    parser = argparse.ArgumentParser(prog='plot.py', description='Overlay the metrics.jsonl of training runs.')
    parser.add_argument('out_dirs', nargs='+', help="runs' out_dir folders (each holds metrics.jsonl), or the "
                                                    "metrics.jsonl files")
    parser.add_argument('--out', default='compare.png',
                        help='the image to write, in the format of its extension (default: compare.png)')
    parser.add_argument('--bpb', action='store_true',
                        help="the evaluations' bits per byte in place of the losses: they compare runs whose "
                             "tokenizers differ")
    args = parser.parse_args(argv)
    from matplotlib.backend_bases import FigureCanvasBase
    formats = {f for f in FigureCanvasBase.get_supported_filetypes() if f != 'pgf'}  # pgf needs LaTeX installed
    if image_format(args.out) not in formats:
        parser.exit(1, f"plot.py: error: --out={args.out}: plot.py writes no '{image_format(args.out)}' "
                       f"images; name it .png, .pdf, .svg or another of {', '.join(sorted(formats))}\n")
    runs = {}
    try:
        for out_dir in args.out_dirs:
            label = os.path.normpath(out_dir)
            if label in runs:
                raise ValueError(f"{out_dir} is given twice")
            runs[label] = read_metrics(out_dir)
            if args.bpb and not any('val_bpb' in r for r in runs[label]):
                path = metrics_path(out_dir)
                raise ValueError(f"--bpb: {path} holds no bits per byte: " + (
                    "the run has not evaluated yet" if not any('val_loss' in r for r in runs[label]) else
                    "the run's report says why ('bits per byte: not reported'), or it predates them"))
    except ValueError as e:
        parser.exit(1, f"plot.py: error: {e}\n")
    try:
        draw(runs, args.out, bpb=args.bpb)
    except OSError as e:
        parser.exit(1, f"plot.py: error: cannot write {args.out}: {e.strerror or e}\n")
    print(f"wrote {args.out}: {', '.join(runs)}")


if __name__ == '__main__':
    main(sys.argv[1:])
