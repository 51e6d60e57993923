"""Checks of command-line values, shared by the subcommands, and the error that reports them.

Every check runs in the parent process before any work starts, and a failed
one ends the command as argparse does: usage, ``amp-patch CMD: error: ...``
on stderr, exit status 2.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["UsageError", "parse_device", "check_output_dir", "check_output_file"]


class UsageError(Exception):
    """A bad command-line value; the message says what was expected.

    :func:`amp_patch.cli.main.main` turns it into argparse's usage error
    (exit status 2).

    Example::

        >>> raise UsageError("--steps must be at least 1, got 0")
        Traceback (most recent call last):
        amp_patch.cli.options.UsageError: --steps must be at least 1, got 0
    """


def parse_device(text: str, option: str = "--device") -> torch.device:
    """The :class:`torch.device` named by ``text``: ``cpu`` or ``cuda[:N]``, present here.

    Args:
        text (str): the option's value.
        option (str, optional): the option's name, for the message. Default: ``"--device"``.

    Returns:
        torch.device: the device.

    Raises:
        UsageError: ``text`` is not a device name, names another device type,
            or names a CUDA device this machine does not have.

    Example::

        >>> parse_device("cuda:1")   # on a machine with two GPUs
        device(type='cuda', index=1)
    """
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise UsageError(f"{option} {text!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"{option} {text!r}: expected cpu, cuda or cuda:N "
                         f"({device.type} is not supported)")
    if not torch.cuda.is_available():
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise UsageError(f"{option} {text!r}: CUDA is not available ({why}, "
                         f"torch {torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(f"{option} {text!r}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return device


def check_output_dir(path: Path, option: str = "--out") -> Path:
    """Create the output directory ``path`` (and its parents) now, so that a bad path fails first.

    Args:
        path (Path): the directory.
        option (str, optional): the option's name, for the message. Default: ``"--out"``.

    Returns:
        Path: ``path``.

    Raises:
        UsageError: ``path`` is a file, or cannot be created.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: names a file; expected a directory "
                         "(created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot create the directory "
                         f"({exc.strerror or exc})") from None
    return path


def check_output_file(path: Path, option: str) -> Path:
    """Check that the file ``path`` can be written later: not a directory, its directory creatable.

    Args:
        path (Path): the file.
        option (str): the option's name, for the message.

    Returns:
        Path: ``path``.

    Raises:
        UsageError: ``path`` is a directory, or its directory cannot be created.
    """
    if path.is_dir():
        raise UsageError(f"{option} {path}: names a directory; expected a file path")
    check_output_dir(path.parent, option=f"{option} {path}: its directory")
    return path
