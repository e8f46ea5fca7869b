"""hellaswag.py: lm-evaluation-harness's preprocessing and token split, each ending's log-likelihood against a forward
per token, the accuracies against that reference, the left-out items, the file checks and the download."""
import json
import math
import os
import re
import shutil
from contextlib import nullcontext

import pytest
import torch

import hellaswag
from configurator import ConfigError
from model import GPT, GPTConfig
from prepare_data import get_tokenizer
from train import TrainError

torch.set_num_threads(1)  # tiny models: one thread is as fast (see test_train.py)
CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,:'"  # char level, 57 ids: no '%' and no digits
META = dict(tokenizer='char', vocab_size=len(CHARS), chars=CHARS)
ENCODE = get_tokenizer(META)[0]
ITEMS = [  # (text, endings, label), as read_items returns them; endings of unequal lengths
    ("Roof: A man is on a roof. He", ["rips tiles off.", "sits.", "is holding a cube.", "pulls up roofing."], 3),
    ("Home: How to clean a rug. Vacuum it. Then", ["wash it with water.", "sing.", "throw it away.", "eat it."], 0),
    ("Cat: The cat sat on the", ["mat.", "hat, said the cat.", "roof.", "rug in the hall."], 1),
    ("Tea: Heat the water, then", ["pour it.", "add tea.", "wait a while.", "drink."], 2),
    ("Bed: The cat slept on the", ["mat.", "hat.", "rug.", "bed."], 3),  # equal lengths: acc_norm picks as acc does
]


def peaked_model(block_size=64, vocab_size=64, seed=0):
    """A tiny model whose weights are drawn wide (std 0.5), so that its next-token distributions are far from
    uniform and an ending's log-likelihood depends on every position it is read at; its vocabulary padded past the
    data's 57 ids, as train.py pads it."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


@torch.no_grad()
def reference_log_likelihood(model, text, ending, vocab_size):
    """The ending's log-likelihood the plain way: text + ' ' + ending encoded at once, cut to its last
    block_size + 1 tokens, then one forward per ending token over the tokens before it alone (no batch, no
    padding), its log-softmax over the data's ids in float64."""
    tokens = ENCODE(text + ' ' + ending)[-(model.config.block_size + 1):]
    total = 0.0
    for k in range(len(tokens) - len(' ' + ending), len(tokens)):
        logits, _ = model(torch.tensor([tokens[:k]]))
        total += torch.log_softmax(logits[0, -1, :vocab_size].double(), -1)[tokens[k]].item()
    return total


def test_preprocess_follows_the_harness():
    """lm-evaluation-harness's steps, in its order: strip, ' [title]' to '. ', tags removed, double spaces halved
    (once: a space left where a tag was stays)."""
    assert hellaswag.preprocess(' [header] How to clean a rug [title] Vacuum it. ') == ' How to clean a rug. Vacuum it.'
    assert hellaswag.preprocess('Mix it [step] well [substeps] now') == 'Mix it well now'
    assert hellaswag.preprocess('a    b') == 'a  b'  # four spaces: replace() halves each pair once
    assert hellaswag.preprocess('no tags here') == 'no tags here'


def test_read_items_builds_the_harness_query(tmp_path):
    path = tmp_path / 'val.jsonl'
    lines = [dict(activity_label='Roof shingle removal', ctx_a='A man is on a roof [title] up there.', ctx_b='he IS',
                  endings=['rips [step] tiles off.', 'sits.'], label='1', ind=0),
             dict(activity_label='Cat', ctx_a='The cat', ctx_b='', endings=['sat.', 'ran.', 'hid.', 'ate.'], label=0)]
    path.write_text(''.join(json.dumps(line) + '\n' for line in lines) + '\n')
    assert hellaswag.read_items(str(path)) == [
        ('Roof shingle removal: A man is on a roof. up there. He is', ['rips tiles off.', 'sits.'], 1),
        ('Cat: The cat', ['sat.', 'ran.', 'hid.', 'ate.'], 0)]
    assert len(hellaswag.read_items(str(path), limit=1)) == 1


def test_encode_pair_splits_as_the_harness():
    """The context's tokens are its own; the ending's, the joint encoding's past their count: with cl100k_base, '123'
    is one token where '1' and '23' are two, so the ending gets none of its own (encoding it alone would give '23',
    and taking the context's from the joint encoding would give '123'). Spaces that end the context move to the
    ending."""
    encode = get_tokenizer(dict(tokenizer='cl100k_base'))[0]
    assert len(encode('Pick 123')) == len(encode('Pick 1')) and encode('Pick 123') != encode('Pick 1')
    assert hellaswag.encode_pair(encode, 'Pick 1', '23') == (encode('Pick 1'), [])
    head, tail = hellaswag.encode_pair(encode, 'The cat sat', ' on the mat.')
    assert head == encode('The cat sat') and tail == encode(' on the mat.')
    assert hellaswag.encode_pair(ENCODE, 'ab  ', 'c') == (ENCODE('ab'), ENCODE('  c'))


