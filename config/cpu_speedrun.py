# The CPU speedrun: the lowest validation loss in the least wall time on 2 CPU cores, for the 0.87M-parameter
# character-level model of config/train_small.py (python prepare_data.py writes data/shakespeare_char).
# The loss is over the whole validation split (eval_iters=0), once, at the end; metrics.jsonl's time_s says
# when it was reached, start-up included. BENCHMARKS.md ("The CPU speedrun") has each change and its figures.
#   python train.py config/cpu_speedrun.py                     # 1,100 iterations: val loss about 1.578
#   python train.py config/cpu_speedrun.py --max_iters=275 --short_block_iters=137   # a quarter: about 1.82
out_dir = 'out-cpu-speedrun'
data_dir = 'data/shakespeare_char'
eval_iters = 0             # the whole val split, every window of block_size once: no sampling noise between runs
eval_at_start = False      # the untrained loss is not worth 12 s here
eval_interval = 1100       # = max_iters: one evaluation, at the end (a run always evaluates at its end)
log_interval = 100

n_layer = 4                # 869,760 parameters, embeddings included
n_head = 4
n_embd = 128
block_size = 256           # 4 x 256 beat 8 x 128 by 0.009 at equal tokens and time: the evaluation's windows give
                           # each token more context too
dropout = 0.0
qk_norm = True             # RMSNorm on queries and keys: the second largest gain, at no cost in parameters

batch_size = 4             # 1,024 tokens per step: at this size a step costs about its tokens, and small
gradient_accumulation_steps = 1  # batches learn more per token (8 x 128 beat 32 x 128 at equal tokens)
short_block_size = 64      # the first half trains on shorter windows (each window of 256 cut into pieces): 64
short_block_iters = 550    # tokens, 128 from iteration 275; cheaper steps, and short runs learn faster on them

optimizer = 'muon'         # Muon on the blocks' matrices, AdamW on embeddings and norms
muon_split = True          # q, k, v and gate, up orthogonalized as separate matrices: the largest single gain
learning_rate = 3e-3       # the best of 2e-3, 3e-3, 4e-3 at 1,000 iterations (4e-3 is a little better at 250)
min_lr = 0.0
max_iters = 1100           # the bf16 steps' time buys 100 more than the float32 config's 1,000, in less time
lr_decay_iters = 0         # 0: max_iters
lr_schedule = 'wsd'        # warmup, stable, then a linear decay over the last 40%: better than cosine here
wsd_decay_frac = 0.4
warmup_iters = 30
weight_decay = 0.1
beta2 = 0.99
grad_clip = 0.0            # no clipping: 0.006 better on average over three seeds
compile = False            # on the CPU, compiling costs more time (60 s and up) than it saves in a 2-minute run
dtype = 'bfloat16_if_native'  # bf16 autocast on a CPU with bf16 dot products (AVX512-BF16, AMX): steps 1.2 to 1.3x
                           # as fast (attention stays float32: model.attend), and Muon's Newton-Schulz in bf16 too
                           # (muon_dtype='auto'); together 0.004 more loss at 1,000 iterations (BENCHMARKS.md).
                           # float32 on other CPUs, where bf16 is emulated and slower
