"""A gradient penalty under amp: differentiate the *scaled* loss, then unscale by hand.

The penalty needs the gradients themselves, with ``create_graph=True``. Take
them of ``loss * scale`` (so that small fp16 gradients do not underflow) and
divide by the scale before using them; then the total loss goes through
``scale_loss`` as usual. With bf16 the scale is 1.0, and the recipe still holds.

    python examples/grad_penalty.py --opt-level O1 --penalty 0.1
"""

import argparse

import torch
import torch.nn.functional as F

import amp_patch as amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--penalty", type=float, default=0.1, help="weight of the gradient penalty")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    params = [p for p in model.parameters() if p.requires_grad]

    for step in range(args.steps):
        x = torch.randn(64, 32)
        y = x[:, :1].sin()
        optimizer.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        scaled_grads = torch.autograd.grad(loss * scale, params, create_graph=True)
        grad_norm = torch.sqrt(sum((g.float() / scale).pow(2).sum() for g in scaled_grads))
        total = loss + args.penalty * grad_norm
        with amp.scale_loss(total, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {grad_norm.item():.4f}  "
                  f"total {total.item():.4f}  (loss scale {scale:g})")
    print(f"{args.opt_level}: trained {args.steps} steps with a gradient-norm penalty of weight "
          f"{args.penalty}")


if __name__ == "__main__":
    main()
