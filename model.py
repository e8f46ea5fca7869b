"""
A modern GPT in one file, read top to bottom: config, norm, rotary embedding, attention, MLP, block, KV cache,
selective checkpointing, loss, the model (with its FLOPs/MFU arithmetic and generate), then sampling and the
GPUs' peak FLOPs.

Features, each findable by name below:
- GPTConfig: one flat dataclass; derived sizes (head_dim, mlp_hidden, unless set) and shape checks in
  __post_init__.
- RMSNorm (torch's nn.RMSNorm, with a cheaper backward on the CPU; bf16 input with a float32 weight normalized
  in float32 on every device), pre-norm residual blocks, no biases.
- Rotary position embedding (RoPE) from precomputed, non-persistent cos/sin buffers, turned into the tables
  apply_rotary multiplies by once per forward (rotary_tables); optionally with Llama 3's frequency scaling
  (llama3_scaling, rope_scaling_factor > 0), as in Llama 3.1 and 3.2.
- Attention with ONE fused QKV projection, grouped-query attention (n_kv_head < n_head) and causal
  attention through F.scaled_dot_product_attention (flash / memory-efficient kernels; in float32 under CPU
  autocast: attend); optional QK-norm.
- MLP: SwiGLU (default), GeGLU, GELU or ReLU^2. The fused matrices' parts (fused_parts: q, k, v; gate, up).
- Dropout (embeddings, attention, residual branches), off in eval.
- x0_mix: each block after the first also reads a learned multiple of the token embeddings.
- Tied input/output embeddings (optional), GPT-2 style init with residual projections scaled by depth
  (or zero: zero_init_proj); optional logit soft-capping (softcap).
- The residual stream in autocast's dtype (`model.autocast_residual`), float32 by default.
- Activation checkpointing (`model.activation_checkpointing`): 'full' recomputes each block in backward;
  'selective' keeps the matmul and attention outputs and recomputes only the cheap ops between them.
- The loss without the full logits (ChunkedCrossEntropy, `model.loss_chunk_tokens`): the head's matmul,
  cross-entropy and their gradients a chunk of tokens at a time; forward returns logits only without targets.
  Targets equal to IGNORE_INDEX (-100) count in neither loss, as in F.cross_entropy; label smoothing in both.
- flops_per_token() from the actual matmul weights plus attention; estimate_mfu() against the
  device's peak (PEAK_FLOPS: A100, H100, H200, H800, GH200, L40S, L40, L4, RTX 4090; None elsewhere).
- generate(): KV cache, temperature, top-k, top-p, vocab_limit (no padding ids), stop_token (end of text), under
  torch.inference_mode().
"""
import math
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclass
class GPTConfig:
    block_size: int = 1024     # longest sequence the model sees
    vocab_size: int = 50304    # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 0         # key/value heads for grouped-query attention; 0 means n_head
    n_embd: int = 768
    dropout: float = 0.0
    qk_norm: bool = False      # RMSNorm on queries and keys before RoPE (stabilizes large-lr training)
    tie_embeddings: bool = True
    mlp: str = 'swiglu'        # 'swiglu', 'geglu', 'gelu' or 'relu2'
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    logit_softcap: float = 0.0   # > 0: logits = logit_softcap * tanh(logits / logit_softcap); 0: off
    zero_init_proj: bool = False  # attn.proj and mlp.down, which write into the residual stream, start at zero
    x0_mix: bool = False       # each block after the first adds a learned multiple (from 0) of the token embeddings
    # derived in __post_init__
    head_dim: int = 0          # 0: n_embd // n_head; set apart from the width in Qwen3 (128 at width 1024, 16 heads)
    mlp_hidden: int = 0        # 0: 8/3 n_embd (4 n_embd for gelu, relu2) rounded up to 64s; published models
                               # set their own (Llama 3.2 1B: 8192 at width 2048, where 8/3 gives 5504)
    # Llama 3's RoPE scaling (Llama 3.1 and 3.2; llama3_scaling): 0 is off
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192  # the context length of pretraining, before the scaling

    def __post_init__(self):
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        for name in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_kv_head', 'n_embd'):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be positive")
        for name in ('head_dim', 'mlp_hidden'):
            if getattr(self, name) < 0:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be at least 0 (0: derived)")
        if self.n_embd % self.n_head and not self.head_dim:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} is not divisible by "
                             f"n_kv_head={self.n_kv_head} (each key/value head serves a group of query heads)")
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig: head_dim={self.head_dim} (n_embd/n_head unless set) must be even for RoPE")
        if self.mlp not in ('swiglu', 'geglu', 'gelu', 'relu2'):
            raise ValueError(f"GPTConfig: mlp={self.mlp!r}, expected 'swiglu', 'geglu', 'gelu' or 'relu2'")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1)")
        if self.x0_mix and self.n_layer < 2:
            raise ValueError(f"GPTConfig: x0_mix=True with n_layer={self.n_layer}: it mixes the token embeddings into "
                             f"the blocks after the first, and there are none (the first reads them already)")
        if not self.logit_softcap >= 0:
            raise ValueError(f"GPTConfig: logit_softcap={self.logit_softcap} must be >= 0 (0: off)")
        if self.rope_scaling_factor and not (self.rope_scaling_factor >= 1 and self.rope_original_max_len >= 1
                                             and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"GPTConfig: rope_scaling_factor={self.rope_scaling_factor} with rope_low_freq_factor="
                             f"{self.rope_low_freq_factor}, rope_high_freq_factor={self.rope_high_freq_factor}, "
                             f"rope_original_max_len={self.rope_original_max_len}: Llama 3's scaling needs a factor "
                             f"of at least 1 (0: off), 0 < low < high and a positive length")
        # Gated MLPs have three matrices instead of two: 8/3 * n_embd keeps the parameter count of a
        # 4 * n_embd GELU MLP (Shazeer 2020). Rounded up to a multiple of 64 for the matmul kernels.
        hidden = 4 * self.n_embd if self.mlp in ('gelu', 'relu2') else int(8 * self.n_embd / 3)
        self.mlp_hidden = self.mlp_hidden or 64 * math.ceil(hidden / 64)

    def to_dict(self):
        """The constructor arguments, the derived sizes as derived (what a checkpoint stores)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ----------------------------------------------------------------------------------------------------
# RMSNorm

class RMSNorm(nn.RMSNorm):
    """torch's nn.RMSNorm (same parameters, same state dict), with a hand-written backward on the CPU: torch 2.13's
    CPU rms_norm is composite (pow, mean, add, rsqrt, mul, mul) and autograd runs each op's backward, about twice
    the elementwise passes of the formula's gradient below. bf16 and fp16 inputs with a float32 weight (q and k
    under autocast with qk_norm, the residual stream with GPT.autocast_residual) are normalized in float32 and
    rounded once, on every device: torch's fused kernels take one dtype, and its composite warns that it cannot
    fuse a float32 weight with them."""

    def forward(self, x):
        return self.cpu_forward(x) if x.device.type == 'cpu' else self.fused_forward(x)

    def fused_forward(self, x):
        """torch's rms_norm: one fused kernel on CUDA, which takes one dtype."""
        low = x.dtype in (torch.bfloat16, torch.float16)
        if low and self.weight is not None and self.weight.dtype == torch.float32:
            return super().forward(x.float()).to(x.dtype)
        return super().forward(x)

    def cpu_forward(self, x):
        if self.weight is None:
            return super().forward(x)
        if x.dtype in (torch.bfloat16, torch.float16):  # under autocast: computed in float32, returned in x's dtype,
            eps = torch.finfo(torch.float32).eps if self.eps is None else self.eps  # as torch's, warning-free
            return _RMSNormFunction.apply(x.float(), self.weight.float(), eps).to(x.dtype)
        return _RMSNormFunction.apply(x, self.weight, torch.finfo(x.dtype).eps if self.eps is None else self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """y = x r w with r = (mean(x^2) + eps)^-1/2 over the last dim. Gradients: dw = sum(g x r) over the other dims,
    dx = r g w - x r^3 <g w, x> / C."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        ctx.save_for_backward(x, weight, rstd)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        gw = grad * weight
        dot = (gw * x).sum(-1, keepdim=True).mul_(rstd.pow(3) / x.size(-1))  # (not vecdot: autocast lowers it)
        dx = torch.addcmul(gw * rstd, x, dot, value=-1)
        dw = (grad * x * rstd).flatten(0, -2).sum(0)
        return dx, dw, None


# ----------------------------------------------------------------------------------------------------
# rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864)

def llama3_scaling(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    """Llama 3's RoPE scaling (Llama 3.1 and 3.2; transformers' _compute_llama3_parameters, the same arithmetic):
    channel pairs whose wavelength 2 pi / inv_freq exceeds original_max_len / low_freq_factor turn factor times
    slower, so that the longer context spans the angles pretraining saw; those shorter than original_max_len /
    high_freq_factor stay as they were; in between, a blend linear in original_max_len / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq  # 0: inv_freq / factor, 1: inv_freq as it was


