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


def saved(model, bf16):
    """(activation bytes, weight-cast bytes) of the distinct non-parameter tensors autograd saves in a forward of
    model's decoder (B, T): a tensor shaped like a weight (or its transpose) is autocast's copy of it."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    acts, casts = {}, {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            (casts if tuple(t.shape) in shapes else acts)[s.data_ptr()] = s.nbytes()
        return t
    x = torch.randint(0, 64, (B, T))
    mask = torch.ones(B, 1, T, T, dtype=torch.bool)
    with torch.autocast('cpu', torch.bfloat16, enabled=bf16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=x, attention_mask=mask, use_cache=False)
    return sum(acts.values()), sum(casts.values())


def saved_bytes(model, bf16):
    """Bytes of the activations autograd saves (weights and their bf16 casts left out)."""
    return saved(model, bf16)[0]


def compile_layers(model, layers):
    """Compile each layer in place, as the families' --compile does (hf.blocks), on a fresh dynamo. The backend runs
    AOTAutograd's min-cut partitioner, inductor's, without building kernels: the same saved tensors (checked for
    every case here) in a fraction of the time."""
    torch._dynamo.reset()
    for layer in layers:
        layer.compile(backend='aot_eager_decomp_partition')
    return model


# two shapes, the second with no dimension a multiple of another, so a term counted at the wrong width shows
DIMS = {'a': dict(hidden_size=96, intermediate_size=320, num_attention_heads=8, num_key_value_heads=2, head_dim=16),
        'b': dict(hidden_size=90, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2, head_dim=14)}


def dense(model_type, n_layer, dims='a'):
    cls = {'qwen3': transformers.Qwen3Config, 'llama': transformers.LlamaConfig}[model_type]
    cfg = cls(vocab_size=64, num_hidden_layers=n_layer, attn_implementation='sdpa', **DIMS[dims])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize('dims', ['a', 'b'])
@pytest.mark.parametrize('model_type', ['qwen3', 'llama'])
@pytest.mark.parametrize('bf16', [False, True])
def test_dense_layer_is_what_autograd_saves(model_type, bf16, dims):
    """One more layer adds exactly what plan.dense_layer counts per token (the shared mask and RoPE tables cancel in
    the difference), in fp32 and under bf16 autocast, with SDPA's repeated k/v (GQA here). Under autocast it also
    keeps a bf16 copy of each of its weights (the plan's casts: 2 bytes a parameter)."""
    (a1, c1), (a2, c2) = saved(dense(model_type, 1, dims), bf16), saved(dense(model_type, 2, dims), bf16)
    counted = plan.dense_layer(plan.dims(dense(model_type, 1, dims).config), bf16=bf16, flex=False)
    assert counted == pytest.approx((a2 - a1) / (B * T), rel=0.02), ((a2 - a1) / (B * T), counted)
    layer_params = sum(p.numel() for p in dense(model_type, 1, dims).model.layers[0].parameters())
    assert c2 - c1 == pytest.approx(2 * layer_params * bf16, rel=0.02)


@pytest.mark.parametrize('dims', ['a', 'b'])
@pytest.mark.parametrize('model_type', ['qwen3', 'llama'])
@pytest.mark.parametrize('bf16', [False, True])
def test_compiled_dense_layer_is_what_autograd_saves(model_type, bf16, dims):
    """Under torch.compile (each layer compiled, as --compile does) autograd keeps what AOTAutograd's partitioner
    chose to save and recomputes the rest in backward: one more layer adds what plan.dense_layer(compiled=True)
    counts, far less than the eager count, and the same bf16 weight copies (traced on CPU with SDPA; the CUDA
    peaks this was compared with are in docs/gpu.md)."""
    (a1, c1), (a2, c2) = [saved(compile_layers(d, d.model.layers), bf16)
                          for d in (dense(model_type, 1, dims), dense(model_type, 2, dims))]
    m = plan.dims(dense(model_type, 1, dims).config)
    counted = plan.dense_layer(m, bf16=bf16, flex=False, compiled=True)
    assert counted == pytest.approx((a2 - a1) / (B * T), rel=0.02), ((a2 - a1) / (B * T), counted)
    assert counted < 0.8 * plan.dense_layer(m, bf16=bf16, flex=False)
    layer_params = sum(p.numel() for p in dense(model_type, 1, dims).model.layers[0].parameters())
    assert c2 - c1 == pytest.approx(2 * layer_params * bf16, rel=0.02)


@pytest.mark.parametrize('bf16,compiled', [(False, False), (True, False), (False, True), (True, True)])
def test_moe_layer_is_what_autograd_saves(bf16, compiled):
    """DiffusionGemma's MoE layer (sandwich norms, dense MLP, router, top-k experts, which stay fp32 under
    autocast), eager and compiled (the partitioner, each layer), in fp32 and under bf16 autocast."""
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
        mask = torch.ones(B, 1, T, T, dtype=torch.bool)  # as training passes one (without, SDPA skips repeat_kv)
        with torch.autocast('cpu', torch.bfloat16, enabled=bf16), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rope = {t: dec.rotary_emb(h, pos, t) for t in set(types)}  # once per layer type, as training does
            for layer, t in zip(dec.layers, types):
                h = layer(h, position_embeddings=rope[t], attention_mask=mask, position_ids=pos)
        return sum(seen.values())
    per_layer = (traced(gemma(2)) - traced(gemma(1))) / (B * T)
    counted = plan.moe_layer(plan.dims(gemma(1).config), bf16=bf16, flex=False, compiled=compiled)
    assert counted == pytest.approx(per_layer, rel=0.035), (per_layer, counted)


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
