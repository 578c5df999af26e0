from setuptools import find_packages, setup

setup(
    name="rlt_mega",
    version="0.1.0",
    description="Trainer for Recurrent Looped Transformers: pretraining, SFT and GRPO "
    "with tensor/pipeline/ZeRO parallelism and exact learner log-probabilities.",
    packages=find_packages(include=["rlt_mega", "rlt_mega.*"]),
    # the modeling code every export carries (copied, never imported by rlt_mega)
    package_data={"rlt_mega.checkpoint_tools": ["hf_code/*.py"]},
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first and pinned by launch/env.sh; this range is one that
        # 2.13.0 satisfies, so pip never replaces it.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "deepspeed==0.19.8",
        "datasets>=2.18",
        "tensorboard>=2.14",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "huggingface_hub>=0.23",  # split_torch_state_dict_into_shards / save_torch_state_dict (exports)
        "tokenizers>=0.15",
        "tqdm>=4.66",
        "numpy>=1.24",
    ],
    extras_require={
        "test": [
            # 5: the tests build HF models with rope_parameters; the exports' modeling code
            # (checkpoint_tools/hf_code) itself was also checked by hand with 4.57
            "transformers>=5.0",
            "lm_eval[hf]>=0.4.13",  # lm-evaluation-harness and its HF model class (accelerate, peft)
            "peft>=0.17",  # tests/e2e/test_lora_cli.py loads `rlt-mega export --adapters` with peft (0.21.2 installed)
            "wandb>=0.31",  # logging.wandb; its offline runs are read back by tests/e2e/test_wandb.py
            "pytest>=8.0,<9.2",  # 9.2 keeps node ids where pytest-xdist 3.8 cannot add its groups (loadgroup)
            "pytest-timeout>=2.2",
            "pytest-xdist>=3.5",  # launch/test.sh runs the suite on two workers (tests/conftest.py: the groups)
            "hypothesis>=6.100",
            "matplotlib>=3.7",
            # the documentation site (mkdocs.yml), built with --strict by tests/unit/test_docs.py
            "mkdocs>=1.6,<2",
            "mkdocs-material>=9.5,<10",
            "mkdocstrings[python]>=0.26,<2",
        ],
    },
    entry_points={"console_scripts": ["rlt-mega=rlt_mega.cli:main"]},
)
