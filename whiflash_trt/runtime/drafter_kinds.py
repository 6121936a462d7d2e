"""The drafter registry: each kind's proposer. A learned kind is built over its checkpoint's model, its KV pool and
the target; a free kind over nothing but how the target verifies (device, dtype, GGML blocks or not), so every engine
has it."""
from __future__ import annotations

from whiflash_trt.config import DFLASH, EAGLE3, SUFFIX
from whiflash_trt.runtime.drafters import DFlashProposer, Eagle3Proposer
from whiflash_trt.runtime.suffix_drafter import SuffixProposer

LEARNED = {EAGLE3: Eagle3Proposer, DFLASH: DFlashProposer}   # name -> proposer(model, pool, target, union)
FREE = {SUFFIX: SuffixProposer}                              # name -> proposer(device, dtype, native)
