"""Random-weight models built locally: tiny hybrid models for tests, real models' shapes
for benchmarks and the demo, and how to compare their outputs.

Nothing is downloaded. Torch and transformers are imported only to build.
"""

from hybridkv.tools.models.build import GroupShape, LocalModel, default_prompt_token_ids
from hybridkv.tools.models.compare import LOGPROB_TOLERANCE, greedy_mismatch
from hybridkv.tools.models.shapes import ShapeKind, ShapeModel, build_shape_model
from hybridkv.tools.models.tiny import TinyModel, TinyModelKind, build_tiny_model

__all__ = [
    "LOGPROB_TOLERANCE",
    "GroupShape",
    "LocalModel",
    "ShapeKind",
    "ShapeModel",
    "TinyModel",
    "TinyModelKind",
    "build_shape_model",
    "build_tiny_model",
    "default_prompt_token_ids",
    "greedy_mismatch",
]
