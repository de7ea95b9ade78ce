"""LoRA through peft (hf.add_lora and the export helpers): which parameters train (their count from the layer shapes),
the frozen weights not moving under AdamW, the adapter export loading back through peft's own PeftModel, and the
merged export (our W + (alpha/r) B A) against peft's merge_and_unload. End-to-end runs of every family are in
test_train.py.
Run: python -m pytest -q tests/test_lora.py"""
import os

import pytest
import torch
from safetensors.torch import save_file

import hf

V = 48


def tiny(seed=0, bidirectional=True):
    torch.manual_seed(seed)
    return hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64,
                          max_seq_len=64, bidirectional=bidirectional)


def adapted(tmp_path, targets='all-linear', r=4):
    """(a tiny model with adapters whose B is random, so they change the output; its base dir)."""
    base = str(tmp_path / 'base')
    model = tiny()
    model.save_pretrained(base)
    hf.add_lora(model, r=r, alpha=8, dropout=0.0, target_modules=targets, base=base)
    for n, p in model.named_parameters():
        if 'lora_B' in n:
            p.data.normal_(std=0.5)
    return model.eval(), base


@pytest.mark.parametrize('targets', ['all-linear', 'q_proj,v_proj'])
def test_only_the_adapters_train_and_their_count_follows_the_shapes(tmp_path, targets):
    base = str(tmp_path / 'base')
    model = tiny()
    model.save_pretrained(base)
    x = torch.randint(0, V, (2, 12))
    before = model(x).logits
    hf.add_lora(model, r=4, alpha=8, dropout=0.0, target_modules=targets, base=base)
    assert torch.equal(model(x).logits, before)  # B = 0: the adapted model starts where the base is
    # rank 4 on every targeted Linear (d=32, head 16, 2 heads, 1 kv head, MLP 64; the LM head never): r·(in + out)
    per_layer = {'q_proj': 32 + 32, 'k_proj': 32 + 16, 'v_proj': 32 + 16, 'o_proj': 32 + 32, 'gate_proj': 32 + 64,
                 'up_proj': 32 + 64, 'down_proj': 64 + 32}
    names = per_layer if targets == 'all-linear' else targets.split(',')
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trained.values()) == 2 * 4 * sum(per_layer[k] for k in names)
    assert all('.lora_' in n for n in trained)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-1, weight_decay=0.1)
    for _ in range(2):
        model(x).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert not torch.equal(model(x).logits, before)  # the adapters did train


def test_adapter_export_loads_through_peft_and_the_merge_matches_peft(tmp_path):
    model, base = adapted(tmp_path)
    x = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        want = model(x).logits
    state = model.state_dict()
    d = tmp_path / 'adapter'
    d.mkdir()
    hf.lora_config(model).save_pretrained(str(d))
    save_file(hf.adapter_state(model, state), str(d / 'adapter_model.safetensors'))
    assert hf.adapter_base(str(d)) == os.path.abspath(base)
    loaded = hf.load_pretrained(str(d))  # peft's PeftModel.from_pretrained + merge_and_unload onto the base
    merged = hf.merged_state(model, state)  # ours: W + (alpha / r) B A under the base's names
    ref = loaded.state_dict()
    assert merged.keys() == ref.keys()
    assert all(torch.allclose(merged[k], ref[k], atol=1e-6) for k in ref)
    plain = tiny()
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, want, atol=1e-5)
        assert torch.allclose(plain.eval()(x).logits, want, atol=1e-5)


def test_bad_targets_and_a_missing_base_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="lora_target_modules='nope'"):
        hf.add_lora(tiny(), r=4, alpha=8, dropout=0.0, target_modules='nope', base=str(tmp_path))
    model, base = adapted(tmp_path)
    d = tmp_path / 'adapter'
    d.mkdir()
    hf.lora_config(model).save_pretrained(str(d))
    os.rename(base, base + '.moved')
    with pytest.raises(FileNotFoundError, match='its base model .* has no config.json'):
        hf.load_pretrained(str(d))
