"""
skeleton.py: the run machinery every family script imports unchanged, so a family script (and a fork of one) reads
as its method and its training loop, not plumbing; nanochat's scripts import common.py and checkpoint_manager.py
the same way. The functions read no config globals: a script passes what it uses.

    distributed    init_distributed, micro_steps, precision, print0, all_sum, from_rank0, finish, fail
    settings       MODEL_KEYS, settings_error, resume_error, get_lr, git_commit
    checkpoints    lock_out_dir, save_run, load_run, die_at, StopSignal
    a run's life   open_data, claim_out_dir, load_resume, model_for_run, mask_id_for_run, wrap, gathered, adamw,
                   full_state, resolve_config, RunLog, eval_line, stop_if_not_finite, Saver, guarded_eval
    randomness     corruption_seeds, fill_length, check_mask_id
    the eval       eval_rows, answer_rows, exact_match, causal_lm_error

What a family changes (its model, corruption, loss, batch, eval and the training loop itself: micro-steps, the DDP
sync toggle, the global denominator, backward, clip, step) stays written out in its script.
"""
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# distributed

def init_distributed(device):
    """Join torchrun's process group when launched by it (RANK set): nccl on CUDA, gloo on CPU. device 'auto' means
    CUDA when there is one; under torchrun a CUDA device becomes cuda:<LOCAL_RANK>.
    Returns (ddp, rank, local_rank, world_size, device)."""
    ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if not ddp:
        return False, 0, 0, 1, device
    rank, local_rank, world_size = int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return True, rank, local_rank, world_size, device


def micro_steps(gradient_accumulation_steps, world_size):
    """Micro-steps per optimizer step on this rank: gradient_accumulation_steps counts them over all ranks, so it
    must divide by the world size (else one line, exit 2)."""
    if gradient_accumulation_steps % world_size:
        fail(f'gradient_accumulation_steps={gradient_accumulation_steps} (the total over ranks) must be divisible by '
             f'the world size {world_size}', 2)
    return gradient_accumulation_steps // world_size


def precision(dtype, device_type):
    """The resolved dtype name ('auto': bfloat16 on CUDA, float32 on CPU) and its autocast context (a no-op for
    float32). On CUDA, bfloat16 lets the float32 matmuls autocast leaves use TF32; float32 means IEEE float32
    everywhere, flex_attention's Triton kernels included (they follow this flag; with TF32 on, bench.py's float32
    flex run of gemma_bd drifted 2.5e-3 from SDPA's in 3 steps on an H200)."""
    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dtype == 'bfloat16'
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
    return dtype, nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type, dtype=ptdtype)


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*a, **k):
    """print on rank 0 only (flushed: torchrun interleaves the ranks' streams)."""
    if _rank() == 0:
        print(*a, **k, flush=True)


