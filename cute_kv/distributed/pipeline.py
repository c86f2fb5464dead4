"""Pipeline parallelism by layers: stage ``s`` holds the layers ``params.stage_layer_range(s)`` in its own cache and
passes each step's hidden states on to the next stage.

Every stage's manager is built from ``params.for_stage(s)`` and driven with the same calls (``broadcast_step``), so
all stages agree on pages and lookup tables; a stage's cache has ``L = n_layers_per_stage`` layers, indexed
locally (global layer ``start + i`` is the stage's layer ``i``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from cute_kv.params import KVCacheParams

# layer(hidden [T, hidden], input_row_offsets, collection, local_layer_idx) -> hidden [T, hidden]
Layer = Callable[[torch.Tensor, torch.Tensor, object, int], torch.Tensor]


class PipelineStage:
    def __init__(self, params: KVCacheParams, layers: Sequence[Layer], *, ranks: Sequence[int], group=None):
        """``layers``: this stage's layers in order (``params.n_layers_per_stage`` of them); ``ranks[s]``: the
        rank running stage ``s`` (one per stage)."""
        if params.stage_id is None:
            raise ValueError("params.stage_id must be set: build the stage from params.for_stage(stage_id)")
        if len(layers) != params.n_layers_per_stage:
            raise ValueError(f"stage {params.stage_id} holds layers {params.stage_layer_range(params.stage_id)} "
                             f"({params.n_layers_per_stage}), got {len(layers)} layer callables")
        if len(ranks) != params.pipeline_parallel_degree:
            raise ValueError(f"ranks must name one rank per stage ({params.pipeline_parallel_degree}), "
                             f"got {list(ranks)}")
        self.stage_id, self.num_stages = params.stage_id, params.pipeline_parallel_degree
        self.layers, self.ranks, self.group = list(layers), list(ranks), group

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def __call__(self, step, hidden: Optional[torch.Tensor] = None, *, hidden_size: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Run this stage on one step (``StepInputs`` of the stage's manager). The first stage takes ``hidden``
        ``[T, hidden_size]``; later stages receive it from the previous stage (give ``hidden_size`` and
        ``dtype``). Returns the stage's output, after sending it on to the next stage."""
        coll, ro = step.collections[0], step.input_row_offsets[0]
        if self.is_first:
            if hidden is None:
                raise ValueError("the first stage needs hidden")
        else:
            if hidden_size is None or dtype is None:
                raise ValueError(f"stage {self.stage_id} receives its input: pass hidden_size and dtype")
            hidden = torch.empty((sum(step.new_token_counts), hidden_size), dtype=dtype, device=coll.device)
            dist.recv(hidden, src=self.ranks[self.stage_id - 1], group=self.group)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, ro, coll, i)
        if not self.is_last:
            dist.send(hidden.contiguous(), dst=self.ranks[self.stage_id + 1], group=self.group)
        return hidden
