"""Placement: deciding, before anything moves, where each tensor of a model lives.

`blocks` (the repeated blocks that stream as groups), `entries` and `kinds` (the model's tensors and
what kind of weight each is), `layout` (each group's byte layout), `cost` (predicted time of a
forward), `plan` (the fastest placement
under a budget), `probe` and `timing` (this machine's measured profile), `shapes` (built-in model
shapes for planning), `prepare` (from a model and arguments to a placement), `experts` (a mixture of
experts' routers).
"""