def all_sum(t):
    """t summed over ranks, in place (itself on one process)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def from_rank0(obj):
    """rank 0's obj on every rank: the verdict of what only rank 0 checks (out_dir's lock and files)."""
    if dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj


def finish(code=0):
    """Exit with code. gloo ranks sometimes abort at interpreter shutdown, so a distributed run tears its process
    group down explicitly and leaves with os._exit."""
    sys.stdout.flush(); sys.stderr.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
        os._exit(code)
    sys.exit(code)


def fail(message, code):
    """`error: message`, one line on stderr (from rank 0: every rank reaches the same verdict), then exit with
    code: 2 for a usage error (a bad setting or combination, found before training), 1 for a run-time failure."""
    if _rank() == 0:
        print(f'error: {message}', file=sys.stderr)
    finish(code)

# -----------------------------------------------------------------------------
# settings, out_dir and checkpoints


MODEL_KEYS = ('model_type', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'intermediate_size', 'rope_theta')  # shape
LORA_KEYS = ('lora_r', 'lora_alpha', 'lora_dropout', 'lora_target_modules')  # the adapters: fixed for a run


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
    if c['attn_implementation'] not in ('auto', 'sdpa', 'eager', 'flex_attention'):
        return (f"attn_implementation={c['attn_implementation']!r} must be 'auto', 'sdpa', 'eager' or 'flex_attention' "
                f"(the families' masks are explicit: flash_attention_2 would ignore them)")
    if c['attn_implementation'] == 'flex_attention' and (c['device'] == 'cpu' or not torch.cuda.is_available()):
        return 'attn_implementation=flex_attention needs CUDA (flex_attention has no backward on CPU)'
    if not re.fullmatch(r'auto|cpu|cuda(:\d+)?', c['device']):
        return f"device={c['device']!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'"
    if c['device'].startswith('cuda') and int(c['device'][5:] or 0) >= torch.cuda.device_count():
        return f"device={c['device']!r} but torch {torch.__version__} sees {torch.cuda.device_count()} CUDA devices"
    if c['wandb_log'] and importlib.util.find_spec('wandb') is None:
        return 'wandb_log=True but wandb is not installed (pip install wandb, or --wandb_log=False)'
    if c.get('lora_r', 0):
        if c['lora_r'] < 0 or c['lora_alpha'] <= 0 or not 0 <= c['lora_dropout'] < 1:
            return (f"lora_r={c['lora_r']} must be >= 0 (0: full fine-tuning), lora_alpha={c['lora_alpha']} > 0 and "
                    f"lora_dropout={c['lora_dropout']} in [0, 1)")
        if c['init_from'] == 'scratch':
            return ('lora_r > 0 adapts a trained model: give --init_from=<its directory> (a scratch model has '
                    'nothing to adapt)')
        if importlib.util.find_spec('peft') is None:
            return 'lora_r > 0 needs peft (pip install -r requirements.txt)'
    return None


def resume_error(config, given, saved, keys=MODEL_KEYS):
    """On resume: the first model-shape key (of keys) set on this run (given: {key: where}) to a value other than the
    one the checkpoint's model was built with (saved: its config), as one line; None if they agree."""
    for k in keys:
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
    written); NANODLM_DIE_AT=eval makes the eval raise instead (guarded_eval). Unset, it does nothing."""
    if os.environ.get('NANODLM_DIE_AT') in (phase, f'{phase}:{step}'):
        os.kill(os.getpid(), signal.SIGKILL)


def save_run(out_dir, ckpt, model, state_dict, meta, tokenizer):
    """out_dir/ckpt.pt, then the HF export out_dir/hf (meta.json records the step), each replaced whole: ckpt.pt.tmp
    is renamed over ckpt.pt, and a complete hf.tmp over hf (hf -> hf.old, hf.tmp -> hf). A kill at any point leaves
    a loadable ckpt.pt and a whole hf/, which may be older than ckpt.pt (its meta.json says which step it is); a
    kill between the two renames leaves hf.old, which the next run puts back."""
    import hf
    path, step = os.path.join(out_dir, 'ckpt.pt'), ckpt['step']
    lora = hf.lora_config(model)
    if lora is not None:  # LoRA: ckpt.pt keeps the adapters (and their AdamW state) and the base they adapt
        ckpt = {**ckpt, 'model': {k: v for k, v in state_dict.items() if '.lora_' in k},
                'lora_base': lora.base_model_name_or_path}
    torch.save(ckpt, path + '.tmp')
    die_at('save', step)
    os.replace(path + '.tmp', path)
    die_at('renamed', step)
    hf_dir = os.path.join(out_dir, 'hf')
    tmp, old = hf_dir + '.tmp', hf_dir + '.old'
    shutil.rmtree(tmp, ignore_errors=True)
    if lora is None:
        model.save_pretrained(tmp, state_dict=state_dict)
    else:  # a peft adapter of its base (PeftModel.from_pretrained(base, hf) loads it); lora_merge: hf/ is the merged
        #    model and the adapter moves to hf/adapter (transformers would apply an adapter found next to weights again)
        from safetensors.torch import save_file
        merge = ckpt['config'].get('lora_merge')
        if merge:
            model.save_pretrained(tmp, state_dict=hf.merged_state(model, state_dict))
        adapter = os.path.join(tmp, 'adapter') if merge else tmp
        os.makedirs(adapter, exist_ok=True)
        lora.save_pretrained(adapter)
        save_file(hf.adapter_state(model, state_dict), os.path.join(adapter, 'adapter_model.safetensors'))
        meta = {**meta, 'lora_base': lora.base_model_name_or_path}
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
# a run's life: data, out_dir, resume, wrapping, optimizer, checkpoints, logging

HERE = os.path.dirname(os.path.abspath(__file__))


def open_data(dataset, data_dir, max_seq_len, tokenizer_source):
    """The prepared splits of a synthetic task (generated into data/<task> on first use) or of data_dir, checked
    against their sources and tokenizer (else one line with the data/prepare.py command to run).
    Returns (data_dir, train_ds, val_ds, meta, tokenizer, text); text: raw text, windows of max_seq_len tokens."""
    from data.loader import TokenDataset, TextWindows
    from data.prepare import check_prepared, ensure_synthetic
    from data.synthetic import TASKS
    from data.tokenizer import load_tokenizer
    synthetic = not data_dir and dataset in TASKS  # only a named synthetic task is generated, into data/<task>
    data_dir = os.path.normpath(data_dir or os.path.join(HERE, 'data', dataset))
    if synthetic and _rank() == 0:
        ensure_synthetic(dataset, data_dir, max_seq_len=max_seq_len, seed=0)
    if dist.is_initialized():
        dist.barrier()
    try:
        check_prepared(data_dir, tokenizer_source, max_seq_len)
        train_ds, val_ds = TokenDataset(data_dir, 'train'), TokenDataset(data_dir, 'val')
        meta = train_ds.meta
        tokenizer = load_tokenizer(meta)
    except (OSError, ValueError) as e:
        fail(str(e), 1 if os.path.isdir(data_dir) else 2)  # a data_dir that does not exist is a bad setting
    text = meta.get('kind') == 'text'
    if text:
        try:
            train_ds, val_ds = TextWindows(train_ds, max_seq_len), TextWindows(val_ds, max_seq_len)
        except ValueError as e:
            fail(f'{data_dir}: {e}', 1)
    return data_dir, train_ds, val_ds, meta, tokenizer, text


def open_late_split(curriculum_data, data_dir, meta, text, max_seq_len, tokenizer_source):
    """The train split of curriculum_data (a synthetic task or a prepared dir, as `dataset`) that a curriculum
    switches to, checked to be chat data with data_dir's tokenizer (else one line, exit 2)."""
    late_dir, late_ds, _, late_meta, _, late_text = open_data(curriculum_data, '', max_seq_len, tokenizer_source)
    same = ('tokenizer', 'tokenizer_path', 'vocab_size', 'pad_id', 'eos_id')
    if late_text or text or any(late_meta.get(k) != meta.get(k) for k in same):
        fail(f"curriculum_data={curriculum_data}: {late_dir} must be chat data with {data_dir}'s tokenizer "
             f"(the same {', '.join(same)})", 2)
    return late_ds


