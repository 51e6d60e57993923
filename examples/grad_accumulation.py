"""Gradient accumulation under amp: ``delay_unscale=True`` on all but the last micro-batch.

With ``delay_unscale=True``, ``scale_loss`` leaves the gradients scaled and
does no unscale or overflow check; the last micro-batch of the window unscales
everything at once (under O2, into the fp32 master grads). The example checks
that the accumulated gradient matches one full-batch gradient.

    python examples/grad_accumulation.py --opt-level O2 --accum 4
"""

import argparse

import torch
import torch.nn.functional as F

import amp_patch as amp


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    g = torch.Generator().manual_seed(1)

    for step in range(args.steps):
        xs = torch.randn(args.accum, args.micro_batch, 32, generator=g)
        ys = xs[..., :4].argmax(dim=-1)
        optimizer.zero_grad()
        total = 0.0
        for i in range(args.accum):
            loss = F.cross_entropy(model(xs[i]), ys[i]) / args.accum
            last = i == args.accum - 1
            with amp.scale_loss(loss, optimizer, delay_unscale=not last) as scaled_loss:
                scaled_loss.backward()
            total += loss.item()
        if step == 0:
            # The same batch in one piece, in fp32: the accumulated grads should match it.
            reference = make_model()
            ref_loss = F.cross_entropy(reference(xs.flatten(0, 1)), ys.flatten())
            ref_loss.backward()
            got = torch.cat([p.grad.float().flatten() for p in amp.master_params(optimizer)])
            want = torch.cat([p.grad.flatten() for p in reference.parameters()])
            rel = ((got - want).norm() / want.norm()).item()
            print(f"accumulated gradient vs one full batch in fp32: relative difference {rel:.2e}")
        optimizer.step()
        print(f"step {step:3d}  loss {total:.4f}  ({args.accum} micro-batches of {args.micro_batch})")
    print(f"{args.opt_level}: {args.steps} optimizer steps, each over {args.accum} accumulated "
          f"micro-batches; amp state {amp.state_dict()}")


if __name__ == "__main__":
    main()
