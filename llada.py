"""
llada.py: masked diffusion language models (MDLM / LLaDA / LLaDA2 SFT) on a Hugging Face model.

The forward process masks each supervised token independently with probability p = (1-eps)*t + eps, t ~ U[0,1)
per example; the model (a bidirectional transformer) predicts the clean token at every masked position and the loss
is the 1/p-weighted cross-entropy over masked positions, divided by the number of supervised tokens in the global
batch (LLaDA arXiv 2502.09992 Eq. 3 / SFT Eq. 5; NeMo AutoModel MDLMCrossEntropyLoss).

CPU, the embedded default (synthetic 3-digit addition, ~1.1M params, ~9 minutes on 2 cores, prints held-out accuracy):
    python llada.py
1 GPU, LLaDA-8B-Base SFT from a local checkpoint directory:
    python llada.py config/llada_sft.py --init_from=/path/to/LLaDA-8B-Base
8 GPUs:
    torchrun --standalone --nproc_per_node=8 llada.py config/llada_sft.py --init_from=/path/to/LLaDA-8B-Base
Resume (bit-exact on CPU):
    python llada.py --init_from=resume
Sample from the result:
    python sample.py --checkpoint out-llada --sampler llada --prompt "123+456"

Layout: the library half (importable, no side effects) holds the model builder, corruption and loss; the script half
under `if __name__ == '__main__':` holds config -> configurator -> distributed init -> data -> model -> training loop.
"""
import json
import math
import os
import re
import shutil
import signal
import sys
import time

import torch
import torch.nn as nn

import hf
import kernels
from data.loader import collate, pack as pack_rows

# -----------------------------------------------------------------------------
# model

def check_mask_id(mask_id, vocab_size, pad_id=-1, eos_id=-1):
    """mask_id must be a real embedding row and must not collide with pad/eos (they are trained as content)."""
    if not (0 <= mask_id < vocab_size):
        raise ValueError(f'mask_id={mask_id} is outside the vocabulary [0, {vocab_size})')
    if mask_id in (pad_id, eos_id):
        raise ValueError(f'mask_id={mask_id} equals the {"pad" if mask_id == pad_id else "eos"} id; pick a dedicated mask token')


class MDLM(nn.Module):
    """The HF model and the MDLM loss in one forward, so DDP/FSDP hooks see a single call per micro-step."""

    def __init__(self, model, softcap=0.0, compiled_ce=False):
        super().__init__()
        self.model = model
        self.softcap = softcap
        self.compiled_ce = compiled_ce

    def forward(self, input_ids, targets, weights, attention_mask=None, position_ids=None):
        h = hf.last_hidden_state(self.model, input_ids, attention_mask, position_ids)  # (B, T, C), post final norm
        sel = weights > 0  # (B, T) the corrupted, supervised positions
        W = self.model.get_output_embeddings().weight  # (V, C)
        # only the selected rows reach the LM head, chunk by chunk: no (B, T, V) logits in forward or backward
        return kernels.chunked_cross_entropy(h[sel], W, targets[sel], row_weights=weights[sel].float(),
                                             softcap=self.softcap, compiled=self.compiled_ce)

# -----------------------------------------------------------------------------
# corruption

def corruption_seeds(seed, step, global_rows, global_batch):
    """One 63-bit seed per row, a pure function of (seed, step, row's place in the global batch): the same tokens get
    the same noise whatever the world size / accumulation split, and a resumed run replays it (NeMo §2.2)."""
    idx = step * global_batch + global_rows.long()  # (B,)
    return (seed + 2**43 + 2654435761 * idx) & (2**63 - 1)


def corrupt(x0, loss_mask, *, mask_id, eps, seeds):
    """MDLM forward process (NeMo corrupt_uniform, LLaDA GUIDELINES): per row t ~ U[0,1), p = (1-eps)t + eps,
    each supervised token -> mask_id with probability p. Prompt and unsupervised padding are never masked.
    Per-row generators seeded by `seeds` (B,); the global RNG is untouched.
    Returns xt (B, T) long, noise (B, T) bool, p (B, T) float32 (p constant along a row)."""
    B, T = x0.shape
    t = torch.empty(B)
    u = torch.empty(B, T)
    for b in range(B):  # per-row streams (B is small; this runs on CPU tensors before the batch moves to device)
        g = torch.Generator().manual_seed(int(seeds[b]))
        t[b] = torch.rand(1, generator=g)[0]  # draw 1: t
        u[b] = torch.rand(T, generator=g)  # draw 2: per-token coin
    p = ((1 - eps) * t + eps)[:, None].expand(B, T).to(torch.float32)  # (B, T)
    noise = (u < p) & loss_mask.bool()  # (B, T)
    xt = torch.where(noise, torch.full_like(x0, mask_id), x0)  # (B, T)
    return xt, noise, p