def _claim(out_dir, ckpt_path, hf_dir, init_from, overwrite):
    """claim_out_dir's work on rank 0: (the lock file or None, (exit code, message); code 0 when claimed)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return None, (2, f'out_dir={out_dir} is a file, not a directory')
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock, busy = lock_out_dir(out_dir)
    except OSError as e:  # a parent that is a file, no permission, a full disk
        return None, (2, f'out_dir={out_dir} cannot be used: {e.strerror or e}')
    if busy:
        return None, (1, busy)
    if init_from != 'resume' and os.path.exists(ckpt_path) and not overwrite:
        return lock, (2, f'{ckpt_path} exists: --init_from=resume continues that run, --overwrite=True replaces it')
    if not os.path.isdir(hf_dir) and os.path.isdir(hf_dir + '.old'):  # a kill between save_run's renames
        os.replace(hf_dir + '.old', hf_dir)
    return lock, (0, '')


def claim_out_dir(out_dir, init_from, overwrite):
    """out_dir holds one run at a time and a fresh run never replaces its checkpoint: rank 0 takes out_dir/lock for
    the run's life (keep the returned file open) and refuses an existing ckpt.pt unless init_from is 'resume' or
    overwrite is set; a kill between save_run's two renames (hf.old left, no hf) is repaired.
    Returns (ckpt_path, hf_dir, lock); a refusal is one line and exit 1 (busy) or 2."""
    ckpt_path, hf_dir = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'hf')
    lock, verdict = None, (0, '')  # (exit code, message) of rank 0
    if _rank() == 0:
        lock, verdict = _claim(out_dir, ckpt_path, hf_dir, init_from, overwrite)
    code, message = from_rank0(verdict)
    if code:
        fail(message, code)
    return ckpt_path, hf_dir, lock


def load_resume(ckpt_path, family, config, given, shape_keys=()):
    """The checkpoint a resumed run continues: it must exist, load, come from this family (another family's run is
    never trained on or overwritten) and have steps left; a model-shape key (MODEL_KEYS and the family's own
    shape_keys) set on this run must agree with it, and config takes the checkpoint's values of them.
    Returns (checkpoint, its config)."""
    if not os.path.exists(ckpt_path):
        fail(f'init_from=resume but {ckpt_path} does not exist', 1)
    try:
        checkpoint = load_run(ckpt_path)
    except RuntimeError as e:
        fail(str(e), 1)
    if checkpoint.get('family') != family:
        fail(f"{ckpt_path} was written by the {checkpoint.get('family')!r} family, not {family!r}: resume it with "
             f"its own script, or start a {family} run in another out_dir", 2)
    saved = checkpoint['config']  # the settings it was trained with
    keys = MODEL_KEYS + LORA_KEYS + tuple(shape_keys)
    problem = resume_error(config, given, saved, keys)
    if problem:
        fail(problem, 2)
    if checkpoint['step'] >= config['max_iters']:
        fail(f"{ckpt_path} is at step {checkpoint['step']} >= max_iters={config['max_iters']}: nothing to train", 2)
    base = checkpoint.get('lora_base')
    if base and not os.path.isfile(os.path.join(base, 'config.json')):
        fail(f'{ckpt_path} holds LoRA adapters of {base}, which has no config.json: restore the base model there', 1)
    config.update({k: saved[k] for k in keys if k in saved})  # the model it is
    return checkpoint, saved



def model_for_run(init_from, checkpoint, hf_dir, config, *, vocab_size, bidirectional, attn_implementation):
    """The run's Hugging Face model. Resumed (checkpoint given): the architecture it was saved with (remote code from
    its export hf_dir) and its weights. Else a scratch model of config's shape keys (model_type, n_layer, ...) or the
    local checkpoint dir init_from, bidirectional or causal. A missing or incomplete dir is one line, exit 1."""
    import hf
    try:
        if checkpoint is not None and checkpoint.get('lora_base'):  # the frozen base (lora_for_run: the adapters)
            return hf.build_model(checkpoint['lora_base'], bidirectional=bidirectional,
                                  trust_remote_code=config['trust_remote_code'], attn_implementation=attn_implementation)
        if checkpoint is not None:
            hf_config = json.loads(checkpoint['model_args'])
            if 'auto_map' in hf_config:  # remote-code model: its code travels with the HF export
                model = hf.build_model(hf_dir, trust_remote_code=config['trust_remote_code'],
                                       bidirectional=bidirectional, attn_implementation=attn_implementation)
            else:
                model = hf.build_model('scratch', hf_config=hf_config, attn_implementation=attn_implementation)
            model.load_state_dict(checkpoint['model'])
            return model
        return hf.build_model(init_from, vocab_size=vocab_size, **{k: config[k] for k in MODEL_KEYS},
                              max_seq_len=max(config['max_seq_len'], 256), bidirectional=bidirectional,
                              trust_remote_code=config['trust_remote_code'], attn_implementation=attn_implementation)
    except (OSError, ValueError) as e:  # a missing/incomplete checkpoint dir
        fail(str(e).splitlines()[0], 1)


def lora_for_run(model, config, checkpoint, base):
    """lora_r > 0: LoRA adapters (peft) on the model's linear layers (lora_target_modules), every other weight frozen;
    on resume the adapters trained so far. base: the directory the model's weights came from (the checkpoint's own
    base on resume). lora_r = 0: the model as is (full fine-tuning). -> the model."""
    if not config.get('lora_r'):
        return model
    import hf
    base = checkpoint['lora_base'] if checkpoint is not None else base
    try:
        hf.add_lora(model, r=config['lora_r'], alpha=config['lora_alpha'], dropout=config['lora_dropout'],
                    target_modules=config['lora_target_modules'], base=base)
    except ValueError as e:
        fail(str(e), 2)
    if checkpoint is not None:
        missing, unexpected = model.load_state_dict(checkpoint['model'], strict=False)
        lost = [k for k in missing if '.lora_' in k] + unexpected
        if lost:
            fail(f'the checkpoint does not fit the adapters: {lost[0]}', 1)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print0(f"LoRA r={config['lora_r']}, alpha={config['lora_alpha']} on {config['lora_target_modules']}: "
           f"{n / 1e6:.3f}M of {total / 1e6:.2f}M parameters trained, the rest frozen ({base})")
    return model


def mask_id_for_run(mask_id, checkpoint, default, vocab_size, pad_id, eos_id):
    """The run's [MASK] id: mask_id, else (-1) the one a resumed checkpoint was trained with, else default (meta.json
    or the tokenizer's). Not a real embedding row, pad or eos, or not the checkpoint's: one line, exit 2."""
    if mask_id == -1:
        mask_id = checkpoint['mask_id'] if checkpoint is not None else default
    try:
        check_mask_id(mask_id, vocab_size, pad_id, eos_id)
        if checkpoint is not None and mask_id != checkpoint['mask_id']:
            raise ValueError(f"mask_id={mask_id} but the checkpoint was trained with mask_id={checkpoint['mask_id']}")
    except ValueError as e:
        fail(str(e), 2)
    return mask_id

def wrap(module, units, *, fsdp, device_type, local_rank, checkpointed=None, compiled=()):
    """module (the one nn.Module whose forward returns the loss) made ready to train, in the one order that
    composes: activation checkpointing of the HF model `checkpointed` (None: off), then torch.compile of each module
    in `compiled` (in place: state_dict keys keep their names, no _orig_mod.), then data parallelism under torchrun:
    FSDP2 (each of units sharded, then the root) or DDP; on one process, itself. So each block's recompute and
    compiled graph stay inside its FSDP unit. The families compile block by block: one traced block whose graph the
    others reuse, not a whole decoder traced layer after layer. Returns (train_model, the FSDP units incl. the root,
    for gathered())."""
    if checkpointed is not None:
        checkpoint_activations(checkpointed)
    for m in compiled:
        m.compile()
    if not dist.is_initialized():
        return module, []
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for unit in units:
            fully_shard(unit)
        fully_shard(module)  # the root: what no unit holds (embeddings, final norm, the tied LM head)
        # a list unit (modules sharing weights) is one FSDP module, reached through its first member
        return module, [u[0] if isinstance(u, (list, tuple)) else u for u in units] + [module]
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(module, device_ids=[local_rank] if device_type == 'cuda' else None), []


def checkpoint_activations(model):
    """activation_checkpointing=True: every transformer block of the HF model recomputes its forward in backward
    (hf.checkpoint_layers). Call it before compile and wrap. A model that cannot is one line, exit 2."""
    import hf
    try:
        n = hf.checkpoint_layers(model)
    except ValueError as e:
        fail(f'activation_checkpointing: {e}', 2)
    print0(f'activation checkpointing: {n} blocks recompute their forward in backward')


@contextmanager
def gathered(units):
    """The context every family's sampling eval runs in. Every FSDP unit gathered whole for the block and kept so,
    then resharded: the one FSDP-safe way to run an eval whose ranks may make different numbers of forward calls (a
    sampler that stops at EOS or accepts a different number of drafted tokens): no collective happens inside. No-op
    without FSDP (units empty). And --compile'd blocks run eager inside: cached decoding at changing lengths would
    recompile every block, using up dynamo's recompile limit that training's graphs share."""
    for unit in units:
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        with torch.compiler.set_stance('force_eager'):
            yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True)
            unit.reshard()


def adamw(module, *, learning_rate, weight_decay, beta1, beta2, device_type, checkpoint=None):
    """AdamW over module's trainable parameters: weight decay on the 2-D ones (matrices, embeddings), none on gains
    and biases. Made after wrap (fully_shard swaps parameters for sharded DTensors). With checkpoint: its
    optimizer state (full, name-keyed) and torch RNG state are restored, for a bit-exact resume."""
    trained = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{'params': [p for p in trained if p.dim() >= 2], 'weight_decay': weight_decay},
                                   {'params': [p for p in trained if p.dim() < 2], 'weight_decay': 0.0}],
                                  lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
    if checkpoint is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, StateDictOptions
        set_optimizer_state_dict(module, optimizer, checkpoint['optimizer'],
                                 options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(checkpoint['torch_rng'])
    return optimizer


def full_state(module, optimizer, prefix=''):
    """The full (unsharded), name-keyed model and optimizer state dicts, the same format with or without FSDP, the
    model's keys without prefix (e.g. 'model.': the bare HF model's names). A collective under FSDP: every rank
    calls it; under FSDP the tensors land on the CPU."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions
    sharded = any(type(p).__name__ == 'DTensor' for p in module.parameters())
    msd, osd = get_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=sharded))
    stray = [k for k in msd if not k.startswith(prefix)]
    if stray:  # a parameter outside the wrapped model would be lost from the export
        raise ValueError(f'full_state: {stray[0]} does not start with {prefix!r}')
    return {k[len(prefix):]: v for k, v in msd.items()}, osd


