"""The model registry: names, configs, weights (given, missing, extra, mis-shaped), seeds."""

import re
import sys

import numpy as np
import pytest

from souffle import models
from souffle.errors import ConfigError, InputError, SouffleError, UnknownModelError, WeightError
from souffle.graph import Graph


def test_unknown_model_lists_the_available_ones():
    with pytest.raises(UnknownModelError, match=r"unknown model 'gpt'; available: lstm, bert, resnext, mmoe"):
        models.build("gpt")


def test_unknown_config_lists_the_available_ones():
    with pytest.raises(UnknownModelError, match=r"unknown config 'huge' for model 'lstm'; available: tiny, paper"):
        models.build("lstm", config="huge")
    with pytest.raises(UnknownModelError, match="huge"):
        models.tolerance("mmoe", "huge")


@pytest.mark.parametrize("name", models.MODELS)
def test_build_returns_a_graph_with_weights(name):
    graph = models.build(name)
    assert isinstance(graph, Graph)
    assert set(graph.weights) == set(graph.params)
    inputs = models.make_inputs(name)
    assert {spec.name: (spec.shape, spec.dtype) for spec in graph.inputs} == {
        k: (v.shape, str(v.dtype)) for k, v in inputs.items()
    }
    rtol, atol = models.tolerance(name, "tiny")
    assert 0 < rtol <= 1e-4 and 0 < atol <= 1e-4


@pytest.mark.parametrize("name", models.MODELS)
def test_structure_is_the_graph_without_weights(name):
    shape_only, weighted = models.structure(name, "tiny"), models.build(name, "tiny")
    assert shape_only.weights is None and shape_only.params == weighted.params
    assert models.structure(name, "paper").params != weighted.params  # the paper's sizes


def test_config_is_a_copy():
    models.config("lstm", "tiny")["hidden_size"] = 1
    assert models.config("lstm", "tiny")["hidden_size"] == 16


