"""
dflash.py: DFlash, a block-diffusion drafter for lossless speculative decoding of a frozen autoregressive target.

A few Qwen3-style layers draft a whole block at once: the block is [the last committed token, MASK x (B-1)], its
queries attend bidirectionally to the block and to the target's own features of every earlier token (the outputs of
a few target layers, concatenated, projected and normed, injected as extra keys/values in every draft layer); the
embeddings and the LM head are the frozen target's. The target then verifies the block in one forward and keeps the
longest prefix it agrees with plus its own next token, so the output is exactly the target's (DFlash, arXiv
2602.06036, Chen, Liang, Liu). Loss: per block, offsets k = 1..B-1 weighted exp(-(k-1)/gamma),
Σ w_k·CE(draft logits, x_{a+k}) / (the global number of predicted tokens).

CPU, the embedded default (a ~0.3M-parameter draft for the tiny ar.py sudoku model; train that target first with
`python ar.py config/ar_sudoku.py`, ~12 minutes), prints the held-out accuracy and the acceptance length:
    python dflash.py
1 GPU, a Qwen3-4B target from a local directory (NeMo AutoModel's recipe):
    python dflash.py config/dflash_qwen3.py --target=/path/to/Qwen3-4B --data_dir=data/mychat
8 GPUs:
    torchrun --standalone --nproc_per_node=8 dflash.py config/dflash_qwen3.py --target=/path/to/Qwen3-4B
Fine-tune a published draft (z-lab/Qwen3-4B-DFlash-b16 format) from a local directory:
    python dflash.py config/dflash_qwen3.py --init_from=/path/to/Qwen3-4B-DFlash-b16 --target=/path/to/Qwen3-4B
Re-roll a chat JSONL's answers with the target itself (the data DFlash trains on; batched, resumable):
    python dflash.py --regenerate=data/sudoku_regen/train.jsonl --regenerate_input=data/sudoku/train.jsonl
Resume (bit-exact on CPU):
    python dflash.py --init_from=resume
Sample from the result (the target comes from out-dflash/hf/meta.json):
    python sample.py --checkpoint out-dflash --prompt "1.../...4/2.../...3"

Layout: the library half (importable, no side effects) holds the draft model, anchor sampling and the loss; the
script half under `if __name__ == '__main__':` holds config -> configurator -> distributed init -> data -> model ->
training loop. Deliberate differences from the references are listed in docs/dflash.md.
"""
import json
import os
import re
import time

import torch
import torch.nn as nn
# the draft is a Qwen3 variant: its norms, MLP and RoPE are transformers' own, so a published DFlash draft
# (Qwen3Config + block_size + dflash_config) loads with from_pretrained and computes what its remote code computes
from transformers.models.qwen3.modeling_qwen3 import (Qwen3Config, Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding, rotate_half)
from transformers.modeling_layers import GradientCheckpointingLayer

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, fail, get_lr, settings_error, die_at,
                      save_run, open_data, claim_out_dir, load_resume, wrap, gathered, adamw, full_state,
                      resolve_config, RunLog, stop_if_not_finite, Saver, corruption_seeds, check_mask_id, exact_match,
                      causal_lm_error, lora_for_run, micro_steps, eval_rows)
from data.loader import collate

FAMILY = 'dflash'  # the family's name, in ckpt.pt and meta.json: a resume checks it, sample.py picks the sampler
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports its math from it

# -----------------------------------------------------------------------------
# model