def resolve_config(config, saved, start_step, **resolved):
    """config with the values this run resolved ('auto', -1 and the like) and the git commit: what is logged and
    saved with ckpt.pt. On resume, the line naming the settings it changes (they take effect), else ''."""
    config.update(resolved, git_commit=git_commit())
    if saved is None:
        return ''
    moved = [f'{k} {saved[k]!r} -> {v!r}' for k, v in config.items()
             if k in saved and saved[k] != v and k not in ('init_from', 'git_commit')]
    return f"resume from step {start_step}: {'changed ' + ', '.join(moved) if moved else 'no setting changed'}"


class RunLog:
    """A run's log: stdout (rank 0), out_dir/log.txt (appended; headed by the torch version, device, world size,
    the resolved config and the resume line) and Weights & Biases when wandb_log is set."""

    def __init__(self, out_dir, script, config, resumed, *, device, world_size):
        self.file, self.wandb = None, None
        if resumed:
            print0(resumed)
        if _rank() != 0:
            return
        self.file = open(os.path.join(out_dir, 'log.txt'), 'a')
        self.file.write(f'# {script} torch {torch.__version__} device {device} world {world_size}\n'
                        f'# config {json.dumps(config)}\n' + (f'# {resumed}\n' if resumed else ''))
        if config.get('wandb_log'):
            import wandb
            wandb.init(project=config['wandb_project'], name=config['wandb_run_name'], config=config)
            self.wandb = wandb

    def __call__(self, line, metrics=None, step=None):
        """Print line (rank 0), append it to log.txt, send metrics to wandb."""
        print0(line)
        if self.file is not None:
            self.file.write(line + '\n')
            self.file.flush()
            if self.wandb is not None and metrics:
                self.wandb.log(metrics, step=step)


