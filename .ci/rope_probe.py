"""
What RoPE's backward costs under torch.compile, form by form: one attention layer at the 124M shape (16 x 1024
tokens, 12 heads of 64, bf16): the fused qkv output split into q, k and v, RoPE on q and k, SDPA (cuDNN where
the GPU has it), forward and backward compiled; each kernel's GPU time by torch.profiler, per step (mean of
--steps). The kernel that writes the qkv gradient holds RoPE's backward: the gradient of the split is a cat of dq,
dk and dv, and inductor fuses RoPE's backward into it. BENCHMARKS.md ("RoPE's backward, measured alone") has the
H100's figures. Without a GPU it only prints each form's gradient's difference from the flip's. Compiled without
inductor's caches: SDPA's backend is not in their keys, so flip_flash would come back from them with cuDNN's kernels.

    python .ci/rope_probe.py                              # every form
    python .ci/rope_probe.py --only=flip,flip_heads       # q, k, v split into channels (as model.py did) or heads
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model  # noqa: E402
from bench import rope_halves  # noqa: E402


def rope_rotate_half(x, cos, sin):
    """x * [cos, cos] + [-x2, x1] * [sin, sin] (the transformers form: a cat of the negated second half)."""
    half = x.size(-1) // 2
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    c, s = torch.cat((c, c), -1)[:, None, :], torch.cat((s, s), -1)[:, None, :]
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


class RotaryFn(torch.autograd.Function):
    """apply_rotary with its backward written out: a rotation's gradient is the rotation by the negated angles."""
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return model.apply_rotary(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return model.apply_rotary(g, cos, -sin), None, None


def rope_function(x, cos, sin):
    return RotaryFn.apply(x, cos, sin)


def attention(qkv, cos, sin, w, rope, H, D, joint=False, heads=False):
    B, T, _ = qkv.shape
    if joint:  # RoPE once over the q and k heads together
        qk, v = qkv.split([2 * H * D, H * D], dim=-1)
        qk = rope(qk.view(B, T, 2 * H, D), cos, sin) if rope else qk.view(B, T, 2 * H, D)
        q, k = qk.split([H, H], dim=2)
        v = v.view(B, T, H, D)
    else:
        if heads:  # model.py's split: into heads
            q, k, v = qkv.view(B, T, 3 * H, D).split([H] * 3, dim=2)
        else:  # into channels, then views (model.py's split until 2026-11-26)
            q, k, v = qkv.split([H * D] * 3, dim=-1)
            q, k, v = q.view(B, T, H, D), k.view(B, T, H, D), v.view(B, T, H, D)
        if rope:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (y.transpose(1, 2).reshape(B, T, H * D) * w).sum()


FORMS = ('none', 'flip', 'flip_heads', 'halves', 'halves_heads', 'rotate_half', 'function', 'flip_joint', 'flip_flash')


def parse_args(argv):
    p = argparse.ArgumentParser(description='RoPE backward under compile, form by form')
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--seq', type=int, default=1024)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--only', default=','.join(FORMS), help='the forms to run, comma-separated: ' + ', '.join(FORMS))
    a = p.parse_args(argv)
    unknown = [name for name in a.only.split(',') if name not in FORMS]
    if unknown:
        p.error(f"--only: no form {', '.join(unknown)}; the forms: {', '.join(FORMS)}")
    return a


def main(argv=None):
    a = parse_args(argv)
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    torch._inductor.config.force_disable_caches = True
    H, D, B, T = 12, 64, a.batch, a.seq
    torch.manual_seed(0)
    cos, sin = (t.to(dev) for t in model.rope_cache(T, D, 10000.0))
    tables = model.rotary_tables(cos, sin)
    qkv0 = torch.randn(B, T, 3 * H * D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(B, T, H * D, device=dev, dtype=torch.bfloat16)
    variants = {  # name: (rope, tables or angles, joint, split into heads, SDPA backend)
        'none': (None, tables, False, False, None),
        'flip': (model.apply_rotary, tables, False, False, None),
        'flip_heads': (model.apply_rotary, tables, False, True, None),
        'halves': (rope_halves, tables, False, False, None),
        'halves_heads': (rope_halves, tables, False, True, None),
        'rotate_half': (rope_rotate_half, (cos, sin), False, False, None),
        'function': (rope_function, tables, False, False, None),
        'flip_joint': (model.apply_rotary, tables, True, False, None),
        'flip_flash': (model.apply_rotary, tables, False, False, 'flash'),
    }
    assert tuple(variants) == FORMS
    ref = None
    for name, (rope, cs, joint, heads, backend) in variants.items():
        if name not in a.only.split(','):
            continue
        torch._dynamo.reset()  # a fresh graph for each: the SDPA backend is chosen when tracing
        fn = torch.compile(lambda x, rope=rope, cs=cs, joint=joint, heads=heads: attention(x, *cs, w, rope, H, D, joint,
                                                                                     heads))
        qkv = qkv0.clone().requires_grad_()
        ctx = (torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION) if backend
               else contextlib.nullcontext())
        t0 = time.time()
        with ctx:
            for _ in range(3):  # compiles, then warms up
                qkv.grad = None
                fn(qkv).backward()
            compile_s = time.time() - t0
            grad = qkv.grad.float()
            ref = grad if name == 'flip' else ref
            err = (grad - ref).abs().max().item() / ref.abs().max().item() if ref is not None and rope else None
            kernels = []
            if dev == 'cuda':
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.steps):
                        qkv.grad = None
                        fn(qkv).backward()
                    torch.cuda.synchronize()
                kernels = sorted(((e.device_time_total / a.steps, e.count // a.steps, e.key)
                                  for e in prof.key_averages() if e.device_time_total > 0), reverse=True)
        total = f"{sum(k[0] for k in kernels):.1f} us of kernels per step" if kernels else 'no GPU: not timed'
        diff = f", gradient's max difference from flip's {err:.2e} (relative to its largest)" if err is not None else ''
        print(f"== {name}: {total} (compile {compile_s:.0f} s){diff}")
        for us, n, key in kernels[:8]:
            print(f"   {us:9.1f} us  x{n:<3d} {key[:110]}")
        sys.stdout.flush()


if __name__ == '__main__':
    main()