def default_target_layer_ids(n_target_layers, n_draft_layers):
    """The target layers whose outputs the draft reads (DFlash, arXiv 2602.06036; z-lab/dflash dflash/model.py): the
    middle one for a one-layer draft, else round(1 + i·(L_t - 4)/(n - 1)), an even spread over [1, L_t - 3] (Qwen3-8B,
    36 layers, 5 draft layers: [1, 9, 17, 25, 33]). Layer i's output is HF hidden_states[i + 1]."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    return [round(1 + i * (n_target_layers - 4) / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def loss_gamma(block_size, gamma=0.0):
    """The decay of the loss weights: gamma if > 0, else the paper's 7 / 5 / 4 for B = 16 / 10 / 8 (NeMo's
    max(2, B/2) for other sizes)."""
    return gamma if gamma > 0 else {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(2.0, block_size / 2))


def decay_weights(block_size, gamma):
    """(B - 1,) float32: w_k = exp(-(k - 1)/gamma) for the predicted offsets k = 1..B-1 (the anchor, k = 0, is
    given, not predicted). An early miss ends the accepted prefix, so early offsets weigh most."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def apply_rope(x, cos, sin):
    """RoPE on x (B, H, T, hd) with cos/sin (B, T, hd) (Qwen3's rotate-half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """GQA attention with q/k-norm whose queries are the block's tokens and whose keys/values are
    [k_proj(context features) ; k_proj(block states)] (KV injection). With a cache (a transformers DynamicCache),
    the context's keys/values are appended to it and the block's are used once and never stored."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hd = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        self.nh, self.nkv = config.num_attention_heads, config.num_key_value_heads
        C, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(C, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(C, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(C, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, C, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, mask, cache=None):
        """h (B, Q, C) normed block states, ctx (B, K, C) fused context features (the new ones when cached),
        cos/sin (B, K + Q, hd) for [context ; block] positions, mask (B, 1, Q, cached + K + Q) or a BlockMask."""
        B, Q, _ = h.shape
        K = ctx.shape[1]
        heads = lambda t, n: t.view(B, -1, n, self.hd)
        q = self.q_norm(heads(self.q_proj(h), self.nh)).transpose(1, 2)  # (B, H, Q, hd)
        kv_in = torch.cat([ctx, h], dim=1)  # (B, K + Q, C): the context is not layer-normed (as the reference)
        k = self.k_norm(heads(self.k_proj(kv_in), self.nkv)).transpose(1, 2)  # (B, Hkv, K + Q, hd)
        v = heads(self.v_proj(kv_in), self.nkv).transpose(1, 2)
        q, k = apply_rope(q, cos[:, K:], sin[:, K:]), apply_rope(k, cos, sin)
        if cache is not None:  # the context's keys/values join the cache; the block's are used once
            kc, vc = cache.update(k[:, :, :K], v[:, :, :K], self.layer_idx)
            k, v = torch.cat([kc, k[:, :, K:]], dim=2), torch.cat([vc, v[:, :, K:]], dim=2)
        y = kernels.attention(q, k, v, mask, scale=self.hd ** -0.5)  # (B, H, Q, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, -1))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm attention + SwiGLU MLP, as a Qwen3 layer; the same fused context goes to every layer. A
    GradientCheckpointingLayer (an nn.Module whose forward can be recomputed in backward) like transformers' own
    blocks, so --activation_checkpointing reaches the draft (hf.checkpoint_layers)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, mask, cache=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The draft, in the public DFlash format (z-lab/Qwen3-4B-DFlash-b16: a Qwen3Config with block_size,
    num_target_layers and dflash_config {mask_token_id, target_layer_ids}; parameters layers.*, norm, fc,
    hidden_norm), so such a draft loads with DFlashDraftModel.from_pretrained(dir) and trains further.
    No embeddings, no LM head: those are the frozen target's."""
    config_class = Qwen3Config
    base_model_prefix = 'dflash'
    _no_split_modules = ['DFlashDecoderLayer']

    def __init__(self, config):
        super().__init__(config)
        dc = getattr(config, 'dflash_config', None) or {}
        self.target_layer_ids = list(dc.get('target_layer_ids') or default_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers))
        self.mask_token_id = dc.get('mask_token_id', -1)
        self.block_size = config.block_size
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, noise_embedding, target_hidden, position_ids, mask=None, cache=None):
        """noise_embedding (B, Q, C): the target's embeddings of the block tokens; target_hidden (B, K, n·C): the
        tapped target features of the context (the new ones when cached); position_ids (B, K + Q) for
        [context ; block]; mask over [cached context ; context ; block] keys. -> (B, Q, C) final-normed states,
        for the target's LM head."""
        ctx = self.hidden_norm(self.fc(target_hidden))  # (B, K, C)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)  # (B, K + Q, hd) each
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, mask, cache)
        return self.norm(h)


def build_draft(target_config, *, n_layer, n_head, n_kv_head, n_embd, intermediate_size, block_size, mask_id,
                target_layer_ids=None):
    """A fresh draft for a target (its hidden size, vocabulary and RoPE; its head size when the head counts agree, as
    in the published Qwen3 drafts), in the public DFlash config format."""
    import transformers
    t = target_config.get_text_config()
    if n_embd != t.hidden_size:
        raise ValueError(f"n_embd={n_embd} must equal the target's hidden size {t.hidden_size} (the draft reads "
                         f"the target's embeddings and feeds its LM head)")
    n_t = t.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(n_t, n_layer)
    if not all(0 <= i < n_t for i in ids):
        raise ValueError(f'target_layer_ids={ids} must lie in [0, {n_t}) (the target has {n_t} layers)')
    rope = getattr(t, 'rope_parameters', None) or {'rope_type': 'default', 'rope_theta': getattr(t, 'rope_theta', 1e4)}
    config = transformers.Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
        head_dim=getattr(t, 'head_dim', None) if n_head == t.num_attention_heads and getattr(t, 'head_dim', None)
        else t.hidden_size // n_head, rms_norm_eps=getattr(t, 'rms_norm_eps', 1e-6),
        max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(rope), tie_word_embeddings=False)
    config.architectures = ['DFlashDraftModel']
    config.block_size, config.num_target_layers = block_size, n_t
    config.dflash_config = {'mask_token_id': mask_id, 'target_layer_ids': ids}
    return DFlashDraftModel(config)


