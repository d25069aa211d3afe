"""The engine: what runs during every forward of an offloaded model.

`schedule` (the slot/group state machine, pure logic), `ops` (the two custom ops that carry it
through a forward, eager and compiled), `transfer` (host->GPU copies on a side stream), `host` (the
exact-size pinned arena), `uva` (zero-copy views), `streamed`
(the block subclasses whose forward waits and releases), `watch` (tensors a model writes),
`replay` (CUDA graph capture and replay), `guards` (everything a user does besides calling the model),
`experts` (a mixture of experts' expert bytes read per token, counted on request).
"""
