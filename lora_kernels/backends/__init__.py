"""Backends of the SGMV ops, one module each, behind one protocol (`base.Backend`).

A backend module in this package defines ``BACKEND``: an object with ``name``, ``unavailable(device)``
(the error to raise, or None)
and the three ops. The registry finds the modules listed in ``NAMES``; adding a backend is one new
module here plus its name in that tuple (and, for `auto` to pick it, a row in the generated table).
"""

from __future__ import annotations

import importlib

from lora_kernels.backends.base import Backend

NAMES = ("torch", "triton", "cuda")  # the package's backends; "auto" chooses among them (auto.py)
_loaded: dict[str, Backend | None] = {}
_errors: dict[str, str] = {}


def get(name: str) -> Backend | None:
    """The backend called `name`, imported on first use; None if its module cannot be imported."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(f"lora_kernels.backends.{name}").BACKEND
        except ImportError as e:  # e.g. Triton not installed
            _loaded[name], _errors[name] = None, str(e) or repr(e)
    return _loaded[name]


def import_error(name: str) -> str:
    return _errors.get(name, "")


def unavailable(name: str, device) -> Exception | None:
    """Why backend `name` cannot run on `device`, as the error to raise (None if it can)."""
    b = get(name)
    if b is None:
        return RuntimeError(f"requested but it cannot be imported: {import_error(name)}")
    return b.unavailable(device)