class DFlash(nn.Module):
    """The draft and its loss in one forward, so DDP/FSDP hooks see a single call per micro-step. The frozen
    target is held outside the module tree (not a submodule: DDP/FSDP and the optimizer see the draft only, and the
    target is replicated on every rank, not sharded: a limitation, docs/limitations.md); it runs once per sequence
    under no_grad and lends its embeddings and LM head."""

    def __init__(self, draft, target, *, weights, compiled_ce=False, flex=None):
        super().__init__()
        self.draft = draft
        self.flex = flex  # the draft's masks: BlockMask (True), dense + SDPA (False), None: flex exactly on CUDA
        self.__dict__['target'] = target  # plain attribute: not a submodule
        self.softcap = float(getattr(target.config.get_text_config(), 'final_logit_softcapping', None) or 0.0)
        self.compiled_ce = compiled_ce
        self.register_buffer('w', weights, persistent=False)  # (B-1,) decay weights

    def draft_states(self, feats, x0, anchors, keep):
        """The draft's final states (R, N·bs, C) of every block, given the target's features feats (R, S, n·C) of
        x0 (R, S): block n is [x0[a_n], MASK x (bs-1)] at positions a_n..a_n+bs-1 and sees the context strictly
        before a_n plus its own block (kernels.draft_blocks; never the unmasked single-block shortcut of NeMo (A), whose
        context includes the positions it predicts, NeMo AutoModel nemo_automodel/recipes/dllm/strategy.py,
        DFlashStrategy)."""
        R, S = x0.shape
        N, bs = anchors.shape[1], self.draft.block_size
        block = torch.full((R, N, bs), self.draft.mask_token_id, dtype=torch.long, device=x0.device)
        block[:, :, 0] = torch.where(keep, x0.gather(1, anchors), self.draft.mask_token_id)  # [x_a, M, ..., M]
        emb = self.target.get_input_embeddings()(block.view(R, N * bs))  # (R, N·bs, C), frozen
        at = anchors[:, :, None] + torch.arange(bs, device=x0.device)  # (R, N, bs) each slot's position
        pos = torch.cat([torch.arange(S, device=x0.device).expand(R, S), at.view(R, -1)], dim=1)
        mask_mod, shape = kernels.draft_blocks(S, bs, anchors, keep), (R, N * bs, S + N * bs, x0.device)
        mask = kernels.device_mask(mask_mod, *shape) if self.flex is None else \
            (kernels.block_mask if self.flex else kernels.dense_mask)(mask_mod, *shape)
        return self.draft(emb.to(feats.dtype), feats, pos, mask)

    def forward(self, x0, key_valid, anchors, keep, loss_mask):
        """x0 (R, S) clean tokens (right-padded), key_valid (R, S) bool real tokens, anchors/keep (R, N) from
        sample_anchors, loss_mask (R, S) the supervised tokens. -> (Σ w·CE over the predicted tokens, stats (2·(B-1)
        + 2,) float: correct per offset, count per offset, Σ (accepted-prefix length + 1), blocks with a target)."""
        R, S = x0.shape
        N, bs = anchors.shape[1], self.draft.block_size
        with torch.no_grad():  # the frozen target, once per sequence: its features of every position
            _, feats = hf.tapped_forward(self.target, x0, self.draft.target_layer_ids, logits=False,
                                         mask=None if bool(key_valid.all()) else key_valid.long())  # (R, S, n·C)
        h = self.draft_states(feats, x0, anchors, keep)  # (R, N·bs, C)
        at = anchors[:, :, None] + torch.arange(bs, device=x0.device)  # (R, N, bs)
        tgt_pos = at[:, :, 1:].clamp(max=S - 1)  # (R, N, bs-1) the predicted tokens' positions
        valid = keep[:, :, None] & (at[:, :, 1:] < S) & loss_mask.gather(1, tgt_pos.view(R, -1)).view_as(tgt_pos).bool()
        targets = x0.gather(1, tgt_pos.view(R, -1)).view_as(tgt_pos)
        sel = h.view(R, N, bs, -1)[:, :, 1:][valid]  # (M, C) only the predicted rows reach the head
        W = self.target.get_output_embeddings().weight  # (V, C) frozen
        w = self.w.expand_as(valid)[valid]
        loss, right = kernels.chunked_cross_entropy(sel, W.to(sel.dtype), targets[valid], row_weights=w,
                                                    softcap=self.softcap, compiled=self.compiled_ce, per_row=True)
        correct = torch.zeros_like(valid)
        correct[valid] = right
        # acceptance: the leading run of right drafts (a slot past the answer neither breaks nor counts) + the bonus
        run = torch.cumprod((correct | ~valid).long(), dim=2) * valid  # (R, N, bs-1)
        has = valid.any(2)
        stats = torch.cat([correct.sum((0, 1)), valid.sum((0, 1)),
                           torch.stack([((run.sum(2) + 1) * has).sum(), has.sum()])]).float()
        return loss, stats

