"""
ar.py: the plain autoregressive baseline, the same skeleton as llada.py with causal attention and next-token loss.

It is the yardstick printed next to every dLLM result, the DFlash target and the I-DLM starting model. It shares the
data pipeline and the checkpoint format (out_dir/ckpt.pt + an HF export in out_dir/hf) with the diffusion families.
The loss: position i predicts token i+1 wherever token i+1 is supervised, Σ CE / global number of such targets,
through kernels.chunked_cross_entropy (no (B, T, V) logits).

CPU, the same synthetic task and budget as llada.py's default:
    python ar.py config/ar_tiny.py
8 GPUs, SFT of a local AR checkpoint:
    torchrun --standalone --nproc_per_node=8 ar.py --init_from=/path/to/Qwen3-0.6B --dataset=mydata --fsdp=True
Sample:
    python sample.py --checkpoint out-ar --sampler ar --prompt "123+456"

Forked from llada.py; changes: causal model (bidirectional=False), no corruption, shifted targets, 'ar' sampler eval.
"""
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn

import hf
import kernels
from data.loader import collate, pack as pack_rows

# -----------------------------------------------------------------------------
# model

class CausalLM(nn.Module):
    """The HF model and the next-token loss in one forward, so DDP/FSDP hooks see a single call per micro-step."""

    def __init__(self, model, softcap=0.0, compiled_ce=False):
        super().__init__()
        self.model = model
        self.softcap = softcap
        self.compiled_ce = compiled_ce

    def forward(self, input_ids, targets, weights, attention_mask=None, position_ids=None):
        h = hf.last_hidden_state(self.model, input_ids, attention_mask, position_ids)  # (B, T, C), post final norm
        sel = weights > 0  # (B, T) positions whose next token is supervised
        W = self.model.get_output_embeddings().weight  # (V, C)
        # only the selected rows reach the LM head, chunk by chunk: no (B, T, V) logits in forward or backward
        return kernels.chunked_cross_entropy(h[sel], W, targets[sel], row_weights=weights[sel].float(),
                                             softcap=self.softcap, compiled=self.compiled_ce)

# -----------------------------------------------------------------------------
# targets

def shift_targets(x0, loss_mask, pad_id):
    """Next-token targets: position i predicts x0[i+1] with weight loss_mask[i+1]; the last position predicts
    nothing. x0 (B, T) long, loss_mask (B, T) -> targets (B, T) long, weights (B, T) float32."""
    targets = torch.cat([x0[:, 1:], torch.full_like(x0[:, :1], pad_id)], dim=1)  # (B, T)
    weights = torch.cat([loss_mask[:, 1:].float(), torch.zeros_like(loss_mask[:, :1], dtype=torch.float32)], 1)
    return targets, weights

# -----------------------------------------------------------------------------
# helpers shared by the training loop (kept here so tests can call them)

def get_lr(it, *, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then flat."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(lr_decay_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def make_batch(examples, *, pad_id, eos_id, max_seq_len, pad_seq_len_divisible=1, supervise_padding=False,
               pack=False):
    """[(ids, loss_mask)] examples -> one micro-batch, a dict of (R, T) tensors: input_ids (x_0), targets (the next
    tokens), weights and loss_mask (1 where the next token is supervised), and with pack=True doc_ids and
    position_ids. Packed rows never predict across a document boundary (the last token of a document has no
    target)."""
    if not pack:
        b = collate(examples, pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len,
                    pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding)
        targets, w = shift_targets(b['input_ids'], b['loss_mask'], pad_id)
        return dict(input_ids=b['input_ids'], targets=targets, weights=w, loss_mask=w)
    b = pack_rows(examples, seq_len=max_seq_len, pad_id=pad_id)
    targets, w = shift_targets(b['input_ids'], b['loss_mask'], pad_id)
    doc = b['doc_ids']
    w[:, :-1] *= (doc[:, 1:] == doc[:, :-1]).float()  # (R, T-1) the next token is in the same document
    return dict(input_ids=b['input_ids'], targets=targets, weights=w, loss_mask=w, doc_ids=doc,
                position_ids=b['position_ids'])


