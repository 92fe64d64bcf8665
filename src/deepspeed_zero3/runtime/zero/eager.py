"""``eager_only``: keep a function of the runtime out of torch.compile.

[Note: what Dynamo may trace]
Under ``engine.compile()`` (``torch.compile`` of the engine's module, ``_call_impl`` and its hooks included)
Dynamo may trace the user's module code and nothing of the runtime's bookkeeping. Two reasons:

* Correctness. A release ends in upstream's ``free_param``: ``param.data = torch.empty(0)``. Dynamo
  records that as ``set_`` on the parameter, plus a call that lowers its version counter back by one; AOT
  autograd (backends ``aot_eager`` and ``inductor``) replays the ``set_`` and loses the compensation, so the
  weight that the compiled forward saved for backward is one version ahead and the first backward raises
  "one of the variables needed for gradient computation has been modified by an inplace operation". Dynamo
  gets there even without tracing a hook into the model's graph: at a graph break it runs the hook eagerly
  but keeps compiling every frame the hook calls, ``free_param`` among them.
* Meaning. Fetch, release, pass boundaries and counters are side effects on state outside the graph
  (collectives, the pass state machine, Python sets and dicts); a graph would replay them as they were
  when it was traced, or guard on them and recompile whenever they change.

So every entry point into the runtime is ``eager_only``: the six module and root hooks and the two backward
callbacks (``hooks.py``), and the coordinator methods upstream's engine calls directly (fetch, release,
``reset_step``, ``release_backward_leftovers``, ``release_and_reset_all``). ``eager_only`` is recursive:
Dynamo neither traces the function nor compiles any frame it calls. Each call site in a compiled forward is
one graph break, as upstream's own disabled hooks and coordinator methods are.

What Dynamo may still trace is ours only where it reads parameters: ``ZeROOrderedDict.__getitem__``
returns the parameter as is while compiling (the module's pre-forward hook, run eagerly, gathered it), and
``BackwardHook`` is applied by the eager output and input wrapping, so it never enters a graph. Under
compiled autograd the backward callbacks are the graph breaks of the backward graph.

The wrapping is lazy: ``torch._disable_dynamo`` imports ``torch._dynamo`` (seconds) on the first call, not
when this module is imported, so importing the runtime stays cheap for processes that never compile.
"""

import torch

_lazy_disable = getattr(torch, "_disable_dynamo", None)


def eager_only(fn):
    """``fn`` never traced by Dynamo, nor anything it calls ([Note: what Dynamo may trace])."""
    if _lazy_disable is not None:
        return _lazy_disable(fn)
    return torch.compiler.disable(fn)  # a torch without the lazy form: imports torch._dynamo here
