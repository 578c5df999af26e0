"""The cost model, for planning before a cluster is booked: parameters, FLOPs, memory,
communication and pipeline bubble of one RLT training step as pure functions of configs, and
the layout planner (``rlt-mega plan``) that ranks the (tp, pp, dp, ZeRO, checkpointing) layouts
that fit a cluster; the scale-up sweeps' cost side.

Nothing here allocates a tensor except ``measure``, the torch-based probes that the tests use
to check the model against what really happens. Import the pieces from their modules:
``rlt_mega.cost.costmodel.estimate``, ``rlt_mega.cost.planner.plan_layouts``."""
