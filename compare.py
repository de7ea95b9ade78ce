"""
compare.py: every family on one task, one model size and one training budget, each decoded by its own sampler on
the same fresh held-out puzzles, with its speed knob swept. Writes docs/results.md and, when matplotlib is installed,
docs/results.png (held-out exact match against tokens per forward, one curve per family, AR as the reference).

The task is 4x4 sudoku (data/sudoku: 16-cell answers, where decoding several tokens per forward matters). Every
family trains the 4-layer d=128 model of its tiny default (gemma_bd: its 1.85M-parameter MoE; dflash: a 2-layer
draft on the AR model) for the same number of examples (BUDGET); dflash and idlm start from the AR run, so their
rows add their own steps to its budget (the table says so). Each checkpoint is scored with sample.py --eval on
fresh puzzles (generated with another seed, in neither split); tokens/s at batch 1 and 64 are ratios to the AR
model's KV-cached decoding in the same run, train s/step and peak memory (the training process's max RSS) ratios to
llada's. One job at a time: run it alone, in the background.

    python compare.py                        # ~1.5 h on 2 cores; appends to compare/results.jsonl, skips what ran
    python compare.py --tiny --out=/tmp/c    # a few steps each, minutes: the command cannot rot (tests)
    python compare.py --report               # only rewrite docs/results.md (+ the figure) from results.jsonl
"""
import argparse
import json
import os
import platform
import statistics
import re
import subprocess
import sys
import time

from sweep import fresh_problems

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET = ['--max_iters=1000', '--batch_size=128', '--eval_interval=0', '--eval_samples=0']  # 128k examples each
TINY = ['--max_iters=4', '--batch_size=8', '--eval_interval=0', '--eval_samples=0', '--n_layer=2', '--n_embd=32',
        '--n_head=2', '--n_kv_head=2', '--intermediate_size=64', '--log_interval=1', '--warmup_iters=1']
GEN = 17  # 16 cells + EOS

# name -> (training argv ({ar}: the AR run's out_dir), the sampler's knob: [(setting label, sample.py args)])
FAMILIES = {
    'ar': (['ar.py', 'config/ar_sudoku.py'], [('KV cache', [])]),
    'llada': (['llada.py', 'config/llada_sudoku.py'],
              [(f'threshold {t}', ['--threshold', str(t)]) for t in (0, 0.99, 0.9, 0.7, 0.5)]),
    'scdd': (['scdd.py', 'config/scdd_sudoku.py'], [(f'steps {s}', ['--steps', str(s)]) for s in (17, 9, 5, 3)]),
    'hybrid': (['hybrid.py', 'config/hybrid_sudoku.py'],
               [(f'threshold {t}', ['--threshold', str(t)]) for t in (0.99, 0.9, 0.7, 0.5)]),
    'gemma_bd': (['gemma_bd.py', '--dataset=sudoku', f'--gen_length={GEN}', f'--canvas_length={GEN}',
                  '--out_dir=out-gemma-bd-sudoku'],
                 [(f'steps/canvas {s}', ['--steps_per_block', str(s)]) for s in (48, 16, 8, 4)]),
    'dflash': (['dflash.py', '--target={ar}'], [('block 8', [])]),
    'idlm': (['idlm.py', 'config/idlm_tiny.py', '--init_from={ar}', '--block_length=3'],
             [('stride 4', [])]),
}
ORDER = list(FAMILIES)  # ar first: dflash and idlm start from it
ON_AR = ('dflash', 'idlm')  # trained on top of the AR run, at their own batch size (64)


def run(argv, log_path):
    """Run a python command, its output in log_path -> (rc, wall s, peak RSS MiB, output)."""
    t0 = time.time()
    with open(log_path, 'w') as log:
        p = subprocess.Popen([sys.executable] + argv, cwd=HERE, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, 'PYTHONWARNINGS': 'ignore'})
        _, status, usage = os.wait4(p.pid, 0)  # this child's own max RSS (KiB on Linux)
    with open(log_path) as f:
        return os.waitstatus_to_exitcode(status), time.time() - t0, usage.ru_maxrss / 1024, f.read()


def eval_line(text):
    """The numbers of sample.py's --eval line: accuracy %, NFE/prompt, tokens/forward, generated tok/s."""
    m = re.search(r'accuracy ([\d.]+)% .*?NFE \d+ total, ([\d.]+)/prompt \| tokens/forward ([\d.]+) \| '
                  r'generated tok/s ([\d.]+)', text)
    return None if m is None else dict(zip(('acc', 'nfe', 'tpf', 'tok_s'), map(float, m.groups())))


