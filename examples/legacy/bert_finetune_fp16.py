"""A BERT-style fine-tuner as 2019 scripts wrote it: model.half(), FusedAdam, FP16_Optimizer.

The pattern of pytorch-pretrained-bert's run_classifier.py, unchanged: the
model is made half by hand, FusedAdam is wrapped in FP16_Optimizer with a
dynamic (``--loss_scale 0``) or static loss scale, ``optimizer.backward(loss)``
replaces ``loss.backward()``, the learning rate follows a warmup-linear
schedule written into ``optimizer.param_groups``, and the master grads are
clipped with ``clip_master_grads``. The model is a tiny transformer encoder so
that it runs in seconds on a CPU. Run it with amp_patch serving ``apex``:

    amp-patch run examples/legacy/bert_finetune_fp16.py --fp16 --loss_scale 0
    amp-patch run examples/legacy/bert_finetune_fp16.py --fp16 --loss_scale 128 \\
        --save_step 10 --output_dir /tmp/bert
    amp-patch run examples/legacy/bert_finetune_fp16.py --fp16 --resume /tmp/bert/checkpoint.pt

``--overflow_step N`` multiplies the loss at step N by inf, to watch
FP16_Optimizer skip that step.
"""

import argparse

import torch
import torch.nn as nn
from legacy_run_utils import load_checkpoint, log_step, parse_args_with_checkpoints, save_checkpoint

VOCAB, SEQ, HIDDEN, LABELS = 64, 12, 32, 2


class TinyBertForSequenceClassification(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.layer_norm = nn.LayerNorm(HIDDEN)
        # Dropout off, so that runs (and a resumed run) are exactly repeatable.
        self.encoder = nn.TransformerEncoderLayer(HIDDEN, 2, 2 * HIDDEN, dropout=0.0,
                                                  batch_first=True)
        self.classifier = nn.Linear(HIDDEN, LABELS)

    def forward(self, input_ids, labels):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        hidden = self.layer_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        logits = self.classifier(self.encoder(hidden)[:, 0])
        loss_fct = nn.CrossEntropyLoss()
        return loss_fct(logits.view(-1, LABELS), labels.view(-1))


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step % 4)
    input_ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    labels = ((input_ids < VOCAB // 2).sum(1) > SEQ // 2).long()
    return input_ids, labels


def warmup_linear(x, warmup=0.002):
    if x < warmup:
        return x / warmup
    return 1.0 - x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--loss_scale", type=float, default=0,
                        help="0: dynamic loss scaling; a positive value: that static scale")
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--warmup_proportion", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--train_batch_size", type=int, default=16)
    parser.add_argument("--num_train_steps", type=int, default=24)
    parser.add_argument("--no_cuda", action="store_true")
    args = parse_args_with_checkpoints(parser, "bert_output")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu")
    torch.manual_seed(42)
    model = TinyBertForSequenceClassification()
    if args.fp16:
        model.half()
    model.to(device)

    no_decay = ["bias", "layer_norm.weight", "norm1.weight", "norm2.weight"]
    param_optimizer = list(model.named_parameters())
    optimizer_grouped_parameters = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    if args.fp16:
        try:
            from apex.fp16_utils import FP16_Optimizer
            from apex.optimizers import FusedAdam
        except ImportError:
            raise ImportError("Please install apex from https://www.github.com/nvidia/apex "
                              "to use distributed and fp16 training.")
        optimizer = FusedAdam(optimizer_grouped_parameters, lr=args.learning_rate)
        if args.loss_scale == 0:
            optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
        else:
            optimizer = FP16_Optimizer(optimizer, static_loss_scale=args.loss_scale)
    else:
        optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    global_step = 0
    if args.resume:
        global_step = load_checkpoint(args.resume, model=model, optimizer=optimizer)

    model.train()
    while global_step < args.num_train_steps:
        input_ids, labels = (t.to(device) for t in get_batch(global_step, args.train_batch_size))
        loss = model(input_ids, labels)
        if global_step == args.overflow_step:
            loss = loss * float("inf")
        if args.fp16:
            optimizer.backward(loss)
            optimizer.clip_master_grads(args.max_grad_norm)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        lr_this_step = args.learning_rate * warmup_linear(global_step / args.num_train_steps,
                                                          args.warmup_proportion)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_this_step
        optimizer.step()
        optimizer.zero_grad()
        scale = optimizer.loss_scale if args.fp16 else 1.0
        log_step(global_step, loss.item(), scale, model.state_dict(), optimizer.state_dict())
        global_step += 1
        if global_step == args.save_step:
            save_checkpoint(args.output_dir, model=model.state_dict(),
                            optimizer=optimizer.state_dict(), step=global_step)

    print("parameters are %s; final loss %.4f" % (next(model.parameters()).dtype, loss.item()))


if __name__ == "__main__":
    main()
