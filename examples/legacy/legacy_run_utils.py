"""Small helpers shared by the 2019-style scripts in this folder: logging a step and checkpoints.

Each script prints one line per step, ``step N loss L scale S state DIGEST``,
where DIGEST hashes every tensor that training changes (model params and
buffers, fp32 masters, optimizer state). A skipped step therefore shows the
digest of the step before it, and a resumed run prints the very same lines as
the run it resumes.
"""

import hashlib
import os

import torch


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def parse_args_with_checkpoints(parser, output_dir):
    """Add the options every script here takes, then parse: --overflow_step, --save_step,
    --output_dir, --resume."""
    parser.add_argument("--overflow_step", type=int, default=-1,
                        help="multiply the loss of this step by inf (to watch it be skipped)")
    parser.add_argument("--save_step", type=int, default=-1,
                        help="save a checkpoint once this many steps are done")
    parser.add_argument("--output_dir", default=output_dir)
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    return parser.parse_args()


def state_digest(*states):
    """A short hash of the bytes of every tensor in ``states`` (nested dicts and lists)."""
    h = hashlib.sha256()
    for t in _tensors(list(states)):
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def log_step(step, loss, scale, *states):
    """Print the step's line (the loss with every digit, so that runs compare exactly)."""
    print("step %d loss %r scale %r state %s" % (step, float(loss), float(scale),
                                                  state_digest(*states)), flush=True)


def save_checkpoint(output_dir, **state):
    """``torch.save`` the dict ``state`` as ``output_dir/checkpoint.pt``; returns the path."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "checkpoint.pt")
    torch.save(state, path)
    print("saved checkpoint at step %d" % state["step"], flush=True)
    return path


def load_checkpoint(path, **objects):
    """Read the checkpoint saved by :func:`save_checkpoint` (``weights_only=True``) into ``objects``.

    Each keyword names a saved entry; its object's ``load_state_dict`` gets it
    (``model=model, optimizer=optimizer, amp=amp``). Returns the saved step.
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    for name, obj in objects.items():
        obj.load_state_dict(checkpoint[name])
    print("resumed from step %d" % checkpoint["step"], flush=True)
    return checkpoint["step"]