def rope_scaling(config):
    """The adjustment of the frequencies that config asks for: llama3_scaling with its fields, or None (plain RoPE)."""
    if not config.rope_scaling_factor:
        return None
    return partial(llama3_scaling, factor=config.rope_scaling_factor, low_freq_factor=config.rope_low_freq_factor,
                   high_freq_factor=config.rope_high_freq_factor, original_max_len=config.rope_original_max_len)


def rope_cache(seq_len, head_dim, base, scaling=None):
    """cos and sin of shape (seq_len, head_dim // 2): position t rotates channel pair i by t * base^(-2i/d), the
    frequencies adjusted first by scaling (a function of them: llama3_scaling) when given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaling(inv_freq)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotary_tables(cos, sin):
    """[cos, cos] and [-sin, sin] of shape (T, 1, D), from the (T, D/2) cos and sin of the angles: what
    apply_rotary multiplies by. GPT.forward builds them once for all its layers."""
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rotary(x, cos, sin):
    """Rotate channel pairs (i, i + D/2) of x (B, T, H, D) by the angles of cos/sin (T, D/2), or of the tables
    that rotary_tables makes of them: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed as
    x * [cos, cos] + [x2, x1] * [-sin, sin].
    NOTE: three kernels over whole heads (mul, flip, addcmul); the textbook form (chunk, four muls, sub, add,
    cat) runs seven, on half-head slices that the CPU's elementwise loops handle poorly."""
    D = x.size(-1)
    if cos.dim() == 2:
        cos, sin = rotary_tables(cos, sin)
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)  # [x2, x1]
    return torch.addcmul(x * cos.to(x.dtype), swapped, sin.to(x.dtype))


