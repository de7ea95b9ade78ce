"""
Benchmarks (performance, not tests). Each section prints a table with ratios measured in the same run.

    python bench.py                      # every section
    python bench.py --only=ce            # chunked cross-entropy vs naive full-logits CE
    python bench.py --only=ce --V=50304 --N=2048 --dtype=bfloat16   # smaller / other dtype
    python bench.py --only=train         # one llada training step vs a naive full-logits step
    python bench.py --only=sample        # llada decoding: reference vs threshold vs prefix / dual KV cache
    python bench.py --only=sample --checkpoint=out-llada-sudoku --val=data/sudoku/val.jsonl --threshold=0.9,0.999

Each variant runs in its own subprocess so its peak memory is its own. torch does not track CPU memory,
so we read the kernel's counters: after the warm-up iteration (which includes any compile) the child
resets its peak RSS (`5 > /proc/self/clear_refs`) and reports VmHWM - VmRSS (peak above the baseline
of inputs, weights and compiled code) over the timed iterations. Time = median forward+backward.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import kernels


def _status_kib(key):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise KeyError(f"bench.py: {key} not in /proc/self/status")


def _measure(step, iters):
    """Warm up once, reset the peak RSS, time `iters` calls.
    Returns {'s': median wall s, 'cpu_s': median process CPU s (all threads), 'mib': peak MiB above baseline}.
    CPU seconds are the steadier number on a machine shared with other jobs."""
    step()
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # resets VmHWM to the current RSS (Linux >= 4.0)
    base = _status_kib('VmRSS')
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {'s': statistics.median(wall), 'cpu_s': statistics.median(cpu), 'mib': (_status_kib('VmHWM') - base) / 1024}

# -----------------------------------------------------------------------------
# ce: chunked cross-entropy (kernels.chunked_cross_entropy) vs naive F.cross_entropy on full logits

CE_VARIANTS = ['naive_eager', 'naive_compiled', 'chunked_eager', 'chunked_compiled']


def ce_child(variant, args):
    torch.manual_seed(0)
    dt = getattr(torch, args.dtype)
    h = torch.randn(args.N, args.d).to(dt).requires_grad_()  # (N, d) selected hidden rows
    W = (torch.randn(args.V, args.d) * args.d ** -0.5).to(dt).requires_grad_()  # (V, d) LM head
    t = torch.randint(args.V, (args.N,))  # (N,)

    def naive(h, W, t):
        return F.cross_entropy((h @ W.t()).float(), t, reduction='sum')  # (N, V) logits

    loss_fn = {
        'naive_eager': naive,
        'naive_compiled': torch.compile(naive, dynamic=False),
        'chunked_eager': lambda h, W, t: kernels.chunked_cross_entropy(h, W, t, chunk_size=args.chunk_size)[0],
        'chunked_compiled': lambda h, W, t: kernels.chunked_cross_entropy(h, W, t, chunk_size=args.chunk_size, compiled=True)[0],
    }[variant]

    def step():
        loss_fn(h, W, t).backward()
        h.grad = W.grad = None

    return _measure(step, args.iters)


def measured(results, header):
    """Print a markdown table header; yield the (variant, result) rows that ran, after printing a row for each
    that failed or was skipped for memory ('skip' rows, duplicates of another, are left out)."""
    print(header)
    print('|' + '---|' * header.count(' | ') + '---|')
    for v, r in results.items():
        if 'error' in r:
            print(f"| {v} | {r['error']} |" + ' |' * (header.count(' | ') - 1))
        elif 'skip' not in r:
            yield v, r


def ce_report(results, args):
    print(f"ce: N={args.N} rows, d={args.d}, V={args.V}, {args.dtype}, forward+backward, "
          f"median of {args.iters}, {torch.get_num_threads()} threads, chunk_size={args.chunk_size or kernels.auto_chunk_size(args.V)}")
    ref = results.get('naive_compiled')
    header = "| variant | s/iter | CPU s/iter | peak MiB above baseline | speed vs naive_compiled (wall, CPU) | memory vs naive_compiled |"
    for v, r in measured(results, header):
        ok = ref is not None and 'error' not in ref
        speed = f"{ref['s'] / r['s']:.2f}x, {ref['cpu_s'] / r['cpu_s']:.2f}x" if ok else '-'
        mem = f"{r['mib'] / ref['mib']:.3f}" if ok and ref['mib'] > 0 else '-'
        print(f"| {v} | {r['s']:.2f} | {r['cpu_s']:.2f} | {r['mib']:.0f} | {speed} | {mem} |")


def ce_need_mib(variant, args):
    """Rough memory a variant needs, to skip one that would not fit (naive eager holds ~4 (N, V) fp32)."""
    nv = args.N * args.V * 4 / 2**20
    return {'naive_eager': 4 * nv, 'naive_compiled': 2 * nv}.get(variant, 0.1 * nv)


# -----------------------------------------------------------------------------
# train: one llada training step (chunked CE on the corrupted rows only) vs a naive reference step (full (B, T, V)
# logits from the HF model, eager F.cross_entropy), same model, batch and corruption, AdamW step included

TRAIN_VARIANTS = ['naive_step', 'llada_step']


def train_child(variant, args):
    import llada
    torch.manual_seed(0)
    V, B, T = args.V, args.B, args.T
    model = llada.build_model('scratch', vocab_size=V, n_layer=args.n_layer, n_head=4, n_kv_head=4, n_embd=args.d,
                              intermediate_size=4 * args.d, max_seq_len=T)
    x0 = torch.randint(V - 1, (B, T))  # (B, T) clean tokens; id V-1 is the mask
    lm = torch.ones(B, T)
    lm[:, :T // 4] = 0  # a prompt quarter, never corrupted
    xt, noise, p = llada.corrupt(x0, lm, mask_id=V - 1, eps=1e-3, seeds=torch.arange(B))
    w, n_sup = llada.loss_weights(noise, p), lm.sum()
    mdlm = llada.MDLM(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        if variant == 'llada_step':
            ce, _ = mdlm(xt, x0, w)
        else:
            logits = model(xt).logits  # (B, T, V)
            ce = (F.cross_entropy(logits.float().view(-1, V), x0.view(-1), reduction='none') * w.view(-1)).sum()
        (ce / n_sup).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = _measure(step, args.iters)
    r['tok_s'] = B * T / r['s']
    return r


def train_report(results, args):
    print(f"train: one llada step (forward+backward+AdamW), {args.n_layer} layers, d={args.d}, V={args.V}, "
          f"B={args.B} x T={args.T}, fp32, median of {args.iters}, {torch.get_num_threads()} threads")
    ref = results.get('naive_step')
    ok = ref is not None and 'error' not in ref
    header = "| variant | s/step | tokens/s | peak MiB above baseline | tokens/s vs naive | memory vs naive |"
    for v, r in measured(results, header):
        speed = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ok else '-'
        mem = f"{r['mib'] / ref['mib']:.3f}" if ok and ref['mib'] > 0 else '-'
        print(f"| {v} | {r['s']:.2f} | {r['tok_s']:,.0f} | {r['mib']:.0f} | {speed} | {mem} |")


def train_need_mib(variant, args):
    return (5 if variant == 'naive_step' else 0.5) * args.B * args.T * args.V * 4 / 2**20


# -----------------------------------------------------------------------------
# sample: llada decoding speed on the trained tiny model (accuracy, NFE, generated tokens/s), Fast-dLLM style:
# the LLaDA reference (one token per step) vs + threshold decoding vs + block-wise prefix / dual KV caches

FAST_VARIANTS = ['threshold', 'threshold_blocks', 'prefix_cache', 'dual_cache']


def sample_variants(args):
    """'reference', then each fast variant at each --threshold ('name@t')."""
    return ['reference'] + [f'{v}@{t}' for t in args.threshold.split(',') for v in FAST_VARIANTS]


def sample_options(variant, meta, args):
    """The reference uses the checkpoint's gen_length/block_length/steps (steps == gen_length: one token per step).
    The fast variants ('name@t') add threshold decoding (t, top-1 always) with early stop; the block and cache
    variants split the canvas into blocks of args.cache_block (0 = the largest divisor <= gen_length / 2) so a cache has a prefix to
    reuse and a refresh per block, and keep steps (the schedule only sets a floor of 1 token per step)."""
    G = meta.get('gen_length', 128)
    ref = dict(gen_length=G, block_length=meta.get('block_length', G), steps=meta.get('steps', G))
    name, _, t = variant.partition('@')
    fast = dict(ref, threshold=float(t or 0.9), early_stop=True)
    # the largest proper divisor of G above 1 (G itself when G is prime: one block, the cache holds the prompt)
    b = args.cache_block or max([d for d in range(2, G // 2 + 1) if G % d == 0] or [G])
    blocks = dict(fast, block_length=b)
    return {'reference': ref, 'threshold': fast, 'threshold_blocks': blocks,
            'prefix_cache': dict(blocks, cache='prefix'), 'dual_cache': dict(blocks, cache='dual')}[name]


def sample_child(variant, args):
    import sample
    if not os.path.isdir(args.checkpoint):
        return {'error': f"skipped: no checkpoint {args.checkpoint!r} (run python llada.py)"}
    torch.manual_seed(0)
    model, tok, meta = sample.load_checkpoint(args.checkpoint)
    records = sample.read_records(args.val)[:args.n_prompts]
    opts = sample_options(variant, meta, args)
    if variant.startswith('threshold_blocks') and opts['block_length'] == opts['gen_length']:
        return {'skip': 'one block: the same run as threshold'}
    runs = []
    for _ in range(args.iters):  # each evaluate() runs one untimed warm-up batch first
        c0 = time.process_time()
        r = sample.evaluate(model, tok, meta, records, 'llada', opts, batch_size=args.sample_batch, progress=False)
        runs.append({**r, 'cpu_s': time.process_time() - c0})
    r = sorted(runs, key=lambda r: r['wall'])[len(runs) // 2]  # the median run (accuracy and NFE are the same in all)
    return {**r, 'opts': opts}


def sample_report(results, args):
    print(f"sample: llada on {args.checkpoint}, first {args.n_prompts} prompts of {args.val}, batch {args.sample_batch}, "
          f"greedy, median of {args.iters} evals (after one warm-up batch), {torch.get_num_threads()} threads")
    ref = results.get('reference')
    ok = ref is not None and 'error' not in ref
    header = "| variant | settings | accuracy | NFE/prompt | tokens/forward | generated tok/s | CPU s | tok/s vs reference | accuracy vs reference |"
    for v, r in measured(results, header):
        o = r['opts']
        s = f"gen {o['gen_length']}, block {o['block_length']}, steps {o['steps']}" + \
            (f", threshold {o['threshold']}, early stop" if o.get('threshold') else '') + \
            (f", {o['cache']} cache" if o.get('cache') else '')
        speed = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ok else '-'
        dacc = f"{r['accuracy'] - ref['accuracy']:+.1f} pt" if ok else '-'
        print(f"| {v} | {s} | {r['accuracy']:.1f}% | {r['nfe_per_prompt']:.2f} | {r['tokens_per_forward']:.2f} | "
              f"{r['tok_s']:,.0f} | {r['cpu_s']:.2f} | {speed} | {dacc} |")


def sample_need_mib(variant, args):
    return 0


SECTIONS = {'ce': (CE_VARIANTS, ce_child, ce_report, ce_need_mib),
            'train': (TRAIN_VARIANTS, train_child, train_report, train_need_mib),
            'sample': (sample_variants, sample_child, sample_report, sample_need_mib)}

# -----------------------------------------------------------------------------

def _mem_available_mib():
    with open('/proc/meminfo') as f:
        for line in f:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) / 1024
    return float('inf')


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--only', default='', help=f"comma-separated sections: {','.join(SECTIONS)} (default all)")
    p.add_argument('--N', type=int, default=8192, help='rows (selected tokens)')
    p.add_argument('--d', type=int, default=256, help='hidden size')
    p.add_argument('--V', type=int, default=126464, help='vocabulary size')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
    p.add_argument('--chunk_size', type=int, default=0, help='chunked CE rows per chunk, 0 = auto')
    p.add_argument('--B', type=int, default=8, help='train: sequences per batch')
    p.add_argument('--T', type=int, default=256, help='train: sequence length')
    p.add_argument('--n_layer', type=int, default=4, help='train: transformer layers')
    p.add_argument('--iters', type=int, default=3, help='timed iterations after one warm-up')
    p.add_argument('--checkpoint', default='out-llada', help='sample: a trained llada out_dir')
    p.add_argument('--val', default='data/add/val.jsonl', help='sample: chat JSONL prompts with answers')
    p.add_argument('--n_prompts', type=int, default=200, help='sample: first n prompts')
    p.add_argument('--sample_batch', type=int, default=64, help='sample: prompts per batch')
    p.add_argument('--threshold', default='0.9', help='sample: Fast-dLLM confidence threshold(s), comma-separated')
    p.add_argument('--cache_block', type=int, default=0, help='sample: block length of the cached variants (0 = largest divisor <= gen/2)')
    p.add_argument('--variants', default='', help='comma-separated subset of variants')
    p.add_argument('--child', default='', help=argparse.SUPPRESS)  # section:variant, run in a subprocess
    args = p.parse_args()

    if args.child:
        section, variant = args.child.split(':')
        print(json.dumps(SECTIONS[section][1](variant, args)))
        return
    child_argv, skip = [], False  # our own argv without --only / --variants (either as --k=v or as --k v)
    for a in sys.argv[1:]:
        if skip or a.startswith(('--only', '--variants')):
            skip = a in ('--only', '--variants')
            continue
        child_argv.append(a)
    sections = args.only.split(',') if args.only else list(SECTIONS)
    for s in sections:
        assert s in SECTIONS, f"bench.py: unknown section {s!r} (have {', '.join(SECTIONS)})"
    for s in sections:
        variants, _, report, need_mib = SECTIONS[s]
        variants = variants(args) if callable(variants) else variants
        if args.variants:  # by name, any threshold
            variants = [v for v in variants if v.partition('@')[0] in args.variants.split(',')]
        results = {}
        for v in variants:
            if need_mib(v, args) > 0.8 * _mem_available_mib():
                results[v] = {'error': f"skipped: needs ~{need_mib(v, args):.0f} MiB"}
                continue
            cmd = [sys.executable, os.path.abspath(__file__), f'--child={s}:{v}'] + child_argv
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                results[v] = {'error': f"failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}"}
            else:
                results[v] = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"  {s}/{v}: {results[v]}", file=sys.stderr, flush=True)
        report(results, args)


if __name__ == '__main__':
    main()
