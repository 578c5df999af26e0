"""The parallel layout: one object that validates (tp, pp, dp) and builds every process group once.

Rank layout (Megatron's default order "tp-dp-pp", tensor-parallel fastest)::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the ranks of a tensor-parallel group are neighbours (one node), a pipeline runs across
nodes, and data-parallel replicas sit between. The groups come from megatron-core's
``parallel_state`` (its vocab-parallel cross-entropy reads the tensor-parallel group from
there); our code never asks ``parallel_state`` for a group: every component receives this
object and takes the group it needs from it.

Validation happens before any process group exists and depends only on the configuration and
the world size, so every rank raises the same :class:`ConfigError` and nobody waits in a
collective for a rank that already gave up. The validating functions (``split_layers``,
``check_tp``, ``micro_batch_plan``, ``resolve_layout``) are pure and shared with the planner
(rlt_mega/plan), so ``rlt-mega plan`` accepts exactly the layouts the trainers run.

The layout always exists: one process is :meth:`ParallelDims.single`, a layout of one rank
without any torch.distributed process group, on which every collective below (barrier,
all-reduce, sharing within a replica, gathers and sums over data-parallel replicas) is the
identity.
Nothing above this module asks whether a run is distributed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from rlt_mega.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from rlt_mega.log import get_logger

log = get_logger(__name__)


def split_layers(num_layers: int, num_stages: int, pp_split: Optional[list] = None) -> list[range]:
    """Layers of each pipeline stage: contiguous ranges; an even split unless ``pp_split`` gives
    the count per stage. Earlier stages get the remainder of an uneven even split (stage 0 also
    runs the embedding and the recurrence input, the last stage the head, so neither end is
    obviously lighter; an explicit split is the way to balance a real run)."""
    if pp_split is not None:
        counts = list(pp_split)
        if len(counts) != num_stages:
            raise ConfigError(f"parallel.pp_split={counts} has {len(counts)} entries but parallel.pp={num_stages}: "
                              "give one layer count per pipeline stage")
        if any((not isinstance(c, int)) or c < 1 for c in counts):
            raise ConfigError(f"parallel.pp_split={counts}: every stage needs at least one layer "
                              "(a stage with no layers would only forward activations)")
        if sum(counts) != num_layers:
            raise ConfigError(f"parallel.pp_split={counts} sums to {sum(counts)} but model.n_layers={num_layers}: "
                              "the counts must add up to the number of layers")
    else:
        if num_stages > num_layers:
            raise ConfigError(f"parallel.pp={num_stages} stages but model.n_layers={num_layers}: some stages would "
                              f"have no layers; use parallel.pp <= {num_layers}")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def micro_batch_plan(micro_batch_size: int, grad_accum: int, num_in_flight: int) -> tuple[int, int]:
    """How a step's ``grad_accum`` batches of ``micro_batch_size`` rows become rounds of
    ``num_in_flight`` (M, parallel.micro_batches) pipeline micro-batches in flight -> (pieces
    per batch, rounds).

    M <= grad_accum: each batch is one pipeline micro-batch, grad_accum / M rounds (the
    Megatron way: mbs=1, grad_accum=8, M=8 is one round of 8). M > grad_accum: one round, each
    batch cut into M / grad_accum pieces."""
    M = num_in_flight
    if M <= grad_accum:
        if grad_accum % M:
            raise ConfigError(f"train.grad_accum={grad_accum} is not a multiple of parallel.micro_batches={M}: the "
                              f"step's micro-batches run in rounds of {M}; choose grad_accum as a multiple of {M}")
        return 1, grad_accum // M
    pieces = M // grad_accum
    if M % grad_accum or micro_batch_size % pieces:
        raise ConfigError(f"parallel.micro_batches={M} cannot be formed from train.grad_accum={grad_accum} "
                          f"micro-batches of train.micro_batch_size={micro_batch_size} rows: with M > grad_accum, "
                          "M must be a multiple of grad_accum and M / grad_accum must divide micro_batch_size")
    return pieces, 1


def check_tp(model: ModelConfig, tp: int) -> None:
    """Every dimension tensor parallelism splits must divide by ``tp`` (heads, key/value heads,
    the vocabulary of the vocab-parallel embedding and head, the MLP's hidden size)."""
    checks = [(model.n_heads, "model.n_heads"), (model.n_kv_heads, "model.n_kv_heads"),
              (model.vocab_size, "model.vocab_size"), (model.ffn_hidden, "model.ffn_hidden")]
    for value, name in checks:
        if value % tp != 0:
            hint = ""
            if name == "model.vocab_size":
                # Padding would add logits the data never targets; we ask for an explicit size instead.
                hint = f" (e.g. {tp * ((value + tp - 1) // tp)}; the vocabulary is not padded implicitly)"
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp}: tensor parallelism splits it "
                              f"across ranks; choose a multiple of {tp}{hint} or a smaller tp")


