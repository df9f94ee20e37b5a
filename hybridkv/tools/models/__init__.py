"""Random-weight models built locally: tiny hybrid models for tests, and how to compare
their outputs.

Nothing is downloaded. Torch and transformers are imported only to build.
"""

from hybridkv.tools.models.build import default_prompt_token_ids
from hybridkv.tools.models.compare import LOGPROB_TOLERANCE, greedy_mismatch
from hybridkv.tools.models.tiny import GroupShape, TinyModel, TinyModelKind, build_tiny_model

__all__ = [
    "LOGPROB_TOLERANCE",
    "GroupShape",
    "TinyModel",
    "TinyModelKind",
    "build_tiny_model",
    "default_prompt_token_ids",
    "greedy_mismatch",
]
