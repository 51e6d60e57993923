"""A Transformer Engine script in the shape of its quickstart: te.Linear layers in fp8_autocast.

It imports no amp_patch. With Transformer Engine installed on an FP8 GPU it runs
on TE; anywhere else (a CPU, a GPU without TE) run it through amp_patch, which
serves ``transformer_engine`` from its own FP8 ops::

    amp-patch run --device cpu examples/te_quickstart.py --steps 30
    amp-patch run examples/te_quickstart.py --recipe current   # on an sm_89+ GPU without TE

It trains a small MLP stack on a fixed regression task and prints the loss of
the first and last steps.
"""

import argparse

import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--recipe", choices=["delayed", "current"], default="delayed")
    args = parser.parse_args()
    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(
        te.LayerNormLinear(h, 4 * h, eps=1e-5),
        torch.nn.GELU(),
        te.Linear(4 * h, h, bias=True),
        te.LayerNorm(h),
        te.Linear(h, h),
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.recipe == "delayed":
        recipe = DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=16,
                                amax_compute_algo="max")
    else:
        recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)
    teacher = torch.randn(h, h, device="cuda") / h ** 0.5
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, h, device="cuda")
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y.float(), torch.tanh(x @ teacher))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad(), te.fp8_autocast(enabled=False):
        y = model(torch.randn(8, h, device="cuda"))
    print(f"first loss {losses[0]:.4f} last loss {losses[-1]:.4f} ({args.recipe} scaling, "
          f"{args.steps} steps); eval output {tuple(y.shape)} without FP8")


if __name__ == "__main__":
    main()