def eval_line(step, ev):
    return f'eval step {step} | ' + (' | '.join(f'{k} {v:.4f}' for k, v in ev.items()) or 'nothing to report')


def stop_if_not_finite(step_loss, grad_norm, step, ckpt_path):
    """A non-finite loss or gradient norm stops the run with one line (exit 1) before the optimizer step."""
    if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
        fail(f'non-finite loss {step_loss} / grad_norm {float(grad_norm)} at step {step}; stopping. '
             + (f'The last good checkpoint ({ckpt_path}) is untouched.' if os.path.exists(ckpt_path) else
                'No checkpoint was saved yet.'), 1)


class Saver:
    """When to checkpoint: every ckpt_interval steps, after ckpt_interval_min minutes of wall time since the last
    save, and on SIGINT/SIGTERM (StopSignal). Every rank must take part in a save (a collective under FSDP), so
    rank 0's clock and any rank's signal decide, summed over ranks."""

    def __init__(self, ckpt_interval, ckpt_interval_min, device, *, eval_interval, max_iters, evaluate, save, log,
                 ckpt_path):
        self.interval, self.minutes, self.device = ckpt_interval, ckpt_interval_min, device
        self.eval_interval, self.max_iters, self.ckpt_path = eval_interval, max_iters, ckpt_path
        self.evaluate, self.save, self.log = evaluate, save, log  # evaluate(step) -> dict; save(step, metrics)
        self.stop = StopSignal()
        self.last = time.time()

    def end_of_step(self, step, metrics):
        """After optimizer step `step`: the eval at every eval_interval and at max_iters (its numbers logged and
        added to metrics; an exception in it saves the steps trained first, then stops with one line), a checkpoint
        then, every ckpt_interval steps or ckpt_interval_min minutes, and on SIGINT/SIGTERM (save, then exit
        128 + the signal). True when it evaluated or saved (time the step clock should not count)."""
        is_eval = (self.eval_interval > 0 and step % self.eval_interval == 0) or step == self.max_iters
        due, stopping = self.due(step)  # the same verdict on every rank (a save is a collective under FSDP)
        if is_eval:
            ev = guarded_eval(self.evaluate, step, lambda: self.save(step, metrics), self.ckpt_path)
            metrics.update(ev)
            self.log(eval_line(step, ev), ev, step)
        if is_eval or due or stopping:
            self.save(step, metrics)
            self.last = time.time()
        if stopping and step < self.max_iters:
            print0(f'stopped by a signal after step {step}, saved in {self.ckpt_path}: --init_from=resume continues')
            finish(self.exit_code())
        return is_eval or due or stopping

    def due(self, step):
        """(a periodic save is due, a signal asks to stop): the same verdict on every rank."""
        due = (self.interval > 0 and step % self.interval == 0) or \
            (_rank() == 0 and self.minutes > 0 and time.time() - self.last >= 60 * self.minutes)
        due, stopping = all_sum(torch.tensor([float(due), float(self.stop.signum > 0)], device=self.device)).tolist()
        return bool(due), bool(stopping)

    def exit_code(self):
        return 128 + (self.stop.signum or signal.SIGTERM)


