"""A small GAN trained with Apex's amp, with checkpoints, written the way Apex's README taught.

Two models and two optimizers under one amp.initialize, three losses with a
loss scaler each (num_losses=3), grads cleared through the models
(netD.zero_grad(), netG.zero_grad()), `from apex.fp16_utils import *` for
to_python_float, and a checkpoint holding the models, the optimizers and
amp.state_dict(), saved at one step and resumed from in a new process.
Everything lives on the GPU, as Apex-era scripts had it.

    python gan_checkpoint_amp.py --opt_level O2 --steps 8 --save_step 4
    amp-patch run --device cpu gan_checkpoint_amp.py --opt_level O2 --steps 8 --save_step 4
    amp-patch run --device cpu gan_checkpoint_amp.py --opt_level O2 --steps 8 \\
        --resume checkpoints/checkpoint.pt

It prints `step N errD X errG Y` for every step (every digit of the losses,
so that runs compare exactly) and can save the final model weights.
"""

import argparse
import os

import torch
import torch.nn as nn
from apex import amp
from apex.fp16_utils import *  # noqa: F401,F403 - to_python_float, as Apex-era scripts used it

parser = argparse.ArgumentParser()
parser.add_argument("--opt_level", default="O1")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.002)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--save_step", type=int, default=-1,
                    help="save a checkpoint once this many steps are done")
parser.add_argument("--output_dir", default="checkpoints")
parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
parser.add_argument("--final", default=None, help="save the final model weights here")
args = parser.parse_args()

torch.manual_seed(args.seed)
NZ, FEATURES = 8, 16

netD = nn.Sequential(nn.Linear(FEATURES, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)).cuda()
netG = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(), nn.Linear(32, FEATURES), nn.Tanh()).cuda()
# "Real" samples: a fixed cloud around 0.5, made once from its own generator.
real_data = (torch.randn(4 * args.batch_size, FEATURES,
                         generator=torch.Generator().manual_seed(1234)) * 0.3 + 0.5).cuda()

criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))

[netD, netG], [optimizerD, optimizerG] = amp.initialize(
    [netD, netG], [optimizerD, optimizerG], opt_level=args.opt_level, num_losses=3, verbosity=0)

start = 0
if args.resume:
    checkpoint = torch.load(args.resume)
    netD.load_state_dict(checkpoint["netD"])
    netG.load_state_dict(checkpoint["netG"])
    optimizerD.load_state_dict(checkpoint["optimizerD"])
    optimizerG.load_state_dict(checkpoint["optimizerG"])
    amp.load_state_dict(checkpoint["amp"])
    torch.set_rng_state(checkpoint["rng"])
    start = checkpoint["step"]
    print("resumed from step %d" % start)

for step in range(start, args.steps):
    batch = real_data[(step % 4) * args.batch_size:(step % 4 + 1) * args.batch_size]
    ones = torch.ones(args.batch_size).cuda()
    zeros = torch.zeros(args.batch_size).cuda()

    # (1) the discriminator: real samples, then fakes, each loss with its own scaler
    netD.zero_grad()
    errD_real = criterion(netD(batch).view(-1), ones)
    with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
        errD_real_scaled.backward()
    noise = torch.randn(args.batch_size, NZ).cuda()
    fake = netG(noise)
    errD_fake = criterion(netD(fake.detach()).view(-1), zeros)
    with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
        errD_fake_scaled.backward()
    optimizerD.step()

    # (2) the generator, through the discriminator
    netG.zero_grad()
    errG = criterion(netD(fake).view(-1), ones)
    with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
        errG_scaled.backward()
    optimizerG.step()

    print("step %d errD %r errG %r" % (step, to_python_float(errD_real + errD_fake),
                                       to_python_float(errG)))

    if step + 1 == args.save_step:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save({"netD": netD.state_dict(), "netG": netG.state_dict(),
                    "optimizerD": optimizerD.state_dict(), "optimizerG": optimizerG.state_dict(),
                    "amp": amp.state_dict(), "rng": torch.get_rng_state(), "step": step + 1},
                   os.path.join(args.output_dir, "checkpoint.pt"))
        print("saved checkpoint at step %d" % (step + 1))

if args.final:
    torch.save({"netD": netD.state_dict(), "netG": netG.state_dict()}, args.final)
