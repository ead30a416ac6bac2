"""A stacked LSTM with torch.nn.LSTM's semantics and state_dict (the paper's LSTM: 10 x 100 cells).

The cells are never unrolled: layer 0 is a scan over time whose body is one cell, and layers
1..L-1 are a scan over layers (each iteration binding its own layer's weights) whose body holds
the scan over time. So the graph has one cell however many layers and steps the config has,
and compiles as fast as one cell.

``{"bias": False}`` builds torch.nn.LSTM(bias=False); ``{"initial_state": True}`` adds the inputs
``h0`` and ``c0`` (layers, batch, hidden), torch's ``hx``, instead of a zero initial state.
"""

from __future__ import annotations

import numpy as np

from souffle.errors import ConfigError
from souffle.graph import Graph, GraphBuilder
from souffle.models.torch_interop import load_weights

CONFIGS = {
    "tiny": {"input_size": 12, "hidden_size": 16, "num_layers": 3, "steps": 5, "batch": 1, "bias": True,
             "initial_state": False},
    "paper": {"input_size": 256, "hidden_size": 256, "num_layers": 10, "steps": 100, "batch": 1, "bias": True,
              "initial_state": False},
}

IGNORED_SUFFIXES = ()

TOLERANCE = {"tiny": (1e-4, 1e-4), "paper": (1e-4, 1e-4)}
# torch.autocast has no float16 CPU LSTM (oneDNN): the fp16 and bf16 references round the weights instead
AUTOCAST = False


def config_from_object(obj):
    """The config of a ``torch.nn.LSTM`` module (None for another object); steps and batch are
    not part of it and keep tiny's values. What the graph does not compute is refused."""
    if type(obj).__name__ != "LSTM" or not hasattr(obj, "proj_size"):
        return None
    for key, supported in (("bidirectional", False), ("proj_size", 0), ("batch_first", False)):
        if getattr(obj, key) != supported:
            raise ConfigError(f"lstm: nn.LSTM({key}={getattr(obj, key)!r}) is not implemented (only {key}={supported!r})")
    return {"input_size": obj.input_size, "hidden_size": obj.hidden_size, "num_layers": obj.num_layers,
            "bias": bool(obj.bias)}


def _kinds(cfg: dict) -> tuple[str, ...]:
    return ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if cfg["bias"] else ())