def guarded_eval(evaluate, step, save, ckpt_path):
    """evaluate(step), whose exception (a bad eval setting found only now, a sampler bug) first saves the steps
    trained (save()), then stops the run with one line (exit 1): an eval failure never loses training."""
    try:
        if os.environ.get('NANODLM_DIE_AT') == 'eval':  # test hook (tests/test_reliability.py): an eval that raises
            raise RuntimeError('NANODLM_DIE_AT=eval')
        return evaluate(step)
    except Exception as e:
        save()
        fail(f'the eval at step {step} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); '
             f'training up to step {step} is saved in {ckpt_path} (--init_from=resume continues it once the eval '
             f'settings are fixed)', 1)

# -----------------------------------------------------------------------------
# per-row randomness and token ids every family checks the same way

def corruption_seeds(seed, step, global_rows, global_batch, stream=1):
    """One 63-bit seed per row, a pure function of (seed, step, the row's place in the global batch): the same tokens
    get the same noise whatever the world size or accumulation split, and a resumed run replays it. stream
    (2**(42 + stream) added) keeps a family's draws apart from other families' (llada, scdd, hybrid: 1; gemma_bd: 2;
    dflash: 3), so one seed does not give two methods correlated noise; 2654435761 (Knuth's multiplicative hash)
    spreads consecutive rows over the seed space."""
    idx = step * global_batch + global_rows.long()  # (B,)
    return (seed + 2**(42 + stream) + 2654435761 * idx) & (2**63 - 1)


