"""
Inductor's Triton kernels for one compiled training step of model.py (forward and backward), on a machine
without a GPU: the code a GPU would run, to read, count and compare before a GPU is at hand. Needs a CUDA build
of torch, which brings triton (the CPU build does not), e.g. in a virtualenv of its own:
pip install torch==2.11.0 numpy (what it was written against: torch 2.11.0+cu130, triton 3.6.0; it reaches into
both libraries' internals, which other versions may have moved).

    python .ci/triton_code.py                        # one block of the 124M shape, 2 x 1024 tokens, bf16
    python .ci/triton_code.py --n_layer=2 --rope=halves --out=/tmp/code
    python .ci/triton_code.py --n_layer=12 --batch_size=16 --loss_chunk_tokens=4096   # a whole 124M micro-step
    python .ci/triton_code.py --n_layer=2 --n_head=16 --n_embd=2048 --batch_size=8 --fp8=tensorwise  # FP8 at 1.01B

How: inductor's Triton backend for the CPU (cpu_backend='triton') generates the kernels as for a GPU, with
triton's driver answering as an H100 (sm90). The kernels are never compiled nor run (stand-ins that do nothing),
so the step's numbers mean nothing: only the code does. model.py's CPU-only paths (RMSNorm's backward, attention
in float32 under CPU autocast) are switched to what CUDA runs, and so are inductor's online softmax
(online_softmax_here_too) and its rules for reused values, loop reordering and mix-order reduction
(reuse_and_fuse_as_on_a_gpu). Where a GPU chooses otherwise, the code differs: attention here is the CPU's flash
kernel (outside the generated code on any device), whose outputs' layout can differ from cuDNN's. With
--fp8=tensorwise, the layers train.fp8_layer_filter keeps are torchao's Float8Linear, as train.convert_to_fp8
makes them on a GPU (needs torchao; rowwise scaling cannot: torch's _scaled_mm takes per-tensor scales only on the
CPU, and it runs here, as every matmul does).
Writes out/forward.py and out/backward.py (the generated modules) and prints each kernel: loads, stores, size,
launches and the MB each launch moves by inductor's own estimate; then the micro-step's total, and the time it
takes at the given bandwidth: an estimate of the Triton kernels' time, not a measurement (inductor counts a value
read twice as twice the bytes, so it errs high where the cache holds the second read).
"""
import atexit
import os
import re
import shutil
import sys
import tempfile

import torch
import torch._inductor.async_compile as async_compile
import torch._inductor.config as inductor_config
from torch._inductor.codecache import PyCodeCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as model_module  # noqa: E402
from configurator import configure  # noqa: E402

DEFAULTS = dict(n_layer=1, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, batch_size=2,
                n_kv_head=0, mlp_hidden=0,  # 0: GPTConfig's
                fp8='',            # 'tensorwise': FP8 linear layers (torchao), as train.py's fp8=True; '': none
                dtype='bfloat16',  # autocast, as on a GPU; 'float32': none
                rope='flip',       # 'halves': bench.rope_halves in place of model.apply_rotary
                loss_chunk_tokens=-1,  # -1: model.py's chunk size; 0: the plain loss
                autocast_residual=False,  # True: the residual stream in bf16 (model.autocast_residual)
                bandwidth=3350,    # GB/s, for the time the bytes take: an H100 SXM's HBM3, by its datasheet
                out='triton_code')


