"""souffle.from_torch: small torch modules imported through torch.export, compiled, and compared
with PyTorch on the same weights and inputs; and the errors a user gets for what cannot import."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import souffle  # noqa: E402
from souffle.errors import ModelImportError, UnsupportedOpError  # noqa: E402

RTOL = ATOL = 1e-4


def _flat(value) -> list:
    return [t.detach().numpy() for t in torch.utils._pytree.tree_leaves(value)]


def check(module, inputs, target="llvm", opt_level=None, kwargs=None):
    """Import ``module`` for ``inputs``, compile it for ``target`` and compare every output with
    the module's own (in eval mode); returns the compiled model."""
    module.eval()
    example = kwargs if kwargs is not None else inputs
    graph = souffle.from_torch(module, example)
    compiled = souffle.compile(graph, target=target, opt_level=opt_level)
    arrays = {k: v.numpy() for k, v in kwargs.items()} if kwargs is not None else \
        {spec.name: x.numpy() for spec, x in zip(graph.inputs, inputs)}
    got = compiled.run(arrays)
    with torch.no_grad():
        want = _flat(module(**kwargs) if kwargs is not None else module(*inputs))
    assert len(got) == len(want)
    for name, value, expected in zip(graph.outputs, got, want):
        np.testing.assert_allclose(value, expected, rtol=RTOL, atol=ATOL, err_msg=name)
    return compiled


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, features):
        h = self.drop(nn.functional.gelu(self.fc1(features)))
        h = nn.functional.hardswish(self.fc2(h)) + nn.functional.gelu(h, approximate="tanh")
        return torch.sigmoid(self.fc3(nn.functional.silu(h))) * 2.0 - 1.0


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8, 5)

    def forward(self, image):
        y = self.pool(torch.relu(self.bn1(self.conv1(image))))
        y = nn.functional.relu6(self.bn2(self.conv2(y))) + y
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _randomized_batch_norms(module, seed=0):
    """Running statistics and affine weights away from their defaults, so eval mode matters."""
    generator = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=generator) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=generator) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=generator) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=generator) * 0.1)
    return module


class Attention(nn.Module):
    """A transformer block: multi-head self-attention, residual, LayerNorm, an FFN."""

    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 32), nn.GELU(), nn.Linear(32, hidden))

    def forward(self, x):
        batch, seq, hidden = x.shape

        def split(t):
            return t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, hidden)
        x = self.norm1(x + self.out(context))
        return self.norm2(x + self.ffn(x))


def test_mlp_names_its_input_after_forward_and_its_weights_after_the_state_dict():
    torch.manual_seed(0)
    module = MLP()
    graph = souffle.from_torch(module, (torch.randn(2, 12),))
    assert [spec.name for spec in graph.inputs] == ["features"]
    assert set(graph.params) == set(module.state_dict())
    assert module.training  # the user's module is left in the mode it was in
    check(module, (torch.randn(2, 12),))


def test_conv_net_with_eval_mode_batch_norm():
    torch.manual_seed(0)
    module = _randomized_batch_norms(ConvNet())
    graph = souffle.from_torch(module, (torch.randn(1, 3, 8, 8),))
    assert {"bn1.running_mean", "bn1.running_var"} <= set(graph.params)
    assert not any(name.endswith("num_batches_tracked") for name in graph.params)
    check(module, (torch.randn(1, 3, 8, 8),))


@pytest.mark.parametrize("opt_level", [0, 4])
def test_conv_net_as_the_persistent_kernel(opt_level):
    torch.manual_seed(1)
    compiled = check(_randomized_batch_norms(ConvNet()), (torch.randn(1, 3, 8, 8),), "llvm-persistent", opt_level)
    kernels = compiled.report().kernels
    assert kernels == 1 if opt_level == 4 else kernels > 10  # O0: one kernel per TE


def test_attention_block():
    torch.manual_seed(0)
    check(Attention(), (torch.randn(1, 6, 16),))


