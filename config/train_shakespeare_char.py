# A ~10M-parameter character-level model on Shakespeare's complete works, for one GPU
# (a few minutes on an H100). Prepare the data with `python prepare_data.py`.
out_dir = 'out-shakespeare-char'
data_dir = 'data/shakespeare_char'
eval_interval = 250
eval_iters = 200
log_interval = 10

n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
dropout = 0.2              # the corpus is small: regularize

batch_size = 64            # 64 * 256 = 16,384 tokens per iteration
gradient_accumulation_steps = 1

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
warmup_iters = 100
min_lr = 1e-4
beta2 = 0.99

compile = True
