"""A compiled trial reports what dynamo compiled over its steps: graphs, graph breaks and their reasons, counted
by dynamo itself (before/after, since its process totals survive `torch.compiler.reset`)."""

from __future__ import annotations

import json

import torch

from raybench.runtime.techniques import compile


class Breaking(torch.nn.Module):
    def forward(self, x):
        y = x.sin()
        # An explicit break: a host call such as print breaks for a reason that depends on the process's
        # logging and stdout (under a lock, dynamo names the lock instead).
        torch._dynamo.graph_break()
        return y.cos()


def test_a_graph_break_is_counted_with_its_reason():
    torch.compiler.reset()
    before = compile.dynamo_counts()
    module = Breaking()
    module.compile(backend="eager")  # dynamo's capture without inductor's code generation
    module(torch.randn(4))
    module(torch.randn(4))  # the second call reuses both graphs
    found = compile.compiled_since(before)
    assert found["compile_graphs"] == 2 and found["compile_graph_breaks"] == 1
    (reason,) = json.loads(found["compile_graph_break_reasons_json"])
    assert "graph_break()" in reason and "\n" not in reason


def test_nothing_compiled_is_zero():
    before = compile.dynamo_counts()
    assert compile.compiled_since(before) == {"compile_graphs": 0, "compile_graph_breaks": 0,
                                              "compile_graph_break_reasons_json": None}
