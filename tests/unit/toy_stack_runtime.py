"""A toy stack kind's runtime module (test_stack_registry.py registers the kind): what runtime/stacks/KIND.py of an
in-process kind gives."""

from __future__ import annotations


def build(payload, ctx, probe):
    """The stack's trainer for one trial; the toy's says which trial it was built for."""
    return {"built_for": payload.config.stack.kind, "ctx": ctx, "probe": probe}
