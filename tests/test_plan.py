"""plan.py, the memory planner: its per-layer activation counts against what autograd really saves (a saved-tensor
trace of transformers' layers), and --plan end to end on a checkpoint directory that holds only a config.json (no
weights to read). bench.py --only=plan checks the whole plan against measured peak RSS (a tiny run here)."""
import os
import subprocess
import sys

import pytest
import torch
import transformers

import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 2, 10


def saved_bytes(model, bf16, compiled=False):
    """Bytes of the distinct non-parameter tensors autograd saves in a forward of model's decoder (B, T)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and tuple(t.shape) not in shapes:  # not a weight, nor its bf16 cast
            seen[s.data_ptr()] = s.nbytes()
        return t
    x = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, 1, T, T, dtype=torch.bool)
    with torch.autocast('cpu', torch.bfloat16, enabled=bf16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=x, attention_mask=mask, use_cache=False)
    return sum(seen.values())


def compile_layers(model, layers):
    """Compile each layer in place with inductor, as the families' --compile does (hf.blocks); a fresh dynamo."""
    torch._dynamo.reset()
    for layer in layers:
        layer.compile()
    return model


def dense(model_type, n_layer):
    cls = {'qwen3': transformers.Qwen3Config, 'llama': transformers.LlamaConfig}[model_type]
    cfg = cls(vocab_size=64, hidden_size=96, intermediate_size=320, num_hidden_layers=n_layer, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, attn_implementation='sdpa')
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize('model_type', ['qwen3', 'llama'])
@pytest.mark.parametrize('bf16', [False, True])
def test_dense_layer_is_what_autograd_saves(model_type, bf16):
    """One more layer adds exactly what plan.dense_layer counts per token (the shared mask and RoPE tables cancel in
    the difference), in fp32 and under bf16 autocast, with SDPA's repeated k/v (GQA 8:2 here)."""
    one = saved_bytes(dense(model_type, 1), bf16)
    two = saved_bytes(dense(model_type, 2), bf16)
    traced = (two - one) / (B * T)
    counted = plan.dense_layer(plan.dims(dense(model_type, 1).config), bf16=bf16, flex=False)
    assert counted == pytest.approx(traced, rel=0.02), (traced, counted)


@pytest.mark.parametrize('model_type,bf16', [('qwen3', True), ('llama', False)])
def test_compiled_dense_layer_is_what_autograd_saves(model_type, bf16):
    """Under torch.compile (each layer compiled with inductor, as --compile does) autograd keeps what AOTAutograd's
    partitioner chose to save, and recomputes the rest in backward: one more layer adds what
    plan.dense_layer(compiled=True) counts, which is far less than the eager count (traced on CPU; the partitioner's
    choices do not depend on the device)."""
    traced = (saved_bytes(compile_layers(d := dense(model_type, 2), d.model.layers), bf16)
              - saved_bytes(compile_layers(d := dense(model_type, 1), d.model.layers), bf16)) / (B * T)
    m = plan.dims(dense(model_type, 1).config)
    counted = plan.dense_layer(m, bf16=bf16, flex=False, compiled=True)
    assert counted == pytest.approx(traced, rel=0.02), (traced, counted)
    assert traced < 0.8 * plan.dense_layer(m, bf16=bf16, flex=False)


