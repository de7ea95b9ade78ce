"""
Tests for data/: tokenizers, synthetic tasks, prepare (on-disk format, validation, overflow), loader (collate, pack,
batch_indices). Everything generated goes under pytest's tmp_path.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_data.py
"""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data import prepare as P  # noqa: E402
from data import synthetic as S  # noqa: E402
from data.loader import TokenDataset, batch_indices, collate, global_rows, pack  # noqa: E402
from data.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, get_tokenizer, load_tokenizer  # noqa: E402

UNICODE = ['', 'hello', 'héllo wörld', '日本語のテキスト', 'emoji 🤖🚀 and ZWJ 👩‍👩‍👧', 'e\u0301 combining',
           'tabs\tand\nnewlines\r\n', 'nul \x00 byte', '<|eos|> [MASK] look like specials']
CHAT = [{'role': 'system', 'content': 'be brief'},
        {'role': 'user', 'content': 'what is 2+2?'},
        {'role': 'assistant', 'content': '4 ✓'},
        {'role': 'user', 'content': 'and 3+3?'},
        {'role': 'assistant', 'content': '6'}]


def expected_mask(tok, messages, eot_id):
    """Reference loss mask from the documented format: 1 on each assistant content token and the eot closing it."""
    ids, _ = tok.encode_chat(messages)
    mask, at = [0] * len(ids), 0
    for m in messages:
        content = tok.encode(m['content'])
        at = next(i for i in range(at, len(ids)) if ids[i:i + len(content) + 1] == content + [eot_id])
        if m['role'] == 'assistant':
            mask[at:at + len(content) + 1] = [1] * (len(content) + 1)
        at += len(content) + 1
    return mask


# -----------------------------------------------------------------------------
# tokenizers

def test_byte_tokenizer_layout_and_roundtrip():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.vocab_size) == (256, 257, 258, 259, 264)
    assert [tok.specials[f'<|{r}|>'] for r in ('user', 'assistant', 'system')] == [260, 261, 262]
    for s in UNICODE:
        assert tok.decode(tok.encode(s)) == s, s
        assert all(0 <= i < 256 for i in tok.encode(s))
    ids = tok.encode('日本') + [tok.mask_id, tok.eos_id]
    assert tok.decode(ids) == '日本'  # specials dropped
    assert tok.render(ids) == '日本[MASK]<|eos|>'  # specials shown
    assert tok.token_str(tok.mask_id) == '[MASK]' and tok.token_str(ord('a')) == 'a'
    assert tok.decode([0xe6]) == '\ufffd'  # invalid UTF-8 from a sampler must not raise
    assert tok.render(torch.tensor(ids)) == tok.render(np.array(ids)) == '日本[MASK]<|eos|>'  # tensor rows work


def test_byte_chat_format_and_mask():
    tok = ByteTokenizer()
    ids, mask = tok.encode_chat(CHAT[1:3])
    assert ids == [257, 260] + list('what is 2+2?'.encode()) + [258, 261] + list('4 ✓'.encode()) + [258]
    assert mask == expected_mask(tok, CHAT[1:3], tok.eos_id)
    ids, mask = tok.encode_chat(CHAT)
    assert mask == expected_mask(tok, CHAT, tok.eos_id)
    assert bytes(i for i, m in zip(ids, mask) if m and i < 256).decode() == '4 ✓6'
    assert sum(mask) == len('4 ✓'.encode()) + 1 + len('6') + 1
    # the generation prompt is a prefix of the full chat and ends with the assistant header
    prompt, pmask = tok.encode_chat(CHAT[:4], add_generation_prompt=True)
    assert prompt[-1] == tok.specials['<|assistant|>'] and set(pmask) == {0}
    assert ids[:len(prompt)] == prompt
    with pytest.raises(ValueError, match="unknown role 'bot'"):
        tok.encode_chat([{'role': 'bot', 'content': 'x'}])


def test_tiktoken_tokenizer():
    tok = TiktokenTokenizer()
    assert tok.vocab_size >= 65536 and tok.vocab_size % 8 == 0
    assert tok.eos_id == tok.enc.eot_token  # <|endoftext|>
    assert min(tok.pad_id, tok.bos_id, tok.mask_id) >= tok.enc.n_vocab and max(tok.pad_id, tok.mask_id) < tok.vocab_size
    for s in UNICODE:
        assert tok.decode(tok.encode(s)) == s, s
    assert tok.decode(tok.encode('ab') + [tok.eos_id, tok.mask_id, 100256]) == 'ab'  # specials and the hole skipped
    ids, mask = tok.encode_chat(CHAT)
    assert mask == expected_mask(tok, CHAT, tok.eos_id)
    assert load_tokenizer(tok.meta()).meta() == tok.meta()