def train_one(name, a, out, rows, results):
    """Train family `name` at the budget (skipped if results.jsonl has it) -> its out_dir."""
    d = os.path.join(out, name)
    if any(r['family'] == name and r['kind'] == 'train' for r in rows):
        return d
    argv, _ = FAMILIES[name]
    budget = TINY if a.tiny else BUDGET
    if name in ON_AR:  # their own steps come on top of the AR run's, at their configs' batch size
        budget = [b for b in budget if not b.startswith('--batch_size')] + (['--batch_size=8'] if a.tiny else [])
        if a.tiny and name == 'dflash':  # the tiny target has 2 layers; short blocks for short runs
            budget += ['--target_layer_ids=0,1', '--block_size=4', '--num_blocks_per_sample=4']
    argv = [x.format(ar=os.path.join(out, 'ar')) for x in argv] + budget + [f'--out_dir={d}', '--overwrite=True',
                                                                            f'--data_dir={a.data_dir}']
    rc, wall, rss, text = run(argv, d + '.log')
    if rc:
        raise SystemExit(f'error: {name} training failed (exit {rc}), see {d}.log')
    dts = [float(x) for x in re.findall(r'\| dt (\d+)ms', text)[1:]] or [0.0]  # the first step warms up
    steps = int(re.findall(r'^step (\d+) \|', text, re.M)[-1])
    bs = int(re.findall(r'x batch (\d+) =', text)[0]) if re.search(r'x batch (\d+) =', text) else 0
    add(rows, results, dict(family=name, kind='train', wall_s=round(wall, 1), rss_mib=round(rss),
                            s_per_step=statistics.median(dts) / 1000, steps=steps, examples=steps * bs))
    return d


def decode(name, d, a, out, fresh, rows, results):
    """Score checkpoint d with its sampler on the fresh puzzles at each knob setting: batch 64 (all puzzles) and
    batch 1 (the first n_batch1)."""
    for label, extra in FAMILIES[name][1][:1 if a.tiny else None]:  # tiny: the first setting only
        if any(r['family'] == name and r['kind'] == 'decode' and r['setting'] == label for r in rows):
            continue
        row = dict(family=name, kind='decode', setting=label)
        for bs, n in ((64, a.n_fresh), (1, a.n_batch1)):
            log = os.path.join(out, re.sub(r'\W+', '_', f'{name}-{label}-b{bs}') + '.log')
            rc, _, _, text = run(['sample.py', '--checkpoint', d, '--eval', fresh, '--batch_size', str(bs),
                                  '--n', str(n), *extra], log)
            e = eval_line(text) if rc == 0 else None
            if e is None:
                raise SystemExit(f'error: {name} {label} decoding failed, see its log in {out}')
            row.update({f'{k}_b{bs}': v for k, v in e.items()})
        add(rows, results, row)


def add(rows, results, row):
    rows.append(row)
    with open(results, 'a') as f:
        f.write(json.dumps(row) + '\n')
    print(json.dumps(row), flush=True)


def figure_possible():
    import importlib.util
    return importlib.util.find_spec('matplotlib') is not None


