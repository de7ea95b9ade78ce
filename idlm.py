"""
idlm.py: I-DLM (introspective diffusion LM): an AR model converted into a diffusion LM that verifies its own drafts.

All-masked fine-tuning: every response token of x_t is [MASK] (the prompt stays clean) and ONE forward reads
[x_t | x_0] (length 2L, the same position ids for both copies) under the I-DLM mask (kernels.block_diffusion with
causal_in_block): x_t is causal inside its block and sees the clean x_0 blocks strictly before it; x_0 is plainly
causal. Dream shift: position i predicts token i+1 in both copies (the first response token from the last prompt
position). Loss (arXiv 2604.11035; NeMo IDLMLoss, reference §7):
    CE_noisy + α·CE_clean,  each Σ CE over the response / (the global number of supervised tokens),
with α = clean_loss_weight (0.2) or, with auto_balance_clean_loss, the DETACHED ratio CE_noisy/CE_clean. The model
stays a plain causal LM: its clean positions are an AR model, its [MASK] positions propose the next block_length
tokens, and sample.py --sampler idlm (introspective strided decoding) verifies and emits up to block_length + 1
tokens per forward, equal to the model's own greedy AR decoding at temperature 0.

CPU, the embedded default converts the tiny ar.py sudoku model (train it first: python ar.py config/ar_sudoku.py);
the paper's curriculum block_length 1 -> 2 -> 3 is three runs, each from the previous one:
    python idlm.py config/idlm_tiny.py
    python idlm.py config/idlm_tiny.py --block_length=2 --init_from=out-idlm-b1 --out_dir=out-idlm-b2
    python idlm.py config/idlm_tiny.py --block_length=3 --init_from=out-idlm-b2 --out_dir=out-idlm-b3 \
        --auto_balance_clean_loss=True
8 GPUs, Qwen3-8B from a local directory (the seeds' recipe; the b2 / b3 stages as above):
    torchrun --standalone --nproc_per_node=8 idlm.py config/idlm_qwen3.py --init_from=/path/to/Qwen3-8B
Resume (bit-exact on CPU):
    python idlm.py config/idlm_tiny.py --init_from=resume
Sample from the result (ISD, stride block_length + 1):
    python sample.py --checkpoint out-idlm-b3 --prompt "1.../...4/2.../...3"

Forked from llada.py; changes: a causal backbone loaded from an AR checkpoint, the all-masked corruption, the
[x_t | x_0] forward and its mask, the shifted two-term loss, the idlm sampler's eval.
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
from data.loader import collate

# -----------------------------------------------------------------------------
# model

def check_mask_id(mask_id, vocab_size, pad_id=-1, eos_id=-1):
    """mask_id must be a real embedding row and must not collide with pad/eos (they are trained as content)."""
    if not (0 <= mask_id < vocab_size):
        raise ValueError(f'mask_id={mask_id} is outside the vocabulary [0, {vocab_size})')
    if mask_id in (pad_id, eos_id):
        raise ValueError(f'mask_id={mask_id} equals the {"pad" if mask_id == pad_id else "eos"} id; pick a dedicated mask token')


class IDLM(nn.Module):
    """The causal HF model and both loss terms in one forward over [x_t | x_0], so DDP/FSDP see a single call per
    micro-step. Returns (Σ CE_noisy, Σ CE_clean) and (noisy hits, clean hits), each a (2,) tensor; the training
    loop applies the global denominator and α."""

    def __init__(self, model, softcap=0.0, compiled_ce=False):
        super().__init__()
        self.model = model
        self.softcap = softcap
        self.compiled_ce = compiled_ce

    def forward(self, xt, x0, targets, weights, attention_mask):
        """xt, x0 (B, L) long: all-masked and clean ids; targets (B, L) = x0[i+1] (the Dream shift), weights (B, L)
        = 1 where token i+1 is supervised; attention_mask: the (B, 1, 2L, 2L) mask / BlockMask of attention_for.
        Both copies run at positions 0..L-1."""
        B, L = x0.shape
        pos = torch.arange(L, device=x0.device).expand(B, L)
        h = hf.last_hidden_state(self.model, torch.cat([xt, x0], 1), attention_mask, torch.cat([pos, pos], 1))
        W = self.model.get_output_embeddings().weight  # (V, C)
        sel = weights > 0  # the same rows of each copy: only those reach the LM head, chunk by chunk
        out = [kernels.chunked_cross_entropy(hh[sel], W, targets[sel], row_weights=weights[sel].float(),
                                             softcap=self.softcap, compiled=self.compiled_ce)
               for hh in (h[:, :L], h[:, L:])]
        return torch.stack([out[0][0], out[1][0]]), torch.stack([out[0][1], out[1][1]])


def total_loss(ce_noisy, ce_clean, *, clean_loss_weight, auto_balance):
    """CE_noisy + α·CE_clean (both already divided by the global supervised count). auto_balance: α =
    sg(CE_noisy / CE_clean) (the paper's Eq. 2, b3 stage): the clean term then equals CE_noisy in value while its
    gradient is CE_clean's scaled by the detached ratio. NeMo computes the ratio per micro-batch, and so does this."""
    alpha = (ce_noisy / ce_clean.clamp_min(1e-6)).detach() if auto_balance else clean_loss_weight
    return ce_noisy + alpha * ce_clean, alpha

# -----------------------------------------------------------------------------
# corruption

def corrupt(x0, loss_mask, *, mask_id):
    """I-DLM's all-masked corruption (NeMo corrupt_all_masked): every supervised token -> mask_id, the prompt and
    unsupervised padding stay. Deterministic (no noise to seed)."""
    return torch.where(loss_mask.bool(), torch.full_like(x0, mask_id), x0)


def make_batch(examples, *, pad_id, eos_id, mask_id, max_seq_len, pad_seq_len_divisible=1, supervise_padding=False):
    """[(ids, loss_mask)] -> one micro-batch dict of (B, L) tensors: xt (all-masked), x0, targets (x0[i+1]), weights
    (1 where token i+1 is supervised: the first response token comes from the last prompt position), key_valid
    (bool, the real tokens and any supervised padding)."""
    b = collate(examples, pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len,
                pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding)
    x0, lm = b['input_ids'], b['loss_mask']
    valid = b['attention_mask'].bool() | (lm > 0)
    targets = torch.cat([x0[:, 1:], torch.full_like(x0[:, :1], pad_id)], 1)
    weights = torch.cat([lm[:, 1:] * valid[:, 1:], torch.zeros_like(lm[:, :1])], 1).float()
    return dict(xt=corrupt(x0, lm, mask_id=mask_id), x0=x0, targets=targets, weights=weights, key_valid=valid,
                loss_mask=lm)


def attention_for(model, batch, block_length, device):
    """The I-DLM mask over [x_t | x_0] (kernels.block_diffusion, causal inside the block, blocks from position 0 of
    each copy, padded keys blocked in both copies) in the model's backend form: BlockMask (flex) or dense bool."""
    B, L = batch['x0'].shape
    mm = kernels.block_diffusion(L, block_length, batch['key_valid'].to(device), causal_in_block=True)
    return hf.attention_mask(model, mm, B, 2 * L, 2 * L, device)

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """idlm's own bad settings as one line, or None; see settings_error for the ones every family shares."""
    if c['block_length'] < 1:
        return f"block_length={c['block_length']} must be >= 1 (the paper's curriculum: 1, 2, 3)"
    if c['clean_loss_weight'] < 0:
        return f"clean_loss_weight={c['clean_loss_weight']} must be >= 0"
    if c['mask_id'] < -1:
        return f"mask_id={c['mask_id']} must be >= -1 (-1: from meta.json)"
    if not c['dataset'] and not c['data_dir']:
        return 'dataset and data_dir are empty: give --data_dir (a prepared chat dataset, tokenized for the model)'
    if not c['init_from']:
        return "init_from is empty: give the AR model to convert (an ar.py out_dir or a local HF dir), or 'scratch'"
    if c['attn_implementation'] not in ('auto', 'sdpa', 'eager', 'flex_attention'):
        return (f"attn_implementation={c['attn_implementation']!r} cannot take the I-DLM mask: use 'sdpa', 'eager' "
                f"or 'flex_attention' ('auto': flex on CUDA, sdpa elsewhere; flash_attention_2 ignores custom masks)")
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
    # config (every key: --key=value or a config/*.py file; `python idlm.py --help` lists them)
    # I/O
    out_dir = 'out-idlm-b1'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'out-ar-sudoku'  # the AR model to convert: an ar.py / idlm.py out_dir or a local HF dir | 'resume' |
    #                              'scratch' (a random causal model: no conversion, for tests)
    trust_remote_code = False  # needed for checkpoints with custom code; only set it for code you trust
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 400  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by ISD for exact-match accuracy and tokens per forward (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'idlm'  # wandb run name
    # data
    dataset = 'sudoku'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 64  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    supervise_padding = False  # padding is trained like ordinary tokens (NeMo's I-DLM recipe: off)
    # model (scratch only; a converted model keeps its own shape)
    model_type = 'qwen3'  # scratch architecture: 'qwen3' | 'llama'
    n_layer = 4  # transformer layers (scratch)
    n_head = 4  # attention heads (scratch)
    n_kv_head = 4  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 512  # MLP hidden size (scratch; 0 = 3 * n_embd)
    rope_theta = 10000.0  # RoPE base (scratch)
    attn_implementation = 'auto'  # 'auto' (flex_attention on CUDA, sdpa elsewhere) | 'sdpa' | 'eager' | 'flex_attention'
    # I-DLM
    mask_id = -1  # [MASK] token id (a reserved token); -1 = from meta.json / the tokenizer (Qwen3: 151669)
    block_length = 1  # the noisy block (the curriculum 1 -> 2 -> 3); ISD's stride is block_length + 1
    clean_loss_weight = 0.2  # α on CE_clean
    auto_balance_clean_loss = False  # α = sg(CE_noisy / CE_clean) instead (the paper's b3 stage)
    # optimizer
    learning_rate = 5e-4  # peak AdamW learning rate
    max_iters = 400  # optimizer steps
    weight_decay = 0.0  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 20  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 5e-5  # final learning rate
    # eval & sampling (the idlm sampler used for the accuracy eval: greedy ISD, stride block_length + 1)
    gen_length = 17  # tokens generated per val prompt (sudoku: 16 cells + EOS)
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    compile = False  # torch.compile the decoder and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    seed = 1337  # data order and init derive from it
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
    from data.loader import TokenDataset, batch_indices, global_rows
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
    source = ''  # the directory of the model to convert
    if init_from not in ('scratch', 'resume'):
        try:  # an ar.py / idlm.py out_dir (its hf/ export) or a HF dir
            source = os.path.abspath(sampler_lib.resolve_checkpoint(init_from))
        except FileNotFoundError as e:
            hint = ' (train it first: python ar.py config/ar_sudoku.py)' if init_from == 'out-ar-sudoku' else ''
            fail(f'init_from: {e}{hint}', 2)
    try:  # prepared, and its sources unchanged since (else one line with the data/prepare.py command to run)
        src_meta = {}
        if source and os.path.isfile(os.path.join(source, 'meta.json')):
            with open(os.path.join(source, 'meta.json')) as f:
                src_meta = json.load(f)
        byte = not source or src_meta.get('tokenizer') == 'byte'
        check_prepared(data_dir, 'byte' if byte else source, max_seq_len)
        train_ds, val_ds = TokenDataset(data_dir, 'train'), TokenDataset(data_dir, 'val')
        meta = train_ds.meta
        tokenizer = load_tokenizer(meta)
    except (OSError, ValueError) as e:
        fail(str(e), 1 if os.path.isdir(data_dir) else 2)  # a data_dir that does not exist is a bad setting
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    if meta.get('kind') == 'text':
        fail(f'{data_dir} is raw text: idlm.py trains on chat data (prompts and the answers to convert on)', 2)

    def get_batch(ds, idx):
        """The micro-batch dict of examples idx (B,): collated and all-masked (deterministic: no seeds)."""
        return make_batch(ds.examples(idx.tolist()), pad_id=pad_id, eos_id=eos_id, mask_id=mask_id,
                          max_seq_len=max_seq_len, pad_seq_len_divisible=pad_seq_len_divisible,
                          supervise_padding=supervise_padding)

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
    if attn_implementation == 'auto':
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
        model = hf.build_model('scratch', hf_config=json.loads(checkpoint['model_args']),
                               attn_implementation=attn_implementation)
        model.load_state_dict(checkpoint['model'])
        start_step = checkpoint['step']
    else:
        try:  # the model stays causal: its clean positions remain an AR model
            model = hf.build_model(source or 'scratch', vocab_size=meta['vocab_size'], model_type=model_type,
                                   n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                                   intermediate_size=intermediate_size, max_seq_len=max(max_seq_len, 256),
                                   rope_theta=rope_theta, trust_remote_code=trust_remote_code, bidirectional=False,
                                   attn_implementation=attn_implementation)
        except (OSError, ValueError) as e:  # a missing/incomplete checkpoint dir
            fail(str(e).splitlines()[0], 1)
    vocab = model.get_input_embeddings().weight.shape[0]
    if mask_id == -1:  # a resumed run keeps the [MASK] it was trained with
        mask_id = checkpoint['mask_id'] if checkpoint is not None else src_meta.get('mask_id', meta.get('mask_id', -1))
    try:
        check_mask_id(mask_id, vocab, pad_id, eos_id)
        if checkpoint is not None and mask_id != checkpoint['mask_id']:
            raise ValueError(f"mask_id={mask_id} but the checkpoint was trained with mask_id={checkpoint['mask_id']}")
    except ValueError as e:
        fail(str(e), 2)
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    idlm = IDLM(model, softcap=softcap, compiled_ce=compile)  # the module that DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: {n_params / 1e6:.2f}M parameters ({source or "scratch"}), vocab {vocab}, mask_id {mask_id}, '
           f'block_length {block_length}, world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = '
           f'{global_batch} examples/step')

    if compile:
        raw_model.get_decoder().compile()  # in place: state_dict keys keep their names (no _orig_mod.)
    if ddp and fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in hf.shard_units(raw_model):
            fully_shard(layer)
        fully_shard(idlm)  # the root: embeddings, final norm and the (tied) LM head
        train_model = idlm
    elif ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(idlm, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)
    else:
        train_model = idlm
    # the optimizer comes after fully_shard, which swaps parameters for sharded DTensors
    decay = [p for p in idlm.parameters() if p.dim() >= 2]
    no_decay = [p for p in idlm.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': weight_decay},
                                   {'params': no_decay, 'weight_decay': 0.0}],
                                  lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
    if checkpoint is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, StateDictOptions
        set_optimizer_state_dict(idlm, optimizer, checkpoint['optimizer'],
                                 options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(checkpoint['torch_rng'])
    checkpoint = None  # free memory

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, StateDictOptions
    # full (unsharded), name-keyed model + optimizer state: the same format with or without FSDP
    sd_options = StateDictOptions(full_state_dict=True, cpu_offload=ddp and fsdp)

    def model_state():
        return get_state_dict(idlm, optimizer, options=sd_options)  # a collective under FSDP: every rank calls it

    def save_checkpoint(step, metrics):
        msd, osd = model_state()
        msd = {k[len('model.'):]: v for k, v in msd.items()}  # keys of the bare HF model
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (a plain causal LM; sample.py --checkpoint out_dir decodes it with ISD)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': 'idlm',
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'mask_id': mask_id, 'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'mask_id': mask_id, 'family': 'idlm', 'sampler': 'idlm',
                                  'gen_length': gen_length, 'block_length': block_length}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    n_acc = min(eval_samples, len(val_ds))
    if eval_iters == 0:
        print0('note: eval_iters=0: evals compute no val_loss')
    acc_rows = []  # (prompt ids incl. the assistant header, reference answer text) of the first n_acc val examples
    for i in range(n_acc):
        ids, lm = val_ds.example(i)
        start = int(np.argmax(lm > 0))  # single-turn: the response is the supervised suffix
        acc_rows.append((ids[:start].tolist(), tokenizer.decode(ids[start:].tolist())))

    @torch.no_grad()
    def accuracy():
        """Exact match and tokens per forward of greedy ISD (stride block_length + 1) on the first eval_samples val
        prompts, split over ranks; every rank runs the same number of batches. Under FSDP every unit is gathered for
        the whole run (rows accept different lengths, so ranks run different numbers of forwards)."""
        per_rank = math.ceil(n_acc / ddp_world_size)
        mine = [ddp_rank * per_rank + j for j in range(per_rank)]
        hits = torch.zeros(4, device=device)  # correct, counted, response tokens, row forwards
        units = hf.shard_units(raw_model) + [idlm] if ddp and fsdp else []
        for unit in units:
            unit.set_reshard_after_forward(False)
            unit.unshard()
        for s in range(0, per_rank, batch_size):
            rows = mine[s:s + batch_size]
            prompts = [acc_rows[min(i, n_acc - 1)][0] for i in rows]
            st = {}
            with autocast:
                gen = sampler_lib.generate(raw_model, prompts, sampler='idlm', mask_id=mask_id, pad_id=pad_id,
                                           eos_id=eos_id, gen_length=gen_length, block_length=block_length, stats=st)
            for i, g in zip(rows, gen):
                if i < n_acc:
                    hits[:2] += torch.tensor([tokenizer.decode(g).strip() == acc_rows[i][1].strip(), 1.0],
                                             device=device)
            hits[2:] += torch.tensor([sum(len(g) for g in gen), st.get('row_nfe', 0)], device=device)
        for unit in units:
            unit.set_reshard_after_forward(True)
            unit.reshard()
        all_sum(hits)
        return (hits[0] / hits[1].clamp_min(1)).item(), (hits[2] / hits[3].clamp_min(1)).item()

    @torch.no_grad()
    def evaluate(step):
        """Val loss (both terms, global denominators), then exact match and tokens per forward of greedy ISD on the
        first eval_samples val prompts. Runs on every rank; sums are all-reduced."""
        idlm.eval()
        tot = torch.zeros(3, device=device)  # Σ CE_noisy, Σ CE_clean, Σ supervised
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds))
            with autocast:
                ce, _ = train_model(*(mb[k].to(device) for k in ('xt', 'x0', 'targets', 'weights')),
                                    attention_for(raw_model, mb, block_length, device))
            tot += torch.cat([ce.float(), mb['weights'].sum().to(device)[None]])
        all_sum(tot)
        out = {}
        if eval_iters > 0:  # no batch, no loss
            out = {'val_loss_noisy': (tot[0] / tot[2].clamp_min(1)).item(),
                   'val_loss_clean': (tot[1] / tot[2].clamp_min(1)).item()}
        if n_acc > 0:
            out['accuracy'], out['tokens_per_forward'] = accuracy()
        idlm.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    # the resolved values ('auto', -1 and the like replaced by what this run uses), logged and saved with ckpt.pt
    config.update(device=device, dtype=dtype, mask_id=mask_id, lr_decay_iters=lr_decay_iters, data_dir=data_dir,
                  attn_implementation=attn_implementation, world_size=ddp_world_size, git_commit=git_commit(),
                  source=source)
    resumed = ''  # a resumed run: the settings it changes take effect, and are logged
    if saved is not None:
        moved = [f'{k} {saved[k]!r} -> {v!r}' for k, v in config.items()
                 if k in saved and saved[k] != v and k not in ('init_from', 'git_commit', 'source')]
        resumed = f"resume from step {start_step}: {'changed ' + ', '.join(moved) if moved else 'no setting changed'}"
        print0(resumed)
    if master_process:
        log_file = open(os.path.join(out_dir, 'log.txt'), 'a')
        log_file.write(f'# idlm.py torch {torch.__version__} device {device} world {ddp_world_size}\n'
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
        # collate every micro-batch first: the loss denominator is the GLOBAL supervised count
        micro = []
        for m in range(grad_accum):
            idx = batch_indices(len(train_ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            micro.append(get_batch(train_ds, idx))
        counts = torch.tensor([sum(mb['weights'].sum() for mb in micro), sum(2 * mb['x0'].numel() for mb in micro)],
                              dtype=torch.float64, device=device)
        n_sup, n_tok = all_sum(counts).tolist()
        loss_sum = torch.zeros(5, device=device)  # Σ loss, Σ CE_noisy, Σ CE_clean (both / n_sup), noisy, clean hits
        for m, mb in enumerate(micro):
            last = m == grad_accum - 1
            if ddp and fsdp:
                train_model.set_requires_gradient_sync(last)
            elif ddp:
                # set before forward: DDP reads it there (setting it late silently breaks accumulation)
                train_model.require_backward_grad_sync = last
            with autocast:
                ce, hits = train_model(*(mb[k].to(device) for k in ('xt', 'x0', 'targets', 'weights')),
                                       attention_for(raw_model, mb, block_length, device))
                ce = ce / max(n_sup, 1.0)  # both terms over the global number of supervised tokens
                loss, alpha = total_loss(ce[0], ce[1], clean_loss_weight=clean_loss_weight,
                                         auto_balance=auto_balance_clean_loss)
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += torch.cat([loss.detach().float()[None], ce.detach().float(), hits.float()])
        grad_norm = torch.nn.utils.clip_grad_norm_(idlm.parameters(), grad_clip if grad_clip > 0 else float('inf'))
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
                   'ce_noisy': loss_sum[1].item(), 'ce_clean': loss_sum[2].item(),
                   'noisy_acc': loss_sum[3].item() / max(n_sup, 1.0), 'clean_acc': loss_sum[4].item() / max(n_sup, 1.0),
                   'supervised_tokens': int(n_sup), 'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"ce_noisy {metrics['ce_noisy']:.4f} | ce_clean {metrics['ce_clean']:.4f} | noisy_acc "
                    f"{metrics['noisy_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | dt {dt*1000:.0f}ms")
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
        print0(f"ISD tokens per forward on {dataset}: {metrics['tokens_per_forward']:.2f} (stride {block_length + 1})")
        print0(f"held-out exact-match accuracy on {dataset}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