def loss_weights(noise, p):
    """Per-position weight of the MDLM loss: 1/p on corrupted supervised tokens, 0 elsewhere (LLaDA Eq. 3). (B, T)"""
    return noise.float() / p.clamp_min(1e-8)


def fill_length(seed, step, hi):
    """The canvas every row of a step is EOS-filled to: uniform in [0, hi] from (seed, step), the same on every rank
    and micro-step (make_batch never fills a row below the batch's longest). Drawing it per step, not fixing it as LLaDA SFT does, trains both
    tight canvases (a sampler's gen_length equal to the answer) and long ones (a gen_length well past the answer)."""
    if hi <= 0:
        return 0
    g = torch.Generator().manual_seed((seed * 1_000_003 + step + 2**40) & (2**63 - 1))
    return int(torch.randint(hi + 1, (1,), generator=g))


def make_batch(examples, seeds, *, pad_id, eos_id, mask_id, eps, max_seq_len, fill_to=0, block_size=1,
               pad_seq_len_divisible=1, supervise_padding=True, pack=False):
    """[(ids, loss_mask)] examples -> one micro-batch, a dict of (R, T) tensors:
      input_ids (x_t, corrupted), targets (x_0), weights (1/p on corrupted supervised tokens, else 0), loss_mask
      (the supervised tokens the loss is divided by: with fill_to, not the EOS fill), noise (corrupted), and with pack=True doc_ids and position_ids (restarting per document).
    Padded (pack=False): one example per row, collated as data.loader.collate (EOS block fill up to fill_to).
    Packed: several examples per row of max_seq_len, no fill, padding unsupervised. Each example is corrupted as
    its own row (seeds (B,), one per example) BEFORE packing, so packing changes the layout, never the noise."""
    if not pack:
        if fill_to:  # every row is EOS-filled to the same canvas, at least the batch's longest row
            fill_to = max(fill_to, min(max(len(ids) for ids, _ in examples), max_seq_len or fill_to))
        b = collate(examples, pad_id=pad_id, eos_id=eos_id, block_size=block_size, max_seq_len=max_seq_len,
                    pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding, fill_to=fill_to)
        x0, lm = b['input_ids'], b['loss_mask']
        xt, noise, p = corrupt(x0, lm, mask_id=mask_id, eps=eps, seeds=seeds)
        if fill_to:  # the EOS fill is trained but not counted in the loss denominator (deliberate difference from
            # LLaDA SFT): counted, it outnumbers the answer tokens and the answers learn far slower (README)
            lm = lm * (torch.arange(x0.shape[1])[None] < b['input_lengths'][:, None])
        return dict(input_ids=xt, targets=x0, weights=loss_weights(noise, p), loss_mask=lm, noise=noise)
    b = collate(examples, pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len)  # no fill, padding unsupervised
    x0, lm = b['input_ids'], b['loss_mask']
    xt, noise, p = corrupt(x0, lm, mask_id=mask_id, eps=eps, seeds=seeds)
    n = b['input_lengths'].clamp(max=x0.shape[1]).tolist()
    # pack() lays rows out from the lengths alone, so packing aligned fields one by one gives aligned rows
    field = lambda ids, vals: pack_rows([(ids[i, :k], vals[i, :k]) for i, k in enumerate(n)], seq_len=max_seq_len,
                                        pad_id=pad_id)
    p0, pt, pw = field(x0, lm), field(xt, noise.float()), field(x0, loss_weights(noise, p))
    return dict(input_ids=pt['input_ids'], targets=p0['input_ids'], weights=pw['loss_mask'],
                loss_mask=p0['loss_mask'], noise=pt['loss_mask'].bool(), doc_ids=p0['doc_ids'],
                position_ids=p0['position_ids'])


def attention_for(model, batch, device):
    """The attention mask of a micro-batch for the model's backend (hf.attention_mask): per-document bidirectional
    for packed rows; for padded rows full bidirectional attention (LLaDA SFT attends to its EOS fill), i.e. no mask
    at all on SDPA, an explicit BlockMask on flex (transformers' own flex mask would be causal)."""
    B, T = batch['input_ids'].shape
    if 'doc_ids' in batch:
        doc = batch['doc_ids'].to(device)
        return hf.attention_mask(model, kernels.document(kernels.bidirectional(), doc, doc), B, T, T, device)
    if hf.uses_flex(model):
        return hf.attention_mask(model, kernels.bidirectional(), B, T, T, device)
    return None

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """llada's own bad settings (the eval sampler's lengths, the corruption) as one line, or None; see
    settings_error for the ones every family shares."""
    if min(c['block_length'], c['steps'], c['pad_block_size']) < 1:
        return (f"block_length={c['block_length']}, steps={c['steps']} and pad_block_size={c['pad_block_size']} "
                f"must be > 0")
    if c['gen_length'] % c['block_length']:
        return f"gen_length={c['gen_length']} must be a multiple of block_length={c['block_length']}"
    n_blocks = c['gen_length'] // c['block_length']
    if c['steps'] % n_blocks:
        return f"steps={c['steps']} must be divisible by the number of blocks gen_length/block_length={n_blocks}"
    if not 0 < c['eps'] < 1:
        return f"eps={c['eps']} must be in (0, 1)"
    if c['eos_fill'] < 0 or c['mask_id'] < -1:
        return f"eos_fill={c['eos_fill']} must be >= 0 and mask_id={c['mask_id']} >= -1 (-1: from meta.json)"
    return None