def test_attention_block_persistent_fuses_q_k_v():
    torch.manual_seed(0)
    compiled = check(Attention(), (torch.randn(1, 6, 16),), "llvm-persistent", 4)
    assert compiled.report().kernels == 1
    assert any(line.startswith("horizontal:") and "query, key, value (3 x [16, 16])" in line
               for line in compiled.transforms), compiled.transforms


def test_lstm_matches_torch_and_gets_the_wavefront():
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8, num_layers=3)
    check(lstm, (torch.randn(4, 1, 6),))
    compiled = check(lstm, (torch.randn(4, 1, 6),), "llvm-persistent", 4)
    assert any("3 layers x 4 steps -> one wavefront scan" in line for line in compiled.transforms), compiled.transforms


def test_lstm_batch_first_without_bias_with_initial_state():
    torch.manual_seed(0)
    lstm = nn.LSTM(5, 7, num_layers=2, bias=False, batch_first=True)
    x, h0, c0 = torch.randn(2, 3, 5), torch.randn(2, 2, 7), torch.randn(2, 2, 7)

    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = lstm

        def forward(self, x, h0, c0):
            return self.lstm(x, (h0, c0))

    graph = souffle.from_torch(WithState(), (x, h0, c0))
    assert [spec.name for spec in graph.inputs] == ["x", "h0", "c0"]
    assert set(graph.params) == {f"lstm.{k}" for k in lstm.state_dict()}
    check(WithState(), (x, h0, c0))


