"""The lightning stack's context parameter, which its check before launch (planning.stacks.lightning) and its rank
(runtime.stacks.lightning) both read off the user's function."""

from __future__ import annotations

import inspect

# The function's parameter raybench fills with the trial's context (runtime.stacks.lightning.LightningContext); no
# override may take its name.
CONTEXT_PARAMETER = "ctx"


def takes_context(parameters) -> bool:
    """Whether a function with these parameters (inspect's) declares `ctx` by name (**kwargs alone does not)."""
    param = parameters.get(CONTEXT_PARAMETER)
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)
