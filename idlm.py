"""
idlm.py: I-DLM (introspective diffusion LM): an AR model converted into a diffusion LM that verifies its own drafts.

All-masked fine-tuning: every response token of x_t is [MASK] (the prompt stays clean) and ONE forward reads
[x_t | x_0] (length 2L, the same position ids for both copies) under the I-DLM mask (kernels.block_diffusion with
causal_in_block): x_t is causal inside its block and sees the clean x_0 blocks strictly before it; x_0 is plainly
causal. Dream shift: position i predicts token i+1 in both copies (the first response token from the last prompt
position). Loss (arXiv 2604.11035; NeMo AutoModel IDLMLoss, nemo_automodel/components/loss/dllm_loss.py):
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
8 GPUs, Qwen3-8B from a local directory (NeMo AutoModel's recipe; the b2 / b3 stages as above):
    torchrun --standalone --nproc_per_node=8 idlm.py config/idlm_qwen3.py --init_from=/path/to/Qwen3-8B
Resume (bit-exact on CPU):
    python idlm.py config/idlm_tiny.py --init_from=resume
Sample from the result (ISD, stride block_length + 1):
    python sample.py --checkpoint out-idlm-b3 --prompt "1.../...4/2.../...3"

Forked from llada.py; changes: a causal backbone loaded from an AR checkpoint, the all-masked corruption, the
[x_t | x_0] forward and its mask, the shifted two-term loss, the idlm sampler's eval.
"""
import json
import os
import time

import torch
import torch.nn as nn

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, fail, get_lr, settings_error, die_at,
                      save_run, open_data, claim_out_dir, load_resume, model_for_run, mask_id_for_run, wrap, gathered,
                      adamw, full_state, resolve_config, RunLog, stop_if_not_finite, Saver, exact_match,
                      causal_lm_error, lora_for_run, micro_steps, eval_rows)
from data.loader import collate

FAMILY = 'idlm'  # this family's name: ckpt.pt and meta.json record it, a resume checks it
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports the family's math from it

# -----------------------------------------------------------------------------
# model

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
    return None

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
    source = ''  # the directory of the model to convert
    if init_from not in ('scratch', 'resume'):
        try:  # an ar.py / idlm.py out_dir (its hf/ export) or a HF dir
            source = os.path.abspath(sampler_lib.resolve_checkpoint(init_from))
        except FileNotFoundError as e:
            hint = ' (train it first: python ar.py config/ar_sudoku.py)' if init_from == 'out-ar-sudoku' else ''
            fail(f'init_from: {e}{hint}', 2)
        problem = causal_lm_error(source)  # I-DLM converts an AR model (its clean positions stay one)
        if problem:
            fail(f'init_from: {problem}; idlm.py converts an AR model (ar.py, idlm.py or a HF causal LM)', 2)
    src_meta = {}  # the converted model's meta.json (its tokenizer, its [MASK])
    if source and os.path.isfile(os.path.join(source, 'meta.json')):
        try:
            with open(os.path.join(source, 'meta.json')) as f:
                src_meta = json.load(f)
        except (OSError, ValueError) as e:
            fail(f"{os.path.join(source, 'meta.json')}: {e}", 1)
    byte = not source or src_meta.get('tokenizer') == 'byte'
    data_dir, train_ds, val_ds, meta, tokenizer, text = open_data(dataset, data_dir, max_seq_len,
                                                                  'byte' if byte else source)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    if text:
        fail(f'{data_dir} is raw text: idlm.py trains on chat data (prompts and the answers to convert on)', 2)

    def get_batch(ds, idx):
        """The micro-batch dict of examples idx (B,): collated and all-masked (deterministic: no seeds)."""
        return make_batch(ds.examples(idx.tolist()), pad_id=pad_id, eos_id=eos_id, mask_id=mask_id,
                          max_seq_len=max_seq_len, pad_seq_len_divisible=pad_seq_len_divisible,
                          supervise_padding=supervise_padding)

    # -------------------------------------------------------------------------
    # model
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # 'auto': flex on CUDA
    if init_from == 'resume':
        checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given)
        start_step = checkpoint['step']
    model = model_for_run(source or 'scratch', checkpoint, hf_dir, config, vocab_size=meta['vocab_size'],
                          bidirectional=False, attn_implementation=attn_implementation)
    vocab = model.get_input_embeddings().weight.shape[0]
    mask_id = mask_id_for_run(mask_id, checkpoint, src_meta.get('mask_id', meta.get('mask_id', -1)), vocab, pad_id, eos_id)
    model = lora_for_run(model, config, checkpoint, source)  # lora_r > 0: adapters on a frozen base
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    net = IDLM(model, softcap=softcap, compiled_ce=compile)  # model + loss: the one module DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    origin = source or ('resumed' if start_step else 'scratch')
    print0(f'model: {n_params / 1e6:.2f}M parameters ({origin}), vocab {vocab}, mask_id {mask_id}, '
           f'block_length {block_length}, world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = '
           f'{global_batch} examples/step')

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
        # ckpt.pt, then the HF export hf/ (a plain causal LM; sample.py --checkpoint out_dir decodes it with ISD)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'mask_id': mask_id, 'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'mask_id': mask_id, 'family': FAMILY, 'module': MODULE, 'sampler': 'idlm',
                                  'gen_length': gen_length, 'block_length': block_length}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=False,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    @torch.no_grad()
    def accuracy():
        """Exact match and tokens per forward of greedy ISD (stride block_length + 1) on the first eval_samples val
        prompts, split over ranks (rows accept different lengths: different numbers of forwards, so every unit
        stays gathered for the whole run)."""
        def decode(prompts):
            st = {}
            with autocast:
                gen = sampler_lib.generate(raw_model, prompts, sampler='idlm', mask_id=mask_id, pad_id=pad_id,
                                           eos_id=eos_id, gen_length=gen_length, block_length=block_length, stats=st)
            return gen, [sum(len(g) for g in gen), st.get('row_nfe', 0)]
        with gathered(fsdp_units):
            acc, (tokens, forwards) = exact_match(decode, acc_rows, tokenizer, batch_size, device, n_stats=2)
        return acc, tokens / max(forwards, 1.0)

    @torch.no_grad()
    def evaluate(step):
        """Val loss (both terms, global denominators), then exact match and tokens per forward of greedy ISD on the
        first eval_samples val prompts. Runs on every rank; sums are all-reduced."""
        net.eval()
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
        if acc_rows:
            out['accuracy'], out['tokens_per_forward'] = accuracy()
        net.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    resumed = resolve_config(config, saved, start_step, device=device, dtype=dtype, mask_id=mask_id,
                             lr_decay_iters=lr_decay_iters, data_dir=data_dir, attn_implementation=attn_implementation,
                             world_size=ddp_world_size, source=source)
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
                   'ce_noisy': loss_sum[1].item(), 'ce_clean': loss_sum[2].item(),
                   'noisy_acc': loss_sum[3].item() / max(n_sup, 1.0), 'clean_acc': loss_sum[4].item() / max(n_sup, 1.0),
                   'supervised_tokens': int(n_sup), 'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"ce_noisy {metrics['ce_noisy']:.4f} | ce_clean {metrics['ce_clean']:.4f} | noisy_acc "
                    f"{metrics['noisy_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | dt {dt*1000:.0f}ms")
            log(line, metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"ISD tokens per forward on {dataset}: {metrics['tokens_per_forward']:.2f} (stride {block_length + 1})")
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
