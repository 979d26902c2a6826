"""Installs the sglang-morph plugin and registers it with SGLang's plugin loader.

The CPU kernel package lives in sgl-kernel/ and is installed separately (only on machines
without the real, CUDA-built sglang-kernel); see scripts/setup.sh.
"""

from setuptools import find_packages, setup

setup(
    name="sglang-morph",
    version="0.1.0",
    description="Elastic, workload-aware serving for SGLang: runtime layer swapping and KV resizing",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.10",
    # click, rich and httpx: the operator command; filelock and tqdm: the morph auto-build.
    install_requires=["sglang==0.5.23", "click>=8", "rich>=13", "httpx", "filelock", "tqdm"],
    entry_points={
        "sglang.srt.plugins": ["morph = sglang_morph.plugin:load"],
        "console_scripts": ["sglang-morph = sglang_morph.console.main:main"],
    },
)