def fake_h100_driver():
    """triton's active driver, answering as an H100 without touching CUDA."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Driver(CudaDriver):
        def __init__(self):  # CudaDriver's would load libcuda
            pass

        def get_current_target(self):
            return GPUTarget('cuda', 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        @staticmethod
        def is_active():
            return True
    triton.runtime.driver.set_active(Driver())


def online_softmax_here_too():
    """inductor's online softmax (the maximum and the sum of exponentials in one loop over a row) for this CPU's
    Triton code as for a GPU's: its pattern's check (post_grad.prepare_softmax_extra_check) takes CUDA and XPU
    devices only. The check is bound where the pattern was registered, so its code is swapped in place."""
    from torch._inductor.fx_passes import post_grad

    def check(match):  # run with post_grad's globals: its `config`
        device_type = match.kwargs['x'].meta['val'].device.type
        return config.online_softmax and getattr(config, f'{device_type}_backend', None) == 'triton'  # noqa: F821
    post_grad.prepare_softmax_extra_check.__code__ = check.__code__


def reuse_and_fuse_as_on_a_gpu():
    """Three of inductor's rules that differ on a CPU, as for a GPU's code. A value that several kernels use is
    stored (realized) on a CPU whenever it is computed with exp or sigmoid (StorageBox.should_realize_on_reuse): a
    buffer written and read back that a GPU's kernels do not have, each of them computing the value again (SwiGLU's
    sigmoid, needed by FP8's scaling and by the gradient, say). Two fusion rules (loop reordering after fusion, loop
    index inversion) are skipped for CPU nodes (BaseSchedulerNode.is_cpu, asked by those two alone in torch 2.11).
    And mix-order reduction (MixOrderReduction.can_fuse: a norm's weight gradient, a sum over the tokens, fused into
    the norm's backward kernel, a sum over the channels, which reads the same tensors) is for CUDA and XPU devices
    only: it is asked of CPU nodes as of a CUDA device's."""
    from torch._inductor import ir, scheduler

    def should_realize_on_reuse(self, users):  # torch 2.11's rule less its branch for the CPU
        return users > 1 and isinstance(self.data, (ir.Pointwise, ir.Reduction)) and (
            self.num_reads() > inductor_config.realize_reads_threshold or self.has_large_inner_fn())
    ir.StorageBox.should_realize_on_reuse = should_realize_on_reuse
    scheduler.BaseSchedulerNode.is_cpu = lambda self: False
    can_fuse, cuda = scheduler.MixOrderReduction.can_fuse.__func__, torch.device('cuda', 0)

    def mix_order_can_fuse(cls, node1, node2):
        on_cpu = [n for n in (node1, node2) if n.get_device() is not None and n.get_device().type == 'cpu']
        for node in on_cpu:
            node.get_device = lambda: cuda  # for this question alone
        try:
            return can_fuse(cls, node1, node2)
        finally:
            for node in on_cpu:
                del node.get_device
    scheduler.MixOrderReduction.can_fuse = classmethod(mix_order_can_fuse)


class NoKernel:
    """Stands in for a compiled kernel: launching it does nothing."""

    def run(self, *args, **kwargs):
        pass


def save_module(path):
    """Copy the module inductor loaded last (its wrapper code, with every kernel's source) to path."""
    latest = max((m.__file__ for m in PyCodeCache.modules), key=os.path.getmtime)
    shutil.copy(latest, path)


def kernels(path):
    """(name, loads, stores, size hints, MB moved, launches) of each Triton kernel in a generated module: the MB
    are inductor's own estimate of the bytes one launch reads and writes (kernel_num_gb, with benchmark_kernel);
    the launches are counted in the module's call code (the chunked loss's loop is unrolled there)."""
    text = open(path).read()
    calls = text[text.rindex("device_str="):]  # the call code, after the last kernel's source
    found = []
    for meta in re.finditer(r"size_hints=(\{[^}]*\}).*?inductor_meta=\{.*?'kernel_name': '(\w+)'.*?'num_load': (\d+), "
                            r"'num_store': (\d+).*?'kernel_num_gb': ([0-9.e-]+)", text, re.S):
        hints, name, loads, stores, gb = meta.groups()
        found.append((name, int(loads), int(stores), hints, 1000 * float(gb), calls.count(f"{name}.run(")))
    assert len(found) == text.count('async_compile.triton('), f"{path}: a kernel without its kernel_num_gb"
    return found


def main(argv):
    a = configure(DEFAULTS, argv)
    fake_h100_driver()
    inductor_config.cpu_backend = 'triton'
    online_softmax_here_too()
    reuse_and_fuse_as_on_a_gpu()
    # a cache of its own: inductor's cache keys do not see the two functions above, so an earlier run's graphs
    # (in the shared cache, with or without them) would come back as they were
    cache = os.environ['TORCHINDUCTOR_CACHE_DIR'] = tempfile.mkdtemp(prefix='triton_code_')
    atexit.register(shutil.rmtree, cache, ignore_errors=True)  # the modules worth keeping are copied to --out
    inductor_config.compile_threads = 1
    inductor_config.benchmark_kernel = True  # each kernel's source then carries kernel_num_gb
    async_compile.AsyncCompile.triton = lambda self, kernel_name, source_code, device_str='cuda': NoKernel()
    # what CUDA runs where model.py takes a path of its own on the CPU: torch's RMSNorm, SDPA in the autocast dtype
    model_module.RMSNorm.cpu_forward = model_module.RMSNorm.fused_forward
    model_module.attend = torch.nn.functional.scaled_dot_product_attention
    if a['rope'] == 'halves':
        import bench
        model_module.apply_rotary = bench.rope_halves
    if a['fp8'] not in ('', 'tensorwise'):
        sys.exit(f"fp8={a['fp8']!r}: '' or 'tensorwise' (rowwise needs _scaled_mm with row scales, CUDA only)")
    shape = ('n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'vocab_size', 'block_size')
    model = model_module.GPT(model_module.GPTConfig(**{k: a[k] for k in shape}))
    if a['fp8']:  # train.py's conversion, told it runs on an H100 (it checks the GPU's capability, nothing else)
        import train
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        try:
            print('FP8 layers:', ', '.join(train.convert_to_fp8(model, a['fp8'], 'cuda')))
        except train.TrainError as e:  # no torchao
            sys.exit(str(e))
    if a['loss_chunk_tokens'] >= 0:
        model.loss_chunk_tokens = a['loss_chunk_tokens']
    model.autocast_residual = a['autocast_residual']
    x, y = (torch.randint(0, a['vocab_size'], (a['batch_size'], a['block_size'])) for _ in range(2))
    os.makedirs(a['out'], exist_ok=True)
    compiled = torch.compile(model)
    with torch.autocast('cpu', torch.bfloat16, enabled=a['dtype'] == 'bfloat16'):
        loss = compiled(x, y)[1]
    save_module(os.path.join(a['out'], 'forward.py'))  # inductor's module for the forward, loaded by now
    loss.backward()
    save_module(os.path.join(a['out'], 'backward.py'))
    total = 0.0
    for part in ('forward', 'backward'):
        path = os.path.join(a['out'], f'{part}.py')
        found = kernels(path)
        moved = sum(mb * n for *_, mb, n in found)
        total += moved
        print(f"{path}: {len(found)} Triton kernels, {sum(n for *_, n in found)} launches, {moved:,.1f} MB moved")
        for name, loads, stores, hints, mb, n in found:
            print(f"  {loads:2d} loads {stores:2d} stores  {hints:<32} {n:3d} x {mb:9.2f} MB  {name}")
    print(f"one micro-step ({a['batch_size']} x {a['block_size']} tokens): {total:,.1f} MB through the Triton kernels, "
          f"{total / a['bandwidth']:.2f} ms at {a['bandwidth']:g} GB/s (an estimate from the code; nothing ran)")
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
