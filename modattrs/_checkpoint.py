"""Loading distributed checkpoints into tensors whose free dims changed size since the checkpoint was saved."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from modattrs._torch_private import set_state_dict_element

__all__ = ["ResizingLoadPlanner"]


class ResizingLoadPlanner(DefaultLoadPlanner):
    """A ``torch.distributed.checkpoint`` load planner that gives plain tensors the checkpoint's shape.

    ``dcp.load`` loads in place into the tensors of the state dict it is given, and refuses a tensor whose shape
    differs from the saved one. The data of a :class:`~modattrs.ShapedTensor` may well differ along its free dims
    (a cache saved with batch 8, a fresh model built with batch 1). With this planner, every plain (unsharded)
    tensor of the destination whose shape differs is replaced, in the state dict, by an empty one of the saved
    shape before loading; ``module.load_state_dict`` then decides, as it would for a checkpoint loaded with
    ``torch.load``: a ``ShapedTensor`` accepts new sizes along free dims, anything else raises torch's size
    mismatch. Nested state dicts (``{"model": model.state_dict(), ...}``) are handled too. Sharded tensors
    (DTensors) are left to DCP. Use it as
    ``dcp.load(state, checkpoint_id=path, planner=modattrs.ResizingLoadPlanner())``.
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)  # flattens nested state dicts
        if metadata is None:
            return
        for key, value in self.state_dict.items():
            saved = metadata.state_dict_metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata) or type(value) is not torch.Tensor:
                continue
            if saved.size != value.shape:
                resized = value.new_empty(saved.size)
                self.state_dict[key] = resized  # what DCP loads into
                if self.flatten_state_dict:  # and the caller's (nested) state dict, which it returns
                    set_state_dict_element(self.original_state_dict, self.mappings[key], resized)