TEMPLATE_GEN = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}<|eot|>{% endgeneration %}{% else %}{{ m['content'] }}<|eot|>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATE_PLAIN = TEMPLATE_GEN.replace('{% generation %}', '').replace('{% endgeneration %}', '')


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
    """Two tiny byte-level HF tokenizers saved locally: chat template with and without {% generation %}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    dirs = {}
    for name, template in (('gen', TEMPLATE_GEN), ('plain', TEMPLATE_PLAIN)):
        fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token='<|bos|>', eos_token='<|eot|>',
                                       pad_token='<|pad|>', mask_token='<|mask|>',
                                       additional_special_tokens=['<|user|>', '<|assistant|>', '<|system|>'])
        fast.chat_template = template
        dirs[name] = str(tmp_path_factory.mktemp(f'hf_{name}'))
        fast.save_pretrained(dirs[name])
    return dirs


def test_hf_tokenizer(hf_dirs, tmp_path):
    tok, plain = HFTokenizer(hf_dirs['gen']), HFTokenizer(hf_dirs['plain'])
    assert tok.has_generation_tag and not plain.has_generation_tag
    for s in UNICODE:
        assert tok.decode(tok.encode(s)) == s, s
    eot = tok.eos_id
    ids, mask = tok.encode_chat(CHAT)
    assert mask == expected_mask(tok, CHAT, eot)  # assistant content + its <|eot|>, via {% generation %}
    assert plain.encode_chat(CHAT) == (ids, mask)  # the prompt-difference fallback agrees
    prompt, pmask = tok.encode_chat(CHAT[:4], add_generation_prompt=True)
    assert ids[:len(prompt)] == prompt and set(pmask) == {0}
    assert tok.mask_id >= 0 and tok.token_str(tok.mask_id) == '<|mask|>'
    assert load_tokenizer(tok.meta()).meta() == tok.meta()
    # prepare with it: small vocab -> uint16; ids on disk equal encode_chat's
    with open(tmp_path / 'train.jsonl', 'w') as f:
        f.write(json.dumps({'messages': CHAT}) + '\n')
    meta = P.prepare({'train': str(tmp_path / 'train.jsonl')}, str(tmp_path), hf_dirs['gen'], max_seq_len=0)
    assert meta['tokenizer'] == 'hf' and meta['dtype'] == 'uint16'
    got_ids, got_mask = TokenDataset(str(tmp_path), 'train').example(0)
    assert got_ids.tolist() == ids and got_mask.tolist() == mask


def test_tokenizer_spec_errors(tmp_path):
    missing = str(tmp_path / 'no_such_tokenizer')
    with pytest.raises(FileNotFoundError, match='no_such_tokenizer'):
        get_tokenizer(missing)
    with pytest.raises(P.DataError) as e:
        P.prepare({'train': 'x.jsonl'}, str(tmp_path), missing, max_seq_len=0)
    assert 'no_such_tokenizer' in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(ValueError, match='vocab_size'):
        load_tokenizer(dict(ByteTokenizer().meta(), vocab_size=300))


# -----------------------------------------------------------------------------
# synthetic tasks

def answer_ok(task, prompt, answer):
    if task in ('add', 'add_short'):
        a, b = prompt.split('+')
        return 0 <= int(a) <= 999 and 0 <= int(b) <= 999 and answer == str(int(a) + int(b))
    if task == 'sort':
        return 1 <= len(prompt) <= 10 and prompt.isdigit() and answer == ''.join(sorted(prompt))
    rows = prompt.split('/')
    puzzle = ''.join(rows)
    return (len(rows) == 4 and len(puzzle) == 16 and S.sudoku_solutions(puzzle) == [answer]  # unique solution
            and all(p in ('.', a) for p, a in zip(puzzle, answer)))


@pytest.mark.parametrize('task', S.TASKS)
def test_synthetic_deterministic_distinct_correct(task):
    recs = S.make_problems(task, 300, seed=0)
    assert recs == S.make_problems(task, 300, seed=0)
    assert recs != S.make_problems(task, 300, seed=1)
    assert S.make_problems(task, 100, seed=0) == recs[:100]  # train does not depend on n_val
    prompts = [r['messages'][0]['content'] for r in recs]
    assert len(set(prompts)) == len(prompts)
    for r in recs:
        (u, a) = r['messages']
        assert (u['role'], a['role']) == ('user', 'assistant')
        assert answer_ok(task, u['content'], a['content']), r


def test_add_short_is_add_with_a_quarter_short_and_none_of_adds_problems():
    # llada's second phase: a quarter of second operands with 1-2 digits (uniform add: a tenth), and never a problem
    # of add's default splits (train 20,000 + val 500 at the same seed), so switching to it never trains on add's val
    recs = S.make_problems('add_short', 4000, seed=0)
    short = sum(len(r['messages'][0]['content'].split('+')[1]) < 3 for r in recs) / len(recs)
    assert 0.22 < short < 0.28, short  # binomial sd ~0.007 around 0.25 (dedup takes a little off)
    uniform = sum(len(r['messages'][0]['content'].split('+')[1]) < 3 for r in S.make_problems('add', 4000, 0)) / 4000
    assert uniform < 0.13, uniform
    adds = {r['messages'][0]['content'] for r in S.make_problems('add', 20500, seed=0)}
    assert not adds & {r['messages'][0]['content'] for r in recs}
    # the check can fail: the same draws without the avoid set share prompts with add's splits
    rng = random.Random('add_short-0')
    assert adds & {S._add_short(rng)[0] for _ in range(4000)}


def test_sudoku_solver():
    assert len(S.sudoku_solutions('.' * 16, limit=1000)) == 288 == len(S._grids()[0])  # all solved 4x4 grids
    assert S.sudoku_solutions('1.../...4/2.../...3'.replace('/', '')) == ['1432321423414123']  # docstring example
    assert len(S.sudoku_solutions('12..............')) == 2  # stops at limit=2: "not unique"


def test_synthetic_cli_disjoint_splits(tmp_path):
    out = tmp_path / 'sort'
    subprocess.run([sys.executable, 'data/synthetic.py', '--task=sort', '--n_train=300', '--n_val=50', '--seed=3',
                    f'--out_dir={out}'], cwd=ROOT, check=True, capture_output=True)
    splits = {s: [json.loads(line) for line in open(out / f'{s}.jsonl')] for s in ('train', 'val')}
    assert (len(splits['train']), len(splits['val'])) == (300, 50)
    prompts = {s: {r['messages'][0]['content'] for r in recs} for s, recs in splits.items()}
    assert not prompts['train'] & prompts['val']
    assert splits['train'] + splits['val'] == S.make_problems('sort', 350, seed=3)


# -----------------------------------------------------------------------------
# prepare

def write_lines(path, lines):
    with open(path, 'w') as f:
        f.write(''.join(line + '\n' for line in lines))
    return str(path)


def test_prepare_chat_roundtrip_uint16(tmp_path):
    S.write_splits('add', str(tmp_path), 200, 20, seed=0)
    meta = P.prepare({s: str(tmp_path / f'{s}.jsonl') for s in ('train', 'val')}, str(tmp_path), 'byte', 64)
    on_disk = json.load(open(tmp_path / 'meta.json'))
    assert on_disk == meta
    assert meta['dtype'] == 'uint16' and meta['kind'] == 'chat' and meta['splits'] == {'train': 200, 'val': 20}
    assert {k: meta[k] for k in ('tokenizer', 'tokenizer_path', 'vocab_size', 'mask_id', 'pad_id', 'eos_id', 'bos_id')} \
        == ByteTokenizer().meta()
    tok = load_tokenizer(meta)
    for split in ('train', 'val'):
        ds = TokenDataset(str(tmp_path), split)
        recs = [json.loads(line) for line in open(tmp_path / f'{split}.jsonl')]
        assert len(ds) == len(recs)
        assert os.path.getsize(tmp_path / f'{split}.bin') == 2 * meta['n_tokens'][split]
        for (ids, mask), rec in zip(ds.examples(range(len(ds))), recs):
            assert ids.dtype == np.int64 and mask.dtype == np.uint8
            user, answer = (m['content'] for m in rec['messages'])
            assert tok.decode(ids.tolist()) == user + answer
            assert tok.render(ids[mask == 1].tolist()) == answer + '<|eos|>'
            assert (ids.tolist(), mask.tolist()) == tok.encode_chat(rec['messages'])


def test_prepare_text_uint32(tmp_path):
    texts = ['First document: héllo 日本 🤖.\n' * 20, 'Second one, plain ASCII text. ' * 30]
    paths = [write_lines(tmp_path / f'{i}.txt', [t]) for i, t in enumerate(texts)]
    out = str(tmp_path / 'text')
    meta = P.prepare_text(paths, out, 'tiktoken', val_fraction=0.1)
    assert meta['dtype'] == 'uint32' and meta['kind'] == 'text' and meta['vocab_size'] >= 65536
    tok = load_tokenizer(meta)
    streams = []
    for split in ('train', 'val'):
        ds = TokenDataset(out, split)
        assert len(ds) == 1 and ds.idx.tolist() == [0, ds.n_tokens]
        assert os.path.getsize(os.path.join(out, f'{split}.bin')) == 4 * ds.n_tokens
        ids, mask = ds.example(0)
        assert mask.all() and ds.window(1, 5)[0].tolist() == ids[1:6].tolist()
        streams += ids.tolist()
    assert streams.count(tok.eos_id) == 2
    assert tok.decode(streams) == ''.join(t + '\n' for t in texts)


BAD = [  # (line 2 of train.jsonl, expected reason)
    ('{"messages": [', 'invalid JSON'),
    ('{"msgs": []}', "missing 'messages'"),
    ('[1, 2]', "missing 'messages'"),
    ('{"messages": []}', 'non-empty list'),
    ('{"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}', "unknown role 'bot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', 'no assistant turn'),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}', 'empty assistant'),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}', 'string'),
]
GOOD = json.dumps({'messages': [{'role': 'user', 'content': '1+1'}, {'role': 'assistant', 'content': '2'}]})


@pytest.mark.parametrize('line,reason', BAD)
def test_prepare_rejects_bad_records(tmp_path, line, reason):
    path = write_lines(tmp_path / 'train.jsonl', [GOOD, line])
    with pytest.raises(P.DataError) as e:
        P.prepare({'train': path}, str(tmp_path), 'byte', 64)
    msg = str(e.value)
    assert msg.startswith(f'{path}:2: ') and reason in msg and '\n' not in msg, msg
    assert not (tmp_path / 'meta.json').exists()


def test_prepare_cli(tmp_path):
    bad_dir = tmp_path / 'bad'
    bad_dir.mkdir()
    write_lines(bad_dir / 'train.jsonl', [GOOD, GOOD, '{oops'])
    write_lines(bad_dir / 'val.jsonl', [GOOD])
    r = subprocess.run([sys.executable, 'data/prepare.py', f'--input_dir={bad_dir}', '--max_seq_len=64'],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count('\n') == 1, r.stderr
    assert r.stderr.startswith(f'error: {bad_dir}/train.jsonl:3: invalid JSON'), r.stderr
    # in-process: a good run, and the missing-file / missing-tokenizer errors
    write_lines(bad_dir / 'train.jsonl', [GOOD])
    assert P.main([f'--input_dir={bad_dir}', f'--out_dir={tmp_path / "out"}']) == 0
    assert json.load(open(tmp_path / 'out' / 'meta.json'))['splits'] == {'train': 1, 'val': 1}
    assert P.main([f'--input_dir={tmp_path}']) == 1
    assert P.main([f'--input_dir={bad_dir}', '--tokenizer=does/not/exist']) == 1


def test_prepare_overflow_counts(tmp_path, capsys):
    def rec(user, answer):
        return json.dumps({'messages': [{'role': 'user', 'content': user}, {'role': 'assistant', 'content': answer}]})
    # byte chat length = 1 (bos) + 1 + len(user) + 1 + 1 + len(answer) + 1
    lines = [rec('a', 'b'),  # 7 tokens: fits
             rec('a', 'bbbbbb'),  # 12: over 10, truncation keeps supervised tokens
             rec('aaaaaaaa', 'b')]  # 14: over 10, truncation leaves no supervised token -> dropped
    path = write_lines(tmp_path / 'train.jsonl', lines)
    meta = P.prepare({'train': path}, str(tmp_path / 'drop'), 'byte', max_seq_len=10)
    assert (meta['splits'], meta['dropped'], meta['truncated']) == ({'train': 1}, {'train': 2}, {'train': 0})
    assert 'dropped 2, truncated 0' in capsys.readouterr().out
    meta = P.prepare({'train': path}, str(tmp_path / 'trunc'), 'byte', max_seq_len=10, overflow='truncate')
    assert (meta['splits'], meta['dropped'], meta['truncated']) == ({'train': 2}, {'train': 1}, {'train': 1})
    assert meta['longest'] == {'train': 10}
    ids, mask = TokenDataset(str(tmp_path / 'trunc'), 'train').example(1)
    assert len(ids) == 10 and mask.tolist() == [0] * 5 + [1] * 5  # bos user 'a' eos assistant | 'bbbbb'
    with pytest.raises(P.DataError, match='all 3 examples are longer than max_seq_len=5'):
        P.prepare({'train': path}, str(tmp_path / 'none'), 'byte', max_seq_len=5)


def test_ensure_synthetic_and_dataset_checks(tmp_path):
    d = str(tmp_path / 'add')
    assert P.ensure_synthetic('add', d, max_seq_len=32, n_train=50, n_val=10) == d
    stamp = os.path.getmtime(os.path.join(d, 'meta.json'))
    P.ensure_synthetic('add', d, max_seq_len=32, n_train=50, n_val=10)  # present: nothing is redone
    assert os.path.getmtime(os.path.join(d, 'meta.json')) == stamp
    assert (len(TokenDataset(d, 'train')), len(TokenDataset(d, 'val'))) == (50, 10)
    with open(os.path.join(d, 'val_mask.bin'), 'ab') as f:
        f.write(b'\x00')
    with pytest.raises(ValueError, match="split 'val' is inconsistent"):
        TokenDataset(d, 'val')
    with pytest.raises(FileNotFoundError, match='test.bin'):
        TokenDataset(d, 'test')


# -----------------------------------------------------------------------------
# collate and pack (NeMo DLLMCollator semantics, non-response-window mode)

PAD, EOS = 0, 9


def ex(n, supervised_from=0):
    """An example of n content tokens (ids 1..n) whose loss mask is 1 from `supervised_from` on."""
    return np.arange(1, n + 1), np.array([int(i >= supervised_from) for i in range(n)], dtype=np.uint8)


def test_collate_plain():
    batch = collate([ex(5, 2), ex(3, 1)], pad_id=PAD, eos_id=EOS)
    assert set(batch) == {'input_ids', 'loss_mask', 'attention_mask', 'input_lengths'}
    assert batch['input_ids'].dtype == torch.long and batch['loss_mask'].dtype == torch.float32
    assert batch['attention_mask'].dtype == torch.long and batch['input_lengths'].tolist() == [5, 3]
    assert batch['input_ids'].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, PAD, PAD]]  # pads to the longest, no fill
    assert batch['loss_mask'].tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert batch['attention_mask'].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]


def test_collate_block_fill_and_padding():
    for supervise_padding in (False, True):
        batch = collate([ex(5, 2), ex(2, 1)], pad_id=PAD, eos_id=EOS, block_size=4, supervise_padding=supervise_padding)
        g = float(supervise_padding)
        # row 0: 5 content + 3 eos fill up to 8; row 1: 2 content + 2 eos fill up to 4, then global pad to 8
        assert batch['input_ids'].tolist() == [[1, 2, 3, 4, 5, EOS, EOS, EOS], [1, 2, EOS, EOS, PAD, PAD, PAD, PAD]]
        assert batch['loss_mask'].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, g, g, g, g]]
        assert batch['attention_mask'].tolist() == [[1] * 5 + [0] * 3, [1, 1] + [0] * 6]
    # no padding at all: supervise_padding changes nothing
    a, b = (collate([ex(4), ex(4)], pad_id=PAD, eos_id=EOS, block_size=4, supervise_padding=s) for s in (False, True))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # no eos id: the fill falls back to pad_id
    assert collate([ex(3)], pad_id=PAD, eos_id=-1, block_size=4)['input_ids'].tolist() == [[1, 2, 3, PAD]]


def test_collate_pad_seq_len_divisible_and_max_seq_len():
    assert collate([ex(5)], pad_id=PAD, eos_id=EOS, pad_seq_len_divisible=1024)['input_ids'].shape == (1, 1024)
    batch = collate([ex(50)], pad_id=PAD, eos_id=EOS, block_size=32, pad_seq_len_divisible=48)
    assert batch['input_ids'].shape == (1, 96)  # lcm(32, 48)
    assert batch['input_ids'][0, 50:64].eq(EOS).all() and batch['input_ids'][0, 64:].eq(PAD).all()
    # max_seq_len caps T and truncates content to its first tokens; input_lengths stay raw
    batch = collate([ex(10), ex(3)], pad_id=PAD, eos_id=EOS, max_seq_len=6)
    assert batch['input_ids'].tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, PAD, PAD, PAD]]
    assert batch['input_lengths'].tolist() == [10, 3]
    batch = collate([ex(5), ex(2)], pad_id=PAD, eos_id=EOS, block_size=4, max_seq_len=6)  # cap beats block alignment
    assert batch['input_ids'].tolist() == [[1, 2, 3, 4, 5, EOS], [1, 2, EOS, EOS, PAD, PAD]]
    assert batch['loss_mask'][0].tolist() == [1] * 6


def test_pack_doc_ids():
    batch = pack([ex(3), ex(4, 2), ex(2), ex(5), ex(12)], seq_len=8, pad_id=PAD)
    assert batch['doc_ids'].tolist() == [[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 1, 1, 1, 1, 1, -1], [0] * 8]
    assert batch['input_ids'].tolist() == [[1, 2, 3, 1, 2, 3, 4, PAD], [1, 2, 1, 2, 3, 4, 5, PAD], list(range(1, 9))]
    assert batch['position_ids'][1].tolist() == [0, 1, 0, 1, 2, 3, 4, 0]
    assert batch['loss_mask'][0].tolist() == [1, 1, 1, 0, 0, 1, 1, 0]
    assert batch['attention_mask'].tolist() == (batch['doc_ids'] >= 0).long().tolist()


# -----------------------------------------------------------------------------
# batch_indices

@pytest.mark.parametrize('replacement', [False, True])
def test_batch_indices_topology_invariant(replacement):
    rng_before = torch.get_rng_state()

    def global_batch(world_size, grad_accum, B, step):
        rows = {}
        for m in range(grad_accum):
            for r in range(world_size):
                idx = batch_indices(37, B, seed=5, step=step, micro_step=m, rank=r, world_size=world_size,
                                    grad_accum=grad_accum, replacement=replacement)
                for g, i in zip(global_rows(B, micro_step=m, rank=r, world_size=world_size).tolist(), idx.tolist()):
                    rows[g] = i
        return [rows[g] for g in range(len(rows))]

    for step in (0, 1, 7):
        ref = global_batch(1, 1, 8, step)
        assert len(ref) == 8 and all(0 <= i < 37 for i in ref)
        for world_size, grad_accum, B in ((2, 1, 4), (1, 2, 4), (2, 2, 2), (4, 2, 1)):
            assert global_batch(world_size, grad_accum, B, step) == ref
    assert global_batch(1, 1, 8, 0) != global_batch(1, 1, 8, 1)
    kw = dict(seed=5, step=3, micro_step=0, rank=0, world_size=1, grad_accum=1, replacement=replacement)
    assert torch.equal(batch_indices(37, 8, **kw), batch_indices(37, 8, **kw))
    assert not torch.equal(batch_indices(37, 8, **kw), batch_indices(37, 8, **dict(kw, seed=6)))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global torch RNG was not used


def test_batch_indices_epochs_cover_every_example():
    n, B = 24, 4
    seen = torch.cat([batch_indices(n, B, seed=0, step=s, micro_step=0, rank=0, world_size=1, grad_accum=1)
                      for s in range(2 * n // B)])
    assert sorted(seen[:n].tolist()) == list(range(n)) and sorted(seen[n:].tolist()) == list(range(n))
    assert seen[:n].tolist() != seen[n:].tolist()  # a fresh permutation each epoch
    # more rows than examples spans several epochs within one micro-batch
    assert sorted(batch_indices(3, 6, seed=0, step=0, micro_step=0, rank=0, world_size=1, grad_accum=1).tolist()) \
        == [0, 0, 1, 1, 2, 2]
