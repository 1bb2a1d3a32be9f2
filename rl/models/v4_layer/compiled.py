"""When the V4 layer's fused functions run under `torch.compile`, and how.

`RL_V4_COMPILE` (environment): `auto` (default) compiles on CUDA tensors and runs eagerly
elsewhere (a CPU has no Triton, and inductor's C++ path would compile for minutes in every
test process); `1` compiles everywhere; `0` never (the same torch code, eagerly). Read at each
call, so a process can switch it.

Each function is compiled whole (`fullgraph=True`: a graph break would split the Sinkhorn loop
back into small kernels, so it is an error, not a silent slowdown). Its leading arguments are
token-major (dim 0 = tokens, `B * S` flattened) and marked dynamic with
`torch._dynamo.maybe_mark_dynamic`, so a new sequence length reuses the compiled graph instead
of recompiling each step; the other dimensions are the model's (static). Only calls with
autograd on compile (training steps); generation and no-grad scoring run the same functions
eagerly, so a decode step's single token or a new width never adds a graph. A function that
still hits dynamo's recompile limit (8) runs eagerly from then on, with one warning.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch

log = logging.getLogger(__name__)

ENV = "RL_V4_COMPILE"
BACKEND: str | Callable = "inductor"
"""The torch.compile backend (tests count compilations with their own)."""


def enabled(device: torch.device) -> bool:
    """Whether a call on `device` runs compiled (`RL_V4_COMPILE`, see the module docstring)."""
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={value!r}; expected auto, 0 or 1")
    return device.type == "cuda" if value == "auto" else value == "1"


ALIGNMENT = 16
"""Bytes: inductor's Triton kernels assume every input's data pointer is this aligned."""


def aligned_args(args: tuple) -> tuple:
    """`args` with every tensor whose data pointer is off `ALIGNMENT` replaced by a copy.

    DeepSpeed hands the model views into its flat buffers, and one parameter of an odd element
    count (V4's 3-element hyper-connection `scale`) shifts every later view off 16 bytes (see
    `rl.trainer.alignment`). Inductor's kernels then fault ("CUDA error: misaligned address",
    first seen in its autotuning). The misaligned inputs are the hyper-connection and norm
    weights, a few kB; the copy is differentiable, so their gradients reach the views."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) and a.data_ptr() % ALIGNMENT else a
                 for a in args)


class Fused:
    """`fn`, run eagerly or compiled (`enabled`); the first `token_args` arguments are
    token-major tensors whose dim 0 is marked dynamic."""

    def __init__(self, fn: Callable, token_args: int):
        self.fn = fn
        self.token_args = token_args
        self._compiled: Callable | None = None
        self._backend: str | Callable | None = None
        self._eager = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        # Only training steps compile: generation and no-grad scoring call with many shapes
        # (a decode step's single token, each prompt length), which would only add graphs.
        if self._eager or not torch.is_grad_enabled() or not enabled(args[0].device):
            return self.fn(*args)
        if self._compiled is None or self._backend is not BACKEND:
            self._compiled = torch.compile(self.fn, fullgraph=True, backend=BACKEND)
            self._backend = BACKEND
        args = aligned_args(args)
        for t in args[:self.token_args]:
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            return self._compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # More distinct shapes than dynamo's recompile limit: run this function eagerly
            # from now on (the same torch code) rather than fail the step.
            self._eager = True
            log.warning("%s: torch.compile hit its recompile limit; running it eagerly from "
                        "now on", self.fn.__name__)
            return self.fn(*args)
