# The CPU-friendly default: a small character-level model on Shakespeare's complete works
# (python prepare_data.py writes data/shakespeare_char). A few minutes on 2 CPU cores.
out_dir = 'out-small'
data_dir = 'data/shakespeare_char'
eval_interval = 200
eval_iters = 20
log_interval = 10

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0

batch_size = 32
gradient_accumulation_steps = 1

learning_rate = 2e-3       # a small model takes a large learning rate
max_iters = 1200
lr_decay_iters = 1200
warmup_iters = 50
min_lr = 2e-4
beta2 = 0.99               # few tokens per step: a slightly longer second-moment average
weight_decay = 0.1
