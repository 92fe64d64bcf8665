"""``eager_only``: keep a function of the runtime out of torch.compile.

[Note: what Dynamo may trace]
Under ``engine.compile()`` Dynamo may trace the user's module code and nothing of the runtime's.
* Correctness: a release ends in upstream's ``free_param`` (``param.data = torch.empty(0)``), which
  Dynamo records as ``set_`` plus a version-counter fix that AOT autograd drops, so the compiled
  forward's saved weight is a version ahead and backward raises "modified by an inplace operation".
  Dynamo compiles every frame a hook calls, even when it runs the hook itself eagerly at a break.
* Meaning: fetch, release, pass boundaries and counters are side effects on state outside the
  graph; a graph would replay them as traced, or guard on them and recompile.
Rule: every entry point into the runtime is ``eager_only`` (recursive: nothing it calls is
compiled): the module and root hooks, the backward callbacks, and the coordinator methods the
engine calls. Each is one graph break, as upstream's disabled hooks are. What Dynamo may still
trace is ``ZeROOrderedDict.__getitem__``, which returns the parameter as is while compiling.
The wrapping is lazy: ``torch._disable_dynamo`` imports ``torch._dynamo`` at the first call.
"""

import torch


def eager_only(fn):
    """``fn`` never traced by Dynamo, nor anything it calls ([Note: what Dynamo may trace])."""
    return torch._disable_dynamo(fn)
