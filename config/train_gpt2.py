# The 124M-parameter GPT-2 shape on a BPE corpus (GPT-2's tokenizer), e.g. OpenWebText or FineWeb:
#   python prepare_data.py --input=path/to/text/ --tokenizer=gpt2 --data_dir=data/gpt2
#   python train.py config/train_gpt2.py                      (one GPU)
# Batch arithmetic: tokens per optimizer step
#   = batch_size * block_size * gradient_accumulation_steps = 16 * 1024 * 32 = 524,288 (about 0.5M,
#   GPT-3 paper's batch for this size). Lower batch_size and raise gradient_accumulation_steps by the
#   same factor if memory runs out: the step's tokens, and so the training, stay the same.
# 19,073 steps * 524,288 tokens = 10B tokens.
out_dir = 'out-gpt2'
data_dir = 'data/gpt2'
eval_interval = 1000
eval_iters = 100
log_interval = 10

n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
vocab_size = 50304         # GPT-2's 50,257 padded to a multiple of 64
dropout = 0.0

batch_size = 16
gradient_accumulation_steps = 32

learning_rate = 6e-4
max_iters = 19073
lr_decay_iters = 19073
warmup_iters = 700
min_lr = 6e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

compile = True
