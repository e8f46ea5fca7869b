"""
Hugging Face weights out and in. model.py's GPT is, weight for weight, Llama (LlamaForCausalLM) and, with
qk_norm, Qwen3 (Qwen3ForCausalLM): rotate-half RoPE, RMSNorm, SwiGLU, GQA, no biases. Only the layout
differs: model.py fuses q, k and v into one matrix (rows [q, k, v]) and the MLP's gate and up projections
into another (rows [gate, up]).

    python export.py --out_dir=out-small --hf_dir=out-small/hf                # ckpt.pt -> transformers
    python export.py --out_dir=out-small --ckpt=best.pt --dtype=bfloat16       # to out-small/hf

The export directory loads with transformers.AutoModelForCausalLM.from_pretrained (no code of ours):
config.json, model.safetensors (the safetensors library), generation_config.json (eos, and as suppress_tokens
the padding ids past the data's vocabulary, which sample.py never samples either), and the tokenizer where
transformers can express it: tokenizer.json and tokenizer_config.json for tiktoken BPE (gpt2, cl100k_base,
converted here) and for a Hugging Face tokenizer the data was prepared with (copied from the checkpoint's
meta, with its chat_template.jinja where it had one). A character-level vocabulary has no transformers
tokenizer: the export says so and writes char_vocab.json (the characters, in id order) instead. A directory
that holds files transformers would read beside these (another export's tokenizer, sharded weights: FOREIGN)
is refused, never mixed with this export (files of this export's own names there, an earlier export of this model
or another, are replaced, and named). Refused too: a model that Llama and Qwen3 cannot compute (hf_config), one
trained with logit_softcap, x0_mix or an MLP other than SwiGLU; a checkpoint whose weights do not fit its
model_args (as sample.py refuses it).
An export that fails (a full disk, a tokenizer that cannot be had) leaves the directory as it was: the files are
written apart, then moved in.

The other way, train.py's init_from=hf:PATH reads a Llama or Qwen3 directory through hf_model_args() and
load_hf_weights(): SmolLM2, Llama 3.2 (with Llama 3's RoPE scaling), Qwen3 (its head_dim set apart from the
width). Whatever model.py cannot represent (another RoPE scaling, such as yarn, biases, sliding windows,
another activation) is refused with a message naming it, never approximated. A checkpoint written by FP8 or
FSDP training exports like any other: checkpoints hold plain, name-keyed state dicts.
"""
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import suppress

import torch

from model import GPT, GPTConfig
from prepare_data import read_json, trained_here

DEFAULTS = dict(
    out_dir='out',       # the training run's directory
    ckpt='ckpt.pt',      # 'ckpt.pt' (latest) or 'best.pt' (lowest val loss)
    hf_dir='',           # where the export goes; '' = out_dir/hf
    dtype='float32',     # of the exported weights: 'float32' (as trained), 'bfloat16' or 'float16'
)

# per block: our tensor, and the Hugging Face tensors it holds, stacked by rows
LAYER = [('attn_norm.weight', ['input_layernorm.weight']),
         ('attn.qkv.weight', ['self_attn.q_proj.weight', 'self_attn.k_proj.weight', 'self_attn.v_proj.weight']),
         ('attn.q_norm.weight', ['self_attn.q_norm.weight']),  # qk_norm (Qwen3) only
         ('attn.k_norm.weight', ['self_attn.k_norm.weight']),
         ('attn.proj.weight', ['self_attn.o_proj.weight']),
         ('mlp_norm.weight', ['post_attention_layernorm.weight']),
         ('mlp.up.weight', ['mlp.gate_proj.weight', 'mlp.up_proj.weight']),  # SwiGLU: silu(gate) * up
         ('mlp.down.weight', ['mlp.down_proj.weight'])]
# GPTConfig's fields and the config.json keys they come from (for messages)
HF_KEYS = {'n_layer': 'num_hidden_layers', 'n_head': 'num_attention_heads', 'n_kv_head': 'num_key_value_heads',
           'n_embd': 'hidden_size', 'vocab_size': 'vocab_size', 'rope_base': 'rope_theta',
           'norm_eps': 'rms_norm_eps', 'tie_embeddings': 'tie_word_embeddings', 'qk_norm': 'model_type',
           'mlp': 'hidden_act', 'head_dim': 'head_dim', 'mlp_hidden': 'intermediate_size',
           'rope_scaling_factor': 'rope_scaling', 'rope_low_freq_factor': 'rope_scaling',
           'rope_high_freq_factor': 'rope_scaling', 'rope_original_max_len': 'rope_scaling'}