def test_an_ending_merged_into_the_text_is_left_out():
    """A tokenizer that makes one token of any text (so text + ending is as many tokens as the text): the ending has
    none of its own to score, and the item is left out with that reason, not scored 0 (the best of log-likelihoods)."""
    with pytest.raises(ValueError, match="an ending with no tokens of its own"):
        hellaswag.rows_of(('A cat:', ['ran.', 'sat.'], 0), lambda text: [len(text) % 7], block_size=16)


def test_rows_cut_the_text_and_refuse_an_ending_longer_than_the_block():
    text, ending = 'A cat: ' + 'the cat sat ' * 5, 'on the mat.'
    rows = hellaswag.rows_of((text.strip(), [ending, 'ran.'], 0), ENCODE, block_size=16)
    whole = ENCODE(text.strip() + ' ' + ending)
    assert rows[0] == (whole[-17:], len(ending) + 1)
    with pytest.raises(ValueError, match='an ending of 17 tokens, longer than block_size=16'):
        hellaswag.rows_of(('A cat:', ['x' * 16, 'ran.'], 0), ENCODE, block_size=16)


def test_an_ending_of_exactly_block_size_tokens_is_scored():
    # Reference: rows_of's docstring: a row is the last block_size + 1 tokens, so an ending of block_size tokens
    # (' ' and 15 characters, char-level) still has one token of context before it: scored, not left out.
    rows = hellaswag.rows_of(('A cat:', ['x' * 15, 'ran.'], 0), ENCODE, block_size=16)
    assert rows[0] == (ENCODE('A cat: ' + 'x' * 15)[-17:], 16)


def test_log_likelihoods_match_a_forward_per_token():
    """Rows of different lengths in one padded batch, some cut to the block (the first text is longer than it),
    scored over the data's 57 ids of the model's 64: each sum equal to the reference's."""
    model = peaked_model(block_size=24)
    items = [('Cat: the cat sat on the big roof and then', ['ran.', 'sat down on the mat.'], 0),
             ('Tea: Boil', ['it.', 'the water.'], 1), ITEMS[2]]
    rows, want = [], []
    for item in items:
        rows += hellaswag.rows_of(item, ENCODE, model.config.block_size)
        want += [reference_log_likelihood(model, item[0], e, META['vocab_size']) for e in item[1]]
    assert max(len(tokens) for tokens, _ in rows) == 25 and min(len(tokens) for tokens, _ in rows) < 25
    got = hellaswag.log_likelihoods(model, rows, META['vocab_size'], 'cpu', nullcontext())
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_accuracies_against_the_reference():
    """acc from the highest sum, acc_norm from the highest sum per character of the ending, both from the
    reference's log-likelihoods; the labels make the two differ. The same for any batch size."""
    model = peaked_model()
    lls = [[reference_log_likelihood(model, text, e, META['vocab_size']) for e in endings]
           for text, endings, _ in ITEMS]
    best = [max(range(4), key=lambda j: ll[j]) for ll in lls]
    best_norm = [max(range(4), key=lambda j: ll[j] / len(endings[j])) for ll, (_, endings, _) in zip(lls, ITEMS)]
    assert best != best_norm  # else the test could not tell the two accuracies apart
    for labels in (best, best_norm):  # all right by one measure, some wrong by the other
        items = [(text, endings, label) for (text, endings, _), label in zip(ITEMS, labels)]
        want_acc = sum(label == b for label, b in zip(labels, best)) / len(items)
        want_norm = sum(label == bn for label, bn in zip(labels, best_norm)) / len(items)
        for batch_size in (1, 3, 8):
            r = hellaswag.evaluate(model, items, ENCODE, META['vocab_size'], 'cpu', nullcontext(), batch_size)
            assert (r['acc'], r['acc_norm'], r['items'], r['left_out'], r['chance']) == (want_acc, want_norm, 5, [],
                                                                                         0.25)
            assert 0 < min(want_acc, want_norm) < 1  # a standard error that depends on the count
            assert (r['acc_se'], r['acc_norm_se']) == pytest.approx([(p * (1 - p) / 4) ** 0.5
                                                                     for p in (want_acc, want_norm)])


