"""Global analysis of the whole-model TE program.

``analyze(program, device)`` runs the stages in order — element-level
dependences (``dependence``), data reuse (``reuse``), per-TE cost against a
device model (``characterize``, ``device``) — and returns one
``ProgramAnalysis``. ``affine`` composes the index maps of one-relies-on-one
chains for the transformations that inline them.
"""

from analysis.program import ProgramAnalysis, analyze

__all__ = ["ProgramAnalysis", "analyze"]
