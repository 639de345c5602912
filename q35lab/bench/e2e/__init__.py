"""Whole training steps of Qwen3.5 + PEFT, patched or not (``python -m q35lab.e2e``; see ``cli``).

* ``model``: the configs at their real sizes (``config``, ``SIZES``) and the LoRA model (``build``);
* ``variants``: what a step trains (``VARIANTS``, ``prepare``);
* ``peers``: where peers' training recipes are found (a checkout's ``benchmarks/peers/``, not the wheel);
* ``timer``: device time of regions of a step (``RegionTimer``: the delta-rule core, in_proj);
* ``step``: a training step and its measurement (``train_step``, ``measure``, ``measure_layer``);
* ``packing``: batches of an SFT length mix, packed into one row or padded (``sft_batch``);
* ``memory``: what is alive at a step's peak (``memory_at_peak``, ``peak_breakdown``);
* ``floor``: what a step's work costs at this GPU's rates (``step_floor``, ``floor_inputs``);
* ``kernels``: its device time by kernel category and source (``categorize``, ``breakdown``);
* ``cli``: one process per variant, rows merged into the CSV (``main``, ``merge_rows``).
"""

from .cli import main, merge_rows
from .floor import floor_inputs, step_floor
from .kernels import CATEGORIES, breakdown, categorize, profile_step
from .memory import SOURCES, allocation_source, memory_at_peak, out_of_memory_note, peak_breakdown
from .model import SIZES, build, config
from .packing import pack_sequences, packed_batch, padded_batches, sft_batch, sft_lengths
from .step import IN_PROJ_NAMES, measure, measure_layer, tokens, toy_corpus, train_step
from .timer import CORE_FUNCTIONS, RegionTimer
from .variants import ALL_FLAGS, VARIANTS, prepare

__all__ = ["ALL_FLAGS", "CATEGORIES", "CORE_FUNCTIONS", "IN_PROJ_NAMES", "SIZES", "SOURCES", "VARIANTS", "RegionTimer",
           "allocation_source", "breakdown", "build", "categorize", "config", "floor_inputs", "main", "measure",
           "measure_layer", "memory_at_peak", "merge_rows", "out_of_memory_note", "pack_sequences", "packed_batch",
           "padded_batches", "peak_breakdown", "prepare",
           "profile_step", "sft_batch", "sft_lengths", "step_floor", "tokens", "toy_corpus", "train_step"]