def write_items(path, items):
    """HellaSwag's JSON lines for (activity_label, ctx_a, ctx_b, endings, label) tuples."""
    with open(path, 'w') as f:
        for label_text, a, b, endings, label in items:
            f.write(json.dumps(dict(activity_label=label_text, ctx_a=a, ctx_b=b, endings=endings, label=label)) + '\n')
    return str(path)


@pytest.fixture
def checkpoint(tmp_path):
    """out_dir/ckpt.pt as train.py writes it (the entries load_model reads): peaked_model's weights."""
    model = peaked_model()
    out_dir = tmp_path / 'out'
    out_dir.mkdir()
    torch.save(dict(model=model.state_dict(), model_args=model.config.to_dict(), meta=META, iter_num=7),
               out_dir / 'ckpt.pt')
    return str(out_dir), model


def test_main_scores_a_checkpoint_and_names_the_items_left_out(tmp_path, checkpoint, capsys):
    out_dir, model = checkpoint
    path = write_items(tmp_path / 'val.jsonl', [
        ('Cat', 'The cat sat on', 'the', ['mat.', 'hat.', 'roof.', 'rug.'], 2),
        ('Sale', 'Prices fell', 'by', ['50% today.', 'half.', 'a lot.', 'little.'], 1),
        ('Tea', 'Heat the water,', 'then', ['pour it.', 'add tea.', 'wait a while.', 'drink.'], '3')])
    r = hellaswag.main([f'--out_dir={out_dir}', f'--input={path}', '--batch_size=1'])
    want = []
    for text, endings, label in [('Cat: The cat sat on The', ['mat.', 'hat.', 'roof.', 'rug.'], 2),
                                 ('Tea: Heat the water, Then', ['pour it.', 'add tea.', 'wait a while.', 'drink.'], 3)]:
        lls = [reference_log_likelihood(model, text, e, META['vocab_size']) for e in endings]
        want.append(max(range(4), key=lambda j: lls[j]) == label)
    assert r['acc'] == sum(want) / 2 and r['items'] == 2
    out = capsys.readouterr().out
    assert f"acc {r['acc']:.4f} ± {r['acc_se']:.4f}, acc_norm {r['acc_norm']:.4f} ± {r['acc_norm_se']:.4f} " in out
    # one item has no standard error: said, not 'nan'
    one = write_items(tmp_path / 'one.jsonl', [('Cat', 'The cat sat on', 'the', ['mat.', 'hat.', 'roof.', 'rug.'], 2)])
    r = hellaswag.main([f'--out_dir={out_dir}', f'--input={one}', '--batch_size=1'])
    assert math.isnan(r['acc_se'])
    assert f"acc {r['acc']:.4f} ± n/a (one item), acc_norm {r['acc_norm']:.4f} ± n/a (one item) over 1 items" in \
        capsys.readouterr().out
    assert f"over 2 items of {path} ({out_dir}/ckpt.pt, iteration 7, float32; chance 0.25)" in out
    assert ("1 of 3 items left out, not scored (the first, item 1: characters not in the dataset's vocabulary: "
            "'%05'") in out


@pytest.mark.parametrize('line, error', [
    ('{"activity_label": "a"', 'line 2 is not JSON'),
    ('[1, 2]', 'line 2: expected a JSON object, got list'),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"]}',
     'line 2 lacks label (the test split'),
    ('{"activity_label": "a", "ctx_b": "c", "endings": ["x", "y"], "label": 0}', 'line 2 lacks ctx_a$'),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"], "label": 2}',
     "line 2: label 2 is not the index of one of its 2 endings"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": "xy", "label": 0}', 'line 2: expected text in'),
    # one ending is no choice: always right, it would raise both accuracies
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x"], "label": 0}',
     'line 2: expected text in activity_label, ctx_a and ctx_b, and a list of at least two endings'),
])
def test_a_line_that_is_not_an_item_is_named(tmp_path, line, error):
    path = tmp_path / 'val.jsonl'
    good = dict(activity_label='a', ctx_a='b', ctx_b='c', endings=['x', 'y'], label=0)
    path.write_text(json.dumps(good) + '\n' + line + '\n')
    with pytest.raises(TrainError, match=f"{path} " + error.replace('(', r'\(').replace('[', r'\[')):
        hellaswag.read_items(str(path))