# the keys of a RoPE dict (rope_scaling, rope_parameters) that model.py can follow, by rope_type
ROPE_KEYS = {'default': {'rope_type', 'type', 'rope_theta'},
             'llama3': {'rope_type', 'type', 'rope_theta', 'factor', 'low_freq_factor', 'high_freq_factor',
                        'original_max_position_embeddings'}}


def name_map(c):
    """(our tensor, its Hugging Face tensors, their row counts) for every weight of a model of config c."""
    rows = {'attn.qkv.weight': [c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim],
            'mlp.up.weight': [c.mlp_hidden, c.mlp_hidden]}
    yield 'wte.weight', ['model.embed_tokens.weight'], None
    for i in range(c.n_layer):
        for ours, theirs in LAYER:
            if c.qk_norm or ours not in ('attn.q_norm.weight', 'attn.k_norm.weight'):
                yield f'blocks.{i}.{ours}', [f'model.layers.{i}.{t}' for t in theirs], rows.get(ours)
    yield 'norm.weight', ['model.norm.weight'], None
    if not c.tie_embeddings:
        yield 'lm_head.weight', ['lm_head.weight'], None


def to_hf(state, c):
    """Our state dict -> the Hugging Face tensors (fused matrices split by rows); a missing, misshapen or unknown
    tensor is an error naming it (sample.py refuses the same checkpoint)."""
    with torch.device('meta'):  # the shapes of config c, nothing allocated
        shapes = {k: tuple(v.shape) for k, v in GPT(c).state_dict().items()}
    if bad := [f"{k} has shape {tuple(v.shape)}, where its model_args make {shapes[k]}" for k, v in state.items()
               if k in shapes and tuple(v.shape) != shapes[k]]:
        raise ValueError(f"the checkpoint's weights do not fit its model_args: {'; '.join(bad[:5])}")
    out = {}
    for ours, theirs, rows in name_map(c):
        if ours not in state:
            from train import compiled_note  # (here: train.py imports this file)
            raise ValueError(f"the checkpoint's weights lack {ours}{compiled_note(state)}")
        out.update(zip(theirs, state[ours].split(rows) if rows else [state[ours]]))
    if unknown := sorted(set(state) - set(shapes)):
        raise ValueError(f"the checkpoint's weights hold tensors its model_args have no place for: "
                         f"{', '.join(unknown[:5])}" + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ''))
    return out


def from_hf(tensors, c):
    """Hugging Face tensors -> our state dict; a missing, unknown or misshapen tensor is an error naming it."""
    tensors = {k: v for k, v in tensors.items() if not k.endswith('rotary_emb.inv_freq')}  # RoPE's, in old files
    if c.tie_embeddings and 'lm_head.weight' in tensors:  # some tied checkpoints store the head as well
        head = tensors.pop('lm_head.weight')
        if not torch.equal(head, tensors.get('model.embed_tokens.weight', head)):
            raise ValueError("tie_word_embeddings is true, but lm_head.weight differs from "
                             "model.embed_tokens.weight")
    with torch.device('meta'):
        shapes = {k: v.shape for k, v in GPT(c).state_dict().items()}
    state = {}
    for ours, theirs, rows in name_map(c):
        if missing := [t for t in theirs if t not in tensors]:
            raise ValueError(f"the weights lack {missing[0]}" + (" (tie_word_embeddings is false)"
                                                                 if missing[0] == 'lm_head.weight' else ''))
        state[ours] = torch.cat([tensors.pop(t) for t in theirs])
        if state[ours].shape != shapes[ours]:
            raise ValueError(f"{', '.join(theirs)}: shape {tuple(state[ours].shape)} where config.json implies "
                             f"{tuple(shapes[ours])}")
    if tensors:
        raise ValueError(f"the weights hold tensors that model.py has no place for: {', '.join(sorted(tensors)[:5])}"
                         + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else ''))
    if c.tie_embeddings:
        state['lm_head.weight'] = state['wte.weight']
    return state


