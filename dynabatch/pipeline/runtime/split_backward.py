"""A split backward that does each gradient product once: the input part (``Bi``) walks the stage's graph
computing activation gradients only and keeps, for every node that feeds a parameter, the gradient that
flowed into it; the weight part (``W``) starts from those nodes and walks only their parameter side.

Why not ``autograd.backward(outputs, inputs=params)`` for the weight part: reaching a parameter of an early
layer from the stage's outputs walks the whole activation chain again, so the weight part repeated most of
the input part's work (measured on gpt-tiny: input part 0.55x, weight part 0.88x of a whole backward).

The graph of one micro-batch on one chunk is read once, at the input part (`input_part`):

* *parameter side*: the parameters' accumulators and the nodes with one edge, into the parameter side
  (``TBackward`` of a weight, ``EmbeddingBackward`` of a lookup: a function of one weight);
* *activation side*: every other node (the chain from the outputs to the stage's inputs); a *weight edge*
  leads from an activation-side node into the parameter side.

The input part asks autograd for the gradients of the stage's inputs and of every output of each
activation-side node that has a weight edge (``GradientEdge(node, i)``: the gradient flowing into it, which
does not run the node itself), so the chain runs once and no weight product is computed. The weight part
runs each such node again from the kept gradient with only its weight edges wanted (`weight_part`): autograd
computes a node's output only when its edge leads to a requested input, and none of the chain edges do.
A parameter reachable from one node through both a weight edge and the chain (a weight used twice on one
chunk, e.g. tied embeddings on one stage) is computed whole in the input part instead, so no product is
done twice or left out. Since a backward is linear in the gradient it starts from, the parameter gradients
are the whole backward's (sums in another order: float rounding only).

Layers recomputed under ``torch.utils.checkpoint`` run their forward again in every autograd call that
unpacks their saved tensors, so a chunk with recomputed layers keeps the plain split (``rewalk``: the weight
part walks from the outputs to the parameters in one call, recomputing once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class WeightWork:
    """What the weight part of one split backward runs: per activation-side node with weight edges, its
    output edges, the gradients the input part kept for them and the parameters it feeds (``groups``), or,
    with ``rewalk``, the stage's ``outputs``/``grads`` and all its parameters in one call."""

    groups: list[tuple[list, list, list]] = field(default_factory=list)
    rewalk: tuple | None = None

    @property
    def kept_bytes(self) -> int:
        """Bytes of the gradients kept for the weight part (held from the input part to the weight part, on top
        of the activations the graph keeps)."""
        return sum(g.numel() * g.element_size() for _, grads, _ in self.groups for g in grads)


def _accumulate(params, grads, taken: set) -> None:
    """Add ``grads`` into ``params``' ``.grad`` (as a whole backward accumulates them). A parameter without one
    takes the tensor itself, as autograd's accumulator does, unless its storage was handed out already
    (``taken``: the data pointers given to other parameters or kept for a weight part; autograd may return one
    tensor for several inputs, e.g. a sum's gradient), then a copy."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            ptr = g.untyped_storage().data_ptr()
            p.grad = g.detach().clone() if ptr in taken else g.detach()
            taken.add(ptr)
        else:
            p.grad.add_(g)


def _graph(roots, param_bit: dict, input_nodes: set):
    """The graph below ``roots`` (grad_fn nodes): nodes in post-order (children first), each node's
    reachable parameters (an int bit set over ``param_bit``) and whether it is on the parameter side."""
    order, seen, stack = [], set(), [(n, False) for n in roots if n is not None]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((nxt, False) for nxt, _ in node.next_functions if nxt is not None and nxt not in seen)
    reach, param_side = {}, {}
    for node in order:
        if node in param_bit:
            reach[node], param_side[node] = param_bit[node], True
        elif node in input_nodes:
            reach[node], param_side[node] = 0, False
        elif not node.next_functions and hasattr(node, "variable"):  # another leaf: nothing to compute there
            reach[node], param_side[node] = 0, True
        else:
            nxt = [n for n, _ in node.next_functions if n is not None]
            bits = 0
            for n in nxt:
                bits |= reach[n]
            # one edge down to the parameter side: a view, transpose or lookup of one weight
            reach[node], param_side[node] = bits, len(nxt) == 1 and param_side[nxt[0]]
    return order, reach, param_side


def input_part(outputs, grads, inputs, params, *, rewalk: bool = False) -> tuple[list, WeightWork]:
    """The input part of the backward of ``outputs`` (tensors; ``grads`` their gradients, None for a scalar
    loss): the gradients of ``inputs`` (tensors that require one, in order; None where none flows) and the
    `WeightWork` of its weight part over ``params``. See the module docstring; ``rewalk``: the plain split
    (recomputed layers)."""
    if not outputs:
        return [None] * len(inputs), WeightWork()
    if rewalk or not params:
        got = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True) if inputs else []
        return list(got), WeightWork(rewalk=(outputs, grads, params) if params else None)
    param_bit = {get_gradient_edge(p).node: 1 << i for i, p in enumerate(params)}
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    order, reach, param_side = _graph([o.grad_fn for o in outputs], param_bit, input_nodes)
    feeders, clash = [], 0  # (node, bits via its weight edges); parameters reached both ways
    for node in order:
        if param_side[node] or node in input_nodes:
            continue
        wbits = cbits = 0
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if param_side[nxt]:
                wbits |= reach[nxt]
            else:
                cbits |= reach[nxt]
        if wbits:
            feeders.append((node, wbits))
            clash |= wbits & cbits
    # an output made on the parameter side (a stage that is one embedding): its weight part starts there
    roots = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn is not None and param_side[o.grad_fn]]
    whole = [p for i, p in enumerate(params) if clash >> i & 1]
    edges, spans = [], []
    for node, wbits in feeders:
        if wbits & ~clash:
            first = len(edges)
            edges += [GradientEdge(node, i) for i in range(len(node._input_metadata))]
            spans.append((node, wbits & ~clash, first, len(edges)))
    targets = list(inputs) + whole + edges
    got = torch.autograd.grad(outputs, targets, grads, retain_graph=True, allow_unused=True) if targets else []
    n_in = len(inputs)
    kept = got[n_in + len(whole):]
    _accumulate(whole, got[n_in:n_in + len(whole)], {g.untyped_storage().data_ptr() for g in kept if g is not None})
    work = WeightWork()
    for o, g in roots:
        bits = reach[o.grad_fn] & ~clash
        if bits:
            work.groups.append(([get_gradient_edge(o)], [torch.ones_like(o) if g is None else g],
                                [p for i, p in enumerate(params) if bits >> i & 1]))
    for node, bits, a, b in spans:
        pairs = [(edges[k], kept[k]) for k in range(a, b) if kept[k] is not None]
        if pairs:
            work.groups.append(([e for e, _ in pairs], [g for _, g in pairs],
                                [p for i, p in enumerate(params) if bits >> i & 1]))
    return list(got[:n_in]), work


def weight_part(work: WeightWork) -> None:
    """Run the weight part `input_part` prepared, accumulating the parameter gradients into ``.grad``."""
    if work.rewalk is not None:
        outputs, grads, params = work.rewalk
        torch.autograd.backward(outputs, grads, inputs=params)
        return
    taken: set = set()
    for edges, grads, params in work.groups:
        # retain_graph: a parameter-side node may be shared by two feeders (one transposed weight used twice)
        _accumulate(params, torch.autograd.grad(edges, params, grads, retain_graph=True, allow_unused=True), taken)