def fill_length(seed, step, hi):
    """The canvas every row of a step is EOS-filled to: uniform in [0, hi] from (seed, step), the same on every rank
    and micro-step (a family's batch never fills a row below the batch's longest). Drawn per step, not fixed as in
    LLaDA SFT, it trains both tight canvases (a sampler's gen_length equal to the answer) and long ones."""
    if hi <= 0:
        return 0
    g = torch.Generator().manual_seed((seed * 1_000_003 + step + 2**40) & (2**63 - 1))
    return int(torch.randint(hi + 1, (1,), generator=g))


def check_mask_id(mask_id, vocab_size, pad_id=-1, eos_id=-1):
    """mask_id must be a real embedding row and must not collide with pad/eos (they are trained as content)."""
    if not (0 <= mask_id < vocab_size):
        raise ValueError(f'mask_id={mask_id} is outside the vocabulary [0, {vocab_size})')
    if mask_id in (pad_id, eos_id):
        raise ValueError(f'mask_id={mask_id} equals the {"pad" if mask_id == pad_id else "eos"} id; pick a dedicated '
                         f'mask token')

# -----------------------------------------------------------------------------
# the exact-match eval every family reports (its own sampler decodes)

def eval_rows(val_ds, tokenizer, *, eval_samples, gen_length, text, eval_iters, data_dir):
    """The val prompts the eval decodes (answer_rows of the first eval_samples; none for raw text, which has no
    prompts), with a note line for an eval that will report no accuracy or no val_loss."""
    if text and eval_samples > 0:
        print0(f'note: {data_dir} is raw text (no prompts): eval reports val_loss only, not accuracy')
    if eval_iters == 0:
        print0('note: eval_iters=0: evals compute no val_loss')
    return answer_rows(val_ds, 0 if text else min(eval_samples, len(val_ds)), tokenizer, gen_length)