# ----------------------------------------------------------------------------------------------------
# attention

def attend(q, k, v, **kwargs):
    """F.scaled_dot_product_attention(q, k, v, **kwargs), except under CPU autocast: there in float32, since
    torch 2.13's CPU flash attention runs bf16 1.3x (T=256) to 3x (T=64) slower than float32 (head_dim 32,
    forward and backward); the output is float32 then, and the projection after it casts it back."""
    if q.device.type != 'cpu' or not torch.is_autocast_enabled('cpu'):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with torch.autocast('cpu', enabled=False):
        return F.scaled_dot_product_attention(*(t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
                                                for t in (q, k, v)), **kwargs)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        # one matmul for queries, keys and values: (n_head + 2 * n_kv_head) * head_dim outputs
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * config.head_dim, bias=False)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        self.q_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.dropout = config.dropout

    def forward(self, x, cos, sin, cache=None, layer=0):
        B, T, C = x.size()
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        # NOTE: split into heads, not into channels then views: compiled for CUDA, the gradient's cat of dq, dk and
        # dv (one kernel with RoPE's backward) then indexes whole heads. Split by channels, that kernel took 0.30 ms
        # per 16 x 1024 micro-batch at 124M on an H100, 6x its bytes' time: by its code, integer index arithmetic.
        q, k, v = self.qkv(x).view(B, T, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=2)
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or Hkv, T, D)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Hkv, T_cached + T, D)
        # NOTE: is_causal aligns the mask to the top-left corner, so with a cache it is only right for a
        # prefill (empty cache); a single new token attends to every cached position, no mask needed.
        assert cache is None or T == 1 or k.size(2) == T, "decode one token at a time after the prefill"
        # NOTE: `cache is None or`: without a cache, a plain bool, not T > 1, which under dynamic shapes (windows of
        # short_block_size) is symbolic, a type SDPA refuses: a graph break that sent the model's forward to eager
        causal = cache is None or T > 1
        y = attend(q, k, v, is_causal=causal, enable_gqa=(H != Hkv), dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H * D)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.kind = config.mlp
        gated = config.mlp in ('swiglu', 'geglu')
        self.up = nn.Linear(config.n_embd, config.mlp_hidden * (2 if gated else 1), bias=False)  # [gate, up] fused
        self.down = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.dropout = config.dropout

    def forward(self, x):
        h = self.up(x)
        if self.kind == 'gelu':
            h = F.gelu(h)
        elif self.kind == 'relu2':  # ReLU squared (So et al. 2021, Primer, https://arxiv.org/abs/2109.08668)
            h = F.relu(h).square()
        else:  # SwiGLU / GeGLU (Shazeer 2020, https://arxiv.org/abs/2002.05202)
            gate, h = h.chunk(2, dim=-1)
            h = (F.silu(gate) if self.kind == 'swiglu' else F.gelu(gate)) * h
        return F.dropout(self.down(h), self.dropout, self.training)


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, layer=0):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class KVCache:
    """Keys and values of every layer for generation, preallocated: (n_layer, B, n_kv_head, max_len, D)."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.pos = 0  # tokens already cached; GPT.forward advances it after the last layer

    def update(self, layer, k, v):
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def softcap(logits, cap):
    """cap * tanh(logits / cap): logits smoothly bounded to (-cap, cap) (Gemma 2, https://arxiv.org/abs/2408.00118;
    modded-nanogpt); cap 0 leaves them as they are."""
    return logits if cap == 0 else cap * torch.tanh(logits / cap)


# ----------------------------------------------------------------------------------------------------
# selective activation checkpointing: save what is expensive to recompute (matmuls, attention), recompute
# the rest (norms, RoPE, activations, residual adds), which costs little time and holds most of the memory

aten = torch.ops.aten
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_mm.default}  # FP8 matmuls (fp8=True)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# ----------------------------------------------------------------------------------------------------
# the loss without the full logits. At batch 16 x 1024 and GPT-2's vocabulary the logits are 1.65 GB in bf16,
# then 3.3 GB in fp32 for the softmax, then their gradient. Here each chunk of tokens takes the head's matmul,
# its loss and its gradients at once, so one chunk's logits exist at a time and none are kept for backward:
# the approach of Liger Kernel's fused linear cross-entropy (https://arxiv.org/abs/2410.10989), whose Triton
# kernels need CUDA; this one is plain PyTorch, runs on any device, and torch.compile fuses its elementwise ops.

# logits per chunk at most: 4096 tokens of GPT-2's vocabulary, 824 MB in fp32. On an H100 at 124M (16 x 1024 tokens
# per micro-batch), compiled, 4 chunks ran 3% faster than 16 with a 0.7 GB lower peak (BENCHMARKS.md): fewer partial
# head gradients to hold and sum. Eager holds none of those, and a larger chunk raises its peak instead (about 1.2 GB
# there by arithmetic: 8 bytes per logit in flight)
LOSS_CHUNK_LOGITS = 2 ** 28
IGNORE_INDEX = -100  # a target that counts in neither the loss nor the mean, in both losses (F.cross_entropy's)


def cross_entropy_chunk(x, weight, targets, label_smoothing, cap=0.0, with_grad=True):
    """The summed cross-entropy of a chunk of tokens, x (N, C) against targets (N,), and its gradient with
    respect to the chunk's logits (N, V), or None without with_grad. The one place where the loss meets the
    logits: soft-capping (cap > 0, see softcap) is applied here, and its derivative, 1 - tanh^2, to the gradient.
    Rows whose target is IGNORE_INDEX are left out of the loss; their gradient rows are not zeroed here (that
    would be a pass over the logits): ChunkedCrossEntropy drops them at (N, C), after and before the matmuls."""
    logits = softcap(F.linear(x, weight), cap)  # (N, V), in the autocast dtype
    logp = logits.log_softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # fp32 or fp64
    eps, V = label_smoothing, logp.size(-1)  # the target distribution: 1 - eps on the target, eps / V everywhere
    kept = targets != IGNORE_INDEX
    targets = targets.clamp(min=0)  # an ignored row's index: any valid one, its terms are masked
    loss = -(1 - eps) * (logp.gather(1, targets[:, None]).squeeze(1) * kept).sum()
    if eps:  # (a whole pass over the logits: skipped without label smoothing)
        loss = loss - eps / V * (logp.sum(dim=-1) * kept).sum()
    if not with_grad:  # evaluation
        return loss, None
    grad = logp.exp_()  # softmax (in place of logp), minus the target distribution
    if eps:
        grad -= eps / V
    if torch.compiler.is_compiling():  # as a select, which inductor fuses with the exp and the cast to the autocast
        # dtype: one pass writes the bf16 gradient; the indexed update would make it write the fp32 one first
        grad = torch.where(torch.arange(V, device=grad.device) == targets[:, None], grad - (1 - eps), grad)
    else:  # eager: in place, on the targets alone
        grad[torch.arange(len(targets), device=grad.device), targets] -= 1 - eps
    if cap:  # d(cap tanh(z / cap))/dz = 1 - tanh^2, and tanh = the capped logits / cap
        grad *= 1 - (logits.to(grad.dtype) / cap).square()
    return loss, grad.to(logits.dtype)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits x @ weight.T of N tokens (x: (N, C)), chunk_tokens at a time, over
    the tokens whose target is not IGNORE_INDEX (as F.cross_entropy: all of them ignored gives NaN).

    The gradients are computed in the forward pass, chunk by chunk, and kept for backward, which only scales
    them: grad_x (N, C) and grad_w (V, C, fp32) instead of the (N, V) logits, and the head's three matmuls run
    once each, none recomputed. NOTE: what is kept is the gradient of the summed loss; the 1/N of the mean is
    applied in backward, with the GradScaler's factor, so fp16 gradients do not underflow.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, label_smoothing, chunk_tokens, with_grad, cap=0.0):
        loss = torch.zeros((), device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
        grad_x = torch.empty_like(x) if with_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if with_grad else None
        kept = (targets != IGNORE_INDEX)[:, None].to(x.dtype)  # (N, 1): 0 drops an ignored row's gradients
        for i in range(0, len(x), chunk_tokens):
            x_c, y_c = x[i:i + chunk_tokens], targets[i:i + chunk_tokens]  # (n, C), (n,)
            loss_c, grad_logits = cross_entropy_chunk(x_c, weight, y_c, label_smoothing, cap, with_grad)  # (), (n, V)
            loss += loss_c
            if with_grad:
                kept_c = kept[i:i + chunk_tokens]
                grad_x[i:i + chunk_tokens] = (grad_logits @ weight) * kept_c  # (n, C)
                grad_w += grad_logits.t() @ (x_c * kept_c)  # (V, C), summed in fp32 over the chunks
        n_kept = kept.sum(dtype=loss.dtype)  # a tensor: no host sync
        ctx.save_for_backward(grad_x, grad_w, n_kept)
        ctx.weight_dtype = weight.dtype
        return loss / n_kept

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n_kept = ctx.saved_tensors
        scale = grad_loss / n_kept
        return grad_x * scale, (grad_w * scale).to(ctx.weight_dtype), None, None, None, None, None


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one matrix embeds tokens and scores them
        cos, sin = rope_cache(config.block_size, config.head_dim, config.rope_base, rope_scaling(config))
        self.register_buffer('cos', cos, persistent=False)  # recomputed, never saved in checkpoints
        self.register_buffer('sin', sin, persistent=False)
        # x0_mix: block i > 0 reads x + x0_scale[i - 1] * x0, x0 the token embeddings (modded-nanogpt's x0 lambdas,
        # one scalar per block here), so every block has the tokens themselves at hand, not only what the
        # blocks before it left of them
        self.x0_scale = nn.Parameter(torch.zeros(config.n_layer - 1)) if config.x0_mix else None
        self.activation_checkpointing = 'none'  # 'full' or 'selective': see the module docstring
        # True: under autocast, the residual stream in autocast's dtype (the token embeddings cast to it, so every
        # block's sum stays in it), as under FSDP's bf16 policy; False: float32, as autocast leaves it. bf16 moves
        # about 16% fewer bytes through the compiled 124M step's elementwise kernels, by inductor's estimate from
        # the generated code (BENCHMARKS.md), and rounds each block's update to bf16 (bench.py --residual=autocast)
        self.autocast_residual = False
        # tokens per chunk of the loss (ChunkedCrossEntropy): the largest power of two whose logits fit in
        # LOSS_CHUNK_LOGITS; 0: the plain loss over all the logits at once (bench.py's baseline, the tests' reference)
        self.loss_chunk_tokens = 2 ** (max(1, LOSS_CHUNK_LOGITS // config.vocab_size).bit_length() - 1)
        self.apply(self._init_weights)
        # GPT-2: the two projections that write into the residual stream get std / sqrt(2 * n_layer),
        # so the residual's variance stays about constant with depth.
        # zero_init_proj: each block starts as the identity and its output grows from zero (modded-nanogpt)
        for block in self.blocks:
            for w in (block.attn.proj.weight, block.mlp.down.weight):
                nn.init.normal_(w, mean=0.0, std=0.0 if config.zero_init_proj else 0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # a tied matrix is counted once

    def fused_parts(self):
        """The row blocks of each fused matrix, {weight: row counts}: [q, k, v] of the QKV projections, [gate, up]
        of a gated MLP's input projection (what train.Muon orthogonalizes separately with muon_split)."""
        c, parts = self.config, {}
        for block in self.blocks:
            parts[block.attn.qkv.weight] = [c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim]
            if c.mlp in ('swiglu', 'geglu'):
                parts[block.mlp.up.weight] = [c.mlp_hidden, c.mlp_hidden]
        return parts

    def forward(self, idx, targets=None, label_smoothing=0.0, cache=None):
        """(logits, loss). Without targets: the logits (B, T, vocab_size) and None. With targets: None and the mean
        cross-entropy, computed in chunks that never hold all the logits (with loss_chunk_tokens=0: the plain
        loss, and the logits with it); targets equal to IGNORE_INDEX (-100) count in neither, as F.cross_entropy."""
        B, T = idx.size()
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        cos, sin = rotary_tables(self.cos[start:start + T], self.sin[start:start + T])  # once for every layer
        x = x0 = self.drop(self.wte(idx))  # (B, T, C)
        if self.autocast_residual and torch.is_autocast_enabled(idx.device.type):
            x = x0 = x.to(torch.get_autocast_dtype(idx.device.type))
        for layer, block in enumerate(self.blocks):
            if self.x0_scale is not None and layer:
                x = x + self.x0_scale[layer - 1] * x0
            if self.activation_checkpointing != 'none' and self.training and torch.is_grad_enabled():
                # NOTE: full checkpointing passes no context_fn at all: dynamo cannot trace an explicit one
                # (not even torch's own noop_context_fn), and compile would fall back to eager
                selective = {'context_fn': partial(create_selective_checkpoint_contexts, _selective_policy)}
                x = checkpoint(block, x, cos, sin, use_reentrant=False,
                               **(selective if self.activation_checkpointing == 'selective' else {}))
            else:
                x = block(x, cos, sin, cache, layer)
        if cache is not None:
            cache.pos += T
        x = self.norm(x)
        if targets is None:
            return softcap(self.lm_head(x), self.config.logit_softcap), None  # (B, T, vocab_size)
        if self.loss_chunk_tokens:
            return None, ChunkedCrossEntropy.apply(x.view(B * T, -1), self.lm_head.weight, targets.reshape(-1),
                                                   label_smoothing, self.loss_chunk_tokens, torch.is_grad_enabled(),
                                                   self.config.logit_softcap)
        # the plain loss: all the logits, (B, T, vocab_size), and in fp32 (fp64 stays)
        logits = softcap(self.lm_head(x), self.config.logit_softcap)
        logits_32 = logits.to(torch.promote_types(logits.dtype, torch.float32)).view(B * T, -1)
        return logits, F.cross_entropy(logits_32, targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                       label_smoothing=label_smoothing)

    # ------------------------------------------------------------------------------------------------
    # FLOPs and MFU

    def flops_per_token(self, seq_len=None):
        """Training FLOPs (forward + backward) per token.

        6 per matmul weight (2 forward, 4 backward) over every weight that takes part in a matmul:
        the blocks' linear layers and the output head (the input embedding is a lookup, not a matmul),
        plus attention's two T x T matmuls: 12 * n_layer * n_head * head_dim * T, the PaLM paper's count
        (https://arxiv.org/abs/2204.02311, appendix B), which ignores the causal mask's savings, as
        the published MFU figures do.
        """
        c = self.config
        T = seq_len or c.block_size
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + 12 * c.n_layer * c.n_head * c.head_dim * T

    def estimate_mfu(self, tokens_per_sec, device, dtype='bfloat16', seq_len=None):
        """Model FLOPs utilization: achieved FLOP/s over the device's peak for dtype (peak_flops); None when
        the peak is unknown. An FP8 run passes its autocast dtype: its MFU is stated against the bf16 peak, as
        torchtitan does, so that FP8 and bf16 runs compare on one scale."""
        peak = peak_flops(device, dtype)
        return None if peak is None else self.flops_per_token(seq_len) * tokens_per_sec / peak

    # ------------------------------------------------------------------------------------------------
    # generation

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
                 vocab_limit=None, generator=None, stop_token=None):
        """Append max_new_tokens tokens to idx (B, T), each predicted from at most the last block_size tokens.

        temperature=0 decodes greedily. top_k keeps the k most likely tokens, top_p the smallest set whose
        probability reaches p. vocab_limit masks ids >= it (the padding of a padded vocabulary). With
        use_cache, keys and values are cached while the sequence fits in block_size; past that, each step
        recomputes the last block_size tokens, exactly as without the cache. A row that draws stop_token
        (end of text) repeats it from then on, and generation ends early once every row has (looked at every
        STOP_CHECK tokens): each row is the one it would be without stop_token up to its first stop (each step
        draws for every row, finished or not).
        """
        was_training = self.training
        self.eval()
        cache = None
        stopped = torch.zeros(idx.size(0), 1, dtype=torch.bool, device=idx.device)
        for i in range(max_new_tokens):
            if idx.size(1) > self.config.block_size or not use_cache:
                logits, _ = self(idx[:, -self.config.block_size:])
            elif cache is None:  # prefill
                cache = KVCache(self.config, idx.size(0), self.config.block_size, idx.device, self.wte.weight.dtype)
                logits, _ = self(idx, cache=cache)
            else:  # one new token against the cache
                logits, _ = self(idx[:, -1:], cache=cache)
            next_token = sample_next(logits[:, -1, :].float(), temperature, top_k, top_p, vocab_limit, generator)
            if stop_token is not None:
                next_token = next_token.masked_fill(stopped, stop_token)
                stopped |= next_token == stop_token
            idx = torch.cat((idx, next_token), dim=1)
            if stop_token is not None and i % STOP_CHECK == STOP_CHECK - 1 and stopped.all():
                break
        self.train(was_training)
        return idx