@pytest.mark.parametrize('bf16,compiled', [(False, False), (True, False), (True, True)])
def test_moe_layer_is_what_autograd_saves(bf16, compiled):
    """DiffusionGemma's MoE layer (sandwich norms, dense MLP, router, top-k experts, which stay fp32 under
    autocast), eager in fp32 and bf16 autocast, and compiled (inductor, each layer) under bf16 autocast."""
    import hf

    def gemma(n):
        torch.manual_seed(0)
        return hf.build_diffusion_gemma('scratch', vocab_size=64, n_layer=n, n_head=8, n_kv_head=2, n_embd=96,
                                        intermediate_size=320, n_experts=4, top_k_experts=2, moe_intermediate_size=112)

    def traced(model):
        dec = model.model.decoder
        if compiled:
            compile_layers(model, dec.layers)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # autocast's bf16 weight copies (the plan counts them apart): a weight's shape, transposed, or an expert's
        shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1], tuple(p.shape)[-2:],
                                                          tuple(p.shape)[-2:][::-1])}
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params and not (bf16 and tuple(t.shape) in shapes):
                seen[s.data_ptr()] = s.nbytes()
            return t
        h = dec.embed_tokens(torch.randint(0, 64, (B, T)))
        pos = torch.arange(T).expand(B, T)
        types = model.config.get_text_config().layer_types
        with torch.autocast('cpu', torch.bfloat16, enabled=bf16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for layer, t in zip(dec.layers, types):
                h = layer(h, position_embeddings=dec.rotary_emb(h, pos, t), attention_mask=None, position_ids=pos)
        return sum(seen.values())
    per_layer = (traced(gemma(2)) - traced(gemma(1))) / (B * T)
    counted = plan.moe_layer(plan.dims(gemma(1).config), bf16=bf16, flex=False, compiled=compiled)
    assert counted == pytest.approx(per_layer, rel=0.05), (per_layer, counted)


def run_plan(tmp_path, *args, script='ar.py'):
    r = subprocess.run([sys.executable, script, *args, f'--out_dir={tmp_path}/out'], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, 'PYTHONWARNINGS': 'ignore'})
    return r.returncode, r.stdout, r.stderr


def config_only(tmp_path, **kw):
    """A checkpoint directory with a config.json and no weights."""
    cfg = transformers.Qwen3Config(vocab_size=1000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, **kw)
    d = tmp_path / 'ckpt'
    cfg.save_pretrained(d)
    return d, cfg


def test_plan_reads_only_the_config(tmp_path):
    """--plan on a directory with no weights: the parameter count is the real model's, and nothing else is read."""
    d, cfg = config_only(tmp_path)
    rc, out, err = run_plan(tmp_path, f'--init_from={d}', '--plan=1x80')
    assert rc == 0, err
    with torch.device('meta'):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    assert f'parameters {n:,}, trained {n:,}' in out
    assert 'tokens per optimizer step' in out


def test_plan_fsdp_shards_and_checkpointing_shrinks(tmp_path):
    """FSDP2 on 8 GPUs holds 1/8 of the weights, grads and AdamW state and adds the gathered blocks; activation
    checkpointing cuts the activations; a budget too small does not fit (in process: the CLI is tested above)."""
    d, _ = config_only(tmp_path)
    c = dict(init_from=str(d), out_dir=str(tmp_path / 'out'), batch_size=8, max_seq_len=1024, dtype='auto',
             attn_implementation='auto', gradient_accumulation_steps=8, fsdp=False, activation_checkpointing=False)
    one = plan.plan('ar', c, world=1)
    eight = plan.plan('ar', {**c, 'fsdp': True}, world=8)
    for name in ('weights', 'grads', 'adam'):
        assert eight[name] == pytest.approx(one[name] / 8)
    assert eight['gathered'] > 0 and one['gathered'] == 0
    assert plan.plan('ar', {**c, 'activation_checkpointing': True})['acts'] < one['acts'] / 3
    assert one['fits'] and not plan.plan('ar', c, gpu_gib=1)['fits']


def test_plan_bad_input_is_one_line(tmp_path):
    rc, _, err = run_plan(tmp_path, '--plan=eight')
    assert rc == 2 and err.strip().splitlines() == ["error: --plan=eight: expected <GPUs>x<GiB>, e.g. --plan=8x80"]
    rc, _, err = run_plan(tmp_path, f'--init_from={tmp_path}/nowhere', '--plan')
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith('error: --plan:')


@pytest.mark.slow
def test_plan_matches_measured_peak(monkeypatch):
    """The whole plan against a real run: llada's embedded model (64 rows of raw text, T=64), planned vs peak RSS
    above baseline within 20 % (bench.py --only=plan; docs/benchmarks.md has every family at two sizes)."""
    import bench
    monkeypatch.setattr(bench, 'PLAN_SIZES', {**bench.PLAN_SIZES, 'tiny': ['--max_seq_len=64', '--batch_size=64']})
    monkeypatch.setattr(bench, 'PLAN_DEFAULT_MALLOC', False)
    r = bench.plan_child('llada@tiny', bench.parse_args(['--only=plan']))
    assert 0.8 <= r['planned_mib'] / r['measured_mib'] <= 1.2, r