def _layer_shapes(cfg: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """torch.nn.LSTM's parameter shapes for one layer, gates stacked in order i, f, g, o."""
    hidden = cfg["hidden_size"]
    inputs = cfg["input_size"] if layer == 0 else hidden
    shapes = {"weight_ih": (4 * hidden, inputs), "weight_hh": (4 * hidden, hidden),
              "bias_ih": (4 * hidden,), "bias_hh": (4 * hidden,)}
    return {f"{kind}_l{layer}": shapes[kind] for kind in _kinds(cfg)}


def init_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Uniform(-1/sqrt(H), 1/sqrt(H)) like torch.nn.LSTM, so gates stay in their active range."""
    rng = np.random.default_rng(seed)
    bound = 1.0 / np.sqrt(cfg["hidden_size"])
    weights = {}
    for layer in range(cfg["num_layers"]):
        for name, shape in _layer_shapes(cfg, layer).items():
            weights[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
    return weights


def make_inputs(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (cfg["steps"], cfg["batch"], cfg["input_size"])
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    if cfg["initial_state"]:
        state = (cfg["num_layers"], cfg["batch"], cfg["hidden_size"])
        inputs.update({name: rng.standard_normal(state).astype(np.float32) for name in ("h0", "c0")})
    return inputs


def _cell(input_size: int, hidden: int, batch: int, biased: bool = True) -> Graph:
    """One LSTM cell: (x_t, h, c) -> (h_next, c_next); weights are inputs so that a time scan
    binds them as invariants (the same weights at every step)."""
    b = GraphBuilder("lstm_cell")
    x_t = b.input("x_t", (batch, input_size))
    h = b.input("h", (batch, hidden))
    c = b.input("c", (batch, hidden))
    w_ih = b.input("w_ih", (4 * hidden, input_size))
    w_hh = b.input("w_hh", (4 * hidden, hidden))
    biases = ([b.input("b_ih", (4 * hidden,))], [b.input("b_hh", (4 * hidden,))]) if biased else ([], [])
    gates = b.op("add", b.op("dense", x_t, w_ih, *biases[0]), b.op("dense", h, w_hh, *biases[1]), name="gates")
    i, f, g, o = (
        b.op("slice", gates, begin=k * hidden, end=(k + 1) * hidden, axis=1, name=f"gate_{gate}")
        for k, gate in enumerate("ifgo")
    )
    c_next = b.op(
        "add",
        b.op("mul", b.op("sigmoid", f), c),
        b.op("mul", b.op("sigmoid", i), b.op("tanh", g)),
        name="c_next",
    )
    h_next = b.op("mul", b.op("sigmoid", o), b.op("tanh", c_next), name="h_next")
    return b.build(h_next, c_next)


def _time_scan(b: GraphBuilder, cell: Graph, cfg: dict, sequence: str, weights: tuple[str, ...], name: str,
               state: tuple[str, str] | None = None):
    """Run ``cell`` over ``sequence`` from ``state`` (h, c), or from a zero state; returns
    (final h, final c, all h)."""
    if state is None:
        zeros = b.op("full", shape=(cfg["batch"], cfg["hidden_size"]), value=0.0, dtype="float32",
                     name=f"{name}.zeros")
        state = (zeros, zeros)
    (h_final, c_final), (outputs,) = b.scan(
        cell,
        cfg["steps"],
        name=name,
        carry=[("h", "h_next", state[0]), ("c", "c_next", state[1])],
        xs=[("x_t", sequence)],
        ys=["h_next"],
        invariants=list(zip(("w_ih", "w_hh", "b_ih", "b_hh"), weights)),
    )
    return h_final, c_final, outputs


def _layer_body(cfg: dict) -> Graph:
    """Layers 1..L-1: the whole (T, B, H) sequence in, the next layer's sequence out, plus that
    layer's final h and c (stacked over layers by the enclosing scan)."""
    hidden, batch = cfg["hidden_size"], cfg["batch"]
    b = GraphBuilder("lstm_layer")
    sequence = b.input("sequence", (cfg["steps"], batch, hidden))
    weights = tuple(b.param(kind, shape) for kind, shape in zip(_kinds(cfg), _layer_shapes(cfg, 1).values()))
    state = (b.input("h0", (batch, hidden)), b.input("c0", (batch, hidden))) if cfg["initial_state"] else None
    cell = _cell(hidden, hidden, batch, cfg["bias"])
    h_final, c_final, outputs = _time_scan(b, cell, cfg, sequence, weights, "time", state)
    return b.build(outputs, h_final, c_final)


def build_graph(cfg: dict, weights: dict[str, np.ndarray]) -> Graph:
    """Outputs (output, h_n, c_n) as torch.nn.LSTM returns them, from input ``x`` (T, B, I)."""
    hidden, batch, layers = cfg["hidden_size"], cfg["batch"], cfg["num_layers"]
    b = GraphBuilder("lstm")
    x = b.input("x", (cfg["steps"], batch, cfg["input_size"]))
    initial = [b.input(name, (layers, batch, hidden)) for name in ("h0", "c0")] if cfg["initial_state"] else []
    for layer in range(layers):
        for name, shape in _layer_shapes(cfg, layer).items():
            b.param(name, shape)

    def layer_state(begin: int, end: int, name: str):
        """The initial (h, c) of layers begin..end-1 (L', B, H), for a scan over those layers."""
        if not initial:
            return None
        return tuple(b.op("slice", state, begin=begin, end=end, axis=0, name=f"{name}.{kind}")
                     for state, kind in zip(initial, ("h0", "c0")))

    layer0 = tuple(f"{kind}_l0" for kind in _kinds(cfg))
    cell0 = _cell(cfg["input_size"], hidden, batch, cfg["bias"])
    state0 = layer_state(0, 1, "layer0")
    if state0:
        state0 = tuple(b.op("reshape", piece, shape=(batch, hidden)) for piece in state0)
    h_final, c_final, output = _time_scan(b, cell0, cfg, x, layer0, "layer0", state0)
    h_n = b.op("reshape", h_final, shape=(1, batch, hidden), name="layer0.h_n")
    c_n = b.op("reshape", c_final, shape=(1, batch, hidden), name="layer0.c_n")
    if layers > 1:
        (output,), (h_rest, c_rest) = b.scan(
            _layer_body(cfg),
            layers - 1,
            name="layers",
            carry=[("sequence", "time.h_next", output)],
            xs=list(zip(("h0", "c0"), layer_state(1, layers, "layers"))) if initial else [],
            ys=["time.h", "time.c"],
            params={kind: [f"{kind}_l{layer}" for layer in range(1, layers)] for kind in _kinds(cfg)},
        )
        h_n = b.op("concat", h_n, h_rest, axis=0, name="h_n")
        c_n = b.op("concat", c_n, c_rest, axis=0, name="c_n")
    return b.build(output, h_n, c_n).with_weights(weights)


def torch_module(cfg: dict, weights: dict[str, np.ndarray]):
    """torch.nn.LSTM loaded with ``weights``, as a module taking the graph's inputs by name
    (x, and h0 and c0 when the config has an initial state) and returning (output, h_n, c_n)."""
    import torch

    class LSTM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(cfg["input_size"], cfg["hidden_size"], cfg["num_layers"], bias=cfg["bias"])

        def forward(self, x, h0=None, c0=None):
            output, (h_n, c_n) = self.lstm(x, None if h0 is None else (h0, c0))
            return output, h_n, c_n

    module = LSTM()
    load_weights(module.lstm, weights)
    return module


def torch_reference(cfg: dict, weights: dict[str, np.ndarray]):
    """inputs -> [output, h_n, c_n], computed by ``torch_module``."""
    import torch

    module = torch_module(cfg, weights)

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        tensors = {name: torch.from_numpy(np.asarray(value, dtype=np.float32)) for name, value in inputs.items()}
        with torch.no_grad():
            return [output.float().numpy() for output in module(**tensors)]

    return run
