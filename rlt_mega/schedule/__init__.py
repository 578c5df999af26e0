"""The row schedule: which rows run which positions, in which batches, with which events.

``rows.py`` plans every rollout call (shared prefixes fork, finished rows leave, slots bound
the batch; typed events and the record the replay repeats); ``dense.py`` runs the same plan
over a learner batch (``DenseRows`` -> ``DensePlan``, the rows each dense position runs on);
``prompt_pack.py`` is the learner encoder's layout over shared prefixes. The rollout executes
these plans (rollout/executor.py), the learner replays them; ``model/`` reads the layouts they
produce (``Step``, ``DensePlan``, ``PromptPack``) as arguments and never imports this package."""
