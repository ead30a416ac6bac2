"""An LSTM layer as a time scan over one cell, shared by the torch and ONNX importers.

Each layer is its own scan whose body is one cell with torch.nn.LSTM's gates (i, f, g, o),
its weights bound as invariants and the sequence chained from layer to layer: the form the
wavefront pass (``codegen.wavefront``) recognises when the initial state is zero.
"""

from __future__ import annotations

from souffle.graph import Graph, GraphBuilder


def lstm_layer(ctx, sequence, weights, h_init, c_init, name: str):
    """(T, B, I) ``sequence`` -> (its (T, B, H) outputs, final h and c as (1, B, H)); ``weights``
    are W_ih (4H, I), W_hh (4H, H) and the two biases (4H) or None, in torch's gate order."""
    steps, batch, inputs = ctx.shape(sequence)
    w_ih, w_hh, b_ih, b_hh = weights
    hidden = ctx.shape(w_hh)[1]
    biased = b_ih is not None
    bound = [("w_ih", w_ih), ("w_hh", w_hh)] + ([("b_ih", b_ih), ("b_hh", b_hh)] if biased else [])
    (h_n, c_n), (outputs,) = ctx.builder.scan(
        _cell(inputs, hidden, batch, biased), steps, name=ctx.fresh(name),
        carry=[("h", "h_next", ctx.tensor(h_init)), ("c", "c_next", ctx.tensor(c_init))],
        xs=[("x_t", ctx.tensor(sequence))], ys=["h_next"],
        invariants=[(inner, ctx.tensor(outer)) for inner, outer in bound])
    h_n, c_n = (ctx.op("reshape", ctx.value(final), shape=(1, batch, hidden)) for final in (h_n, c_n))
    return ctx.value(outputs), h_n, c_n


def layer_state(ctx, state, layer: int):
    """Layer ``layer``'s initial (B, H) state from the (layers, B, H) one; a constant state
    stays a constant (torch's zeros a ``full`` op, as the wavefront needs)."""
    _, batch, hidden = ctx.shape(state)
    if ctx.is_constant(state):
        return ctx.constant(state.value[layer], f"{state.name}.l{layer}")
    piece = ctx.op("slice", state, begin=[layer], end=[layer + 1], axis=[0])
    return ctx.op("reshape", piece, shape=(batch, hidden))


def stacked(ctx, finals: list):
    """Per-layer (1, B, H) final states as one (layers, B, H) tensor."""
    return finals[0] if len(finals) == 1 else ctx.op("concat", *finals, axis=0)


def _cell(inputs: int, hidden: int, batch: int, biased: bool) -> Graph:
    """One cell (x_t, h, c) -> (h_next, c_next) with torch.nn.LSTM's gates i, f, g, o."""
    b = GraphBuilder("lstm_cell")
    x_t, h, c = b.input("x_t", (batch, inputs)), b.input("h", (batch, hidden)), b.input("c", (batch, hidden))
    w_ih, w_hh = b.input("w_ih", (4 * hidden, inputs)), b.input("w_hh", (4 * hidden, hidden))
    biases = [[b.input("b_ih", (4 * hidden,))], [b.input("b_hh", (4 * hidden,))]] if biased else [[], []]
    gates = b.op("add", b.op("dense", x_t, w_ih, *biases[0]), b.op("dense", h, w_hh, *biases[1]), name="gates")
    i, f, g, o = (b.op("slice", gates, begin=k * hidden, end=(k + 1) * hidden, axis=1, name=f"gate_{gate}")
                  for k, gate in enumerate("ifgo"))
    c_next = b.op("add", b.op("mul", b.op("sigmoid", f), c), b.op("mul", b.op("sigmoid", i), b.op("tanh", g)),
                  name="c_next")
    h_next = b.op("mul", b.op("sigmoid", o), b.op("tanh", c_next), name="h_next")
    return b.build(h_next, c_next)
