"""Mixed precision on a CPU: bfloat16, no loss scaling, and what each opt level does.

On a CPU, half_dtype defaults to bfloat16: it has fp32's exponent range, so
no loss scaling is needed (the scale is a static 1.0), and CPUs with bf16
instructions (avx512_bf16, AMX) run its matmuls several times faster than
fp32. fp16 on most CPUs has no fast kernels at all.

This trains a small MLP for a few steps under O0-O3, each after
``deinitialize()``, and prints the dtypes each level uses and its step time.

    python examples/bf16_cpu.py --steps 10
"""

import argparse
import time

import torch
import torch.nn.functional as F

import amp_patch as amp
from amp_patch.settings import levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--levels", nargs="+", default=list(levels.NAMES))
    args = parser.parse_args()

    for level in args.levels:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
                                    torch.nn.Linear(args.width, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
        x = torch.randn(256, args.width)
        y = x[:, :10].argmax(dim=1)
        seen = {}
        model[0].register_forward_hook(lambda mod, inp, out: seen.update(hidden=out.dtype))
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        ms = (time.perf_counter() - start) / args.steps * 1e3
        master = next(amp.master_params(optimizer)).dtype
        print(f"{level}: weights {model[0].weight.dtype}, first layer output {seen['hidden']}, "
              f"stepped params {master}, loss scale "
              f"{amp.state_dict()['loss_scaler0']['loss_scale']:g}, loss {loss.item():.4f}, "
              f"{ms:.1f} ms/step")
        amp.deinitialize()
    print("bf16 needs no loss scaling: every level ran with a static scale of 1.0")


if __name__ == "__main__":
    main()
