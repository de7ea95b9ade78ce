"""
Synthetic chat tasks with exactly checkable answers, small enough to train on a CPU in minutes.

    add:    '123+45'              -> '168'               operands uniform in 0..999
    add_short: add with a quarter of second operands of 1-2 digits (uniform add: a tenth), never one of add's
            problems (its default splits at the same seed): llada's second training phase (docs/llada.md)
    sort:   '90210'               -> '00129'             1..10 digits, length uniform
    sudoku: '1.../...4/2.../...3' -> '1432321423414123'    4x4 grid, rows joined by '/', '.' = blank;
            the puzzle has exactly one solution (checked by a tiny solver); the answer is the 16-char solved grid

Each record is one user/assistant exchange, one JSON object per line in train.jsonl / val.jsonl:
    {"messages": [{"role": "user", "content": "123+45"}, {"role": "assistant", "content": "168"}]}

make_problems(task, n, seed) returns n records with pairwise distinct prompts, deterministic in (task, seed). The CLI
takes the first n_train of make_problems(task, n_train + n_val, seed) as train and the rest as val, so no prompt is in
both splits, and train does not depend on n_val. Only a private random.Random is used (global RNGs untouched).

    python data/synthetic.py --task=add --n_train=20000 --n_val=500 --seed=0 --out_dir=data/add
"""
import argparse
import functools
import json
import os
import random
import sys

TASKS = ('add', 'add_short', 'sort', 'sudoku')


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error format: one line `error: ...` on stderr, exit status 2."""

    def error(self, message):
        self.exit(2, f'error: {message} (see --help)\n')


def _add(rng):
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return f'{a}+{b}', str(a + b)


def _add_short(rng):
    # the same distribution as add but P(b < 100) = 1/4 instead of 1/10: a problem whose first operand is not at a
    # fixed offset from the prompt's end is common enough to pay for reading the '+' (docs/llada.md)
    a, b = rng.randint(0, 999), rng.randint(0, 99) if rng.random() < 0.25 else rng.randint(100, 999)
    return f'{a}+{b}', str(a + b)


# task -> (task, n): its problems avoid the first n of that task at the same seed (add's default train + val), so a
# run that trains on add and then on add_short never trains on add's val problems
AVOID = {'add_short': ('add', 20000 + 500)}


def _sort(rng):
    digits = ''.join(rng.choice('0123456789') for _ in range(rng.randint(1, 10)))
    return digits, ''.join(sorted(digits))


def sudoku_solutions(grid, limit=2):
    """All solutions (at most `limit`) of a 4x4 sudoku given as 16 chars, '.' = blank. Plain backtracking."""
    cells = list(grid)
    out = []

    def ok(k, d):
        r, c = divmod(k, 4)
        box = [(r // 2 * 2 + i // 2) * 4 + c // 2 * 2 + i % 2 for i in range(4)]
        return all(cells[j] != d for j in [r * 4 + i for i in range(4)] + [i * 4 + c for i in range(4)] + box)

    def solve():
        if len(out) >= limit:
            return
        if '.' not in cells:
            out.append(''.join(cells))
            return
        k = cells.index('.')
        for d in '1234':
            if ok(k, d):
                cells[k] = d
                solve()
                cells[k] = '.'

    solve()
    return out


@functools.cache
def _grids():
    """All 288 solved 4x4 grids, and for each the cells where it differs from every other grid (16-bit masks)."""
    grids = sudoku_solutions('.' * 16, limit=288)  # all of them: there are 288
    diffs = []
    for g in grids:
        masks = {sum(1 << k for k in range(16) if g[k] != h[k]) for h in grids if h != g}
        # keep the minimal masks: a clue set that hits every minimal one hits them all
        diffs.append([m for m in masks if not any(o != m and o & m == o for o in masks)])
    return grids, diffs


def _sudoku(rng):
    grids, diffs = _grids()
    i = rng.randrange(len(grids))
    solution = grids[i]
    # blank cells in random order as long as the solution stays unique, down to a random number of blanks.
    # The puzzle's clue set (a 16-bit mask) has a unique solution iff it contains a cell where `solution`
    # differs from each other grid.
    target = rng.randint(4, 12)  # 12 blanks (4 clues) is the most a 4x4 sudoku with a unique solution can have
    clues, blanks = (1 << 16) - 1, 0
    for k in rng.sample(range(16), 16):
        if blanks == target:
            break
        if all((clues & ~(1 << k)) & d for d in diffs[i]):
            clues &= ~(1 << k)
            blanks += 1
    p = ''.join(solution[k] if clues >> k & 1 else '.' for k in range(16))
    return '/'.join(p[r:r + 4] for r in range(0, 16, 4)), solution


def make_problems(task, n, seed):
    """n records with pairwise distinct prompts; deterministic in (task, seed), and a prefix of any larger n.
    ValueError for an unknown task or more records than the task has distinct prompts."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    make = {'add': _add, 'add_short': _add_short, 'sort': _sort, 'sudoku': _sudoku}[task]
    rng = random.Random(f'{task}-{seed}')  # str seeds hash deterministically (sha512), unlike hash()
    seen, records, tries = set(), [], 0
    if task in AVOID:
        seen = {r['messages'][0]['content'] for r in make_problems(*AVOID[task], seed)}
    while len(records) < n:
        tries += 1
        if tries > 100 * (n + 10):
            raise ValueError(f"task {task!r} ran out of distinct prompts after {len(records)} of {n}")
        prompt, answer = make(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        records.append({'messages': [{'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': answer}]})
    return records


def write_jsonl(records, path):
    tmp = f'{path}.tmp{os.getpid()}'  # per process: two runs generating one dir never share a temp file
    with open(tmp, 'w') as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + '\n')
    os.replace(tmp, path)  # atomic: a reader never sees a half-written file


def write_splits(task, out_dir, n_train, n_val, seed):
    """Write out_dir/train.jsonl and out_dir/val.jsonl (disjoint prompts)."""
    records = make_problems(task, n_train + n_val, seed)
    os.makedirs(out_dir, exist_ok=True)
    write_jsonl(records[:n_train], os.path.join(out_dir, 'train.jsonl'))
    write_jsonl(records[n_train:], os.path.join(out_dir, 'val.jsonl'))
    print(f'synthetic: wrote {n_train:,} train and {n_val:,} val {task} examples to {out_dir}')


if __name__ == '__main__':
    parser = ArgumentParser(description='Generate a synthetic chat task as train.jsonl / val.jsonl.')
    parser.add_argument('--task', choices=TASKS, default='add', help='which task')
    parser.add_argument('--n_train', type=int, default=20000, help='number of training examples')
    parser.add_argument('--n_val', type=int, default=500, help='number of validation examples')
    parser.add_argument('--seed', type=int, default=0, help='random seed')
    parser.add_argument('--out_dir', default=None, help='output directory (default: data/<task>)')
    args = parser.parse_args()
    if args.n_train < 1 or args.n_val < 1:  # checked before anything is written
        parser.error(f'--n_train={args.n_train} and --n_val={args.n_val} must be > 0')
    try:
        write_splits(args.task, args.out_dir or os.path.join('data', args.task), args.n_train, args.n_val, args.seed)
    except ValueError as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