# -----------------------------------------------------------------------------
# anchors (DFlash's "corruption": which blocks a sequence trains)

def sample_anchors(loss_mask, *, n_blocks, block_size, overlap, seeds):
    """Per row, up to n_blocks anchor positions a (sorted), drawn without replacement from the supervised positions
    whose next token is supervised too (an anchor is a committed response token; its block predicts a+1..a+B-1).
    A deliberate difference (docs/dflash.md): NeMo's trainer (B) takes supervised positions up to S - B only, its dLLM
    strategy (A) any position in [1, len - B]; here an answer's last tokens train too (slots past it predict nothing).
    overlap=False keeps the blocks [a, a + B) disjoint (a random greedy packing). Per-row generators from seeds.
    -> anchors (R, n_blocks) long (0 in unused slots), keep (R, n_blocks) bool."""
    R, S = loss_mask.shape
    sup = loss_mask.bool()
    cand = sup & torch.cat([sup[:, 1:], torch.zeros_like(sup[:, :1])], dim=1)  # (R, S)
    anchors = torch.zeros(R, n_blocks, dtype=torch.long)
    keep = torch.zeros(R, n_blocks, dtype=torch.bool)
    for r in range(R):
        g = torch.Generator().manual_seed(int(seeds[r]))
        c = cand[r].nonzero()[:, 0]
        order = c[torch.randperm(len(c), generator=g)]
        if overlap:
            chosen = order[:n_blocks]
        else:
            chosen = []
            for a in order.tolist():
                if all(abs(a - b) >= block_size for b in chosen):
                    chosen.append(a)
                    if len(chosen) == n_blocks:
                        break
            chosen = torch.tensor(chosen, dtype=torch.long)
        chosen = chosen.sort().values
        anchors[r, :len(chosen)], keep[r, :len(chosen)] = chosen, True
    return anchors, keep