def resolve_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int,
                   train: Optional[TrainConfig] = None) -> tuple[int, int, int]:
    """Checks the layout against the world size and the model; returns (tp, pp, dp). ``train``:
    anything with ``micro_batch_size`` and ``grad_accum`` (a TrainConfig, or the engine's
    parallel.engine.EngineConfig, which GRPO derives) to check the step's micro-batch plan.

    Pure arithmetic on the configuration: it runs (and fails identically) on every rank before
    any process group is created, and ``rlt-mega plan`` runs the same function.
    """
    tp, pp = parallel.tp, parallel.pp
    if world_size % (tp * pp) != 0:
        raise ConfigError(f"parallel.tp * parallel.pp = {tp} * {pp} = {tp * pp} does not divide the world size "
                          f"{world_size}: launch a multiple of {tp * pp} processes or change tp/pp")
    dp = parallel.dp if parallel.dp is not None else world_size // (tp * pp)
    if tp * pp * dp != world_size:
        raise ConfigError(f"parallel.tp * parallel.pp * parallel.dp = {tp} * {pp} * {dp} = {tp * pp * dp} but the "
                          f"world size is {world_size}: set parallel.dp={world_size // (tp * pp)} (or null) or launch "
                          f"{tp * pp * dp} processes")
    check_tp(model, tp)
    if pp > 1 and model.arch != "rlt":
        raise ConfigError(f"parallel.pp={pp} with model.arch={model.arch}: pipeline parallelism runs the RLT's "
                          "ring schedule (an encoder pass, then a decoder ring over positions); the dense and "
                          "looped baselines are not split into stages. Use parallel.pp=1 with tensor "
                          "parallelism (parallel.tp) and ZeRO (parallel.zero_stage) instead")
    split_layers(model.n_layers, pp, parallel.pp_split)
    if parallel.pp_split is not None and pp == 1 and list(parallel.pp_split) != [model.n_layers]:
        raise ConfigError("parallel.pp_split is only meaningful with parallel.pp > 1")
    if parallel.zero_stage == 3 and pp > 1:
        raise ConfigError("parallel.zero_stage=3 with parallel.pp > 1 is not supported: ZeRO-3 gathers parameters "
                          "inside forward with collectives over all ranks and deadlocks across pipeline stages "
                          "(DeepSpeed's own pipeline engine refuses it too). Use zero_stage 1 or 2 with pipeline "
                          "parallelism, or pp=1 with ZeRO-3")
    if train is not None:
        micro_batch_plan(train.micro_batch_size, train.grad_accum, parallel.micro_batches)
        if train.dtype == "bf16" and parallel.zero_stage == 0 and parallel.grad_accum_dtype == "fp32":
            raise ConfigError("parallel.grad_accum_dtype=fp32 with train.dtype=bf16 needs ZeRO: DeepSpeed accumulates "
                              "bf16 gradients in fp32 only with parallel.zero_stage >= 1 (ZeRO-1 partitions the "
                              "optimizer state and computes the same update); or set parallel.grad_accum_dtype=bf16 "
                              "(or null) to accumulate in bf16")
    return tp, pp, dp


