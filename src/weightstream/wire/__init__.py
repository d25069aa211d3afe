"""The wire: groups that cross the host->GPU link losslessly compressed.

`codec` (the format and its pure-torch reference decoder), `triton_decoder` (the GPU decoder, bit for
bit equal to the reference), `groups` (encoding at offload, decoding every forward), `coded_load`
(compressed groups straight from checkpoint tensors).
"""
