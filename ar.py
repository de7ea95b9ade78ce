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
import os
import time

import torch
import torch.nn as nn

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, get_lr, settings_error, die_at, save_run,
                      open_data, claim_out_dir, load_resume, model_for_run, wrap, gathered, adamw, full_state,
                      resolve_config, RunLog, stop_if_not_finite, Saver, exact_match, lora_for_run, micro_steps,
                      eval_rows)
from data.loader import collate, pack as pack_rows

FAMILY = 'ar'  # this family's name: ckpt.pt and meta.json record it, a resume checks it
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports the family's math from it

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

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """ar's own bad settings as one line, or None: none beyond settings_error's (the ar sampler needs only
    gen_length > 0)."""
    return None

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python ar.py --help` lists them)
    # I/O
    out_dir = 'out-ar'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | path to a local HF checkpoint dir
    trust_remote_code = False  # needed for checkpoints with custom code; only set it for code you trust
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 1000  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by the ar sampler for exact-match accuracy (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'ar'  # wandb run name
    # data
    dataset = 'add'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
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
    attn_implementation = 'auto'  # 'auto' (flex_attention on CUDA, else sdpa) | 'sdpa' | 'eager' | 'flex_attention'
    compile = False  # torch.compile each block and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    activation_checkpointing = False  # recompute each block in backward: less memory for ~1/3 more compute
    lora_r = 0  # LoRA (peft) rank, 0 = full fine-tuning; > 0: only adapters on init_from's linears train
    lora_alpha = 16  # adapter scale: alpha / r
    lora_dropout = 0.0  # dropout on the adapters' input
    lora_target_modules = 'all-linear'  # 'all-linear' (every nn.Linear but the LM head) or 'q_proj,v_proj'
    lora_merge = False  # also export hf/ merged (adapters folded into the weights: a plain model)
    seed = 1337  # data order and init derive from it
    # -------------------------------------------------------------------------
    import configurator
    given = {}  # key -> where this run set it (command line or file:line)
    config = configurator.configure(globals(), sources=given)
    problem = settings_error(config) or family_settings_error(config)
    if problem:
        configurator.usage_error(problem)  # one line, exit 2, before any data, model or step

    from data.loader import batch_indices
    import sample as sampler_lib

    # -------------------------------------------------------------------------
    # distributed init
    ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = init_distributed(device)
    master_process = ddp_rank == 0
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    grad_accum = micro_steps(gradient_accumulation_steps, ddp_world_size)  # on this rank (the key counts all ranks)
    global_batch = batch_size * grad_accum * ddp_world_size  # examples per optimizer step
    dtype, autocast = precision(dtype, device_type)  # 'auto': bfloat16 autocast on CUDA, float32 on CPU
    torch.manual_seed(seed)  # model init only: the data order (and any corruption) use their own generators

    # -------------------------------------------------------------------------
    # data
    data_dir, train_ds, val_ds, meta, tokenizer, text = open_data(
        dataset, data_dir, max_seq_len, 'byte' if init_from in ('scratch', 'resume') else init_from)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']

    def get_batch(ds, idx):
        """The micro-batch dict of examples idx (B,): collated (or packed), with shifted targets."""
        return make_batch(ds.examples(idx.tolist()), pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len,
                          pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding,
                          pack=pack)

    def pos_of(mb):
        return mb['position_ids'].to(device) if 'position_ids' in mb else None

    # -------------------------------------------------------------------------
    # model
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # 'auto': flex on CUDA
    if init_from == 'resume':
        checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given)
        start_step = checkpoint['step']
    model = model_for_run(init_from, checkpoint, hf_dir, config, vocab_size=meta['vocab_size'],
                          bidirectional=False, attn_implementation=attn_implementation)
    vocab = model.get_input_embeddings().weight.shape[0]
    model = lora_for_run(model, config, checkpoint, init_from)  # lora_r > 0: adapters on a frozen base
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    net = CausalLM(model, softcap=softcap, compiled_ce=compile)  # model + loss: the one module DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: {n_params / 1e6:.2f}M parameters, vocab {vocab}, '
           f'world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = {global_batch} examples/step')

    train_model, fsdp_units = wrap(net, hf.shard_units(raw_model) if fsdp else [], fsdp=fsdp, device_type=device_type,
                                   local_rank=ddp_local_rank, compiled=hf.blocks(raw_model) if compile else [],
                                   checkpointed=raw_model if activation_checkpointing else None)  # the order: skeleton.wrap
    optimizer = adamw(net, learning_rate=learning_rate, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                      device_type=device_type, checkpoint=checkpoint)
    checkpoint = None  # free memory

    def save_checkpoint(step, metrics):
        msd, osd = full_state(net, optimizer, prefix='model.')  # every rank calls it; keys of the bare HF model
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (plain transformers loads it; sample.py --checkpoint out_dir uses it)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'family': FAMILY, 'module': MODULE, 'sampler': 'ar',
                                  'gen_length': gen_length}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=text,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    @torch.no_grad()
    def accuracy():
        """Exact match of the ar sampler (greedy, KV cache, at most gen_length tokens) on the first eval_samples val
        prompts, split over ranks."""
        def decode(prompts):
            with autocast:
                return sampler_lib.generate(raw_model, prompts, sampler='ar', pad_id=pad_id, eos_id=eos_id,
                                            gen_length=gen_length), []
        with gathered(fsdp_units):  # the sampler calls raw_model: every weight whole, no collective inside
            return exact_match(decode, acc_rows, tokenizer, batch_size, device)[0]

    @torch.no_grad()
    def evaluate(step):
        """Val loss (next-token CE per supervised target), then exact-match accuracy of the ar sampler on the
        first eval_samples val prompts. Runs on every rank; sums are all-reduced."""
        net.eval()
        tot = torch.zeros(2, device=device)  # Σ weighted CE, Σ supervised tokens
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds))
            with autocast:
                ce, _ = train_model(mb['input_ids'].to(device), mb['targets'].to(device), mb['weights'].to(device),
                                    attention_for(raw_model, mb, device), pos_of(mb))
            tot += torch.stack([ce.float(), mb['loss_mask'].sum().to(device)])
        all_sum(tot)
        out = {'val_loss': (tot[0] / tot[1].clamp_min(1)).item()} if eval_iters > 0 else {}  # no batch, no loss
        if acc_rows:
            out['accuracy'] = accuracy()
        net.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    resumed = resolve_config(config, saved, start_step, device=device, dtype=dtype, lr_decay_iters=lr_decay_iters,
                             data_dir=data_dir, attn_implementation=attn_implementation, world_size=ddp_world_size)
    log = RunLog(out_dir, MODULE + '.py', config, resumed, device=device, world_size=ddp_world_size)
    saver = Saver(ckpt_interval, ckpt_interval_min, device, eval_interval=eval_interval, max_iters=max_iters,
                  evaluate=evaluate, save=save_checkpoint, log=log, ckpt_path=ckpt_path)
    metrics, step, t0 = {}, start_step, time.time()
    net.train()  # from_pretrained loads in eval mode; activation checkpointing acts in train mode only
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
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        all_sum(loss_sum)
        step_loss = loss_sum[0].item()
        stop_if_not_finite(step_loss, grad_norm, step + 1, ckpt_path)  # one line and exit 1, before the step
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
                    f"token_acc {metrics['token_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | "
                    f"dt {dt*1000:.0f}ms")
            log(line, metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