# generate looks at whether every row has stopped once every STOP_CHECK tokens: each look waits for the device,
# which could otherwise run ahead
STOP_CHECK = 16


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, vocab_limit=None, generator=None):
    """One token id per row of logits (B, V): greedy at temperature 0, else sampled after top-k / top-p."""
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be at least 1 (None: off)")
    if not 0 <= temperature < math.inf:  # inf would divide the masked -inf logits into NaN
        raise ValueError(f"temperature={temperature} must be at least 0 (0: greedy) and finite")
    if vocab_limit is not None and vocab_limit < 1:
        raise ValueError(f"vocab_limit={vocab_limit} must be at least 1 (None: every id)")
    if vocab_limit is not None:
        logits = logits.clone()
        logits[:, vocab_limit:] = float('-inf')
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # shifted by each row's largest first: a tiny temperature would take logits to inf, and inf - inf is NaN; the
    # largest stay 0 where temperature is below float32's smallest number (their ratio 0 / 0)
    top = logits.amax(dim=-1, keepdim=True)
    logits = torch.where(logits == top, 0.0, (logits - top) / temperature)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # tokens past the first that reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float('-inf'))
        logits = torch.full_like(logits, float('-inf')).scatter(-1, order, sorted_logits)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


# Dense tensor-core peaks per GPU in FLOP/s, (bf16, fp8): bf16/fp16 and fp8 matmuls with fp32 accumulation,
# which is how PyTorch's and torchao's float8 matmuls run; None: the card has no FP8. The datasheets' headline
# figures are "with sparsity", twice the dense ones given here. float32 matmuls run as TF32 at half the bf16
# peak (train.py turns TF32 on).
_A100 = (312e12, None)             # A100 datasheet: BF16 312 (624 sparse), SXM4 and PCIe, 40 and 80 GB
_H100_SXM = (989.5e12, 1979e12)    # H100 datasheet, SXM: BF16 1,979, FP8 3,958 sparse; the same in the H200
                                   # (SXM), H800 (SXM) and GH200 datasheets
