"""
Reading prepared data (see data/prepare.py for the on-disk format) and turning examples into batches.

    ds = TokenDataset('data/add', 'train')                  # memory-mapped view of one split
    idx = batch_indices(len(ds), batch_size, seed=seed, step=step, micro_step=micro_step,
                        rank=ddp_rank, world_size=ddp_world_size, grad_accum=grad_accum)
    batch = collate(ds.examples(idx.tolist()), pad_id=meta['pad_id'], eos_id=meta['eos_id'])

collate() follows NeMo AutoModel's DLLMCollator (non-response-window mode). Each row of length T is
    [0, cl)            content                input_ids = the example, loss_mask = its mask, attention_mask = 1
    [cl, fill_end)     block fill             input_ids = eos_id,      loss_mask = 1,         attention_mask = 0
    [fill_end, T)      global pad             input_ids = pad_id,      loss_mask = supervise_padding, attention 0
where cl = min(len(example), max_seq_len or inf) and fill_end = cl rounded up to a multiple of block_size (no fill
when block_size <= 1). T = the batch's longest fill_end, rounded up to a multiple of lcm(block_size,
pad_seq_len_divisible) when pad_seq_len_divisible > 1, then capped at max_seq_len (content is truncated to T).
The fill is supervised so that a block-wise sampler learns to end a block with eos; it is not attended to, so it
changes no content position's output. input_lengths holds the raw example lengths (before the cap).

batch_indices() is a pure function of (seed, step, position in the global batch): the global batch of a step is the
same whatever the split into ranks and accumulation micro-steps, and a resumed run needs only `step` to continue
the data stream. It never touches the global torch RNG.
"""
import functools
import json
import math
import os

import numpy as np
import torch