# -----------------------------------------------------------------------------
# skeleton helpers
# (every family script has this section verbatim: tests/test_family_contract.py compares the copies)

MODEL_KEYS = ('model_type', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'intermediate_size', 'rope_theta')  # shape


def get_lr(it, *, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then flat."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(lr_decay_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def git_commit():
    """The source's git commit (+ '-dirty' with uncommitted changes), or '' outside a git checkout."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *a: subprocess.run(['git', *a], cwd=here, capture_output=True, text=True, timeout=10)
        head = run('rev-parse', '--short=12', 'HEAD')
        if head.returncode:
            return ''
        dirty = run('status', '--porcelain', '--untracked-files=no').stdout.strip()
        return head.stdout.strip() + ('-dirty' if dirty else '')
    except (OSError, subprocess.SubprocessError):
        return ''


def settings_error(c, model_types=('qwen3', 'llama')):
    """The first bad setting of the resolved config c as one line, or None. Run before any data, model or step, so
    a bad eval setting cannot surface after hours of training; family_settings_error adds the family's own.
    model_types: the scratch architectures the family builds (gemma_bd.py: its own)."""
    import importlib.util
    for k in ('batch_size', 'gradient_accumulation_steps', 'max_iters', 'learning_rate', 'log_interval', 'max_seq_len',
              'pad_seq_len_divisible', 'gen_length'):
        if k in c and not c[k] > 0:
            return f'{k}={c[k]!r} must be > 0' + (': nothing to train' if k == 'max_iters' else '')
    for k in ('eval_interval', 'eval_iters', 'eval_samples', 'ckpt_interval', 'ckpt_interval_min', 'warmup_iters',
              'min_lr', 'weight_decay', 'grad_clip', 'intermediate_size'):
        if k in c and c[k] < 0:
            return f'{k}={c[k]!r} must be >= 0'
    if not (0 <= c['beta1'] < 1 and 0 <= c['beta2'] < 1):
        return f"beta1={c['beta1']} and beta2={c['beta2']} must be in [0, 1)"
    if c['init_from'] == 'scratch':  # the shape keys build the model only from scratch
        if min(c['n_layer'], c['n_head'], c['n_kv_head'], c['n_embd']) < 1:
            return 'n_layer, n_head, n_kv_head and n_embd must be > 0'
        if c['n_embd'] % c['n_head'] or c['n_embd'] // c['n_head'] % 2:
            return f"n_embd={c['n_embd']} must be n_head={c['n_head']} x an even head size (RoPE rotates pairs)"
        if c['n_head'] % c['n_kv_head']:
            return f"n_head={c['n_head']} must be divisible by n_kv_head={c['n_kv_head']}"
        if c['model_type'] not in model_types:
            return f"model_type={c['model_type']!r} must be " + ' or '.join(map(repr, model_types))
    if c['dtype'] not in ('auto', 'float32', 'bfloat16'):
        return f"dtype={c['dtype']!r} must be 'auto', 'float32' or 'bfloat16'"
    if not re.fullmatch(r'auto|cpu|cuda(:\d+)?', c['device']):
        return f"device={c['device']!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'"
    if c['device'].startswith('cuda') and int(c['device'][5:] or 0) >= torch.cuda.device_count():
        return f"device={c['device']!r} but torch {torch.__version__} sees {torch.cuda.device_count()} CUDA devices"
    if c['wandb_log'] and importlib.util.find_spec('wandb') is None:
        return 'wandb_log=True but wandb is not installed (pip install wandb, or --wandb_log=False)'
    return None


def resume_error(config, given, saved):
    """On resume: the first model-shape key set on this run (given: {key: where}) to a value other than the one the
    checkpoint's model was built with (saved: its config), as one line; None if they agree."""
    for k in MODEL_KEYS:
        if k in given and k in saved and config[k] != saved[k]:
            return (f"{k}={config[k]!r} ({given[k]}) but the checkpoint was trained with {k}={saved[k]!r}; a resumed "
                    f"run keeps its model: drop {k}, or start over with --init_from=scratch --overwrite=True")
    return None


def lock_out_dir(out_dir):
    """(open lock file, None) once this process holds out_dir/lock, else (None, one line naming the holder's PID).
    The kernel drops an flock when its holder exits or is killed, so a lock file left by a dead run is simply taken
    over. Keep the file open for the run's life."""
    import fcntl
    f = open(os.path.join(out_dir, 'lock'), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or '?'
        f.close()
        return None, f'{out_dir} is in use by another run (PID {pid}); wait for it to end or pick another out_dir'
    f.truncate(0)
    f.write(f'{os.getpid()}\n')
    f.flush()
    return f, None


def die_at(phase, step):
    """Test hook (tests/test_reliability.py): NANODLM_DIE_AT=<phase> or <phase>:<step> makes this process SIGKILL
    itself there: 'step' (mid-step), 'save' (ckpt.pt.tmp written), 'renamed' (ckpt.pt replaced), 'export' (hf.tmp
    written). Unset, it does nothing."""
    if os.environ.get('NANODLM_DIE_AT') in (phase, f'{phase}:{step}'):
        os.kill(os.getpid(), signal.SIGKILL)


def save_run(out_dir, ckpt, model, state_dict, meta, tokenizer):
    """out_dir/ckpt.pt, then the HF export out_dir/hf (meta.json records the step), each replaced whole: ckpt.pt.tmp
    is renamed over ckpt.pt, and a complete hf.tmp over hf (hf -> hf.old, hf.tmp -> hf). A kill at any point leaves
    a loadable ckpt.pt and a whole hf/, which may be older than ckpt.pt (its meta.json says which step it is); a
    kill between the two renames leaves hf.old, which the next run puts back."""
    path, step = os.path.join(out_dir, 'ckpt.pt'), ckpt['step']
    torch.save(ckpt, path + '.tmp')
    die_at('save', step)
    os.replace(path + '.tmp', path)
    die_at('renamed', step)
    hf_dir = os.path.join(out_dir, 'hf')
    tmp, old = hf_dir + '.tmp', hf_dir + '.old'
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    if hasattr(tokenizer, 'save'):
        tokenizer.save(tmp)
    with open(os.path.join(tmp, 'meta.json'), 'w') as f:
        json.dump({**meta, 'step': step}, f, indent=1)
    die_at('export', step)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(hf_dir):
        os.replace(hf_dir, old)
    os.replace(tmp, hf_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_run(path):
    """The checkpoint at path (plain tensors), or RuntimeError: one line naming the file and what else is usable."""
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # truncated or corrupt: zip, pickle and EOF errors, depending on where the damage is
        hf_dir = os.path.join(os.path.dirname(path), 'hf')
        try:
            with open(os.path.join(hf_dir, 'meta.json')) as f:
                alt = (f"the last good alternative is {hf_dir} (step {json.load(f)['step']}, weights only, no "
                       f"optimizer state): --init_from={hf_dir} --overwrite=True")
        except (OSError, ValueError, KeyError):
            alt = 'nothing else there is usable: start over with --overwrite=True'
        raise RuntimeError(f'{path} is truncated or corrupt ({type(e).__name__}); {alt}') from None


class StopSignal:
    """SIGINT/SIGTERM during training: the first sets .signum (the loop saves a checkpoint after the step, then
    exits 128 + signum); another one more than a second later exits at once (torchrun passes the terminal's Ctrl-C
    on to its workers, so each sees the first one twice)."""

    def __init__(self):
        self.signum, self.time = 0, 0.0
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self)

    def __call__(self, signum, frame):
        if self.signum and time.time() - self.time > 1:
            os._exit(128 + signum)
        if not self.signum:
            self.signum, self.time = signum, time.time()
            os.write(2, f'{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping '
                        f'(send it again to stop at once)\n'.encode())

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python llada.py --help` lists them)
    # I/O
    out_dir = 'out-llada'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | path to a local HF checkpoint dir
    trust_remote_code = False  # needed for checkpoints with custom code (LLaDA-8B); only set it for code you trust
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 1000  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by the sampler for exact-match accuracy (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'llada'  # wandb run name
    # data
    dataset = 'add'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 256  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_block_size = 1  # >1: EOS-fill each row to a multiple of this (supervised, unattended)
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    supervise_padding = True  # padding is trained like ordinary tokens (LLaDA SFT: teaches the model to stop)
    eos_fill = 32  # >0: EOS-fill every row of a step to a canvas drawn from [its longest row, eos_fill] (fill_length),
    #                so a sampling canvas longer than the answer stays in distribution (README); 0 = off
    pack = False  # pack several examples per row of max_seq_len (per-document attention) instead of padding
    # model
    model_type = 'qwen3'  # scratch architecture: 'qwen3' | 'llama'
    n_layer = 4  # transformer layers (scratch)
    n_head = 8  # attention heads (scratch). 8 of 16 dims, not 4 of 32 (same parameters): on add the answer's last
    # digits must find operand digits whose offset depends on the answer's length; more heads find it sooner (README)
    n_kv_head = 8  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 512  # MLP hidden size (scratch; 0 = 3 * n_embd)
    rope_theta = 10000.0  # RoPE base (scratch)
    # corruption
    mask_id = -1  # [MASK] token id; -1 = from meta.json / the tokenizer (LLaDA 126336, LLaDA2.1 156895)
    eps = 0.1  # minimum mask probability: p = (1 - eps) * t + eps. LLaDA uses 1e-3 (config/llada_sft.py keeps it);
    # on a 5-token answer a row at p ~ 1e-3 puts one token of weight 1/p ~ 1000 in a 256-row batch and its gradient
    # is the step. Capping 1/p at 10 is one of three changes after which every swept run left its plateau (README)
    # optimizer
    learning_rate = 3e-3  # peak AdamW learning rate (3e-3 leaves the add plateau ~250 steps sooner than 2e-3)
    max_iters = 2000  # optimizer steps
    weight_decay = 0.1  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 50  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 1e-4  # final learning rate
    # eval & sampling (the llada sampler used for the accuracy eval)
    gen_length = 5  # tokens generated per val prompt (add: up to 4 digits + EOS)
    block_length = 5  # semi-autoregressive block length
    steps = 5  # denoising steps in total (one token per step here)
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    compile = False  # torch.compile the decoder and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    seed = 1337  # data order, corruption and init all derive from it
    # -------------------------------------------------------------------------
    import configurator
    given = {}  # key -> where this run set it (command line or file:line)
    config = configurator.configure(globals(), sources=given)
    problem = settings_error(config) or family_settings_error(config)
    if problem:
        configurator.usage_error(problem)  # one line, exit 2, before any data, model or step

    import numpy as np
    import torch.distributed as dist
    from contextlib import nullcontext
    from data.loader import TokenDataset, TextWindows, batch_indices, global_rows
    from data.prepare import check_prepared, ensure_synthetic
    from data.synthetic import TASKS
    from data.tokenizer import load_tokenizer
    import sample as sampler_lib

    # -------------------------------------------------------------------------
    # distributed init
    ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if ddp:
        ddp_rank, ddp_local_rank = int(os.environ['RANK']), int(os.environ['LOCAL_RANK'])
        ddp_world_size = int(os.environ['WORLD_SIZE'])
        if device.startswith('cuda'):
            device = f'cuda:{ddp_local_rank}'
            torch.cuda.set_device(device)
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    else:
        ddp_rank, ddp_local_rank, ddp_world_size = 0, 0, 1
    master_process = ddp_rank == 0
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'

    def print0(*a, **k):
        if master_process:
            print(*a, **k, flush=True)

    def all_sum(t):
        if ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def from_rank0(obj):
        """rank 0's obj on every rank: the verdict of what only rank 0 checks (out_dir's lock and files)."""
        if ddp:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            obj = box[0]
        return obj

    def finish(code=0):
        # gloo ranks sometimes abort at interpreter shutdown; tear down explicitly (environment.md)
        sys.stdout.flush(); sys.stderr.flush()
        if ddp:
            dist.destroy_process_group()
            os._exit(code)
        sys.exit(code)

    def fail(message, code):
        """`error: message`, one line on stderr (from rank 0: every rank reaches the same verdict), then exit with
        code: 2 for a usage error (a bad setting or combination, found before training), 1 for a run-time failure."""
        if master_process:
            print(f'error: {message}', file=sys.stderr)
        finish(code)

    if gradient_accumulation_steps % ddp_world_size:
        fail(f'gradient_accumulation_steps={gradient_accumulation_steps} (the total over ranks) must be divisible by '
             f'the world size {ddp_world_size}', 2)
    grad_accum = gradient_accumulation_steps // ddp_world_size  # micro-steps on this rank
    global_batch = batch_size * grad_accum * ddp_world_size  # examples per optimizer step

    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
    autocast = nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type, dtype=ptdtype)
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(seed)  # model init only: the data order (and any corruption) use their own generators

    # -------------------------------------------------------------------------
    # data
    synthetic = not data_dir and dataset in TASKS  # only a named synthetic task is generated, into data/<task>
    data_dir = data_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset)
    if synthetic and master_process:
        ensure_synthetic(dataset, data_dir, max_seq_len=max_seq_len, seed=0)
    if ddp:
        dist.barrier()
    try:  # prepared, and its sources unchanged since (else one line with the data/prepare.py command to run)
        check_prepared(data_dir, 'byte' if init_from in ('scratch', 'resume') else init_from, max_seq_len)
        train_ds, val_ds = TokenDataset(data_dir, 'train'), TokenDataset(data_dir, 'val')
        meta = train_ds.meta
        tokenizer = load_tokenizer(meta)
    except (OSError, ValueError) as e:
        fail(str(e), 1 if os.path.isdir(data_dir) else 2)  # a data_dir that does not exist is a bad setting
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    text = meta.get('kind') == 'text'  # raw text: windows of max_seq_len tokens, every token supervised
    if text:
        try:
            train_ds, val_ds = TextWindows(train_ds, max_seq_len), TextWindows(val_ds, max_seq_len)
        except ValueError as e:
            fail(f'{data_dir}: {e}', 1)

    def get_batch(ds, idx, seeds, fill_to):
        """The micro-batch dict of examples idx (B,): collated (or packed), corrupted with per-row seeds (B,)."""
        return make_batch(ds.examples(idx.tolist()), seeds, pad_id=pad_id, eos_id=eos_id, mask_id=mask_id, eps=eps,
                          max_seq_len=max_seq_len, fill_to=0 if text else fill_to, block_size=pad_block_size,
                          pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding,
                          pack=pack)

    def pos_of(mb):
        return mb['position_ids'].to(device) if 'position_ids' in mb else None

    # -------------------------------------------------------------------------
    # model
    # out_dir holds one run at a time (a lock for the run's life), and a fresh run never replaces its checkpoint
    ckpt_path, hf_dir = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'hf')
    lock, verdict = None, (0, '')  # the lock (an open file, kept until exit); (exit code, message) of rank 0
    if master_process:
        os.makedirs(out_dir, exist_ok=True)
        lock, busy = lock_out_dir(out_dir)
        if busy:
            verdict = (1, busy)
        elif init_from != 'resume' and os.path.exists(ckpt_path) and not overwrite:
            verdict = (2, f'{ckpt_path} exists: --init_from=resume continues that run, --overwrite=True replaces it')
        elif not os.path.isdir(hf_dir) and os.path.isdir(hf_dir + '.old'):  # a kill between save_run's renames
            os.replace(hf_dir + '.old', hf_dir)
    code, message = from_rank0(verdict)
    if code:
        fail(message, code)
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device)  # flex_attention on CUDA, sdpa on CPU
    if init_from == 'resume':
        if not os.path.exists(ckpt_path):
            fail(f'init_from=resume but {ckpt_path} does not exist', 1)
        try:
            checkpoint = load_run(ckpt_path)
        except RuntimeError as e:
            fail(str(e), 1)
        saved = checkpoint['config']  # the settings it was trained with
        problem = resume_error(config, given, saved)
        if problem:
            fail(problem, 2)
        if checkpoint['step'] >= max_iters:
            fail(f"{ckpt_path} is at step {checkpoint['step']} >= max_iters={max_iters}: nothing to train", 2)
        config.update({k: saved[k] for k in MODEL_KEYS if k in saved})  # the model it is
        hf_config = json.loads(checkpoint['model_args'])
        if 'auto_map' in hf_config:  # remote-code model: its code travels with the HF export
            model = hf.build_model(hf_dir, trust_remote_code=trust_remote_code,
                                   bidirectional=True, attn_implementation=attn_implementation)
        else:
            model = hf.build_model('scratch', hf_config=hf_config, attn_implementation=attn_implementation)
        model.load_state_dict(checkpoint['model'])
        start_step = checkpoint['step']
    else:
        try:
            model = hf.build_model(init_from, vocab_size=meta['vocab_size'], model_type=model_type, n_layer=n_layer,
                                   n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                                   intermediate_size=intermediate_size, max_seq_len=max(max_seq_len, 256),
                                   rope_theta=rope_theta, trust_remote_code=trust_remote_code, bidirectional=True,
                                   attn_implementation=attn_implementation)
        except (OSError, ValueError) as e:  # a missing/incomplete checkpoint dir
            fail(str(e).splitlines()[0], 1)
    vocab = model.get_input_embeddings().weight.shape[0]
    if mask_id == -1:  # a resumed run keeps the [MASK] it was trained with
        mask_id = checkpoint['mask_id'] if checkpoint is not None else meta.get('mask_id', -1)
    try:
        check_mask_id(mask_id, vocab, pad_id, eos_id)
        if checkpoint is not None and mask_id != checkpoint['mask_id']:
            raise ValueError(f"mask_id={mask_id} but the checkpoint was trained with mask_id={checkpoint['mask_id']}")
    except ValueError as e:
        fail(str(e), 2)
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    mdlm = MDLM(model, softcap=softcap, compiled_ce=compile)  # the module that DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: {n_params / 1e6:.2f}M parameters, vocab {vocab}, mask_id {mask_id}, '
           f'world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = {global_batch} examples/step')

    if compile:
        raw_model.get_decoder().compile()  # in place: state_dict keys keep their names (no _orig_mod.)
    if ddp and fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in hf.shard_units(raw_model):
            fully_shard(layer)
        fully_shard(mdlm)  # the root: embeddings, final norm and the (tied) LM head
        train_model = mdlm
    elif ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(mdlm, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)
    else:
        train_model = mdlm
    # the optimizer comes after fully_shard, which swaps parameters for sharded DTensors
    decay = [p for p in mdlm.parameters() if p.dim() >= 2]
    no_decay = [p for p in mdlm.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': weight_decay},
                                   {'params': no_decay, 'weight_decay': 0.0}],
                                  lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
    if checkpoint is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, StateDictOptions
        set_optimizer_state_dict(mdlm, optimizer, checkpoint['optimizer'],
                                 options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(checkpoint['torch_rng'])
    checkpoint = None  # free memory

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, StateDictOptions
    # full (unsharded), name-keyed model + optimizer state: the same format with or without FSDP
    sd_options = StateDictOptions(full_state_dict=True, cpu_offload=ddp and fsdp)

    def model_state():
        return get_state_dict(mdlm, optimizer, options=sd_options)  # a collective under FSDP: every rank calls it

    def save_checkpoint(step, metrics):
        msd, osd = model_state()
        msd = {k[len('model.'):]: v for k, v in msd.items()}  # keys of the bare HF model
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (plain transformers loads it; sample.py --checkpoint out_dir uses it)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': 'llada',
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'mask_id': mask_id, 'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'mask_id': mask_id, 'family': 'llada', 'sampler': 'llada',
                                  'gen_length': gen_length, 'block_length': block_length, 'steps': steps}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    n_acc = 0 if text else min(eval_samples, len(val_ds))  # raw text has no prompts to answer
    if text and eval_samples > 0:
        print0(f'note: {data_dir} is raw text (no prompts): eval reports val_loss only, not accuracy')
    if eval_iters == 0:
        print0('note: eval_iters=0: evals compute no val_loss')
    acc_rows = []  # (prompt ids incl. the assistant header, reference answer text) of the first n_acc val examples
    for i in range(n_acc):
        ids, lm = val_ds.example(i)
        start = int(np.argmax(lm > 0))  # single-turn: the response is the supervised suffix
        acc_rows.append((ids[:start].tolist(), tokenizer.decode(ids[start:].tolist())))

    @torch.no_grad()
    def accuracy():
        """Exact match of the llada sampler (eval settings: gen_length/block_length/steps, greedy) on the first
        eval_samples val prompts, split over ranks; every rank runs the same number of batches (FSDP lockstep)."""
        per_rank = math.ceil(n_acc / ddp_world_size)
        mine = [ddp_rank * per_rank + j for j in range(per_rank)]
        hits = torch.zeros(2, device=device)  # correct, counted
        if ddp and fsdp:
            mdlm.unshard()  # gather the root's parameters (embeddings, norm, head): the sampler calls raw_model
        for s in range(0, per_rank, batch_size):
            rows = mine[s:s + batch_size]
            prompts = [acc_rows[min(i, n_acc - 1)][0] for i in rows]
            with autocast:
                gen = sampler_lib.generate(raw_model, prompts, sampler='llada', mask_id=mask_id, pad_id=pad_id,
                                           eos_id=eos_id, gen_length=gen_length, block_length=block_length,
                                           steps=steps)
            for i, g in zip(rows, gen):
                if i < n_acc:
                    hits += torch.tensor([tokenizer.decode(g).strip() == acc_rows[i][1].strip(), 1.0], device=device)
        if ddp and fsdp:
            mdlm.reshard()
        all_sum(hits)
        return (hits[0] / hits[1].clamp_min(1)).item()

    @torch.no_grad()
    def evaluate(step):
        """Val loss with fixed corruption seeds (the same noise at every eval), then exact-match accuracy of the
        llada sampler on the first eval_samples val prompts. Runs on every rank; sums are all-reduced."""
        mdlm.eval()
        tot = torch.zeros(2, device=device)  # Σ weighted CE, Σ supervised tokens
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds), corruption_seeds(seed, 0, rows, 1), eos_fill)
            with autocast:
                ce, _ = train_model(mb['input_ids'].to(device), mb['targets'].to(device), mb['weights'].to(device),
                                    attention_for(raw_model, mb, device), pos_of(mb))
            tot += torch.stack([ce.float(), mb['loss_mask'].sum().to(device)])
        all_sum(tot)
        out = {'val_loss': (tot[0] / tot[1].clamp_min(1)).item()} if eval_iters > 0 else {}  # no batch, no loss
        if n_acc > 0:
            out['accuracy'] = accuracy()
        mdlm.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    # the resolved values ('auto', -1 and the like replaced by what this run uses), logged and saved with ckpt.pt
    config.update(device=device, dtype=dtype, mask_id=mask_id, lr_decay_iters=lr_decay_iters, data_dir=data_dir,
                  attn_implementation=attn_implementation, world_size=ddp_world_size, git_commit=git_commit())
    resumed = ''  # a resumed run: the settings it changes take effect, and are logged
    if saved is not None:
        moved = [f'{k} {saved[k]!r} -> {v!r}' for k, v in config.items()
                 if k in saved and saved[k] != v and k not in ('init_from', 'git_commit')]
        resumed = f"resume from step {start_step}: {'changed ' + ', '.join(moved) if moved else 'no setting changed'}"
        print0(resumed)
    if master_process:
        log_file = open(os.path.join(out_dir, 'log.txt'), 'a')
        log_file.write(f'# llada.py torch {torch.__version__} device {device} world {ddp_world_size}\n'
                       f'# config {json.dumps(config)}\n' + (f'# {resumed}\n' if resumed else ''))
    if wandb_log and master_process:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)
    metrics = {}
    step = start_step
    stop = StopSignal()  # SIGINT/SIGTERM: save after the step, then exit
    t0 = last_save = time.time()
    while step < max_iters:
        lr = get_lr(step, learning_rate=learning_rate, min_lr=min_lr, warmup_iters=warmup_iters,
                    lr_decay_iters=lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # collate + corrupt every micro-batch first: the loss denominator is the GLOBAL supervised count
        micro, fill_to = [], fill_length(seed, step, eos_fill)
        for m in range(grad_accum):
            idx = batch_indices(len(train_ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(train_ds, idx, corruption_seeds(seed, step, rows, global_batch), fill_to))
        counts = torch.tensor([sum(mb['loss_mask'].sum() for mb in micro), sum(mb['noise'].sum() for mb in micro),
                               sum(mb['input_ids'].numel() for mb in micro)], dtype=torch.float64, device=device)
        n_sup, n_noise, n_tok = all_sum(counts).tolist()
        loss_sum = torch.zeros(2, device=device)  # Σ loss, Σ correct (argmax == target on masked positions)
        for m, mb in enumerate(micro):
            last = m == grad_accum - 1
            if ddp and fsdp:
                train_model.set_requires_gradient_sync(last)
            elif ddp:
                # set before forward: DDP reads it there (setting it late silently breaks accumulation)
                train_model.require_backward_grad_sync = last
            with autocast:
                ce, n_correct = train_model(mb['input_ids'].to(device), mb['targets'].to(device),
                                            mb['weights'].to(device), attention_for(raw_model, mb, device), pos_of(mb))
                loss = ce / max(n_sup, 1.0)  # LLaDA SFT: divide by the global number of supervised tokens
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += torch.stack([loss.detach().float(), n_correct.float()])
        grad_norm = torch.nn.utils.clip_grad_norm_(mdlm.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        all_sum(loss_sum)
        step_loss = loss_sum[0].item()
        if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
            fail(f'non-finite loss {step_loss} / grad_norm {float(grad_norm)} at step {step + 1}; stopping. The last '
                 f'good checkpoint ({ckpt_path}) is untouched.', 1)
        die_at('step', step + 1)  # test hook: a kill mid-step (gradients computed, not applied)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t0
        t0 = time.time()
        metrics = {'step': step, 'loss': step_loss, 'grad_norm': float(grad_norm), 'lr': lr,
                   'token_acc': loss_sum[1].item() / max(n_noise, 1.0), 'supervised_tokens': int(n_sup),
                   'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"token_acc {metrics['token_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | dt {dt*1000:.0f}ms")
            print0(line)
            if master_process:
                log_file.write(line + '\n'); log_file.flush()
                if wandb_log:
                    wandb.log(metrics, step=step)
        # a checkpoint at each eval, every ckpt_interval steps or ckpt_interval_min minutes, and on SIGINT/SIGTERM.
        # Every rank must take part (a collective under FSDP): rank 0's clock and any rank's signal decide, summed
        is_eval = (eval_interval > 0 and step % eval_interval == 0) or step == max_iters
        due = (ckpt_interval > 0 and step % ckpt_interval == 0) or \
            (master_process and ckpt_interval_min > 0 and time.time() - last_save >= 60 * ckpt_interval_min)
        due, stopping = all_sum(torch.tensor([float(due), float(stop.signum > 0)], device=device)).tolist()
        if is_eval:
            ev = evaluate(step)
            metrics.update(ev)
            line = f'eval step {step} | ' + (' | '.join(f'{k} {v:.4f}' for k, v in ev.items()) or 'nothing to report')
            print0(line)
            if master_process:
                log_file.write(line + '\n'); log_file.flush()
                if wandb_log:
                    wandb.log(ev, step=step)
        if is_eval or due or stopping:
            save_checkpoint(step, metrics)
            t0 = last_save = time.time()
        if stopping and step < max_iters:
            print0(f'stopped by a signal after step {step}, saved in {ckpt_path}: --init_from=resume continues')
            finish(128 + (stop.signum or signal.SIGTERM))
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {dataset}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
