"""Training EAGLE-3 draft heads for a local Llama target, in one process.

The target answers prompts itself (self-distillation) and its features are
captured online (`features`); a head (`head`) learns the training-time test
objective (`objective`) over a draft vocabulary (`vocab`) in `trainer`, and is
written in the published layout that sglang, vLLM and `fa3_spec.eagle` load
(`export`).
"""

from .export import ARCHITECTURE, save_head
from .head import Eagle3Head, default_aux_layers
from .trainer import TrainConfig, TrainReport, train_draft
from .vocab import DraftVocab, draft_vocab_from_counts

__all__ = ["ARCHITECTURE", "DraftVocab", "Eagle3Head", "TrainConfig", "TrainReport",
           "default_aux_layers", "draft_vocab_from_counts", "save_head", "train_draft"]
