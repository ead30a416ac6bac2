"""Importers: a user's PyTorch module (``from_torch``, through torch.export) or ONNX model
(``from_onnx``) as a souffle ``Graph`` whose weights keep the model's own names.

Each importer walks its model's graph once and hands every node to one conversion rule, kept
in one table per source (``aten`` for torch.export's ATen ops, ``onnx_rules`` for ONNX op
types): adding a source op touches that one file. The rules map onto the op registry
(``souffle.ops``); they add no op kinds of their own.
"""
