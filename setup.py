"""rfa_fairseq: Random Feature Attention for fairseq.

Install the stack first (scripts/setup_env.sh does it: torch, then fairseq-fixed without
build isolation), then this package with ``pip install --no-deps -e .``. The package declares
no hard requirements on purpose: resolving fairseq-fixed's metadata would pull torchaudio and
replace an installed (for example CUDA) torch.
"""
from setuptools import find_packages, setup

setup(
    name="rfa_fairseq",
    version="0.1.0",
    description="Random Feature Attention (RFA, RFA-Gate) for fairseq: linear-time attention and "
                "constant-memory incremental decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["rfa_fairseq", "rfa_fairseq.*"]),
    package_data={"rfa_fairseq.ops.causal_rfa": ["fused_step.cpp"]},  # compiled on first use (ops/causal_rfa/fused.py)
    entry_points={
        "console_scripts": [
            "rfa-convert-from-softmax = rfa_fairseq.cli.convert_from_softmax:main",
            "rfa-redraw-features = rfa_fairseq.cli.redraw_features:main",
            "rfa-diagnostics = rfa_fairseq.cli.diagnostics:main",
            "rfa-average-checkpoints = rfa_fairseq.cli.average_checkpoints:main",
            "rfa-translate-documents = rfa_fairseq.cli.translate_documents:main",
        ],
    },
    python_requires=">=3.11",
    install_requires=[],
    extras_require={
        "stack": ["torch>=2.4", "fairseq-fixed==0.12.3.1", "hydra-core==1.3.2", "omegaconf==2.3.0",
                  "sacrebleu", "sacremoses", "sentencepiece", "ninja"],
        "test": ["pytest", "pytest-xdist", "hypothesis"],
        "bench": ["ctranslate2==4.8.5"],  # bench/decode.py's CTranslate2 models (scripts/setup_env.sh installs it)
        # --rfa-backend fla: flash-linear-attention's kernels; triton 3.7.1 is torch 2.13's (scripts/setup_env.sh
        # installs both, keeping a triton that came with an installed CUDA torch)
        "gpu": ["fla-core==0.6.0", "triton==3.7.1"],
    },
    license="MIT",
)