# ----------------------------------------------------------------------------------------------------
# weights in: a Hugging Face directory -> GPTConfig arguments and a state dict

def hf_model_args(path):
    """(GPTConfig arguments, max_position_embeddings) from path/config.json, or an error naming what model.py
    cannot represent. A key that config.json leaves out takes transformers' default."""
    cfg = read_json(os.path.join(path, 'config.json'))
    where = f"{path}/config.json"
    kind = cfg.get('model_type')
    if kind not in ('llama', 'qwen3'):
        raise ValueError(f"{where}: model_type={kind!r}; only Llama ('llama', e.g. SmolLM2) and Qwen3 ('qwen3') "
                         f"checkpoints map onto model.py")
    # as transformers: rope_scaling (older files, Llama 3.2's) over rope_parameters (transformers 5's own)
    rope_key = 'rope_scaling' if cfg.get('rope_scaling') else 'rope_parameters'
    rope = cfg.get(rope_key) or {}
    rope_type = rope.get('rope_type', rope.get('type', 'default'))
    extra = sorted(set(rope) - ROPE_KEYS.get(rope_type, set(rope)))
    refused = [('hidden_act', cfg.get('hidden_act', 'silu') != 'silu', 'model.py gates its MLP with silu'),
               ('attention_bias', cfg.get('attention_bias', False), 'model.py has no biases'),
               ('mlp_bias', cfg.get('mlp_bias', False), 'model.py has no biases'),
               (rope_key, rope_type not in ROPE_KEYS, f"rope_type {rope_type!r}: model.py has plain RoPE and Llama 3's "
                                                      f"scaling ('llama3')"),
               (rope_key, extra, f"model.py's RoPE has no {', '.join(extra)}"),
               ('partial_rotary_factor', cfg.get('partial_rotary_factor', 1.0) != 1.0, 'model.py rotates whole heads'),
               ('use_sliding_window', cfg.get('use_sliding_window', False), 'model.py attends to the whole context'),
               ('layer_types', any(t != 'full_attention' for t in cfg.get('layer_types') or []),
                'model.py attends to the whole context'),
               ('quantization_config', 'quantization_config' in cfg, 'quantized weights are not loaded')]
    for key, bad, why in refused:
        if bad:
            raise ValueError(f"{where}: {key}={cfg.get(key)!r} cannot be represented ({why})")
    if rope_type == 'llama3' and (missing := [k for k in ('factor', 'low_freq_factor', 'high_freq_factor')
                                              if k not in rope]):
        raise ValueError(f"{where}: {rope_key} lacks {missing[0]} (rope_type 'llama3')")
    max_len = cfg.get('max_position_embeddings', 32768 if kind == 'qwen3' else 2048)
    try:
        n_head = cfg['num_attention_heads']
        qwen3 = kind == 'qwen3'  # where a key is left out, transformers' defaults: Qwen3Config's, LlamaConfig's
        args = dict(n_layer=cfg['num_hidden_layers'], n_head=n_head,
                    n_kv_head=cfg.get('num_key_value_heads') or (32 if qwen3 else n_head),
                    n_embd=cfg['hidden_size'], vocab_size=cfg['vocab_size'], qk_norm=kind == 'qwen3',
                    tie_embeddings=cfg.get('tie_word_embeddings', False), mlp='swiglu',
                    rope_base=float(rope.get('rope_theta', cfg.get('rope_theta', 10000.0))),
                    norm_eps=cfg.get('rms_norm_eps', 1e-6),
                    head_dim=cfg.get('head_dim') or (128 if qwen3 else cfg['hidden_size'] // n_head),
                    mlp_hidden=cfg.get('intermediate_size', 22016 if kind == 'qwen3' else 11008))
        if rope_type == 'llama3':  # where the length of pretraining is, as transformers looks for it
            original = (cfg.get('original_max_position_embeddings') or rope.get('original_max_position_embeddings')
                        or max_len)
            args.update(rope_scaling_factor=float(rope['factor']), rope_low_freq_factor=float(rope['low_freq_factor']),
                        rope_high_freq_factor=float(rope['high_freq_factor']), rope_original_max_len=int(original))
        GPTConfig(**args)
    except KeyError as e:
        raise ValueError(f"{where} lacks {e.args[0]}") from None
    except ValueError as e:  # a shape that GPTConfig refuses
        raise ValueError(f"{where}: {e}") from None
    return args, max_len


def load_hf_weights(path, c):
    """Our state dict from path's model.safetensors, or the shards that model.safetensors.index.json lists."""
    from safetensors.torch import load_file
    index = os.path.join(path, 'model.safetensors.index.json')
    if os.path.exists(index):
        files = sorted(set(read_json(index)['weight_map'].values()))
    elif os.path.exists(os.path.join(path, 'model.safetensors')):
        files = ['model.safetensors']
    else:
        raise ValueError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    return from_hf(tensors, c)


# ----------------------------------------------------------------------------------------------------
# weights out: a checkpoint -> config.json, model.safetensors, generation_config.json and the tokenizer

def hf_config(c, eot, dtype):
    """config.json for a model of config c: Qwen3 with QK-norm, else Llama."""
    refused = [why for unmet, why in (
        (c.logit_softcap, f"logit_softcap={c.logit_softcap}: Llama and Qwen3 do not cap their logits, so the exported "
                          f"model would compute other probabilities; train with logit_softcap=0 to export"),
        (c.x0_mix, "x0_mix=True: Llama and Qwen3 have no path from the token embeddings into the later blocks, so "
                   "the exported model would compute something else; train with x0_mix=False to export"),
        (c.mlp != 'swiglu', f"mlp={c.mlp!r}: Llama and Qwen3 use SwiGLU, so transformers has no architecture for "
                            f"this model; train with mlp='swiglu' to export")) if unmet]
    if refused:  # all of them at once: named one at a time, a retrain for the first met the next
        raise ValueError('. '.join(refused))
    arch = 'Qwen3ForCausalLM' if c.qk_norm else 'LlamaForCausalLM'
    config = dict(architectures=[arch], model_type='qwen3' if c.qk_norm else 'llama', vocab_size=c.vocab_size,
                  hidden_size=c.n_embd, intermediate_size=c.mlp_hidden, num_hidden_layers=c.n_layer,
                  num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
                  hidden_act='silu', max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
                  rope_theta=c.rope_base, rope_scaling=hf_rope_scaling(c), attention_bias=False, attention_dropout=0.0,
                  tie_word_embeddings=c.tie_embeddings, bos_token_id=None, eos_token_id=eot,
                  torch_dtype=dtype, use_cache=True)
    if c.qk_norm:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    else:
        config.update(mlp_bias=False, pretraining_tp=1)
    return config


def hf_rope_scaling(c):
    """config.json's rope_scaling for c: Llama 3's, as Llama 3.2's config.json writes it, or None."""
    if not c.rope_scaling_factor:
        return None
    return dict(rope_type='llama3', factor=c.rope_scaling_factor, low_freq_factor=c.rope_low_freq_factor,
                high_freq_factor=c.rope_high_freq_factor, original_max_position_embeddings=c.rope_original_max_len)


def tiktoken_to_hf(enc):
    """A tiktoken Encoding as a `tokenizers` byte-level BPE that encodes and decodes the same ids.

    As transformers' TikTokenConverter: tiktoken merges the adjacent pair whose concatenation has the lowest
    rank, so every split of a token into two tokens becomes a merge, ranked by the token it makes; bytes are
    written with GPT-2's byte-to-unicode table, and the split regex is tiktoken's own.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    # GPT-2's table: printable bytes stand for themselves, the others for code points from 256 up
    keep = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in table)})

    def text(token):
        return ''.join(table[b] for b in token)
    ranks = enc._mergeable_ranks
    merges = sorted((rank, ranks[t[:i]], ranks[t[i:]], t[:i], t[i:]) for t, rank in ranks.items()
                    for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks)
    vocab = {text(t): rank for t, rank in ranks.items()}
    vocab.update(enc._special_tokens)
    tok = Tokenizer(models.BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], ignore_merges=True))
    # NOTE: `{1,3}+` is possessive in tiktoken's regex engine but means `({1,3})+` in Oniguruma's, which
    # would keep '1024' whole; nothing follows it in its alternative, so the greedy `{1,3}` is the same
    pattern = re.sub(r'(\{\d+,\d+\})\+', r'\1', enc._pat_str)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior='isolated'),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in enc._special_tokens])
    return tok


def write_tokenizer(meta, hf_dir, max_len):
    """The dataset's tokenizer, as transformers reads it, into hf_dir; returns a line saying what was written."""
    name, eot = meta['tokenizer'], meta.get('eot_token')
    if name == 'char':
        with open(os.path.join(hf_dir, 'char_vocab.json'), 'w') as f:
            json.dump(list(meta['chars']), f, ensure_ascii=False)
        return ("tokenizer: character level, which transformers cannot express as a tokenizer; wrote "
                "char_vocab.json (the characters in id order: id i is chars[i]) beside the model")
    if name.startswith('hf:'):
        with open(os.path.join(hf_dir, 'tokenizer.json'), 'w', encoding='utf-8') as f:
            f.write(meta['tokenizer_json'])
        copied = ['tokenizer.json']
        for key, file in (('chat_template', 'chat_template.jinja'), ('tokenizer_config', 'tokenizer_config.json')):
            if meta.get(key):  # as they came with the tokenizer (a chat template, special tokens)
                text = meta[key]
                if key == 'tokenizer_config' and trained_here(text):  # prepare_data.py's bpe:N: the model's length
                    text = json.dumps({**json.loads(text), 'model_max_length': max_len}, indent=1)
                with open(os.path.join(hf_dir, file), 'w', encoding='utf-8') as f:
                    f.write(text)
                copied.append(file)
        note = f"tokenizer: copied from {name} ({', '.join(copied)})"
        if meta.get('tokenizer_config'):
            return note
        eos = None if eot is None else json.loads(meta['tokenizer_json'])
        eos = next((t['content'] for t in (eos or {}).get('added_tokens', []) if t['id'] == eot), None)
    else:
        from prepare_data import load_bpe
        enc = load_bpe(name)
        try:
            tiktoken_to_hf(enc).save(os.path.join(hf_dir, 'tokenizer.json'))
        except Exception as e:  # tokenizers' failed write is a plain Exception ('File too large (os error 27)')
            raise OSError(f"tokenizer.json: {e}") from None
        eos = None if eot is None else enc.decode_single_token_bytes(eot).decode()
        note = f"tokenizer: tiktoken {name} converted to tokenizer.json"
    with open(os.path.join(hf_dir, 'tokenizer_config.json'), 'w') as f:
        json.dump(dict(tokenizer_class='PreTrainedTokenizerFast', model_max_length=max_len, eos_token=eos,
                       clean_up_tokenization_spaces=False), f, indent=1)
    return note


# what transformers reads from a model directory besides the files an export writes (model.safetensors, config.json,
# generation_config.json and its tokenizer's): left there by another export or model, they would load with this one
FOREIGN = ('model.safetensors.index.json', 'pytorch_model.bin', 'pytorch_model.bin.index.json', 'tokenizer.json',
           'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json', 'chat_template.jinja',
           'additional_chat_templates', 'tokenizer.model', 'vocab.json', 'merges.txt', 'char_vocab.json')


def export(ckpt_path, hf_dir, dtype='float32'):
    """Write the checkpoint at ckpt_path as a transformers model directory; returns the lines it printed."""
    from train import load_checkpoint, probe_out_dir  # here: train.py imports this file for init_from=hf
    if dtype not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f"dtype={dtype!r}: expected 'float32', 'bfloat16' or 'float16'")
    ckpt = load_checkpoint(ckpt_path)
    if missing := [k for k in ('model', 'model_args', 'meta') if k not in ckpt]:
        raise ValueError(f"{ckpt_path} is not a checkpoint of train.py: it lacks {', '.join(missing)}")
    try:
        c, meta = GPTConfig(**ckpt['model_args']), ckpt['meta']
    except (TypeError, ValueError) as e:  # a key GPTConfig lacks, or a shape it refuses
        raise ValueError(f"{ckpt_path}: its model_args do not make a model.py config: {e}") from None
    config = hf_config(c, meta.get('eot_token'), dtype)
    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in to_hf(ckpt['model'], c).items()}
    made = not os.path.exists(hf_dir)
    probe_out_dir(hf_dir, 'hf_dir')  # made and probed: a one-line error naming it
    try:
        return write_export(hf_dir, ckpt_path, ckpt, c, meta, config, tensors, dtype)
    except BaseException:
        if made:
            with suppress(OSError):  # rmdir removes only an empty directory
                os.rmdir(hf_dir)  # a failed export into a new directory leaves none behind
        raise