@pytest.mark.parametrize("name", models.MODELS)
def test_same_seed_same_weights_and_inputs(name):
    a, b, c = (models.build(name, seed=s).weights for s in (3, 3, 4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a)
    assert all(v.dtype == np.float32 or np.issubdtype(v.dtype, np.integer) for v in a.values())  # index buffers (Swin)
    x, x_again, y = (models.make_inputs(name, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(x[k], x_again[k]) for k in x)
    assert any(not np.array_equal(x[k], y[k]) for k in x)


def test_build_with_given_weights_uses_them():
    weights = {k: v + 1 for k, v in models.get("mmoe").init_weights(models.config("mmoe"), 7).items()}
    graph = models.build("mmoe", weights=weights)
    assert all(np.array_equal(graph.weights[k], weights[k]) for k in weights)


def test_given_weights_must_be_a_mapping_of_arrays():
    weights = models.build("mmoe").weights
    with pytest.raises(WeightError, match=re.escape(
            "weights must be a mapping from parameter name to array (a dict or a PyTorch state_dict), not a list")):
        models.build("mmoe", weights=list(weights.values()))
    with pytest.raises(WeightError, match=re.escape(
            "weight 'gates.0.bias' of 'mmoe' is a list: a weight must be a numpy array or a torch tensor")):
        models.build("mmoe", weights={**weights, "gates.0.bias": weights["gates.0.bias"].tolist()})


def test_a_weight_that_float32_cannot_hold_is_named():
    weights = models.build("mmoe").weights
    with pytest.raises(WeightError, match=re.escape(
            "weight 'gates.0.bias' of 'mmoe': 3 int64 values cannot be held exactly by float32 (the first: 16777217)")):
        models.build("mmoe", weights={**weights, "gates.0.bias": np.full(3, 2**24 + 1)})
    with pytest.raises(WeightError, match=re.escape(
            "weight 'gates.0.bias' of 'mmoe': 3 float64 values overflow float32, whose largest is 3.40282e+38 (the first: 1e+300)")):
        models.build("mmoe", weights={**weights, "gates.0.bias": np.full(3, 1e300)})
    small_ints = models.build("mmoe", weights={**weights, "gates.0.bias": np.array([1, -2, 3])})
    assert small_ints.weights["gates.0.bias"].tolist() == [1.0, -2.0, 3.0]


def test_the_graph_keeps_its_own_copy_of_given_weights():
    weights = {k: v.copy() for k, v in models.build("mmoe").weights.items()}
    graph = models.build("mmoe", weights=weights)
    before = graph.weights["gates.0.weight"].copy()
    weights["gates.0.weight"] *= 2
    assert np.array_equal(graph.weights["gates.0.weight"], before)
    with pytest.raises(ValueError, match="read-only"):
        graph.weights["gates.0.weight"] *= 2


@pytest.mark.parametrize("seed", [-1, 1.5, True, "0"])
def test_a_seed_numpy_does_not_take_is_refused(seed):
    message = re.escape(f"seed must be a non-negative integer (numpy's random generator takes no other), got {seed!r}")
    with pytest.raises(InputError, match=message):
        models.build("mmoe", seed=seed)
    with pytest.raises(InputError, match=message):
        models.make_inputs("mmoe", seed=seed)


def test_a_torch_state_dict_loads_as_it_is():
    torch = pytest.importorskip("torch")
    cfg = models.config("lstm", "tiny")
    lstm = torch.nn.LSTM(cfg["input_size"], cfg["hidden_size"], cfg["num_layers"])
    graph = models.build("lstm", weights=lstm.state_dict())
    assert np.array_equal(graph.weights["weight_hh_l2"], lstm.weight_hh_l2.detach().numpy())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_torch_state_dict_loads_exactly(dtype):
    torch = pytest.importorskip("torch")
    half = {k: torch.from_numpy(v.copy()).to(getattr(torch, dtype)) for k, v in models.build("mmoe").weights.items()}
    graph = models.build("mmoe", weights=half)
    assert all(graph.weights[k].dtype == np.float32 and np.array_equal(graph.weights[k], v.float().numpy())
               for k, v in half.items())
    inputs = models.make_inputs("mmoe")
    for got, want in zip(models.reference("mmoe", "tiny", half)(inputs), models.reference("mmoe", "tiny", graph.weights)(inputs)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", models.MODELS)
def test_missing_weight_is_named(name):
    weights = models.build(name).weights
    dropped = max(models.get(name).init_weights(models.config(name), 0))  # a state_dict entry, not an import's constant
    del weights[dropped]
    with pytest.raises(WeightError, match=re.escape(f"missing 1: '{dropped}'")):
        models.build(name, weights=weights)


def test_extra_weight_is_named():
    weights = dict(models.build("mmoe").weights, **{"experts.9.weight": np.zeros((4, 10), np.float32)})
    with pytest.raises(WeightError, match=r"unexpected 1: 'experts\.9\.weight'"):
        models.build("mmoe", weights=weights)


def test_misshaped_weight_is_named():
    weights = models.build("mmoe").weights
    weights["gates.1.weight"] = weights["gates.1.weight"].T
    with pytest.raises(WeightError, match=r"'gates\.1\.weight' of 'mmoe' has shape \(10, 3\), expected \(3, 10\)"):
        models.build("mmoe", weights=weights)


def test_keys_with_ignored_suffixes_are_dropped(monkeypatch):
    weights = dict(models.build("mmoe").weights, **{"norm.num_batches_tracked": np.array(5)})
    with pytest.raises(WeightError, match="num_batches_tracked"):
        models.build("mmoe", weights=weights)
    monkeypatch.setattr(models.get("mmoe"), "IGNORED_SUFFIXES", (".num_batches_tracked",))
    assert "norm.num_batches_tracked" not in models.build("mmoe", weights=weights).weights


def test_reference_without_torch_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SouffleError, match=r"pip install torch==2\.13\.0"):
        models.reference("lstm", "tiny", models.build("lstm").weights)


def test_a_dict_config_overrides_tiny():
    graph = models.build("bert", {"layers": 3, "seq": 4})
    assert graph.inputs[0].shape == (1, 4)
    assert sum(name.endswith("attention.self.query.weight") for name in graph.params) == 3
    assert models.config("lstm", {"hidden_size": 8}) == {**models.config("lstm", "tiny"), "hidden_size": 8}
    assert models.tolerance("bert", {"layers": 1}) == (1e-3, 1e-3)  # the loosest named config's


@pytest.mark.parametrize("name", models.MODELS)
def test_an_unknown_config_key_is_named_with_the_allowed_ones(name):
    allowed = ", ".join(sorted(models.config(name)))
    with pytest.raises(ConfigError, match=rf"unknown config key 'sizes' for model '{name}'; allowed keys: {re.escape(allowed)}"):
        models.build(name, {"sizes": 3})


@pytest.mark.parametrize("config, message", [
    ({"num_layers": 0}, "'num_layers' of model 'lstm' must be a positive integer, got 0"),
    ({"hidden_size": 2.0}, "'hidden_size' of model 'lstm' must be a positive integer, got 2.0"),
    ({"bias": 1}, "'bias' of model 'lstm' must be True or False, got 1"),
])
def test_a_config_value_of_the_wrong_kind_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        models.build("lstm", config)


def test_a_config_of_another_type_is_refused():
    with pytest.raises(ConfigError, match="must be a name .* not a int"):
        models.build("mmoe", 3)


@pytest.mark.parametrize("config", [{"bias": False}, {"initial_state": True}, {"bias": False, "initial_state": True,
                                                                               "num_layers": 2, "batch": 2}])
def test_lstm_without_biases_or_with_an_initial_state_matches_torch(config):
    pytest.importorskip("torch")
    import souffle
    from model_checks import run_poisoned

    graph = models.build("lstm", config, seed=2)
    cfg = models.config("lstm", config)
    assert [s.name for s in graph.inputs] == ["x"] + (["h0", "c0"] if cfg["initial_state"] else [])
    assert any(name.startswith("bias") for name in graph.params) == cfg["bias"]
    inputs = models.make_inputs("lstm", config, seed=1)
    want = models.reference("lstm", config, graph.weights)(inputs)
    for target in ("llvm", "llvm-persistent"):
        got = run_poisoned(souffle.compile(graph, target=target), inputs)
        for value, expected in zip(got, want):
            np.testing.assert_allclose(value, expected, rtol=1e-4, atol=1e-4, err_msg=target)


def test_a_torch_lstm_is_a_config_and_its_state_dict_loads():
    torch = pytest.importorskip("torch")
    lstm = torch.nn.LSTM(6, 10, 2, bias=False)
    graph = models.build("lstm", lstm, weights=lstm.state_dict())
    assert models.config("lstm", lstm) == {**models.config("lstm"), "input_size": 6, "hidden_size": 10,
                                           "num_layers": 2, "bias": False}
    assert set(graph.params) == {"weight_ih_l0", "weight_hh_l0", "weight_ih_l1", "weight_hh_l1"}


@pytest.mark.parametrize("options, setting", [({"bidirectional": True}, "bidirectional=True"),
                                              ({"proj_size": 4}, "proj_size=4"),
                                              ({"batch_first": True}, "batch_first=True")])
def test_a_torch_lstm_setting_the_graph_does_not_compute_is_refused(options, setting):
    torch = pytest.importorskip("torch")
    with pytest.raises(ConfigError, match=rf"nn\.LSTM\({setting}\) is not implemented"):
        models.build("lstm", torch.nn.LSTM(6, 10, 2, **options))
