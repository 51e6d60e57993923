"""A training script as an Apex user wrote it, years ago. It is not edited for amp_patch.

Run it with the import hook that serves `apex` from amp_patch:

    amp-patch run examples/legacy_apex_train.py --steps 30
    python -m amp_patch run examples/legacy_apex_train.py --opt-level O1

On CPU the half type is bfloat16; on CUDA it is float16, as in Apex.
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp
from apex.optimizers import FusedAdam


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def get_batch(step, batch_size, device):
    g = torch.Generator().manual_seed(step)
    target = torch.randint(0, 10, (batch_size,), generator=g)
    # Each class lights up its own horizontal band of the image, plus noise.
    data = torch.randn(batch_size, 1, 28, 28, generator=g) * 0.5
    for i, t in enumerate(target.tolist()):
        data[i, 0, 2 * t:2 * t + 3, :] += 2.0
    return data.to(device), target.to(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Net().to(device)
    optimizer = FusedAdam(model.parameters(), lr=args.lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    for step in range(args.steps):
        data, target = get_batch(step, args.batch_size, device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print("step %d loss %.4f" % (step, loss.item()))

    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "amp": amp.state_dict(),
    }
    path = os.path.join(tempfile.mkdtemp(), "amp_checkpoint.pt")
    torch.save(checkpoint, path)

    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    print("saved and restored checkpoint: amp state %s" % checkpoint["amp"])
    print("final loss %.4f" % loss.item())


if __name__ == "__main__":
    main()
