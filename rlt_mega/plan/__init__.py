"""Planning before a cluster is booked: a cost model of one RLT training step (parameters,
FLOPs, memory, communication, pipeline bubble) as pure functions of configs, and a layout
planner that ranks the (tp, pp, dp, ZeRO, checkpointing) layouts that fit a cluster.

Nothing here allocates a tensor except ``measure``, the torch-based probes that the tests use
to check the model against what really happens. Import the pieces from their modules:
``rlt_mega.plan.costmodel.estimate``, ``rlt_mega.plan.planner.plan_layouts``."""
