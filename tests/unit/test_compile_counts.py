"""A compiled trial reports what dynamo compiled over its steps: graphs, graph breaks and their reasons, counted
by dynamo itself (before/after, since its process totals survive `torch.compiler.reset`)."""

from __future__ import annotations

import json

import torch

from raybench.techniques import compile


class Printing(torch.nn.Module):
    def forward(self, x):
        y = x.sin()
        print("a host call dynamo cannot trace")  # a graph break: two graphs either side of it
        return y.cos()


def test_a_graph_break_is_counted_with_its_reason(capsys):
    torch.compiler.reset()
    before = compile.dynamo_counts()
    module = Printing()
    module.compile(backend="eager")  # dynamo's capture without inductor's code generation
    module(torch.randn(4))
    module(torch.randn(4))  # the second call reuses both graphs
    found = compile.compiled_since(before)
    assert found["compile_graphs"] == 2 and found["compile_graph_breaks"] == 1
    (reason,) = json.loads(found["compile_graph_break_reasons_json"])
    assert "print" in reason and "\n" not in reason


def test_nothing_compiled_is_zero():
    before = compile.dynamo_counts()
    assert compile.compiled_since(before) == {"compile_graphs": 0, "compile_graph_breaks": 0,
                                              "compile_graph_break_reasons_json": None}