def make_batch(examples, seeds, *, pad_id, eos_id, max_seq_len, n_blocks, block_size, overlap,
               pad_seq_len_divisible=1):
    """[(ids, loss_mask)] -> one micro-batch dict: x0 (R, S), key_valid (R, S) bool, loss_mask (R, S), anchors and
    keep (R, N) and predicted (the number of predicted tokens: the loss denominator's share of this micro-batch)."""
    b = collate(examples, pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len,
                pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=False)
    x0, lm = b['input_ids'], b['loss_mask']
    anchors, keep = sample_anchors(lm, n_blocks=n_blocks, block_size=block_size, overlap=overlap, seeds=seeds)
    S = x0.shape[1]
    at = anchors[:, :, None] + torch.arange(1, block_size)  # (R, N, bs-1)
    pred = keep[:, :, None] & (at < S) & lm.gather(1, at.clamp(max=S - 1).view(len(x0), -1)).view_as(at).bool()
    return dict(x0=x0, key_valid=b['attention_mask'].bool(), loss_mask=lm, anchors=anchors, keep=keep,
                predicted=int(pred.sum()))

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """dflash's own bad settings as one line, or None; see settings_error for the ones every family shares."""
    if c['block_size'] < 2:
        return f"block_size={c['block_size']} must be >= 2 (the anchor + at least one drafted token)"
    if c['num_blocks_per_sample'] < 1:
        return f"num_blocks_per_sample={c['num_blocks_per_sample']} must be >= 1"
    if c['num_blocks_per_sample'] > c['max_seq_len']:  # anchors are distinct positions: the rest would be padding
        #                                                blocks, computed for no loss (1,000 at 64: ~300x the step)
        return (f"num_blocks_per_sample={c['num_blocks_per_sample']} exceeds max_seq_len={c['max_seq_len']}: a "
                f"sequence has at most that many anchors")
    if c['loss_decay_gamma'] < 0:
        return f"loss_decay_gamma={c['loss_decay_gamma']} must be >= 0 (0: the paper's default for the block size)"
    if c['mask_id'] < -1:
        return f"mask_id={c['mask_id']} must be >= -1 (-1: from meta.json)"
    if c['target_layer_ids'] and not re.fullmatch(r'\d+(,\d+)*', c['target_layer_ids']):
        return f"target_layer_ids={c['target_layer_ids']!r} must be comma-separated layer indices like '1,2' ('' = " \
               f"the default spread)"
    if not c['dataset'] and not c['data_dir']:
        return 'dataset and data_dir are empty: give --data_dir (a prepared chat dataset, tokenized for the target)'
    if not c['target']:
        return 'target is empty: give the AR model to draft for (an ar.py out_dir or a local HF causal-LM dir)'
    if c['regenerate_temperature'] < 0 or c['regenerate_batch_size'] < 1:
        return (f"regenerate_temperature={c['regenerate_temperature']} must be >= 0 and regenerate_batch_size="
                f"{c['regenerate_batch_size']} >= 1")
    return None

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python dflash.py --help` lists them)
    # I/O
    out_dir = 'out-dflash'  # checkpoints (ckpt.pt), the HF export of the draft (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | a local DFlash draft dir to fine-tune
    target = 'out-ar-sudoku'  # the frozen AR target: an ar.py out_dir or a local HF causal-LM dir
    trust_remote_code = False  # needed for targets with custom code; only set it for code you trust
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 500  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss and draft accuracy
    eval_samples = 500  # val prompts decoded speculatively for exact match and acceptance length (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'dflash'  # wandb run name
    # data
    dataset = 'sudoku'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 64  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    # regeneration (instead of training: the target re-answers a chat JSONL; then prepare it with data/prepare.py)
    regenerate = ''  # output chat JSONL ('' = train as usual)
    regenerate_input = ''  # chat JSONL to re-answer ('' = <data_dir>/train.jsonl)
    regenerate_temperature = 0.8  # the target's sampling temperature (0.8: the paper, NeMo's guide; 0 = greedy)
    regenerate_batch_size = 64  # prompts per batched decode
    # model (the draft; its hidden size, vocabulary and RoPE are the target's)
    model_type = 'qwen3'  # the draft is Qwen3-style (the public DFlash format); the only choice
    n_layer = 2  # draft layers (scratch; the paper: 5)
    n_head = 4  # attention heads (scratch)
    n_kv_head = 4  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size: must equal the target's (scratch)
    intermediate_size = 0  # MLP hidden size (scratch; 0 = the target's)
    target_layer_ids = '1,2'  # target layers the draft reads ('' = the paper's spread, which needs >= 5 target layers)
    block_size = 8  # tokens per drafted block: the anchor + block_size - 1 guesses
    mask_id = -1  # [MASK] token id (a reserved token, never pad/eos); -1 = from meta.json / the tokenizer
    # training
    num_blocks_per_sample = 16  # anchors per sequence, drawn among the response tokens (the paper: 512)
    overlap_anchors = True  # anchors may lie inside another anchor's block (else the blocks are disjoint)
    loss_decay_gamma = 0.0  # w_k = exp(-(k-1)/gamma); 0 = the paper's 7 / 5 / 4 for block 16 / 10 / 8
    # optimizer
    learning_rate = 2e-3  # peak AdamW learning rate
    max_iters = 1000  # optimizer steps
    weight_decay = 0.0  # AdamW weight decay (2-D weights only; the paper: 0)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.95  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 40  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 2e-4  # final learning rate
    # eval & sampling (the dflash sampler used for the accuracy eval: greedy, lossless)
    gen_length = 17  # tokens generated per val prompt (sudoku: 16 cells + EOS)
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    attn_implementation = 'auto'  # 'auto' (flex_attention on CUDA, else sdpa) | 'sdpa' | 'eager' | 'flex_attention'
    compile = False  # torch.compile the draft layers and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard the draft with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    activation_checkpointing = False  # recompute the draft's blocks in backward: less memory, ~1/3 more compute
    lora_r = 0  # LoRA (peft) rank on the draft, 0 = full fine-tuning; >0: only adapters train (target frozen)
    lora_alpha = 16  # adapter scale: alpha / r
    lora_dropout = 0.0  # dropout on the adapters' input
    lora_target_modules = 'all-linear'  # 'all-linear' (every nn.Linear but the LM head) or 'q_proj,v_proj'
    lora_merge = False  # also export hf/ merged (adapters folded into the weights: a plain model)
    seed = 1337  # data order, anchors and init all derive from it
    # -------------------------------------------------------------------------
    import configurator
    given = {}  # key -> where this run set it (command line or file:line)
    config = configurator.configure(globals(), sources=given)
    problem = settings_error(config, model_types=('qwen3',)) or family_settings_error(config)
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
    try:  # the target: an ar.py out_dir (its hf/ export) or a HF causal-LM dir
        target_dir = os.path.abspath(sampler_lib.resolve_checkpoint(target))
    except FileNotFoundError as e:
        hint = ' (train it first: python ar.py config/ar_sudoku.py)' if target == 'out-ar-sudoku' else ''
        fail(f'target: {e}{hint}', 2)
    problem = causal_lm_error(target_dir)  # the target decodes autoregressively: a denoiser would give tau = 0
    if problem:
        fail(f'target: {problem}; dflash drafts for an AR target (ar.py, idlm.py or hybrid.py)', 2)
    target_meta = {}  # the target's meta.json (its tokenizer)
    if os.path.isfile(os.path.join(target_dir, 'meta.json')):
        try:
            with open(os.path.join(target_dir, 'meta.json')) as f:
                target_meta = json.load(f)
        except (OSError, ValueError) as e:
            fail(f"{os.path.join(target_dir, 'meta.json')}: {e}", 1)
    data_dir, train_ds, val_ds, meta, tokenizer, text = open_data(
        dataset, data_dir, max_seq_len, 'byte' if target_meta.get('tokenizer') == 'byte' else target_dir)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    if text:
        fail(f'{data_dir} is raw text: dflash trains on chat data (prompts and the answers to draft)', 2)

    def get_batch(ds, idx, seeds):
        """The micro-batch dict of examples idx (B,): collated, anchors drawn with per-row seeds (B,)."""
        return make_batch(ds.examples(idx.tolist()), seeds, pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len,
                          n_blocks=num_blocks_per_sample, block_size=block_size, overlap=overlap_anchors,
                          pad_seq_len_divisible=pad_seq_len_divisible)

    # -------------------------------------------------------------------------
    # model
    # the frozen target, in the run's dtype (it only runs forward)
    try:
        target_model = hf.load_pretrained(target_dir, device, getattr(torch, dtype), trust_remote_code)
        target_model.requires_grad_(False)
    except Exception as e:  # a truncated or foreign checkpoint: one line
        fail(f'target {target_dir}: cannot load it as a causal LM: {str(e).strip().splitlines()[0]}', 1)
    vocab = target_model.get_input_embeddings().weight.shape[0]
    if vocab < meta['vocab_size']:
        fail(f"target {target_dir} has a vocabulary of {vocab} but {data_dir} was tokenized to {meta['vocab_size']}: "
             f"not the target's tokenizer", 2)
    if regenerate:  # instead of training: the target re-answers a chat JSONL
        if ddp:
            fail('--regenerate runs in one process (python dflash.py --regenerate=...), not under torchrun', 2)
        from data.regenerate import regenerate_answers
        src = regenerate_input or os.path.join(data_dir, 'train.jsonl')
        try:
            n = regenerate_answers(target_model, tokenizer, src, regenerate, pad_id=pad_id, eos_id=eos_id,
                                   mask_id=meta.get('mask_id', -1), max_new_tokens=gen_length,
                                   temperature=regenerate_temperature, batch_size=regenerate_batch_size, seed=seed)
        except (OSError, ValueError) as e:
            fail(str(e), 1)
        print0(f'wrote {n} regenerated records to {regenerate}; prepare them for training with: python '
               f'data/prepare.py --input_dir={os.path.dirname(regenerate) or "."} --tokenizer=byte '
               f'--max_seq_len={max_seq_len} (with a val.jsonl next to it)')
        finish(0)
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    if mask_id == -1:
        mask_id = meta.get('mask_id', -1)
    layer_ids = [int(i) for i in target_layer_ids.split(',')] if target_layer_ids else None
    try:
        if init_from == 'resume':
            # the draft's own shape keys too: a resumed draft keeps its block size and target taps
            checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given,
                                            shape_keys=('block_size', 'target_layer_ids'))
            if 'mask_id' in given and mask_id != checkpoint['mask_id']:
                fail(f"mask_id={mask_id} ({given['mask_id']}) but the checkpoint was trained with mask_id="
                     f"{checkpoint['mask_id']}; a resumed draft keeps its [MASK]", 2)
            if checkpoint.get('lora_base'):  # a LoRA run: its frozen base (lora_for_run adds the adapters)
                draft = DFlashDraftModel.from_pretrained(checkpoint['lora_base'], dtype=torch.float32)
            else:
                draft = DFlashDraftModel(Qwen3Config(**json.loads(checkpoint['model_args'])))
                draft.load_state_dict(checkpoint['model'])
            start_step = checkpoint['step']
        elif init_from == 'scratch':
            draft = build_draft(target_model.config, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                                n_embd=n_embd, intermediate_size=intermediate_size, block_size=block_size,
                                mask_id=mask_id, target_layer_ids=layer_ids)
        else:  # a published DFlash draft to fine-tune: its own block size, taps and [MASK]
            if not os.path.isfile(os.path.join(init_from, 'config.json')):
                fail(f'init_from={init_from!r}: no config.json there (expected a local DFlash draft dir)', 2)
            draft = DFlashDraftModel.from_pretrained(init_from, dtype=torch.float32)
            if 'mask_id' in given and mask_id != draft.mask_token_id:
                fail(f'mask_id={mask_id} ({given["mask_id"]}) but the draft in {init_from} was trained with '
                     f'mask_token_id={draft.mask_token_id}', 2)
            mask_id = draft.mask_token_id
    except ValueError as e:  # a draft that does not fit the target
        fail(str(e).splitlines()[0], 2)
    try:
        check_mask_id(mask_id, vocab, pad_id, eos_id)
        if checkpoint is not None and mask_id != checkpoint['mask_id']:
            raise ValueError(f"mask_id={mask_id} but the checkpoint was trained with mask_id={checkpoint['mask_id']}")
        if draft.config.hidden_size != target_model.config.get_text_config().hidden_size or \
                max(draft.target_layer_ids) >= target_model.config.get_text_config().num_hidden_layers:
            raise ValueError(f'the draft (hidden {draft.config.hidden_size}, target layers {draft.target_layer_ids}) '
                             f'does not fit the target {target_dir}')
    except ValueError as e:
        fail(str(e), 2)
    draft.mask_token_id = mask_id
    draft.config.dflash_config = {**draft.config.dflash_config, 'mask_token_id': mask_id}
    block_size = draft.block_size  # a loaded draft keeps its own
    gamma = loss_gamma(block_size, loss_decay_gamma)
    draft = lora_for_run(draft, config, checkpoint, init_from)  # lora_r > 0: adapters on a frozen base
    draft.to(device)
    raw_model = draft  # the bare draft: state_dict, export, sampling
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # the draft's masks
    net = DFlash(draft, target_model, weights=decay_weights(block_size, gamma).to(device), compiled_ce=compile,
                 flex=attn_implementation == 'flex_attention')
    pair = sampler_lib.Speculative(target_model, draft)  # what the dflash sampler decodes with
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: draft {n_params / 1e6:.2f}M parameters ({len(draft.layers)} layers, block {block_size}, gamma '
           f'{gamma:g}, target layers {draft.target_layer_ids}), target {target_dir} '
           f'({sum(p.numel() for p in target_model.parameters()) / 1e6:.2f}M, frozen), vocab {vocab}, mask_id '
           f'{mask_id}, world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = {global_batch} '
           f'examples/step')

    train_model, fsdp_units = wrap(net, hf.shard_units(raw_model) if fsdp else [], fsdp=fsdp, device_type=device_type,
                                   local_rank=ddp_local_rank, compiled=list(draft.layers) if compile else [],
                                   checkpointed=raw_model if activation_checkpointing else None)  # the order: skeleton.wrap
    optimizer = adamw(net, learning_rate=learning_rate, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                      device_type=device_type, checkpoint=checkpoint)
    checkpoint = None  # free memory

    def save_checkpoint(step, metrics):
        msd, osd = full_state(net, optimizer, prefix='draft.')  # every rank calls it; the draft's public names
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (the draft; meta.json names its target, so sample.py finds both)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'mask_id': mask_id, 'target': target_dir, 'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'mask_id': mask_id, 'family': FAMILY, 'module': MODULE,
                                  'sampler': 'dflash', 'gen_length': gen_length, 'block_size': block_size,
                                  'target': target_dir, 'target_layer_ids': raw_model.target_layer_ids}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=False,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    @torch.no_grad()
    def accuracy():
        """Exact match and acceptance length of the dflash sampler (greedy: the target's own greedy answers) on the
        first eval_samples val prompts, split over ranks (they accept different lengths: different numbers of
        draft forwards, so every unit stays gathered for the whole run)."""
        def decode(prompts):
            st = {}
            with autocast:
                gen = sampler_lib.generate(pair, prompts, sampler='dflash', mask_id=mask_id, pad_id=pad_id,
                                           eos_id=eos_id, gen_length=gen_length, stats=st)
            return gen, [st.get('accepted', 0), st.get('rounds', 0)]
        with gathered(fsdp_units):
            acc, (accepted, rounds) = exact_match(decode, acc_rows, tokenizer, batch_size, device, n_stats=2)
        return acc, accepted / max(rounds, 1.0)

    @torch.no_grad()
    def evaluate(step):
        """Val loss and draft accuracy with fixed anchor seeds (the same blocks at every eval), then exact match
        and acceptance length τ of speculative decoding on the first eval_samples val prompts. Runs on every
        rank; sums are all-reduced."""
        net.eval()
        tot = torch.zeros(2 * block_size + 1, device=device)  # Σ w·CE, correct[k], count[k], Σ accept, blocks
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds), corruption_seeds(seed, 0, rows, 1, stream=3))
            with autocast:
                ce, st = train_model(*(mb[k].to(device) for k in ('x0', 'key_valid', 'anchors', 'keep', 'loss_mask')))
            tot += torch.cat([ce.float()[None], st])
        all_sum(tot)
        k = block_size - 1
        out = {}
        if eval_iters > 0:  # no batch, no loss
            out = {'val_loss': (tot[0] / tot[1 + k:1 + 2 * k].sum().clamp_min(1)).item(),
                   'draft_acc': (tot[1:1 + k].sum() / tot[1 + k:1 + 2 * k].sum().clamp_min(1)).item(),
                   'accept_len': (tot[-2] / tot[-1].clamp_min(1)).item()}
        if acc_rows:
            out['accuracy'], out['tau'] = accuracy()
        net.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    resumed = resolve_config(config, saved, start_step, device=device, dtype=dtype, mask_id=mask_id,
                             lr_decay_iters=lr_decay_iters, data_dir=data_dir, target=target_dir, block_size=block_size,
                             attn_implementation=attn_implementation,
                             loss_decay_gamma=gamma, target_layer_ids=','.join(map(str, raw_model.target_layer_ids)),
                             world_size=ddp_world_size)
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
        # collate + draw anchors for every micro-batch first: the loss denominator is the GLOBAL predicted count
        micro = []
        for m in range(grad_accum):
            idx = batch_indices(len(train_ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(train_ds, idx, corruption_seeds(seed, step, rows, global_batch, stream=3)))
        counts = torch.tensor([sum(mb['predicted'] for mb in micro), sum(mb['x0'].numel() for mb in micro)],
                              dtype=torch.float64, device=device)
        n_pred, n_tok = all_sum(counts).tolist()
        loss_sum = torch.zeros(1, device=device)
        stat_sum = torch.zeros(2 * block_size, device=device)  # correct[k], count[k], Σ accept, blocks
        for m, mb in enumerate(micro):
            last = m == grad_accum - 1
            if ddp and fsdp:
                train_model.set_requires_gradient_sync(last)
            elif ddp:
                # set before forward: DDP reads it there (setting it late silently breaks accumulation)
                train_model.require_backward_grad_sync = last
            with autocast:
                ce, st = train_model(*(mb[k].to(device) for k in ('x0', 'key_valid', 'anchors', 'keep', 'loss_mask')))
                loss = ce / max(n_pred, 1.0)  # DFlash (NeMo A): the global UNWEIGHTED number of predicted tokens
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += loss.detach().float()
            stat_sum += st
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        all_sum(loss_sum)
        all_sum(stat_sum)
        step_loss = loss_sum[0].item()
        stop_if_not_finite(step_loss, grad_norm, step + 1, ckpt_path)  # one line and exit 1, before the step
        die_at('step', step + 1)  # test hook: a kill mid-step (gradients computed, not applied)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t0
        t0 = time.time()
        k = block_size - 1
        right, count = stat_sum[:k].tolist(), stat_sum[k:2 * k].tolist()
        metrics = {'step': step, 'loss': step_loss, 'grad_norm': float(grad_norm), 'lr': lr,
                   'draft_acc': sum(right) / max(sum(count), 1.0),
                   **{f'draft_acc_k{j + 1}': right[j] / max(count[j], 1.0) for j in range(k)},
                   'accept_len': stat_sum[-2].item() / max(stat_sum[-1].item(), 1.0),
                   'supervised_tokens': int(n_pred), 'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"draft_acc {metrics['draft_acc']:.3f} | accept_len {metrics['accept_len']:.2f} | "
                    f"sup {int(n_pred)} | tok/s {n_tok / dt:,.0f} | dt {dt*1000:.0f}ms")
            log(line, metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"acceptance length τ of greedy speculative decoding on {dataset}: {metrics['tau']:.2f} tokens per "
               f"target forward (block {block_size})")
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
