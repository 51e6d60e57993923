"""A trainer that reaches into apex.amp's state, as ViT and BERT training scripts did.

After ``amp.initialize`` it sets the first loss scale by hand
(``amp._amp_state.loss_scalers[0]._loss_scale = 2**20``), logs
``loss_scale()`` every step, and steps its learning-rate scheduler only when
the optimizer step was not skipped (``_unskipped != 0``). Checkpoints hold
``amp.state_dict()``. Run it with amp_patch serving ``apex``:

    amp-patch run examples/legacy/amp_state_trainer.py --fp16_opt_level O2 --loss_scale dynamic
    amp-patch run examples/legacy/amp_state_trainer.py --save_step 8 --output_dir /tmp/vit
    amp-patch run examples/legacy/amp_state_trainer.py --resume /tmp/vit/checkpoint.pt

``--overflow_step N`` multiplies the loss at step N by inf, to watch amp skip it.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp
from apex.amp._amp_state import _amp_state
from legacy_run_utils import load_checkpoint, log_step, parse_args_with_checkpoints, save_checkpoint


class PatchClassifier(nn.Module):
    def __init__(self, patches=4, dim=24, classes=3):
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.mlp(self.norm(h))
        return self.head(h.mean(1))


def get_batch(step, batch_size=16):
    g = torch.Generator().manual_seed(step % 4)
    x = torch.randn(batch_size, 4, 16, generator=g)
    return x, (x[:, :, :4].sum((1, 2)) > 0).long() + (x[:, 0, 0] > 0).long()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16_opt_level", type=str, default="O2",
                        help="For fp16: Apex AMP optimization level selected in ['O0', 'O1', "
                             "'O2', and 'O3'].")
    parser.add_argument("--loss_scale", default=None,
                        help="Loss scale passed to amp.initialize: a number or 'dynamic'.")
    parser.add_argument("--learning_rate", default=0.1, type=float,
                        help="The initial learning rate for SGD.")
    parser.add_argument("--num_steps", default=24, type=int,
                        help="Total number of training steps to perform.")
    parser.add_argument("--warmup_steps", default=4, type=int,
                        help="Step of training to perform learning rate warmup for.")
    args = parse_args_with_checkpoints(parser, "vit_output")

    torch.manual_seed(0)
    model = PatchClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)

    def warmup_cosine(step):
        if step < args.warmup_steps:
            return float(step + 1) / args.warmup_steps
        progress = float(step - args.warmup_steps) / max(1, args.num_steps - args.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    loss_scale = args.loss_scale
    if loss_scale not in (None, "dynamic"):
        loss_scale = float(loss_scale)
    model, optimizer = amp.initialize(models=model, optimizers=optimizer,
                                      opt_level=args.fp16_opt_level, loss_scale=loss_scale)
    amp._amp_state.loss_scalers[0]._loss_scale = 2**20

    step = 0
    if args.resume:
        step = load_checkpoint(args.resume, model=model, optimizer=optimizer,
                               scheduler=scheduler, amp=amp)

    model.train()
    while step < args.num_steps:
        x, y = get_batch(step)
        loss = F.cross_entropy(model(x), y)
        if step == args.overflow_step:
            loss = loss * float("inf")
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        if amp._amp_state.loss_scalers[0]._unskipped != 0:  # the step was not skipped
            scheduler.step()
        optimizer.zero_grad()
        log_step(step, loss.item(), _amp_state.loss_scalers[0].loss_scale(),
                 model.state_dict(), optimizer.state_dict(), torch.tensor(scheduler.last_epoch))
        step += 1
        if step == args.save_step:
            save_checkpoint(args.output_dir, model=model.state_dict(),
                            optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                            amp=amp.state_dict(), step=step)

    print("opt level %s, loss scale %s, unskipped %d" % (
        _amp_state.opt_properties.opt_level, _amp_state.loss_scalers[0].loss_scale(),
        _amp_state.loss_scalers[0]._unskipped))


if __name__ == "__main__":
    main()