def test_keyword_inputs_and_integer_ids():
    torch.manual_seed(0)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(20, 8)
            self.register_buffer("offsets", torch.arange(8, dtype=torch.float32))

        def forward(self, input_ids, mask):
            scores = self.table(input_ids) + self.offsets
            return scores * mask.unsqueeze(-1).to(torch.float32) + (1.0 - mask.unsqueeze(-1).float()) * -100.0

    ids = torch.randint(0, 20, (1, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    check(Embed(), None, kwargs={"input_ids": ids, "mask": mask})


def test_unsupported_op_names_the_aten_op_the_node_and_the_source_line():
    class Cumulative(nn.Module):
        def forward(self, x):
            y = x * 2
            return torch.cumsum(y, dim=1)  # the line the error must show

    with pytest.raises(UnsupportedOpError) as caught:
        souffle.from_torch(Cumulative(), (torch.randn(2, 3),))
    message = str(caught.value)
    assert "aten.cumsum.default" in message and "node 'cumsum'" in message
    assert "test_import_torch.py" in message and "torch.cumsum(y, dim=1)" in message


def test_data_dependent_control_flow_is_refused_with_the_reason():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(ModelImportError, match="data-dependent"):
        souffle.from_torch(Branchy(), (torch.randn(3),))


def test_symbolic_shapes_are_refused_with_the_reason():
    batch = torch.export.Dim("batch", min=2, max=8)
    with pytest.raises(ModelImportError, match=r"input 'features' has a symbolic dimension 0.*static shapes"):
        souffle.from_torch(MLP(), (torch.randn(2, 12),), dynamic_shapes={"features": {0: batch}})


def test_bf16_weights_are_refused_by_name():
    with pytest.raises(ModelImportError, match=r"weight 'fc1.weight' is bfloat16.*module.float\(\)"):
        souffle.from_torch(MLP().to(torch.bfloat16), (torch.randn(2, 12, dtype=torch.bfloat16),))


def test_not_a_module_is_refused():
    with pytest.raises(ModelImportError, match="takes a torch.nn.Module"):
        souffle.from_torch(lambda x: x, (torch.randn(2),))


# -- padding, rolling and indexing (Swin Transformer's ops) ---------------------------------------
class PadRollIndex(nn.Module):
    """F.pad, torch.roll (over dims and flattened), x[:, index] by a buffer, index_select by an input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("picks", torch.tensor([[3, 0], [-1, 2]]))

    def forward(self, x, rows):
        y = nn.functional.pad(x, (1, 2, 0, 1), value=-0.5)
        y = torch.roll(y, shifts=(-1, 2), dims=(1, 2)) + torch.roll(y, 5)
        return y[:, self.picks], torch.index_select(y, 1, rows)


def test_pad_roll_and_indexing():
    x, rows = torch.randn(2, 3, 4), torch.tensor([3, 0, 3])
    graph = souffle.from_torch(PadRollIndex(), (x, rows))
    assert {"pad", "roll", "take"} <= {op.kind for op in graph.ops}
    check(PadRollIndex(), (x, rows))
    check(PadRollIndex(), (x, rows), target="llvm-persistent")


def test_as_strided_views_read_the_elements_they_name():
    class Strided(nn.Module):
        def forward(self, x):
            return torch.as_strided(x, (4, 3), (1, 4)) * 2, torch.as_strided(x * 3, (2, 2), (4, 1), 5)

    check(Strided(), (torch.randn(3, 4),))


def test_indexing_by_two_tensors_is_refused():
    class TwoIndices(nn.Module):
        def forward(self, x, i, j):
            return x[i, j]

    index = torch.tensor([0, 1])
    with pytest.raises(UnsupportedOpError, match=r"aten\.index\.Tensor.*by 2 index tensors at once"):
        souffle.from_torch(TwoIndices(), (torch.randn(3, 4), index, index))


def test_negative_padding_is_refused():
    class Crop(nn.Module):
        def forward(self, x):
            return nn.functional.pad(x, (0, -1))

    with pytest.raises(UnsupportedOpError, match=r"constant_pad_nd.*negative padding"):
        souffle.from_torch(Crop(), (torch.randn(3, 4),))


class Embeddings(nn.Module):
    """Hugging Face BERT's embeddings called without token types or a mask: positions and token
    types are gathered by constant buffers, and an attention mask of zeros is added."""

    def __init__(self):
        super().__init__()
        self.words, self.positions, self.types = nn.Embedding(20, 8), nn.Embedding(10, 8), nn.Embedding(2, 8)
        self.register_buffer("position_ids", torch.arange(10).unsqueeze(0), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, 10, dtype=torch.long), persistent=False)

    def forward(self, ids):
        length = ids.shape[1]
        x = self.words(ids) + self.types(self.token_type_ids[:, :length])
        x = x + self.positions(self.position_ids[:, 2:2 + length])
        return torch.softmax(x + torch.zeros(1, length, 8), -1)


def test_lookups_by_constant_rows_are_slices_and_adding_zeros_is_no_op():
    """Rows picked by consecutive constant indices are a slice, one row picked everywhere that
    row broadcast: no gather (whose reads the analysis widens to the whole table) but the one by
    the ids; and the mask of zeros is not added."""
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    compiled = check(Embeddings(), (ids,))
    kinds = [op.kind for op in compiled.graph.ops]
    assert kinds.count("embedding") == 1 and kinds.count("add") == 2 and "expand" in kinds, kinds


class WeightedSum(nn.Module):
    """A mixture's weighted sum over its stacked parts, as MMoE sums its experts."""

    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(6, 4) for _ in range(parts))
        self.gate = nn.Linear(6, parts)

    def forward(self, x):
        stacked = torch.stack([torch.relu(part(x)) for part in self.parts], dim=1)
        return (torch.softmax(self.gate(x), dim=1).unsqueeze(2) * stacked).sum(dim=1)


@pytest.mark.parametrize("parts", [3, 17])
def test_a_sum_over_a_short_axis_is_the_adds_of_its_slices(parts):
    """Over 3 parts the sum is element-wise adds (the weighted product then inlines into them);
    over 17, more than ``sums.SHORT_AXIS``, it stays a reduction."""
    torch.manual_seed(0)
    compiled = check(WeightedSum(parts), (torch.randn(2, 6),), target="llvm-persistent")
    kinds = [op.kind for op in compiled.graph.ops]
    assert ("sum" in kinds) == (parts == 17) and kinds.count("add") == (0 if parts == 17 else parts - 1), kinds
