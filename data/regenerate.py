"""
data/regenerate.py: a chat dataset re-answered by a model, the data DFlash trains a draft on (dflash.py
--regenerate): what the draft must guess is what its target will say, not what a dataset says. In process, batched,
KV-cached (sample.py's `ar` sampler); NeMo's regenerate script talks to an SGLang server instead.
"""
import json
import os

import torch


def regenerate_answers(target, tokenizer, in_path, out_path, *, pad_id, eos_id, mask_id, max_new_tokens, temperature,
                       batch_size, seed, log=print):
    """Re-roll the last (assistant) turn of every record of the chat JSONL in_path with the target (the `ar`
    sampler, KV-cached, batched, in process: NeMo's regenerate script talks to an SGLang server) into out_path, the
    same records with the target's answers. Resumable: records
    already in out_path are skipped (a torn last line is dropped first), and batch i always draws from a generator
    seeded (seed, i), so a resumed file equals an uninterrupted one. A resume must be of the same regeneration: the
    kept records' prompts are in_path's, and the settings (out_path.settings.json, written first) are the same;
    anything else is a ValueError before a line is written. -> the number of records written now."""
    import sample as sampler_lib
    from data.prepare import read_chat_jsonl
    if os.path.abspath(out_path) == os.path.abspath(in_path):
        raise ValueError(f'--regenerate={out_path} is its own input: write the regenerated records to another file')
    records = [msgs for _, msgs in read_chat_jsonl(in_path)]
    settings = dict(input=os.path.abspath(in_path), max_new_tokens=max_new_tokens, temperature=temperature,
                    batch_size=batch_size, seed=seed)
    done, settings_path = 0, out_path + '.settings.json'
    if os.path.exists(out_path):
        with open(out_path, 'rb') as f:
            data = f.read()
        whole = data[:data.rfind(b'\n') + 1]  # complete lines only
        kept = [json.loads(line)['messages'][:-1] for line in whole.decode().splitlines()]
        bad = next((k for k, m in enumerate(kept) if k >= len(records) or m != records[k][:-1]), None)
        if bad is not None:
            raise ValueError(f'{out_path} line {bad + 1} is not a regeneration of {in_path} record {bad + 1}: another '
                             f'input? Pick another output file, or delete it to start over')
        if os.path.exists(settings_path):
            with open(settings_path) as f:
                before = json.load(f)
            moved = [k for k in settings if before.get(k) != settings[k]]
            if moved:
                raise ValueError(f'{out_path} was regenerated with {moved[0]}={before.get(moved[0])!r}, not '
                                 f'{settings[moved[0]]!r}: resuming would mix the two; pick another output file')
        if len(whole) != len(data):
            with open(out_path, 'wb') as f:
                f.write(whole)
        done = len(kept)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(settings_path + '.tmp', 'w') as f:
        json.dump(settings, f)
    os.replace(settings_path + '.tmp', settings_path)
    device = next(target.parameters()).device
    written = 0
    with open(out_path, 'a') as f:
        for i in range(done // batch_size * batch_size, len(records), batch_size):
            batch = records[i:i + batch_size]
            prompts = [sampler_lib.encode_prompt(tokenizer, m[:-1], raw=False) for m in batch]
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i // batch_size)
            outs = sampler_lib.generate(target, prompts, sampler='ar', pad_id=pad_id, eos_id=eos_id, mask_id=mask_id,
                                        generator=gen, gen_length=max_new_tokens, temperature=temperature)
            for j, (m, o) in enumerate(zip(batch, outs)):
                if i + j >= done:  # a resumed run re-decodes its first batch and writes only the missing records
                    f.write(json.dumps({'messages': m[:-1] + [{'role': 'assistant',
                                                               'content': tokenizer.decode(o)}]}) + '\n')
                    written += 1
            f.flush()
            os.fsync(f.fileno())
            log(f'regenerated {min(i + batch_size, len(records))}/{len(records)} records into {out_path}')
    return written
