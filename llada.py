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
import os
import time

import torch
import torch.nn as nn

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, get_lr, settings_error, die_at, save_run,
                      open_data, claim_out_dir, load_resume, model_for_run, mask_id_for_run, wrap, gathered, adamw,
                      full_state, resolve_config, RunLog, stop_if_not_finite, Saver, corruption_seeds, fill_length,
                      exact_match, lora_for_run, micro_steps, eval_rows, open_late_split)
from data.loader import collate, pack as pack_rows

FAMILY = 'llada'  # this family's name: ckpt.pt and meta.json record it, a resume checks it
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports the family's math from it

# -----------------------------------------------------------------------------
# model

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
            # LLaDA SFT): counted, it outnumbers the answer tokens and the answers learn far slower (docs/llada.md)
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
    if c['curriculum_iter'] < 0:
        return f"curriculum_iter={c['curriculum_iter']} must be >= 0"
    return None

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
    #                so a sampling canvas longer than the answer stays in distribution (docs/llada.md); 0 = off
    pack = False  # pack several examples per row of max_seq_len (per-document attention) instead of padding
    curriculum_data = 'auto'  # from step curriculum_iter on, train on this task's or prepared dir's train split (the
    # same tokenizer; val stays data_dir's): 'auto' = 'add_short' when training on add, else '' (off). On uniform add
    # 9 of 10 second operands have 3 digits, so a run can sit at ~86-91 % reading the first operand at a fixed offset
    # from the prompt's end; add_short (a quarter short) makes that cost. From step 0 it kept a run on the first
    # plateau, so it starts after every run has left it (docs/llada.md)
    curriculum_iter = 1000  # the step the train split switches to curriculum_data (lr 5e-3: first exits 390-630)
    # model
    model_type = 'qwen3'  # scratch architecture: 'qwen3' | 'llama'
    n_layer = 4  # transformer layers (scratch)
    n_head = 8  # attention heads (scratch). 8 of 16 dims, not 4 of 32 (same parameters): on add the answer's last
    # digits must find operand digits whose offset depends on the answer's length; more heads find
    # it sooner (docs/llada.md)
    n_kv_head = 8  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 512  # MLP hidden size (scratch; 0 = 3 * n_embd)
    rope_theta = 10000.0  # RoPE base (scratch)
    # corruption
    mask_id = -1  # [MASK] token id; -1 = from meta.json / the tokenizer (LLaDA 126336, LLaDA2.1 156895)
    eps = 0.1  # minimum mask probability: p = (1 - eps) * t + eps. LLaDA uses 1e-3 (config/llada_sft.py keeps it);
    # on a 5-token answer a row at p ~ 1e-3 puts one token of weight 1/p ~ 1000 in a 256-row batch and its gradient
    # is the step. Capping 1/p at 10 is one of three changes after which every swept run left its
    # plateau (docs/llada.md)
    # optimizer
    learning_rate = 5e-3  # peak AdamW learning rate: on add, 5e-3 leaves the first plateau by step ~600 on every
    # seed tried (3e-3: one at step 1,010, after the curriculum's switch; docs/defaults.md)
    max_iters = 2500  # optimizer steps. On add, 2,500 not 2,000: when a run leaves the first plateau is a draw
    # (step ~400 to ~1,000 over the seeds and roundings swept); at 2,000 a late exit ended at 89.20 %, with 500 more
    # steps every swept run had room to learn the short operands after its exit (docs/defaults.md)
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
    attn_implementation = 'auto'  # 'auto' (flex_attention on CUDA, else sdpa) | 'sdpa' | 'eager' | 'flex_attention'
    compile = False  # torch.compile each block and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    activation_checkpointing = False  # recompute each block in backward: less memory for ~1/3 more compute
    lora_r = 0  # LoRA (peft) rank, 0 = full fine-tuning; > 0: only adapters on init_from's linears train
    lora_alpha = 16  # adapter scale: alpha / r
    lora_dropout = 0.0  # dropout on the adapters' input
    lora_target_modules = 'all-linear'  # 'all-linear' (every nn.Linear but the LM head) or 'q_proj,v_proj'
    lora_merge = False  # also export hf/ merged (adapters folded into the weights: a plain model)
    seed = 1337  # data order, corruption and init all derive from it
    # -------------------------------------------------------------------------
    import configurator
    given = {}  # key -> where this run set it (command line or file:line)
    config = configurator.configure(globals(), sources=given)
    problem = settings_error(config) or family_settings_error(config)
    if problem:
        configurator.usage_error(problem)  # one line, exit 2, before any data, model or step

    from data.loader import batch_indices, global_rows
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
    if curriculum_data == 'auto':
        curriculum_data = 'add_short' if dataset == 'add' and not data_dir else ''
    tokenizer_source = 'byte' if init_from in ('scratch', 'resume') else init_from
    data_dir, train_ds, val_ds, meta, tokenizer, text = open_data(dataset, data_dir, max_seq_len, tokenizer_source)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    late_ds = None  # the train split from step curriculum_iter on (None: train_ds throughout)
    if curriculum_data and curriculum_iter < max_iters:
        late_ds = open_late_split(curriculum_data, data_dir, meta, text, max_seq_len, tokenizer_source)

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
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # 'auto': flex on CUDA
    if init_from == 'resume':
        checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given)
        start_step = checkpoint['step']
    model = model_for_run(init_from, checkpoint, hf_dir, config, vocab_size=meta['vocab_size'],
                          bidirectional=True, attn_implementation=attn_implementation)
    vocab = model.get_input_embeddings().weight.shape[0]
    mask_id = mask_id_for_run(mask_id, checkpoint, meta.get('mask_id', -1), vocab, pad_id, eos_id)
    model = lora_for_run(model, config, checkpoint, init_from)  # lora_r > 0: adapters on a frozen base
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    net = MDLM(model, softcap=softcap, compiled_ce=compile)  # model + loss: the one module DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: {n_params / 1e6:.2f}M parameters, vocab {vocab}, mask_id {mask_id}, '
           f'world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = {global_batch} examples/step')
    train_model, fsdp_units = wrap(net, hf.shard_units(raw_model) if fsdp else [], fsdp=fsdp, device_type=device_type,
                                   local_rank=ddp_local_rank, compiled=hf.blocks(raw_model) if compile else [],
                                   checkpointed=raw_model if activation_checkpointing else None)  # the order: skeleton.wrap
    optimizer = adamw(net, learning_rate=learning_rate, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                      device_type=device_type, checkpoint=checkpoint)
    checkpoint = None  # free memory

    def save_checkpoint(step, metrics):
        msd, osd = full_state(net, optimizer, prefix='model.')  # every rank calls it; keys of the bare HF model
        if master_process:  # ckpt.pt, then the HF export hf/ (plain transformers loads it; sample.py uses it)
            save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                               'model_args': raw_model.config.to_json_string(), 'config': config,
                               'metrics': metrics, 'mask_id': mask_id, 'torch_rng': torch.get_rng_state()},
                     raw_model, msd, {**meta, 'mask_id': mask_id, 'family': FAMILY, 'module': MODULE,
                                      'sampler': 'llada', 'gen_length': gen_length, 'block_length': block_length,
                                      'steps': steps}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=text,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    @torch.no_grad()
    def accuracy():
        """Exact match of the llada sampler (eval settings: gen_length/block_length/steps, greedy) on the first
        eval_samples val prompts, split over ranks."""
        def decode(prompts):
            with autocast:
                return sampler_lib.generate(raw_model, prompts, sampler='llada', mask_id=mask_id, pad_id=pad_id,
                                            eos_id=eos_id, gen_length=gen_length, block_length=block_length,
                                            steps=steps), []
        with gathered(fsdp_units):  # the sampler calls raw_model: every weight whole, no collective inside
            return exact_match(decode, acc_rows, tokenizer, batch_size, device)[0]

    @torch.no_grad()
    def evaluate(step):
        """Val loss with fixed corruption seeds (the same noise at every eval), then exact-match accuracy of the
        llada sampler on the first eval_samples val prompts. Runs on every rank; sums are all-reduced."""
        net.eval()
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
        if acc_rows:
            out['accuracy'] = accuracy()
        net.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    resumed = resolve_config(config, saved, start_step, device=device, dtype=dtype, mask_id=mask_id,
                             lr_decay_iters=lr_decay_iters, data_dir=data_dir, attn_implementation=attn_implementation,
                             world_size=ddp_world_size, curriculum_data=curriculum_data)
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
        # collate + corrupt every micro-batch first: the loss denominator is the GLOBAL supervised count
        micro, fill_to = [], fill_length(seed, step, eos_fill)
        ds = late_ds if late_ds is not None and step >= curriculum_iter else train_ds
        for m in range(grad_accum):
            idx = batch_indices(len(ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(ds, idx, corruption_seeds(seed, step, rows, global_batch), fill_to))
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
            log(f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                f"token_acc {metrics['token_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | "
                f"dt {dt*1000:.0f}ms", metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
