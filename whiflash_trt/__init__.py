"""whiflash-trt: lossless speculative decoding that routes every round between an EAGLE-3 and a DFlash drafter."""

__version__ = "0.1.0"
