"""Several models, optimizers and losses in one amp session, each loss with its own scaler.

``num_losses=2`` gives two loss scalers; ``loss_id`` picks one in
``scale_loss``. Here an encoder and a classifier are trained on one loss, and
an auxiliary reconstruction head, on detached features, with its own optimizer
and its own loss scaler, so that an overflow in one loss never shrinks the
other's scale.

    python examples/multiple_models_losses.py --opt-level O2
"""

import argparse

import torch
import torch.nn.functional as F

import amp_patch as amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    classifier = torch.nn.Linear(16, 4)
    decoder = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt_main = torch.optim.Adam(list(encoder.parameters()) + list(classifier.parameters()), lr=1e-3)
    opt_aux = torch.optim.SGD(decoder.parameters(), lr=0.05, momentum=0.9)

    [encoder, classifier, decoder], [opt_main, opt_aux] = amp.initialize(
        [encoder, classifier, decoder], [opt_main, opt_aux], opt_level=args.opt_level,
        num_losses=2, verbosity=0)

    for step in range(args.steps):
        x = torch.randn(64, 32)
        y = x[:, :4].argmax(dim=1)
        opt_main.zero_grad()
        opt_aux.zero_grad()
        features = encoder(x)
        loss_cls = F.cross_entropy(classifier(features), y)
        loss_rec = F.mse_loss(decoder(features.detach()).float(), x)
        with amp.scale_loss(loss_cls, opt_main, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(loss_rec, opt_aux, loss_id=1) as scaled:
            scaled.backward()
        opt_main.step()
        opt_aux.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  classification {loss_cls.item():.4f}  "
                  f"reconstruction {loss_rec.item():.4f}")
    state = amp.state_dict()
    print(f"{args.opt_level}: 3 models, 2 optimizers, 2 losses; loss scales "
          f"{state['loss_scaler0']['loss_scale']:g} and {state['loss_scaler1']['loss_scale']:g}")


if __name__ == "__main__":
    main()
