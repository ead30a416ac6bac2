"""Errors a user of Souffle can get, each naming the problem in its message.

Every user-facing failure is one of these, never a TVM stack dump: catch
``SouffleError`` to catch them all.
"""


class SouffleError(Exception):
    """Base class of every error Souffle raises on bad input."""


class GraphError(SouffleError, ValueError):
    """A malformed graph: unknown op, dangling tensor, shape or dtype mismatch."""


class UnknownOpError(GraphError):
    """An op kind with no registered lowering."""


class WeightError(SouffleError, ValueError):
    """Weights that do not fit the model: missing, extra or mis-shaped arrays."""


class InputError(SouffleError, ValueError):
    """Run-time inputs or arguments of the wrong number, size, shape, type or dtype."""


class ExportError(SouffleError, ValueError):
    """A graph that cannot be written as ONNX: no weights, or an op kind with no export rule."""


class _UnknownNameError(SouffleError, KeyError):
    """A name lookup that failed; its message prints as written, not quoted as KeyError's would be."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class UnknownModelError(_UnknownNameError):
    """A model name or configuration that is not registered."""


class UnknownDeviceError(_UnknownNameError):
    """A device name with no model in ``analysis.device``."""


class TargetError(SouffleError, RuntimeError):
    """A compilation target that is unknown or not available on this machine."""


class ModelImportError(SouffleError, ValueError):
    """A PyTorch or ONNX model that cannot become a static souffle Graph (symbolic shapes,
    data-dependent control flow, an export that failed)."""


class UnsupportedOpError(ModelImportError):
    """An op of an imported model with no conversion rule; the message names it and where it is."""


class ValidationError(SouffleError, RuntimeError):
    """A kernel the thread-level validator (``analysis.threads``) refuses: a race, a missed or
    doubly written element, a barrier not every thread reaches, or a launch it does not fit."""


class ConfigError(SouffleError, ValueError):
    """A model configuration souffle cannot build as given: an unknown key, a value of the wrong
    type or range, or a setting (an activation, ``bias=False``) the model does not implement."""