_H100_PCIE = (756.5e12, 1513e12)   # H100 PCIe datasheet (2022): BF16 1,513, FP8 3,026 sparse; H800 PCIe the same
_H100_NVL = (835.5e12, 1670.5e12)  # H100 datasheet (2024), H100 NVL: BF16 1,671, FP8 3,341 sparse; the same in
                                   # the H200 datasheet for the H200 NVL (its PCIe card)
# Ada: L40S datasheet: BF16 362.05, FP8 733 dense; L40 datasheet: BF16 181.05, FP8 362 dense; L4 datasheet:
# BF16 242, FP8 485 sparse. GeForce RTX 4090: NVIDIA Ada GPU architecture whitepaper, appendix A: BF16 (and FP16)
# with FP32 accumulate 165.2 dense (FP16 with FP16 accumulate 330.3, which PyTorch does not use; 82.6 is TF32),
# FP8 with FP32 accumulate 330.3 dense
PEAK_FLOPS = {
    # keys: torch.cuda.get_device_name() without its 'NVIDIA ' prefix, matched whole, so that every card gets
    # its own peak or none (no MFU rather than a wrong one: an unlisted name, a MIG slice, a laptop part)
    'A100-SXM4-40GB': _A100, 'A100-SXM4-80GB': _A100, 'A100-PCIE-40GB': _A100, 'A100-PCIE-80GB': _A100,
    'A100 80GB PCIe': _A100,
    'H100 80GB HBM3': _H100_SXM, 'H100': _H100_SXM, 'H100 PCIe': _H100_PCIE, 'H100 NVL': _H100_NVL,
    'H200': _H100_SXM, 'H200 NVL': _H100_NVL, 'H200 PCIe': _H100_NVL,
    'H800': _H100_SXM, 'H800 80GB HBM3': _H100_SXM, 'H800 PCIe': _H100_PCIE,
    'GH200 480GB': _H100_SXM,
    'L40S': (362.05e12, 733e12), 'L40': (181.05e12, 362e12), 'L4': (121e12, 242.5e12),
    'GeForce RTX 4090': (165.2e12, 330.3e12),
}


def peak_flops(device, dtype='bfloat16'):
    """The dense peak FLOP/s of a CUDA device for matmuls in this dtype ('bfloat16', 'float16', 'float32' as
    TF32, 'float8'), or None when the device is not in PEAK_FLOPS or has no such peak."""
    device = torch.device(device)
    if device.type != 'cuda' or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).strip()
    bf16, fp8 = PEAK_FLOPS.get(name[len('NVIDIA '):] if name.startswith('NVIDIA ') else name, (None, None))
    if dtype == 'float8':
        return fp8
    return bf16 / 2 if bf16 is not None and dtype == 'float32' else bf16
