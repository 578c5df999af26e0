"""``rlt-mega`` with crash-test hooks, so that a test can SIGKILL a real training process at a
chosen point. The hooks live here, in the tests, and are installed by patching the phases of
``CheckpointManager.save`` and the engine's step; the library carries none.

    python tests/crash_driver.py pretrain --config ... [overrides]

Environment:
    RLT_CRASH_PAUSE=<phase>:<step>  stop forever just before ``CheckpointManager.<phase>`` in the
                                    save of <step>: _seal (files written, no manifest yet),
                                    _publish (sealed, not renamed), _point (renamed, ``latest``
                                    not yet moved), _prune
    RLT_CRASH_TORN=1                with _seal: first cut model.safetensors to half its size,
                                    as if the process died while writing it
    RLT_CRASH_MARKER=<path>         written when the pause begins (the test polls for it)
    RLT_CRASH_STEP_SLEEP=<seconds>  sleep after every optimizer step, so that a kill at a random
                                    moment lands in the middle of the run on any machine
    RLT_CRASH_KILL=<rank>:<step>    under a launcher: that rank SIGKILLs itself as it fetches the
                                    batches of <step>, in the first attempt only (torchrun's
                                    TORCHELASTIC_RESTART_COUNT=0), while the other ranks go on
                                    into the step's collectives
    RLT_CRASH_GRPO_KILL=<rank>:<n>  ``grpo``: that rank SIGKILLs itself as it begins its n-th
                                    learner step (``GRPOJob.step``) or, on a sampler role, its
                                    n-th data step (``SamplePhase.sample``), counted from the
                                    step the run starts or resumes at
    RLT_CRASH_CHUNK_SLEEP=<seconds> ``preprocess``: sleep after writing every chunk of documents,
                                    so that a kill lands in the middle of the job
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlt_mega.checkpoint import CheckpointManager  # noqa: E402
from rlt_mega.cli import main  # noqa: E402
from rlt_mega.parallel.engine import LocalEngine  # noqa: E402
from rlt_mega.data.pretraining import PackedBatches  # noqa: E402


def _pause_forever() -> None:
    Path(os.environ["RLT_CRASH_MARKER"]).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


def install_pause(phase: str, step: int, torn: bool) -> None:
    original_save, original_phase = CheckpointManager.save, getattr(CheckpointManager, phase)

    def save(self, save_step, write, meta=None):
        self.crash_step = save_step
        return original_save(self, save_step, write, meta)

    def paused(self, *args, **kwargs):
        if self.crash_step == step:
            if torn:
                model = args[0] / "model.safetensors"  # _seal(tmp, step, meta)
                model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
            _pause_forever()
        return original_phase(self, *args, **kwargs)

    CheckpointManager.save = save
    setattr(CheckpointManager, phase, paused)


def install_step_sleep(seconds: float) -> None:
    original = LocalEngine.train_step

    def train_step(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        time.sleep(seconds)
        return stats

    LocalEngine.train_step = train_step


def install_chunk_sleep(seconds: float) -> None:
    from rlt_mega.data.indexed import IndexedWriter

    original = IndexedWriter.add

    def add(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.builder.data_file.flush()  # the partial file grows on disk as the job goes
        time.sleep(seconds)

    IndexedWriter.add = add


def install_rank_kill(rank: int, step: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    original = PackedBatches.next_batches
    fetched = [0]

    def next_batches(self):
        fetched[0] += 1  # counts from the step the run starts (or resumes) at
        if fetched[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    PackedBatches.next_batches = next_batches


def install_grpo_kill(rank: int, n: int) -> None:
    from rlt_mega.train.grpo import GRPOJob
    from rlt_mega.train.grpo_sample import SamplePhase

    if int(os.environ.get("RANK", "0")) != rank:
        return
    calls = [0]

    def killing(original):
        def method(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)
        return method

    GRPOJob.step, SamplePhase.sample = killing(GRPOJob.step), killing(SamplePhase.sample)


if __name__ == "__main__":
    if os.environ.get("RLT_CRASH_PAUSE"):
        phase, step = os.environ["RLT_CRASH_PAUSE"].split(":")
        install_pause(phase, int(step), torn=os.environ.get("RLT_CRASH_TORN") == "1")
    if os.environ.get("RLT_CRASH_STEP_SLEEP"):
        install_step_sleep(float(os.environ["RLT_CRASH_STEP_SLEEP"]))
    if os.environ.get("RLT_CRASH_CHUNK_SLEEP"):
        install_chunk_sleep(float(os.environ["RLT_CRASH_CHUNK_SLEEP"]))
    if os.environ.get("RLT_CRASH_KILL"):
        rank, step = os.environ["RLT_CRASH_KILL"].split(":")
        install_rank_kill(int(rank), int(step))
    if os.environ.get("RLT_CRASH_GRPO_KILL"):
        rank, n = os.environ["RLT_CRASH_GRPO_KILL"].split(":")
        install_grpo_kill(int(rank), int(n))
    sys.exit(main(sys.argv[1:]))