class TokenDataset:
    """Memory-mapped view of one split of a prepared directory: len(ds) examples, ds.example(i) -> (ids, mask)."""

    def __init__(self, data_dir, split):
        meta_path = os.path.join(data_dir, 'meta.json')
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{meta_path} not found: run data/prepare.py on {data_dir} first")
        with open(meta_path) as f:
            self.meta = json.load(f)
        self.dtype = np.dtype(self.meta['dtype'])
        self.ids_path, self.mask_path = (os.path.join(data_dir, f'{split}{s}.bin') for s in ('', '_mask'))
        idx_path = os.path.join(data_dir, f'{split}_idx.bin')
        for path in (self.ids_path, self.mask_path, idx_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found (split {split!r} of {data_dir})")
        self.idx = np.fromfile(idx_path, dtype=np.int64)  # small: 8 bytes per example, kept in memory
        self.n_tokens = int(self.idx[-1])
        n_ids, n_mask = os.path.getsize(self.ids_path) // self.dtype.itemsize, os.path.getsize(self.mask_path)
        if not n_ids == n_mask == self.n_tokens:
            raise ValueError(f"{data_dir}: split {split!r} is inconsistent: {n_ids} ids, {n_mask} mask bytes, "
                             f"{self.n_tokens} tokens in {idx_path}; re-run data/prepare.py")

    def __len__(self):
        return len(self.idx) - 1

    def _maps(self):
        # recreate np.memmap on every access to avoid a memory leak, as per
        # https://stackoverflow.com/questions/45132940/numpy-memmap-memory-usage-want-to-iterate-once/61472122#61472122
        return (np.memmap(self.ids_path, dtype=self.dtype, mode='r'),
                np.memmap(self.mask_path, dtype=np.uint8, mode='r'))

    def examples(self, indices):
        """[(ids int64, loss_mask uint8)] for a list of example indices (one memmap per call)."""
        ids, mask = self._maps()
        out = []
        for i in indices:
            a, b = self.idx[i], self.idx[i + 1]
            out.append((np.array(ids[a:b], dtype=np.int64), np.array(mask[a:b])))  # copies: plain arrays, no memmap
        return out

    def example(self, i):
        return self.examples([i])[0]

    def window(self, start, length):
        """Tokens [start, start + length) of the split's stream, across example boundaries (raw text)."""
        end = start + length
        assert 0 <= start <= end <= self.n_tokens, f"window [{start}, {end}) is outside the split's 0..{self.n_tokens}"
        ids, mask = self._maps()
        return np.array(ids[start:end], dtype=np.int64), np.array(mask[start:end])


def collate(examples, *, pad_id, eos_id, block_size=1, pad_seq_len_divisible=1, max_seq_len=0, supervise_padding=False,
            fill_to=0):
    """[(ids, mask)] -> dict of input_ids (B, T) long, loss_mask (B, T) float32, attention_mask (B, T) long,
    input_lengths (B,) long. Layout: see the module docstring (NeMo DLLMCollator semantics).
    fill_to > 0 extends every row's block fill to at least fill_to tokens (LLaDA SFT's EOS fill to a fixed canvas:
    the model learns to end an answer inside a canvas longer than the answer)."""
    assert examples, "collate needs at least one example"
    bs = block_size if block_size and block_size > 1 else 1
    fill_id = eos_id if eos_id is not None and eos_id >= 0 else pad_id  # NeMo: eos, falling back to pad
    lengths = [len(ids) for ids, _ in examples]
    content = [min(n, max_seq_len) if max_seq_len else n for n in lengths]
    fill_end = [max(math.ceil(c / bs) * bs, fill_to) for c in content]
    T = max(fill_end)
    if pad_seq_len_divisible and pad_seq_len_divisible > 1:
        m = math.lcm(bs, pad_seq_len_divisible)
        T = math.ceil(T / m) * m
    if max_seq_len:
        T = min(T, max_seq_len)
    T = max(T, 1)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    loss_mask = torch.full((B, T), float(supervise_padding), dtype=torch.float32)  # (B, T)
    attention_mask = torch.zeros((B, T), dtype=torch.long)  # (B, T)
    for b, (ids, mask) in enumerate(examples):
        c, f = min(content[b], T), min(fill_end[b], T)
        input_ids[b, :c] = torch.as_tensor(np.asarray(ids[:c], dtype=np.int64))
        loss_mask[b, :c] = torch.as_tensor(np.asarray(mask[:c], dtype=np.float32))
        attention_mask[b, :c] = 1
        input_ids[b, c:f] = fill_id
        loss_mask[b, c:f] = 1.0  # block fill is always supervised, never attended
    return dict(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask,
                input_lengths=torch.tensor(lengths, dtype=torch.long))


class TextWindows:
    """Raw text (meta kind 'text', one token stream per split) as examples: non-overlapping windows of seq_len
    tokens, every token supervised (pretraining). len(w) windows; w.examples(idx) -> [(ids, mask)] like TokenDataset."""

    def __init__(self, ds, seq_len):
        self.ds, self.seq_len, self.meta = ds, seq_len, ds.meta
        if ds.n_tokens < seq_len:
            raise ValueError(f"raw text split of {ds.n_tokens} tokens is shorter than one row of max_seq_len={seq_len}")

    def __len__(self):
        return self.ds.n_tokens // self.seq_len

    def examples(self, indices):
        return [self.ds.window(i * self.seq_len, self.seq_len) for i in indices]

    def example(self, i):
        return self.examples([i])[0]


def pack(examples, *, seq_len, pad_id):
    """Greedy packing: whole examples, in order, go into rows of seq_len tokens; a new row starts when the next
    example does not fit (an example longer than seq_len is truncated into a row of its own).
    Returns input_ids (R, T) long, loss_mask (R, T) float32, attention_mask (R, T) long (1 on content),
    doc_ids (R, T) long (0, 1, 2, .. per example within a row, -1 on pad) and position_ids (R, T) long
    (restarting at 0 in every example, 0 on pad), so a document mask plus these positions reproduce the unpacked
    examples. Rows have no block fill: pad positions are unsupervised and unattended."""
    rows, row, used = [], [], 0
    for ids, mask in examples:
        n = min(len(ids), seq_len)
        if row and used + n > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append((ids[:n], mask[:n]))
        used += n
    if row:
        rows.append(row)
    R = len(rows)
    input_ids = torch.full((R, seq_len), pad_id, dtype=torch.long)  # (R, T)
    loss_mask = torch.zeros((R, seq_len), dtype=torch.float32)  # (R, T)
    attention_mask = torch.zeros((R, seq_len), dtype=torch.long)  # (R, T)
    doc_ids = torch.full((R, seq_len), -1, dtype=torch.long)  # (R, T)
    position_ids = torch.zeros((R, seq_len), dtype=torch.long)  # (R, T)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            n = len(ids)
            input_ids[r, at:at + n] = torch.as_tensor(np.asarray(ids, dtype=np.int64))
            loss_mask[r, at:at + n] = torch.as_tensor(np.asarray(mask, dtype=np.float32))
            attention_mask[r, at:at + n] = 1
            doc_ids[r, at:at + n] = d
            position_ids[r, at:at + n] = torch.arange(n)
            at += n
    return dict(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask, doc_ids=doc_ids,
                position_ids=position_ids)


def _mix(*xs):
    # a 63-bit generator seed from a few ints (torch.Generator.manual_seed wants a non-negative int64)
    h = 0
    for x in xs:
        h = (h * 1_000_003 + x) & (2 ** 63 - 1)
    return h


@functools.lru_cache(maxsize=4)
def _epoch_perm(n, seed, epoch):
    g = torch.Generator().manual_seed(_mix(seed, epoch))
    return torch.randperm(n, generator=g)


def global_rows(batch_size, *, micro_step, rank, world_size):
    """(B,) long: positions of this micro-batch's rows in the step's global batch of world_size*grad_accum*B rows.
    Micro-step m of rank r holds rows [(m * world_size + r) * B, +B). Seed per-row randomness from these."""
    assert 0 <= rank < world_size, f"rank {rank} outside world_size {world_size}"
    start = (micro_step * world_size + rank) * batch_size
    return torch.arange(start, start + batch_size)


def batch_indices(n_examples, batch_size, *, seed, step, micro_step, rank, world_size, grad_accum, replacement=False):
    """(B,) long example indices of micro-batch `micro_step` on rank `rank` at optimizer step `step`.

    The data stream is a sequence of epochs, each a permutation of range(n_examples) seeded by (seed, epoch); step s
    takes the next world_size*grad_accum*batch_size entries of it, so every example is seen once per epoch.
    replacement=True draws each step's global batch with torch.randint seeded by (seed, step) instead (for huge n,
    e.g. window starts in raw text, where a permutation per epoch is too big)."""
    assert n_examples > 0, "batch_indices needs at least one example"
    assert 0 <= micro_step < grad_accum, f"micro_step {micro_step} outside grad_accum {grad_accum}"
    G = world_size * grad_accum * batch_size
    rows = global_rows(batch_size, micro_step=micro_step, rank=rank, world_size=world_size)  # (B,)
    if replacement:
        g = torch.Generator().manual_seed(_mix(seed, step))
        return torch.randint(n_examples, (G,), generator=g)[rows]
    pos = step * G + rows  # (B,) position in the endless stream
    epoch, offset = pos // n_examples, pos % n_examples
    out = torch.empty_like(pos)
    for e in epoch.unique().tolist():  # one or two epochs per micro-batch unless n_examples < B
        sel = epoch == e
        out[sel] = _epoch_perm(n_examples, seed, e)[offset[sel]]
    return out
