"""`rlt-mega sft` under torchrun: two data-parallel ranks (ZeRO-1) read disjoint halves of each
global batch and follow the single-process run on the combined batch; a pipeline-parallel run
(fixed-length padded pairs) trains and exports."""

from rlt_mega import cli
from rlt_mega.metrics import read_metrics

from helpers import launched

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.n_layers=2",
        "model.memory_block=2", "model.max_seq_len=160", "data.seq_len=128", "data.generated.num_train=64",
        "data.generated.num_eval=4", "train.eval_every=0", "train.log_every=1", "logging.progress=false",
        "optim.warmup_steps=0", "optim.lr=3e-3", "train.steps=3", "checkpoint.every=0"]


def sft_args(tmp_path, name, *overrides):
    return ["sft", *TINY, f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.dir={tmp_path / name / 'tb'}",
            *overrides]


def torchrun(tmp_path, name, nproc, *overrides):
    launched(nproc, sft_args(tmp_path, name, *overrides))


def losses(tmp_path, name):
    return [r["train/loss"] for r in read_metrics(tmp_path / name / "tb") if "train/loss" in r]


def test_data_parallel_sft_follows_the_single_process_run(tmp_path):
    torchrun(tmp_path, "dp", 2, "parallel.zero_stage=1", "train.micro_batch_size=2")
    assert cli.main(sft_args(tmp_path, "single", "train.micro_batch_size=4")) == 0
    dp, single = losses(tmp_path, "dp"), losses(tmp_path, "single")
    assert len(dp) == len(single) == 3
    # The same rows and the same global token normalisation; only summation order differs.
    for a, b in zip(dp, single):
        assert abs(a - b) <= 1e-4 * abs(b), (dp, single)


def test_pipeline_parallel_sft_trains_and_exports(tmp_path):
    torchrun(tmp_path, "pp", 2, "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero_stage=1",
             "train.micro_batch_size=4")
    pp = losses(tmp_path, "pp")
    assert len(pp) == 3 and pp[-1] < pp[0]
    assert cli.main(["export", str(tmp_path / "pp" / "ckpt"), str(tmp_path / "export")]) == 0
