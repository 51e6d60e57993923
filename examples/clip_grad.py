"""Gradient clipping under amp: clip the fp32 master gradients after ``scale_loss`` exits.

Under O2 the optimizer steps fp32 master weights; their gradients are filled
(unscaled) when ``scale_loss`` exits. Clip those, with ``amp.master_params``,
before ``optimizer.step()``. Under O0/O1/O3 ``master_params`` yields the model's
own parameters, so the same code works at every level.

    python examples/clip_grad.py --opt-level O2 --max-norm 0.5
"""

import argparse

import torch
import torch.nn.functional as F

import amp_patch as amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-norm", type=float, default=0.5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)

    clipped = 0
    for step in range(args.steps):
        x = torch.randn(128, 64)
        y = (x[:, :8] * 3).argmax(dim=1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        # After the context exits the master grads are unscaled fp32: clip those.
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_norm)
        after = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in amp.master_params(optimizer)]))
        clipped += int(norm > args.max_norm)
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f} "
                  f"-> {after.item():.3f}")
    dtypes = sorted({str(p.dtype) for p in amp.master_params(optimizer)})
    print(f"{args.opt_level}: clipped {clipped}/{args.steps} steps to max norm {args.max_norm}; "
          f"clipped grads are {', '.join(dtypes)}; model weights are {model[0].weight.dtype}")


if __name__ == "__main__":
    main()