def write_export(hf_dir, ckpt_path, ckpt, c, meta, config, tensors, dtype):
    """export()'s check of what hf_dir holds, then its writes: each file staged in hf_dir, then moved into place."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    ours = ({'char_vocab.json'} if meta['tokenizer'] == 'char' else {'tokenizer.json', 'tokenizer_config.json'}
            | ({'chat_template.jinja'} if meta.get('chat_template') else set()))
    stale = [n for n in FOREIGN if n not in ours and os.path.exists(os.path.join(hf_dir, n))]
    stale += sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(hf_dir), 'model-*.safetensors')))
    if stale:
        raise ValueError(f"hf_dir {hf_dir} holds {', '.join(stale)}, which this export does not write and transformers "
                         f"would load with it (another export's or model's): remove them, or choose another hf_dir")
    # every file is written into a directory of its own inside hf_dir first, then moved into place: an export that
    # fails (a full disk, a tokenizer that cannot be had) leaves hf_dir as it was, never new weights beside an old
    # tokenizer or a cut file
    stage = tempfile.mkdtemp(prefix='.export-', dir=hf_dir)
    try:
        weights = os.path.join(stage, 'model.safetensors')
        try:
            save_file(tensors, weights, metadata={'format': 'pt'})
        except SafetensorError as e:  # its failed writes ('I/O error: File too large (os error 27)')
            raise OSError(f"model.safetensors: {e}") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(weights, 0o666 & ~umask)  # save_file leaves its file readable by its owner alone (0600)
        generation = dict(bos_token_id=None, eos_token_id=config['eos_token_id'])
        if meta['vocab_size'] < c.vocab_size:  # the padding ids past the data's vocabulary, which no tokenizer
            # decodes: never generated, as sample.py's vocab_limit ensures for our own model
            generation['suppress_tokens'] = list(range(meta['vocab_size'], c.vocab_size))
        for name, content in (('config.json', config), ('generation_config.json', generation)):
            with open(os.path.join(stage, name), 'w') as f:
                json.dump(content, f, indent=1)
        lines = [f"wrote {hf_dir}: {config['architectures'][0]}, {sum(t.numel() for t in tensors.values()) / 1e6:.2f}M "
                 f"parameters in {dtype} (from {ckpt_path}, iteration {ckpt.get('iter_num', '?')})",
                 write_tokenizer(meta, stage, c.block_size)]
        names = sorted(os.listdir(stage))
        if replaced := [n for n in names if os.path.exists(os.path.join(hf_dir, n))]:  # an earlier export's, or not
            lines[0] += f"; replaced the {', '.join(replaced)} it held"
        for name in names:
            os.replace(os.path.join(stage, name), os.path.join(hf_dir, name))
    except OSError as e:  # named by hf_dir, not by the staging directory's paths
        reason = e.strerror or str(e) or type(e).__name__
        raise ValueError(f"cannot write into {hf_dir}: {reason}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for line in lines:
        print(line)
    return lines


def main(argv):
    from configurator import configure
    from prepare_data import os_reason
    cfg = configure(DEFAULTS, argv, __file__)
    hf_dir = cfg['hf_dir'] or os.path.join(cfg['out_dir'], 'hf')
    try:
        export(os.path.join(cfg['out_dir'], cfg['ckpt']), hf_dir, cfg['dtype'])
    except OSError as e:  # a write into the probed directory (a full disk shows at a file's close: no file named)
        raise ValueError(f"cannot write into {hf_dir}: {os_reason(e, hf_dir)}") from None


if __name__ == '__main__':
    from train import TrainError
    try:
        main(sys.argv[1:])
    except (ValueError, TrainError) as e:  # ConfigError is a ValueError
        sys.exit(f"export.py: error: {e}")
    except OSError as e:  # the model directory cannot be written
        sys.exit(f"export.py: error: {e.filename or ''}: {e.strerror or e}")
