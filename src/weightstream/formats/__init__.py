"""Formats: what weights come as and where they are read from.

`checkpoint` (safetensors shards read into final places), `hf` (`from_pretrained`), `disk` and
`diskcache` (the disk tier, raw and compressed), `fp8` (fine-grained FP8 checkpoints), `subclass`
(wrapper-subclass weights such as torchao's quantized tensors).
"""
