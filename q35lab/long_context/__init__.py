"""Long-context memory for Qwen3.5 LoRA training: a sequence-tiled MLP and GatedDeltaNet, decoder-layer
checkpoints offloaded to host memory, and the memory model and planner that say how long a step fits.

Most users need one switch, ``apply_to_qwen3_5(model, long_context=T)``, which calls
``plan_long_context``; the rest is for those who place the options themselves. The other way round, where a step
fits with memory to spare, ``apply_to_qwen3_5(model, checkpointing="auto", tokens_per_step=T)`` checkpoints only the
decoder layers the memory needs (``plan_checkpointing``, ``run_without_checkpointing``).
"""

from ..hf.modules import MLP_CLASSES
from .checkpointing import planned_layers, restore_checkpointing, run_without_checkpointing
from .gated_delta_net import (
    TiledGDNForward,
    TiledGDNLayerForward,
    tile_gated_delta_net,
    tile_gated_delta_net_layer,
    tile_gated_delta_nets,
    tiled_gated_delta_net,
    tiled_gated_delta_net_layer,
    untile_gated_delta_net,
    untile_gated_delta_net_layer,
    untile_gated_delta_nets,
)
from .memory import H200_USABLE_BYTES, GiB, KiB, MemoryModel, bytes_per_token, lora_parameter_count, parameter_count
from .offload import (
    HOST_CHUNK_BYTES,
    HOST_RESERVE_BYTES,
    MIN_OFFLOAD_BYTES,
    CheckpointOffloader,
    default_host_reserve,
    enable_checkpointing,
    has_long_context_options,
    host_memory_available,
    offload_decoder_layers,
    offloaded_checkpoints,
    restore_decoder_layers,
)
from .planner import (
    CHECKPOINT_MARGIN,
    PLAN_TILES,
    CheckpointPlan,
    LongContextPlan,
    checkpoint_budget,
    checkpoint_order,
    expandable_segments,
    longest_planned_step,
    plan_checkpointing,
    plan_long_context,
    plan_offload_layers,
    usable_gpu_bytes,
)
from .tiles import (
    TiledMLPForward,
    TiledMLPFunction,
    tile_mlp,
    tile_mlps,
    tile_only_above,
    tiled_mlp,
    untile_mlp,
    untile_mlps,
)

__all__ = ["plan_long_context", "longest_planned_step", "LongContextPlan", "usable_gpu_bytes", "bytes_per_token",
           "MemoryModel", "plan_offload_layers", "tile_only_above", "offload_decoder_layers", "restore_decoder_layers",
           "CheckpointOffloader", "offloaded_checkpoints", "enable_checkpointing", "default_host_reserve",
           "host_memory_available", "HOST_RESERVE_BYTES", "H200_USABLE_BYTES", "plan_checkpointing", "CheckpointPlan"]


def __dir__() -> list[str]:
    return sorted(__all__)