def resolve_device(name: str) -> torch.device:
    """train.device -> the device of one process ("auto": cuda when available, else cpu); a CUDA
    device without CUDA is refused here as under a launcher (``rank_device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(_no_cuda(name))
    return torch.device(name)


def _no_cuda(device: str) -> str:
    return (f"train.device={device} but CUDA is not available here (torch {torch.__version__}, "
            f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}): use train.device=cpu or auto")


def _env_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank(world_size: int) -> int:
    """This process's rank on its node (LOCAL_RANK). A launcher that runs several ranks without
    setting it would put every rank on the same GPU, so that is an error."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        if world_size > 1:
            raise ConfigError(f"LOCAL_RANK is not set but WORLD_SIZE={world_size} ranks run: each rank needs its "
                              "rank on the node to pick its device. Launch with torchrun or the deepspeed launcher "
                              "(both set it; launch/slurm.sbatch runs torchrun under srun), or export "
                              "LOCAL_RANK=$SLURM_LOCALID under a bare srun")
        return 0
    try:
        rank = int(value)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={value!r} is not an integer") from None
    if rank < 0:
        raise ConfigError(f"LOCAL_RANK={rank} is negative")
    return rank


def rank_device(device: str, local: int) -> torch.device:
    """train.device -> this rank's device: "auto" is cuda:LOCAL_RANK when CUDA is available, else
    the CPU; "cuda" is cuda:LOCAL_RANK; "cuda:N" pins this process to GPU N (one rank per node)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not device.startswith("cuda"):
        raise ConfigError(f"train.device={device}: distributed runs use cpu (gloo) or cuda (nccl)")
    if not torch.cuda.is_available():
        raise ConfigError(_no_cuda(device))
    count = torch.cuda.device_count()
    if device == "cuda":
        index = local
    else:
        index = int(device.split(":")[1])
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if ranks_here > 1:
            raise ConfigError(f"train.device={device} puts every rank of this node on GPU {index}, but "
                              f"LOCAL_WORLD_SIZE={ranks_here} ranks run here: use train.device=cuda (each rank "
                              "takes cuda:LOCAL_RANK)")
    if index >= count:
        raise ConfigError(f"this rank wants cuda:{index} (train.device={device}, LOCAL_RANK={local}) but "
                          f"{count} GPU(s) are visible: launch at most {count} ranks per node or fix "
                          "CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def _check_backend(backend: str, dev: torch.device, device: str) -> str:
    """The process-group backend, refused where it cannot drive ``dev``."""
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError(f"parallel.backend=nccl needs CUDA devices, but this rank runs on {dev} "
                          f"(train.device={device}): use parallel.backend=gloo (or null) on the CPU")
    if backend == "gloo" and dev.type == "cuda":
        raise ConfigError("parallel.backend=gloo with CUDA devices: gloo's point-to-point needs CPU tensors; "
                          "use parallel.backend=nccl (or null)")
    return backend


def init_distributed(backend: Optional[str] = None, device: str = "auto", timeout_s: float = 1800.0,
                     deterministic: bool = True, replica_size: Optional[int | Sequence[int]] = None
                     ) -> tuple[str, torch.device]:
    """Initialises torch.distributed from the launcher's environment (torchrun, the deepspeed
    launcher and srun+torchrun all set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT); a
    process started without a launcher becomes a world of one. NCCL for CUDA devices, gloo for
    the CPU. Returns (backend, device).

    ``replica_size`` n (GRPO's sampler and learner roles, parallel/roles.py): torch.distributed's
    world is this rank's replica, launcher ranks [q n, (q + 1) n) for q = RANK // n, ranked
    RANK mod n, so that each replica builds its layout (and DeepSpeed its world collectives) as
    a job of its own; a sequence of sizes: consecutive replicas of those sizes (a data-parallel
    learner's replica is larger than a sampler's). ``launcher_store()`` is then the launcher's
    store, which the roles' own groups between replicas are made from."""
    world = _env_world_size()
    dev = rank_device(device, local_rank(world))
    backend = _check_backend(backend or ("nccl" if dev.type == "cuda" else "gloo"), dev, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if deterministic:
        from rlt_mega.determinism import set_nccl_environment

        set_nccl_environment()  # before the first communicator
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python` run: a world of one on a free local port
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        warn_if_restarts_cannot_work()
        # device_id binds NCCL to this rank's GPU and creates communicators eagerly (new groups
        # by splitting the world's), so no communicator is first created inside a schedule.
        extra = {"device_id": dev} if dev.type == "cuda" else {}
        timeout = datetime.timedelta(seconds=timeout_s)
        if replica_size is None:
            dist.init_process_group(backend=backend, timeout=timeout, **extra)
        else:
            global _LAUNCHER_STORE
            # One connection to the launcher's store per process, kept: a process that runs the
            # roles again (the tests' workers) keys each run by its generation.
            store, rank, generation = _LAUNCHER_STORE or (*next(dist.rendezvous("env://", timeout=timeout))[:2], 0)
            _LAUNCHER_STORE = (store, rank, generation + 1)
            replica, index, size = replica_of(rank, replica_size)
            dist.init_process_group(backend=backend, timeout=timeout, rank=index, world_size=size,
                                    store=dist.PrefixStore(f"{generation + 1}/replica{replica}/", store), **extra)
            # Every rank of the new world has connected before any may leave it: a world made and
            # left at once (an idle replica's) otherwise closes its sockets while a peer is still
            # connecting, and gloo fails there with "connectFullMesh ... Connection closed by peer".
            dist.barrier()
    return backend, dev


_LAUNCHER_STORE: Optional[tuple] = None


def replica_of(rank: int, replica_size: int | Sequence[int]) -> tuple[int, int, int]:
    """Launcher rank -> (its replica, its rank there, the replica's size), for replicas of
    ``replica_size`` ranks each, or of the sizes listed, consecutive."""
    if isinstance(replica_size, int):
        return (*divmod(rank, replica_size), replica_size)
    offset = 0
    for replica, size in enumerate(replica_size):
        if rank < offset + size:
            return replica, rank - offset, size
        offset += size
    raise ValueError(f"launcher rank {rank} lies beyond the replicas {list(replica_size)}")


def launcher_store() -> tuple:
    """(the launcher's store, this process's launcher rank, the generation: how many times this
    process initialised a world per replica) of a world initialised per replica
    (``init_distributed(replica_size=...)``)."""
    if _LAUNCHER_STORE is None:  # the callers' order, not a user error
        raise RuntimeError("torch.distributed was not initialised per replica (init_distributed(replica_size=...))")
    return _LAUNCHER_STORE


def warn_if_restarts_cannot_work() -> None:
    """torchrun --max-restarts with the agent's shared TCPStore: the restarted ranks would read
    the dead ranks' addresses from the previous attempt and fail to connect
    (pytorch/pytorch#135712). Said once, at start-up, where it can still be fixed."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        log.warning("torchrun --max-restarts=%d with a shared rendezvous store: restarts will fail to "
                    "connect. Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and use the c10d rendezvous "
                    "(--standalone or --rdzv-backend c10d), as launch/torchrun.sh does", restarts)


def free_port() -> int:
    """A TCP port free on this host now (for a world of one, and the tests' launchers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _channel_groups(tp: int, pp: int, dp: int, rank: int, device: torch.device) -> dict:
    """One process group per direction between two stages of every pipeline (p2p.py): created
    collectively, every rank in the same order; returns the groups of my pipeline. On NCCL each
    is then initialised by a barrier, in the same global order on every rank (so none waits
    for a rank that is still in an earlier one), so that no communicator is first created
    inside a schedule, where its two ranks could be waiting for each other elsewhere."""
    from rlt_mega.parallel.p2p import pipeline_channels

    mine, order = {}, []
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            stages = [tp_rank + tp * (dp_rank + dp * s) for s in range(pp)]
            for src, dst, lane in pipeline_channels(pp):
                group = dist.new_group([stages[src], stages[dst]])
                if rank in (stages[src], stages[dst]):
                    mine[(src, dst, lane)] = group
                    order.append(group)
    if device.type == "cuda":
        for group in order:
            dist.barrier(group=group, device_ids=[device.index])
    return mine


@dataclass
class ParallelDims:
    """The layout and its process groups. Built once per process: by :meth:`build` under a
    launcher (or whenever tensor/pipeline parallelism or ZeRO is asked for), by :meth:`single`
    for one process without torch.distributed."""

    tp: int
    pp: int
    dp: int
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: Optional[str]  # None: no process group (the single-process layout)
    stage_layers: list  # list[range]: the layers of every stage
    tp_group: object = field(repr=False, default=None)
    pp_group: object = field(repr=False, default=None)
    dp_group: object = field(repr=False, default=None)
    mp_group: object = field(repr=False, default=None)  # tp x pp: "model parallel" in DeepSpeed's words
    embed_group: object = field(repr=False, default=None)  # first + last stage (tied embeddings); None elsewhere
    pp_ranks: list = field(default_factory=list)  # global rank of every stage of my pipeline
    dp_ranks: list = field(default_factory=list)
    mp_ranks: list = field(default_factory=list)  # global ranks of my model replica (tp x pp), ascending
    # (src stage, dst stage, lane) -> the process group of that channel of my pipeline (p2p.py)
    p2p_groups: dict = field(repr=False, default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls, model: ModelConfig, device: str | torch.device = "auto") -> "ParallelDims":
        """One process holding the whole model: no process group, every collective the identity."""
        dev = resolve_device(device) if isinstance(device, str) else device
        return cls(tp=1, pp=1, dp=1, rank=0, world_size=1, tp_rank=0, pp_rank=0, dp_rank=0, device=dev,
                   backend=None, stage_layers=[range(model.n_layers)], pp_ranks=[0], dp_ranks=[0], mp_ranks=[0])

    @classmethod
    def build(cls, parallel: ParallelConfig, model: ModelConfig, device: str = "auto",
              train: Optional[TrainConfig] = None, deterministic: bool = True) -> "ParallelDims":
        """Validates the layout (before any collective), initialises torch.distributed if needed
        and creates every process group. ``train``: the step's shape (resolve_layout);
        ``deterministic``: train.deterministic (NCCL's environment, determinism.py)."""
        tp, pp, dp = resolve_layout(parallel, model, _env_world_size(), train)
        backend, dev = init_distributed(parallel.backend, device, deterministic=deterministic)
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        # order="tp-dp-pp" is Megatron's default ("tp-cp-ep-dp-pp" with cp = ep = 1).
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)
        dims = cls(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), world_size=dist.get_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   dp_rank=ps.get_data_parallel_rank(), device=dev, backend=backend,
                   stage_layers=split_layers(model.n_layers, pp, parallel.pp_split),
                   tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                   dp_group=ps.get_data_parallel_group(), mp_group=ps.get_model_parallel_group(),
                   embed_group=ps.get_embedding_group(check_initialized=False))
        dims.pp_ranks = dist.get_process_group_ranks(dims.pp_group)
        dims.dp_ranks = dist.get_process_group_ranks(dims.dp_group)
        dims.mp_ranks = sorted(dist.get_process_group_ranks(dims.mp_group))
        assert dims.rank == dims.tp_rank + tp * (dims.dp_rank + dp * dims.pp_rank), "unexpected megatron rank order"
        dims.p2p_groups = _channel_groups(tp, pp, dp, dims.rank, dev)
        log.info("parallel layout: tp=%d pp=%d dp=%d on %d ranks (%s), stage layers %s", tp, pp, dp,
                 dims.world_size, backend, [(r.start, r.stop) for r in dims.stage_layers])
        return dims

    def destroy(self) -> None:
        """Releases the megatron groups and the pipeline channels (the torch.distributed world
        stays up)."""
        if not self.distributed:
            return
        from megatron.core import parallel_state as ps

        # megatron-core's destroy_model_parallel only forgets its groups: each gloo group keeps
        # its threads and sockets (17 groups, ~50 threads per layout at world 2), so a process
        # that builds many layouts (the distributed tests' workers) grows to thousands of
        # threads. Its create_group records every group this rank belongs to (None: the world).
        for group in ps._global_process_group_list or []:
            if group is not None:
                dist.destroy_process_group(group)
        ps.destroy_model_parallel()
        for group in self.p2p_groups.values():
            dist.destroy_process_group(group)
        self.p2p_groups = {}

    # ------------------------------------------------------------------ queries
    @property
    def distributed(self) -> bool:
        """Whether process groups exist (False: the single-process layout)."""
        return self.backend is not None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def layers(self) -> range:
        """The layers of my pipeline stage."""
        return self.stage_layers[self.pp_rank]

    @property
    def mp_rank(self) -> int:
        """Rank in the tp x pp group, unique per model shard (DeepSpeed names its files by it)."""
        return self.pp_rank * self.tp + self.tp_rank

    def mpu(self) -> "DeepSpeedMPU":
        return DeepSpeedMPU(self)

    @property
    def is_replica_source(self) -> bool:
        """The rank that computes what a model replica shares (GRPO's rewards) and reports its
        totals: the lowest rank of the replica."""
        return self.rank == self.mp_ranks[0]

    @property
    def is_loss_rank(self) -> bool:
        """Computes the loss and holds its metrics: TP rank 0 of the stage with the head, so
        tensor-parallel copies are not counted twice."""
        return self.is_last_stage and self.tp_rank == 0

    # ------------------------------------------------------------------ collectives
    # The identity on the single-process layout, so that the code above is one code path.
    def _group(self, axis: str):
        return {"world": None, "dp": self.dp_group, "pp": self.pp_group, "tp": self.tp_group,
                "mp": self.mp_group}[axis]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", axis: str = "world") -> torch.Tensor:
        """In place over the ranks of ``axis`` ("world", "dp", "pp", "tp", "mp"); returns it."""
        if self.distributed:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                                        "max": dist.ReduceOp.MAX}[op], group=self._group(axis))
        return tensor

    def share_in_replica(self, obj: Any) -> Any:
        """The replica source's ``obj`` on every rank of the model replica (picklable)."""
        if not self.distributed or len(self.mp_ranks) == 1:
            return obj
        box = [obj if self.is_replica_source else None]
        dist.broadcast_object_list(box, src=self.mp_ranks[0], group=self.mp_group)
        return box[0]

    def gather_over_dp(self, obj: Any) -> list:
        """Every data-parallel replica's ``obj`` (picklable), in dp-rank order; every rank of
        the dp group calls it (a streamed run's checkpoint holds each replica's position)."""
        if not self.distributed or self.dp == 1:
            return [obj]
        out: list = [None] * self.dp
        dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def sum_over_dp(self, values: list[float]) -> list[float]:
        """Per-replica values (the same on every rank of a replica) summed over replicas."""
        if not self.distributed or self.dp == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    def reduce(self, sums: dict[str, float], mins: Optional[dict[str, float]] = None,
               maxs: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Sums, minima and maxima over the world; every rank passes the same keys (a rank
        without a value passes 0 for a sum, +inf for a minimum, -inf for a maximum)."""
        out: dict[str, float] = {}
        for values, op in ((sums, "sum"), (mins or {}, "min"), (maxs or {}, "max")):
            if not values:
                continue
            keys = sorted(values)
            t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
            out.update(zip(keys, self.all_reduce(t, op).tolist()))
        return out


class DeepSpeedMPU:
    """The ``mpu`` object DeepSpeed asks for, restricted to the methods it calls (docs/engines.md).

    "Model parallel" is the tp x pp group (DeepSpeed sums gradient norms over it and names
    checkpoint shards by its rank); data parallel is the group ZeRO partitions over. It
    deliberately has no ``initialize_sequence_parallel``: when that exists DeepSpeed returns
    None for the data-parallel group.
    """

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims

    def get_data_parallel_group(self):
        return self.dims.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dims.dp

    def get_data_parallel_rank(self) -> int:
        return self.dims.dp_rank

    def get_data_parallel_group_ranks(self) -> list:
        return list(self.dims.dp_ranks)

    def get_model_parallel_group(self):
        return self.dims.mp_group

    def get_model_parallel_world_size(self) -> int:
        return self.dims.tp * self.dims.pp

    def get_model_parallel_rank(self) -> int:
        return self.dims.mp_rank

    def get_tensor_model_parallel_group(self):
        return self.dims.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.dims.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.dims.tp_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.dims.rank - self.dims.tp_rank

    def get_pipeline_model_parallel_group(self):
        return self.dims.pp_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.dims.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.dims.pp_rank