def report(rows, page, figure, meta):
    """docs/results.md (+ the figure): one row per family and knob setting."""
    train = {r['family']: r for r in rows if r['kind'] == 'train'}
    dec = [r for r in rows if r['kind'] == 'decode']
    ar = next((r for r in dec if r['family'] == 'ar'), None)
    ll = train.get('llada')
    ratio = lambda x, y: f'{x / y:.2f}x' if x and y else '-'
    lines = ['# Every family on one task: 4x4 sudoku', '', meta, '',
             '| family | sampler setting | held-out exact match | NFE / answer | tokens / forward | '
             'tok/s batch 1 (vs AR) | tok/s batch 64 (vs AR) | train s/step (vs llada) | peak memory (vs llada) | '
             'examples trained |', '|---|---|---|---|---|---|---|---|---|---|']
    for r in dec:
        t = train.get(r['family'], {})
        ex = t.get('examples', 0) + (train['ar']['examples'] if r['family'] in ON_AR else 0)
        lines.append(f"| {r['family']} | {r['setting']} | {r['acc_b64']:.1f} % | {r['nfe_b64']:.2f} | "
                     f"{r['tpf_b64']:.2f} | {r['tok_s_b1']:,.0f} ({ratio(r['tok_s_b1'], ar and ar['tok_s_b1'])}) | "
                     f"{r['tok_s_b64']:,.0f} ({ratio(r['tok_s_b64'], ar and ar['tok_s_b64'])}) | "
                     f"{t.get('s_per_step', 0):.3f} ({ratio(t.get('s_per_step'), ll and ll['s_per_step'])}) | "
                     f"{t.get('rss_mib', 0):,} MiB ({ratio(t.get('rss_mib'), ll and ll['rss_mib'])}) | "
                     f"{ex:,}{' (AR + its own)' if r['family'] in ON_AR else ''} |")
    if ar:  # the verdict the table answers: at the AR model's accuracy (within a point), faster than AR?
        lines += ['', f"**Faster than AR at its accuracy?** AR: {ar['acc_b64']:.1f} % at batch 64. For each family, "
                  'its fastest setting within one point of that accuracy (or better), as a ratio to AR\'s KV-cached '
                  'decoding in the same run:', '']
        for fam in dict.fromkeys(r['family'] for r in dec if r['family'] != 'ar'):
            good = [r for r in dec if r['family'] == fam and r['acc_b64'] >= ar['acc_b64'] - 1]
            if not good:
                best = max((r for r in dec if r['family'] == fam), key=lambda r: r['acc_b64'])
                lines.append(f"- {fam}: no setting reaches it (best {best['acc_b64']:.1f} % at {best['setting']})")
                continue
            b1, b64 = (max(good, key=lambda r: r[f'tok_s_b{n}']) for n in (1, 64))
            lines.append(f"- {fam}: batch 1 {b1['tok_s_b1'] / ar['tok_s_b1']:.2f}x ({b1['setting']}, "
                         f"{b1['acc_b64']:.1f} %), batch 64 {b64['tok_s_b64'] / ar['tok_s_b64']:.2f}x "
                         f"({b64['setting']}, {b64['acc_b64']:.1f} %)")
    if os.path.exists(figure) or figure_possible():
        lines += ['', f'![accuracy against tokens per forward]({os.path.basename(figure)})']
    with open(page, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('note: matplotlib is not installed (pip install matplotlib): no figure, the table is written')
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam in ORDER:
        pts = sorted((r['tpf_b64'], r['acc_b64']) for r in dec if r['family'] == fam)
        if pts:
            ax.plot(*zip(*pts), 'o-' if len(pts) > 1 else ('k*' if fam == 'ar' else 'o'), label=fam,
                    markersize=12 if fam == 'ar' else 6)
    ax.set_xlabel('tokens per forward (answer tokens / NFE)')
    ax.set_ylabel('held-out exact match (%)')
    ax.set_title('4x4 sudoku, one model size and budget; each family its speed knob')
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[1])
    ap.add_argument('--tiny', action='store_true', help='a few steps per family (tests): the plumbing, no result')
    ap.add_argument('--out', default='', help='runs and results.jsonl (default: compare/)')
    ap.add_argument('--data_dir', default='', help='the prepared sudoku data (default: data/sudoku, generated)')
    ap.add_argument('--n_fresh', type=int, default=500, help='fresh held-out puzzles every checkpoint is scored on')
    ap.add_argument('--n_batch1', type=int, default=50, help='of those, decoded one at a time for batch-1 tok/s')
    ap.add_argument('--families', default=','.join(ORDER), help='comma-separated subset (ar is always trained)')
    ap.add_argument('--report', action='store_true', help='only write the page (and figure) from results.jsonl')
    ap.add_argument('--page', default=os.path.join(HERE, 'docs', 'results.md'), help='the page to write')
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out or os.path.join(HERE, 'compare'))
    os.makedirs(out, exist_ok=True)
    results = os.path.join(out, 'results.jsonl')
    rows = [json.loads(line) for line in open(results)] if os.path.exists(results) else []
    # tiny: a small dataset of its own (in data/sudoku it would stand in for the real one in every later run)
    a.data_dir = os.path.abspath(a.data_dir or os.path.join(out if a.tiny else os.path.join(HERE, 'data'),
                                                             'sudoku'))
    sys.path.insert(0, HERE)
    from data.prepare import ensure_synthetic  # as the scripts generate it (a.tiny: a small one)
    ensure_synthetic('sudoku', a.data_dir, max_seq_len=64, seed=0, **(dict(n_train=500, n_val=32) if a.tiny else {}))
    names = [n for n in ORDER if n == 'ar' or n in a.families.split(',')]
    unknown = set(a.families.split(',')) - set(ORDER)
    if unknown:
        raise SystemExit(f'error: --families: unknown {sorted(unknown)} (have {", ".join(ORDER)})')
    if not a.report:
        t0, n_before = time.time(), len(rows)
        fresh = os.path.join(out, 'fresh_sudoku.jsonl')
        for name in names:
            d = train_one(name, a, out, rows, results)
            if not os.path.exists(fresh):
                from data.synthetic import write_jsonl
                write_jsonl(fresh_problems('sudoku', a.n_fresh, [a.data_dir]), fresh)
            decode(name, d, a, out, fresh, rows, results)
        if any(r['kind'] != 'total' for r in rows[n_before:]):  # this invocation ran something: its wall time
            add(rows, results, dict(family='-', kind='total', wall_s=round(time.time() - t0)))
    meta = (f"Measured by `python compare.py` on {platform.node() or 'this machine'} ({os.cpu_count()} CPU cores, "
            f"{platform.processor() or platform.machine()}, fp32), {time.strftime('%Y-%m-%d')}. Budget per family: "
            f"{' '.join(TINY if a.tiny else BUDGET)}; {a.n_fresh} fresh puzzles (batch 64), the first {a.n_batch1} "
            f"of them one at a time (batch 1). Wall time of the whole comparison: "
            f"{sum(r['wall_s'] for r in rows if r['kind'] == 'total') / 60:.0f} min.")
    report(rows, a.page, os.path.splitext(a.page)[0] + '.png', meta)
    print(f'wrote {a.page}')


if __name__ == '__main__':
    main()
