"""Fine-tuning a BERT-style classifier with Apex's amp and FusedAdam, written for GPUs.

After the BERT fine-tuning scripts of that time (run_classifier.py with
--fp16): apex.normalization's FusedLayerNorm as BERT's LayerNorm,
apex.optimizers.FusedAdam over parameter groups with and without weight
decay, gradient accumulation (--gradient_accumulation_steps, with
delay_unscale on all but the last micro-batch), BERT's linear warm-up set on
the param groups by hand, and torch.device("cuda"). The model is a tiny BERT
and the task synthetic (is the sequence mostly made of the upper half of the
vocabulary?), so that it runs in seconds.

    python bert_finetune_amp.py --opt_level O2                               # on a GPU, with apex
    amp-patch run --device cpu bert_finetune_amp.py --opt_level O2           # unchanged, on a CPU

It prints the loss of every optimizer step, then the mean loss over the first
and the last steps.
"""

import argparse
import logging
import math
import random

import numpy as np
import torch
import torch.nn as nn
from apex import amp
from apex.normalization import FusedLayerNorm as BertLayerNorm
from apex.optimizers import FusedAdam
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

logging.basicConfig(format='%(asctime)s - %(levelname)s - %(name)s -   %(message)s',
                    datefmt='%m/%d/%Y %H:%M:%S', level=logging.INFO)
logger = logging.getLogger(__name__)


class BertConfig:
    def __init__(self, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=64, type_vocab_size=2,
                 hidden_dropout_prob=0.1, initializer_range=0.02):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.initializer_range = initializer_range


def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        position_ids = torch.arange(input_ids.size(1), dtype=torch.long, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
                      + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout(nn.Softmax(dim=-1)(attention_scores))
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*(context_layer.size()[:-2] + (self.all_head_size,)))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attention_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_norm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask):
        attention = self.attention(hidden_states, attention_mask)
        attention = self.dropout(self.attention_output(attention))
        hidden_states = self.attention_norm(attention + hidden_states)
        layer_output = self.dropout(self.output(gelu(self.intermediate(hidden_states))))
        return self.output_norm(layer_output + hidden_states)


