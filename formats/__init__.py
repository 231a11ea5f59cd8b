"""Checkpoint formats and tokenizers: everything that turns files on disk into model.py's layout.

HF folders (safetensors, sharded, memory-mapped), Hub ids, GGUF files read over a memory map,
GPTQ / AWQ / compressed-tensors folders, quantize.py's own checkpoints, MXFP4 experts; the
tokenizers of every kind and chat templates rendered in jinja2's sandbox. weights.py is the door:
`weights.load(path)` -> (model, info). The root's core files never import from here.
"""
