"""A script that guards its apex imports and falls back quietly, as many 2018-2020 scripts did.

``--fp16`` imports FP16_Optimizer inside ``try``/``except ImportError``; without
apex it prints a warning and trains in fp32, and a user reading a long log
may never notice. ``--fast_layer_norm`` does the same for a contrib kernel.
Under ``amp-patch run`` the first import is served (the model trains in
half), and the second, which amp_patch does not serve, is logged as a warning
by amp_patch and listed at the end of the run:

    amp-patch run examples/legacy/guarded_import.py --fp16 --fast_layer_norm
    python examples/legacy/guarded_import.py --fp16      # no apex: falls back to fp32

``--overflow_step N`` multiplies the loss at step N by inf; ``--save_step`` and
``--resume`` checkpoint and resume.
"""

import argparse

import torch
import torch.nn as nn
from legacy_run_utils import load_checkpoint, log_step, parse_args_with_checkpoints, save_checkpoint


def get_batch(step, batch_size=16):
    g = torch.Generator().manual_seed(step % 4)
    x = torch.randn(batch_size, 10, generator=g)
    return x, (x[:, :5].sum(1) > 0).long()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--fast_layer_norm", action="store_true")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=20)
    args = parse_args_with_checkpoints(parser, "guarded_output")

    if args.fp16:
        try:
            from apex.fp16_utils import FP16_Optimizer
        except ImportError:
            print("WARNING: apex not installed, ignoring --fp16 option")
            args.fp16 = False
    criterion = nn.CrossEntropyLoss()
    norm = nn.Identity()
    if args.fast_layer_norm:
        try:
            from apex.contrib.layer_norm import FastLayerNorm
            norm = FastLayerNorm(32)
        except ImportError:
            print("WARNING: apex.contrib not installed, using torch.nn.LayerNorm")
            norm = nn.LayerNorm(32)

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 32), norm, nn.Tanh(), nn.Linear(32, 2))
    if args.fp16:
        model = model.half()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.fp16:
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2**10})
    print("training in %s" % next(model.parameters()).dtype)

    step = 0
    if args.resume:
        step = load_checkpoint(args.resume, model=model, optimizer=optimizer)

    while step < args.epochs:
        x, y = get_batch(step)
        if args.fp16:
            x = x.half()
        loss = criterion(model(x).float(), y)
        if step == args.overflow_step:
            loss = loss * float("inf")
        optimizer.zero_grad()
        if args.fp16:
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        log_step(step, loss.item(), optimizer.loss_scale if args.fp16 else 1.0,
                 model.state_dict(), optimizer.state_dict())
        step += 1
        if step == args.save_step:
            save_checkpoint(args.output_dir, model=model.state_dict(),
                            optimizer=optimizer.state_dict(), step=step)


if __name__ == "__main__":
    main()