class BertForSequenceClassification(nn.Module):
    def __init__(self, config, num_labels):
        super().__init__()
        self.num_labels = num_labels
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.apply(lambda module: self.init_bert_weights(module, config))

    @staticmethod
    def init_bert_weights(module, config):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=config.initializer_range)
        elif isinstance(module, BertLayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        hidden_states = self.embeddings(input_ids, token_type_ids)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        pooled_output = torch.tanh(self.pooler(hidden_states[:, 0]))
        logits = self.classifier(self.dropout(pooled_output))
        if labels is not None:
            return nn.CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
        return logits


def warmup_linear(x, warmup=0.002):
    if x < warmup:
        return x / warmup
    return max((x - 1.) / (warmup - 1.), 0.)


def synthetic_examples(n, max_seq_length, vocab_size, seed):
    # Label 1 when most tokens come from the upper half of the vocabulary; [CLS] = 1 leads.
    g = torch.Generator().manual_seed(seed)
    bias = torch.rand(n, 1, generator=g)
    upper = torch.rand(n, max_seq_length - 1, generator=g) < bias
    tokens = torch.randint(2, vocab_size // 2, (n, max_seq_length - 1), generator=g)
    tokens = tokens + upper.long() * (vocab_size // 2 - 2)
    input_ids = torch.cat([torch.ones(n, 1, dtype=torch.long), tokens], dim=1)
    lengths = torch.randint(max_seq_length // 2, max_seq_length + 1, (n,), generator=g)
    input_mask = (torch.arange(max_seq_length)[None, :] < lengths[:, None]).long()
    input_ids = input_ids * input_mask
    label_ids = ((upper.float() * input_mask[:, 1:]).sum(1) * 2 > input_mask[:, 1:].sum(1)).long()
    segment_ids = torch.zeros_like(input_ids)
    return TensorDataset(input_ids, input_mask, segment_ids, label_ids)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_seq_length", default=24, type=int)
    parser.add_argument("--train_examples", default=256, type=int)
    parser.add_argument("--train_batch_size", default=32, type=int,
                        help="Total batch size for training.")
    parser.add_argument("--learning_rate", default=5e-3, type=float,
                        help="The initial learning rate for Adam.")
    parser.add_argument("--num_train_epochs", default=2.0, type=float)
    parser.add_argument("--warmup_proportion", default=0.1, type=float)
    parser.add_argument("--no_cuda", action='store_true')
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--gradient_accumulation_steps', type=int, default=2,
                        help="Number of updates steps to accumulate before an update pass.")
    parser.add_argument('--opt_level', type=str, default='O1')
    parser.add_argument('--loss_scale', type=str, default=None,
                        help="Loss scaling: None (the opt level's), 'dynamic', or a number.")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu")
    n_gpu = torch.cuda.device_count()
    logger.info(f"device: {device} n_gpu: {n_gpu}, opt_level: {args.opt_level}")

    if args.gradient_accumulation_steps < 1:
        raise ValueError(f"Invalid gradient_accumulation_steps parameter: {args.gradient_accumulation_steps}, should be >= 1")
    args.train_batch_size = args.train_batch_size // args.gradient_accumulation_steps

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if n_gpu > 0:
        torch.cuda.manual_seed_all(args.seed)

    config = BertConfig()
    train_data = synthetic_examples(args.train_examples, args.max_seq_length, config.vocab_size,
                                    args.seed)
    num_train_optimization_steps = int(
        len(train_data) / args.train_batch_size / args.gradient_accumulation_steps
    ) * args.num_train_epochs

    model = BertForSequenceClassification(config, num_labels=2)
    model.to(device)

    param_optimizer = list(model.named_parameters())
    no_decay = ['bias', 'LayerNorm.bias', 'LayerNorm.weight', 'norm.bias', 'norm.weight']
    optimizer_grouped_parameters = [
        {'params': [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)],
         'weight_decay': 0.01},
        {'params': [p for n, p in param_optimizer if any(nd in n for nd in no_decay)],
         'weight_decay': 0.0}
    ]
    optimizer = FusedAdam(optimizer_grouped_parameters, lr=args.learning_rate)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      loss_scale=args.loss_scale)
    if n_gpu > 1:
        model = torch.nn.DataParallel(model)

    train_dataloader = DataLoader(train_data, sampler=RandomSampler(train_data),
                                  batch_size=args.train_batch_size)

    logger.info("***** Running training *****")
    logger.info("  Num examples = %d", len(train_data))
    logger.info("  Batch size = %d", args.train_batch_size)
    logger.info("  Num steps = %d", num_train_optimization_steps)

    global_step = 0
    step_losses = []
    tr_loss = 0
    model.train()
    for _ in range(int(args.num_train_epochs)):
        for step, batch in enumerate(train_dataloader):
            batch = tuple(t.to(device) for t in batch)
            input_ids, input_mask, segment_ids, label_ids = batch
            loss = model(input_ids, segment_ids, input_mask, label_ids)
            if n_gpu > 1:
                loss = loss.mean()  # mean() to average on multi-gpu.
            if args.gradient_accumulation_steps > 1:
                loss = loss / args.gradient_accumulation_steps

            last = (step + 1) % args.gradient_accumulation_steps == 0
            with amp.scale_loss(loss, optimizer, delay_unscale=not last) as scaled_loss:
                scaled_loss.backward()
            tr_loss += loss.item()

            if last:
                # modify learning rate with special warm up BERT uses
                lr_this_step = args.learning_rate * warmup_linear(
                    global_step / num_train_optimization_steps, args.warmup_proportion)
                for param_group in optimizer.param_groups:
                    param_group['lr'] = lr_this_step
                optimizer.step()
                optimizer.zero_grad()
                global_step += 1
                step_losses.append(tr_loss)
                print("step %d loss %.4f lr %.6f" % (global_step, tr_loss, lr_this_step))
                tr_loss = 0

    k = max(1, len(step_losses) // 4)
    print('Loss mean over the first %d steps %.4f, over the last %d %.4f'
          % (k, sum(step_losses[:k]) / k, k, sum(step_losses[-k:]) / k))


if __name__ == "__main__":
    main()