def answer_rows(val_ds, n, tokenizer, gen_length=0):
    """[(prompt ids incl. the assistant header, reference answer text)] of the first n val examples (single-turn: the
    response is the supervised suffix). With gen_length: a warning line when some responses (their end token
    included) are longer, since those can never be matched."""
    import numpy as np
    rows, lengths = [], []
    for i in range(n):
        ids, lm = val_ds.example(i)
        start = int(np.argmax(lm > 0))
        rows.append((ids[:start].tolist(), tokenizer.decode(ids[start:].tolist())))
        lengths.append(len(ids) - start)
    too_long = sum(k > gen_length for k in lengths) if gen_length else 0
    if too_long:
        print0(f'warning: gen_length={gen_length} is shorter than {too_long} of the {n} eval answers (the longest '
               f'is {max(lengths)} tokens with its end token): those can never match')
    return rows


def exact_match(decode, rows, tokenizer, batch_size, device, n_stats=0):
    """Exact match of decode on rows [(prompt ids, reference text)], split over ranks: every rank decodes the same
    number of batches (its last one padded with the last prompt, not scored). decode(prompts) -> (the generated ids
    of each prompt, n_stats numbers to sum, e.g. accepted tokens and rounds). Run it inside gathered() under FSDP.
    Returns (accuracy, [each stat summed over batches and ranks])."""
    n = len(rows)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    per_rank = math.ceil(n / world)
    mine = [rank * per_rank + j for j in range(per_rank)]
    tot = torch.zeros(2 + n_stats, device=device)  # correct, counted, the stats
    for s in range(0, per_rank, batch_size):
        batch = mine[s:s + batch_size]
        gen, stats = decode([rows[min(i, n - 1)][0] for i in batch])
        if n_stats:
            tot[2:] += torch.tensor(stats, dtype=tot.dtype, device=device)
        for i, g in zip(batch, gen):
            if i < n:
                tot[:2] += torch.tensor([tokenizer.decode(g).strip() == rows[i][1].strip(), 1.0], device=device)
    all_sum(tot)
    return (tot[0] / tot[1].clamp_min(1)).item(), tot[2:].tolist()


def causal_lm_error(path):
    """None if the Hugging Face checkpoint dir path holds a causal LM (an ar.py, idlm.py or hybrid.py export, or a
    plain HF causal model), else one line saying what it is: a bidirectional denoiser (is_causal false in its
    config.json, e.g. a llada.py or scdd.py export), a DiffusionGemma or a DFlash draft (meta.json's family)."""
    try:
        with open(os.path.join(path, 'config.json')) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None  # not readable here: loading it reports the problem
    family = ''
    if os.path.isfile(os.path.join(path, 'meta.json')):
        try:
            with open(os.path.join(path, 'meta.json')) as f:
                family = json.load(f).get('family', '')
        except (OSError, ValueError):
            pass
    if family in ('gemma_bd', 'dflash') or cfg.get('is_causal') is False:
        what = f"a {family!r} checkpoint" if family else 'a model'
        return (f'{path} is {what} that is not a causal LM'
                + (' (is_causal: false in its config.json)' if cfg.get('is_causal') is False else ''))
    return None
