"""Tiered modules' ``forward`` kept out of graph capture: the store boundary is opaque to
``torch.compile`` and ``torch.fx`` tracers."""

from __future__ import annotations

import functools
import sys

import torch


def opaque_to_tracers(method):
    """``forward`` of a tiered module, opaque to graph capture, as the store boundary must be:
    under torch.compile it runs eagerly (a graph break: the dense layers around it compile, and the
    update hook runs in backward as in eager mode); under torch.fx tracing (``symbolic_trace``,
    TorchRec's tracer) its call is one leaf of the graph, so the rest of the model traces."""
    compiled = _opaque_to_compiler(method)

    proxy = torch.fx.Proxy

    @functools.wraps(method)
    def call(module, *args, **kwargs):
        for value in args if not kwargs else (*args, *kwargs.values()):  # a plain loop: each step
            if isinstance(value, proxy):  # an fx tracer's: the call is one node of its graph
                tracer = value.tracer
                return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)
        return compiled(module, *args, **kwargs)

    return call


def _opaque_to_compiler(method):
    """``method`` run eagerly under torch.compile (``torch.compiler.disable``). That imports
    torch._dynamo (about 70 MiB of memory): it is applied once a compiler is loaded, so a process
    that never compiles never loads it."""
    reason = "a tiered table reads its rows from a store outside the graph"
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(method, recursive=True, reason=reason)
    disabled = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # no compiler loaded: nothing is tracing this call
                return method(*args, **kwargs)
            disabled = torch.compiler.disable(method, recursive=True, reason=reason)
        return disabled(*args, **kwargs)

    return call