def attention_for(model, batch, device):
    """The attention mask of a micro-batch for the model's backend (hf.attention_mask): per-document causal for
    packed rows; causal for padded rows (no mask on SDPA: the model is causal; an explicit BlockMask on flex)."""
    B, T = batch['input_ids'].shape
    if 'doc_ids' in batch:
        doc = batch['doc_ids'].to(device)
        return hf.attention_mask(model, kernels.document(kernels.causal(), doc, doc), B, T, T, device)
    if hf.uses_flex(model):
        return hf.attention_mask(model, kernels.causal(), B, T, T, device)
    return None


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


def save_atomic(obj, path):
    """torch.save to a temp file, then rename: a crash mid-write never leaves a truncated checkpoint."""
    tmp = path + '.tmp'
    torch.save(obj, tmp)
    os.replace(tmp, path)

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python ar.py --help` lists them)
    # I/O
    out_dir = 'out-ar'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | path to a local HF checkpoint dir
    trust_remote_code = False  # needed for checkpoints with custom code; only set it for code you trust
    eval_interval = 1000  # steps between evals + checkpoints (0 = only at the end)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by the ar sampler for exact-match accuracy (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'ar'  # wandb run name
    # data
    dataset = 'add'  # synthetic task ('add'|'sort'|'sudoku', generated if missing) or a prepared dir under data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 256  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    supervise_padding = False  # AR stops at its EOS: padding after it need not be trained
    pack = False  # pack several examples per row of max_seq_len (per-document attention) instead of padding
    # model
    model_type = 'qwen3'  # scratch architecture: 'qwen3' | 'llama'
    n_layer = 4  # transformer layers (scratch)
    n_head = 4  # attention heads (scratch)
    n_kv_head = 4  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 512  # MLP hidden size (scratch; 0 = 3 * n_embd)
    rope_theta = 10000.0  # RoPE base (scratch)
    # optimizer
    learning_rate = 2e-3  # peak AdamW learning rate
    max_iters = 2000  # optimizer steps
    weight_decay = 0.1  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 50  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 1e-4  # final learning rate
    # eval & sampling (the ar sampler used for the accuracy eval)
    gen_length = 8  # max tokens generated per val prompt (greedy, KV cache, stops at EOS)
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    compile = False  # torch.compile the decoder and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    seed = 1337  # data order and init derive from it
    # -------------------------------------------------------------------------
    import configurator
    config = configurator.configure(globals())

    import numpy as np
    import torch.distributed as dist
    from contextlib import nullcontext
    from data.loader import TokenDataset, TextWindows, batch_indices
    from data.prepare import ensure_synthetic
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
    if gradient_accumulation_steps % ddp_world_size:
        sys.exit(f'error: gradient_accumulation_steps={gradient_accumulation_steps} (the total over ranks) must be '
                 f'divisible by the world size {ddp_world_size}')
    grad_accum = gradient_accumulation_steps // ddp_world_size  # micro-steps on this rank
    global_batch = batch_size * grad_accum * ddp_world_size  # examples per optimizer step

    def print0(*a, **k):
        if master_process:
            print(*a, **k, flush=True)

    def all_sum(t):
        if ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def finish(code=0):
        # gloo ranks sometimes abort at interpreter shutdown; tear down explicitly (environment.md)
        sys.stdout.flush(); sys.stderr.flush()
        if ddp:
            dist.destroy_process_group()
            os._exit(code)
        sys.exit(code)

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
    data_dir = data_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset)
    if master_process and not os.path.exists(os.path.join(data_dir, 'meta.json')):
        ensure_synthetic(dataset, data_dir, max_seq_len=max_seq_len, seed=0)
    if ddp:
        dist.barrier()
    train_ds, val_ds = TokenDataset(data_dir, 'train'), TokenDataset(data_dir, 'val')
    meta = train_ds.meta
    tokenizer = load_tokenizer(meta)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']

    text = meta.get('kind') == 'text'  # raw text: windows of max_seq_len tokens, every token supervised
    if text:
        try:
            train_ds, val_ds = TextWindows(train_ds, max_seq_len), TextWindows(val_ds, max_seq_len)
        except ValueError as e:
            print(f'error: {data_dir}: {e}', file=sys.stderr)
            finish(1)

    def get_batch(ds, idx):
        """The micro-batch dict of examples idx (B,): collated (or packed), with shifted targets."""
        return make_batch(ds.examples(idx.tolist()), pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len,
                          pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding,
                          pack=pack)

    def pos_of(mb):
        return mb['position_ids'].to(device) if 'position_ids' in mb else None

    # -------------------------------------------------------------------------
    # model
    os.makedirs(out_dir, exist_ok=True)
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    start_step, checkpoint = 0, None
    attn_implementation = hf.default_attn_implementation(device)  # flex_attention on CUDA, sdpa on CPU
    if init_from == 'resume':
        if not os.path.exists(ckpt_path):
            print(f'error: init_from=resume but {ckpt_path} does not exist', file=sys.stderr)
            finish(1)
        checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        hf_config = json.loads(checkpoint['model_args'])
        if 'auto_map' in hf_config:  # remote-code model: its code travels with the HF export
            model = hf.build_model(os.path.join(out_dir, 'hf'), trust_remote_code=trust_remote_code,
                                   bidirectional=False, attn_implementation=attn_implementation)
        else:
            model = hf.build_model('scratch', hf_config=hf_config, attn_implementation=attn_implementation)
        model.load_state_dict(checkpoint['model'])
        start_step = checkpoint['step']
    else:
        try:
            model = hf.build_model(init_from, vocab_size=meta['vocab_size'], model_type=model_type, n_layer=n_layer,
                                   n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                                   intermediate_size=intermediate_size, max_seq_len=max(max_seq_len, 256),
                                   rope_theta=rope_theta, trust_remote_code=trust_remote_code, bidirectional=False,
                                   attn_implementation=attn_implementation)
        except (OSError, ValueError) as e:  # a missing/incomplete checkpoint dir, a bad model_type
            print(f'error: {str(e).splitlines()[0]}', file=sys.stderr)
            finish(1)
    vocab = model.get_input_embeddings().weight.shape[0]
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    mdlm = CausalLM(model, softcap=softcap, compiled_ce=compile)  # the module that DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: {n_params / 1e6:.2f}M parameters, vocab {vocab}, '
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
        save_atomic({'model': msd, 'optimizer': osd, 'step': step, 'family': 'ar',
                     'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                     'torch_rng': torch.get_rng_state()}, ckpt_path)
        # HF export: plain transformers can load it; sample.py --checkpoint out_dir uses it
        hf_dir = os.path.join(out_dir, 'hf')
        raw_model.save_pretrained(hf_dir, state_dict=msd)
        with open(os.path.join(hf_dir, 'meta.json'), 'w') as f:
            json.dump({**meta, 'family': 'ar', 'sampler': 'ar', 'gen_length': gen_length}, f, indent=1)
        if hasattr(tokenizer, 'save'):
            tokenizer.save(hf_dir)

    # -------------------------------------------------------------------------
    # eval
    n_acc = 0 if text else min(eval_samples, len(val_ds))  # raw text has no prompts to answer
    if text and eval_samples > 0:
        print0(f'note: {data_dir} is raw text (no prompts): eval reports val_loss only, not accuracy')
    acc_rows = []  # (prompt ids incl. the assistant header, reference answer text) of the first n_acc val examples
    for i in range(n_acc):
        ids, lm = val_ds.example(i)
        start = int(np.argmax(lm > 0))  # single-turn: the response is the supervised suffix
        acc_rows.append((ids[:start].tolist(), tokenizer.decode(ids[start:].tolist())))

    @torch.no_grad()
    def accuracy():
        """Exact match of the ar sampler (greedy, KV cache, at most gen_length tokens) on the first
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
                gen = sampler_lib.generate(raw_model, prompts, sampler='ar', pad_id=pad_id, eos_id=eos_id,
                                           gen_length=gen_length, stop_at_eos=not (ddp and fsdp))
            for i, g in zip(rows, gen):
                if i < n_acc:
                    hits += torch.tensor([tokenizer.decode(g).strip() == acc_rows[i][1].strip(), 1.0], device=device)
        if ddp and fsdp:
            mdlm.reshard()
        all_sum(hits)
        return (hits[0] / hits[1].clamp_min(1)).item()

    @torch.no_grad()
    def evaluate(step):
        """Val loss (next-token CE per supervised target), then exact-match accuracy of the ar sampler on the
        first eval_samples val prompts. Runs on every rank; sums are all-reduced."""
        mdlm.eval()
        tot = torch.zeros(2, device=device)  # Σ weighted CE, Σ supervised tokens
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds))
            with autocast:
                ce, _ = train_model(mb['input_ids'].to(device), mb['targets'].to(device), mb['weights'].to(device),
                                    attention_for(raw_model, mb, device), pos_of(mb))
            tot += torch.stack([ce.float(), mb['loss_mask'].sum().to(device)])
        all_sum(tot)
        out = {'val_loss': (tot[0] / tot[1].clamp_min(1)).item()}
        if n_acc > 0:
            out['accuracy'] = accuracy()
        mdlm.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    # the resolved values ('auto', -1 and the like replaced by what this run uses), logged and saved with ckpt.pt
    config.update(device=device, dtype=dtype, lr_decay_iters=lr_decay_iters, data_dir=data_dir,
                  attn_implementation=attn_implementation, world_size=ddp_world_size, git_commit=git_commit())
    if master_process:
        log_file = open(os.path.join(out_dir, 'log.txt'), 'a')
        log_file.write(f'# ar.py torch {torch.__version__} device {device} world {ddp_world_size}\n'
                       f'# config {json.dumps(config)}\n')
    if wandb_log and master_process:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)
    metrics = {}
    step = start_step
    t0 = time.time()
    while step < max_iters:
        lr = get_lr(step, learning_rate=learning_rate, min_lr=min_lr, warmup_iters=warmup_iters,
                    lr_decay_iters=lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # collate every micro-batch first: the loss denominator is the GLOBAL count of supervised targets
        micro = []
        for m in range(grad_accum):
            idx = batch_indices(len(train_ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            micro.append(get_batch(train_ds, idx))
        counts = torch.tensor([sum(mb['loss_mask'].sum() for mb in micro), sum(mb['loss_mask'].sum() for mb in micro),
                               sum(mb['input_ids'].numel() for mb in micro)], dtype=torch.float64, device=device)
        n_sup, n_noise, n_tok = all_sum(counts).tolist()
        loss_sum = torch.zeros(2, device=device)  # Σ loss, Σ correct (argmax == target on supervised targets)
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
                loss = ce / max(n_sup, 1.0)  # mean over the global number of supervised targets
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += torch.stack([loss.detach().float(), n_correct.float()])
        grad_norm = torch.nn.utils.clip_grad_norm_(mdlm.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        all_sum(loss_sum)
        step_loss = loss_sum[0].item()
        if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
            print0(f'error: non-finite loss {step_loss} / grad_norm {float(grad_norm)} at step {step}; stopping. '
                   f'The last good checkpoint ({ckpt_path}) is untouched.')
            finish(1)
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
        if (eval_interval > 0 and step % eval_interval == 0) or step == max_iters:
            ev = evaluate(step)
            metrics.update(ev)
            line = f'eval step {step} | ' + ' | '.join(f'{k} {v:.4f}' for k, v in ev.items())
            print0(line)
            if master_process:
                log_file.write(line + '\n'); log_file.flush()
                if wandb_log:
                    wandb.log(ev, step=step)
            save_checkpoint(step, metrics)
            t0 = time.time()
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {dataset}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