def test_errors_name_the_input_and_the_checkpoint(tmp_path, checkpoint):
    out_dir, _ = checkpoint
    with pytest.raises(ConfigError, match='--input=nowhere.jsonl: no such file'):
        hellaswag.main([f'--out_dir={out_dir}', '--input=nowhere.jsonl'])
    empty = tmp_path / 'empty.jsonl'
    empty.write_text('\n')
    with pytest.raises(TrainError, match=f'{empty} holds no items'):
        hellaswag.main([f'--out_dir={out_dir}', f'--input={empty}'])
    with pytest.raises(TrainError, match=f'no checkpoint at {tmp_path}/elsewhere/ckpt.pt'):
        hellaswag.main([f'--out_dir={tmp_path}/elsewhere', f'--input={empty}'])
    # a run a scratch run moved aside: named, as train.py's resume names it (the latest of them)
    for stamp in ('20261101-000000-a', '20261102-000000-b'):
        os.makedirs(tmp_path / 'moved' / f'previous-{stamp}')
        shutil.copy(os.path.join(out_dir, 'ckpt.pt'), tmp_path / 'moved' / f'previous-{stamp}')
    with pytest.raises(TrainError, match=re.escape(
            f"no checkpoint at {tmp_path}/moved/ckpt.pt; earlier ones were moved aside: the latest is "
            f"{tmp_path}/moved/previous-20261102-000000-b/ckpt.pt")):
        hellaswag.main([f'--out_dir={tmp_path}/moved', f'--input={empty}'])
    for flag in ('--limit=-1', '--batch_size=0'):
        with pytest.raises(ConfigError, match=f"{flag[2:]} is out of range"):
            hellaswag.main([f'--out_dir={out_dir}', flag])
    bad = write_items(tmp_path / 'bad.jsonl', [('Fun', '100%', 'of it', ['is.', 'was.'], 0)])
    with pytest.raises(TrainError, match=r"none of the 1 items could be scored: item 0: characters not in .* '%01'"):
        hellaswag.main([f'--out_dir={out_dir}', f'--input={bad}'])


def test_the_default_input_is_downloaded_once_and_a_failed_download_leaves_nothing(tmp_path, checkpoint, monkeypatch):
    out_dir, _ = checkpoint
    source = write_items(tmp_path / 'source.jsonl', [('Tea', 'Heat the water,', 'then', ['pour it.', 'drink.'], 0)])
    work = tmp_path / 'work'
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(hellaswag, 'URL', f'file://{tmp_path}/missing.jsonl')
    with pytest.raises(TrainError, match=f'could not download file://{tmp_path}/missing.jsonl to '
                                         f'{hellaswag.DEFAULT_INPUT} .*fetch it by hand to that path, or pass --input'):
        hellaswag.main([f'--out_dir={out_dir}'])
    assert os.listdir(work / 'data/hellaswag') == []  # no partial file
    monkeypatch.setattr(hellaswag, 'URL', f'file://{source}')
    r = hellaswag.main([f'--out_dir={out_dir}'])
    assert r['items'] == 1 and r['chance'] == 0.5  # two endings
    assert (work / hellaswag.DEFAULT_INPUT).read_text() == open(source).read()
    monkeypatch.setattr(hellaswag, 'URL', f'file://{tmp_path}/missing.jsonl')  # not fetched again
    assert hellaswag.main([f'--out_dir={out_dir}'])['items'] == 1


def test_a_download_cut_short_leaves_no_file(tmp_path, monkeypatch):
    """The connection drops after the first chunk: an error naming the URL, and neither the file nor its
    temporary part left behind (a later run downloads again rather than read half a file)."""
    class Dropped:
        chunks, headers = [b'{"activity_label": "Tea"', OSError('connection reset by peer')], {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, size):
            chunk = self.chunks.pop(0)
            if isinstance(chunk, Exception):
                raise chunk
            return chunk

    monkeypatch.setattr(hellaswag.urllib.request, 'urlopen', lambda url, timeout: Dropped())
    path = tmp_path / 'hs' / 'val.jsonl'
    with pytest.raises(TrainError, match=f'could not download https://x/val.jsonl to {path} '
                                         r'\(connection reset by peer\)'):
        hellaswag.download(str(path), 'https://x/val.jsonl')
    assert os.listdir(tmp_path / 'hs') == []
    # closed early without an error (http.client returns b'' before Content-Length: "ideally, we would raise"): the
    # file is refused by its size, not kept as a whole one
    Dropped.chunks, Dropped.headers = [b'{"activity_label": "Tea"', b''], {'Content-Length': '974074'}
    with pytest.raises(TrainError, match=r'\(the connection closed after 24 of its 974,074 bytes\)'):
        hellaswag.download(str(path), 'https://x/val.jsonl')
    assert os.listdir(tmp_path / 'hs') == []
